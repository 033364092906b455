"""tpubox on Ray: one daemon per node, owned by a node actor, lent to the node's tasks.

A TPU chip (or a GPU, or the CPU plugin's device) is opened by one process per machine: on a
Ray cluster that process is ``tpubox serve``, started and supervised by one detached actor per
node, :class:`TpuboxNode`, named ``tpubox-node-<node id>`` in the namespace ``tpubox`` and
pinned to its node. Tasks and actors on that node ask for no accelerator: they open a *session*
on the node's daemon, and tpubox's tenant limits (device memory, sessions, compiles, execution
slots) decide what each gets.

    import ray, tpubox.ray

    @ray.remote
    def work(x):
        with tpubox.ray.session(tenant="default") as s:   # this node's daemon
            add = s.compile(PROGRAM)
            (y,) = add(s.tensor(x), s.tensor(x))
            return y.numpy()

:func:`node` gets or creates this node's actor (race-free: many tasks calling it at once start
one daemon); :func:`session` is ``tpubox.connect(...)`` to it. With ``model_repository=`` the
daemon also serves models over the Open Inference Protocol on 127.0.0.1, and
:func:`serve_model` makes a Ray Serve deployment (:class:`ModelDeployment`) whose replicas
forward each request, one at a time, to their node's daemon, which batches across all of them.
See docs/RAY.md.

Needs ``ray`` (``pip install 'tpubox[ray]'``); the daemon binary comes from ``TPUBOX_BIN``, else
``tpubox`` on ``PATH``, as the node actor's process sees them.
"""

from __future__ import annotations

import asyncio
import ctypes
import http.client
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from . import session as _session
from ._values import Device
from .errors import ResourceExhausted, TpuboxError, Unavailable

NAMESPACE = "tpubox"
"""The Ray namespace of the node actors."""

NAME_PREFIX = "tpubox-node-"
"""A node actor's name is this followed by the node's id (hex)."""

DEFAULT_TENANT = "default"
"""The tenant a node actor makes when given no tenants (the daemon's default session limits)."""

ENV_BIN = "TPUBOX_BIN"
"""Environment variable naming the ``tpubox`` binary (default: ``tpubox`` on ``PATH``)."""

# How long a restarted daemon that dies again at once waits before the next start: doubled on
# each quick death, from 0.1 s up to 5 s; reset once a daemon stayed up for 10 s.
_BACKOFF_FIRST = 0.1
_BACKOFF_MAX = 5.0
_STABLE_SECONDS = 10.0
_TENANT_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# How long session() sleeps between tries while it waits for a free device: doubled from 0.05 s
# up to 1 s.
_DEVICE_WAIT_FIRST = 0.05
_DEVICE_WAIT_MAX = 1.0
# A `devices` refusal that waiting cannot cure: more devices than the tenant may use at all.
_NEVER_ENOUGH = re.compile(r"asks for \d+ devices, and may use \d+")

DEVICE_RESOURCE = "tpubox_device"
"""The Ray custom resource that stands for one device of a node's daemon in docs/RAY.md
(``ray start --resources '{"tpubox_device": 4}'``, ``@ray.remote(resources={"tpubox_device":
1})``): only a name the docs and tests use; Ray counts it, tpubox never reads it."""
_log = logging.getLogger("tpubox.ray")


def actor_name(node_id: str) -> str:
    """The node actor's name for NODE_ID (a Ray node id, hex): ``tpubox-node-<node_id>``."""
    return NAME_PREFIX + node_id


def _toml_str(s: str) -> str:
    # json's escapes of a str are TOML basic-string escapes (\", \\, \n, \uXXXX).
    return json.dumps(s)


