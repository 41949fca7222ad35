"""Fuzz campaigns against tandem's parsers of untrusted bytes.

    python -m reliability.fuzz --target gguf|safetensors|frames --examples N [--seed S] [--save DIR]
    python -m reliability.fuzz --target http --url http://HOST:PORT --examples N

Each example mutates a valid seed (reliability/fuzz_inputs.py for the loaders; every KV wire
message of kvtransfer/message.py for frames) and feeds it to the real parser. The rule it
checks: every input gets a clear error or a correct answer.

- gguf / safetensors: engine.loaders.load_config and load_model (and for a GGUF the
  tokenizer it carries, common.tokenizer.Tokenizer.from_path) either succeed, or raise a
  TandemError (ModelFormatError, UnsupportedModelError, ...) whose message names the file or
  directory. Any other exception, a message that does not name the file, or an example that
  runs past --timeout seconds (a hang, or an allocation sized by a corrupt count) is a crash.
- frames: each message's decode either raises MessageError or returns a message that
  re-encodes and decodes to itself; KVHeader.check_against raises nothing but MessageError.

- http: schemathesis against a running coordinator's /openapi.json (reliability/fuzz_http.py):
  --examples per operation and mode; tests/reliability/test_fuzz_http.py runs it on fake workers.

The report lists examples run, crashes, and the distinct outcomes (error kinds) seen; --save
writes each crash's recipe as JSON, the form tests/data/fuzz/ keeps them in.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reliability import fuzz_inputs as inputs
from common.errors import TandemError


class Hang(Exception):
    """An example ran past its time limit."""


@dataclass
class Report:
    target: str
    examples: int = 0
    outcomes: Counter = field(default_factory=Counter)  # "ok" or an error kind -> count
    crashes: list[dict[str, Any]] = field(default_factory=list)  # recipe + what went wrong

    def lines(self) -> list[str]:
        out = [f"target {self.target}: {self.examples} examples, {len(self.crashes)} crashes",
               f"  distinct outcomes: {len(self.outcomes)}"]
        out += [f"    {n:6d}  {kind}" for kind, n in self.outcomes.most_common()]
        for crash in self.crashes[:10]:
            out.append(f"  CRASH {crash['error']}  recipe {json.dumps(crash['recipe'])[:200]}")
        return out


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise Hang in the block after `seconds` (main thread only: elsewhere no limit)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def fire(signum: int, frame: Any) -> None:
        raise Hang(f"still running after {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def error_kind(exc: BaseException) -> str:
    """An outcome's name for the report: the class and the message's first words, with
    numbers and paths dropped so that one kind of problem counts once."""
    words = [w for w in str(exc).split() if not any(c.isdigit() for c in w) and "/" not in w
             and w.isascii() and w.isprintable()]  # a mutated tensor name may be any bytes
    return f"{type(exc).__name__}: {' '.join(words[:6])}"


# ---- loaders --------------------------------------------------------------------------------

def check_load(path: Path, timeout_s: float) -> str:
    """'ok', or the kind of the clear error the loaders raised; raises on anything else."""
    from common.model_files import load_config
    from engine.loaders import load_model
    from common.tokenizer import Tokenizer

    with time_limit(timeout_s):
        try:
            load_config(path)
            loaded = load_model(path)
            if path.is_file():  # a GGUF carries its tokenizer too (the coordinator reads it)
                Tokenizer.from_path(path)
        except TandemError as exc:
            if str(path) not in str(exc):
                raise AssertionError(f"error does not name {path}: {exc}") from exc
            return error_kind(exc)
    if set(loaded.weights) < {"model.embed_tokens.weight", "lm_head.weight"}:
        raise AssertionError("load_model returned without the embeddings")
    return "ok"


def _run(report: Report, examples: int, make: Callable[[int], dict[str, Any]],
         check: Callable[[dict[str, Any]], str]) -> Report:
    for i in range(examples):
        recipe = make(i)
        report.examples += 1
        try:
            report.outcomes[check(recipe)] += 1
        except (Exception, Hang) as exc:  # the crash is the finding: keep going, record it
            report.outcomes["CRASH " + error_kind(exc)] += 1
            report.crashes.append({"recipe": recipe, "error": f"{type(exc).__name__}: {exc}"[:300],
                                   "traceback": traceback.format_exc(limit=6)})
    return report


def fuzz_gguf(examples: int, seed: int, workdir: Path, timeout_s: float = 10.0) -> Report:
    seed_path = inputs.write_seed_gguf(workdir / "seed.gguf")
    seed_bytes, hot = seed_path.read_bytes(), inputs.header_end(seed_path)
    rng = random.Random(seed)
    path = workdir / "mutant.gguf"

    def check(recipe: dict[str, Any]) -> str:
        path.write_bytes(inputs.apply_recipe(seed_bytes, recipe))
        return check_load(path, timeout_s)

    return _run(Report("gguf"), examples,
                lambda i: inputs.random_recipe(rng, len(seed_bytes), hot), check)


def fuzz_safetensors(examples: int, seed: int, workdir: Path, timeout_s: float = 10.0) -> Report:
    seed_dir = inputs.write_seed_hf(workdir / "seed")
    seed_bytes = (seed_dir / "model.safetensors").read_bytes()
    rng = random.Random(seed)
    model_dir = workdir / "mutant"
    model_dir.mkdir()

    def check(recipe: dict[str, Any]) -> str:
        inputs.apply_hf_recipe(model_dir, seed_bytes, recipe)
        return check_load(model_dir, timeout_s)

    return _run(Report("safetensors"), examples,
                lambda i: inputs.random_hf_recipe(rng, seed_bytes), check)


# ---- KV wire messages -----------------------------------------------------------------------

def frame_seeds() -> dict[str, bytes]:
    """One valid encoding of every message kind of kvtransfer/message.py."""
    from kvtransfer import message as m
    from kvtransfer.layout import KVLayout

    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, block_size=2, dtype="float32",
                      model_id="fuzz")
    return {
        "KVHeader": m.KVHeader(transfer_id="t1", layer=1, block_ids=(3, 4), dtype="float32",
                               shape=layout.payload_shape(2), fingerprint=layout.fingerprint,
                               checksum=77, seq=5, payload_nbytes=layout.payload_nbytes(2),
                               sender_id="s").encode(),
        "Ack": m.Ack(5, "t1", 1, False, "why").encode(),
        "Grant": m.Grant("t1", True, "", 1, (7, 8), 2).encode(),
        "GrantRequest": m.GrantRequest("t1", "s").encode(),
        "Revoke": m.Revoke("t1", "cancelled").encode(),
        "Revoked": m.Revoked("t1", "s").encode(),
        "HandshakeRequest": m.HandshakeRequest(layout, "s", 12, 34).encode(),
        "HandshakeReply": m.HandshakeReply(layout, 16, "shm-a", "shm-b").encode(),
    }


def check_frame(kind: str, data: bytes) -> str:
    """'ok <kind>' when `data` decodes to a message that round-trips; the MessageError's kind
    when it does not decode; raises on anything else."""
    from kvtransfer import message as m
    from kvtransfer.layout import KVLayout

    cls = getattr(m, kind)
    try:
        msg = cls.decode(data)
    except m.MessageError as exc:
        return error_kind(exc)
    again = cls.decode(msg.encode())
    if again != msg:
        raise AssertionError(f"{kind} does not round-trip: {msg!r} -> {again!r}")
    if kind == "KVHeader":
        layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, block_size=2,
                          dtype="float32", model_id="fuzz")
        try:
            msg.check_against(layout, num_cache_blocks=8)
        except m.MessageError as exc:
            return "check_against " + error_kind(exc)
    return f"ok {kind}"


def fuzz_frames(examples: int, seed: int, workdir: Path, timeout_s: float = 10.0) -> Report:
    seeds = frame_seeds()
    kinds = sorted(seeds)
    rng = random.Random(seed)

    def make(i: int) -> dict[str, Any]:
        kind = kinds[i % len(kinds)]
        data = seeds[kind]
        if rng.random() < 0.1:  # bytes from nowhere
            return {"kind": kind, "data": rng.randbytes(rng.randrange(64)).hex()}
        recipe = inputs.random_recipe(rng, max(1, len(data)), len(data))
        return {"kind": kind, "data": inputs.apply_recipe(data, recipe).hex()}

    def check(recipe: dict[str, Any]) -> str:
        with time_limit(timeout_s):
            return check_frame(recipe["kind"], bytes.fromhex(recipe["data"]))

    return _run(Report("frames"), examples, make, check)


TARGETS: dict[str, Callable[..., Report]] = {
    "gguf": fuzz_gguf, "safetensors": fuzz_safetensors, "frames": fuzz_frames,
}


def _http(args: argparse.Namespace) -> int:
    from reliability.fuzz_http import fuzz_http

    report = fuzz_http(args.url.rstrip("/"), args.examples)
    print(f"target http: {report.requests} requests over {len(report.labels)} operations, "
          f"{len(report.failures)} failures")
    statuses = Counter(key.rsplit(" ", 1)[1] for key in report.statuses.elements())
    print("  statuses: " + ", ".join(f"{s}: {n}" for s, n in sorted(statuses.items())))
    for failure in report.failures[:10]:
        print("  FAILURE " + failure)
    return 1 if report.failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reliability.fuzz", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", choices=sorted([*TARGETS, "http"]), required=True)
    parser.add_argument("--url", help="http: the coordinator to fuzz, e.g. http://127.0.0.1:11434")
    parser.add_argument("--examples", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0, help="RNG seed: a campaign replays")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per example")
    parser.add_argument("--save", type=Path, help="write each crash's recipe here as JSON")
    args = parser.parse_args(argv)
    if args.examples < 1:
        parser.error("--examples must be at least 1")
    if args.target == "http":
        if not args.url:
            parser.error("--target http needs --url")
        return _http(args)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tandem-fuzz-") as tmp:
        report = TARGETS[args.target](args.examples, args.seed, Path(tmp), args.timeout)
    print("\n".join(report.lines()))
    print(f"  {time.monotonic() - started:.1f} s")
    if args.save and report.crashes:
        args.save.mkdir(parents=True, exist_ok=True)
        for n, crash in enumerate(report.crashes):
            out = args.save / f"{args.target}-seed{args.seed}-{n}.json"
            out.write_text(json.dumps({"target": args.target, **crash}, indent=1))
        print(f"  crash recipes written to {args.save}")
    return 1 if report.crashes else 0


if __name__ == "__main__":
    sys.exit(main())
