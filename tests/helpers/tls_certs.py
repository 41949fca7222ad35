"""A throwaway certificate authority for tests, made with the openssl command line: one CA and
certificates it signed, each valid for the given names and addresses (server and client use)."""

from __future__ import annotations

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


def _openssl(*args: str) -> None:
    done = subprocess.run(["openssl", *args], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {done.stderr.strip()}")


def make_ca(folder: Path, name: str = "ca") -> tuple[Path, Path]:
    """(certificate, key) of a new CA in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    cert, key = folder / f"{name}.pem", folder / f"{name}.key"
    _openssl("req", "-x509", *EC, "-keyout", str(key), "-out", str(cert), "-days", "2",
             "-subj", f"/CN=tandem test {name}",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    return cert, key


def issue(folder: Path, ca: tuple[Path, Path], name: str,
          addresses: tuple[str, ...] = ("127.0.0.1",), dns: tuple[str, ...] = ("localhost",)) -> Issued:
    """A certificate for `name`, signed by `ca`, valid for those addresses and host names."""
    ca_cert, ca_key = ca
    key, csr, cert = folder / f"{name}.key", folder / f"{name}.csr", folder / f"{name}.pem"
    _openssl("req", *EC, "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}")
    san = ",".join([*(f"IP:{a}" for a in addresses), *(f"DNS:{d}" for d in dns)])
    ext = folder / f"{name}.ext"
    ext.write_text(f"subjectAltName={san}\nextendedKeyUsage=serverAuth,clientAuth\n"
                   "basicConstraints=CA:FALSE\n")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca_cert), "-CAkey", str(ca_key),
             "-CAcreateserial", "-out", str(cert), "-days", "2", "-extfile", str(ext))
    return Issued(cert, key, ca_cert)