def _toml_value(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return _toml_str(v)
    raise ValueError(f"a tenant limit must be a number, a bool, a string or a list, not {v!r}")


INFERENCE_KEYS = frozenset(
    {"models", "max_in_flight", "max_requests_per_second", "repository_control", "metrics", "admin"}
)
"""The keys of a tenant's entry in :func:`tokens_toml` that are the tenant's own (its inference
permissions and limits: ``models``, ``max_in_flight``, ...; docs/SERVING.md "Tenants at the
door") rather than its ``[tenant.session]`` limits."""


def tokens_toml(tenants: Mapping[str, Mapping[str, Any]]) -> str:
    """The daemon's tokens file for TENANTS: name -> ``{"token": str, "session": {limits},
    "inference": {keys}}``, with the limits as the tokens file names them (``max_device_mib``,
    ``max_sessions``, ``tenant_max_device_mib``, ... see docs/NOTEBOOKS.md) and the inference
    keys of :data:`INFERENCE_KEYS` (``models = ["minilm"]``, ``max_in_flight``, ...; see
    docs/SERVING.md). Every tenant may open sessions.

    Raises:
        ValueError: a tenant name or limit that the file cannot hold.
    """
    out = []
    for name, t in tenants.items():
        out += ["[[tenant]]", f"name = {_toml_str(name)}", f"tokens = [{_toml_str(t['token'])}]"]
        for k, v in (t.get("inference") or {}).items():
            if k not in INFERENCE_KEYS:
                raise ValueError(f"tenant {name!r}: {k!r} is not a tenant key")
            if k == "models" and (
                not isinstance(v, (list, tuple)) or not all(isinstance(m, str) for m in v)
            ):
                raise ValueError(f"tenant {name!r}: models must be a list of model names")
            out.append(f"{k} = {_toml_value(v)}")
        out.append("[tenant.session]")
        for k, v in (t.get("session") or {}).items():
            if not re.fullmatch(r"[a-z_]+", k):
                raise ValueError(f"tenant {name!r}: {k!r} is not a limit name")
            out.append(f"{k} = {_toml_value(v)}")
        out.append("")
    return "\n".join(out)


def _die_with_parent() -> None:
    """In the daemon's child, before exec: SIGTERM when the thread that started it goes away
    (the actor's supervisor thread, hence the actor's process: ray.kill, a crash)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _split_tenant(limits: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    """A tenant's options as the actor takes them (one mapping) -> its ``session`` limits and its
    ``inference`` keys (:data:`INFERENCE_KEYS`)."""
    limits = dict(limits or {})
    return {
        "session": {k: v for k, v in limits.items() if k not in INFERENCE_KEYS},
        "inference": {k: v for k, v in limits.items() if k in INFERENCE_KEYS},
    }


def _http_status(host: str, port: int, path: str, timeout: float = 1.0) -> int | None:
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    except OSError:
        return None
    finally:
        conn.close()


class _Node:
    """The node actor's state and logic; :data:`TpuboxNode` is this class as a Ray actor.

    Constructed (on its node, by :func:`node`) it makes a private directory (mode 0700) for the
    session socket, the tokens file and the daemon's log, starts ``tpubox serve`` from a
    supervisor thread and returns once the daemon answers.

    Args:
        tenants: name -> the tenant's limits as the tokens file names them: session limits
            (``max_device_mib``, ``max_sessions``, ``tenant_max_device_mib``, ...; sizes in
            MiB, times in seconds) and, for the model repository, the tenant's own keys
            (:data:`INFERENCE_KEYS`: ``models`` (a list of model names, ``"*"`` for all),
            ``max_in_flight``, ``max_requests_per_second``, ...; without ``models`` a tenant
            may call every model, ``[]`` none); a random token is made for each. Default: one
            tenant ``default`` with the daemon's default limits.
        plugin: the daemon's ``--plugin`` (``cpu``, ``xla-cpu``, ``tpu``, ``cuda`` or a path).
        port: also serve the session API on TCP ``127.0.0.1:PORT`` (0: a free port, kept
            across restarts); None: the Unix socket only.
        tokens_file: an operator's tokens file to use instead of ``tenants`` (then
            ``token()`` and ``add_tenant()`` are refused).
        cache_dir: the daemon's ``--cache-dir`` (default: its own default).
        binary: the ``tpubox`` binary (default ``$TPUBOX_BIN``, else ``tpubox`` on PATH).
        extra_args: more ``tpubox serve`` arguments.
        model_repository: also serve this model repository (``--model-repository``) over the
            Open Inference Protocol on 127.0.0.1 (docs/SERVING.md); the tokens file decides
            which tenant may call which model.
        http_port: the REST door's port on 127.0.0.1 with a model repository (None or 0: a free
            port, kept across restarts).
        grpc_port: the gRPC door's port likewise.
        drain_seconds: the daemon's ``--drain-seconds`` at shutdown.
        cpu_devices: the CPU plugin's device count (``--cpu-devices N``: N CPU devices stand in
            for a host's chips); None: the plugin's default (one). A TPU or GPU plugin shows
            the host's devices as they are.
        ready_timeout: seconds to wait for the first start to answer.

    Raises:
        FileNotFoundError: no tpubox binary; ValueError: bad tenants or both ``tenants`` and
        ``tokens_file``; TimeoutError: the daemon did not answer within ``ready_timeout``.
    """

    def __init__(
        self,
        tenants: Mapping[str, Mapping[str, Any] | None] | None = None,
        *,
        plugin: str = "cpu",
        port: int | None = None,
        tokens_file: str | None = None,
        cache_dir: str | None = None,
        binary: str | None = None,
        extra_args: Sequence[str] = (),
        model_repository: str | None = None,
        http_port: int | None = None,
        grpc_port: int | None = None,
        drain_seconds: int = 5,
        cpu_devices: int | None = None,
        ready_timeout: float = 60.0,
    ):
        if tenants is not None and tokens_file is not None:
            raise ValueError("give tenants or tokens_file, not both")
        self._node_id = ray.get_runtime_context().get_node_id()
        self._binary = self._find_binary(binary)
        self._dir = Path(tempfile.mkdtemp(prefix="tpubox-ray-"))  # mode 0700
        self._socket = self._dir / "session.sock"
        self._log_path = self._dir / "serve.log"
        self._plugin = plugin
        self._port = _free_port() if port == 0 else port
        self._cache_dir = cache_dir
        self._extra_args = list(extra_args)
        self._repository = None
        self._http_port = self._grpc_port = None
        if model_repository is not None:
            self._repository = str(Path(model_repository).resolve())
            if not os.path.isdir(self._repository):
                raise FileNotFoundError(f"model repository {self._repository}: no such directory")
            self._http_port = http_port or _free_port()
            self._grpc_port = grpc_port or _free_port()
            while self._grpc_port == self._http_port and not grpc_port:
                self._grpc_port = _free_port()
        self._drain_seconds = drain_seconds
        if cpu_devices is not None and (isinstance(cpu_devices, bool) or int(cpu_devices) < 1):
            raise ValueError(f"cpu_devices={cpu_devices!r}: at least 1")
        self._cpu_devices = None if cpu_devices is None else int(cpu_devices)
        # The daemon's devices (its platform's), learnt when it first answers (_learn_devices).
        self._devices: list[Device] | None = None
        self._ready_timeout = ready_timeout
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._proc: subprocess.Popen | None = None
        self._restarts = 0
        self._started_at = 0.0
        self._last_exit: int | None = None
        self._failure: str | None = None
        self._tenants: dict[str, dict[str, Any]] = {}
        if tokens_file is not None:
            self._tokens_path = Path(tokens_file).resolve()
            self._managed = False
        else:
            self._tokens_path = self._dir / "tokens.toml"
            self._managed = True
            for name, limits in (tenants if tenants is not None else {DEFAULT_TENANT: {}}).items():
                self._tenants[self._check_name(name)] = {
                    "token": secrets.token_urlsafe(32),
                    **_split_tenant(limits),
                }
            self._write_tokens()
        self._thread = threading.Thread(
            target=self._supervise, name="tpubox-supervisor", daemon=True
        )
        self._thread.start()
        # Created only once the daemon answers (or raise, and the actor is dead with the reason).
        self.address(timeout=ready_timeout)

    # ----------------------------------------------------------------------------------------
    # The daemon

    @staticmethod
    def _find_binary(binary: str | None) -> str:
        p = binary or os.environ.get(ENV_BIN) or shutil.which("tpubox")
        if not p or not os.path.isfile(p) or not os.access(p, os.X_OK):
            raise FileNotFoundError(
                f"no tpubox binary on this node ({ENV_BIN}={os.environ.get(ENV_BIN)!r}, "
                f"binary={binary!r}, PATH has none): set {ENV_BIN} for the Ray workers"
            )
        return os.path.abspath(p)

    @staticmethod
    def _check_name(name: str) -> str:
        if not _TENANT_NAME.match(name):
            raise ValueError(f"tenant name {name!r}: 1 to 64 of A-Z a-z 0-9 _ . -")
        return name

    def _write_tokens(self) -> None:
        tmp = self._tokens_path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(tokens_toml(self._tenants))
        os.replace(tmp, self._tokens_path)

    def _command(self) -> list[str]:
        cmd = [
            self._binary, "serve",
            "--session-socket", str(self._socket),
            "--metrics-port", "0",
            "--plugin", self._plugin,
            "--tokens", str(self._tokens_path),
            "--drain-seconds", str(self._drain_seconds),
        ]  # fmt: skip
        if self._port is not None:
            cmd += ["--session-port", str(self._port)]
        if self._cache_dir is not None:
            cmd += ["--cache-dir", str(self._cache_dir)]
        if self._cpu_devices is not None:
            cmd += ["--cpu-devices", str(self._cpu_devices)]
        if self._repository is not None:
            cmd += [
                "--model-repository", self._repository,
                "--host", "127.0.0.1",
                "--http-port", str(self._http_port),
                "--grpc-port", str(self._grpc_port),
            ]  # fmt: skip
        return cmd + self._extra_args

    def _spawn(self) -> subprocess.Popen:
        env = dict(os.environ)
        env.setdefault("TPUBOX_LOG", "info")
        with open(self._log_path, "ab") as log:
            return subprocess.Popen(
                self._command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self._dir,
                env=env,
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            )

    def _answers(self) -> bool:
        try:
            # Any answer but Unavailable means the session API is up (no token: Unauthenticated).
            _session.tenant_usage(f"unix:{self._socket}", None, timeout=1.0)
        except Unavailable:
            return False
        except TpuboxError:
            pass
        if self._repository is not None:
            # The inference doors answer ready once every model of the repository loaded.
            return _http_status("127.0.0.1", self._http_port, "/v2/health/ready") == 200
        return True

    def _supervise(self) -> None:
        """Starts the daemon, waits for it to answer, waits for it to exit, starts it again."""
        backoff = _BACKOFF_FIRST
        while not self._stopping.is_set():
            try:
                proc = self._spawn()
            except OSError as e:
                self._failure = f"cannot start {self._binary}: {e}"
                _log.error("tpubox node %s: %s", self._node_id, self._failure)
                self._stopping.wait(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX)
                continue
            with self._lock:
                self._proc = proc
                self._started_at = time.time()
            _log.info("tpubox node %s: tpubox serve started, pid %d", self._node_id, proc.pid)
            while proc.poll() is None and not self._stopping.is_set():
                if self._answers():
                    self._failure = None
                    # Before any task has the address: the probe's session takes no device a
                    # task could be refused for.
                    self._learn_devices()
                    self._ready.set()
                    break
                time.sleep(0.02)
            rc = proc.wait()
            self._ready.clear()
            with self._lock:
                self._last_exit = rc
                up = time.time() - self._started_at
            if self._stopping.is_set():
                break
            self._failure = (
                f"tpubox serve (pid {proc.pid}) exited with status {rc} after {up:.1f} s"
            )
            _log.error(
                "tpubox node %s: %s; restarting it (see %s)",
                self._node_id, self._failure, self._log_path,
            )  # fmt: skip
            with self._lock:
                self._restarts += 1
            if up >= _STABLE_SECONDS:
                backoff = _BACKOFF_FIRST
            self._stopping.wait(backoff)
            backoff = min(backoff * 2, _BACKOFF_MAX)

    def _probe_tokens(self) -> list[str]:
        """Tenant tokens that may open a session: the actor's tenants', or those of the
        operator's tokens file that have a ``[tenant.session]`` table (read with tomllib,
        Python 3.11+)."""
        if self._managed:
            with self._lock:
                return [t["token"] for t in self._tenants.values()]
        try:
            import tomllib

            with open(self._tokens_path, "rb") as f:
                doc = tomllib.load(f)
        except (ImportError, OSError, ValueError):
            return []
        return [
            tok
            for t in doc.get("tenant", [])
            if isinstance(t, dict) and isinstance(t.get("session"), dict)
            for tok in t.get("tokens", [])
            if isinstance(tok, str)
        ]

    def _learn_devices(self) -> None:
        """The daemon's devices, from the platform a short session of the first tenant that
        may open one sees (on one device, not held alone, closed at once). Left as they were
        when no tenant can open one (the log says why)."""
        last: Exception | None = None
        for token in self._probe_tokens():
            try:
                with _session.connect(
                    f"unix:{self._socket}",
                    token,
                    devices=1,
                    local=False,
                    timeout=10.0,
                    label="tpubox.ray node actor: devices",
                ) as s:
                    self._devices = list(s.platform.devices)
                    return
            except TpuboxError as e:
                last = e
        _log.warning(
            "tpubox node %s: could not learn the daemon's devices (%s)", self._node_id, last
        )

    # ----------------------------------------------------------------------------------------
    # The actor's methods

    def address(self, timeout: float | None = None) -> str:
        """The daemon's session API address on this node, ``unix:/PATH``; waits until the
        daemon answers (after a restart too) for up to TIMEOUT seconds (default: the actor's
        ``ready_timeout``).

        Raises:
            TimeoutError: the daemon does not answer within TIMEOUT (the message has the last
                failure and the daemon's log tail).
            RuntimeError: the actor was shut down.
        """
        if self._stopping.is_set():
            raise RuntimeError("this tpubox node actor was shut down")
        if not self._ready.wait(self._ready_timeout if timeout is None else timeout):
            raise TimeoutError(
                f"tpubox serve on node {self._node_id} did not answer in "
                f"{self._ready_timeout if timeout is None else timeout} s "
                f"(last failure: {self._failure}); log {self._log_path}:\n{self.log_tail(40)}"
            )
        return f"unix:{self._socket}"

    def inference_address(self, timeout: float | None = None) -> dict[str, str] | None:
        """The daemon's inference doors, ``{"http": "127.0.0.1:PORT", "grpc":
        "127.0.0.1:PORT"}`` (None without a model repository); waits as :meth:`address` does
        until the daemon answers and its models are ready."""
        if self._repository is None:
            return None
        self.address(timeout)
        return {"http": f"127.0.0.1:{self._http_port}", "grpc": f"127.0.0.1:{self._grpc_port}"}

    def tcp_address(self) -> str | None:
        """``127.0.0.1:PORT`` when the actor was given a ``port``, else None."""
        return None if self._port is None else f"127.0.0.1:{self._port}"

    def info(self) -> dict[str, Any]:
        """The node's daemon, as a dict: ``node_id``, ``address`` (``unix:/PATH``), ``socket``
        (the path), ``tcp`` (``127.0.0.1:PORT`` or None), ``pid`` (None while down), ``ready``
        (answering now), ``restarts`` (times it died and was started again), ``started_at``
        (Unix seconds, the current process), ``last_exit`` (the last exit status, negative: the
        signal), ``last_failure``, ``tenants`` (names), ``plugin``, ``log`` (the daemon's log
        file), ``tokens_file``, ``model_repository`` (None: none served), ``http`` and
        ``grpc`` (the inference doors, ``127.0.0.1:PORT``, or None), ``devices`` (the daemon's
        device indices; None until learnt), ``cpu_devices`` (the actor's option)."""
        with self._lock:
            proc = self._proc
            return {
                "node_id": self._node_id,
                "address": f"unix:{self._socket}",
                "socket": str(self._socket),
                "tcp": self.tcp_address(),
                "pid": proc.pid if proc is not None and proc.poll() is None else None,
                "ready": self._ready.is_set(),
                "restarts": self._restarts,
                "started_at": self._started_at,
                "last_exit": self._last_exit,
                "last_failure": self._failure,
                "tenants": sorted(self._tenants),
                "plugin": self._plugin,
                "log": str(self._log_path),
                "tokens_file": str(self._tokens_path),
                "model_repository": self._repository,
                "http": None if self._http_port is None else f"127.0.0.1:{self._http_port}",
                "grpc": None if self._grpc_port is None else f"127.0.0.1:{self._grpc_port}",
                "devices": None
                if self._devices is None
                else [d.index for d in self._devices],
                "cpu_devices": self._cpu_devices,
            }

    def devices(self, timeout: float | None = None) -> list[Device]:
        """The node's devices as its daemon sees them (``tpubox.Device``: index, kind,
        description; a TPU host's chips, or the CPU plugin's ``cpu_devices``), learnt when the
        daemon first answered; waits for the daemon as :meth:`address` does.

        Raises:
            RuntimeError: no tenant of the tokens file could open a session to learn them
                (an operator's file with no ``[tenant.session]``, or read on Python < 3.11);
            TimeoutError: as :meth:`address`.
        """
        self.address(timeout)
        if self._devices is None:
            self._learn_devices()
        if self._devices is None:
            raise RuntimeError(
                f"tpubox node {self._node_id}: the daemon's devices are unknown (no tenant "
                f"could open a session; log {self._log_path})"
            )
        return list(self._devices)

    def token(self, tenant: str = DEFAULT_TENANT) -> str:
        """TENANT's token (made by this actor).

        Raises:
            KeyError: no such tenant, or the tokens file is the operator's (``tokens_file``).
        """
        if not self._managed:
            raise KeyError(
                f"the tokens file {self._tokens_path} is the operator's: pass token= to session()"
            )
        try:
            return self._tenants[tenant]["token"]
        except KeyError:
            raise KeyError(f"no tenant {tenant!r} on this node (add_tenant adds one)") from None

    def add_tenant(self, name: str, limits: Mapping[str, Any] | None = None) -> str:
        """Adds tenant NAME (or changes its limits: live sessions keep theirs) with session
        LIMITS named as in the tokens file (``max_device_mib``, ``max_sessions``, ...; and its
        inference keys, ``models`` and the others of :data:`INFERENCE_KEYS`), and makes
        the daemon read its tokens file again (SIGHUP; no restart, no session ends). Returns
        the tenant's token.

        Raises:
            ValueError: a bad name or limit; RuntimeError: the tokens file is the operator's.
        """
        if not self._managed:
            raise RuntimeError(f"the tokens file {self._tokens_path} is the operator's: edit it")
        self._check_name(name)
        with self._lock:
            old = self._tenants.get(name)
            t = {"token": old["token"] if old else secrets.token_urlsafe(32),
                 **_split_tenant(limits)}  # fmt: skip
            self._tenants[name] = t
            try:
                self._write_tokens()
            except ValueError:
                if old is None:
                    del self._tenants[name]
                else:
                    self._tenants[name] = old
                raise
        self.reload()
        return t["token"]

    def remove_tenant(self, name: str) -> bool:
        """Removes tenant NAME (its sessions end) and reloads the daemon's tokens file.
        Returns False when there was no such tenant.

        Raises:
            RuntimeError: the tokens file is the operator's.
        """
        if not self._managed:
            raise RuntimeError(f"the tokens file {self._tokens_path} is the operator's: edit it")
        with self._lock:
            if self._tenants.pop(name, None) is None:
                return False
            self._write_tokens()
        self.reload()
        return True

    def reload(self) -> bool:
        """SIGHUP to the daemon: it reads the tokens file again (a file that does not check is
        refused and the one in use stays; its log says which). A daemon started later reads
        the file anyway. Returns whether a running daemon was signalled."""
        with self._lock:
            proc = self._proc
        if proc is None or proc.poll() is not None:
            return False
        proc.send_signal(signal.SIGHUP)
        return True

    def pid(self) -> int:
        """The node actor's own process id (the daemon's is ``info()["pid"]``)."""
        return os.getpid()

    def log_tail(self, lines: int = 100) -> str:
        """The last LINES lines of the daemon's log (all its restarts in one file)."""
        try:
            with open(self._log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 256 * lines))
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def shutdown(self, timeout: float = 30.0) -> int | None:
        """Stops supervising and stops the daemon (SIGTERM: it drains for up to its
        ``drain_seconds``; SIGKILL after TIMEOUT seconds); removes the private directory.
        Returns the daemon's exit status (None: it was not running). The actor stays alive
        but useless: :func:`shutdown_node` also kills it."""
        self._stopping.set()
        self._ready.clear()
        with self._lock:
            proc = self._proc
        rc = None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._thread.join(timeout=5)
        if self._managed:
            shutil.rmtree(self._dir, ignore_errors=True)
        return rc


