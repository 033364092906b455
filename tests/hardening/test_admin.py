"""The operator's view (`tpubox admin`, the admin calls on the metrics port): live sessions
with tenant, label, bytes, device-seconds and age; ending one; reloading the tokens file
without ending the others; and who may do none of that."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hardening_util  # noqa: E402
from hardening_util import ATTACKER, PROBE, admin, bearer, request  # noqa: E402

import tpubox  # noqa: E402

ADD = """
func.func @main(%a: tensor<2x2xf32>, %b: tensor<2x2xf32>) -> tensor<2x2xf32> {
  %0 = stablehlo.add %a, %b : tensor<2x2xf32>
  func.return %0 : tensor<2x2xf32>
}
"""


def sessions(d, **kw) -> dict[str, dict]:
    rc, out, err = admin(d, "sessions", "--json", **kw)
    assert rc == 0, err
    return {r["label"]: r for r in json.loads(out)["sessions"]}


def test_admin_lists_sessions_and_ends_one(daemon):
    d = daemon()
    with (
        tpubox.connect(f"unix:{d.socket_path}", PROBE, label="kernel-a") as a,
        tpubox.connect(d.session_tcp, ATTACKER, label="kernel-b") as b,
    ):
        held = a.tensor(np.zeros(1 << 18, np.float32))  # 1 MiB on the device
        exe = b.compile(ADD)
        for _ in range(3):
            exe(np.ones((2, 2), np.float32), np.ones((2, 2), np.float32))
        rows = sessions(d)
        assert set(rows) == {"kernel-a", "kernel-b"}, rows
        ra, rb = rows["kernel-a"], rows["kernel-b"]
        assert (ra["tenant"], rb["tenant"]) == ("probe", "attacker")
        assert ra["id"] == a.session_id and rb["id"] == b.session_id
        assert ra["device_bytes"] == 1 << 20, ra
        assert rb["executions"] == 3 and rb["device_seconds"] > 0, rb
        assert rb["compiles"] >= 1 and ra["executions"] == 0
        for r in (ra, rb):
            assert 0 <= r["age_seconds"] < 120 and r["opened_unix_seconds"] > 1.7e9
            assert r["attached"] == 1, r  # each connect() holds an Attach stream

        # The table names both.
        rc, out, err = admin(d, "sessions")
        assert rc == 0, err
        assert "kernel-a" in out and "kernel-b" in out and "probe" in out, out

        # End kernel-a's session: its handles go, its next call says why; kernel-b goes on.
        rc, out, err = admin(d, "end", a.session_id)
        assert (rc, out.strip()) == (0, f"ended {a.session_id}"), err
        with pytest.raises(tpubox.SessionEnded, match="operator"):
            held.numpy()
        (z,) = exe(np.ones((2, 2), np.float32), np.full((2, 2), 2, np.float32))
        np.testing.assert_array_equal(z.numpy(), np.full((2, 2), 3))
        assert set(sessions(d)) == {"kernel-b"}
        # The tenant's bytes came back.
        assert tpubox.tenant_usage(f"unix:{d.socket_path}", PROBE).usage.device_bytes == 0

        # Ending it again, or an id nobody has: 404, exit 1, the reason on stderr.
        rc, _, err = admin(d, "end", a.session_id)
        assert rc == 1 and "404" in err and "no live session" in err, err
        rc, _, err = admin(d, "end", "s-0000000000000000")
        assert rc == 1 and "no live session" in err, err


def test_admin_calls_need_an_admin_token(daemon):
    d = daemon()
    for method, path in (
        ("GET", "/v2/admin/sessions"),
        ("DELETE", "/v2/admin/sessions/s-0000000000000000"),
        ("POST", "/v2/admin/reload"),
    ):
        assert request(d, method, path, port=d.metrics_port).status == 401
        r = request(d, method, path, headers=bearer(PROBE), port=d.metrics_port)
        assert r.status == 403 and "admin = true" in r.json()["error"], r
    rc, _, err = admin(d, "sessions", token=PROBE)
    assert rc == 1 and "403" in err, err
    rc, _, err = admin(d, "sessions", token=None)
    assert rc == 1 and "401" in err, err


def test_admin_reload_adds_a_tenant_and_keeps_the_file_on_errors(daemon):
    d = daemon()
    tokens = d.root / "tokens.toml"
    with tpubox.connect(f"unix:{d.socket_path}", PROBE, label="survivor") as s:
        tenants = dict(hardening_util.TENANTS)
        tenants["carol"] = {"token": "carol-token", "models": [], "session": {}}
        tokens.write_text(hardening_util.tokens_toml(tenants))
        rc, out, err = admin(d, "reload")
        assert rc == 0, err
        r = json.loads(out)
        assert r["added"] == ["carol"] and r["removed"] == [] and r["tokens_reloaded"], r
        with tpubox.connect(f"unix:{d.socket_path}", "carol-token", label="carol") as c:
            assert c.tenant == "carol"
        # A broken file: refused with the reason, the one in use stays, nobody is cut off.
        tokens.write_text(tokens.read_text() + "\n[[tenant]]\nname = 3\n")
        rc, _, err = admin(d, "reload")
        assert rc == 1 and "400" in err and "not reloaded" in err, err
        with tpubox.connect(f"unix:{d.socket_path}", "carol-token") as c:
            assert c.tenant == "carol"
        # The session opened before every reload is still there.
        assert s.usage().device_bytes == 0
        assert "survivor" in sessions(d)
