"""`python -m decode_node --model M --port P [--coordinator HOST:PORT] [--role decode|colocated]
[--kv-dtype fp32|bf16]`"""

from __future__ import annotations

import asyncio
import logging
import sys
from dataclasses import replace

import torch

from decode_node.server import DecodeServicer
from decode_node.worker import DecodeWorker
from common.errors import TandemError
from common.shm_segments import reclaim_orphans, segment_name
from engine.kv_cache_sizing import sized_cache
from common.model_identity import model_fingerprint
from worker.node_server import (
    NodeIdentity,
    build_engine,
    kv_counters,
    kv_layout,
    new_worker_id,
    node_main,
    open_core_share,
    resolve_model,
    run_node,
    worker_status,
)
from common.rpc import worker_pb2_grpc as pb_grpc
from kvtransfer.auth import kv_auth_from
from worker.config import WorkerConfig

log = logging.getLogger("tandem.decode")


def kv_endpoint_spec(backend: str, host: str, port: int, advertised: str | None = None) -> dict:
    if backend == "dist" and host in ("0.0.0.0", "::", "*"):
        # dist's store and gloo bind one interface (never every one): the advertised one.
        if not advertised or advertised in ("0.0.0.0", "::", "*"):
            raise TandemError("--kv-backend dist with a wildcard --host needs --advertise-host "
                              "(the interface its unauthenticated store and gloo bind)")
        host = advertised
    if backend in ("zmq", "dist"):  # dist: its control channel is zmq's
        return {"endpoint": f"tcp://{host}:{port or '*'}"}
    if backend == "grpc":
        return {"endpoint": f"{host}:{port}"}
    return {}


async def main_async(config: WorkerConfig) -> None:
    import kvtransfer
    from common.model_files import load_config

    path = resolve_model(config.model)
    model = load_config(path)
    fingerprint = model_fingerprint(path, model)
    worker_id = config.worker_id or new_worker_id(config.role)
    # The cache lives in the KV receiver's buffer (shared memory for the shm backend), so the
    # layout (--kv-dtype included) is fixed first and the engine is built around that tensor;
    # the engine checks that the tensor's dtype is its --kv-dtype.
    sized = replace(config.engine, cache=sized_cache(config.engine.cache, model))
    num_blocks = sized.cache.num_blocks
    layout = kv_layout(model, sized.cache.block_size, sized.cache.kv_dtype, fingerprint)
    shm_name = None
    if config.kv_backend == "shm":
        shm_name = segment_name(worker_id)
        reclaimed = reclaim_orphans()  # pools of workers that died without closing them
        if reclaimed:
            log.info("reclaimed shared-memory segments of gone processes: %s", ", ".join(reclaimed))
    device = config.engine.device  # resolved by WorkerConfig.from_args
    if device == "cpu":
        try:
            cache = kvtransfer.allocate_cache(layout, num_blocks, shared_memory_name=shm_name)
        except kvtransfer.KVTransferError as e:  # no room in /dev/shm: the reason, no traceback
            raise TandemError(str(e)) from None
    elif config.kv_backend != "shm":
        # Every other receiver copies each validated payload into the cache wherever it lives
        # (zmq and grpc from host frames, dist from its group, NCCL between two GPUs).
        cache = kvtransfer.KVCacheBuffer(layout, num_blocks, torch.zeros(
            layout.cache_shape(num_blocks), dtype=layout.torch_dtype, device=device))
    else:
        raise TandemError(f"a decode worker on {device} cannot use --kv-backend shm: its "
                          f"senders write a host shared-memory pool; use dist, zmq or grpc")
    if config.kv_backend == "dist" and config.insecure_dist:
        log.warning("WARNING: --insecure-dist: the dist KV backend's TCPStore and gloo sockets "
                    "on %s are not authenticated; a peer that reaches them can end this worker",
                    config.advertised)
    kv_auth = kv_auth_from(config.cluster_auth)  # with a cluster secret: CURVE and per-transfer tokens
    receiver = kvtransfer.create_receiver(config.kv_backend, cache, layout,
                                          **kv_endpoint_spec(config.kv_backend, config.host, config.kv_port,
                                                             config.advertised),
                                          **({"auth": kv_auth} if kv_auth else {}))
    cores = open_core_share(config)
    engine = build_engine(config, path, sized, kv_cache=cache.tensor, cores=cores)
    loop = asyncio.get_running_loop()
    endpoint = config.kv_advertise or receiver.endpoint.replace("0.0.0.0", config.advertised)
    worker = DecodeWorker(engine, loop, receiver, kv_backend=config.kv_backend, kv_endpoint=endpoint,
                          kv_deadline_s=config.kv_deadline_s)
    worker.cores = cores
    worker.start()

    def status():
        return worker_status(worker_id, config.role, worker,
                             kv_counters(config.kv_backend, [receiver.stats()], sending=False),
                             config.cluster_auth)

    identity = NodeIdentity(worker_id, config.role, f"{config.advertised}:{config.port}", endpoint,
                            config.kv_backend, fingerprint, layout.description)

    def stop() -> None:
        worker.stop()
        receiver.close()
        cache.close()
        if cores is not None:
            cores.close()

    await run_node(config, "tandem.worker.DecodeWorker",
                   lambda server: pb_grpc.add_DecodeWorkerServicer_to_server(DecodeServicer(worker, status), server),
                   identity, status, worker, on_stop=stop)


def main(argv: list[str] | None = None) -> int:
    return node_main("decode_node", ("decode", "colocated"), main_async, argv)


if __name__ == "__main__":
    sys.exit(main())
