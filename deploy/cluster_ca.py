"""A throwaway certificate authority for one cluster, made with the openssl command line: one CA
and, per host, a certificate it signed for that host's address (server and client use), so the
internal gRPC plane can be mutual TLS without an operator's PKI.

    tls = make_cluster_tls(state_dir / "tls", {"gpu-a": "10.0.0.1", "gpu-b": "node-b.lab"})
    tls["gpu-a"].flags()   # --tls-cert ... --tls-key ... --tls-ca ... (common/cluster_auth.py)

Every file is created 0600 in a 0700 folder; the CA's key stays there (a worker started later
can be issued a certificate with `issue`) and never leaves this machine. `tandem launch` makes
one for a topology that listens off loopback and names no [security] tls_* files.
tests/helpers/tls_certs.py uses the same functions.
"""

from __future__ import annotations

import ipaddress
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path
    ca: Path

    def flags(self) -> list[str]:
        return ["--tls-cert", str(self.cert), "--tls-key", str(self.key), "--tls-ca", str(self.ca)]


class OpenSSLError(RuntimeError):
    """openssl is missing or refused to make a key or certificate."""


def _openssl(*args: str) -> None:
    if shutil.which("openssl") is None:
        raise OpenSSLError("openssl is not installed (e.g. `apt-get install openssl`)")
    # umask 077: keys and certificates are written 0600 from the start. Set by a shell rather
    # than a preexec_fn: a preexec_fn forces a plain fork() of this (gRPC-threaded) process,
    # whose fork handlers then run in the child and can fail it ("epoll_wait error: Bad file
    # descriptor", seen in CI); without one, subprocess spawns without them.
    done = subprocess.run(["sh", "-c", 'umask 077 && exec openssl "$@"', "openssl", *args],
                          capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise OpenSSLError(f"openssl {args[0]} failed: {done.stderr.strip()}")


def make_ca(folder: Path, name: str = "ca", days: int = 2) -> tuple[Path, Path]:
    """(certificate, key) of a new CA in `folder`."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    cert, key = folder / f"{name}.pem", folder / f"{name}.key"
    _openssl("req", "-x509", *EC, "-keyout", str(key), "-out", str(cert), "-days", str(days),
             "-subj", f"/CN=tandem {name}",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    return cert, key


def issue(folder: Path, ca: tuple[Path, Path], name: str,
          addresses: tuple[str, ...] = ("127.0.0.1",), dns: tuple[str, ...] = ("localhost",),
          days: int = 2) -> Issued:
    """A certificate for `name`, signed by `ca`, valid for those addresses and host names."""
    ca_cert, ca_key = ca
    key, csr, cert = folder / f"{name}.key", folder / f"{name}.csr", folder / f"{name}.pem"
    _openssl("req", *EC, "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}")
    san = ",".join([*(f"IP:{a}" for a in addresses), *(f"DNS:{d}" for d in dns)])
    ext = folder / f"{name}.ext"
    ext.write_text(f"subjectAltName={san}\nextendedKeyUsage=serverAuth,clientAuth\n"
                   "basicConstraints=CA:FALSE\n")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca_cert), "-CAkey", str(ca_key),
             "-CAcreateserial", "-out", str(cert), "-days", str(days), "-extfile", str(ext))
    return Issued(cert, key, ca_cert)


def make_cluster_tls(folder: Path, hosts: dict[str, str], days: int = 365) -> dict[str, Issued]:
    """A new CA in `folder` and one certificate per host name, valid for its address (an IP
    address or a DNS name) and for loopback. OpenSSLError when openssl cannot make them."""
    ca = make_ca(folder, "cluster-ca", days)
    issued = {}
    for i, (name, address) in enumerate(sorted(hosts.items())):
        try:
            ipaddress.ip_address(address)
            addresses, dns = (address, "127.0.0.1"), ("localhost",)
        except ValueError:
            addresses, dns = ("127.0.0.1",), (address, "localhost")
        issued[name] = issue(folder, ca, f"host-{i}", tuple(dict.fromkeys(addresses)), dns, days)
        for leftover in (f"host-{i}.csr", f"host-{i}.ext"):
            (folder / leftover).unlink(missing_ok=True)
    return issued
