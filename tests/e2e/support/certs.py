"""Throwaway certificate authorities and certificates, made with the openssl CLI
(P-256 keys: quick to make, and every TLS stack takes them)."""

from __future__ import annotations

import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

OPENSSL = shutil.which("openssl") or "/usr/bin/openssl"

# Both usages: `radixserve serve` gives its workers the certificate the scheduler
# presents to them, so one certificate is a TLS server's and a TLS client's.
SERVER_EXT = (
    "subjectAltName=DNS:localhost,IP:127.0.0.1\n"
    "extendedKeyUsage=serverAuth,clientAuth\n"
    "basicConstraints=critical,CA:FALSE\n"
    "keyUsage=critical,digitalSignature\n"
)
CLIENT_EXT = (
    "extendedKeyUsage=clientAuth\nbasicConstraints=critical,CA:FALSE\n"
    "keyUsage=critical,digitalSignature\n"
)


@dataclass(frozen=True)
class Cert:
    cert: Path
    key: Path


@dataclass(frozen=True)
class Pki:
    ca: Path
    server: Cert  # localhost / 127.0.0.1, server and client usages
    client: Cert  # client usage only
    other_ca: Path  # an unrelated authority
    other_client: Cert  # a client certificate from the unrelated authority


def _run(*args: str) -> None:
    subprocess.run([OPENSSL, *args], check=True, capture_output=True, timeout=60)


def _key_args(key: Path) -> list[str]:
    return ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", str(key)]


def make_ca(d: Path, name: str) -> tuple[Path, Path]:
    cert, key = d / f"{name}.pem", d / f"{name}.key"
    _run(
        "req", "-x509", *_key_args(key), "-out", str(cert), "-days", "2", "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip
    return cert, key


def make_cert(d: Path, name: str, ca: tuple[Path, Path], ext: str) -> Cert:
    cert, key, csr, extfile = (d / f"{name}{s}" for s in (".pem", ".key", ".csr", ".ext"))
    extfile.write_text(ext)
    _run("req", "-new", *_key_args(key), "-out", str(csr), "-subj", f"/CN={name}")
    _run(
        "x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]),
        "-set_serial", f"0x{secrets.token_hex(8)}", "-days", "2",
        "-extfile", str(extfile), "-out", str(cert),
    )  # fmt: skip
    return Cert(cert, key)


def make_pki(d: Path) -> Pki:
    ca = make_ca(d, "ca")
    other = make_ca(d, "other-ca")
    return Pki(
        ca=ca[0],
        server=make_cert(d, "localhost", ca, SERVER_EXT),
        client=make_cert(d, "scheduler", ca, CLIENT_EXT),
        other_ca=other[0],
        other_client=make_cert(d, "intruder", other, CLIENT_EXT),
    )
