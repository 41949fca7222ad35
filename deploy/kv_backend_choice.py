"""`tandem serve --kv-backend auto` (its default): which KV transfer its workers use.

Every worker `tandem serve` starts is on this host, so the prefill workers can write the KV
straight into the decode workers' pools in shared memory (kvtransfer/shm_backend.py): one
streamed copy with its crc32c, nothing for the decode worker's core to do. Over zmq the same
bytes cross loopback TCP, and the decode worker's process copies them again into its pool,
on the core its decode steps run on. Measured on a 2-core host (README, Stop 45: 8 clients,
235-token prompts, two A/B pairs of `benchmarks.bench_peer`), shm against zmq: ITL p99 34.7
and 32.5 ms against 56.2 and 36.9, TPOT p50 17.6 and 15.8 against 18.8 and 18.5, output
tok/s within 5% either way; with another process busy on the host, ITL p99 45 and 39 ms
against 218 and 152, and ~20% more output. So auto is shm wherever it can work, else zmq:

    shm   the workers compute on the CPU (a CUDA cache is not host memory), the topology
          moves KV at all (not --colocated), every model's workers start now (not
          --load-on-request: a model loaded later would need room nobody counted), and
          /dev/shm has room for every decode worker's pool after the orphans of dead
          workers are reclaimed (a container's /dev/shm is 64 MiB unless given more; a pool
          that does not fit fails its worker with that reason, kvtransfer/layout.py)
    zmq   otherwise, with the reason logged

`tandem launch` keeps the explicit backends: its workers may be on other hosts.
"""

from __future__ import annotations

from pathlib import Path

from common import shm_segments
from common.model_files import load_config
from deploy.local_topology import Topology
from engine.config import CacheConfig
from engine.kv_cache_sizing import KV_TORCH_DTYPES
from engine.model_runner import kv_cache_bytes_per_block

# Beside the pools: each pool's owner table, and room for what else the host keeps there.
SHM_SLACK_BYTES = 64 << 20


def pool_bytes(model_path: Path, num_blocks: int | None, kv_dtype: str) -> int:
    """The most a decode worker's KV pool of this model takes: `num_blocks` blocks, or at most
    the byte budget the worker sizes it by (CacheConfig.kv_cache_bytes, 1 GiB)."""
    cache = CacheConfig(kv_dtype=kv_dtype)
    if num_blocks is None:
        return cache.kv_cache_bytes
    per_block = kv_cache_bytes_per_block(load_config(model_path), cache.block_size,
                                         KV_TORCH_DTYPES[kv_dtype])
    return num_blocks * per_block


def choose(topology: Topology, device_type: str, shm_free: int | None = None) -> tuple[str, str]:
    """(backend, why) for a topology whose workers all run on this host. shm_free: /dev/shm's
    free bytes (default: read now)."""
    if topology.colocated:
        return "zmq", "colocated workers move no KV between them"
    if device_type != "cpu":
        return "zmq", f"the workers compute on {device_type}, and shm needs a KV cache in host memory"
    if topology.load_on_request:
        return "zmq", ("models loaded on request start workers later, whose KV pools in "
                       f"{shm_segments.SHM_DIR} nobody can count now")
    pools = sum(topology.counts(i)[1] * pool_bytes(path, topology.num_blocks, topology.kv_dtype)
                for i, (_, path) in enumerate(topology.models))
    if shm_free is None:
        shm_segments.reclaim_orphans()  # pools of workers that died without closing them
        shm_free = shm_segments.free_bytes()
    if shm_free is None:
        return "zmq", f"this host has no {shm_segments.SHM_DIR}"
    up, down = (lambda n: f"{-(-n // 2**20):,} MiB"), (lambda n: f"{n // 2**20:,} MiB")  # noqa: E731
    if pools + SHM_SLACK_BYTES > shm_free:
        return "zmq", (f"{shm_segments.SHM_DIR} has {down(shm_free)} free, the decode workers' KV "
                       f"pools need {up(pools)} and {up(SHM_SLACK_BYTES)} to spare (more shared "
                       "memory, or --num-blocks, allows shm)")
    return "shm", (f"every worker is on this host and the decode workers' KV pools ({up(pools)}) "
                   f"fit {shm_segments.SHM_DIR} ({down(shm_free)} free)")
