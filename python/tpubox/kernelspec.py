"""Installs a Jupyter kernelspec whose kernels get a tpubox session (the tpubox provisioner).

    python -m tpubox.kernelspec install --name tpubox --address unix:/run/tpubox/session.sock \\
        --token-file '~/.config/tpubox/{user}.token' [--limit max_device_bytes=4GiB] \\
        [--user | --prefix PREFIX | --sys-prefix] [--display-name "Python (tpubox)"]

(also ``tpubox-kernelspec install ...``). The kernelspec runs ipykernel with the Python that
ran this command (``--python`` to choose another) and names ``tpubox-provisioner`` in
``metadata.kernel_provisioner`` with the address, token (or token file), limits and label. A
kernelspec holding a ``--token`` is written readable by its owner only; prefer
``--token-file``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import fields
from pathlib import Path
from typing import Any, Sequence

from ._values import parse_size
from .session import Limits

__all__ = ["kernel_json", "install", "main", "parse_limit"]

PROVISIONER_NAME = "tpubox-provisioner"

def parse_limit(text: str) -> tuple[str, int | float]:
    """``NAME=VALUE`` of a :class:`tpubox.Limits` field. Byte limits take a unit (``64MiB``,
    ``4G``: powers of 1024); seconds are numbers. ValueError for an unknown name or value."""
    name, sep, value = text.partition("=")
    name = name.strip().replace("-", "_")
    known = {f.name: f for f in fields(Limits)}
    if not sep or name not in known:
        raise ValueError(f"--limit wants NAME=VALUE with NAME one of {sorted(known)}, not {text!r}")
    if known[name].type in ("float", float):
        return name, float(value)
    if name.endswith("_bytes"):
        try:
            return name, parse_size(value)
        except ValueError as e:
            raise ValueError(f"--limit {name}: {e}") from None
    return name, int(value)


def kernel_json(
    *,
    address: str,
    token: str | None = None,
    token_file: str | None = None,
    limits: dict[str, Any] | None = None,
    label: str | None = None,
    display_name: str = "Python 3 (tpubox)",
    python: str | None = None,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
) -> dict[str, Any]:
    """The kernel.json of a tpubox kernelspec (see the module documentation). ``tls_*``: PEM
    files for a daemon that serves TLS on a TCP address (see :class:`tpubox.TLS`)."""
    config: dict[str, Any] = {"address": address}
    if token:
        config["token"] = token
    if token_file:
        config["token_file"] = token_file
    if limits:
        config["limits"] = dict(limits)
    if label:
        config["label"] = label
    for key, value in (("tls_ca", tls_ca), ("tls_cert", tls_cert), ("tls_key", tls_key)):
        if value:
            config[key] = value
    return {
        "argv": [python or sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": display_name,
        "language": "python",
        "interrupt_mode": "signal",
        "metadata": {
            "debugger": True,
            "kernel_provisioner": {"provisioner_name": PROVISIONER_NAME, "config": config},
        },
    }


def install(
    name: str,
    spec: dict[str, Any],
    *,
    user: bool = False,
    prefix: str | None = None,
) -> str:
    """Installs SPEC (a kernel.json dict) as kernelspec NAME (for this user, under PREFIX, or
    system-wide); returns the directory it went to."""
    from jupyter_client.kernelspec import KernelSpecManager

    secret = "token" in spec["metadata"]["kernel_provisioner"]["config"]
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o700 if secret else 0o755)
        path = Path(tmp) / "kernel.json"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if secret else 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(spec, f, indent=1)
            f.write("\n")
        dest = KernelSpecManager().install_kernel_spec(
            tmp, kernel_name=name, user=user, prefix=prefix, replace=None
        )
    if secret:
        os.chmod(dest, 0o700)
        os.chmod(os.path.join(dest, "kernel.json"), 0o600)
    return dest


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (``python -m tpubox.kernelspec``, ``tpubox-kernelspec``)."""
    p = argparse.ArgumentParser(
        prog="python -m tpubox.kernelspec",
        description="Install a Jupyter kernelspec whose kernels each get a tpubox session.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    i = sub.add_parser("install", help="install a kernelspec")
    i.add_argument("--name", required=True, help="kernelspec name (a directory name)")
    i.add_argument("--address", required=True, help="unix:/path/to/session.sock or HOST:PORT")
    tok = i.add_mutually_exclusive_group()
    tok.add_argument("--token-file", help="file holding the tenant token ({user}, ~ expand)")
    tok.add_argument("--token", help="the tenant token itself (kept in kernel.json, mode 0600)")
    i.add_argument(
        "--limit",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a tighter session limit, e.g. max_device_bytes=4GiB (repeatable)",
    )
    i.add_argument("--label", help="label in the daemon's logs ({user}, {kernel_id})")
    i.add_argument("--tls-ca", help="TLS (TCP address): PEM CA file of the daemon's certificate")
    i.add_argument("--tls-cert", help="TLS: PEM client certificate chain ({user}, ~ expand)")
    i.add_argument("--tls-key", help="TLS: PEM key of the client certificate ({user}, ~ expand)")
    i.add_argument("--display-name", help="name shown in Jupyter (default: Python 3 (NAME))")
    i.add_argument("--python", help="the kernel's Python (default: this one)")
    where = i.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="for this user (the default)")
    where.add_argument("--prefix", help="under PREFIX/share/jupyter/kernels")
    where.add_argument("--sys-prefix", action="store_true", help="under sys.prefix (this venv)")
    where.add_argument("--system", action="store_true", help="system-wide")
    args = p.parse_args(argv)

    try:
        limits = dict(parse_limit(t) for t in args.limit)
    except ValueError as e:
        p.error(str(e))
    spec = kernel_json(
        address=args.address,
        token=args.token,
        token_file=args.token_file,
        limits=limits,
        label=args.label,
        display_name=args.display_name or f"Python 3 ({args.name})",
        python=args.python,
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
    )
    prefix = args.prefix or (sys.prefix if args.sys_prefix else None)
    user = not (prefix or args.system)
    try:
        dest = install(args.name, spec, user=user, prefix=prefix)
    except ValueError as e:  # jupyter_client refuses names that are not a directory name
        p.error(f"--name {args.name!r}: {e}")
    print(f"Installed kernelspec {args.name} in {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
