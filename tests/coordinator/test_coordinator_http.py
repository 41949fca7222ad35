"""The coordinator end to end: real HTTP (uvicorn) in front, real gRPC fake workers behind."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import httpx
import pytest

from coordinator.config import CoordinatorConfig
from common.pooling import Pooling
from common.rpc import worker_pb2 as pb

from tests.helpers.coordinator_fakes import (
    DEADLINE_S, Script, coordinator_harness, load_model, make_tiny_model_dir, run, wait_until,
)

TEXT = "Hello world! How are you?"
MESSAGES = [{"role": "user", "content": "Tell me a story about the river and the city."}]
FIGURES = ("total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration",
           "eval_count", "eval_duration")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def tokens(model):
    return model.tokenizer.encode(TEXT, add_special_tokens=False)


def prompt_len(model, messages=MESSAGES) -> int:
    tok = model.tokenizer
    return len(tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True)))


async def chat_lines(client: httpx.AsyncClient, url: str, **body) -> list[dict]:
    body = {"model": "tiny", "messages": MESSAGES, **body}
    async with client.stream("POST", f"{url}/api/chat", json=body) as response:
        assert response.status_code == 200, await response.aread()
        assert response.headers["content-type"].startswith("application/x-ndjson")
        return [json.loads(line) async for line in response.aiter_lines() if line]


def check_final(final: dict, model, output_tokens: int, done_reason: str = "stop") -> None:
    assert final["done"] is True and final["done_reason"] == done_reason
    for name in FIGURES:
        assert isinstance(final[name], int) and final[name] >= 0, name
    assert final["prompt_eval_count"] == prompt_len(model)
    assert final["eval_count"] == output_tokens
    assert final["load_duration"] == 0
    assert final["total_duration"] >= final["prompt_eval_duration"] > 0
    assert final["total_duration"] >= final["eval_duration"]


def test_disaggregated_flow_two_concurrent_calls_streams_ndjson(model, tokens):
    async def scenario():
        async with coordinator_harness(model, prefill_threshold=0) as h:
            prefill = await h.add_worker("p1", "prefill", Script(tokens=tokens))
            decode = await h.add_worker("d1", "decode", Script(tokens=tokens))
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                lines = await chat_lines(client, h.url)
            return prefill, decode, lines

    prefill, decode, lines = run(scenario())
    *chunks, final = lines
    assert all(c["done"] is False and c["message"]["role"] == "assistant" for c in chunks)
    assert all(c["model"] == "tiny" and c["created_at"].endswith("Z") for c in lines)
    assert "".join(c["message"]["content"] for c in chunks) == TEXT
    check_final(final, model, len(tokens))
    assert final["message"]["content"] == ""
    assert final["tandem"]["prefill_worker"] == "p1" and final["tandem"]["decode_worker"] == "d1"
    assert final["tandem"]["prefill_worker_s"] == 0.01  # as the (fake) prefill worker reported
    assert len(final["tandem"]["itl_s"]) == len(tokens) - 1

    (gen,) = decode.requests
    assert gen.remote_prefill is True
    assert list(gen.prompt_token_ids) == prefill.requests[0].prompt_token_ids
    assert gen.max_tokens == model.context_len - prompt_len(model)
    assert set(gen.stop_token_ids) == set(model.tokenizer.stop_token_ids)
    (pre,) = prefill.requests
    # One transfer id on both calls; the decode worker grants its blocks to it directly.
    assert pre.request_id == gen.request_id == pre.transfer_id == gen.transfer_id
    # The chunk plan travels with the request: prefill-worker chunks of chunk_size.
    assert pre.max_chunk_tokens == CoordinatorConfig().chunk_size and gen.max_chunk_tokens == 0
    assert pre.destination.endpoint == f"tcp://{decode.address}-kv"
    assert pre.destination.backend == "zmq"
    assert decode.kv_arrivals == [(gen.transfer_id, tokens[0], "")]
    assert decode.finished == [gen.request_id] and decode.cancelled == []


def test_short_prompt_prefills_on_the_decode_worker(model, tokens):
    async def scenario():
        async with coordinator_harness(model, prefill_threshold=1000) as h:
            prefill = await h.add_worker("p1", "prefill", Script(tokens=tokens))
            decode = await h.add_worker("d1", "decode", Script(tokens=tokens))
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                r = await client.post(f"{h.url}/api/chat", json={
                    "model": "tiny:latest", "messages": MESSAGES, "stream": False,
                    "options": {"temperature": 0, "seed": 3}})
            return prefill, decode, r

    prefill, decode, r = run(scenario())
    assert r.status_code == 200
    body = r.json()
    assert body["message"] == {"role": "assistant", "content": TEXT}
    check_final(body, model, len(tokens))
    assert body["tandem"]["prefill_worker"] is None and body["tandem"]["prefill_worker_s"] is None
    assert prefill.requests == []
    (gen,) = decode.requests
    assert gen.remote_prefill is False
    assert gen.sampling.temperature == 0 and gen.sampling.seed == 3
    assert gen.transfer_id == "" and decode.kv_arrivals == []


def test_colocated_worker_always_prefills_locally(model, tokens):
    async def scenario():
        async with coordinator_harness(model, prefill_threshold=0) as h:
            prefill = await h.add_worker("p1", "prefill", Script(tokens=tokens))
            worker = await h.add_worker("c1", "colocated", Script(tokens=tokens))
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                lines = await chat_lines(client, h.url, options={"num_predict": 50})
            return prefill, worker, lines

    prefill, worker, lines = run(scenario())
    assert "".join(line["message"]["content"] for line in lines) == TEXT
    assert prefill.requests == []
    assert worker.requests[0].remote_prefill is False
    assert worker.requests[0].max_tokens == 50
    # Prefilled inside the decode batch: in the small chunks that keep its steps short.
    assert worker.requests[0].max_chunk_tokens == CoordinatorConfig().local_chunk_size


def test_overload_answers_503_with_retry_after(model, tokens):
    async def scenario():
        async with coordinator_harness(model, max_running_per_worker=1, max_queue=0) as h:
            decode = await h.add_worker("d1", "decode", Script(tokens=tokens, token_delay_s=0.2))
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                first = asyncio.create_task(chat_lines(client, h.url))
                await wait_until(lambda: decode.requests, "the first request to run")
                second = await client.post(f"{h.url}/api/chat",
                                           json={"model": "tiny", "messages": MESSAGES})
                await first
                metrics = (await client.get(f"{h.url}/metrics")).text
            return second, metrics

    second, metrics = run(scenario())
    assert second.status_code == 503
    assert second.headers["retry-after"] == "1"
    assert "overloaded" in second.json()["error"]
    assert 'tandem_requests_total{outcome="overloaded"} 1.0' in metrics
    assert 'tandem_requests_total{outcome="stop"} 1.0' in metrics


def test_too_many_open_streams_is_429(model, tokens):
    async def scenario():
        async with coordinator_harness(model, max_streams=1) as h:
            decode = await h.add_worker("d1", "decode", Script(tokens=tokens, token_delay_s=0.2))
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                first = asyncio.create_task(chat_lines(client, h.url))
                await wait_until(lambda: decode.requests, "the first request to run")
                second = await client.post(f"{h.url}/api/chat", json={"model": "tiny", "messages": MESSAGES})
                first_lines = await first
            return second, first_lines

    second, first_lines = run(scenario())
    assert second.status_code == 429 and "Retry-After" in second.headers
    assert "too many concurrent requests" in second.json()["error"]
    assert first_lines[-1]["done"] is True  # the open stream was not disturbed


def test_no_live_worker_is_503(model):
    async def scenario():
        async with coordinator_harness(model) as h:
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                return await client.post(f"{h.url}/api/chat",
                                         json={"model": "tiny", "messages": MESSAGES})

    r = run(scenario())
    assert r.status_code == 503 and "Retry-After" in r.headers
    assert "no live decode worker" in r.json()["error"]


def test_request_errors_before_any_output(model, tokens):
    async def scenario():
        async with coordinator_harness(model) as h:
            await h.add_worker("d1", "decode", Script(tokens=tokens))
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                post = lambda **kw: client.post(f"{h.url}/api/chat", **kw)  # noqa: E731
                return [
                    await post(content=b"{not json"),
                    await post(content=b""),
                    await post(json={"model": "tiny", "messages": MESSAGES,
                                     "options": {"temperature": "hot"}}),
                    await post(json={"model": "nope", "messages": MESSAGES}),
                    await post(json={"model": "tiny", "messages": [
                        {"role": "user", "content": "river " * 200}]}),
                    await post(json={"model": "tiny", "messages": MESSAGES, "stream": "yes"}),
                    await post(json={"model": "tiny", "messages": [{"role": "wizard"}]}),
                ]

    bad_json, empty, bad_option, unknown, too_long, bad_stream, bad_role = run(scenario())
    assert bad_json.status_code == 400 and "invalid JSON" in bad_json.json()["error"]
    assert empty.status_code == 400 and "missing request body" in empty.json()["error"]
    assert bad_option.status_code == 400 and "'temperature'" in bad_option.json()["error"]
    assert unknown.status_code == 404 and unknown.json() == {"error": "model 'nope' not found"}
    assert too_long.status_code == 400 and "context window" in too_long.json()["error"]
    assert bad_stream.status_code == 400 and "stream" in bad_stream.json()["error"]
    assert bad_role.status_code == 400 and "role" in bad_role.json()["error"]


def test_empty_messages_answers_load(model):
    async def scenario():
        async with coordinator_harness(model) as h:
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                return await client.post(f"{h.url}/api/chat",
                                         json={"model": "tiny", "messages": []})

    r = run(scenario())
    assert r.status_code == 200 and r.json()["done_reason"] == "load"


def test_client_disconnect_cancels_the_worker_stream(model, tokens):
    async def scenario():
        async with coordinator_harness(model) as h:
            decode = await h.add_worker("d1", "decode",
                                        Script(tokens=tokens * 20, token_delay_s=0.05))
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                body = {"model": "tiny", "messages": MESSAGES}
                async with client.stream("POST", f"{h.url}/api/chat", json=body) as response:
                    async for line in response.aiter_lines():
                        assert json.loads(line)["done"] is False
                        break  # leave after the first chunk: the connection closes
            await wait_until(lambda: decode.cancelled, "the worker to see the cancellation")
            await wait_until(lambda: h.coordinator.admission.running == 0, "the slot to free")
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                metrics = (await client.get(f"{h.url}/metrics")).text
            return decode, metrics

    decode, metrics = run(scenario())
    assert decode.cancelled == [decode.requests[0].request_id]
    assert decode.finished == []
    assert 'tandem_requests_total{outcome="cancelled"} 1.0' in metrics


def test_client_disconnect_during_remote_prefill_cancels_both(model, tokens):
    async def scenario():
        async with coordinator_harness(model, prefill_threshold=0) as h:
            prefill = await h.add_worker("p1", "prefill", Script(tokens=tokens, token_delay_s=30))
            decode = await h.add_worker("d1", "decode", Script(tokens=tokens))
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                task = asyncio.create_task(
                    client.post(f"{h.url}/api/chat",
                                json={"model": "tiny", "messages": MESSAGES, "stream": False}))
                await wait_until(lambda: prefill.requests, "the prefill to start")
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            await wait_until(lambda: prefill.cancelled and decode.cancelled, "cancellations")
            return prefill, decode

    prefill, decode = run(scenario())
    assert prefill.cancelled == decode.cancelled == [decode.requests[0].request_id]


def test_prefill_worker_dying_is_retried_on_another(model, tokens):
    async def scenario():
        async with coordinator_harness(model, prefill_threshold=0) as h:
            dead = await h.add_worker("p1", "prefill", Script(tokens=tokens, unavailable=True))
            good = await h.add_worker("p2", "prefill", Script(tokens=tokens))
            decode = await h.add_worker("d1", "decode", Script(tokens=tokens))
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                lines = await chat_lines(client, h.url)
            # The first attempt's decode call is cancelled (if its handler had started at all:
            # the coordinator may cancel it before the worker runs it).
            await wait_until(lambda: len(decode.cancelled) == len(decode.requests) - 1,
                             "the first decode call to be cancelled")
            return dead, good, decode, lines, h.coordinator.registry.get("p1")

    dead, good, decode, lines, record = run(scenario())
    assert "".join(line["message"]["content"] for line in lines) == TEXT
    assert lines[-1]["tandem"]["prefill_worker"] == "p2"
    assert len(dead.requests) == 1 and len(good.requests) == 1
    assert record.alive is False and "Prefill failed" in record.dead_reason
    # A new attempt with its own transfer id; the first attempt's decode call was cancelled.
    *first, second = decode.requests
    assert dead.requests[0].transfer_id != second.transfer_id == good.requests[0].transfer_id
    assert [r.transfer_id for r in first] in ([], [dead.requests[0].transfer_id])
    assert decode.cancelled == [r.request_id for r in first]
    assert decode.kv_arrivals == [(second.transfer_id, tokens[0], "")]


def test_prefill_worker_dying_without_spare_prefills_on_the_decode_worker(model, tokens):
    async def scenario():
        async with coordinator_harness(model, prefill_threshold=0) as h:
            await h.add_worker("p1", "prefill", Script(tokens=tokens, unavailable=True))
            decode = await h.add_worker("d1", "decode", Script(tokens=tokens))
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                lines = await chat_lines(client, h.url)
            await wait_until(lambda: len(decode.cancelled) == len(decode.requests) - 1,
                             "the first decode call to be cancelled")
            return decode, lines

    decode, lines = run(scenario())
    assert "".join(line["message"]["content"] for line in lines) == TEXT
    assert lines[-1]["tandem"]["prefill_worker"] is None
    *first, second = decode.requests  # the first call, unless cancelled before it ran
    assert all(r.remote_prefill for r in first) and second.remote_prefill is False
    assert decode.cancelled == [r.request_id for r in first]  # the first reservation is given up


def test_prefill_failure_with_migrations_off_ends_with_error(model, tokens):
    async def scenario():
        async with coordinator_harness(model, prefill_threshold=0, max_migrations=0) as h:
            await h.add_worker("p1", "prefill", Script(tokens=tokens, unavailable=True))
            decode = await h.add_worker("d1", "decode", Script(tokens=tokens))
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                r = await client.post(f"{h.url}/api/chat",
                                      json={"model": "tiny", "messages": MESSAGES})
            # The decode call is cancelled: if its handler had started, it sees the cancel.
            await wait_until(lambda: len(decode.cancelled) == len(decode.requests),
                             "the decode call to be cancelled")
            return decode, r

    decode, r = run(scenario())
    (line,) = [json.loads(x) for x in r.text.splitlines()]
    assert "prefill worker p1" in line["error"] and "UNAVAILABLE" in line["error"]
    assert decode.finished == [] and len(decode.requests) <= 1


def test_decode_worker_dying_mid_stream_ends_with_error_line(model, tokens):
    async def scenario():
        async with coordinator_harness(model) as h:
            await h.add_worker("d1", "decode", Script(tokens=tokens, die_after=3))
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                lines = await chat_lines(client, h.url)
            return lines, h.coordinator.registry.get("d1")

    lines, record = run(scenario())
    assert [line["done"] for line in lines[:-1]] == [False] * (len(lines) - 1)
    assert "decode worker d1" in lines[-1]["error"]
    assert "UNAVAILABLE" in lines[-1]["error"] and "no live worker" in lines[-1]["error"]
    assert record.alive is False


def test_decode_worker_dying_mid_stream_migrates_to_another(model, tokens):
    async def scenario():
        async with coordinator_harness(model) as h:
            await h.add_worker("d1", "decode", Script(tokens=tokens, die_after=3))
            # d2 will be asked to continue after the 3 tokens d1 streamed.
            d2 = await h.add_worker("d2", "decode", Script(tokens=tokens[3:]),
                                    num_blocks=50)  # fewer free blocks: d1 is chosen first
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                lines = await chat_lines(client, h.url)
            return d2, lines, h.coordinator.registry.get("d1")

    d2, lines, record = run(scenario())
    assert "error" not in lines[-1]
    assert "".join(line["message"]["content"] for line in lines) == TEXT
    assert lines[-1]["eval_count"] == len(tokens)
    assert lines[-1]["tandem"]["decode_worker"] == "d2"
    assert record.alive is False
    (moved,) = d2.requests
    assert list(moved.prompt_token_ids)[-3:] == tokens[:3]  # prompt + what was generated
    assert moved.num_prior_output_tokens == 3  # output to its grammar, prompt to the model
    assert moved.max_tokens == model.context_len - prompt_len(model) - 3


def test_a_live_worker_registering_again_mid_stream_loses_no_stream(model, tokens, monkeypatch):
    """A wrong death verdict: d1 registers again while it streams. The registry retires d1's
    old channel, which ends the call under the flow with CancelledError (grpc.aio's way); the
    flow takes that as a worker failure and moves the request on: the client sees the whole
    answer and a done line, never a 500 or a cut stream."""
    from coordinator import registry as registry_module

    def retire_now(channel):
        asyncio.get_running_loop().create_task(channel.close(grace=0.05))

    monkeypatch.setattr(registry_module, "_close_later", retire_now)

    async def scenario():
        async with coordinator_harness(model) as h:
            d1 = await h.add_worker("d1", "decode", Script(tokens=tokens, pause_after=3))
            d2 = await h.add_worker("d2", "decode", Script(tokens=tokens[3:]),
                                    num_blocks=50)  # fewer free blocks: d1 is chosen first
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                lines = []
                async with client.stream("POST", f"{h.url}/api/chat",
                                         json={"model": "tiny", "messages": MESSAGES}) as r:
                    async for line in r.aiter_lines():
                        lines.append(json.loads(line))
                        if len(lines) == 3:
                            assert (await d1.register()).accepted  # the same live worker
            return d1, d2, lines

    d1, d2, lines = run(scenario())
    assert "error" not in lines[-1] and lines[-1]["done"] is True
    assert "".join(line["message"]["content"] for line in lines) == TEXT
    assert lines[-1]["tandem"]["migrations"] == 1 and lines[-1]["tandem"]["decode_worker"] == "d2"
    assert d1.cancelled == [d1.requests[0].request_id]


def test_stop_string_ends_the_stream_and_cancels_the_worker(model, tokens):
    async def scenario():
        async with coordinator_harness(model) as h:
            decode = await h.add_worker("d1", "decode",
                                        Script(tokens=tokens + tokens * 20, token_delay_s=0.02))
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                lines = await chat_lines(client, h.url, options={"stop": ["world"]})
            await wait_until(lambda: decode.cancelled, "the worker to see the cancellation")
            return decode, lines

    decode, lines = run(scenario())
    assert "".join(line["message"]["content"] for line in lines) == "Hello "
    assert lines[-1]["done_reason"] == "stop"
    assert decode.cancelled == [decode.requests[0].request_id] and decode.finished == []


def test_root_and_metrics(model, tokens):
    async def scenario():
        async with coordinator_harness(model, prefill_threshold=0) as h:
            await h.add_worker("p1", "prefill", Script(tokens=tokens))
            await h.add_worker("d1", "decode", Script(tokens=tokens))
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                await chat_lines(client, h.url)
                return (await client.get(f"{h.url}/"), await client.head(f"{h.url}/"),
                        (await client.get(f"{h.url}/metrics")).text,
                        (await client.get(f"{h.url}/internal/workers")).json())

    get, head, metrics, workers = run(scenario())
    assert get.status_code == head.status_code == 200 and get.text == "Ollama is running"
    tiny = '{model_name="tiny"}'
    assert f"vllm:time_to_first_token_seconds_count{tiny} 1.0" in metrics
    assert f"vllm:inter_token_latency_seconds_count{tiny} {float(len(tokens) - 1)}" in metrics
    for series in (f"vllm:request_time_per_output_token_seconds_count{tiny} 1.0",
                   f"vllm:e2e_request_latency_seconds_count{tiny} 1.0",
                   f"vllm:request_queue_time_seconds_count{tiny} 1.0",
                   'tandem_live_workers{role="prefill"} 1.0',
                   'tandem_live_workers{role="decode"} 1.0', "tandem_queue_depth 0.0",
                   'tandem_worker_kv_blocks_free{worker="d1"} 100.0'):
        assert series in metrics, series
    assert workers["live"] == {"prefill": 1, "decode": 1, "colocated": 0}


def test_the_ollama_python_client_works_unchanged(model, tokens):
    import ollama

    async def scenario():
        async with coordinator_harness(model, prefill_threshold=0) as h:
            await h.add_worker("p1", "prefill", Script(tokens=tokens))
            await h.add_worker("d1", "decode", Script(tokens=tokens))
            client = ollama.AsyncClient(host=h.url, timeout=DEADLINE_S)
            whole = await client.chat(model="tiny", messages=MESSAGES)
            parts = [part async for part in await client.chat(model="tiny", messages=MESSAGES,
                                                                 stream=True)]
            with pytest.raises(ollama.ResponseError) as info:
                await client.chat(model="missing", messages=MESSAGES)
            return whole, parts, info.value

    whole, parts, error = run(scenario())
    assert whole.message.content == TEXT and whole.done_reason == "stop"
    assert whole.eval_count == len(tokens) and whole.prompt_eval_count == prompt_len(model)
    assert "".join(p.message.content for p in parts) == TEXT and parts[-1].done
    assert error.status_code == 404 and "model 'missing' not found" in error.error


def test_api_ps_lists_the_model_only_while_a_worker_serves_it(model, tokens):
    async def scenario():
        async with coordinator_harness(model) as h:
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                before = (await client.get(f"{h.url}/api/ps")).json()
                await h.add_worker("d1", "decode", Script(tokens=tokens))
                after = (await client.get(f"{h.url}/api/ps")).json()
            return before, after

    before, after = run(scenario())
    assert before == {"models": []}
    assert [m["name"] for m in after["models"]] == ["tiny:latest"]


def test_a_chat_longer_than_its_context_drops_its_oldest_messages(model, tokens):
    """Ollama's truncate (default true): the oldest non-system messages go, the fewest that
    make the chat fit num_ctx, and the answer says how much was dropped; truncate false is the
    context-length 400; a chat whose last message alone overflows is a 400 either way."""
    from coordinator.prompts import chat_prompt_ids

    system = {"role": "system", "content": "You are terse."}
    turns = [{"role": "user" if i % 2 == 0 else "assistant",
              "content": f"turn {i}: the river"} for i in range(12)]
    messages = [system, *turns, {"role": "user", "content": "And now?"}]
    full = len(chat_prompt_ids(model, messages))
    num_ctx = min(full // 2, model.context_len)
    assert full >= model.context_len  # the whole chat overflows the model itself
    kept = next(n for n in range(1, len(turns) + 1)  # the fewest dropped that fit
                if len(chat_prompt_ids(model, [system, *turns[n:], messages[-1]])) < num_ctx)

    async def scenario():
        async with coordinator_harness(model) as h:
            d1 = await h.add_worker("d1", "decode", Script(tokens=tokens))
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                body = {"model": "tiny", "messages": messages, "stream": False,
                        "options": {"num_ctx": num_ctx}}
                fitted = (await client.post(f"{h.url}/api/chat", json=body)).json()
                refused = await client.post(f"{h.url}/api/chat", json={**body, "truncate": False})
                huge = {**body, "messages": [system, {"role": "user", "content": "x " * full}]}
                overflow = await client.post(f"{h.url}/api/chat", json=huge)
            return d1, fitted, refused, overflow

    d1, fitted, refused, overflow = run(scenario())
    assert fitted.get("done") is True, fitted
    assert fitted["message"]["content"] == TEXT
    assert fitted["tandem"]["truncated_messages"] == kept
    sent = list(d1.requests[0].prompt_token_ids)
    assert sent == chat_prompt_ids(model, [system, *turns[kept:], messages[-1]])
    assert fitted["tandem"]["truncated_tokens"] == full - len(sent)
    assert fitted["prompt_eval_count"] == len(sent) < num_ctx
    assert refused.status_code == 400 and "context" in refused.json()["error"]
    assert overflow.status_code == 400


def test_embeddings_go_to_a_prefill_worker_when_one_is_live(model, tokens):
    """Compute-bound prompt passes stall no decode batch on a prefill worker; with none live,
    the decode worker embeds in local-prefill chunks."""
    async def scenario():
        async with coordinator_harness(model) as h:
            d1 = await h.add_worker("d1", "decode", Script(tokens=tokens))
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                alone = await client.post(f"{h.url}/api/embed", json={"model": "tiny", "input": "hi"})
                p1 = await h.add_worker("p1", "prefill", Script(tokens=tokens))
                both = await client.post(f"{h.url}/api/embed", json={"model": "tiny", "input": "hi"})
                last = await client.post(f"{h.url}/v1/embeddings", json={
                    "model": "tiny", "input": "hi", "pooling": "last"})
            return d1, p1, alone, both, last, h.coordinator.config

    d1, p1, alone, both, last, config = run(scenario())
    assert alone.status_code == both.status_code == last.status_code == 200
    [on_decode] = [r for r in d1.requests if r.DESCRIPTOR.name == "EmbedRequest"]
    on_prefill, with_last = [r for r in p1.requests if r.DESCRIPTOR.name == "EmbedRequest"]
    assert on_decode.max_chunk_tokens == config.local_chunk_size
    assert on_prefill.max_chunk_tokens == config.chunk_size
    assert on_decode.pooling == on_prefill.pooling == pb.EmbedRequest.POOLING_MEAN
    assert with_last.pooling == pb.EmbedRequest.POOLING_LAST


def test_a_model_whose_file_names_last_pooling_embeds_so_by_default(model, tokens):
    """ModelConfig.pooling (GGUF `<arch>.pooling_type`) is the routes' default; a request's
    `pooling` still chooses."""
    last_model = replace(model, config=replace(model.config, pooling=Pooling.LAST))

    async def scenario():
        async with coordinator_harness(last_model) as h:
            d1 = await h.add_worker("d1", "decode", Script(tokens=tokens))
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                for body in ({}, {"pooling": "mean"}):
                    r = await client.post(f"{h.url}/api/embed",
                                          json={"model": "tiny", "input": "hi", **body})
                    assert r.status_code == 200, r.text
            return d1

    d1 = run(scenario())
    sent = [r.pooling for r in d1.requests if r.DESCRIPTOR.name == "EmbedRequest"]
    assert sent == [pb.EmbedRequest.POOLING_LAST, pb.EmbedRequest.POOLING_MEAN]
