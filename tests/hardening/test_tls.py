"""TLS on every TCP door (`tpubox serve --tls-cert --tls-key [--tls-client-ca]`), reached by
the real clients: tritonclient over HTTPS and gRPC with SSL, the tpubox Python client with
`tls=`, and an HTTPS scrape of the metrics. Then what TLS adds to attack: plain text on a TLS
port, a handshake that never finishes, client certificates that are missing or from a CA
nobody trusts, and a certificate renewed under a running daemon (SIGHUP)."""

from __future__ import annotations

import http.client
import json
import shutil
import signal
import socket
import ssl
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

sys.path.insert(0, str(Path(__file__).resolve().parent))

import certs  # noqa: E402
import serve_util  # noqa: E402  (tests/serve, on the path through hardening_util)
from hardening_util import OPS, PROBE, admin, bearer, request  # noqa: E402

import tpubox  # noqa: E402

ADD = """
func.func @main(%a: tensor<2x2xf32>, %b: tensor<2x2xf32>) -> tensor<2x2xf32> {
  %0 = stablehlo.add %a, %b : tensor<2x2xf32>
  func.return %0 : tensor<2x2xf32>
}
"""


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> certs.Certs:
    return certs.make_all(tmp_path_factory.mktemp("pki"))


def _http_client(d, pki: certs.Certs, client: certs.Pair | None = None):
    opts = {"ca_certs": str(pki.ca.cert)}
    if client is not None:
        opts.update(certfile=str(client.cert), keyfile=str(client.key))
    return httpclient.InferenceServerClient(
        f"{d.host}:{d.http_port}", ssl=True, ssl_options=opts, network_timeout=30
    )


def _grpc_client(d, pki: certs.Certs, client: certs.Pair | None = None):
    kw = {}
    if client is not None:
        kw = {"private_key": str(client.key), "certificate_chain": str(client.cert)}
    return grpcclient.InferenceServerClient(
        d.grpc_url, ssl=True, root_certificates=str(pki.ca.cert), **kw
    )


def _infer_both(d, pki: certs.Certs, client: certs.Pair | None = None) -> None:
    """A dtypes inference over HTTPS and over gRPC with SSL, each checked element by element."""
    data = serve_util.dtypes_data(shape=(1, 4), seed=7)
    with _http_client(d, pki, client) as c:
        r = c.infer("dtypes", serve_util.http_inputs(data, binary=True), headers=bearer(PROBE))
        serve_util.assert_flipped(r.as_numpy, data)
    with _grpc_client(d, pki, client) as g:
        r = g.infer(
            "dtypes", serve_util.grpc_inputs(data), headers={"authorization": f"Bearer {PROBE}"}
        )
        serve_util.assert_flipped(r.as_numpy, data)


def _session_add(address: str, tls) -> np.ndarray:
    with tpubox.connect(address, PROBE, tls=tls, label="tls test") as s:
        exe = s.compile(ADD)
        (z,) = exe(np.ones((2, 2), np.float32), np.full((2, 2), 2, np.float32))
        return z.numpy()


def _plain_request_fails(host: str, port: int) -> None:
    """A plain-text HTTP request to a TLS port gets no HTTP answer."""
    conn = http.client.HTTPConnection(host, port, timeout=15)
    try:
        with pytest.raises((http.client.HTTPException, OSError)):
            conn.request("GET", "/v2/health/live")
            conn.getresponse().read()
    finally:
        conn.close()


def _closed_by_peer(s: socket.socket) -> bool:
    """Waits (up to the socket's timeout) for the peer to close; True when it did."""
    try:
        return s.recv(1 << 16) == b""
    except ConnectionResetError:
        return True


def test_every_tcp_door_speaks_tls_to_the_real_clients(daemon, pki):
    d = daemon(tls=pki)
    _infer_both(d, pki)
    # The session API's TCP port: the tpubox client with tls= (a CA path, a TLS, a mapping).
    for tls in (str(pki.ca.cert), tpubox.TLS(ca=str(pki.ca.cert)), {"ca": pki.ca.cert}):
        np.testing.assert_array_equal(_session_add(d.session_tcp, tls), np.full((2, 2), 3))
    # And from the environment, as a kernel gets it from its provisioner.
    mp = pytest.MonkeyPatch()
    try:
        mp.setenv("TPUBOX_TLS_CA", str(pki.ca.cert))
        np.testing.assert_array_equal(_session_add(d.session_tcp, None), np.full((2, 2), 3))
    finally:
        mp.undo()
    # The Unix socket stays plain (its file mode guards it); tls= there is a mistake.
    np.testing.assert_array_equal(_session_add(f"unix:{d.socket_path}", None), np.full((2, 2), 3))
    with pytest.raises(ValueError, match="Unix socket"):
        tpubox.connect(f"unix:{d.socket_path}", PROBE, tls=True)
    # Metrics over HTTPS (hardening_util's connections use the test CA).
    assert "tpubox_" in d.metrics()
    assert request(d, "GET", "/v2/health/ready").status == 200

    # Plain text on every TLS port: no answer, the handshake counted as refused.
    before = d.protection_count("tls-handshake")
    _plain_request_fails(d.host, d.http_port)
    _plain_request_fails(d.host, d.metrics_port)
    with pytest.raises(InferenceServerException):
        grpcclient.InferenceServerClient(d.grpc_url).is_server_live(client_timeout=10)
    with pytest.raises(tpubox.Unavailable):
        tpubox.connect(d.session_tcp, PROBE, timeout=10)
    # A client that does not trust the daemon's CA gives up on its own.
    ctx = ssl.create_default_context(cafile=str(pki.other_ca.cert))
    conn = http.client.HTTPSConnection(d.host, d.http_port, timeout=15, context=ctx)
    with pytest.raises(ssl.SSLCertVerificationError):
        conn.request("GET", "/v2/health/live")
    conn.close()
    deadline = time.monotonic() + 10
    while d.protection_count("tls-handshake") < before + 4 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert d.protection_count("tls-handshake") >= before + 4
    # Still serving.
    _infer_both(d, pki)


