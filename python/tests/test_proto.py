"""The committed generated code (python/tpubox/_proto) is what the pinned grpcio-tools makes
from host/proto/tpubox/v1/session.proto: regenerated into a temporary directory, byte for
byte. After changing the proto: bash scripts/dev.sh python-proto."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import gen_proto  # noqa: E402


@pytest.mark.parametrize("name", gen_proto.FILES)
def test_generated_code_is_current(tmp_path, name):
    gen_proto.generate(tmp_path)
    committed = ROOT / "tpubox" / "_proto" / name
    assert committed.is_file(), f"{committed} is missing: bash scripts/dev.sh python-proto"
    assert (tmp_path / name).read_bytes() == committed.read_bytes(), (
        f"{committed} is not what grpcio-tools makes from host/proto/tpubox/v1/session.proto: "
        "bash scripts/dev.sh python-proto"
    )


def test_installed_package_has_the_same_generated_code():
    import tpubox._proto.session_pb2 as installed

    committed = ROOT / "tpubox" / "_proto" / "session_pb2.py"
    assert Path(installed.__file__).read_bytes() == committed.read_bytes(), (
        "the installed tpubox is stale: pip install --no-deps ./python"
    )
