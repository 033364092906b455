"""The transports a session reaches the daemon by.

- gRPC, over a Unix socket or TCP: every call. Here: addresses, the channel and its options, the
  bearer token, the two bulk calls (``PutTensor``/``GetTensor``: tensor bytes framed by
  :mod:`._wire`, cut into and reassembled from ``CHUNK_BYTES`` pieces) and the ``Attach``
  stream that ties an owned session to this process.
- The daemon's local socket (:mod:`._local`: memfds and JSON, on the daemon's machine): tensor
  data, executions and frees. Here: whether a session uses it, and connecting it.

Which transport a call takes is ``Session``'s choice, call by call.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import Any, Iterator, Mapping

import grpc
import numpy as np

from . import _dtypes, _local, _wire
from ._proto import session_pb2 as pb
from ._proto import session_pb2_grpc as pb_grpc
from .errors import Internal, Unavailable, Unsupported

#: Data bytes per PutTensor message and per GetTensor chunk asked for.
CHUNK_BYTES = 4 << 20
_MAX_MESSAGE = 1 << 30

_CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", _MAX_MESSAGE),
    ("grpc.max_receive_message_length", _MAX_MESSAGE),
    # A daemon that is not there fails a call at once (no wait_for_ready anywhere); reconnect
    # attempts after a lost connection start soon and back off to 5 s at most.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 5000),
    ("grpc.enable_retries", 0),
]


#: Address schemes that ask for TLS (``tls=`` may give the certificates).
TLS_SCHEMES = ("grpcs://", "https://")

#: Environment variables :meth:`TLS.from_env` reads (a kernel's provisioner sets them).
ENV_TLS_CA = "TPUBOX_TLS_CA"
ENV_TLS_CERT = "TPUBOX_TLS_CERT"
ENV_TLS_KEY = "TPUBOX_TLS_KEY"
ENV_TLS_SERVER_NAME = "TPUBOX_TLS_SERVER_NAME"


@dataclasses.dataclass(frozen=True)
class TLS:
    """How to reach a daemon that serves TLS on its TCP port (``tpubox serve --tls-cert``).

    Attributes:
        ca: a PEM file of the CA certificate(s) that signed the daemon's certificate; None
            trusts gRPC's default roots (the system's).
        cert: a PEM file of this client's certificate chain, for a daemon started with
            ``--tls-client-ca`` (with ``key``).
        key: the PEM file of that certificate's private key.
        server_name: the name to check the daemon's certificate against, when it is not the
            host of the address (e.g. connecting by IP to a certificate issued for a name).

    The files are read when a channel is made (each ``connect``), so a renewed certificate is
    picked up by the next session.
    """

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError(
                "tpubox TLS: give both cert and key (a client certificate), or neither"
            )

    @classmethod
    def coerce(cls, value: Any) -> "TLS | None":
        """TLS from what ``connect(tls=...)`` accepts: None/False (plain text), True (TLS,
        default roots), a path (the CA file), a mapping of the fields, or a TLS."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, (str, os.PathLike)):
            return cls(ca=os.fspath(value))
        if isinstance(value, Mapping):
            fields = {f.name for f in dataclasses.fields(cls)}
            unknown = set(value) - fields
            if unknown:
                raise ValueError(
                    f"tpubox TLS: unknown fields {sorted(unknown)} (known: {sorted(fields)})"
                )
            return cls(
                **{
                    k: (os.fspath(v) if isinstance(v, os.PathLike) else v)
                    for k, v in value.items()
                }
            )
        raise TypeError(
            "tls= takes None, a bool, a CA file path, a mapping or tpubox.TLS, "
            f"not {type(value).__name__}"
        )

    @classmethod
    def from_env(cls) -> "TLS | None":
        """TLS from ``TPUBOX_TLS_CA``, ``TPUBOX_TLS_CERT``, ``TPUBOX_TLS_KEY`` and
        ``TPUBOX_TLS_SERVER_NAME``; None when none is set."""
        v = {
            "ca": os.environ.get(ENV_TLS_CA) or None,
            "cert": os.environ.get(ENV_TLS_CERT) or None,
            "key": os.environ.get(ENV_TLS_KEY) or None,
            "server_name": os.environ.get(ENV_TLS_SERVER_NAME) or None,
        }
        if not any(v.values()):
            return None
        return cls(**v)

    def env(self) -> dict[str, str]:
        """The environment variables :meth:`from_env` reads back into this TLS."""
        out = {}
        for name, value in (
            (ENV_TLS_CA, self.ca),
            (ENV_TLS_CERT, self.cert),
            (ENV_TLS_KEY, self.key),
            (ENV_TLS_SERVER_NAME, self.server_name),
        ):
            if value:
                out[name] = os.path.abspath(value) if name != ENV_TLS_SERVER_NAME else value
        return out

    def credentials(self) -> grpc.ChannelCredentials:
        """gRPC channel credentials from the files.

        Raises:
            FileNotFoundError / PermissionError: a file that cannot be read.
        """

        def read(path: str | None) -> bytes | None:
            if path is None:
                return None
            with open(os.path.expanduser(path), "rb") as f:
                return f.read()

        return grpc.ssl_channel_credentials(
            root_certificates=read(self.ca),
            private_key=read(self.key),
            certificate_chain=read(self.cert),
        )


