"""`tandem bench`: its statistics, and whole runs against a running tandem through both the
Ollama and the OpenAI surfaces."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import argparse

from cli.load_generator import PARAGRAPHS, Record, percentile, random_prompts, sessions, summarize
from tests.helpers.api_cluster import MODEL, api  # noqa: F401 (fixture)

ROOT = Path(__file__).resolve().parents[2]


def test_percentile_matches_linear_interpolation():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(list(range(101)), 90) == 90
    assert percentile([10, 0, 5], 100) == 10


def test_summary_tpot_and_goodput():
    fast = Record(ok=True, ttft=0.1, latency=1.1, itl=[0.1] * 10, prompt_tokens=5,
                  output_tokens=11)
    slow = Record(ok=True, ttft=3.0, latency=4.0, itl=[0.5, 0.5], prompt_tokens=5,
                  output_tokens=3)
    failed = Record(ok=False, error="HTTP 503")
    s = summarize([fast, slow, failed], duration=2.0, slo_ttft_ms=2000, slo_tpot_ms=200)
    assert fast.tpot == pytest.approx(0.1) and slow.tpot == pytest.approx(0.5)
    assert s["completed"] == 2 and s["failed"] == 1 and s["errors"] == ["HTTP 503"]
    assert s["goodput"] == 0.5 and s["request_throughput"] == 1.0
    assert s["output_throughput"] == 7.0
    assert s["ttft_ms"]["p50"] == pytest.approx(1550)


def test_random_prompts_are_reproducible_and_sized():
    a, b = random_prompts(4, 16, seed=1), random_prompts(4, 16, seed=1)
    assert a == b and len(set(a)) == 4
    assert all(len(p.split()) == 16 for p in a)


def test_copy_and_write_datasets_for_speculation():
    """copy: each request repeats one of the paragraphs (prompt lookup drafts from it); write:
    a story, little to copy. One turn per session, as many as --num-prompts."""
    def of(kind: str) -> list[str]:
        work = sessions(argparse.Namespace(dataset=kind, num_prompts=5))
        assert all(len(turns) == 1 for turns in work) and len(work) == 5
        return [turns[0] for turns in work]

    copy, write = of("copy"), of("write")
    assert all(p.startswith("Repeat this text exactly") for p in copy)
    assert {p.split(": ", 1)[1] for p in copy} == set(PARAGRAPHS)
    assert all(p.startswith("Write a short story about") for p in write) and len(set(write)) == 4


def bench(api, tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "cli.main", "bench", "--base-url", api.url,
                        "--model", MODEL, "--result-json", str(out), *args],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r, json.loads(out.read_text())


def test_bench_sweeps_concurrency_against_tandem_with_a_plot(api, tmp_path):
    png = tmp_path / "bench.png"
    r, result = bench(api, tmp_path, "--dataset", "random", "--input-len", "16",
                      "--output-len", "6", "--num-prompts", "8", "--concurrency", "1,4",
                      "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", "--plot", str(png))
    assert [lv["load"] for lv in result["levels"]] == [1, 4]
    for level in result["levels"]:
        s = level["summary"]
        assert s["completed"] == 8 and s["failed"] == 0
        assert 0 < s["output_tokens"] <= 8 * 6 and s["input_tokens"] > 8 * 16
        assert s["goodput"] == pytest.approx(s["request_throughput"])
        for name in ("ttft_ms", "e2e_ms"):
            assert s[name]["p50"] <= s[name]["p90"] <= s[name]["p99"]
    assert "TTFT" in r.stdout and "goodput (req/s)" in r.stdout and "100%" in r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_multi_turn_chat_over_openai_with_poisson_arrivals(api, tmp_path):
    _, result = bench(api, tmp_path, "--backend", "openai", "--dataset", "chat",
                      "--output-len", "5", "--num-prompts", "6", "--request-rate", "20",
                      "--no-progress")
    (level,) = result["levels"]
    s = level["summary"]
    assert s["completed"] == 6 and s["failed"] == 0
    prompts = [r["prompt_tokens"] for r in level["requests"]]
    assert len(prompts) == 6 and max(prompts) > min(prompts)  # later turns carry history


def test_a_connection_closed_before_any_answer_is_sent_once_more():
    """A server that closes a pooled keep-alive connection (llama-server does) drops the next
    request sent on it before answering: `send` tries it once more on a new connection, and
    counts it as failed only if that one dies too. A connection that dies mid-answer is a
    failure at once."""
    import asyncio

    import httpx

    from cli.load_generator import Backend, send

    answer = (b'{"message": {"content": "hi"}, "done": false}\n'
              b'{"message": {"content": ""}, "done": true, "prompt_eval_count": 3, '
              b'"eval_count": 1}\n')

    async def scenario(script: list[str]) -> tuple[list, int]:
        connections = 0

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal connections
            what = script[min(connections, len(script) - 1)]
            connections += 1
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            await reader.readexactly(length)
            if what == "answer":
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\n"
                             b"Content-Length: %d\r\n\r\n" % len(answer) + answer)
            elif what == "cut":  # the status line and half of the body
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(answer)
                             + answer[:20])
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        backend = Backend("tandem", "chat", f"http://127.0.0.1:{port}", "m", 4, 0.0)
        async with server, httpx.AsyncClient(timeout=10) as client:
            out = await send(client, backend, [{"role": "user", "content": "hello"}])
        return out, connections

    (record, text), tries = asyncio.run(scenario(["close", "answer"]))
    assert record.ok and text == "hi" and record.output_tokens == 1 and tries == 2
    assert record.retried and summarize([record], 1.0, None, None)["retried"] == 1
    (record, _), tries = asyncio.run(scenario(["close", "close"]))
    assert not record.ok and "RemoteProtocolError" in record.error and tries == 2
    (record, _), tries = asyncio.run(scenario(["cut", "answer"]))
    assert not record.ok and not record.retried and tries == 1
