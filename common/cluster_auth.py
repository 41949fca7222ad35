"""The internal plane's credentials: the cluster secret and the mutual-TLS files, shared by the
coordinator and every worker, and what each gRPC channel and server of the plane does with them.

    secret   --cluster-secret-file PATH, else the TANDEM_CLUSTER_SECRET variable (never a flag
             holding the secret itself: ps shows command lines). Entry points read them.
    TLS      --tls-cert, --tls-key, --tls-ca (PEM files; else TANDEM_TLS_CERT/_KEY/_CA): every
             internal gRPC server requires a client certificate signed by the CA, every channel
             presents ours and checks the server's. Without them the plane is plaintext, which
             is meant for loopback or a trusted network.

With a secret, every internal gRPC call carries `x-tandem-proof: TS.NONCE.HEAD.BODY`, where

    HEAD = HMAC-SHA256(k, "METHOD|TS|NONCE")
    BODY = HMAC-SHA256(k, "METHOD|TS|NONCE|" + hex SHA-256 of the request message)

k is derived from the secret and the request message is serialized deterministically (every
internal call has a unary request: worker.proto). An HMAC rather than the secret itself:
without TLS a sniffer sees proofs, and a proof opens only the one method it names, with the one
request it was made for, once, within PROOF_WINDOW_S of TS (the hosts' clocks may disagree by
up to that much), never the secret. Servers remember the nonces they admitted until their
proofs go stale (common/nonce_log.py), so a captured proof replayed as it was is refused
("replayed"), and replayed with another body too ("other_request"; HEAD tells that apart from
a wrong secret). A call with a streaming request would be bound to method, time and nonce only
(none exists in the internal plane). Proofs of older tandem versions (TS.NONCE.MAC, no body)
are refused as malformed: every process of a cluster runs this same version.
Servers refuse a call without a valid proof UNAUTHENTICATED and count it by method and
reason (ClusterAuth.refused, common/refused_calls.py; the health service stays open, for probes); the Registry thus refuses a worker without the secret, and a worker refuses
a caller that is not the coordinator. The Registry's answer to Register carries a proof of its
own (for REGISTER_REPLY and the worker's WorkerInfo, in the trailing metadata), so a worker
also refuses to serve a coordinator without the secret (a misconfigured or rogue one). The KV
plane's keys derive from the same secret (kvtransfer/auth.py).

Default (no secret, no TLS): everything is as before, plaintext and open.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from common.grpc_guard import screened
from common.nonce_log import NonceLog
from common.refused_calls import RefusedCalls

log = logging.getLogger(__name__)

MIN_SECRET_BYTES = 16
PROOF_HEADER = "x-tandem-proof"
PROOF_WINDOW_S = 300.0
OPEN_PREFIX = "/grpc.health.v1.Health/"  # probes (k8s, launchers) need no proof
REGISTER_METHOD = "/tandem.worker.Registry/Register"
# What the Registry's reply proves: not a method name, so it cannot open a call.
REGISTER_REPLY = "tandem.worker.Registry/Register#reply"
ENV_SECRET = "TANDEM_CLUSTER_SECRET"
ENV_TLS = {"cert": "TANDEM_TLS_CERT", "key": "TANDEM_TLS_KEY", "ca": "TANDEM_TLS_CA"}


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"{what} {path} does not exist") from None
    except OSError as exc:
        raise ValueError(f"{what} {path} is unreadable: {exc.strerror}") from None


@dataclass(frozen=True)
class TLSFiles:
    """Mutual TLS from PEM files, read and checked once at start-up."""

    cert: Path
    key: Path
    ca: Path
    # The name checked in a server's certificate instead of the host dialled (one cluster
    # certificate for every host, e.g. "tandem.internal"); empty = the host itself.
    server_name: str = ""
    cert_pem: bytes = field(init=False, repr=False)
    key_pem: bytes = field(init=False, repr=False)
    ca_pem: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for name, marker in (("cert", b"CERTIFICATE"), ("key", b"PRIVATE KEY"), ("ca", b"CERTIFICATE")):
            path = Path(getattr(self, name))
            data = _read(path, f"TLS {name} file")
            if b"-----BEGIN" not in data or marker not in data:
                raise ValueError(f"TLS {name} file {path} holds no PEM {marker.decode().lower()}")
            object.__setattr__(self, name, path)
            object.__setattr__(self, f"{name}_pem", data)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key_pem, self.cert_pem)],
                                           root_certificates=self.ca_pem, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca_pem,
                                            private_key=self.key_pem, certificate_chain=self.cert_pem)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


@dataclass(frozen=True)
class ClusterAuth:
    secret: bytes | None = field(default=None, repr=False)  # None = no secret; never logged
    tls: TLSFiles | None = None
    # Calls this process's servers refused, by method and reason (for /metrics and heartbeats).
    refused: RefusedCalls = field(default_factory=RefusedCalls, repr=False, compare=False)
    # Nonces of the proofs this process admitted, until they go stale (no replay).
    nonces: NonceLog = field(default_factory=lambda: NonceLog(PROOF_WINDOW_S), repr=False,
                             compare=False)
    # The proofs' HMAC key, derived from the secret (b"" without one).
    _proof_key: bytes = field(init=False, repr=False, compare=False, default=b"")

    def __post_init__(self) -> None:
        if self.secret is not None and len(self.secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the cluster secret is too short ({len(self.secret)} bytes): use at "
                             f"least {MIN_SECRET_BYTES}, e.g. `openssl rand -hex 32`")
        if self.secret:
            object.__setattr__(self, "_proof_key",
                               hmac.new(self.secret, b"tandem-grpc-proof", hashlib.sha256).digest())

    @classmethod
    def from_sources(cls, secret_file: str | None = None, env: Mapping[str, str] | None = None,
                     tls_cert: str | None = None, tls_key: str | None = None,
                     tls_ca: str | None = None, tls_server_name: str = "") -> ClusterAuth:
        """From an entry point's flags and environment (flags win)."""
        env = os.environ if env is None else env
        secret: bytes | None = None
        if secret_file:
            secret = _read(Path(secret_file), "cluster secret file").strip()
            if not secret:
                raise ValueError(f"cluster secret file {secret_file} is empty")
        elif env.get(ENV_SECRET, "").strip():
            secret = env[ENV_SECRET].strip().encode()
        files = {"cert": tls_cert, "key": tls_key, "ca": tls_ca}
        files = {k: v or env.get(ENV_TLS[k], "").strip() or None for k, v in files.items()}
        given = [k for k, v in files.items() if v]
        if given and len(given) != 3:
            missing = ", ".join(f"--tls-{k}" for k in files if k not in given)
            raise ValueError(f"mutual TLS needs a certificate, its key and the CA: {missing} missing")
        tls = TLSFiles(Path(files["cert"]), Path(files["key"]), Path(files["ca"]),
                       tls_server_name) if given else None
        return cls(secret, tls)

    def describe(self) -> str:
        """For the start-up log line; never the secret."""
        return (f"cluster secret {'set' if self.secret else 'not set'}, "
                f"TLS {'mutual (' + str(self.tls.cert) + ')' if self.tls else 'off'}")

    # ---- proofs -----------------------------------------------------------------------------

    def proof(self, method: str, now: float | None = None, *, body: bytes = b"") -> str:
        """A proof that opens `method` once, for the request serialized as `body`."""
        ts = str(int(time.time() if now is None else now))
        nonce = secrets.token_hex(8)
        head, full = self._macs(method, ts, nonce, body)
        return f"{ts}.{nonce}.{head}.{full}"

    def check(self, method: str, proof: str | None, now: float | None = None, *,
              body: bytes = b"") -> str:
        """Why `proof` does not open `method` with `body` ("" when it does); nonces aside."""
        if not proof:
            return "no cluster proof: the caller has no cluster secret"
        try:
            ts, nonce, head, full = proof.split(".")
            age = abs((time.time() if now is None else now) - int(ts))
        except ValueError:
            return "malformed cluster proof"
        want_head, want_full = self._macs(method, ts, nonce, body)
        if not hmac.compare_digest(want_head, head):
            return "wrong cluster proof: the caller's cluster secret is a different one"
        if age > PROOF_WINDOW_S:
            return f"stale cluster proof ({age:.0f} s old; are the hosts' clocks apart?)"
        if not hmac.compare_digest(want_full, full):
            return "cluster proof of another request (replayed with a new body, or altered)"
        return ""

    def admit(self, method: str, proof: str | None, now: float | None = None, *,
              body: bytes = b"") -> str:
        """`check`, and the proof's first use: its nonce is remembered, a second use refused."""
        now = time.time() if now is None else now
        reason = self.check(method, proof, now, body=body)
        if not reason:
            ts, nonce = proof.split(".")[:2]
            if not self.nonces.first_use(nonce, int(ts), now):
                reason = "replayed cluster proof: its nonce opened a call already"
        return reason

    def _macs(self, method: str, ts: str, nonce: str, body: bytes) -> tuple[str, str]:
        head = f"{method}|{ts}|{nonce}"
        full = f"{head}|{hashlib.sha256(body).hexdigest()}"
        return tuple(hmac.new(self._proof_key, m.encode(), hashlib.sha256).hexdigest()
                     for m in (head, full))

    # ---- gRPC servers and channels ----------------------------------------------------------

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [ProofInterceptor(self)] if self.secret else []

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        if self.tls is not None:
            return server.add_secure_port(address, self.tls.server_credentials())
        return server.add_insecure_port(address)

    def aio_channel(self, target: str, options: list | None = None) -> grpc.aio.Channel:
        interceptors = proof_client_interceptors(self) if self.secret else None
        options = list(options or [])
        if self.tls is not None:
            return grpc.aio.secure_channel(target, self.tls.channel_credentials(),
                                           options + self.tls.channel_options(),
                                           interceptors=interceptors)
        return grpc.aio.insecure_channel(target, options, interceptors=interceptors)


