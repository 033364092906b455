"""scripts/ci_target_cache.py: what a kept CI target dir loses before a run, and what it keeps."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "ci_target_cache.py"
H = "0123456789abcdef"


def prepare(target: Path) -> str:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "prepare", str(target)], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return done.stderr


def toolchain() -> str:
    return subprocess.run(["rustc", "-vV"], capture_output=True, text=True, check=True).stdout


def touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("x")
    return path


def test_workspace_artifacts_go_dependencies_stay(tmp_path):
    t = tmp_path / "target"
    (t).mkdir()
    (t / ".tpubox-ci-toolchain").write_text(toolchain())
    ours = [
        touch(t / f"release/deps/libtpubox_core-{H}.rlib"),
        touch(t / f"release/deps/libtpubox_core-{H}.rmeta"),
        touch(t / f"release/deps/tpubox-{H}"),  # the CLI binary
        touch(t / f"release/deps/all-{H}"),  # tests/all
        touch(t / f"release/deps/all-{H}.d"),
        touch(t / f"release/.fingerprint/tpubox-core-{H}/lib-tpubox_core"),
        touch(t / f"release/build/pjrt-sys-{H}/out/bindings.rs"),
        touch(t / f"debug/.fingerprint/tpubox-serve-{H}/x"),
        touch(t / f"debug/incremental/tpubox_serve-{H}/s-1/x"),
        touch(t / f"wasm32-wasip2/release/deps/libtpubox_guest-{H}.rlib"),
        touch(t / f"wasm32-wasip2/release/.fingerprint/minilm-embed-{H}/x"),
    ]
    theirs = [
        touch(t / f"release/deps/libserde-{H}.rlib"),
        touch(t / f"release/deps/allocator_api2-{H}.d"),  # starts with a workspace target's name
        touch(t / f"release/deps/libtpubox_core_extra-{H}.rlib"),  # not a workspace name
        touch(t / f"release/.fingerprint/wasmtime-{H}/lib-wasmtime"),
        touch(t / f"release/build/zstd-sys-{H}/out/libzstd.a"),
        touch(t / f"wasm32-wasip2/release/deps/libtokenizers-{H}.rlib"),
    ]
    said = prepare(t)
    assert "removed" in said
    for p in ours:
        assert not p.exists(), p
    for p in theirs:
        assert p.exists(), p
    assert not (t / f"release/.fingerprint/tpubox-core-{H}").exists()
    assert not (t / f"release/build/pjrt-sys-{H}").exists()


def test_another_toolchain_wipes_the_dir(tmp_path):
    t = tmp_path / "target"
    dep = touch(t / f"release/deps/libserde-{H}.rlib")
    (t / ".tpubox-ci-toolchain").write_text("rustc 0.0.0 (not this one)\n")
    assert "another toolchain" in prepare(t)
    assert not dep.exists()
    assert (t / ".tpubox-ci-toolchain").read_text() == toolchain()
    # A second run with the same toolchain keeps what the first left.
    dep2 = touch(t / f"release/deps/libserde-{H}.rlib")
    assert "wiping" not in prepare(t)
    assert dep2.exists()
