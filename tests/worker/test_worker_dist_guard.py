"""`--kv-backend dist` off loopback needs `--insecure-dist` (worker/config.py): its TCPStore
and gloo sockets have no authentication, a cluster secret or not."""

from __future__ import annotations

import pytest

from worker.config import WorkerConfig
from worker.flags import worker_arg_parser


def _config(*argv: str) -> WorkerConfig:
    parser = worker_arg_parser("decode_node", ("decode",))
    return WorkerConfig.from_args(parser.parse_args(["--model", "m", "--port", "1", *argv]))


@pytest.mark.parametrize("argv", [["--host", "0.0.0.0"], ["--host", "10.1.2.3"],
                                  ["--advertise-host", "gpu-a"]])
def test_dist_off_loopback_is_refused_without_the_flag(argv):
    with pytest.raises(ValueError, match="needs --insecure-dist"):
        _config("--kv-backend", "dist", *argv)
    assert _config("--kv-backend", "dist", "--insecure-dist", *argv).insecure_dist
    assert _config("--kv-backend", "zmq", *argv).kv_backend == "zmq"  # the others authenticate


def test_dist_on_loopback_needs_no_flag():
    assert not _config("--kv-backend", "dist").insecure_dist
    assert _config("--kv-backend", "dist", "--host", "127.0.0.1").host == "127.0.0.1"


def test_decode_node_binds_dist_to_the_advertised_interface():
    from common.errors import TandemError
    from decode_node.__main__ import kv_endpoint_spec

    assert kv_endpoint_spec("dist", "0.0.0.0", 0, "10.0.0.2") == {"endpoint": "tcp://10.0.0.2:*"}
    assert kv_endpoint_spec("zmq", "0.0.0.0", 5, "10.0.0.2") == {"endpoint": "tcp://0.0.0.0:5"}
    with pytest.raises(TandemError, match="needs --advertise-host"):
        kv_endpoint_spec("dist", "0.0.0.0", 0, "0.0.0.0")
