#!/usr/bin/env bash
# tpubox developer entry point. On a fresh machine it installs what is missing, then:
#   bash scripts/dev.sh setup   # only set up: system packages, Rust target, PJRT header and plugin, builds
#   bash scripts/dev.sh demo    # set up what the demo needs, then embed a few sentences with MiniLM
#   bash scripts/dev.sh test    # set up, then run every test
#   bash scripts/dev.sh lint    # fmt --check, clippy and doc with warnings denied (CI runs it)
#   bash scripts/dev.sh bench   # set up, then run the benchmarks (prints tables)
#   bash scripts/dev.sh polyglot  # only the C/Python/JavaScript guest tools and guests
#   bash scripts/dev.sh python-proto  # regenerate python/tpubox/_proto from host/proto (pinned grpcio-tools)
#   bash scripts/dev.sh fuzz [SECONDS] [TARGET]  # fuzz TARGET (wit_calls: WIT host calls; programs: generated StableHLO; doors: request decoding); default 600 s, wit_calls
# Everything downloaded goes under ${TPUBOX_CACHE_DIR:-~/.cache/tpubox}; nothing under the repo
# except cargo's target/.
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE="${TPUBOX_CACHE_DIR:-$HOME/.cache/tpubox}"
# cargo's output directory (honours CARGO_TARGET_DIR, e.g. one shared by several worktrees).
TARGET="${CARGO_TARGET_DIR:-target}"
# The PJRT C API header comes from the OpenXLA authors' CPU plugin wheel (API 0.81).
HEADER_PKG="xla-cpu-pjrt"
HEADER_VER="0.0.1"
HEADER_SHA="55837b6b7b47daa717f2d9a5a03563ea0ceaa338d06a81a1e2d3f060d960decc"
HEADER_DIR="$CACHE/plugins/$HEADER_PKG-$HEADER_VER"
# The XLA FFI C API header (custom-call handlers: the LAPACK handlers of crates/pjrt-lapack)
# ships in the jaxlib wheel's include/. The wheel is fetched for one fixed Python tag and
# platform, so that its SHA-256 is the same on every machine; only the header is kept.
FFI_HEADER_PKG="jaxlib"
FFI_HEADER_VER="0.10.2"
FFI_HEADER_WHEEL_TAG=(--python-version 3.11 --platform manylinux_2_27_x86_64)
FFI_HEADER_SHA="1faca3c5d4662cb4a6130a68105d68bb520764817e165d6eebfd6786c0d1f30f"
FFI_HEADER_DIR="$CACHE/headers/$FFI_HEADER_PKG-$FFI_HEADER_VER"
# Model guests of `tpubox serve` (tests/serve). They are cdylibs: cargo names their component
# with underscores, $TARGET/wasm32-wasip2/release/serve_dtypes.wasm (see guest_wasm); command
# guests keep the package name.
SERVE_GUESTS=(serve-dtypes serve-accumulator serve-decoder minilm-serve tpubox-triton-standins tpubox-triton-repeat tpubox-wasi-nn-model)
GUESTS=(hello-matmul tpubox-probe tpubox-graph-ops tpubox-eager tpubox-wit-0-1-0 tpubox-wasi-nn minilm-embed "${SERVE_GUESTS[@]}")

# Tools for guests in C, Python and JavaScript (docs/guests/), installed once under $TOOLS.
TOOLS="$CACHE/tools"
WASM_TOOLS_VER="1.263.0"       # wasm-tools component new (C)
WIT_BINDGEN_VER="0.63.0"       # wit-bindgen c (C)
ADAPTER_VER="48.0.8"           # WASI preview1 adapter (C): same version as wasmtime
ADAPTER_SHA="d3a1674fffec103c1d4367d4417a3bd5423cde3cfd56ff3b326b5fc72c0a8ebd"
COMPONENTIZE_PY_VER="0.25.1"   # Python
COMPONENTIZE_JS_VER="0.23.0"   # JavaScript; every npm package pinned in scripts/tools/componentize-js
POLYGLOT_GUESTS=(c-mlp python-mlp js-mlp)

log() { printf '\033[1m[dev.sh %4ds]\033[0m %s\n' "$SECONDS" "$*" >&2; }

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

