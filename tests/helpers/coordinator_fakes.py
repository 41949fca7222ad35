"""Scripted fake workers and a coordinator harness for the coordinator tests.

The fakes are real grpc.aio servers implementing worker.proto (PrefillWorker / DecodeWorker)
that register with the coordinator's Registry over gRPC and heartbeat, like the real workers.
Each one records what it was asked and whether the coordinator cancelled its calls, and can be
told to fail (UNAVAILABLE) at a chosen point.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc

from coordinator.config import CoordinatorConfig
from coordinator.model import ServedModel, load_served_model
from coordinator.server import uvicorn_server
from coordinator.service import Coordinator
from common.model_store import ModelStore
from common.logprobs import TokenLogprob
from common.rpc import worker_pb2 as pb
from common.rpc import worker_pb2_grpc as pb_grpc
from common.wire import logprobs_to_proto
from common.grpc_guard import guarded
from reliability.model_factory import write_tiny_tokenizer

LAYOUT = "layout-A"
DEADLINE_S = 20.0  # every wait in these tests ends by then
EMBED_SIZE = 64  # the fake decode's vectors: make_tiny_model_dir's hidden_size


def run(coro, timeout: float = 60.0):
    """Run a test coroutine with a hard deadline."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_tiny_model_dir(dir: Path, max_position: int = 128) -> Path:
    """config.json + tokenizer only: all the coordinator reads."""
    dir.mkdir(parents=True, exist_ok=True)
    (dir / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 320,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
        "max_position_embeddings": max_position, "bos_token_id": 1, "eos_token_id": 2}))
    write_tiny_tokenizer(dir, 320)
    return dir


