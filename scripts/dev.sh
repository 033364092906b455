#!/usr/bin/env bash
# tpubox developer entry point. On a fresh machine it installs what is missing, then:
#   bash scripts/dev.sh setup   # only set up: system packages, Rust target, PJRT header and plugin, builds
#   bash scripts/dev.sh demo    # set up, then embed a few sentences with MiniLM in a sandboxed guest
#   bash scripts/dev.sh test    # set up, then run every test
#   bash scripts/dev.sh bench   # set up, then run the benchmarks (prints tables)
# Everything downloaded goes under ${TPUBOX_CACHE_DIR:-~/.cache/tpubox}; nothing under the repo
# except cargo's target/.
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE="${TPUBOX_CACHE_DIR:-$HOME/.cache/tpubox}"
# The PJRT C API header comes from the OpenXLA authors' CPU plugin wheel (API 0.81).
HEADER_PKG="xla-cpu-pjrt"
HEADER_VER="0.0.1"
HEADER_SHA="55837b6b7b47daa717f2d9a5a03563ea0ceaa338d06a81a1e2d3f060d960decc"
HEADER_DIR="$CACHE/plugins/$HEADER_PKG-$HEADER_VER"
GUESTS=(hello-matmul tpubox-probe tpubox-graph-ops minilm-embed)

log() { printf '\033[1m[dev.sh]\033[0m %s\n' "$*" >&2; }

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

setup_system() {
  local missing=()
  [ -e /usr/lib/llvm-14/lib/libclang.so ] || ls /usr/lib/llvm-*/lib/libclang*.so >/dev/null 2>&1 || missing+=(libclang-dev)
  command -v python3 >/dev/null || missing+=(python3 python3-pip)
  if [ ${#missing[@]} -gt 0 ]; then
    log "installing Debian packages: ${missing[*]}"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
  # moto's S3 server, started on loopback by the tier-3 compile-cache tests.
  if ! command -v moto_server >/dev/null; then
    log "installing moto[server]==5.2.1 (S3 server for the tier-3 cache tests)"
    python3 -m pip install --disable-pip-version-check -q "moto[server]==5.2.1"
  fi
  if ! rustup target list --installed | grep -qx wasm32-wasip2; then
    log "adding Rust target wasm32-wasip2"
    rustup target add wasm32-wasip2
  fi
}

setup_header() {
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

build() {
  log "building the host (release)"
  cargo build --release -p tpubox-host
  log "installing the default CPU plugin and the MiniLM model files"
  target/release/tpubox setup cpu minilm
  for g in "${GUESTS[@]}"; do
    log "building guest $g (wasm32-wasip2)"
    cargo build --release --target wasm32-wasip2 -p "$g"
  done
}

setup() { setup_system; setup_header; build; }

cmd="${1:-}"
case "$cmd" in
  setup) setup ;;
  demo)
    setup
    model="$(target/release/tpubox setup minilm | sed -n 's/^minilm: //p')"
    log "embedding sentences with all-MiniLM-L6-v2 in a sandboxed guest (examples/minilm-embed)"
    target/release/tpubox run --weights "minilm=$model/model.safetensors" --dir "$model::/model" \
      target/wasm32-wasip2/release/minilm-embed.wasm -- "${@:2}" </dev/null
    ;;
  test)
    setup
    log "running the tests"
    cargo test --release --workspace
    ;;
  bench)
    setup
    cargo bench -p tpubox-host --bench spine
    cargo bench -p tpubox-host --bench minilm
    cargo bench -p tpubox-host --bench cache
    ;;
  *)
    echo "usage: bash scripts/dev.sh setup|demo|test|bench" >&2
    exit 2
    ;;
esac
