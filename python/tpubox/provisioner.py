"""A Jupyter kernel provisioner that gives each kernel its own tpubox session.

``TpuboxProvisioner`` (entry point ``tpubox-provisioner`` in ``jupyter_client.kernel_provisioners``)
is jupyter_client's ``LocalProvisioner`` (the kernel is a local process) plus a session:

- ``pre_launch`` opens a session on the daemon for the tenant of the configured token
  (``end_on_disconnect``: it is held by an Attach stream from *this* process, the Jupyter
  server's, so the session ends if the server goes away), and gives the kernel
  ``TPUBOX_ADDRESS``, ``TPUBOX_SESSION_TOKEN`` and ``TPUBOX_SESSION_ID``: in the kernel,
  ``tpubox.connect()`` joins it. The tenant token never reaches the kernel.
- The kernel's environment hides the accelerators (``CUDA_VISIBLE_DEVICES=""``,
  ``JAX_PLATFORMS=cpu``, ...): the kernel reaches the device only through the daemon. This is
  advisory (a process can undo its environment); the hard barrier is the operator's: device
  nodes (``/dev/accel*``, ``/dev/vfio/*``, ``/dev/nvidia*``) that only the daemon's user may
  open.
- ``cleanup`` (after every shutdown, kill and restart) closes the session, which frees
  everything the kernel held; on a restart the next ``pre_launch`` opens a fresh one.

Configuration (the kernelspec's ``metadata.kernel_provisioner.config``;
``python -m tpubox.kernelspec install`` writes it):

- ``address``: the daemon's session socket (``unix:/run/tpubox/session.sock``) or
  ``HOST:PORT``.
- ``token`` or ``token_file``: the tenant token, or a file holding it (per-user: ``{user}`` is
  replaced by ``$TPUBOX_USER``, ``$JUPYTERHUB_USER`` or the login name, ``~`` expands).
  Neither: no token (a daemon without ``--tokens``).
- ``limits``: tighter limits than the tenant's, a dict of :class:`tpubox.Limits` fields
  (``{"max_device_bytes": 4294967296}``).
- ``label``: shown in the daemon's logs (default ``jupyter kernel {kernel_id}``; ``{user}`` and
  ``{kernel_id}`` are replaced).
"""

from __future__ import annotations

import asyncio
import getpass
import os
from typing import Any

from jupyter_client.provisioning import LocalProvisioner
from traitlets import Dict, Float, Unicode

from . import _transport
from ._transport import TLS
from .session import ENV_ADDRESS, ENV_SESSION_ID, ENV_SESSION_TOKEN, Limits, Session, connect

__all__ = ["TpuboxProvisioner", "HIDDEN_ACCELERATOR_ENV", "current_user"]

#: What the kernel's environment gets so that frameworks in it find no accelerator.
HIDDEN_ACCELERATOR_ENV: dict[str, str] = {
    "CUDA_VISIBLE_DEVICES": "",
    "NVIDIA_VISIBLE_DEVICES": "void",
    "HIP_VISIBLE_DEVICES": "",
    "ROCR_VISIBLE_DEVICES": "",
    "TPU_VISIBLE_CHIPS": "",
    "TPU_VISIBLE_DEVICES": "",
    "TPU_SKIP_MDS_QUERY": "1",
    "JAX_PLATFORMS": "cpu",
    "PJRT_DEVICE": "CPU",
}


def current_user() -> str:
    """The user ``{user}`` stands for: ``$TPUBOX_USER``, ``$JUPYTERHUB_USER``, else the login
    name."""
    return os.environ.get("TPUBOX_USER") or os.environ.get("JUPYTERHUB_USER") or getpass.getuser()


def _substitute(text: str, **values: str) -> str:
    for k, v in values.items():
        text = text.replace("{" + k + "}", v)
    return text