async def wait_until(predicate, what: str, timeout: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


@dataclass
class Script:
    """What a fake decode/prefill worker does with each request."""

    tokens: list[int] = field(default_factory=list)  # the whole output; [0] is the first token
    finish_reason: str = "stop"
    token_delay_s: float = 0.0
    die_after: int | None = None  # decode: abort UNAVAILABLE after this many streamed tokens
    unavailable: bool = False  # prefill: every Prefill fails UNAVAILABLE
    hang: bool = False  # decode: after the first event, stream nothing until cancelled
    pause_after: int | None = None  # decode: after this many streamed tokens, stream nothing more
    kv_bytes_received: int = 0  # decode: reported on the first event (Tokens.kv_bytes_received)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (prefill result / first event)
    # Parallel to `tokens`: each token's logprob entry, sent only when the request asked for
    # logprobs (SamplingOptions.logprobs set); [0] travels in the PrefillResult.
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def logprobs_for(self, request, index: int) -> list:
        if not request.sampling.HasField("logprobs") or index >= len(self.logprobs):
            return []
        entry = self.logprobs[index]  # as a worker would: the request's n alternatives
        return logprobs_to_proto([replace(entry, top=entry.top[:request.sampling.logprobs])])

    @staticmethod
    def prompt_logprobs_for(request) -> list:
        """When the request asked (SamplingOptions.prompt_logprobs): prompt token i's entry,
        for i >= 1, is logprob -i / 10 with alternatives (token 7, -5.0 - i) and (8, -6.0)."""
        if not request.sampling.HasField("prompt_logprobs"):
            return []
        n = request.sampling.prompt_logprobs
        return logprobs_to_proto([TokenLogprob(t, -i / 10, ((7, -5.0 - i), (8, -6.0))[:n])
                                  for i, t in enumerate(request.prompt_token_ids) if i])


class FakeWorker:
    """A fake worker process: gRPC server + registration + heartbeats."""

    def __init__(self, worker_id: str, role: str, registry_address: str, fingerprint: str,
                 script: Script, layout: str = LAYOUT, num_blocks: int = 100,
                 max_batched_tokens: int = 512) -> None:
        self.worker_id, self.role = worker_id, role
        self.registry_address = registry_address
        self.fingerprint = fingerprint
        self.script = script
        self.layout = layout
        self.status = pb.WorkerStatus(worker_id=worker_id, role=role, num_blocks=num_blocks,
                                      num_free_blocks=num_blocks, block_size=16,
                                      max_num_batched_tokens=max_batched_tokens)
        self.requests: list = []  # GenerateRequest / PrefillRequest received
        # decode: what arrived over the (simulated) KV channel per transfer: the first token
        # from the prefill worker, or its error
        self.kv_arrivals: list[tuple[str, int | None, str]] = []
        self.cancelled: list[str] = []  # request ids whose call the coordinator cancelled
        self.finished: list[str] = []  # request ids whose call ended normally
        self.register_response: pb.RegisterResponse | None = None
        self.heartbeating = True
        self.status_answers = True  # False with heartbeating False: a hung worker
        # SetResident (keep_alive): each call's `resident`, in order; a load takes load_delay_s.
        self.residency_calls: list[bool] = []
        self.load_delay_s = 0.0
        self._started: dict[str, asyncio.Queue] = {}
        self.open_calls = 0  # Generate / Prefill calls running now
        self._server: grpc.aio.Server | None = None
        self._channel: grpc.aio.Channel | None = None
        self._beat: asyncio.Task | None = None
        self.address = ""

    async def start(self) -> FakeWorker:
        self._server = grpc.aio.server(interceptors=guarded())  # as the real workers
        if self.role == "prefill":
            pb_grpc.add_PrefillWorkerServicer_to_server(_Prefill(self), self._server)
        else:
            pb_grpc.add_DecodeWorkerServicer_to_server(_Decode(self), self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{port}"
        await self._server.start()
        self._channel = grpc.aio.insecure_channel(self.registry_address)
        await self.register()
        if self.register_response.accepted:
            self._beat = asyncio.create_task(self._heartbeats())
        return self

    async def register(self) -> pb.RegisterResponse:
        stub = pb_grpc.RegistryStub(self._channel)
        self.register_response = await stub.Register(pb.WorkerInfo(
            worker_id=self.worker_id, role=self.role, address=self.address,
            kv_endpoint=f"tcp://{self.address}-kv" if self.role != "prefill" else "",
            kv_backend="zmq", model_fingerprint=self.fingerprint,
            kv_layout_fingerprint=self.layout, status=self.status), timeout=DEADLINE_S)
        return self.register_response

    async def _heartbeats(self) -> None:
        stub = pb_grpc.RegistryStub(self._channel)
        while True:
            await asyncio.sleep(self.register_response.heartbeat_interval_s)
            if not self.heartbeating:
                continue
            answer = await stub.Heartbeat(pb.HeartbeatRequest(worker_id=self.worker_id,
                                                              status=self.status),
                                          timeout=DEADLINE_S)
            if not answer.known:
                await self.register()

    @property
    def resident(self) -> bool:
        return not self.status.unloaded

    async def set_resident(self, request: pb.ResidencyRequest, context) -> pb.ResidencyResult:
        """As a real worker: dropping the weights with calls open is refused."""
        self.residency_calls.append(request.resident)
        if not request.resident and self.open_calls:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "requests are open")
        seconds = 0.0
        if request.resident and not self.resident:
            await asyncio.sleep(self.load_delay_s)
            seconds = self.load_delay_s
        self.status.unloaded = not request.resident
        return pb.ResidencyResult(resident=request.resident, load_seconds=seconds)

    async def refuse_unloaded(self, context) -> None:
        if not self.resident:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the model is unloaded")

    async def stop(self) -> None:
        if self._beat is not None:
            self._beat.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await self._beat
        if self._server is not None:
            await self._server.stop(grace=None)
        if self._channel is not None:
            await self._channel.close()


_KV_CHANNELS: dict[str, asyncio.Queue] = {}


def kv_channel(transfer_id: str) -> asyncio.Queue:
    """The fakes' stand-in for a KV transfer: (first token, error) from prefill to decode."""
    return _KV_CHANNELS.setdefault(transfer_id, asyncio.Queue())


class _Decode(pb_grpc.DecodeWorkerServicer):
    def __init__(self, worker: FakeWorker) -> None:
        self.w = worker

    async def Generate(self, request: pb.GenerateRequest, context):
        w, script = self.w, self.w.script
        w.requests.append(request)
        await w.refuse_unloaded(context)
        rid = request.request_id
        w.open_calls += 1
        try:
            tokens = list(script.tokens)
            skip = 0  # tokens the prefill worker sent
            if request.remote_prefill:
                # The direct handshake, simulated: the fake prefill worker hands the first
                # token (or its failure) to this transfer id, as the last layer's KV would.
                first, error = await asyncio.wait_for(kv_channel(request.transfer_id).get(), DEADLINE_S)
                w.kv_arrivals.append((request.transfer_id, first, error))
                if error:
                    yield pb.GenerateEvent(tokens=pb.Tokens(finished=True, finish_reason="error",
                                                            error=error))
                    return
                tokens, skip = tokens[1:], 1  # the first token came from the prefill worker
            if script.hang:
                await asyncio.sleep(DEADLINE_S)
            for i, token in enumerate(tokens):
                if script.die_after is not None and i >= script.die_after:
                    self.w.heartbeating = False  # a crashed process sends none (else it
                    # registers again once declared dead, and the test sees it alive)
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "decode worker crashed")
                if script.pause_after is not None and i >= script.pause_after:
                    await asyncio.sleep(DEADLINE_S)  # until the call is cancelled
                await asyncio.sleep(script.token_delay_s)
                last = i == len(tokens) - 1
                yield pb.GenerateEvent(tokens=pb.Tokens(
                    token_ids=[token], finished=last,
                    finish_reason=script.finish_reason if last else "",
                    kv_bytes_received=script.kv_bytes_received if i == 0 else 0,
                    num_cached_tokens=script.num_cached_tokens if i == 0 else 0,
                    logprobs=script.logprobs_for(request, i + skip),
                    prompt_logprobs=(script.prompt_logprobs_for(request)
                                     if i == 0 and not request.remote_prefill else [])))
            if not tokens:
                yield pb.GenerateEvent(tokens=pb.Tokens(finished=True,
                                                        finish_reason=script.finish_reason))
            w.finished.append(rid)
        except asyncio.CancelledError:
            w.cancelled.append(rid)
            raise
        finally:
            w.open_calls -= 1

    async def SetResident(self, request, context):
        return await self.w.set_resident(request, context)

    async def Embed(self, request: pb.EmbedRequest, context):
        return await fake_embed(self.w, request, context)

    async def Status(self, request, context):
        if not self.w.status_answers:
            await asyncio.sleep(DEADLINE_S)  # hung: the probe's deadline ends it
        return self.w.status


