"""A fake worker as a process, speaking the worker process contract (flags, Register,
Heartbeat), for the local launcher's tests: `python -m tests.helpers.fake_worker_process --role decode
--model DIR --host H --port P --coordinator HOST:PORT --kv-backend zmq --worker-id ID`.
It generates a fixed reply and exits cleanly on SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import signal

from common.lifeline import watch_launcher
from common.model_files import load_config
from common.model_identity import model_fingerprint
from common.tokenizer import Tokenizer
from tests.helpers.coordinator_fakes import FakeWorker, Script


async def main() -> None:
    watch_launcher()
    p = argparse.ArgumentParser()
    for flag in ("--model", "--host", "--port", "--coordinator", "--kv-backend", "--worker-id",
                 "--max-batched-tokens", "--kv-dtype", "--device"):
        p.add_argument(flag)
    p.add_argument("--role", default="prefill")
    args = p.parse_args()
    fingerprint = model_fingerprint(args.model, load_config(args.model))
    tokens = Tokenizer.from_path(args.model).encode("Hello world!", add_special_tokens=False)
    worker = FakeWorker(args.worker_id, args.role, args.coordinator, fingerprint,
                        Script(tokens=tokens))
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await worker.start()
    print(f"fake {args.role} worker {args.worker_id} at {worker.address}", flush=True)
    await stop.wait()
    await worker.stop()


if __name__ == "__main__":
    asyncio.run(main())