class TpuboxProvisioner(LocalProvisioner):  # type: ignore[misc]
    """``LocalProvisioner`` that opens a tpubox session for each kernel launch and closes it
    when the kernel is shut down, killed or restarted (see the module documentation)."""

    address = Unicode("", help="The tpubox daemon's session address.").tag(config=True)
    token = Unicode("", help="The tenant token ({user} is substituted).").tag(config=True)
    token_file = Unicode("", help="A file holding the tenant token ({user}, ~).").tag(config=True)
    limits = Dict({}, help="Limits fields for the session (tighter than the tenant's).").tag(
        config=True
    )
    label = Unicode("jupyter kernel {kernel_id}", help="Shown in the daemon's logs.").tag(
        config=True
    )
    timeout = Float(30.0, help="Deadline of the Open and Close calls, in seconds.").tag(config=True)
    tls_ca = Unicode(
        "", help="TLS: PEM file of the CA that signed the daemon's certificate (TCP address)."
    ).tag(config=True)
    tls_cert = Unicode("", help="TLS: PEM client certificate chain ({user}, ~).").tag(config=True)
    tls_key = Unicode("", help="TLS: PEM key of the client certificate ({user}, ~).").tag(
        config=True
    )

    _tpubox_session: Session | None = None

    # -- configuration ----------------------------------------------------------------------

    def _tenant_token(self) -> str | None:
        user = current_user()
        if self.token:
            return _substitute(self.token, user=user)
        if self.token_file:
            path = os.path.expanduser(_substitute(self.token_file, user=user))
            try:
                with open(path, encoding="utf-8") as f:
                    tok = f.read().strip()
            except OSError as e:
                raise RuntimeError(
                    f"tpubox provisioner: cannot read the token file {path}: {e}"
                ) from None
            if not tok:
                raise RuntimeError(f"tpubox provisioner: the token file {path} is empty")
            return tok
        return None

    def _address(self) -> str:
        if not self.address:
            raise RuntimeError(
                "tpubox provisioner: no `address` in the kernelspec's "
                "metadata.kernel_provisioner.config (python -m tpubox.kernelspec install "
                "--address ...)"
            )
        return _substitute(self.address, user=current_user())

    def _tls(self) -> TLS | None:
        """TLS from the tls_* settings; None (the environment's or none) when unset."""
        user = current_user()
        files = {
            k: os.path.expanduser(_substitute(v, user=user))
            for k, v in (("ca", self.tls_ca), ("cert", self.tls_cert), ("key", self.tls_key))
            if v
        }
        return TLS(**files) if files else None

    # -- the session ------------------------------------------------------------------------

    @property
    def session(self) -> Session | None:
        """The kernel's current session (None between a cleanup and the next launch)."""
        return self._tpubox_session

    def _open(self) -> Session:
        label = _substitute(self.label, user=current_user(), kernel_id=str(self.kernel_id or ""))
        return connect(
            self._address(),
            self._tenant_token(),
            limits=Limits.coerce(dict(self.limits)),
            label=label,
            timeout=self.timeout,
            tls=self._tls(),
        )

    def _close(self) -> None:
        s, self._tpubox_session = self._tpubox_session, None
        if s is not None:
            try:
                s.close(timeout=self.timeout)
            except Exception as e:  # the kernel is going anyway; the daemon ends it on its own
                self.log.warning("tpubox provisioner: closing session %s: %s", s.session_id, e)

    async def pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        """Opens the kernel's session and puts it, and the accelerator-hiding variables, into
        the kernel's environment."""
        kwargs = await super().pre_launch(**kwargs)
        loop = asyncio.get_running_loop()
        # A restart without a cleanup in between must not leak the previous session.
        await loop.run_in_executor(None, self._close)
        s = await loop.run_in_executor(None, self._open)
        self._tpubox_session = s
        env = dict(kwargs.get("env") or {})
        env.update(HIDDEN_ACCELERATOR_ENV)
        env[ENV_ADDRESS] = s.address
        env[ENV_SESSION_TOKEN] = s.token
        env[ENV_SESSION_ID] = s.session_id
        # The kernel joins over the same TLS (CA and client certificate files, not their
        # contents, reach it).
        tls = _transport.resolve_tls(s.address, self._tls())
        if tls is not None:
            env.update(tls.env())
        kwargs["env"] = env
        self.log.info(
            "tpubox provisioner: kernel %s has session %s (tenant %s) at %s",
            self.kernel_id,
            s.session_id,
            s.tenant,
            s.address,
        )
        return kwargs

    async def poll(self) -> int | None:
        """LocalProvisioner's poll; once the kernel process has exited (killed, crashed), its
        session is closed at once instead of at the next shutdown or restart."""
        ret = await super().poll()
        if ret is not None and self._tpubox_session is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._close)
        return ret

    async def kill(self, restart: bool = False) -> None:
        """Kills the kernel, then closes its session."""
        await super().kill(restart=restart)
        await asyncio.get_running_loop().run_in_executor(None, self._close)

    async def cleanup(self, restart: bool = False) -> None:
        """Closes the kernel's session (idempotent); a restart opens a new one in pre_launch."""
        await asyncio.get_running_loop().run_in_executor(None, self._close)
        await super().cleanup(restart=restart)

    async def get_provisioner_info(self) -> dict[str, Any]:
        """LocalProvisioner's information plus the session id (never the token)."""
        info = await super().get_provisioner_info()
        if self._tpubox_session is not None:
            info["tpubox_session_id"] = self._tpubox_session.session_id
        return info