def add_auth_args(parser) -> None:
    """The flags of every internal-plane process (coordinator, workers)."""
    parser.add_argument("--cluster-secret-file", default=None,
                        help=f"file holding the cluster secret (else ${ENV_SECRET}); with one, "
                             "only processes holding it may join or feed KV")
    parser.add_argument("--tls-cert", default=None, help=f"PEM certificate (else ${ENV_TLS['cert']})")
    parser.add_argument("--tls-key", default=None, help=f"PEM private key (else ${ENV_TLS['key']})")
    parser.add_argument("--tls-ca", default=None,
                        help=f"PEM CA that signed every peer's certificate (else ${ENV_TLS['ca']})")
    parser.add_argument("--tls-server-name", default="",
                        help="name to check in peers' certificates instead of their host")


def auth_from_args(args) -> ClusterAuth:
    return ClusterAuth.from_sources(args.cluster_secret_file, None, args.tls_cert, args.tls_key,
                                    args.tls_ca, args.tls_server_name)


def request_bytes(request) -> bytes:
    """What a proof's BODY covers: the request message, serialized deterministically (both
    ends run this version, so both serialize a message alike)."""
    return request.SerializeToString(deterministic=True)


class ProofInterceptor(grpc.aio.ServerInterceptor):
    """Ends every call without a valid, unused proof for its request UNAUTHENTICATED, except
    the health service's. The proof covers the request, so it is checked once the request has
    been read, before the method sees it."""

    def __init__(self, auth: ClusterAuth) -> None:
        self.auth = auth

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_PREFIX):
            return handler
        proof = dict(details.invocation_metadata or ()).get(PROOF_HEADER)
        if handler.request_streaming:  # method, time and nonce only (none in the plane)
            reason = self._admit(details.method, proof, b"")
            return refusal_handler(handler, reason) if reason else handler

        async def screen(request, context: grpc.aio.ServicerContext) -> None:
            reason = self._admit(details.method, proof, request_bytes(request))
            if reason:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

        return screened(handler, screen)

    def _admit(self, method: str, proof: str | None, body: bytes) -> str:
        reason = self.auth.admit(method, proof, body=body)
        if reason:
            log.warning("refused %s: %s", method, reason)
            self.auth.refused.add(method, reason)
        return reason