# What every command needs: libclang for bindgen, python3 with pip (plugin and model wheels),
# OpenBLAS (the LAPACK behind the CPU plugin's linear-algebra custom calls, loaded at run time),
# and the Rust target guests are built for.
setup_core() {
  local missing=()
  [ -e /usr/lib/llvm-14/lib/libclang.so ] || ls /usr/lib/llvm-*/lib/libclang*.so >/dev/null 2>&1 || missing+=(libclang-dev)
  ldconfig -p 2>/dev/null | grep -q 'libopenblas\.so\.0 ' || missing+=(libopenblas0)
  command -v python3 >/dev/null || missing+=(python3 python3-pip)
  install_debian "${missing[@]}"
  if ! rustup target list --installed | grep -qx wasm32-wasip2; then
    log "adding Rust target wasm32-wasip2"
    rustup target add wasm32-wasip2
  fi
}

# What the tests need beyond that: the C/Python/JavaScript guest toolchains and python3-venv
# (the test venvs are set up by setup_venvs).
setup_system() {
  setup_core
  local missing=()
  python3 -c 'import venv, ensurepip' 2>/dev/null || missing+=(python3-venv)
  command -v npm >/dev/null || missing+=(nodejs npm)
  # tests/hardening/certs.py makes the TLS tests' certificates with the openssl command.
  command -v openssl >/dev/null || missing+=(openssl)
  # C guests: clang and wasm-ld for wasm32-wasi, WASI's libc, and clang's wasm32 builtins.
  local pkg
  for pkg in clang lld wasi-libc libclang-rt-14-dev-wasm32; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
  done
  install_debian "${missing[@]}"
}

# Python tools of the tests, each in its own venv under $CACHE (never the system Python), built
# from a requirements file that pins every package, transitive ones too (scripts/venvs/).
SERVE_VENV="$CACHE/venv-serve"   # tritonclient, numpy, pytest: tests/serve (tpubox serve)
MOTO_VENV="$CACHE/venv-moto"     # moto's S3 server: tests/all/cache_remote.rs (tier-3 cache)
JAX_VENV="$CACHE/venv-jax"       # a pinned jax: tests/jax (jax.export artifacts through tpubox exec)
PYTHON_VENV="$CACHE/venv-python" # the tpubox Python client: python/tests, tests/notebook (Jupyter)
BENCH_VENV="$CACHE/venv-bench"   # the MiniLM benchmark's anchors (PyTorch, ONNX Runtime): bench only
TORCH_VENV="$CACHE/venv-torch"   # PyTorch, transformers, torch-mlir: python/tests/pytorch (tpubox.torch)
RAY_VENV="$CACHE/venv-ray"       # a pinned ray: tests/ray (tpubox.ray on a local loopback Ray cluster)
ONNX_VENV="$CACHE/venv-onnx"     # the ONNX converter tpubox serve runs (torch-mlir, onnx; no torch)
ONNX_EXPORT_VENV="$CACHE/venv-onnx-export" # ONNX models built by PyTorch and ONNX Runtime: python/tests/onnx

