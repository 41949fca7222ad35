"""The stateless 2-rank torch.distributed process group of one (sender, receiver) pair.

No global init_process_group: a decode worker's receiver talks to many prefill workers that
come and go, so (as vLLM's StatelessProcessGroup does) every pair gets a group of its own,
built straight from the backend class over a store:

    receiver: TCPStore(is_master=True, port=0)   one per receiver, bound to its interface
                                                 (never 0.0.0.0), port in the pair reply
    pair:     PrefixStore("tandem-kv/<pair key>", store)   keys of different pairs never meet;
              the key is random per pair, drawn by the receiver, sent only over the control
              channel (CURVE with a cluster secret)
              receiver = rank 0, sender = rank 1, world size 2
    group:    ProcessGroupNCCL between GPUs, ProcessGroupGloo otherwise (group_backend); the
              callers use the same send/recv calls on either, only the class (and options) differ

Construction is a rendezvous: each rank blocks until the other has joined (or the timeout).
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, Store, TCPStore

RECEIVER_RANK, SENDER_RANK = 0, 1
TAG = 0  # one stream per pair: units are matched in posting order


def device_uuid(device: torch.device | None = None) -> str:
    """The identity of this process's current GPU ("" without one): NCCL refuses a pair whose
    two ranks sit on the same GPU, so the receiver must know whether the sender shares its own."""
    if not torch.cuda.is_available():
        return ""
    index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    return str(torch.cuda.get_device_properties(index).uuid)


def group_backend(cache_device: torch.device, sender_gpu: str, receiver_gpu: str = "") -> str:
    """The group class of a pair, picked by the receiver: NCCL between two different GPUs (the
    receiver's cache on one, the sender with another to gather its payloads on), else gloo,
    whose CPU payloads the receiver copies into its cache wherever that is (a CPU prefill
    worker feeding a GPU decode worker, or both roles sharing one GPU, which NCCL refuses)."""
    distinct = bool(sender_gpu) and sender_gpu != receiver_gpu
    return "nccl" if cache_device.type == "cuda" and distinct else "gloo"


def host_store(host: str, timeout_s: float) -> TCPStore:
    """The receiver's store, on a free port (TCPStore.port); senders connect as clients."""
    return TCPStore(host, 0, None, True, timedelta(seconds=timeout_s), wait_for_workers=False)


def join_store(host: str, port: int, timeout_s: float) -> TCPStore:
    return TCPStore(host, port, None, False, timedelta(seconds=timeout_s))


def pair_group(store: Store, pair_key: str, rank: int, backend: str, host: str, timeout_s: float) -> Any:
    """This side's half of the pair's group; blocks until the other side joined.

    `pair_key`: the pair's namespace in the store (the receiver's random per-pair key).

    `host`: the local address gloo binds and advertises to the peer (the interface that
    reaches it); "" = gloo's default (the hostname's address, or $GLOO_SOCKET_IFNAME)."""
    prefix = PrefixStore(f"tandem-kv/{pair_key}", store)
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        options = ProcessGroupGloo._Options()
        options._devices = [ProcessGroupGloo.create_device(hostname=host) if host
                            else ProcessGroupGloo.create_default_device()]
        options._timeout = timeout
        return ProcessGroupGloo(prefix, rank, 2, options)
    if backend == "nccl":
        from torch.distributed import ProcessGroupNCCL  # absent from CPU-only builds

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        return ProcessGroupNCCL(prefix, rank, 2, options)
    raise ValueError(f"unknown process group backend {backend!r}")


def local_address_towards(host: str) -> str:
    """The address of the interface this host uses to reach `host` (no packet is sent)."""
    if host in ("", "localhost") or host.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((socket.gethostbyname(host), 9))
            return s.getsockname()[0]
        except OSError:
            return ""


def endpoint_host(endpoint: str) -> str:
    """The host of a zmq endpoint: "tcp://HOST:PORT" -> HOST; ipc (same host) -> 127.0.0.1."""
    if endpoint.startswith("tcp://"):
        host = endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
        return "127.0.0.1" if host in ("*", "0.0.0.0", "") else host
    return "127.0.0.1"
