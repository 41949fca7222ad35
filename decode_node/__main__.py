"""`python -m decode_node --model M --port P [--coordinator HOST:PORT] [--role decode|colocated]
[--kv-dtype fp32|bf16]`"""

from __future__ import annotations

import asyncio
import os
import sys

import torch

from decode_node.server import DecodeServicer
from decode_node.worker import DecodeWorker
from common.errors import TandemError
from engine.llm_engine import KV_TORCH_DTYPES
from common.model_identity import model_fingerprint
from engine.model_runner import kv_cache_bytes_per_block
from worker.node_server import (
    NodeIdentity,
    build_engine,
    kv_counters,
    kv_layout,
    new_worker_id,
    node_main,
    resolve_model,
    run_node,
    worker_status,
)
from common.rpc import worker_pb2_grpc as pb_grpc
from kvtransfer.auth import kv_auth_from


def kv_endpoint_spec(backend: str, host: str, port: int) -> dict:
    if backend in ("zmq", "dist"):  # dist: its control channel is zmq's
        return {"endpoint": f"tcp://{host}:{port or '*'}"}
    if backend == "grpc":
        return {"endpoint": f"{host}:{port}"}
    return {}


async def main_async(args) -> None:
    import kvtransfer
    from common.model_files import load_config

    path = resolve_model(args.model)
    config = load_config(path)
    fingerprint = model_fingerprint(path, config)
    worker_id = args.worker_id or new_worker_id(args.role)
    # The cache lives in the KV receiver's buffer (shared memory for the shm backend), so the
    # layout (--kv-dtype included) is fixed first and the engine is built around that tensor;
    # the engine checks that the tensor's dtype is its --kv-dtype.
    num_blocks = args.num_blocks or max(1, int(args.kv_cache_gb * (1 << 30)) //
                                        kv_cache_bytes_per_block(config, args.block_size,
                                                                 KV_TORCH_DTYPES[args.kv_dtype]))
    layout = kv_layout(config, args.block_size, args.kv_dtype, fingerprint)
    shm_name = f"tandem-kv-{worker_id}-{os.getpid()}" if args.kv_backend == "shm" else None
    if args.device == "cpu":  # node_main resolved --device
        cache = kvtransfer.allocate_cache(layout, num_blocks, shared_memory_name=shm_name)
    elif args.kv_backend != "shm":
        # Every other receiver copies each validated payload into the cache wherever it lives
        # (zmq and grpc from host frames, dist from its group, NCCL between two GPUs).
        cache = kvtransfer.KVCacheBuffer(layout, num_blocks, torch.zeros(
            layout.cache_shape(num_blocks), dtype=layout.torch_dtype, device=args.device))
    else:
        raise TandemError(f"a decode worker on {args.device} cannot use --kv-backend shm: its "
                          f"senders write a host shared-memory pool; use dist, zmq or grpc")
    advertise = args.advertise_host or args.host
    kv_auth = kv_auth_from(args.cluster_auth)  # with a cluster secret: CURVE and per-transfer tokens
    receiver = kvtransfer.create_receiver(args.kv_backend, cache, layout,
                                          **kv_endpoint_spec(args.kv_backend, args.host, args.kv_port),
                                          **({"auth": kv_auth} if kv_auth else {}))
    engine = build_engine(args, path, kv_cache=cache.tensor, num_blocks=num_blocks)
    loop = asyncio.get_running_loop()
    endpoint = args.kv_advertise or receiver.endpoint.replace("0.0.0.0", advertise)
    worker = DecodeWorker(engine, loop, receiver, kv_backend=args.kv_backend, kv_endpoint=endpoint,
                          kv_deadline_s=args.kv_deadline)
    worker.start()

    def status():
        return worker_status(worker_id, args.role, worker,
                             kv_counters(args.kv_backend, [receiver.stats()], sending=False),
                             args.cluster_auth)

    identity = NodeIdentity(worker_id, args.role, f"{advertise}:{args.port}", endpoint, args.kv_backend,
                            fingerprint, layout.description)

    def stop() -> None:
        worker.stop()
        receiver.close()
        cache.close()

    await run_node(args, "tandem.worker.DecodeWorker",
                   lambda server: pb_grpc.add_DecodeWorkerServicer_to_server(DecodeServicer(worker, status), server),
                   identity, status, worker, on_stop=stop)


def main(argv: list[str] | None = None) -> int:
    return node_main("decode_node", ("decode", "colocated"), main_async, argv)


if __name__ == "__main__":
    sys.exit(main())
