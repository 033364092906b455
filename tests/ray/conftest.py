"""tpubox.ray against a real Ray: one local cluster per test module, started by the test on
loopback only (the node's address 127.0.0.1, no dashboard, no usage statistics), with the
`tpubox serve` binary of this checkout (TPUBOX_BIN, else target/release/tpubox: see
python/tests/tpubox_daemon.py) and the CPU plugin that `tpubox setup cpu` installed.

`bash scripts/dev.sh test` builds the binary, makes the venv ($CACHE/venv-ray, from
scripts/venvs/ray.txt) and installs ./python into it first.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python" / "tests"))

from tpubox_daemon import binary  # noqa: E402

# Before Ray starts: its processes (raylet, workers, the node actor) inherit the environment.
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
# ray.init() turns _node_ip_address="127.0.0.1" into the machine's routable address unless
# clusters are off, which keeps the node's address (and what binds to it) on loopback. The
# variable's name says Windows or macOS; Ray reads it on every platform.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
# The raylet waits for its agent process (Python) to write its port file before it registers;
# on a loaded 2-core machine that start can take longer than Ray's default allows.
os.environ.setdefault("RAY_agent_register_timeout_ms", "120000")
os.environ.setdefault("TPUBOX_LOG", "info")


def _tpubox_bin() -> str:
    try:
        return str(binary())
    except FileNotFoundError as e:
        pytest.exit(str(e), returncode=1)


@pytest.fixture(scope="module")
def cluster(request, tmp_path_factory):
    """A local Ray cluster (4 CPUs, loopback only) for the module, with the custom resources
    of the module's ``RAY_RESOURCES`` (a dict, if it has one); at the end every tpubox node
    actor is shut down (its daemon stopped) before Ray is. Yields a dict with ``node_id`` and
    ``cache_dir`` (a private compile cache for the node actor)."""
    import ray
    from ray import cloudpickle

    import tpubox.ray

    os.environ["TPUBOX_BIN"] = _tpubox_bin()
    ray.init(
        num_cpus=4,
        resources=dict(getattr(request.module, "RAY_RESOURCES", None) or {}),
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        namespace="tpubox-tests",
    )
    # The tasks the tests define travel by value: the workers cannot import the test modules.
    here = str(Path(__file__).parent)
    for name, mod in list(sys.modules.items()):
        if name.startswith("test_") and (getattr(mod, "__file__", None) or "").startswith(here):
            cloudpickle.register_pickle_by_value(mod)
    try:
        yield {
            "node_id": ray.get_runtime_context().get_node_id(),
            "cache_dir": str(tmp_path_factory.mktemp("tpubox-cache")),
        }
    finally:
        try:
            for node_id in tpubox.ray.nodes():
                tpubox.ray.shutdown_node(node_id)
        finally:
            ray.shutdown()
