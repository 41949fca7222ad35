"""Request traces: what arrives when, how long its prompt is, how many tokens it generates.

A JSONL trace has one request per line:

    {"arrival_s": 0.125, "prompt_tokens": 812, "output_tokens": 143}

arrival times in seconds from the trace's start, non-decreasing. A generated trace draws
Poisson arrivals at a rate and lengths from a distribution (fixed, uniform or lognormal),
from one seed, so a plan is reproducible.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

FIELDS = ("arrival_s", "prompt_tokens", "output_tokens")


@dataclass(frozen=True)
class Request:
    arrival_s: float
    prompt_tokens: int   # >= 1
    output_tokens: int   # >= 1; the first comes from the prefill pass


@dataclass(frozen=True)
class LengthDist:
    """fixed (value), uniform (low..high inclusive) or lognormal (median, sigma of the log),
    clamped to [low, high]."""

    kind: str
    value: int = 0
    low: int = 1
    high: int = 1 << 20
    median: float = 0.0
    sigma: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "uniform", "lognormal"):
            raise ValueError(f"length distribution kind must be fixed, uniform or lognormal, got {self.kind!r}")
        if self.kind == "fixed" and self.value < 1:
            raise ValueError(f"fixed length must be >= 1, got {self.value}")
        if not 1 <= self.low <= self.high:
            raise ValueError(f"length bounds must satisfy 1 <= low <= high, got {self.low}..{self.high}")
        if self.kind == "lognormal" and (self.median <= 0 or self.sigma < 0):
            raise ValueError(f"lognormal needs median > 0 and sigma >= 0, got {self.median}, {self.sigma}")

    @classmethod
    def parse(cls, spec: str) -> "LengthDist":
        """'512', 'uniform:64:1024' or 'lognormal:MEDIAN:SIGMA[:LOW:HIGH]'."""
        parts = spec.split(":")
        try:
            if len(parts) == 1:
                return cls("fixed", value=int(parts[0]))
            if parts[0] == "uniform" and len(parts) == 3:
                return cls("uniform", low=int(parts[1]), high=int(parts[2]))
            if parts[0] == "lognormal" and len(parts) in (3, 5):
                bounds = dict(low=int(parts[3]), high=int(parts[4])) if len(parts) == 5 else {}
                return cls("lognormal", median=float(parts[1]), sigma=float(parts[2]), **bounds)
        except ValueError as exc:
            raise ValueError(f"length {spec!r}: {exc}") from None
        raise ValueError(f"length {spec!r}: expected N, uniform:LOW:HIGH or lognormal:MEDIAN:SIGMA[:LOW:HIGH]")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return self.value
        if self.kind == "uniform":
            return rng.randint(self.low, self.high)
        return min(self.high, max(self.low, round(self.median * math.exp(rng.gauss(0.0, self.sigma)))))

    def mean(self) -> float:
        """The distribution's mean (before clamping, for lognormal): for first estimates."""
        if self.kind == "fixed":
            return float(self.value)
        if self.kind == "uniform":
            return (self.low + self.high) / 2
        return min(self.high, self.median * math.exp(self.sigma ** 2 / 2))


def generate(rate: float, count: int, prompt: LengthDist, output: LengthDist, seed: int = 0) -> list[Request]:
    """`count` requests with Poisson arrivals at `rate` per second."""
    if rate <= 0 or count < 1:
        raise ValueError(f"a generated trace needs rate > 0 and count >= 1, got {rate}, {count}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate)
        out.append(Request(t, prompt.sample(rng), output.sample(rng)))
    return out


def load(path: str | Path) -> list[Request]:
    """Every line of a JSONL trace; a malformed line raises ValueError naming file and line."""
    out: list[Request] = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            out.append(_parse_line(line, f"{path}:{number}", out[-1].arrival_s if out else 0.0))
    if not out:
        raise ValueError(f"{path}: empty trace")
    return out


def _parse_line(line: str, where: str, previous_s: float) -> Request:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected an object with {', '.join(FIELDS)}")
    missing = [k for k in FIELDS if k not in obj]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}")
    arrival = obj["arrival_s"]
    if isinstance(arrival, bool) or not isinstance(arrival, (int, float)) or not math.isfinite(arrival) or arrival < 0:
        raise ValueError(f"{where}: arrival_s must be a finite number >= 0, got {arrival!r}")
    if arrival < previous_s:
        raise ValueError(f"{where}: arrival_s {arrival} is before the previous line's {previous_s}")
    for key in ("prompt_tokens", "output_tokens"):
        v = obj[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{where}: {key} must be an integer >= 1, got {v!r}")
    return Request(float(arrival), obj["prompt_tokens"], obj["output_tokens"])


def save(requests: list[Request], path: str | Path) -> None:
    with open(path, "w") as f:
        for r in requests:
            f.write(json.dumps({"arrival_s": r.arrival_s, "prompt_tokens": r.prompt_tokens,
                                "output_tokens": r.output_tokens}) + "\n")
