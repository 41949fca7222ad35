"""Transfer throughput per backend, next to a plain memory copy measured in the same run.

    python -m kvtransfer.bench [--backends zmq shm grpc] [--tokens 128 512 2048] [--reps 3]

Layout: SmolLM2-135M's KV (30 layers x 3 KV heads x 64 dims, block 16, fp32). One "request"
is a prompt of N tokens sent layer by layer (30 units of N/16 blocks each), timed from the
first send() to DONE (every layer acknowledged by the receiver, i.e. written and checksummed).
The receiver runs in a separate spawned process; the sender here. GB/s = request bytes / time;
the best of --reps runs is reported. The baseline copies the same bytes with torch in this
process: the ceiling no transport on this machine can beat.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time

import torch

import kvtransfer as kt

LAYOUT = kt.KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32",
                     model_id="HuggingFaceTB/SmolLM2-135M-Instruct")


def _receiver(conn, backend: str, num_blocks: int, shm_name: str) -> None:
    torch.set_num_threads(1)
    cache = kt.allocate_cache(LAYOUT, num_blocks, shm_name if backend == "shm" else None)
    receiver = kt.create_receiver(backend, cache, LAYOUT)
    conn.send(receiver.endpoint)
    try:
        while (msg := conn.recv()) is not None:
            rid, blocks = msg
            receiver.poll()  # drop the previous request's event
            receiver.expect(rid, blocks, LAYOUT.num_layers, deadline_s=60.0)
            conn.send(None)
    finally:
        receiver.close()
        cache.close()


def _bench_backend(backend: str, tokens: list[int], reps: int) -> dict[int, float]:
    num_blocks = max(tokens) // LAYOUT.block_size
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child, backend, num_blocks, f"tkvbench-{os.getpid()}"), daemon=True)
    proc.start()
    results: dict[int, float] = {}
    try:
        if not conn.poll(60):
            raise RuntimeError(f"{backend} receiver did not start")
        sender = kt.create_sender(backend, ack_timeout_s=60.0)
        sender.connect(conn.recv(), LAYOUT)
        for n_tokens in tokens:
            blocks = list(range(n_tokens // LAYOUT.block_size))
            payloads = [torch.randn(LAYOUT.payload_shape(len(blocks))) for _ in range(LAYOUT.num_layers)]
            nbytes = sum(p.numel() * p.element_size() for p in payloads)
            best = float("inf")
            for rep in range(reps + 1):  # the first run warms up
                rid = f"{n_tokens}-{rep}"
                conn.send((rid, blocks))
                conn.recv()
                start = time.perf_counter()
                for layer, p in enumerate(payloads):
                    sender.send(rid, layer, blocks, p)
                while (status := sender.poll(rid)).state is kt.TransferState.IN_FLIGHT:
                    time.sleep(0.0002)
                if status.failed:
                    raise RuntimeError(f"{backend}: {status.reason}")
                if rep:
                    best = min(best, time.perf_counter() - start)
            results[n_tokens] = nbytes / best / 1e9
        sender.close()
    finally:
        conn.send(None)
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return results


def _bench_copy(tokens: list[int], reps: int) -> dict[int, float]:
    results = {}
    for n_tokens in tokens:
        n = n_tokens // LAYOUT.block_size
        src = torch.randn(LAYOUT.num_layers, *LAYOUT.payload_shape(n))
        dst = torch.empty_like(src)
        best = float("inf")
        for _ in range(reps + 1):
            start = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - start)
        results[n_tokens] = src.numel() * src.element_size() / best / 1e9
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", nargs="+", default=["zmq", "shm", "grpc"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[128, 512, 2048])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    bad = [t for t in args.tokens if t <= 0 or t % LAYOUT.block_size]
    if bad:
        parser.error(f"--tokens must be positive multiples of {LAYOUT.block_size}: {bad}")
    rows = {"torch copy": _bench_copy(args.tokens, args.reps)}
    for backend in args.backends:
        rows[backend] = _bench_backend(backend, args.tokens, args.reps)
    print(f"KV transfer, {LAYOUT.num_layers} layers x {LAYOUT.num_kv_heads} kv heads x "
          f"{LAYOUT.head_dim} dims, block {LAYOUT.block_size}, {LAYOUT.dtype}; GB/s, best of {args.reps}")
    sizes = [f"{t} tok ({LAYOUT.cache_nbytes(t // LAYOUT.block_size) / 2**20:.1f} MiB)" for t in args.tokens]
    print(f"{'backend':<12}" + "".join(f"{s:>22}" for s in sizes) + f"{'vs copy @ ' + str(args.tokens[-1]):>16}")
    ref = rows["torch copy"][args.tokens[-1]]
    for name, res in rows.items():
        print(f"{name:<12}" + "".join(f"{res[t]:>22.2f}" for t in args.tokens) + f"{res[args.tokens[-1]] / ref:>15.1%}")


if __name__ == "__main__":
    main()