def test_a_handshake_that_never_finishes_is_closed_at_the_header_timeout(daemon, pki):
    d = daemon(tls=pki, extra_args=("--header-timeout-seconds", "1"))
    before = d.protection_count("tls-handshake")
    socks = []
    for partial in (b"", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"):
        s = socket.create_connection((d.host, d.http_port), timeout=10)
        if partial:
            s.sendall(partial)  # the first bytes of a ClientHello, and then nothing
        socks.append(s)
    t0 = time.monotonic()
    for s in socks:
        assert _closed_by_peer(s), "the daemon answered a stalled handshake instead of closing"
    waited = time.monotonic() - t0
    assert waited < 5, f"the stalled handshakes were closed after {waited:.1f} s (limit 1 s)"
    for s in socks:
        s.close()
    assert d.protection_count("tls-handshake") >= before + 2
    _infer_both(d, pki)


def test_required_client_certificates(daemon, pki):
    d = daemon(tls=pki, client_auth="required")
    # With the test CA's client certificate: every client works.
    _infer_both(d, pki, pki.client)
    tls = tpubox.TLS(ca=str(pki.ca.cert), cert=str(pki.client.cert), key=str(pki.client.key))
    np.testing.assert_array_equal(_session_add(d.session_tcp, tls), np.full((2, 2), 3))
    # Without one, or with one from another CA: the handshake fails, nothing else is read.
    for who in (None, pki.stranger):
        with pytest.raises(Exception) as e:
            with _http_client(d, pki, who) as c:
                c.is_server_live()
        assert not isinstance(e.value, AssertionError)
        with pytest.raises(InferenceServerException):
            with _grpc_client(d, pki, who) as g:
                g.is_server_live(client_timeout=10)
        bad = tpubox.TLS(ca=str(pki.ca.cert))
        if who is not None:
            bad = tpubox.TLS(ca=str(pki.ca.cert), cert=str(who.cert), key=str(who.key))
        with pytest.raises(tpubox.Unavailable):
            tpubox.connect(d.session_tcp, PROBE, tls=bad, timeout=10)
    # `tpubox admin` with the CA and a client certificate.
    tls_args = ("--ca", str(pki.ca.cert), "--cert", str(pki.client.cert), "--key", str(pki.client.key))
    rc, out, err = admin(d, "sessions", "--json", extra=tls_args)
    assert rc == 0 and json.loads(out) == {"sessions": []}, err
    rc, _, err = admin(d, "sessions", extra=tls_args[:2])
    assert rc != 0, "a client without a certificate got through"
    # The certificate admits the connection; the token still names the tenant.
    r = request(d, "GET", "/v2/models/dtypes")
    assert r.status == 401, r
    assert request(d, "GET", "/v2/models/dtypes", headers=bearer(PROBE)).status == 200


def test_optional_client_certificates(daemon, pki):
    d = daemon(tls=pki, client_auth="optional")
    _infer_both(d, pki)  # no certificate: served
    _infer_both(d, pki, pki.client)  # a valid one: served
    with pytest.raises(InferenceServerException):  # an invalid one: refused
        with _grpc_client(d, pki, pki.stranger) as g:
            g.is_server_live(client_timeout=10)


def test_sighup_renews_the_certificate_without_a_restart(daemon, pki, tmp_path):
    # The daemon reads its certificate from files the test replaces.
    live = certs.Certs(
        ca=pki.ca,
        server=certs.Pair(tmp_path / "live.pem", tmp_path / "live.key"),
        client=pki.client,
        other_ca=pki.other_ca,
        stranger=pki.stranger,
    )
    shutil.copy(pki.server.cert, live.server.cert)
    shutil.copy(pki.server.key, live.server.key)
    d = daemon(tls=live)
    _infer_both(d, pki)
    # A renewed certificate from a new CA.
    new_ca = certs.make_ca(tmp_path / "new", "new-ca")
    renewed = certs.make_leaf(tmp_path / "new", "server2", new_ca, server=True)
    # A half-written key first: the reload fails and the certificate in use stays.
    live.server.key.write_text("-----BEGIN PRIVATE KEY-----\ngarbage\n")
    shutil.copy(renewed.cert, live.server.cert)
    d.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while "TLS files were not reloaded" not in d.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "TLS files were not reloaded" in d.log(), d.log()[-3000:]
    _infer_both(d, pki)
    # Then the whole pair: new connections get the new certificate.
    shutil.copy(renewed.key, live.server.key)
    d.proc.send_signal(signal.SIGHUP)
    new_pki = certs.Certs(
        ca=new_ca,
        server=renewed,
        client=pki.client,
        other_ca=pki.other_ca,
        stranger=pki.stranger,
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            _infer_both(d, new_pki)
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    with pytest.raises(tpubox.Unavailable):
        tpubox.connect(d.session_tcp, PROBE, tls=str(pki.ca.cert), timeout=10)
    d.tls = new_pki
    assert "tpubox_" in d.metrics(OPS)
