"""`python -m prefill_node --model M --port P [--coordinator HOST:PORT] [--kv-backend zmq]
[--kv-dtype fp32|bf16]`"""

from __future__ import annotations

import asyncio
import sys

from engine.kv_cache_sizing import kv_dtype_name
from common.model_identity import model_fingerprint
from worker.node_server import (
    NodeIdentity,
    build_engine,
    kv_counters,
    open_core_share,
    kv_layout,
    new_worker_id,
    node_main,
    resolve_model,
    run_node,
    worker_status,
)
from common.rpc import worker_pb2_grpc as pb_grpc
from worker.config import WorkerConfig
from kvtransfer.auth import kv_auth_from
from prefill_node.senders import SenderPool
from prefill_node.server import PrefillServicer
from prefill_node.worker import PrefillWorker


async def main_async(config: WorkerConfig) -> None:
    path = resolve_model(config.model)
    cores = open_core_share(config)
    engine = build_engine(config, path, cores=cores)
    model = engine.config.model
    fingerprint = model_fingerprint(path, model)
    # From the cache the engine actually allocated: the sender refuses payloads whose dtype is
    # not the layout's, and the decode worker's layout must match it.
    layout = kv_layout(model, engine.config.cache.block_size,
                       kv_dtype_name(engine.runner.kv_cache.dtype), fingerprint)
    worker_id = config.worker_id or new_worker_id("prefill")
    worker = PrefillWorker(engine, asyncio.get_running_loop())
    worker.cores = cores
    worker.start()
    senders = SenderPool(layout, auth=kv_auth_from(config.cluster_auth))

    def status():
        return worker_status(worker_id, "prefill", worker,
                             kv_counters(config.kv_backend, senders.stats(), sending=True),
                             config.cluster_auth)

    identity = NodeIdentity(worker_id, "prefill", f"{config.advertised}:{config.port}", "",
                            config.kv_backend, fingerprint, layout.description)

    def stop() -> None:
        worker.stop()
        senders.close()
        if cores is not None:
            cores.close()

    await run_node(config, "tandem.worker.PrefillWorker",
                   lambda server: pb_grpc.add_PrefillWorkerServicer_to_server(
                       PrefillServicer(worker, senders, status), server),
                   identity, status, worker, on_stop=stop)


def main(argv: list[str] | None = None) -> int:
    return node_main("prefill_node", ("prefill",), main_async, argv)


if __name__ == "__main__":
    sys.exit(main())
