"""SIGTERM with requests still queued: a second server over the same repository, with a drain
time of 1 s, gets SIGTERM while 12 requests of 64 sentences each wait on MiniLM (seconds of
work). Readiness turns false, requests finish or get 503, none hangs, and the server exits 0
within the drain time plus a few seconds."""

import http.client
import json
import signal
import struct
import subprocess
import threading
import time

from conftest import _binary, _free_ports
from serve_util import http_headers, load_reference

DRAIN = 1.0


def _ready(host, port) -> int | None:
    try:
        c = http.client.HTTPConnection(host, port, timeout=2)
        c.request("GET", "/v2/health/ready")
        r = c.getresponse()
        r.read()
        return r.status
    except OSError:
        return None


def test_sigterm_bounds_the_drain(server, tmp_path):
    http_port, grpc_port, metrics_port = _free_ports(3)
    log = open(tmp_path / "serve2.log", "wb")
    proc = subprocess.Popen(
        [str(_binary()), "serve", "--model-repository", str(server.repo),
         "--tokens", str(server.tokens), "--http-port", str(http_port),
         "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port),
         "--drain-seconds", str(DRAIN)],
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while _ready(server.host, http_port) != 200:
            assert proc.poll() is None, (tmp_path / "serve2.log").read_text()
            assert time.monotonic() < deadline, "the second server did not get ready"
            time.sleep(0.2)
        texts = [c["text"] for c in load_reference()] * 8
        raw = b"".join(struct.pack("<I", len(t.encode())) + t.encode() for t in texts)
        head = json.dumps(
            {"inputs": [{"name": "text", "shape": [len(texts)], "datatype": "BYTES",
                         "parameters": {"binary_data_size": len(raw)}}],
             "outputs": [{"name": "embedding", "parameters": {"binary_data": True}}]}
        ).encode()  # fmt: skip
        statuses = []

        def send():
            c = http.client.HTTPConnection(server.host, http_port, timeout=60)
            try:
                c.request(
                    "POST", "/v2/models/minilm/infer", body=head + raw,
                    headers={**http_headers("load-a"), "Inference-Header-Content-Length": str(len(head))},
                )  # fmt: skip
                r = c.getresponse()
                r.read()
                statuses.append(r.status)
            except OSError as e:
                statuses.append(type(e).__name__)
            finally:
                c.close()

        threads = [threading.Thread(target=send) for _ in range(12)]
        for t in threads:
            t.start()
        time.sleep(0.5)  # queued behind one another by now
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=DRAIN + 10)
        took = time.monotonic() - start
        for t in threads:
            t.join(timeout=30)
        assert rc == 0, (tmp_path / "serve2.log").read_text()
        assert took < DRAIN + 5, f"exited {took:.1f} s after SIGTERM with a {DRAIN} s drain"
        assert all(not t.is_alive() for t in threads), "a client still waits"
        assert len(statuses) == 12, statuses
        # Each request either finished or was refused as the server shut down (or, when it was
        # executing at exit, saw its connection close).
        assert set(statuses) <= {200, 503, "RemoteDisconnected", "ConnectionResetError"}, statuses
        assert 503 in statuses, f"no queued request was refused: {statuses}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