async def fake_embed(w: FakeWorker, request: pb.EmbedRequest, context) -> pb.EmbedResult:
    """Either fake worker's Embed: a vector of EMBED_SIZE (make_tiny_model_dir's hidden size)
    per input: its token count, then zeros (unit length when normalize)."""
    w.requests.append(request)
    await w.refuse_unloaded(context)
    if not w.status_answers:
        await asyncio.sleep(DEADLINE_S)  # hung: it answers nothing
    return pb.EmbedResult(embeddings=[
        pb.Embedding(values=[1.0 if request.normalize else float(len(ids.token_ids))]
                     + [0.0] * (EMBED_SIZE - 1)) for ids in request.inputs])


class _Prefill(pb_grpc.PrefillWorkerServicer):
    def __init__(self, worker: FakeWorker) -> None:
        self.w = worker

    async def Prefill(self, request: pb.PrefillRequest, context):
        self.w.requests.append(request)
        await self.w.refuse_unloaded(context)
        if self.w.script.unavailable:
            self.w.heartbeating = False  # as a crashed process (see _Decode)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "prefill worker crashed")
        try:
            await asyncio.sleep(self.w.script.token_delay_s)
        except asyncio.CancelledError:
            # Cancelled by the coordinator, which cancels the decode call too (a real prefill
            # worker's abort would also reach the decode worker over the KV channel).
            self.w.cancelled.append(request.request_id)
            raise
        first = self.w.script.tokens[0]
        kv_channel(request.transfer_id).put_nowait((first, ""))
        return pb.PrefillResult(first_token=first, prefill_seconds=0.01,
                                num_cached_tokens=self.w.script.num_cached_tokens,
                                logprobs=self.w.script.logprobs_for(request, 0),
                                prompt_logprobs=self.w.script.prompt_logprobs_for(request))

    async def Embed(self, request: pb.EmbedRequest, context):
        return await fake_embed(self.w, request, context)

    async def SetResident(self, request, context):
        return await self.w.set_resident(request, context)

    async def Status(self, request, context):
        if not self.w.status_answers:
            await asyncio.sleep(DEADLINE_S)  # hung: the probe's deadline ends it
        return self.w.status


