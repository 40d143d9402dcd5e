"""A small PKI for the TLS tests, made with the openssl command: a CA, a certificate for
127.0.0.1 and localhost signed by it, a client certificate, and bcrypt hashes for basic auth."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import bcrypt


@dataclass
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path
    """A CA that signed nothing here: a client trusting it must refuse the server."""


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_pki(directory: Path) -> Pki:
    d = directory
    for ca in ("ca", "other-ca"):
        _openssl(
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            f"/CN={ca}",
            "-keyout",
            f"{ca}.key",
            "-out",
            f"{ca}.crt",
            cwd=d,
        )
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:ddpmon-node\n")
    for who, ext in (("server", ["-extfile", "san.ext"]), ("client", [])):
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            f"/CN={who}",
            "-keyout",
            f"{who}.key",
            "-out",
            f"{who}.csr",
            cwd=d,
        )
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{who}.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-out",
            f"{who}.crt",
            *ext,
            cwd=d,
        )
    return Pki(
        d / "ca.crt",
        d / "server.crt",
        d / "server.key",
        d / "client.crt",
        d / "client.key",
        d / "other-ca.crt",
    )


def bcrypt_hash(password: str) -> str:
    """As ``htpasswd -nBC 10`` makes it (exporter-toolkit's docs): cost 10."""
    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(10)).decode()
