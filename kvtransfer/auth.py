"""Authentication of the KV data plane, derived from the cluster secret (common/cluster_auth.py).

Two mechanisms, both keyed by `KVAuth.key` (itself derived from the secret, so the secret
never reaches this package):

- zmq and shm's zmq control channel: CURVE. Both keypairs are derived deterministically from
  the key, so no key files travel: the receiver is the CURVE server, and its ZAP handler
  admits exactly one client public key, the cluster's. A peer without the secret cannot
  complete the handshake; the receiver counts each failed handshake (`auth_rejected`).
- every backend, on every unit: a per-transfer token, HMAC(key, transfer id), in each KV
  header and grant request. The receiver checks it before the unit is admitted (before a byte
  reaches the cache) and drops and counts a unit whose token is wrong or missing. Over CURVE
  this is a second lock; over gRPC without TLS it is the lock: a rogue that can reach the
  port but lacks the secret cannot forge a token for a live transfer id.

- the gRPC backend's Handshake (which answers the receiver's layout): a proof in the call's
  metadata, TS.NONCE.HMAC(key, "kv-handshake|SENDER|TS|NONCE"), valid for HANDSHAKE_WINDOW_S.
  No transfer id exists yet at connect(), hence a time-stamped proof instead of a token; a
  rogue without the secret learns nothing, not even the layout.

Optional TLS material (PEM bytes) for the gRPC backend travels here too, so that backend uses
the same mutual TLS as the rest of the internal plane.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass, field

MIN_KEY_BYTES = 32
HANDSHAKE_PROOF_HEADER = "x-tandem-kv-proof"
HANDSHAKE_WINDOW_S = 300.0  # as common/cluster_auth.py's PROOF_WINDOW_S: hosts' clocks differ


@dataclass(frozen=True)
class KVAuth:
    key: bytes = field(repr=False)  # derived from the cluster secret; b"" = none (TLS only)
    # PEM bytes for mutual TLS on the gRPC backend; all three or none.
    tls_cert: bytes = field(default=b"", repr=False)
    tls_key: bytes = field(default=b"", repr=False)
    tls_ca: bytes = field(default=b"", repr=False)
    tls_server_name: str = ""  # checked in the receiver's certificate instead of its host

    def __post_init__(self) -> None:
        if not isinstance(self.key, bytes) or 0 < len(self.key) < MIN_KEY_BYTES:
            raise ValueError(f"KVAuth.key must be empty or at least {MIN_KEY_BYTES} bytes")
        given = [bool(self.tls_cert), bool(self.tls_key), bool(self.tls_ca)]
        if any(given) and not all(given):
            raise ValueError("KVAuth TLS needs a certificate, its key and the CA, or none of them")

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    @property
    def keyed(self) -> bool:
        """Tokens and CURVE are on (a cluster secret was given)."""
        return bool(self.key)

    def token(self, transfer_id: str) -> bytes:
        if not self.key:
            return b""
        return hmac.new(self.key, b"kv-token|" + transfer_id.encode(), hashlib.sha256).digest()

    def token_ok(self, transfer_id: str, token: bytes) -> bool:
        return not self.key or hmac.compare_digest(self.token(transfer_id), token)

    def handshake_proof(self, sender_id: str, now: float | None = None) -> str:
        ts, nonce = str(int(time.time() if now is None else now)), secrets.token_hex(8)
        return f"{ts}.{nonce}.{self._handshake_mac(sender_id, ts, nonce)}"

    def handshake_ok(self, sender_id: str, proof: str | None, now: float | None = None) -> bool:
        """Whether `proof` (the Handshake's metadata) is this cluster's, for this sender, recent."""
        if not self.key:
            return True
        try:
            ts, nonce, mac = (proof or "").split(".")
            age = abs((time.time() if now is None else now) - int(ts))
        except ValueError:
            return False
        return (hmac.compare_digest(self._handshake_mac(sender_id, ts, nonce), mac)
                and age <= HANDSHAKE_WINDOW_S)

    def _handshake_mac(self, sender_id: str, ts: str, nonce: str) -> str:
        message = f"kv-handshake|{sender_id}|{ts}|{nonce}".encode()
        return hmac.new(self.key, message, hashlib.sha256).hexdigest()

    def _curve_secret(self, label: bytes) -> bytes:
        import zmq.utils.z85 as z85  # noqa: PLC0415 (zmq loads only with a zmq backend)

        # A CURVE secret key is any 32 bytes (X25519 clamps it); z85 is libzmq's text form.
        return z85.encode(hmac.new(self.key, b"kv-curve|" + label, hashlib.sha256).digest())

    def curve_server(self) -> tuple[bytes, bytes]:
        """(public, secret) z85 keys of every KV receiver."""
        import zmq  # noqa: PLC0415

        secret = self._curve_secret(b"server")
        return zmq.curve_public(secret), secret

    def curve_client(self) -> tuple[bytes, bytes]:
        """(public, secret) z85 keys of every KV sender."""
        import zmq  # noqa: PLC0415

        secret = self._curve_secret(b"client")
        return zmq.curve_public(secret), secret


def kv_auth_from(cluster) -> KVAuth | None:
    """The KV plane's credentials derived from a process's cluster credentials
    (common.cluster_auth.ClusterAuth): keys from the secret, TLS material for the grpc backend;
    None with neither. The secret itself never enters this package."""
    if not cluster.secret and cluster.tls is None:
        return None
    key = hmac.new(cluster.secret, b"tandem-kv", hashlib.sha256).digest() if cluster.secret else b""
    tls = cluster.tls
    if tls is None:
        return KVAuth(key)
    return KVAuth(key, tls.cert_pem, tls.key_pem, tls.ca_pem, tls.server_name)