# setup_venv DIR REQUIREMENTS: skipped while DIR's marker names this file's hash and this
# python3; otherwise DIR is rebuilt from scratch (a venv is not relocatable: built in place).
# Lines `#no-deps NAME==VERSION` of REQUIREMENTS are installed after the rest with --no-deps.
setup_venv() {
  local dir="$1" req="$2" key
  key="$(python3 -c 'import sys; print(sys.executable, sys.version.split()[0])') $(sha256sum "$req" | cut -d' ' -f1)"
  if [ -f "$dir/.tpubox-installed" ] && [ "$(cat "$dir/.tpubox-installed")" = "$key" ]; then return; fi
  log "installing $req into $dir"
  rm -rf "$dir"
  python3 -m venv "$dir"
  "$dir/bin/pip" install --quiet --disable-pip-version-check --only-binary :all: -r "$req"
  local no_deps
  mapfile -t no_deps < <(sed -n 's/^#no-deps[[:space:]]\+\([^[:space:]]\+\).*/\1/p' "$req")
  if [ ${#no_deps[@]} -gt 0 ]; then
    "$dir/bin/pip" install --quiet --disable-pip-version-check --only-binary :all: --no-deps "${no_deps[@]}"
  fi
  echo "$key" > "$dir/.tpubox-installed"
}

setup_venvs() {
  setup_venv "$SERVE_VENV" scripts/venvs/serve.txt
  setup_venv "$MOTO_VENV" scripts/venvs/moto.txt
  setup_venv "$JAX_VENV" scripts/venvs/jax.txt
  setup_venv "$PYTHON_VENV" scripts/venvs/python.txt
  setup_venv "$TORCH_VENV" scripts/venvs/torch.txt
  setup_venv "$RAY_VENV" scripts/venvs/ray.txt
  setup_venv "$ONNX_VENV" scripts/venvs/onnx.txt
  setup_venv "$ONNX_EXPORT_VENV" scripts/venvs/onnx-export.txt
  # tpubox serve runs `$ONNX_VENV/bin/python -m tpubox.onnx_convert` (crates/serve/src/onnx.rs).
  install_python_client "$ONNX_VENV"
}

# Installs ./python (the tpubox client) into venv $1 (default $PYTHON_VENV) again, so that the
# tests see its current sources and entry points (tpubox.torch's torch_dynamo_backends): no
# dependencies (the venv pins them), no build isolation (the venv's pinned setuptools builds it;
# nothing fetched). setuptools builds in the source tree: its build/ and
# egg-info are removed before (a stale build/lib would be packed) and after.
install_python_client() {
  local venv="${1:-$PYTHON_VENV}"
  rm -rf python/build python/tpubox.egg-info
  "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps --no-build-isolation \
    --force-reinstall ./python
  rm -rf python/build python/tpubox.egg-info
}

install_debian() {
  [ $# -gt 0 ] || return 0
  log "installing Debian packages: $*"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

setup_header() {
  setup_ffi_header
  if [ -f "$HEADER_DIR/.tpubox-installed" ]; then return; fi
  log "fetching the PJRT C API header ($HEADER_PKG==$HEADER_VER)"
  local tmp; tmp="$(mktemp -d)"
  python3 -m pip download --no-deps --disable-pip-version-check -q "$HEADER_PKG==$HEADER_VER" -d "$tmp"
  local whl; whl="$(ls "$tmp"/*.whl)"
  echo "$HEADER_SHA  $whl" | sha256sum -c --quiet
  rm -rf "$HEADER_DIR.tmp" && mkdir -p "$HEADER_DIR.tmp"
  python3 -m zipfile -e "$whl" "$HEADER_DIR.tmp"
  echo "$HEADER_SHA" > "$HEADER_DIR.tmp/.tpubox-installed"
  rm -rf "$HEADER_DIR" && mv "$HEADER_DIR.tmp" "$HEADER_DIR"
  rm -rf "$tmp"
}

setup_ffi_header() {
  if [ -f "$FFI_HEADER_DIR/.tpubox-installed" ]; then return; fi
  log "fetching the XLA FFI C API header ($FFI_HEADER_PKG==$FFI_HEADER_VER, include/ only)"
  local tmp; tmp="$(mktemp -d)"
  python3 -m pip download --no-deps --disable-pip-version-check -q --only-binary :all: \
    "${FFI_HEADER_WHEEL_TAG[@]}" "$FFI_HEADER_PKG==$FFI_HEADER_VER" -d "$tmp"
  local whl; whl="$(ls "$tmp"/*.whl)"
  echo "$FFI_HEADER_SHA  $whl" | sha256sum -c --quiet
  rm -rf "$FFI_HEADER_DIR.tmp" && mkdir -p "$FFI_HEADER_DIR.tmp"
  python3 - "$whl" "$FFI_HEADER_DIR.tmp" <<'PY'
import sys, zipfile, pathlib
whl, out = sys.argv[1], pathlib.Path(sys.argv[2])
with zipfile.ZipFile(whl) as z:
    for name in z.namelist():
        if name.startswith("jaxlib/include/xla/ffi/api/") and name.endswith(".h"):
            dest = out / name[len("jaxlib/"):]
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(z.read(name))
PY
  echo "$FFI_HEADER_SHA" > "$FFI_HEADER_DIR.tmp/.tpubox-installed"
  rm -rf "$FFI_HEADER_DIR" && mv "$FFI_HEADER_DIR.tmp" "$FFI_HEADER_DIR"
  rm -rf "$tmp"
}

# build_host [CARGO FLAGS]: the `tpubox` binary in release. The demo passes
# --no-default-features (no `tpubox serve`, no remote cache tier: it uses neither).
build_host() {
  log "building the host (release${1:+, $*})"
  cargo build --release -p tpubox "$@"
}

is_model_guest() {
  local m
  for m in "${SERVE_GUESTS[@]}"; do [ "$m" = "$1" ] && return 0; done
  return 1
}

# The component cargo builds for guest package $1.
guest_wasm() {
  if is_model_guest "$1"; then
    echo "$TARGET/wasm32-wasip2/release/${1//-/_}.wasm"
  else
    echo "$TARGET/wasm32-wasip2/release/$1.wasm"
  fi
}

# Checks that model guest $1's component exports tpubox:device/model, when wasm-tools is
# installed (with the polyglot tools; `setup` checks again once it has installed them).
check_model_guest() {
  local wasm wit wasm_tools="$TOOLS/wasm-tools-$WASM_TOOLS_VER/bin/wasm-tools"
  wasm="$(guest_wasm "$1")"
  [ -x "$wasm_tools" ] || return 0
  wit="$("$wasm_tools" component wit "$wasm")"
  grep -q '^  export tpubox:device/model@0.1.2;' <<<"$wit" ||
    { log "$wasm does not export tpubox:device/model@0.1.2"; return 1; }
}

# All guests in one cargo run: separate runs unify features per guest, so the proc macros they
# share (serde_derive, syn, wit-bindgen's) were compiled again for each.
build_guests() {
  local g wasm pkgs=()
  for g in "$@"; do pkgs+=(-p "$g"); done
  log "building guests $* (wasm32-wasip2)"
  cargo build --release --target wasm32-wasip2 "${pkgs[@]}"
  for g in "$@"; do
    wasm="$(guest_wasm "$g")"
    [ -f "$wasm" ] || { log "guest $g built, but $wasm is missing"; return 1; }
    if is_model_guest "$g"; then check_model_guest "$g"; fi
  done
}

# build [tests]: the host, the CPU plugin and model files, the guests. With `tests`, the host
# is built by `cargo test --no-run` of the whole workspace instead: its features unify with the
# test targets' dev-dependencies, and a plain `cargo build` first compiled wasmtime, Cranelift
# and their dependencies a second time (about 4 minutes of a CI run on 2 cores).
build() {
  if [ "${1:-}" = tests ]; then
    log "building the host and every test (release)"
    cargo test --release --workspace --no-run
  else
    build_host
  fi
  log "installing the default CPU plugin and the MiniLM model files"
  "$TARGET/release/tpubox" setup cpu minilm
  build_guests "${GUESTS[@]}"
}

# `cargo install`s one pinned tool into $TOOLS/NAME-VER, building in a throwaway target dir so
# that the project's target/ is neither polluted nor locked.
install_cargo_tool() {
  local crate="$1" ver="$2" dir="$3" bin="$4"; shift 4
  if [ -x "$dir/bin/$bin" ]; then return; fi
  log "installing $crate $ver into $dir (once; several minutes)"
  local tmp; tmp="$(mktemp -d)"
  CARGO_TARGET_DIR="$tmp" cargo install --locked --quiet --root "$dir" "$@" "$crate@$ver"
  rm -rf "$tmp"
}

setup_polyglot_tools() {
  install_cargo_tool wit-bindgen-cli "$WIT_BINDGEN_VER" "$TOOLS/wit-bindgen-$WIT_BINDGEN_VER" wit-bindgen \
    --no-default-features --features c
  install_cargo_tool wasm-tools "$WASM_TOOLS_VER" "$TOOLS/wasm-tools-$WASM_TOOLS_VER" wasm-tools \
    --no-default-features --features component,validate,print

  # The adapter ships in a crates.io crate; cargo fetches it, we check its SHA-256.
  local adapter="$TOOLS/wasi-adapter-$ADAPTER_VER"
  if [ ! -f "$adapter/.tpubox-installed" ]; then
    log "fetching the WASI preview1 adapter (wasi-preview1-component-adapter-provider $ADAPTER_VER)"
    local tmp; tmp="$(mktemp -d)"
    mkdir -p "$tmp/src" && touch "$tmp/src/lib.rs"
    printf '[package]\nname = "adapter-fetch"\nversion = "0.0.0"\nedition = "2021"\n[dependencies]\nwasi-preview1-component-adapter-provider = "=%s"\n' \
      "$ADAPTER_VER" > "$tmp/Cargo.toml"
    (cd "$tmp" && cargo fetch --quiet)
    local crate
    crate="$(ls "${CARGO_HOME:-$HOME/.cargo}"/registry/cache/*/"wasi-preview1-component-adapter-provider-$ADAPTER_VER.crate" | head -n1)"
    echo "$ADAPTER_SHA  $crate" | sha256sum -c --quiet
    rm -rf "$adapter.tmp" && mkdir -p "$adapter.tmp"
    tar -xzf "$crate" -C "$adapter.tmp" --strip-components=2 \
      "wasi-preview1-component-adapter-provider-$ADAPTER_VER/artefacts"
    echo "$ADAPTER_SHA" > "$adapter.tmp/.tpubox-installed"
    rm -rf "$adapter" && mv "$adapter.tmp" "$adapter"
    rm -rf "$tmp"
  fi

  # A venv is not relocatable: build it in place; the marker says it is complete.
  local py="$TOOLS/componentize-py-$COMPONENTIZE_PY_VER"
  if [ ! -f "$py/.tpubox-installed" ]; then
    log "installing componentize-py $COMPONENTIZE_PY_VER into $py"
    rm -rf "$py"
    python3 -m venv "$py"
    "$py/bin/pip" install --quiet --disable-pip-version-check --only-binary :all: \
      "componentize-py==$COMPONENTIZE_PY_VER"
    touch "$py/.tpubox-installed"
  fi

  local js="$TOOLS/componentize-js-$COMPONENTIZE_JS_VER" node_major
  node_major="$(node -p 'process.versions.node.split(".")[0]')"
  if [ "$node_major" -lt 20 ]; then
    echo "componentize-js $COMPONENTIZE_JS_VER needs Node.js 20 or newer; found $(node --version)" >&2
    exit 1
  fi
  if [ ! -f "$js/.tpubox-installed" ] || ! cmp -s scripts/tools/componentize-js/package-lock.json "$js/package-lock.json"; then
    log "installing componentize-js $COMPONENTIZE_JS_VER into $js (npm ci)"
    rm -rf "$js" && mkdir -p "$js"
    cp scripts/tools/componentize-js/package.json scripts/tools/componentize-js/package-lock.json "$js/"
    (cd "$js" && npm ci --no-audit --no-fund --silent)
    touch "$js/.tpubox-installed"
  fi
}

# Builds examples/{c,python,js}-mlp into $POLYGLOT_OUT/NAME.wasm. A guest is rebuilt only when
# its inputs (sources, WIT, tool versions) changed: their hash is kept next to the .wasm.
POLYGLOT_OUT="$TARGET/polyglot"

polyglot_stamp() {
  { echo "$WASM_TOOLS_VER $WIT_BINDGEN_VER $ADAPTER_VER $COMPONENTIZE_PY_VER $COMPONENTIZE_JS_VER"
    find wit examples/wit "examples/$1" scripts/tools -type f ! -path '*/__pycache__/*' -print0 | sort -z | xargs -0 sha256sum
  } | sha256sum | cut -d' ' -f1
}

build_polyglot_guest() {
  local name="$1" out; out="$(mkdir -p "$POLYGLOT_OUT" && cd "$POLYGLOT_OUT" && pwd)"
  local stamp; stamp="$(polyglot_stamp "$name")"
  if [ -f "$out/$name.wasm" ] && [ "$(cat "$out/$name.stamp" 2>/dev/null)" = "$stamp" ]; then
    return
  fi
  log "building guest $name"
  rm -f "$out/$name.wasm" "$out/$name.stamp"
  case "$name" in
    c-mlp)
      # Bindings are generated here, never committed: guest.h, guest.c, guest_component_type.o.
      local gen="$out/c-mlp.gen"
      rm -rf "$gen" && mkdir -p "$gen"
      local said
      said="$("$TOOLS/wit-bindgen-$WIT_BINDGEN_VER/bin/wit-bindgen" c wit --world guest --out-dir "$gen" 2>&1)" ||
        { echo "$said" >&2; return 1; }
      clang --target=wasm32-wasi -O2 -Wall -Wextra -Werror -Wno-unused-parameter -Wl,--strip-debug -I "$gen" \
        examples/c-mlp/mlp.c "$gen/guest.c" "$gen/guest_component_type.o" -o "$gen/c-mlp.core.wasm"
      "$TOOLS/wasm-tools-$WASM_TOOLS_VER/bin/wasm-tools" component new "$gen/c-mlp.core.wasm" \
        --adapt "wasi_snapshot_preview1=$TOOLS/wasi-adapter-$ADAPTER_VER/wasi_snapshot_preview1.command.wasm" \
        -o "$out/c-mlp.wasm"
      ;;
    python-mlp)
      (cd examples/python-mlp && "$TOOLS/componentize-py-$COMPONENTIZE_PY_VER/bin/componentize-py" \
        -d ../wit -w command componentize app -o "$out/python-mlp.wasm" >/dev/null)
      ;;
    js-mlp)
      # `-d http fetch-event`: without it the component imports wasi:http, which the host lacks.
      (cd examples/js-mlp && "$TOOLS/componentize-js-$COMPONENTIZE_JS_VER/node_modules/.bin/componentize-js" \
        mlp.js --wit ../wit --world-name command-args -d http fetch-event -o "$out/js-mlp.wasm")
      ;;
  esac
  echo "$stamp" > "$out/$name.stamp"
}

build_polyglot() {
  local g
  for g in "${POLYGLOT_GUESTS[@]}"; do build_polyglot_guest "$g"; done
}

# wasmtime's wasi-nn ONNX classification example (tests/wasi-nn/wasmtime/, vendored unchanged:
# its own workspace and Cargo.lock) into $WASI_NN_OUT/classification-component-onnx.wasm, for
# tests/wasi-nn. Built in a cargo target dir of its own under $WASI_NN_OUT (the example's release
# profile differs from ours: LTO, opt-level "s"), and only when its inputs (the vendored files,
# the toolchain) changed: their hash is kept next to the .wasm. About 45 s on 2 cores when built.
WASI_NN_OUT="$TARGET/wasi-nn"
WASI_NN_EXAMPLE="tests/wasi-nn/wasmtime/crates/wasi-nn/examples/classification-component-onnx"

build_wasi_nn_example() {
  local out; out="$(mkdir -p "$WASI_NN_OUT" && cd "$WASI_NN_OUT" && pwd)"
  local name=classification-component-onnx stamp
  stamp="$({ rustc -vV; find tests/wasi-nn/wasmtime -name target -prune -o -type f -print0 | sort -z | xargs -0 sha256sum; } | sha256sum | cut -d' ' -f1)"
  if [ -f "$out/$name.wasm" ] && [ "$(cat "$out/$name.stamp" 2>/dev/null)" = "$stamp" ]; then
    return
  fi
  log "building wasmtime's wasi-nn example $name (wasm32-wasip2)"
  rm -f "$out/$name.wasm" "$out/$name.stamp"
  (cd "$WASI_NN_EXAMPLE" && CARGO_TARGET_DIR="$out/cargo" cargo build --release --locked --target wasm32-wasip2)
  cp "$out/cargo/wasm32-wasip2/release/$name.wasm" "$out/$name.wasm"
  # A component (layer 1), not a core module: \0asm, version 0x0d, layer 1.
  [ "$(head -c 8 "$out/$name.wasm" | od -An -tx1 | tr -d ' \n')" = 0061736d0d000100 ] ||
    { log "$out/$name.wasm is not a component"; return 1; }
  echo "$stamp" > "$out/$name.stamp"
}

setup() {
  setup_system; setup_venvs; setup_header; build "$@"; build_wasi_nn_example; setup_polyglot_tools; build_polyglot
  local g
  for g in "${SERVE_GUESTS[@]}"; do check_model_guest "$g"; done
}

# Fuzzes TARGET (default wit_calls: the WIT host calls; programs: structure-aware StableHLO
# programs; doors: the session API's and inference doors' request decoding, see
# fuzz/README.md) for SECONDS. cargo-fuzz wants nightly; RUSTC_BOOTSTRAP=1 lets the
# stable toolchain take its flags. No sanitizer: the host is safe Rust and the plugin is not
# instrumented, so ASan would only cost speed. Its own target dir, because its flags differ from
# the workspace's. Fork mode keeps fuzzing past a crash; crash inputs land in
# fuzz/artifacts/TARGET/. The programs target sends recursive and deeply nested programs to
# compile workers (the release tpubox binary).
CARGO_FUZZ_VER="0.13.2"
fuzz() {
  local seconds="${1:-600}" target="${2:-wit_calls}"
  case "$target" in wit_calls|programs|doors) ;; *) log "unknown fuzz target $target (wit_calls, programs, doors)"; return 2 ;; esac
  setup_header
  # The doors target decodes requests only: no plugin, no compile worker.
  [ "$target" = doors ] || "$TARGET/release/tpubox" setup cpu >/dev/null
  install_cargo_tool cargo-fuzz "$CARGO_FUZZ_VER" "$TOOLS/cargo-fuzz-$CARGO_FUZZ_VER" cargo-fuzz
  mkdir -p "fuzz/corpus/$target"
  log "fuzzing $target for $seconds s (corpus fuzz/corpus/$target, regressions fuzz/regressions/$target)"
  local fuzz_env=(RUSTC_BOOTSTRAP=1 CARGO_TARGET_DIR="${FUZZ_TARGET_DIR:-$TARGET/fuzz}"
    PATH="$TOOLS/cargo-fuzz-$CARGO_FUZZ_VER/bin:$PATH"
    TPUBOX_COMPILE_WORKER="$( [ "$target" = doors ] || { cd "$TARGET/release" && pwd; } )/tpubox")
  # Regression inputs first: each once crashed the target and must pass now.
  # Stored as hex text (no binaries in git); decoded into the target dir before replay.
  local regdir="${FUZZ_TARGET_DIR:-$TARGET/fuzz}/regressions/$target"
  rm -rf "$regdir" && mkdir -p "$regdir"
  for h in fuzz/regressions/"$target"/*.hex; do
    [ -f "$h" ] || continue
    python3 -c 'import sys; open(sys.argv[2], "wb").write(bytes.fromhex(open(sys.argv[1]).read().strip()))' \
      "$h" "$regdir/$(basename "$h" .hex)"
  done
  for f in "$regdir"/*; do
    [ -f "$f" ] || continue
    (cd fuzz && env "${fuzz_env[@]}" cargo fuzz run "$target" --release --sanitizer none "$f") \
      || { log "regression $f FAILS"; return 1; }
  done
  (cd fuzz && env "${fuzz_env[@]}" cargo fuzz run "$target" --release --sanitizer none -- \
    -max_total_time="$seconds" -rss_limit_mb=8192 -timeout=60 -print_final_stats=1 \
    -fork=1 -ignore_crashes=1)
  log "crash inputs kept: $(find "fuzz/artifacts/$target" -name 'crash-*' 2>/dev/null | wc -l) (fuzz/artifacts/$target/)"
}

cmd="${1:-}"
case "$cmd" in
  setup) setup ;;
  polyglot) setup_system; setup_polyglot_tools; build_polyglot ;;
  demo)
    # Only what the demo uses: no guest toolchains for other languages, no test servers.
    setup_core; setup_header; build_host --no-default-features
    "$TARGET/release/tpubox" setup cpu >/dev/null
    model="$("$TARGET/release/tpubox" setup minilm | sed -n 's/^minilm: //p')"
    build_guests minilm-embed
    log "embedding sentences with all-MiniLM-L6-v2 in a sandboxed guest (examples/minilm-embed)"
    "$TARGET/release/tpubox" run --weights "minilm=$model/model.safetensors" --dir "$model::/model" \
      "$TARGET/wasm32-wasip2/release/minilm-embed.wasm" -- "${@:2}" </dev/null
    ;;
  test)
    setup tests
    log "running the tests"
    TPUBOX_MOTO_SERVER="$MOTO_VENV/bin/moto_server" cargo test --release --workspace
    # jax.export artifacts made by a pinned jax, run with tpubox exec against JAX's outputs.
    log "running the jax.export tests (tests/jax, pytest)"
    "$JAX_VENV/bin/python" -m pytest tests/jax -q -p no:cacheprovider
    # tpubox serve driven by Triton's own clients (tritonclient over HTTP and gRPC).
    log "running the serving tests (tests/serve, pytest)"
    "$SERVE_VENV/bin/python" -m pytest tests/serve -q
    # The daemon under attack: callers that never authenticate, slow readers, floods.
    log "running the adversarial daemon tests (tests/hardening, pytest)"
    "$SERVE_VENV/bin/python" -m pytest tests/hardening -q
    # The Python client against tpubox serve's session API, tpubox.jax against JAX on the CPU.
    install_python_client
    log "running the Python client tests (python/tests, pytest)"
    "$PYTHON_VENV/bin/python" -m pytest python/tests -q -p no:cacheprovider
    # Jupyter kernels (jupyter_client, ipykernel) started through the tpubox kernel provisioner.
    log "running the notebook tests (tests/notebook, pytest)"
    "$PYTHON_VENV/bin/python" -m pytest tests/notebook -q -p no:cacheprovider
    # torch.compile(backend="tpubox") against PyTorch eager (tpubox.torch, torch-mlir).
    install_python_client "$TORCH_VENV"
    log "running the PyTorch backend tests (python/tests/pytorch, pytest)"
    "$TORCH_VENV/bin/python" -m pytest python/tests/pytorch -q -p no:cacheprovider
    # ONNX models: the converter against ONNX Runtime, and Triton repositories of ONNX models
    # served by tpubox serve (the converter's venv as the daemon's child).
    install_python_client "$ONNX_VENV"
    log "running the ONNX tests (python/tests/onnx, pytest)"
    TPUBOX_ONNX_PYTHON="$ONNX_VENV/bin/python" "$ONNX_EXPORT_VENV/bin/python" -m pytest python/tests/onnx -q
    # tpubox.ray: the node actor that owns the daemon, sessions from Ray tasks (a local cluster
    # on loopback, started by the tests).
    install_python_client "$RAY_VENV"
    log "running the Ray integration tests (tests/ray, pytest)"
    "$RAY_VENV/bin/python" -m pytest tests/ray -q -p no:cacheprovider
    # The scripts' own logic (CI's kept target dir).
    log "running the scripts' tests (scripts/tests, pytest)"
    "$SERVE_VENV/bin/python" -m pytest scripts/tests -q -p no:cacheprovider
    # wasmtime's wasi-nn ONNX classification example, unchanged, under `tpubox run` against ONNX
    # Runtime (issue 52; the venv with ONNX Runtime, the converter's Python passed on). Last:
    # until the host implements wasi-nn it fails, and the suites above still run.
    log "running wasmtime's wasi-nn example (tests/wasi-nn, pytest)"
    TPUBOX_ONNX_PYTHON="$ONNX_VENV/bin/python" "$ONNX_EXPORT_VENV/bin/python" -m pytest tests/wasi-nn -q
    ;;
  python-proto)
    # python/tpubox/_proto from host/proto/tpubox/v1/session.proto; python/tests checks that
    # the committed files are what this writes.
    setup_venv "$PYTHON_VENV" scripts/venvs/python.txt
    "$PYTHON_VENV/bin/python" python/tools/gen_proto.py python/tpubox/_proto
    log "regenerated python/tpubox/_proto"
    ;;
  lint)
    # The gates CI runs besides the tests (.ci/run): formatting, clippy, docs; warnings fail.
    setup_core; setup_header
    log "cargo fmt --check"
    cargo fmt --all -- --check
    log "cargo clippy (warnings are errors)"
    cargo clippy --workspace --all-targets -- -D warnings
    # The demo's build of the CLI (no `serve`, no remote cache tier).
    cargo clippy -p tpubox --no-default-features -- -D warnings
    log "cargo doc (warnings are errors)"
    RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps
    # fuzz/ is its own workspace (cargo fuzz's flags); check that its targets still build, in
    # this target dir so that the dependencies clippy just checked are reused.
    log "cargo clippy of the fuzz targets (fuzz/, warnings are errors)"
    CARGO_TARGET_DIR="$TARGET" cargo clippy --manifest-path fuzz/Cargo.toml --bins -- -D warnings
    ;;
  bench)
    setup
    # The MiniLM anchors (sentence-transformers on PyTorch, ONNX Runtime); about 6 GB, bench only.
    setup_venv "$BENCH_VENV" scripts/venvs/bench.txt
    cargo bench -p tpubox --bench all -- spine minilm cache tenants eager exported
    # The session API from the Python client: tiny-execute latency, 64 MiB transfers.
    install_python_client
    "$PYTHON_VENV/bin/python" python/bench/bench_session.py
    # An ONNX model served from a Triton repository against ONNX Runtime in process.
    TPUBOX_BIN="$TARGET/release/tpubox" TPUBOX_ONNX_PYTHON="$ONNX_VENV/bin/python" \
      "$ONNX_EXPORT_VENV/bin/python" python/bench/bench_onnx_serve.py
    ;;
  fuzz)
    setup_system
    if [ ! -x "$TARGET/release/tpubox" ]; then cargo build --release -p tpubox; fi
    fuzz "${2:-600}" "${3:-wit_calls}"
    ;;
  *)
    echo "usage: bash scripts/dev.sh setup|demo|test|lint|bench|polyglot|python-proto|fuzz [SECONDS] [TARGET]" >&2
    exit 2
    ;;
esac