def resolve_tls(address: str, tls: Any) -> "TLS | None":
    """The TLS a connection to ADDRESS uses: TLS (``tls=``); else the environment's
    (``TPUBOX_TLS_*``) for a TCP address; else default-roots TLS for a ``grpcs://`` or
    ``https://`` address; else none.

    Raises:
        ValueError: TLS asked for a Unix socket (which never uses it: who may connect is who
            may write the socket file).
    """
    t = TLS.coerce(tls)
    unix = grpc_target(address).startswith(("unix:", "unix-abstract:"))
    if unix:
        if t is not None:
            raise ValueError(
                f"tls= was given for the Unix socket {address}: the daemon serves TLS on its TCP "
                "port only (a Unix socket is guarded by its file mode)"
            )
        return None
    if t is None:
        t = TLS.from_env()
    if t is None and os.fspath(address).strip().startswith(TLS_SCHEMES):
        t = TLS()
    return t


def grpc_target(address: str | os.PathLike[str]) -> str:
    """The gRPC target of ADDRESS: ``unix:PATH`` (also a bare path), or ``HOST:PORT``
    (``grpcs://HOST:PORT`` and ``https://HOST:PORT`` too: they ask for TLS)."""
    a = os.fspath(address).strip()
    if not a:
        raise ValueError("empty tpubox daemon address")
    if a.startswith(("unix:", "unix-abstract:")):
        return a
    if a.startswith(("/", "./", "../", "~")):
        return "unix:" + os.path.abspath(os.path.expanduser(a))
    for scheme in ("grpc://", "http://", "tcp://", "dns:///") + TLS_SCHEMES:
        if a.startswith(scheme):
            return a[len(scheme) :]
    return a