def refusal_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that aborts before reading any request."""

    async def refuse(request_or_iterator, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    for kind, make in (("unary_unary", grpc.unary_unary_rpc_method_handler),
                       ("unary_stream", grpc.unary_stream_rpc_method_handler),
                       ("stream_unary", grpc.stream_unary_rpc_method_handler),
                       ("stream_stream", grpc.stream_stream_rpc_method_handler)):
        if getattr(handler, kind) is not None:
            return make(refuse, request_deserializer=handler.request_deserializer,
                        response_serializer=handler.response_serializer)
    raise TypeError(f"unknown kind of gRPC handler: {handler!r}")


def _with_proof(auth: ClusterAuth, details: grpc.aio.ClientCallDetails,
                request) -> grpc.aio.ClientCallDetails:
    method = details.method.decode() if isinstance(details.method, bytes) else details.method
    proof = auth.proof(method, body=request_bytes(request))
    metadata = [*(details.metadata or ()), (PROOF_HEADER, proof)]
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata,
                                      details.credentials, details.wait_for_ready)


class _ProofUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, auth: ClusterAuth) -> None:
        self.auth = auth

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_with_proof(self.auth, details, request), request)


class _ProofUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, auth: ClusterAuth) -> None:
        self.auth = auth

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_with_proof(self.auth, details, request), request)


def proof_client_interceptors(auth: ClusterAuth) -> list:
    """Every internal call is unary-unary or unary-stream (worker.proto)."""
    return [_ProofUnaryUnary(auth), _ProofUnaryStream(auth)]
