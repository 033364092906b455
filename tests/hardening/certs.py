"""Test certificates made with the `openssl` command line (Debian's openssl package; dev.sh
installs it): a CA, a server certificate for 127.0.0.1 and localhost signed by it, client
certificates, and a second CA nobody trusts. ECDSA P-256, valid for one day.

Each certificate carries the extensions rustls's verifier (webpki) insists on: CAs have
`basicConstraints = critical, CA:TRUE` and `keyUsage = keyCertSign`; leaves have
`CA:FALSE`, a subjectAltName (webpki ignores the CN), and the extended key usage of their role.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


def _openssl(*args: str, cwd: Path) -> None:
    r = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed:\n{r.stderr}")


@dataclass(frozen=True)
class Pair:
    """A certificate (PEM) and its key (PEM), as paths."""

    cert: Path
    key: Path


def make_ca(dir: Path, name: str) -> Pair:
    """A self-signed CA NAME in DIR."""
    dir.mkdir(parents=True, exist_ok=True)
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "1",
        "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=dir,
    )  # fmt: skip
    return Pair(dir / f"{name}.pem", dir / f"{name}.key")


def make_leaf(dir: Path, name: str, ca: Pair, *, server: bool, san: str | None = None) -> Pair:
    """A certificate NAME signed by CA: for a server (subjectAltName SAN, default 127.0.0.1
    and localhost) or a client."""
    dir.mkdir(parents=True, exist_ok=True)
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}",
        cwd=dir,
    )  # fmt: skip
    ext = dir / f"{name}.ext"
    lines = ["basicConstraints=critical,CA:FALSE", "keyUsage=critical,digitalSignature"]
    if server:
        lines += [
            "extendedKeyUsage=serverAuth",
            f"subjectAltName={san or 'IP:127.0.0.1,DNS:localhost'}",
        ]
    else:
        lines += ["extendedKeyUsage=clientAuth", f"subjectAltName={san or 'DNS:' + name}"]
    ext.write_text("\n".join(lines) + "\n")
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", str(ca.cert), "-CAkey", str(ca.key),
        "-CAcreateserial", "-out", f"{name}.pem", "-days", "1", "-extfile", ext.name,
        cwd=dir,
    )  # fmt: skip
    return Pair(dir / f"{name}.pem", dir / f"{name}.key")


@dataclass(frozen=True)
class Certs:
    """Everything a TLS test needs."""

    ca: Pair
    server: Pair
    client: Pair
    other_ca: Pair
    stranger: Pair  # a client certificate of other_ca


def make_all(dir: Path) -> Certs:
    ca = make_ca(dir, "test-ca")
    other = make_ca(dir, "other-ca")
    return Certs(
        ca=ca,
        server=make_leaf(dir, "server", ca, server=True),
        client=make_leaf(dir, "client", ca, server=False),
        other_ca=other,
        stranger=make_leaf(dir, "stranger", other, server=False),
    )
