"""`tandem bench`: a serving load generator in the spirit of `vllm bench serve`.

    tandem bench --base-url http://127.0.0.1:11434 --model smollm2 \\
        --dataset random --input-len 128 --output-len 64 --num-prompts 64 \\
        --concurrency 1,4,16 --slo-ttft-ms 2000 --slo-tpot-ms 50 \\
        --result-json bench.json --plot bench.png

Load is a fixed number of requests in flight (--concurrency) or Poisson arrivals at a rate in
requests/s (--request-rate; `inf` sends everything at once); a comma list runs one level per
value, and --plot draws latency and throughput against load. Backends: `tandem` and `ollama`
(Ollama's /api/chat or /api/generate, NDJSON) and `openai` (/v1/chat/completions or
/v1/completions, SSE), so any of these servers can be measured the same way.

Datasets: `random`, synthetic prompts of --input-len words (exact tokens with --tokenizer) and
--output-len tokens asked for; `chat`, a built-in multi-turn set where each conversation sends
its turns in order with the real answers in its history (so prefix caching shows); `copy`,
requests to repeat a paragraph exactly (what prompt-lookup speculation drafts from), and
`write`, requests for a short story (little to copy), the two workloads that show what
`--speculative ngram` gains and costs.

Per request (DESIGN.md's definitions, measured at the client): TTFT = send to first content;
ITL = gaps between content chunks; TPOT = (latency - TTFT) / (output tokens - 1); output
tokens come from the server's counts (eval_count, usage) where it gives them. Goodput = requests
per second that met every SLO given. Torch-free; needs httpx, tqdm, and matplotlib for --plot.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from common.errors import TandemError

PERCENTILES = (50, 90, 99)
_WORDS = ("the river city light stone water morning garden quiet window market bridge paper "
          "music winter summer forest mountain story train letter harbor evening lantern road "
          "field cloud table silver orange dream island valley").split()
CHAT_SET: list[list[str]] = [
    ["Hi! Can you suggest a name for a small bakery?", "Why that name?",
     "Give me a short slogan for it."],
    ["What is a prime number?", "Is 91 prime?", "What is the next prime after 91?"],
    ["Write a haiku about rain.", "Now one about snow.", "Which of the two do you prefer?"],
    ["How do I boil an egg?", "How long for a soft yolk?", "And for a hard one?"],
    ["Explain what a CPU cache is.", "Why does it make programs faster?",
     "What is a cache miss?"],
    ["Translate 'good morning' into French.", "And into Spanish?", "And into German?"],
    ["List three uses of a paperclip.", "Pick the most unusual one.", "Explain it in detail."],
    ["What causes the seasons?", "Is it colder when Earth is farther from the Sun?",
     "Summarise in one sentence."],
]

# `copy` and `write` (benchmarks/bench_speculative.py uses the same two workloads in process)
PARAGRAPHS = (
    "The river rose slowly through the night, and by morning the low fields along the valley "
    "were under water. Farmers moved their animals to the hills, and the old stone bridge, "
    "which had stood for three hundred years, was closed to traffic while engineers checked "
    "its arches for cracks.",
    "The market opens before sunrise. Bakers carry trays of warm bread past the fountain, the "
    "fishmongers lay their catch on beds of ice, and by seven o'clock the square is so full "
    "that the tram has to wait at the corner until the crowd lets it through.",
    "Our library keeps its oldest maps in a cool room under the reading hall. Each map rests in "
    "a flat drawer lined with acid-free paper, and visitors may see one only with a librarian "
    "beside them, wearing cotton gloves, for no longer than half an hour.",
)
STORY_TOPICS = ("a robot who learns to paint", "a lighthouse keeper's last winter",
                "a cat that runs a small hotel", "two friends lost in a desert town")


def copy_prompt(i: int) -> str:
    return f"Repeat this text exactly, with no other words: {PARAGRAPHS[i % len(PARAGRAPHS)]}"


def write_prompt(i: int) -> str:
    return f"Write a short story about {STORY_TOPICS[i % len(STORY_TOPICS)]}."


@dataclass
class Record:
    """One request as the client saw it (seconds)."""

    ok: bool = False
    error: str = ""
    ttft: float | None = None
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    retried: bool = False  # sent once more: its first try's connection closed unanswered

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


# ---- datasets ----------------------------------------------------------------------------------

def random_prompts(n: int, input_len: int, seed: int, tokenizer: Any = None) -> list[str]:
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        words = [rng.choice(_WORDS) for _ in range(input_len * 2)]
        text = f"{i}: " + " ".join(words)
        if tokenizer is not None:
            text = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:input_len])
        else:
            text = " ".join(text.split()[:input_len])
        prompts.append(text)
    return prompts


def sessions(args: argparse.Namespace, tokenizer: Any = None) -> list[list[str]]:
    """Each session is a list of user turns sent in order; `random` has one turn each."""
    if args.dataset == "random":
        return [[p] for p in random_prompts(args.num_prompts, args.input_len, args.seed,
                                            tokenizer)]
    if args.dataset in ("copy", "write"):
        make = copy_prompt if args.dataset == "copy" else write_prompt
        return [[make(i)] for i in range(args.num_prompts)]
    out, total, i = [], 0, 0
    while total < args.num_prompts:
        turns = CHAT_SET[i % len(CHAT_SET)][: args.num_prompts - total]
        out.append([f"{t}" if i < len(CHAT_SET) else f"({i}) {t}" for t in turns])
        total += len(turns)
        i += 1
    return out


# ---- backends -----------------------------------------------------------------------------------

class Backend:
    def __init__(self, kind: str, endpoint: str, base_url: str, model: str, output_len: int,
                 temperature: float) -> None:
        self.kind, self.endpoint, self.model = kind, endpoint, model
        self.base_url = base_url.rstrip("/")
        self.output_len, self.temperature = output_len, temperature

    def request(self, history: list[dict]) -> tuple[str, dict]:
        prompt = history[-1]["content"]
        if self.kind in ("tandem", "ollama"):
            options = {"num_predict": self.output_len, "temperature": self.temperature}
            if self.endpoint == "chat":
                return "/api/chat", {"model": self.model, "messages": history,
                                     "options": options, "stream": True}
            return "/api/generate", {"model": self.model, "prompt": prompt,
                                     "options": options, "stream": True}
        common = {"model": self.model, "max_tokens": self.output_len, "stream": True,
                  "temperature": self.temperature, "stream_options": {"include_usage": True}}
        if self.endpoint == "chat":
            return "/v1/chat/completions", {**common, "messages": history}
        return "/v1/completions", {**common, "prompt": prompt}

    def parse(self, line: str) -> tuple[str, dict | None]:
        """(content in this line, the final figures if this line has them)."""
        if self.kind in ("tandem", "ollama"):
            obj = json.loads(line)
            if "error" in obj:
                raise RuntimeError(obj["error"])
            text = obj.get("message", {}).get("content", "") if self.endpoint == "chat" \
                else obj.get("response", "")
            if obj.get("done"):
                return text, {"prompt_tokens": obj.get("prompt_eval_count", 0),
                              "output_tokens": obj.get("eval_count", 0)}
            return text, None
        if not line.startswith("data:"):
            return "", None
        data = line[5:].strip()
        if data == "[DONE]":
            return "", None
        obj = json.loads(data)
        if "error" in obj:
            error = obj["error"]
            raise RuntimeError(error.get("message") if isinstance(error, dict) else error)
        usage = obj.get("usage")
        text = ""
        for choice in obj.get("choices") or []:
            text += (choice.get("delta", {}).get("content") or "") if self.endpoint == "chat" \
                else (choice.get("text") or "")
        if usage:
            return text, {"prompt_tokens": usage.get("prompt_tokens", 0),
                          "output_tokens": usage.get("completion_tokens", 0)}
        return text, None


async def send(client: httpx.AsyncClient, backend: Backend, history: list[dict]
               ) -> tuple[Record, str]:
    """One request, streamed and timed. A pooled keep-alive connection that the server had
    already closed (llama-server closes idle ones) fails before any answer: that request is
    sent once more (httpx drops the dead connection; the pool may hand out another idle one),
    timed from its first try, and counted as retried (`retried` in the summary: a server that
    took the request and then died before answering is answered twice so, and shows there)."""
    start = time.perf_counter()
    try:
        return await _send(client, backend, history, start)
    except _NoAnswer:
        record, text = await _send(client, backend, history, start, last_try=True)
        record.retried = True
        return record, text


class _NoAnswer(Exception):
    """The connection closed before the server answered anything (no status line)."""


async def _send(client: httpx.AsyncClient, backend: Backend, history: list[dict], start: float,
                last_try: bool = False) -> tuple[Record, str]:
    record, pieces, chunks, figures = Record(), [], 0, None
    path, body = backend.request(history)
    last, answered = start, False
    try:
        async with client.stream("POST", backend.base_url + path, json=body) as r:
            answered = True
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                raise RuntimeError(f"HTTP {r.status_code}: {text[:200]}")
            async for line in r.aiter_lines():
                if not line.strip():
                    continue
                text, final = backend.parse(line)
                now = time.perf_counter()
                if text:
                    chunks += 1
                    if record.ttft is None:
                        record.ttft = now - start
                    else:
                        record.itl.append(now - last)
                    last = now
                    pieces.append(text)
                figures = final or figures
        record.latency = time.perf_counter() - start
        record.prompt_tokens = figures["prompt_tokens"] if figures else 0
        record.output_tokens = figures["output_tokens"] if figures else chunks
        record.ok = record.ttft is not None or record.output_tokens == 0
    except (httpx.HTTPError, RuntimeError, ValueError) as exc:
        if isinstance(exc, httpx.RemoteProtocolError) and not answered and not last_try:
            raise _NoAnswer from exc
        record.error = f"{type(exc).__name__}: {exc}"[:300]
        record.latency = time.perf_counter() - start
    return record, "".join(pieces)


# ---- load ----------------------------------------------------------------------------------------

async def run_level(backend: Backend, work: list[list[str]], concurrency: int | None,
                    rate: float | None, seed: int, progress: Any, timeout_s: float
                    ) -> tuple[list[Record], float]:
    records: list[Record] = []
    limits = httpx.Limits(max_connections=max(concurrency or 0, 256))
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        gate = asyncio.Semaphore(concurrency) if concurrency else None

        async def session(turns: list[str]) -> None:
            history: list[dict] = []
            for turn in turns:
                history.append({"role": "user", "content": turn})
                if gate is not None:
                    async with gate:
                        record, answer = await send(client, backend, history)
                else:
                    record, answer = await send(client, backend, history)
                records.append(record)
                progress.update(1)
                if not record.ok:
                    return
                history.append({"role": "assistant", "content": answer})

        rng = random.Random(seed)
        start = time.perf_counter()
        tasks = []
        for turns in work:
            tasks.append(asyncio.create_task(session(turns)))
            if rate is not None and math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
        return records, time.perf_counter() - start


# ---- figures ------------------------------------------------------------------------------------

def percentile(values: list[float], p: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _stats_ms(values: list[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {"mean": (sum(values) / len(values) * 1e3) if values else None}
    for p in PERCENTILES:
        v = percentile(values, p)
        out[f"p{p}"] = None if v is None else v * 1e3
    return out


def summarize(records: list[Record], duration: float, slo_ttft_ms: float | None,
              slo_tpot_ms: float | None) -> dict[str, Any]:
    ok = [r for r in records if r.ok]

    def good(r: Record) -> bool:
        if slo_ttft_ms is not None and (r.ttft is None or r.ttft * 1e3 > slo_ttft_ms):
            return False
        return slo_tpot_ms is None or r.tpot is None or r.tpot * 1e3 <= slo_tpot_ms

    output = sum(r.output_tokens for r in ok)
    return {
        "completed": len(ok), "failed": len(records) - len(ok),
        "retried": sum(r.retried for r in records),
        "errors": sorted({r.error for r in records if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": output / duration if duration else 0.0,
        "input_tokens": sum(r.prompt_tokens for r in ok), "output_tokens": output,
        "goodput": sum(1 for r in ok if good(r)) / duration if duration else 0.0,
        "ttft_ms": _stats_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": _stats_ms([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": _stats_ms([g for r in ok for g in r.itl]),
        "e2e_ms": _stats_ms([r.latency for r in ok]),
    }


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def print_level(label: str, s: dict[str, Any], slo: bool) -> None:
    print(f"============ {label} ============")
    print(f"requests: {s['completed']} ok, {s['failed']} failed in {s['duration_s']:.2f} s"
          + (f" ({s['retried']} sent twice: a closed keep-alive connection)" if s.get("retried") else ""))
    for error in s["errors"]:
        print(f"  error: {error}")
    print(f"request throughput (req/s): {s['request_throughput']:.2f}")
    print(f"output token throughput (tok/s): {s['output_throughput']:.2f}")
    if slo:
        print(f"goodput (req/s): {s['goodput']:.2f}")
    print(f"{'':10}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}   (ms)")
    for name in ("ttft", "tpot", "itl", "e2e"):
        st = s[f"{name}_ms"]
        print(f"{name.upper():10}" + "".join(f"{_fmt(st[k]):>10}"
                                             for k in ("mean", "p50", "p90", "p99")))


def plot(path: Path, load_name: str, levels: list[dict[str, Any]]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise TandemError("--plot needs matplotlib: pip install matplotlib") from None
    xs = [lv["load"] for lv in levels]
    fig, (lat, thr) = plt.subplots(1, 2, figsize=(11, 4))
    for name in ("ttft", "tpot", "itl"):
        for p, style in (("p50", "-o"), ("p99", "--o")):
            ys = [lv["summary"][f"{name}_ms"][p] for lv in levels]
            lat.plot(xs, [float("nan") if y is None else y for y in ys], style,
                     label=f"{name.upper()} {p}")
    lat.set(xlabel=load_name, ylabel="ms", title="latency vs load", yscale="log")
    lat.legend(fontsize=8)
    thr.plot(xs, [lv["summary"]["output_throughput"] for lv in levels], "-o",
             label="output tok/s")
    thr2 = thr.twinx()
    thr2.plot(xs, [lv["summary"]["request_throughput"] for lv in levels], "-s", color="C1",
              label="req/s")
    thr2.plot(xs, [lv["summary"]["goodput"] for lv in levels], "--s", color="C2",
              label="goodput req/s")
    thr.set(xlabel=load_name, ylabel="output tokens/s", title="throughput vs load")
    thr2.set_ylabel("requests/s")
    thr.legend(loc="upper left", fontsize=8)
    thr2.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- command line ------------------------------------------------------------------------------

def _floats(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of numbers, got {text!r}")
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"values must be > 0, got {text!r}")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:11434", help="server to measure")
    p.add_argument("--backend", choices=("tandem", "ollama", "openai"), default="tandem")
    p.add_argument("--endpoint", choices=("chat", "generate"), default="chat",
                   help="chat: /api/chat or /v1/chat/completions; generate: /api/generate "
                        "or /v1/completions")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dataset", choices=("random", "chat", "copy", "write"), default="random",
                   help="copy: repeat a paragraph (speculation drafts from it); write: a story")
    p.add_argument("--input-len", type=int, default=128, help="random: prompt length")
    p.add_argument("--output-len", type=int, default=64, help="tokens asked for per request")
    p.add_argument("--num-prompts", type=int, default=32, help="requests per load level")
    p.add_argument("--tokenizer", help="model name or path whose tokenizer sizes random "
                                       "prompts exactly (default: words, about one token each)")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=_floats, help="requests in flight, e.g. 1,4,16")
    load.add_argument("--request-rate", type=_floats,
                      help="Poisson arrivals per second, e.g. 1,2,4 (inf = all at once)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, help="goodput: TTFT at most this")
    p.add_argument("--slo-tpot-ms", type=float, help="goodput: TPOT at most this")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--result-json", help="write every figure here")
    p.add_argument("--plot", help="PNG of latency and throughput against load")
    p.add_argument("--no-progress", action="store_true")


def _tokenizer(name: str | None):
    if name is None:
        return None
    from common.model_store import default_store
    from common.tokenizer import Tokenizer

    return Tokenizer.from_path(default_store().resolve(name))


def run_from_args(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    for name in ("input_len", "output_len", "num_prompts"):
        if getattr(args, name) < 1:
            raise TandemError(f"--{name.replace('_', '-')} must be >= 1")
    if args.request_rate is not None:
        load_name, values = "request rate (req/s)", args.request_rate
    else:
        load_name, values = "concurrency", args.concurrency or [1.0]
    backend = Backend(args.backend, args.endpoint, args.base_url, args.model, args.output_len,
                      args.temperature)
    work = sessions(args, _tokenizer(args.tokenizer))
    total = sum(len(s) for s in work) * len(values)
    slo = args.slo_ttft_ms is not None or args.slo_tpot_ms is not None
    levels = []
    with tqdm(total=total, disable=args.no_progress, unit="req", file=sys.stderr) as bar:
        for value in values:
            concurrency = None if args.request_rate is not None else int(value)
            rate = value if args.request_rate is not None else None
            records, duration = asyncio.run(run_level(backend, work, concurrency, rate,
                                                      args.seed, bar, args.timeout))
            summary = summarize(records, duration, args.slo_ttft_ms, args.slo_tpot_ms)
            levels.append({"load": value, "summary": summary,
                           "requests": [asdict(r) | {"tpot": r.tpot} for r in records]})
    for level in levels:
        print_level(f"{load_name} {level['load']:g}", level["summary"], slo)
    if args.result_json:
        config = {k: v for k, v in vars(args).items() if k != "func"}
        Path(args.result_json).write_text(json.dumps(
            {"config": config, "load": load_name, "levels": levels}, indent=1))
    if args.plot:
        plot(Path(args.plot), load_name, levels)
    failed = sum(lv["summary"]["failed"] for lv in levels)
    return 1 if failed == total else 0
