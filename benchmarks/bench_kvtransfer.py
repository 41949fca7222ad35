"""Transfer throughput per backend, next to a plain memory copy measured in the same run.

    python -m benchmarks.bench_kvtransfer [--backends zmq shm shm-sverify shm-rverify grpc dist] [--tokens 128 512 2048] [--reps 3]

Layout: SmolLM2-135M's KV (30 layers x 3 KV heads x 64 dims, block 16, fp32). One "request"
is a prompt of N tokens sent layer by layer out of a source cache (30 units of N/16 blocks
each, then finish), timed from the first send() to DONE (the grant, every layer and the finish
acknowledged by the receiver, i.e. written and checksummed). The receiver expects the transfer
before the first send, as a decode worker that reserved its blocks would.
The receiver runs in a separate spawned process; the sender here. GB/s = request bytes / time;
the best of --reps runs is reported. The baseline copies the same bytes with torch in this
process (a row of its own, and beside each backend: timed right before each of its runs, so
the ratio compares runs under the same load on a shared host): the ceiling no transport on
this machine can beat. Before every timed run (copy or transfer) the last-level cache is
evicted (a write of twice its size), so each run reads its source from memory: on a host whose
last-level cache holds the 90 MiB (this kind lists 480 MiB) a copy otherwise ran at 6.8 or
13 GB/s depending on what the run before had touched, and the ratios with it.

shm is the default (ShmReceiver(verify="copy")): the writer computes the crc32c in its copy
loop and streams its stores past the cache, and nobody reads the bytes again; shm-sverify has
the writer compare each 24 KiB chunk with its source right after its copy, both in cache
(verify="sender"); shm-rverify has the receiver crc32c the blocks in place before it acks each
unit (verify="receiver", the writer streaming), a third pass over the bytes on the other core
that shares the host's memory bandwidth with the copy (kvtransfer/shm_backend.py). Small
prompts also pay the grant round trip, the finish ack and tens of microseconds of Python per
unit. The copy+crc32c rows are shm's byte path without the protocol: the native kernel
(kernels/copy_crc32c.py) once per layer, in process, streaming (as the default) and with the
read-back (as shm-sverify).
The zmq-raw row is the transport's own ceiling on this host: the same bytes pushed as 8 MiB
messages over loopback TCP to a spawned process that only receives them (no checksum, no
header, no write into a cache), timed like a transfer.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time

import torch

import kvtransfer as kt
from kernels.copy_crc32c import copy_crc32c
from kernels.layout_choice import last_level_cache_bytes

LAYOUT = kt.KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32",
                     model_id="HuggingFaceTB/SmolLM2-135M-Instruct")


_EVICT: list[torch.Tensor] = []


def _evict_caches() -> None:
    """Write twice the last-level cache's size, so what a timed run reads comes from memory."""
    if not _EVICT:
        _EVICT.append(torch.empty(2 * last_level_cache_bytes() // 4, dtype=torch.float32))
    _EVICT[0].fill_(1.0)


# bench name -> (backend, receiver options)
VARIANTS = {"shm-sverify": ("shm", {"verify": "sender"}), "shm-rverify": ("shm", {"verify": "receiver"})}


def _receiver(conn, name: str, num_blocks: int, shm_name: str) -> None:
    torch.set_num_threads(1)
    backend, options = VARIANTS.get(name, (name, {}))
    cache = kt.allocate_cache(LAYOUT, num_blocks, shm_name if backend == "shm" else None)
    receiver = kt.create_receiver(backend, cache, LAYOUT, **options)
    conn.send(receiver.endpoint)
    try:
        while (msg := conn.recv()) is not None:
            if msg == "cpu":
                conn.send(time.process_time())
                continue
            rid, blocks = msg
            receiver.poll()  # drop the previous request's event
            receiver.expect(rid, blocks, LAYOUT.num_layers, deadline_s=60.0)
            conn.send(time.process_time())  # this process's CPU so far (every thread)
    finally:
        receiver.close()
        cache.close()


def _bench_backend(backend: str, tokens: list[int], reps: int) -> tuple[dict[int, float], ...]:
    """(transfer GB/s, torch copy GB/s, transfer GB per CPU-second) per prompt size: a copy of
    the same bytes is timed right before every transfer run, so a noisy host slows both alike;
    the CPU figure is the request's bytes over the CPU time both processes spent on it (every
    thread; the receiver's counted up to its next expect), which time slicing on a busy host
    does not inflate."""
    num_blocks = max(tokens) // LAYOUT.block_size
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child, backend, num_blocks, f"tkvbench-{os.getpid()}"), daemon=True)
    proc.start()
    results: dict[int, float] = {}
    copies: dict[int, float] = {}
    per_cpu: dict[int, float] = {}
    try:
        if not conn.poll(60):
            raise RuntimeError(f"{backend} receiver did not start")
        sender = kt.create_sender(VARIANTS.get(backend, (backend,))[0], ack_timeout_s=60.0)
        sender.connect(conn.recv(), LAYOUT)
        for n_tokens in tokens:
            blocks = list(range(n_tokens // LAYOUT.block_size))
            source = torch.randn(LAYOUT.cache_shape(len(blocks)))  # the prefill worker's cache
            nbytes = source.numel() * source.element_size()
            copy_src, copy_dst = torch.randn(source.shape), torch.empty(source.shape)
            best = best_copy = best_cpu = float("inf")
            last: tuple[float, float] | None = None  # (our CPU, receiver CPU) after the last run
            for rep in range(reps + 2):  # the first run warms up; the last only reads the CPU
                rid = f"{n_tokens}-{rep}"
                conn.send((rid, blocks) if rep <= reps else "cpu")
                receiver_cpu = conn.recv()
                if last is not None and rep > 1:
                    best_cpu = min(best_cpu, last[0] + receiver_cpu - last[1])
                if rep == reps + 1:
                    break
                _evict_caches()
                start = time.perf_counter()
                copy_dst.copy_(copy_src)
                best_copy = min(best_copy, time.perf_counter() - start)
                _evict_caches()
                cpu_start, start = time.process_time(), time.perf_counter()
                for layer in range(LAYOUT.num_layers):
                    sender.send(rid, layer, 0, source[layer], blocks)
                sender.finish(rid, 0)
                while (status := sender.poll(rid)).state is kt.TransferState.IN_FLIGHT:
                    time.sleep(0.0002)
                if status.failed:
                    raise RuntimeError(f"{backend}: {status.reason}")
                if rep:
                    best = min(best, time.perf_counter() - start)
                last = (time.process_time() - cpu_start, receiver_cpu)
            results[n_tokens] = nbytes / best / 1e9
            copies[n_tokens] = nbytes / best_copy / 1e9
            per_cpu[n_tokens] = nbytes / best_cpu / 1e9
        sender.close()
    finally:
        conn.send(None)
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return results, copies, per_cpu


def _raw_sink(endpoint: str, done_endpoint: str) -> None:
    import zmq  # noqa: PLC0415 (the spawned child imports what it uses)

    ctx = zmq.Context()
    pull, done = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(endpoint)
    done.connect(done_endpoint)
    while True:
        count = int(pull.recv())
        for _ in range(count):
            pull.recv(copy=False)
        done.send(b"")


def _bench_raw_zmq(tokens: list[int], reps: int) -> tuple[dict[int, float], ...]:
    """Loopback TCP through libzmq alone (see the module docstring), with a torch copy of the
    same bytes timed before each run."""
    import zmq  # noqa: PLC0415

    ctx = zmq.Context()
    push, done = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    port, done_port = push.bind_to_random_port("tcp://127.0.0.1"), done.bind_to_random_port("tcp://127.0.0.1")
    proc = mp.get_context("spawn").Process(
        target=_raw_sink, args=(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{done_port}"), daemon=True)
    proc.start()
    results, copies, per_cpu = {}, {}, {}
    try:
        for n_tokens in tokens:
            nbytes = LAYOUT.cache_nbytes(n_tokens // LAYOUT.block_size)
            src = torch.randn(nbytes // 4)
            copy_src, copy_dst = torch.randn(nbytes // 4), torch.empty(nbytes // 4)
            frame = 8 << 20
            views = [memoryview(src.numpy()).cast("B")[at:at + frame] for at in range(0, nbytes, frame)]
            best = best_copy = float("inf")
            for rep in range(reps + 1):
                _evict_caches()
                start = time.perf_counter()
                copy_dst.copy_(copy_src)
                best_copy = min(best_copy, time.perf_counter() - start)
                _evict_caches()
                start = time.perf_counter()
                push.send(str(len(views)).encode())
                for view in views:
                    push.send(view, copy=False)
                if not done.poll(60_000):
                    raise RuntimeError("the raw zmq sink did not answer")
                done.recv()
                if rep:
                    best = min(best, time.perf_counter() - start)
            results[n_tokens], copies[n_tokens] = nbytes / best / 1e9, nbytes / best_copy / 1e9
            per_cpu[n_tokens] = float("nan")  # the sink's CPU is not measured
    finally:
        proc.kill()
        push.close(linger=0)
        done.close(linger=0)
        ctx.term()
    return results, copies, per_cpu


def _bench_copy(tokens: list[int], reps: int) -> tuple[dict[int, float], dict[int, float]]:
    results, per_cpu = {}, {}
    for n_tokens in tokens:
        n = n_tokens // LAYOUT.block_size
        src = torch.randn(LAYOUT.num_layers, *LAYOUT.payload_shape(n))
        dst = torch.empty_like(src)
        best = best_cpu = float("inf")
        for _ in range(reps + 1):
            _evict_caches()
            cpu_start, start = time.process_time(), time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - start)
            best_cpu = min(best_cpu, time.process_time() - cpu_start)
        results[n_tokens] = src.numel() * src.element_size() / best / 1e9
        per_cpu[n_tokens] = src.numel() * src.element_size() / best_cpu / 1e9
    return results, per_cpu


def _bench_kernel(tokens: list[int], reps: int, stream: bool) -> tuple[dict[int, float], ...]:
    """The shm writer's byte path alone: kernels/copy_crc32c.py over the same bytes, one call
    per layer as the writer makes them (copy and crc32c, streamed or read back), no protocol;
    with a torch copy timed before each run as for the backends."""
    results, copies, per_cpu = {}, {}, {}
    for n_tokens in tokens:
        n = n_tokens // LAYOUT.block_size
        src = torch.randn(LAYOUT.num_layers, *LAYOUT.payload_shape(n))
        dst, copy_src, copy_dst = torch.empty_like(src), torch.randn(src.shape), torch.empty_like(src)
        layer_bytes = src[0].numel() * src.element_size()
        layers = [(dst[i].data_ptr(), src[i].data_ptr(), layer_bytes) for i in range(LAYOUT.num_layers)]
        best = best_copy = best_cpu = float("inf")
        for _ in range(reps + 1):
            _evict_caches()
            start = time.perf_counter()
            copy_dst.copy_(copy_src)
            best_copy = min(best_copy, time.perf_counter() - start)
            _evict_caches()
            cpu_start, start = time.process_time(), time.perf_counter()
            for layer in layers:
                copy_crc32c([layer], verify=not stream, stream=stream)
            best = min(best, time.perf_counter() - start)
            best_cpu = min(best_cpu, time.process_time() - cpu_start)
        nbytes = src.numel() * src.element_size()
        results[n_tokens], copies[n_tokens] = nbytes / best / 1e9, nbytes / best_copy / 1e9
        per_cpu[n_tokens] = nbytes / best_cpu / 1e9
    return results, copies, per_cpu


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", nargs="+",
                        default=["zmq", "zmq-raw", "shm", "shm-sverify", "shm-rverify", "grpc", "dist"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[128, 512, 2048])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", action="store_true",
                        help="print the GB/s per backend and prompt size as JSON (for planner/cost_profile.py)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    bad = [t for t in args.tokens if t <= 0 or t % LAYOUT.block_size]
    if bad:
        parser.error(f"--tokens must be positive multiples of {LAYOUT.block_size}: {bad}")
    rows: dict[str, dict[int, float]] = {}
    beside: dict[str, dict[int, float]] = {}
    cpu: dict[str, dict[int, float]] = {}
    rows["torch copy"], cpu["torch copy"] = _bench_copy(args.tokens, args.reps)
    for name, stream in (("copy+crc32c", True), ("+read-back", False)):
        rows[name], beside[name], cpu[name] = _bench_kernel(args.tokens, args.reps, stream)
    for backend in args.backends:
        if backend == "zmq-raw":
            rows[backend], beside[backend], cpu[backend] = _bench_raw_zmq(args.tokens, args.reps)
            continue
        rows[backend], beside[backend], cpu[backend] = _bench_backend(backend, args.tokens, args.reps)
    if args.json:
        print(json.dumps({"layout": {"num_layers": LAYOUT.num_layers, "num_kv_heads": LAYOUT.num_kv_heads,
                                     "head_dim": LAYOUT.head_dim, "block_size": LAYOUT.block_size,
                                     "dtype": LAYOUT.dtype,
                                     "bytes_per_token": LAYOUT.cache_nbytes(1) // LAYOUT.block_size},
                          "gb_s": {name: {str(t): v for t, v in res.items()} for name, res in rows.items()}}))
        return
    last = args.tokens[-1]
    print(f"KV transfer, {LAYOUT.num_layers} layers x {LAYOUT.num_kv_heads} kv heads x "
          f"{LAYOUT.head_dim} dims, block {LAYOUT.block_size}, {LAYOUT.dtype}; GB/s, best of {args.reps}")
    print(f"(copy @ {last}: a torch copy of the same bytes timed before each of that backend's runs, "
          "best of them; the ratio is against it. per CPU-s: bytes over the CPU seconds both "
          "processes spent, every thread, against the copy's own)")
    sizes = [f"{t} tok ({LAYOUT.cache_nbytes(t // LAYOUT.block_size) / 2**20:.1f} MiB)" for t in args.tokens]
    print(f"{'backend':<12}" + "".join(f"{s:>22}" for s in sizes) + f"{'copy @ ' + str(last):>14}"
          f"{'vs copy @ ' + str(last):>16}{'GB per CPU-s':>14}{'vs copy':>9}")
    for name, res in rows.items():
        ref = beside.get(name, res)[last]
        per_cpu = cpu[name][last]
        cpu_cells = (f"{'-':>14}{'-':>9}" if per_cpu != per_cpu else  # NaN: not measured
                     f"{per_cpu:>14.2f}{per_cpu / cpu['torch copy'][last]:>9.1%}")
        print(f"{name:<12}" + "".join(f"{res[t]:>22.2f}" for t in args.tokens) + f"{ref:>14.2f}"
              f"{res[last] / ref:>15.1%}" + cpu_cells)

if __name__ == "__main__":
    main()