@dataclass
class Harness:
    coordinator: Coordinator
    url: str
    registry_address: str
    workers: list[FakeWorker] = field(default_factory=list)

    async def add_worker(self, worker_id: str, role: str, script: Script, **kwargs) -> FakeWorker:
        fingerprint = kwargs.pop("fingerprint", self.coordinator.model.fingerprint)
        worker = FakeWorker(worker_id, role, self.registry_address, fingerprint, script, **kwargs)
        self.workers.append(worker)
        return await worker.start()


# Heartbeats every 0.1 s, dead after 3 s of silence: a GC pause or a descheduled test process
# on a loaded 2-core machine must not kill a healthy fake worker.
DEFAULT_TEST_CONFIG = dict(heartbeat_interval_s=0.1, heartbeat_misses=30, queue_timeout_s=5.0,
                           prefill_timeout_s=DEADLINE_S,
                           control_timeout_s=DEADLINE_S, token_timeout_s=DEADLINE_S,
                           request_timeout_s=60.0,
                           # no wait for a worker to load (a test that wants one sets it)
                           load_timeout_s=0.0)


@contextlib.asynccontextmanager
async def coordinator_harness(model: ServedModel | list[ServedModel], store: ModelStore | None = None,
                              **overrides) -> AsyncIterator[Harness]:
    """The real coordinator (HTTP on uvicorn + Registry gRPC) on free ports, in this loop;
    `store` backs its model routes (/api/pull, /api/copy, ...). A list of models: one
    coordinator serving each (the first is the default; add_worker(fingerprint=) places a
    fake worker with another)."""
    config = CoordinatorConfig(port=free_port(), registry_port=0,
                               **{**DEFAULT_TEST_CONFIG, **overrides})
    coordinator = Coordinator(config, model, store)
    server = uvicorn_server(coordinator, loop="asyncio", graceful_timeout_s=2.0)
    server.config.log_level = "warning"
    task = asyncio.create_task(server.serve())
    harness = None
    try:
        await wait_until(lambda: server.started or task.done(), "uvicorn to start")
        if task.done():
            task.result()
        scheme = "https" if config.api_tls else "http"
        harness = Harness(coordinator, f"{scheme}://127.0.0.1:{config.port}",
                          f"127.0.0.1:{coordinator.registry_port}")
        yield harness
    finally:
        if harness is not None:
            for worker in harness.workers:
                await worker.stop()
        server.should_exit = True
        await asyncio.wait_for(task, DEADLINE_S)


@contextlib.contextmanager
def harness_on_thread(model: ServedModel, setup: Callable[[Harness], Awaitable[object]],
                      store: ModelStore | None = None, **overrides) -> Iterator[object]:
    """A coordinator_harness on its own thread and event loop, for synchronous tests (module
    fixtures, blocking clients): yields what `await setup(harness)` returned (workers added,
    addresses), and stops the harness and its workers on exit."""
    started, state = threading.Event(), {}

    async def main() -> None:
        state["loop"], state["stop"] = asyncio.get_running_loop(), asyncio.Event()
        try:
            async with coordinator_harness(model, store, **overrides) as h:
                state["value"] = await setup(h)
                started.set()
                await state["stop"].wait()
        finally:
            started.set()

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    assert started.wait(DEADLINE_S) and "value" in state, "the coordinator did not start"
    try:
        yield state["value"]
    finally:
        state["loop"].call_soon_threadsafe(state["stop"].set)
        thread.join(DEADLINE_S)


def load_model(dir: Path) -> ServedModel:
    return load_served_model(dir, "tiny")


__all__ = ["Harness", "Script", "FakeWorker", "coordinator_harness", "free_port", "load_model",
           "make_tiny_model_dir", "run", "wait_until"]


def openai_refusal(model: ServedModel, extra_body: dict, chat: bool = True):
    """The openai.BadRequestError a coordinator (no workers) answers a chat (or completion)
    request carrying `extra_body`, through the real openai client."""
    import openai

    async def scenario():
        async with coordinator_harness(model, prefill_threshold=10_000) as h:
            async with openai.AsyncOpenAI(base_url=h.url + "/v1", api_key="x",
                                          max_retries=0) as oai:
                create = (functools.partial(oai.chat.completions.create,
                                            messages=[{"role": "user", "content": "Hi"}])
                          if chat else functools.partial(oai.completions.create, prompt="x"))
                try:
                    await create(model=model.name, extra_body=extra_body)
                except openai.BadRequestError as exc:
                    return exc
                raise AssertionError(f"{extra_body} was not refused")

    return run(scenario())
