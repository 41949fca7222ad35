"""TLS of the client-facing APIs (the Ollama/OpenAI HTTP API and the tandem.v1 gRPC API).

    --api-tls-cert PEM  --api-tls-key PEM   (python -m coordinator, tandem serve)

Server-side TLS only: clients check the server's certificate (against their CA file, or the
system's store); who a client is stays the API key's business (coordinator/access.py). These
files are separate from the internal plane's (common/cluster_auth.py): the public certificate
is usually a public CA's, for a public name, while the cluster's is a private CA's.

Both files are read and the pair is checked (the key must be the certificate's) once at
start-up, so a typo or a mismatched key is a one-line error before anything listens.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path

import grpc


@dataclass(frozen=True)
class ApiTLS:
    cert: Path  # PEM certificate chain, the server's certificate first
    key: Path  # PEM private key of that certificate (unencrypted: nobody types a passphrase)
    cert_pem: bytes = field(init=False, repr=False)
    key_pem: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("cert", "key"):
            path = Path(getattr(self, name))
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                raise ValueError(f"API TLS {name} file {path} (--api-tls-{name}) does not exist") from None
            except OSError as exc:
                raise ValueError(f"API TLS {name} file {path} (--api-tls-{name}) is unreadable: "
                                 f"{exc.strerror}") from None
            marker = b"CERTIFICATE" if name == "cert" else b"PRIVATE KEY"
            if b"-----BEGIN" not in data or marker not in data:
                raise ValueError(f"API TLS {name} file {path} (--api-tls-{name}) holds no PEM "
                                 f"{marker.decode().lower()}")
            object.__setattr__(self, name, path)
            object.__setattr__(self, f"{name}_pem", data)
        try:  # the same check uvicorn's start-up would make, but before anything starts
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(self.cert, self.key)
        except ssl.SSLError as exc:
            raise ValueError(f"API TLS: {self.key} is not the key of the certificate {self.cert} "
                             f"({exc.reason or exc})") from None

    def grpc_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key_pem, self.cert_pem)])

    def uvicorn_options(self) -> dict[str, str]:
        return {"ssl_certfile": str(self.cert), "ssl_keyfile": str(self.key)}


def api_tls_from(cert: str | None, key: str | None) -> ApiTLS | None:
    """From the entry point's flags: both, or neither (plain HTTP and gRPC, as before)."""
    if not cert and not key:
        return None
    if not cert or not key:
        missing = "--api-tls-key" if cert else "--api-tls-cert"
        raise ValueError(f"API TLS needs a certificate and its key: {missing} missing")
    return ApiTLS(Path(cert), Path(key))


def add_api_tls_args(parser) -> None:
    parser.add_argument("--api-tls-cert", default=None, metavar="PEM",
                        help="serve the HTTP and gRPC client APIs over TLS with this certificate "
                             "(with --api-tls-key; separate from the internal plane's --tls-*)")
    parser.add_argument("--api-tls-key", default=None, metavar="PEM",
                        help="private key of --api-tls-cert")