TpuboxNode = ray.remote(num_cpus=0, max_concurrency=16, max_restarts=-1)(_Node)
"""The node actor class: ``_Node`` as a Ray actor (no CPU, threaded so ``info()`` answers
while ``address()`` waits for a restart, restarted by Ray if its process dies). Create it
through :func:`node`, which names and pins it; its methods: ``address``, ``tcp_address``,
``inference_address``,
``info``, ``devices``, ``token``, ``add_tenant``, ``remove_tenant``, ``reload``, ``pid``,
``log_tail``, ``shutdown``."""


def _current_node_id() -> str:
    if not ray.is_initialized():
        raise RuntimeError(
            "tpubox.ray: Ray is not initialized (ray.init() first, or call from a task)"
        )
    return ray.get_runtime_context().get_node_id()


def node(
    *,
    node_id: str | None = None,
    create: bool = True,
    ready_timeout: float = 60.0,
    **options: Any,
) -> Any:
    """The tpubox node actor of NODE_ID (default: the node this task, actor or driver runs on),
    created if it does not exist yet: named ``tpubox-node-<node_id>`` in namespace ``tpubox``,
    ``lifetime="detached"`` (it outlives the job that created it), pinned to the node
    (``NodeAffinitySchedulingStrategy(node_id, soft=False)``), ``num_cpus=0``. Many callers at
    once get one actor and one daemon (Ray's ``get_if_exists``). Waits until its daemon
    answers.

    Args:
        node_id: a Ray node id (hex).
        create: False: only an existing actor (else ValueError).
        ready_timeout: seconds to wait for the daemon to answer.
        **options: the actor's arguments when this call creates it (ignored when it exists):
            ``tenants`` (name -> tokens-file session limits such as ``{"max_device_mib": 4096,
            "max_sessions": 8}``; default one tenant ``default`` with the daemon's default
            limits), ``tokens_file`` (the operator's file instead; then sessions need
            ``token=``), ``plugin`` (default ``"cpu"``; ``"tpu"``, ``"cuda"`` or a path),
            ``port`` (also serve on TCP 127.0.0.1:PORT; 0 picks one), ``cache_dir`` (the compile
            cache), ``binary`` (default ``$TPUBOX_BIN`` or ``tpubox`` on PATH),
            ``extra_args`` (more ``tpubox serve`` flags), ``drain_seconds`` (default 5),
            ``cpu_devices`` (the CPU plugin's device count, ``--cpu-devices``; default one).

    Returns:
        The actor handle (``ray.get(h.info.remote())`` and so on).

    Raises:
        RuntimeError: Ray not initialized; ValueError: no actor and ``create=False``;
        TimeoutError (from the actor): the daemon did not answer in time;
        ray.exceptions.RayActorError: the actor could not be created (its error says why,
        e.g. no tpubox binary on the node).
    """
    node_id = node_id or _current_node_id()
    name = actor_name(node_id)
    if create:
        handle = TpuboxNode.options(
            name=name,
            namespace=NAMESPACE,
            get_if_exists=True,
            lifetime="detached",
            num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(ready_timeout=ready_timeout, **options)
    else:
        try:
            handle = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            raise ValueError(f"no tpubox node actor {name!r} in namespace {NAMESPACE!r}") from None
    ray.get(handle.address.remote(ready_timeout))
    return handle


def session(
    tenant: str = DEFAULT_TENANT,
    *,
    token: str | None = None,
    node_options: Mapping[str, Any] | None = None,
    ready_timeout: float = 60.0,
    devices: int | Sequence[int] | None = None,
    exclusive_devices: bool | None = None,
    device_wait_s: float = 60.0,
    **connect_kwargs: Any,
) -> _session.Session:
    """A new session on this node's daemon: ``tpubox.connect(address, token, ...)``, from any
    task, actor or driver on the node. The node actor is created if it is not there yet
    (:func:`node`, with NODE_OPTIONS). The session ends when it is closed or when this process
    goes away, killed included; what it held on the device is freed then.

    ``devices=1`` gives the task a device of its own: one of the tenant's devices that no other
    session uses, held alone until the session ends (``Session.devices`` says which). While
    none is free, the call waits, trying again, up to DEVICE_WAIT_S seconds; give each node a
    Ray custom resource per device (:data:`DEVICE_RESOURCE`, docs/RAY.md) so that Ray does not
    start more such tasks than the node has devices.

    Args:
        tenant: the tenant whose token to use (one the node actor made: its ``tenants``, or
            ``add_tenant``).
        token: a tenant token to use instead (needed with an operator's ``tokens_file``).
        node_options: the node actor's arguments if this call creates it (see :func:`node`).
        ready_timeout: seconds to wait for the daemon to answer (after a restart too).
        devices: a count of the tenant's devices (the daemon picks them) or a sequence of
            device indices, as :func:`tpubox.connect` takes it; None: every device the tenant
            may use, shared (as before placement).
        exclusive_devices: hold the devices alone (no other session is placed on them while
            this one lives). Default: True when ``devices`` is given, else False.
        device_wait_s: how long to wait for free devices when the daemon refuses the session
            for now (``tpubox.ResourceExhausted`` naming ``(limit devices)``: the devices
            asked for are held, or have other sessions while ``exclusive_devices`` asks for
            them alone); 0: refuse at once. A count above what the tenant may use at all is
            raised at once.
        **connect_kwargs: :func:`tpubox.connect`'s: ``limits``, ``label`` (default
            ``ray task <task id>``), ``timeout``, ``local``.

    Raises:
        KeyError: an unknown tenant; TimeoutError: no daemon answer in READY_TIMEOUT seconds;
        tpubox.ResourceExhausted: ``(limit devices)`` still after DEVICE_WAIT_S seconds (the
        daemon's last refusal), ``max-sessions``, ...; what else :func:`tpubox.connect` raises
        (tpubox.PermissionDenied for a device the tenant may not use or another tenant's
        session holds alone, tpubox.NotFound for a device the node lacks,
        tpubox.InvalidArgument for a count above the node's devices, ...).
    """
    if device_wait_s < 0:
        raise ValueError(f"device_wait_s={device_wait_s}: at least 0")
    if exclusive_devices is None:
        exclusive_devices = devices is not None
    h = node(ready_timeout=ready_timeout, **dict(node_options or {}))
    address = ray.get(h.address.remote(ready_timeout))
    if token is None:
        token = ray.get(h.token.remote(tenant))
    if "label" not in connect_kwargs:
        ctx = ray.get_runtime_context()
        who = ctx.get_actor_id() or ctx.get_task_id()
        connect_kwargs["label"] = f"ray {'actor' if ctx.get_actor_id() else 'task'} {who}"
    deadline = time.monotonic() + device_wait_s
    delay = _DEVICE_WAIT_FIRST
    while True:
        try:
            return _session.connect(
                address,
                token,
                devices=devices,
                exclusive_devices=exclusive_devices,
                **connect_kwargs,
            )
        except ResourceExhausted as e:
            left = deadline - time.monotonic()
            if "(limit devices)" not in e.message or _NEVER_ENOUGH.search(e.message) or left <= 0:
                raise
            time.sleep(min(delay, left))
            delay = min(delay * 2, _DEVICE_WAIT_MAX)


def shutdown_node(node_id: str | None = None, timeout: float = 30.0) -> bool:
    """Stops NODE_ID's daemon (default: this node's) and kills its actor. Returns False when
    there was no actor."""
    name = actor_name(node_id or _current_node_id())
    try:
        h = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return False
    try:
        ray.get(h.shutdown.remote(timeout), timeout=timeout + 10)
    finally:
        ray.kill(h, no_restart=True)
    return True


def nodes() -> dict[str, Any]:
    """The tpubox node actors alive in the cluster: node id -> actor handle."""
    out = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a.get("namespace") == NAMESPACE and a["name"].startswith(NAME_PREFIX):
            out[a["name"][len(NAME_PREFIX):]] = ray.get_actor(a["name"], namespace=NAMESPACE)
    return out


# ------------------------------------------------------------------------------------------------
# Ray Serve: replicas that forward to their node's daemon, which batches across all of them.

_FORWARD_HEADERS = ("content-type", "inference-header-content-length", "content-encoding")
_RETRY_STATUSES = (429, 503)


class ModelDeployment:
    """A Ray Serve deployment class whose replicas forward each HTTP request to MODEL on their
    node's tpubox daemon over the Open Inference Protocol (REST), one request at a time, so that
    the daemon's dynamic batcher merges what all replicas, and every other client of the node,
    send at the same moment. Ray Serve's ``@serve.batch`` would batch per replica only.

    The route takes the protocol's own bodies: ``POST`` a KServe v2 inference request (JSON, or
    the binary extension with ``Inference-Header-Content-Length``) and get the daemon's answer
    (status, body and those headers) back; ``GET`` returns the model's metadata. The replica adds
    the tenant's ``Authorization``. Answers carry ``X-Tpubox-Replica`` (the replica's actor id)
    and ``X-Tpubox-In-Flight`` (the requests Serve had given this replica when this one went to
    the daemon, itself included: 1 with ``max_ongoing_requests=1``; the replica forwards one at a
    time in any case).

    Use :func:`serve_model`, which makes the deployment (``max_ongoing_requests=1``) and binds
    it; or ``serve.deployment(ModelDeployment, max_ongoing_requests=1).bind(model, ...)``.

    Args:
        model: the model's name in the node's model repository.
        tenant: the node actor's tenant whose token the replica uses (its ``models`` must list
            MODEL, or ``"*"``).
        token: a token to use instead (an operator's ``tokens_file``).
        node_options: the node actor's arguments if this replica creates it (see :func:`node`;
            ``model_repository`` is needed then).
        ready_timeout: seconds to wait for the node's daemon (and its models) to be ready.
        timeout: seconds one forwarded request may take.
        retries: how many times a request the daemon refuses for the moment (429, 503) or that
            finds the daemon gone (restarting) is sent again, 0.1 s apart and doubling.
    """

    def __init__(
        self,
        model: str,
        *,
        tenant: str = DEFAULT_TENANT,
        token: str | None = None,
        node_options: Mapping[str, Any] | None = None,
        ready_timeout: float = 120.0,
        timeout: float = 120.0,
        retries: int = 5,
    ):
        self._model = model
        self._timeout = timeout
        self._retries = retries
        self._ready_timeout = ready_timeout
        self._node = node(ready_timeout=ready_timeout, **dict(node_options or {}))
        self._token = token if token is not None else ray.get(self._node.token.remote(tenant))
        self._conn: http.client.HTTPConnection | None = None
        self._connect()
        self._lock = asyncio.Lock()
        self._in_flight = 0
        self._replica = ray.get_runtime_context().get_actor_id() or str(os.getpid())

    def _connect(self) -> None:
        doors = ray.get(self._node.inference_address.remote(self._ready_timeout))
        if doors is None:
            raise RuntimeError(
                "this node's tpubox daemon serves no model repository: create the node actor "
                "with model_repository= (node_options of serve_model)"
            )
        host, port = doors["http"].rsplit(":", 1)
        if self._conn is not None:
            self._conn.close()
        self._conn = http.client.HTTPConnection(host, int(port), timeout=self._timeout)

    def _send(self, method: str, path: str, body: bytes | None, headers: dict) -> tuple:
        """One request to the daemon over the replica's kept-alive connection (blocking)."""
        delay = 0.1
        for attempt in range(self._retries + 1):
            last = attempt == self._retries
            try:
                assert self._conn is not None
                self._conn.request(method, path, body=body, headers=headers)
                resp = self._conn.getresponse()
                data = resp.read()
                if resp.status in _RETRY_STATUSES and not last:
                    time.sleep(delay)
                    delay = min(delay * 2, 2.0)
                    continue
                return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data
            except (OSError, http.client.HTTPException):
                # The daemon restarted (or closed an idle connection): connect again.
                if last:
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
                self._connect()
        raise AssertionError("unreachable")

    async def __call__(self, request):
        from starlette.responses import Response

        body = await request.body()
        if request.method == "GET":
            method, path, body = "GET", f"/v2/models/{self._model}", None
        elif request.method == "POST":
            method, path = "POST", f"/v2/models/{self._model}/infer"
        else:
            return Response(status_code=405, headers={"Allow": "GET, POST"})
        headers = {"Authorization": f"Bearer {self._token}"}
        for k in _FORWARD_HEADERS:
            if k in request.headers:
                headers[k] = request.headers[k]
        self._in_flight += 1  # requests Serve gave this replica (1 with max_ongoing_requests=1)
        try:
            async with self._lock:  # one request at a time at the daemon, whatever Serve sends
                in_flight = self._in_flight
                status, rh, data = await asyncio.to_thread(self._send, method, path, body, headers)
        finally:
            self._in_flight -= 1
        out = {k: rh[k] for k in _FORWARD_HEADERS if k in rh}
        out["x-tpubox-replica"] = self._replica
        out["x-tpubox-in-flight"] = str(in_flight)
        media = out.pop("content-type", None)
        return Response(content=data, status_code=status, headers=out, media_type=media)


def serve_model(
    model: str,
    *,
    tenant: str = DEFAULT_TENANT,
    token: str | None = None,
    node_options: Mapping[str, Any] | None = None,
    num_replicas: int = 1,
    name: str | None = None,
    ray_actor_options: Mapping[str, Any] | None = None,
    ready_timeout: float = 120.0,
    timeout: float = 120.0,
    retries: int = 5,
    **deployment_options: Any,
) -> Any:
    """A bound Ray Serve application that serves MODEL of the node daemons' model repository:
    :class:`ModelDeployment` with NUM_REPLICAS replicas, each with ``max_ongoing_requests=1``
    (one request at a time; the daemon batches across replicas) and ``num_cpus=0.1`` unless
    RAY_ACTOR_OPTIONS says otherwise. Run it with ``serve.run(app, route_prefix="/minilm")``.

    Args:
        model, tenant, token, node_options, ready_timeout, timeout, retries: see
            :class:`ModelDeployment`.
        num_replicas: the deployment's replicas (or ``"auto"``: Serve's autoscaling).
        name: the deployment's name (default ``tpubox-<model>``).
        ray_actor_options: the replicas' Ray options.
        **deployment_options: more ``serve.deployment`` options (``autoscaling_config``, ...).
    """
    from ray import serve

    actor_options = {"num_cpus": 0.1, **dict(ray_actor_options or {})}
    options = {"max_ongoing_requests": 1, **deployment_options}
    deployment = serve.deployment(
        ModelDeployment,
        name=name or f"tpubox-{model}",
        num_replicas=num_replicas,
        ray_actor_options=actor_options,
        **options,
    )
    return deployment.bind(
        model,
        tenant=tenant,
        token=token,
        node_options=dict(node_options or {}),
        ready_timeout=ready_timeout,
        timeout=timeout,
        retries=retries,
    )