def grpc_channel(target: str, tls: "TLS | None" = None) -> grpc.Channel:
    """A gRPC channel to TARGET (a :func:`grpc_target`) with the session API's options, over
    TLS when TLS is given."""
    options = list(_CHANNEL_OPTIONS)
    if target.startswith(("unix:", "unix-abstract:")):
        # gRPC C-core's default :authority for a Unix socket is the percent-encoded socket
        # path, which the daemon's HTTP/2 server refuses (RST_STREAM PROTOCOL_ERROR).
        options.append(("grpc.default_authority", "localhost"))
    if tls is None:
        return grpc.insecure_channel(target, options=options)
    if tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return grpc.secure_channel(target, tls.credentials(), options=options)


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that presents TOKEN (a tenant or session token; none without one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def bulk_calls(
    channel: grpc.Channel,
) -> tuple[grpc.StreamUnaryMultiCallable, grpc.UnaryStreamMultiCallable]:
    """CHANNEL's PutTensor and GetTensor calls, with tensor bytes framed by :mod:`._wire`
    instead of protobuf messages (one copy of the data on each side)."""
    put = channel.stream_unary(
        "/tpubox.v1.Session/PutTensor",
        request_serializer=_wire.identity,
        response_deserializer=pb.TensorInfo.FromString,
    )
    get = channel.unary_stream(
        "/tpubox.v1.Session/GetTensor",
        request_serializer=pb.GetTensorRequest.SerializeToString,
        response_deserializer=_wire.parse_tensor_chunk,
    )
    return put, get


def sharded_calls(
    channel: grpc.Channel,
) -> tuple[grpc.StreamUnaryMultiCallable, grpc.UnaryStreamMultiCallable]:
    """CHANNEL's PutShardedTensor and GetShardedTensor calls, framed as :func:`bulk_calls`'."""
    put = channel.stream_unary(
        "/tpubox.v1.Session/PutShardedTensor",
        request_serializer=_wire.identity,
        response_deserializer=pb.ShardedTensorInfo.FromString,
    )
    get = channel.unary_stream(
        "/tpubox.v1.Session/GetShardedTensor",
        request_serializer=pb.GetShardedTensorRequest.SerializeToString,
        response_deserializer=_wire.parse_tensor_chunk,
    )
    return put, get


def put_sharded_messages(header: pb.PutShardedChunk, raw: memoryview) -> Iterator[bytes]:
    """The PutShardedTensor stream of a global array: HEADER with the first CHUNK_BYTES of
    RAW, then the rest, CHUNK_BYTES a message."""
    yield _wire.put_sharded_chunk(header, raw[:CHUNK_BYTES])
    for off in range(CHUNK_BYTES, len(raw), CHUNK_BYTES):
        yield _wire.put_sharded_chunk(None, raw[off : off + CHUNK_BYTES])


def put_messages(header: pb.PutTensorChunk, raw: memoryview) -> Iterator[bytes]:
    """The PutTensor stream of a tensor: HEADER with the first CHUNK_BYTES of RAW, then the
    rest of RAW, CHUNK_BYTES a message."""
    yield _wire.put_chunk(header, raw[:CHUNK_BYTES])
    for off in range(CHUNK_BYTES, len(raw), CHUNK_BYTES):
        yield _wire.put_chunk(None, raw[off : off + CHUNK_BYTES])


def read_tensor(call: Any) -> np.ndarray:
    """The tensor a GetTensor stream CALL carries, as a new, writable array of its shape and
    dtype. A ``grpc.RpcError`` of the stream passes through (the session maps it).

    Raises:
        tpubox.Internal: the stream sent no chunk, no header, or not the bytes announced.
    """
    try:
        info, data = next(call)
        if info is None:
            raise Internal("internal", "GetTensor: the first chunk carries no header")
        size = int(info.byte_size)
        out = np.empty(size, np.uint8)
        off = 0
        n = len(data)
        if n:
            out[off : off + n] = np.frombuffer(data, np.uint8)
            off += n
        for _, data in call:
            n = len(data)
            if off + n > size:
                raise Internal("internal", f"GetTensor: more than the {size} bytes announced")
            out[off : off + n] = np.frombuffer(data, np.uint8)
            off += n
    except StopIteration:
        raise Internal("internal", "GetTensor: the daemon sent no chunk") from None
    if off != size:
        raise Internal("internal", f"GetTensor: {off} bytes received, {size} announced")
    dt = _dtypes.from_wire(info.spec.dtype).newbyteorder("<")
    return out.view(dt).reshape(tuple(int(d) for d in info.spec.dims))


# ---------------------------------------------------------------------------------------------
# Attach: holds an owned session while this process lives


class Attachment:
    """An Attach stream read by a daemon thread. The session ends (on the daemon) when this
    process goes away, or when :meth:`cancel` is called and nothing else is attached."""

    def __init__(self, stub: pb_grpc.SessionStub, metadata: tuple, session_id: str):
        self.attached = threading.Event()
        self.done = threading.Event()
        self.ended_reason: str | None = None
        self.error: grpc.RpcError | None = None
        self._cancelled = False
        self._call = stub.Attach(pb.AttachRequest(), metadata=metadata)
        self._thread = threading.Thread(
            target=self._run, name=f"tpubox-attach-{session_id}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        try:
            for ev in self._call:
                if ev.kind == pb.AttachEvent.ATTACHED:
                    self.attached.set()
                elif ev.kind == pb.AttachEvent.ENDED:
                    self.ended_reason = ev.reason or "ended"
        except grpc.RpcError as e:
            if not self._cancelled:
                self.error = e
        except Exception:  # interpreter shutdown
            pass
        finally:
            self.done.set()
            self.attached.set()

    def cancel(self) -> None:
        self._cancelled = True
        try:
            self._call.cancel()
        except Exception:
            pass


# ---------------------------------------------------------------------------------------------
# The local socket


def local_channel(
    address: str, local_socket: str, token: str, local: bool | None
) -> _local.LocalChannel | None:
    """The local-socket channel a session at ADDRESS uses (see :func:`tpubox.connect`'s
    ``local``), connected, or None."""
    if local is False:
        return None
    if not local_socket or not _local.available():
        if local:
            raise Unsupported(
                "unsupported",
                f"the tpubox daemon at {address} offers no local socket (or this platform "
                "lacks memfds and SCM_RIGHTS)",
            )
        return None
    # A local socket is only trusted by default when the session itself is on a Unix socket
    # (so on this machine): a TCP session's daemon may be elsewhere, and the session token
    # must not go to whatever listens at that path here.
    if local is None and not grpc_target(address).startswith("unix:"):
        return None
    ch = _local.LocalChannel(local_socket, token, address)
    try:
        ch.connect()
    except OSError as e:
        if local:
            raise Unavailable(
                "unavailable",
                f"the tpubox daemon at {address}: its local socket {local_socket}: {e}",
            ) from None
        return None
    return ch
