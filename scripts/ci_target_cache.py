#!/usr/bin/env python3
"""Keeps cargo's target directory of CI runs between clean clones (what CI caches such as
rust-cache do): the dependencies compiled by one run are reused by the next, and only the
workspace's own crates are compiled again.

    python3 scripts/ci_target_cache.py prepare DIR

`prepare` makes DIR ready for a run of this checkout:
- wipes DIR when it was filled by another toolchain (`rustc -vV` differs: nothing in it could
  be reused) or when it has grown past the size cap (TPUBOX_CI_TARGET_CAP_GIB, default 40);
- removes every artifact of the workspace's own packages (libraries, binaries, test and bench
  binaries, fingerprints, build-script outputs, incremental state) for every profile and
  target. A clean clone lives at a new path, so cargo would compile these again anyway; what
  an earlier clone left is only disk. Dependencies' artifacts stay: cargo's fingerprints decide
  whether each is still fresh (version, features, profile, flags), as they do in any target dir.

Package and target names come from `cargo metadata --no-deps` of the checkout. Cargo names
artifacts `<name>-<16 hex digits>` (fingerprint and build-script directories: the package name;
files under deps/ and incremental/: the target name with `-` as `_`, libraries prefixed `lib`).
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

STAMP = ".tpubox-ci-toolchain"
HASH = r"-[0-9a-f]{16}"


def workspace_names() -> tuple[set[str], set[str]]:
    """(package names, target names with `-` as `_`) of the workspace members."""
    meta = json.loads(
        subprocess.run(
            ["cargo", "metadata", "--no-deps", "--format-version", "1", "--offline"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    )
    packages, targets = set(), set()
    for pkg in meta["packages"]:
        packages.add(pkg["name"])
        for target in pkg["targets"]:
            targets.add(target["name"].replace("-", "_"))
    return packages, targets


def size_bytes(root: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def profile_dirs(root: Path):
    """Directories cargo writes a profile's artifacts to: DIR/<profile> and
    DIR/<target triple>/<profile> (those holding a .fingerprint directory)."""
    for fp in list(root.glob("*/.fingerprint")) + list(root.glob("*/*/.fingerprint")):
        yield fp.parent


def prune(root: Path, packages: set[str], targets: set[str]) -> int:
    pkg_re = re.compile("^(" + "|".join(map(re.escape, sorted(packages))) + ")" + HASH + "$")
    target_alt = "|".join(map(re.escape, sorted(targets)))
    file_re = re.compile("^(lib)?(" + target_alt + ")" + HASH + r"(\..*)?$")
    removed = 0
    for pdir in profile_dirs(root):
        for sub, pattern in ((".fingerprint", pkg_re), ("build", pkg_re), ("deps", file_re), ("incremental", file_re)):
            d = pdir / sub
            if not d.is_dir():
                continue
            for entry in d.iterdir():
                if not pattern.match(entry.name):
                    continue
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
                removed += 1
    return removed


def prepare(root: Path) -> None:
    toolchain = subprocess.run(["rustc", "-vV"], check=True, capture_output=True, text=True).stdout
    cap = float(os.environ.get("TPUBOX_CI_TARGET_CAP_GIB", "40")) * 2**30
    stamp = root / STAMP
    if root.exists():
        why = None
        if not stamp.exists() or stamp.read_text() != toolchain:
            why = "another toolchain filled it"
        elif (size := size_bytes(root)) > cap:
            why = f"{size / 2**30:.1f} GiB is over the cap of {cap / 2**30:.0f} GiB"
        if why:
            print(f"[ci-target] wiping {root}: {why}", file=sys.stderr)
            shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    stamp.write_text(toolchain)
    packages, targets = workspace_names()
    removed = prune(root, packages, targets)
    print(
        f"[ci-target] {root}: {removed} artifacts of {len(packages)} workspace packages removed; "
        "dependencies kept",
        file=sys.stderr,
    )


def main() -> int:
    if len(sys.argv) != 3 or sys.argv[1] != "prepare":
        print(__doc__, file=sys.stderr)
        return 2
    prepare(Path(sys.argv[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
