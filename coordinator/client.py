"""A small Python client for tandem's gRPC API (proto/tandem.proto).

    from coordinator.client import TandemClient

    with TandemClient("127.0.0.1:50051") as client:
        for piece in client.generate("smollm2", "Why is the sky blue?", options={"seed": 1}):
            print(piece.response, end="", flush=True)
        reply = client.chat_text("smollm2", [{"role": "user", "content": "Hi!"}])
        print(client.health())   # "SERVING"

Streams are iterators of the generated messages; the last one has `done` set and carries the
figures. Leaving an iteration early (break, exception) cancels the request on the server.
Options take Ollama's names; errors raise grpc.RpcError with the server's status and message.
A server started with an API key wants it on every call: `TandemClient(target, api_key=KEY)`
sends it as the metadata `authorization: Bearer KEY`. A server started with --api-tls-cert
serves TLS only: `TandemClient(target, ca_file="ca.pem")` checks its certificate against that
CA (`tls=True` alone: against the system's CAs; `server_name` when the certificate names
another host than the target's).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.rpc import tandem_pb2 as pb
from common.rpc import tandem_pb2_grpc as pb_grpc

__all__ = ["TandemClient", "pb"]


def make_options(options: Mapping[str, Any] | None) -> pb.Options:
    """Ollama-style options -> the Options message (unknown keys are a ValueError here)."""
    message = pb.Options()
    for key, value in (options or {}).items():
        if key not in pb.Options.DESCRIPTOR.fields_by_name:
            raise ValueError(f"unknown option {key!r}")
        if key == "stop":
            message.stop.extend([value] if isinstance(value, str) else value)
        elif value is not None:
            setattr(message, key, value)
    return message


class TandemClient:
    def __init__(self, target: str = "127.0.0.1:50051", timeout_s: float | None = None,
                 api_key: str | None = None, *, tls: bool = False, ca_file: str | None = None,
                 server_name: str = "") -> None:
        if tls or ca_file:
            roots = Path(ca_file).read_bytes() if ca_file else None  # None: the system's CAs
            options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
            self.channel = grpc.secure_channel(
                target, grpc.ssl_channel_credentials(root_certificates=roots), options)
        else:
            self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.TandemStub(self.channel)
        self.timeout_s = timeout_s  # deadline of each call; None = none
        # Metadata, not call credentials: gRPC sends those over TLS channels only.
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None

    def __enter__(self) -> TandemClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def generate(self, model: str, prompt: str, *, system: str = "", raw: bool = False,
                 options: Mapping[str, Any] | None = None,
                 context: Sequence[int] = ()) -> Iterator[pb.GenerateResponse]:
        request = pb.GenerateRequest(model=model, prompt=prompt, system=system, raw=raw,
                                     options=make_options(options), context=list(context))
        return self._stream(self.stub.Generate(request, timeout=self.timeout_s,
                                               metadata=self.metadata))

    def chat(self, model: str, messages: Sequence[Mapping[str, str]], *,
             options: Mapping[str, Any] | None = None) -> Iterator[pb.ChatResponse]:
        request = pb.ChatRequest(
            model=model, options=make_options(options),
            messages=[pb.Message(role=m["role"], content=m.get("content", "")) for m in messages])
        return self._stream(self.stub.Chat(request, timeout=self.timeout_s,
                                           metadata=self.metadata))

    def generate_text(self, model: str, prompt: str, **kwargs: Any) -> str:
        return "".join(r.response for r in self.generate(model, prompt, **kwargs))

    def chat_text(self, model: str, messages: Sequence[Mapping[str, str]], **kwargs: Any) -> str:
        return "".join(r.message.content for r in self.chat(model, messages, **kwargs))

    def list_models(self) -> list[pb.Model]:
        return list(self.stub.ListModels(pb.ListModelsRequest(), timeout=self.timeout_s,
                                         metadata=self.metadata).models)

    def health(self, service: str = "") -> str:
        """"SERVING" while the server has a live decode worker, else "NOT_SERVING"."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        response = stub.Check(health_pb2.HealthCheckRequest(service=service),
                              timeout=self.timeout_s)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    @staticmethod
    def _stream(call) -> Iterator[Any]:
        try:
            yield from call
        finally:
            call.cancel()  # a no-op after the last message; cancels the request if left early
