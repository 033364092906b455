"""An ONNX model served by `tpubox serve` against the same model in ONNX Runtime in process,
throughput and latency at concurrency 1 and 16, in one run (issue 49; not run in CI).

    TPUBOX_BIN=target/release/tpubox TPUBOX_ONNX_PYTHON=$CACHE/venv-onnx/bin/python \\
        $CACHE/venv-onnx-export/bin/python python/bench/bench_onnx_serve.py \\
        [--model bert|resnet] [--seconds 10] [--rounds 2] [--queue-delay-us 500]

($CACHE is ~/.cache/tpubox; venv-onnx-export has torch, transformers, onnx, onnxruntime and
tritonclient, venv-onnx is the converter's venv that the daemon runs.)

The model is built offline from a `transformers` config with random weights (nothing is
downloaded) and exported by `torch.onnx.export` with a dynamic batch dimension:

- `bert` (default): BERT, hidden 256, 4 layers, 4 heads, intermediate 1024, vocab 30522,
  sequence 64; inputs `input_ids`, `attention_mask` (the last 8 positions padding),
  `token_type_ids`, int64 [batch, 64]; outputs `last_hidden_state` f32[batch, 64, 256] and
  `pooler_output` f32[batch, 256]; 11 M parameters (7.8 M of them the embeddings), about
  0.4 GFLOP a sequence.
- `resnet`: ResNet, widths 32/64/128/256, depths 1/1/1/1, basic blocks, `pixel_values`
  f32[batch, 3, 96, 96] -> `pooler_output` f32[batch, 256, 1, 1].

It is written as a Triton repository (`config.pbtxt` with `platform: "onnxruntime_onnx"`,
`max_batch_size: 16`, `dynamic_batching { max_queue_delay_microseconds: D }`, one instance,
and `1/model.onnx`) and served by `tpubox serve` (TPUBOX_BIN; else `target/release/tpubox` of
CARGO_TARGET_DIR) on loopback ports. Its load converts
the model to StableHLO programs for batch sizes 1, 2, 4, 8 and 16 (cached by the file's hash
under `--workdir`, so a second run does not convert again) and compiles them; that is not
timed. Once the server is ready, tpubox's answers to a
batch-1 request and to 16 concurrent batch-1 requests are checked against ONNX Runtime's
(rtol 1e-4, atol 1e-5), so the bench measures a correct model.

Rows, each timed for SECONDS after a short warm-up, interleaved (ORT c1, tpubox gRPC c1,
tpubox HTTP c1, ORT c16, tpubox gRPC c16, tpubox HTTP c16, then again, ROUNDS times) so that
drift hits every side alike; each figure is the median over the rounds (with 2 rounds, their
mean):

- ONNX Runtime in this process (CPUExecutionProvider, default session options and threads):
  concurrency 1 is one thread calling `sess.run` on batch-1 inputs in a loop, concurrency 16 is
  16 threads doing so on the one session;
- tpubox over gRPC (`tritonclient.grpc`): one client thread with a synchronous `infer` of batch
  1, or 16 threads each with its own client;
- tpubox over HTTP (`tritonclient.http`, binary tensors), the same.

Printed: requests/s, client-side p50 and p99 latency, and tpubox's requests/s over ORT's; then,
for the tpubox rows, the server's own statistics over the timed window (Triton's
`get_inference_statistics`, read as the window opens and after its last request): the mean
batch size it ran, the mean time a request waited in the queue, the mean execution of a batch,
and the mean time a request spent in the server, so the client's mean latency splits into
queue, execution and what is outside the server (protocol, client, scheduling). Last, with
`--batch-seconds` S > 0 (default 2), one request of batch B = 1, 2, 4, 8, 16 at a time, ORT and
tpubox (gRPC) in turn for S seconds each: ms a call and per item, and tpubox's execution of the
batch, which shows what batching buys on the device (the CPU plugin).

**ORT and tpubox share the same machine's cores** (2 on the project's build machine): the
daemon, its device (the CPU PJRT plugin's threads), ONNX Runtime's threads and every client
thread of this process run on them. ORT runs in process with no protocol; tpubox's client
threads serialize and parse requests on the same cores the server computes on. Time only on a
quiet machine: before timing, the bench waits (polling every 20 s, up to 20 minutes; `--no-wait`
skips it) until no `rustc`, `cargo` or `pytest` process runs, and prints what else was running
before and after.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

REPO = Path(__file__).resolve().parents[2]
CACHE = Path.home() / ".cache" / "tpubox"
RTOL, ATOL = 1e-4, 1e-5
MAX_BATCH = 16
BUSY = "rustc|cargo |pytest"

Feeds = dict[str, np.ndarray]


# ---------------------------------------------------------------------------------- models

BERT_SEQ, BERT_VOCAB = 64, 30522


def bert_feeds(bs: int, seed: int = 0) -> Feeds:
    """Inputs of the BERT: random ids, the last 8 positions padding, two token types."""
    g = np.random.default_rng(1000 + seed)
    mask = np.ones((bs, BERT_SEQ), np.int64)
    mask[:, BERT_SEQ - 8 :] = 0
    tt = (np.arange(BERT_SEQ)[None, :] >= BERT_SEQ // 2).astype(np.int64)
    return {
        "input_ids": g.integers(0, BERT_VOCAB, (bs, BERT_SEQ)).astype(np.int64),
        "attention_mask": mask,
        "token_type_ids": tt.repeat(bs, 0),
    }


def resnet_feeds(bs: int, seed: int = 0) -> Feeds:
    g = np.random.default_rng(2000 + seed)
    return {"pixel_values": g.standard_normal((bs, 3, 96, 96)).astype(np.float32)}



def build_bert(d: Path) -> Path:
    import torch
    from transformers import BertConfig, BertModel

    cfg = BertConfig(
        vocab_size=BERT_VOCAB,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=1024,
        max_position_embeddings=128,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = BertModel(cfg).eval()

    class Wrap(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
            o = self.m(
                input_ids=input_ids,
                attention_mask=attention_mask,
                token_type_ids=token_type_ids,
                return_dict=True,
            )
            return o.last_hidden_state, o.pooler_output

    ex = {k: torch.from_numpy(v) for k, v in bert_feeds(2).items()}
    batch = torch.export.Dim("batch", min=1, max=64)
    path = d / "model.onnx"
    torch.onnx.export(
        Wrap().eval(),
        (ex["input_ids"], ex["attention_mask"], ex["token_type_ids"]),
        str(path),
        input_names=["input_ids", "attention_mask", "token_type_ids"],
        output_names=["last_hidden_state", "pooler_output"],
        dynamic_shapes={k: {0: batch} for k in ex},
        dynamo=True,
        external_data=False,
        verbose=False,
    )
    return path


def build_resnet(d: Path) -> Path:
    import torch
    from transformers import ResNetConfig, ResNetModel

    cfg = ResNetConfig(
        num_channels=3,
        embedding_size=32,
        hidden_sizes=[32, 64, 128, 256],
        depths=[1, 1, 1, 1],
        layer_type="basic",
        hidden_act="relu",
    )
    torch.manual_seed(0)
    model = ResNetModel(cfg).eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 1.5)

    class Wrap(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, pixel_values: Any) -> Any:
            return self.m(pixel_values=pixel_values, return_dict=True).pooler_output

    path = d / "model.onnx"
    torch.onnx.export(
        Wrap().eval(),
        (torch.from_numpy(resnet_feeds(2)["pixel_values"]),),
        str(path),
        input_names=["pixel_values"],
        output_names=["pooler_output"],
        dynamic_shapes={"pixel_values": {0: torch.export.Dim("batch", min=1, max=64)}},
        dynamo=True,
        external_data=False,
        verbose=False,
    )
    return path


BUILDERS = {"bert": (build_bert, bert_feeds), "resnet": (build_resnet, resnet_feeds)}
_ONNX_TYPES = {1: "TYPE_FP32", 7: "TYPE_INT64"}


def config_pbtxt(name: str, model: Path, delay_us: int) -> str:
    """Triton's config for MODEL (its inputs and outputs without the batch dimension)."""
    import onnx

    g = onnx.load(str(model), load_external_data=False).graph
    inits = {i.name for i in g.initializer}

    def tensors(vis) -> str:
        out = []
        for v in vis:
            if v.name in inits:
                continue
            t = v.type.tensor_type
            dims = [d.dim_value for d in t.shape.dim][1:]
            out.append(
                f'  {{ name: "{v.name}" data_type: {_ONNX_TYPES[t.elem_type]} '
                f"dims: [ {', '.join(map(str, dims))} ] }}"
            )
        return ",\n".join(out)

    return (
        f'name: "{name}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: {MAX_BATCH}\n'
        f"input [\n{tensors(g.input)}\n]\noutput [\n{tensors(g.output)}\n]\n"
        f"dynamic_batching {{ max_queue_delay_microseconds: {delay_us} }}\n"
        "instance_group [ { count: 1 kind: KIND_CPU } ]\n"
    )


# ---------------------------------------------------------------------------------- server


def tpubox_bin() -> Path:
    """TPUBOX_BIN, else the release build of CARGO_TARGET_DIR (default target/)."""
    if os.environ.get("TPUBOX_BIN"):
        return Path(os.environ["TPUBOX_BIN"])
    t = Path(os.environ.get("CARGO_TARGET_DIR") or "target")
    return (t if t.is_absolute() else REPO / t) / "release" / "tpubox"


def _ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Served:
    """`tpubox serve` of REPO on loopback ports, its log under ROOT."""

    def __init__(self, root: Path, repo: Path, binary: Path, converter: Path, extra: list[str]):
        self.root, self.repo, self.binary, self.converter = root, repo, binary, converter
        self.extra = extra
        self.http_port, self.grpc_port, self.metrics_port = _ports(3)
        self.http_url = f"127.0.0.1:{self.http_port}"
        self.grpc_url = f"127.0.0.1:{self.grpc_port}"
        self.log_path = root / "serve.log"
        self.proc: subprocess.Popen | None = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def start(self, timeout: float = 900) -> "Served":
        import tritonclient.http as httpclient

        env = dict(os.environ)
        env.update(
            TPUBOX_LOG="info",
            TPUBOX_ONNX_PYTHON=str(self.converter),
            TPUBOX_ONNX_PYTHONPATH=str(REPO / "python"),
            TPUBOX_ONNX_CACHE_DIR=str(self.root / "onnx-cache"),
        )
        cmd = [
            str(self.binary), "serve", "--model-repository", str(self.repo),
            "--host", "127.0.0.1", "--http-port", str(self.http_port),
            "--grpc-port", str(self.grpc_port), "--metrics-port", str(self.metrics_port),
            *self.extra,
        ]  # fmt: skip
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL
            )
        client = httpclient.InferenceServerClient(self.http_url)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                sys.exit(f"tpubox serve exited ({self.proc.returncode}):\n{self.log()[-4000:]}")
            try:
                if client.is_server_ready():
                    return self
            except Exception:  # noqa: BLE001 - not listening yet
                pass
            if time.monotonic() > deadline:
                self.stop()
                sys.exit(f"tpubox serve not ready after {timeout:.0f} s:\n{self.log()[-4000:]}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# ---------------------------------------------------------------------------------- clients


def _datatype(a: np.ndarray) -> str:
    return {np.float32: "FP32", np.int64: "INT64"}[a.dtype.type]


def grpc_caller(url: str, model: str, feeds: Feeds, outputs: list[str]) -> Callable[[], Any]:
    """A synchronous batch-1 request over gRPC on a client of its own."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    inputs = []
    for name, a in feeds.items():
        i = grpcclient.InferInput(name, list(a.shape), _datatype(a))
        i.set_data_from_numpy(a)
        inputs.append(i)
    outs = [grpcclient.InferRequestedOutput(o) for o in outputs]

    def call() -> Any:
        r = client.infer(model, inputs, outputs=outs)
        return [r.as_numpy(o) for o in outputs]

    return call


def http_caller(url: str, model: str, feeds: Feeds, outputs: list[str]) -> Callable[[], Any]:
    """The same over HTTP (binary tensors both ways)."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(url, connection_timeout=120, network_timeout=120)
    inputs = []
    for name, a in feeds.items():
        i = httpclient.InferInput(name, list(a.shape), _datatype(a))
        i.set_data_from_numpy(a, binary_data=True)
        inputs.append(i)
    outs = [httpclient.InferRequestedOutput(o, binary_data=True) for o in outputs]

    def call() -> Any:
        r = client.infer(model, inputs, outputs=outs)
        return [r.as_numpy(o) for o in outputs]

    return call


def ort_caller(sess: Any, feeds: Feeds, outputs: list[str]) -> Callable[[], Any]:
    def call() -> Any:
        return sess.run(outputs, feeds)

    return call


def run_row(
    make: Callable[[int], Callable[[], Any]],
    conc: int,
    seconds: float,
    warm: float,
    at_edges: Callable[[], Any] | None = None,
):
    """CONC threads, each with its own caller (MAKE(thread index), made before the clock
    starts), calling in a loop: WARM seconds untimed, then SECONDS timed. AT_EDGES (if given)
    is called as the timed window opens and after its last request. Returns (requests/s,
    latencies in s, AT_EDGES' two results)."""
    callers = [make(i) for i in range(conc)]
    lat: list[list[float]] = [[] for _ in range(conc)]
    ends = [0.0] * conc
    errors: list[BaseException] = []
    start_barrier = threading.Barrier(conc + 1)
    timed_barrier = threading.Barrier(conc + 1)
    clock: dict[str, float] = {}

    def worker(k: int) -> None:
        call, mine = callers[k], lat[k]
        try:
            start_barrier.wait()
            stop_warm = clock["warm_end"]
            while time.perf_counter() < stop_warm:
                call()
            timed_barrier.wait()
            stop = time.perf_counter() + seconds
            while True:
                t0 = time.perf_counter()
                call()
                t1 = time.perf_counter()
                mine.append(t1 - t0)
                if t1 >= stop:
                    break
            ends[k] = t1
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            errors.append(e)
            start_barrier.abort()
            timed_barrier.abort()

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(conc)]
    for t in threads:
        t.start()
    clock["warm_end"] = time.perf_counter() + warm
    try:
        start_barrier.wait()
        timed_barrier.wait()
    except threading.BrokenBarrierError:
        pass  # a worker failed: its error is raised below
    t_start = time.perf_counter()
    first = at_edges() if at_edges else None
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    last = at_edges() if at_edges else None
    n = sum(len(x) for x in lat)
    return (
        n / (max(ends) - t_start),
        np.concatenate([np.asarray(x) for x in lat]),
        (first, last),
    )


# ---------------------------------------------------------------------------------- the machine


def busy() -> str:
    """The running rustc/cargo/pytest processes, a line each (command lines cut short)."""
    r = subprocess.run(["pgrep", "-af", BUSY], capture_output=True, text=True)
    return "\n".join(line[:150] for line in r.stdout.strip().splitlines())


def _cpu_ticks() -> dict[int, tuple[str, int]]:
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            st = (d / "stat").read_text()
        except OSError:
            continue
        comm = st[st.index("(") + 1 : st.rindex(")")]
        f = st[st.rindex(")") + 2 :].split()
        out[int(d.name)] = (comm, int(f[11]) + int(f[12]))  # utime + stime
    return out


def top_processes(n: int = 6, window: float = 1.0) -> str:
    """The N processes that used the most CPU over the next WINDOW seconds."""
    a = _cpu_ticks()
    time.sleep(window)
    b = _cpu_ticks()
    hz = os.sysconf("SC_CLK_TCK")
    use = sorted(
        ((t - a[p][1]) / hz / window * 100, p, c) for p, (c, t) in b.items() if p in a
    )[::-1][:n]
    return "\n".join(f"    {pct:5.0f} % {pid:>7} {comm}" for pct, pid, comm in use if pct > 0)


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def wait_quiet(limit_s: float = 1200, poll_s: float = 20) -> None:
    t0 = time.monotonic()
    while True:
        b = busy()
        if not b:
            waited = time.monotonic() - t0
            print(f"quiet: no rustc/cargo/pytest process (waited {waited:.0f} s)", flush=True)
            return
        if time.monotonic() - t0 > limit_s:
            print(f"WARNING: still busy after {limit_s:.0f} s; timing anyway:\n{b[:2000]}")
            return
        first = b.splitlines()[0][:160]
        print(f"waiting for a quiet machine ({len(b.splitlines())} busy: {first} ...)", flush=True)
        time.sleep(poll_s)


# ---------------------------------------------------------------------------------- main


def server_stats(client: Any, model: str) -> dict[str, Any]:
    """Triton's statistics of MODEL (an HTTP client's), summed as the bench reads them."""
    s = client.get_inference_statistics(model)["model_stats"][0]
    inf = s["inference_stats"]
    batches = {b["batch_size"]: b["compute_infer"] for b in s.get("batch_stats", [])}
    return {
        "ok": inf["success"]["count"],
        "server_ns": inf["success"]["ns"],
        "queue_ns": inf["queue"]["ns"],
        "exec": sum(b["count"] for b in batches.values()),
        "exec_ns": sum(b["ns"] for b in batches.values()),
        "items": sum(bs * b["count"] for bs, b in batches.items()),
    }


def stats_delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    d = {k: b[k] - a[k] for k in a}
    ok, ex = max(d["ok"], 1), max(d["exec"], 1)
    return {
        "batch": d["items"] / ex,
        "queue_us": d["queue_ns"] / ok / 1e3,
        "exec_us": d["exec_ns"] / ex / 1e3,
        "server_us": d["server_ns"] / ok / 1e3,
    }


def per_batch(
    sess: Any, grpc_url: str, stats: Callable[[], Any], name: str, feeds_of, outputs, seconds
) -> list[tuple[int, float, float, float]]:
    """One request of batch B at a time, B = 1, 2, 4, 8, 16, ORT and tpubox (gRPC) in turn,
    SECONDS each: (B, ORT ms a call, tpubox's client ms a call, tpubox's execution ms of the
    batch in the server)."""
    out = []
    for b in (1, 2, 4, 8, MAX_BATCH):
        f = feeds_of(b, 0)
        ms = []
        for call in (ort_caller(sess, f, outputs), grpc_caller(grpc_url, name, f, outputs)):
            call()  # warm
            s0, n, t0 = stats(), 0, time.perf_counter()
            while (t := time.perf_counter()) - t0 < seconds or n < 3:
                call()
                n += 1
            ms.append((t - t0) / n * 1e3)
            d = stats_delta(s0, stats())
        out.append((b, ms[0], ms[1], d["exec_us"] / 1e3))
    return out


def check(name: str, got: list[np.ndarray], want: list[np.ndarray], outputs: list[str]) -> None:
    for o, g, w in zip(outputs, got, want):
        if not np.allclose(g, w, rtol=RTOL, atol=ATOL):
            err = np.max(np.abs(g - w) / (ATOL + RTOL * np.abs(w)))
            sys.exit(f"{name}: output {o} differs from ONNX Runtime's ({err:.2f}x the tolerance)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(BUILDERS), default="bert")
    ap.add_argument("--seconds", type=float, default=10.0, help="timed seconds per row")
    ap.add_argument("--warmup", type=float, default=2.0, help="untimed seconds before each row")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--queue-delay-us", type=int, default=500)
    ap.add_argument(
        "--serve-args", default="", help="more arguments of tpubox serve (e.g. --cpu-devices 1)"
    )
    ap.add_argument(
        "--batch-seconds",
        type=float,
        default=2.0,
        help="seconds per batch size of the table of one request of batch B (0: no table)",
    )
    ap.add_argument("--no-http", action="store_true", help="leave out the HTTP rows")
    ap.add_argument("--no-wait", action="store_true", help="time without waiting for quiet")
    ap.add_argument(
        "--workdir",
        type=Path,
        default=Path("/tmp/tpubox-bench-onnx-serve"),
        help="the model, repository and conversion cache (kept: a rerun converts nothing)",
    )
    ap.add_argument("--fresh", action="store_true", help="rebuild the model and convert again")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()

    import onnxruntime as ort
    import tritonclient.http as httpclient

    binary = tpubox_bin()
    converter = Path(
        os.environ.get("TPUBOX_ONNX_PYTHON") or CACHE / "venv-onnx" / "bin" / "python"
    )
    for p, what in ((binary, "TPUBOX_BIN"), (converter, "TPUBOX_ONNX_PYTHON")):
        if not p.exists():
            sys.exit(f"{p} is missing (set {what})")

    name = f"onnx_{args.model}"
    root = args.workdir / args.model
    if args.fresh and root.exists():
        shutil.rmtree(root)
    build = root / "build"
    repo = root / "repo"
    if repo.exists():
        shutil.rmtree(repo)
    t0 = time.perf_counter()
    model_path = build / "model.onnx"
    build.mkdir(parents=True, exist_ok=True)
    stamp = build / "built"
    if not stamp.exists():
        print(f"building {args.model} (torch.onnx.export) ...", flush=True)
        BUILDERS[args.model][0](build)
        stamp.write_text("ok")
    feeds_of = BUILDERS[args.model][1]
    (repo / name / "1").mkdir(parents=True, exist_ok=True)
    shutil.copy(model_path, repo / name / "1" / "model.onnx")
    (repo / name / "config.pbtxt").write_text(config_pbtxt(name, model_path, args.queue_delay_us))
    t_build = time.perf_counter() - t0

    sess = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    outputs = [o.name for o in sess.get_outputs()]

    t0 = time.perf_counter()
    print(f"starting tpubox serve ({binary}); the load converts and compiles ...", flush=True)
    served = Served(root, repo, binary, converter, args.serve_args.split()).start()
    t_ready = time.perf_counter() - t0
    converted = "ONNX model converted to StableHLO" in served.log()
    try:
        one = feeds_of(1, 0)
        want = sess.run(outputs, one)
        check("gRPC, batch 1", grpc_caller(served.grpc_url, name, one, outputs)(), want, outputs)
        check("HTTP, batch 1", http_caller(served.http_url, name, one, outputs)(), want, outputs)
        # Sixteen different requests at once: batched by the server, each answer its own.
        items = [feeds_of(1, k) for k in range(16)]
        callers = [grpc_caller(served.grpc_url, name, f, outputs) for f in items]
        got: list[Any] = [None] * 16
        ths = [
            threading.Thread(target=lambda k=k: got.__setitem__(k, callers[k]()))
            for k in range(16)
        ]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        for k in range(16):
            check(f"gRPC, request {k} of 16 at once", got[k], sess.run(outputs, items[k]), outputs)
        print(f"answers equal ONNX Runtime's (rtol {RTOL}, atol {ATOL}): batch 1 and 16 at once")

        sides: list[tuple[str, Callable[[int], Callable[[], Any]]]] = [
            ("ORT in process", lambda k: ort_caller(sess, one, outputs)),
            ("tpubox gRPC", lambda k: grpc_caller(served.grpc_url, name, one, outputs)),
        ]
        if not args.no_http:
            sides.append(
                ("tpubox HTTP", lambda k: http_caller(served.http_url, name, one, outputs))
            )
        plan = [(c, s, mk) for c in args.concurrency for s, mk in sides]
        stats_client = httpclient.InferenceServerClient(served.http_url)

        def stats_of() -> dict[str, Any]:
            return server_stats(stats_client, name)

        if not args.no_wait:
            wait_quiet()
        before = busy()
        started = datetime.datetime.now(datetime.timezone.utc)
        print(f"\ntiming from {started:%Y-%m-%d %H:%M:%S} UTC, load average {loadavg()}")
        print(f"  busy processes (rustc/cargo/pytest): {before or 'none'}")
        print("  top processes by CPU over 1 s:\n" + top_processes())
        results: dict[tuple[int, str], list[dict[str, float]]] = {}
        busy_during: list[str] = []
        for r in range(args.rounds):
            for conc, side, make in plan:
                edges = stats_of if side != "ORT in process" else None
                rps, lat, (s0, s1) = run_row(make, conc, args.seconds, args.warmup, edges)
                row = {
                    "rps": rps,
                    "p50_ms": float(np.percentile(lat, 50) * 1e3),
                    "p99_ms": float(np.percentile(lat, 99) * 1e3),
                    "mean_ms": float(lat.mean() * 1e3),
                    "n": len(lat),
                }
                if s0 is not None:
                    row.update(stats_delta(s0, s1))
                results.setdefault((conc, side), []).append(row)
                b = busy()
                if b:
                    busy_during.append(f"round {r + 1}, c{conc} {side}: {b.splitlines()[0]}")
                print(
                    f"  round {r + 1} c{conc:<3} {side:<15} {rps:8.1f} req/s"
                    f"  p50 {row['p50_ms']:7.2f} ms  p99 {row['p99_ms']:7.2f} ms"
                    f"  (load average {loadavg().split()[0]})",
                    flush=True,
                )
        batches = []
        if args.batch_seconds > 0:
            batches = per_batch(
                sess, served.grpc_url, stats_of, name, feeds_of, outputs, args.batch_seconds
            )
        finished = datetime.datetime.now(datetime.timezone.utc)
    finally:
        served.stop()

    med = {
        k: {f: statistics.median(r[f] for r in rows) for f in rows[0]}
        for k, rows in results.items()
    }
    print(
        f"\n{args.model}: tpubox serve vs ONNX Runtime {ort.__version__} in process, "
        f"batch-1 requests, {args.seconds:.0f} s a row, median of {args.rounds} rounds"
    )
    print(
        f"({platform.machine()}, {os.cpu_count()} cores, {started:%Y-%m-%d %H:%M}-"
        f"{finished:%H:%M} UTC, load average after {loadavg()}; queue delay"
        f" {args.queue_delay_us} µs{'; serve ' + args.serve_args if args.serve_args else ''})"
    )
    print(
        f"\n| concurrency | system | req/s | p50 ms | p99 ms | req/s vs ORT |\n"
        f"|---:|---|---:|---:|---:|---:|"
    )
    for conc in args.concurrency:
        base = med[(conc, "ORT in process")]["rps"]
        for side, _ in sides:
            m = med[(conc, side)]
            ratio = "1.00x" if side == "ORT in process" else f"{m['rps'] / base:.2f}x"
            print(
                f"| {conc} | {side} | {m['rps']:.1f} | {m['p50_ms']:.2f} | {m['p99_ms']:.2f} |"
                f" {ratio} |"
            )
    print(
        "\ntpubox's server side over the timed windows (Triton statistics, per request but for"
        " the batch's execution):\n\n| concurrency | door | mean batch | queue µs |"
        " execution of a batch µs | in the server µs | client mean µs | outside the server µs |"
        "\n|---:|---|---:|---:|---:|---:|---:|---:|"
    )
    for conc in args.concurrency:
        for side, _ in sides[1:]:
            m = med[(conc, side)]
            print(
                f"| {conc} | {side.split()[1]} | {m['batch']:.2f} | {m['queue_us']:.0f} |"
                f" {m['exec_us']:.0f} | {m['server_us']:.0f} | {m['mean_ms'] * 1e3:.0f} |"
                f" {m['mean_ms'] * 1e3 - m['server_us']:.0f} |"
            )
    if batches:
        print(
            "\none request of batch B at a time (gRPC), after the rows:\n\n"
            "| B | ORT ms a call | tpubox ms a call | tpubox execution ms | ORT ms per item |"
            " tpubox execution ms per item |\n|---:|---:|---:|---:|---:|---:|"
        )
        for b, o, t, e in batches:
            print(f"| {b} | {o:.2f} | {t:.2f} | {e:.2f} | {o / b:.2f} | {e / b:.2f} |")
    print(
        f"\nset-up (not timed): model built/copied in {t_build:.1f} s, server ready in "
        f"{t_ready:.1f} s ({'converted now' if converted else 'conversion read from the cache'})"
    )
    print(f"busy processes before timing: {before or 'none'}")
    print("busy during the rows: " + ("; ".join(busy_during) if busy_during else "none"))
    print("top processes by CPU over 1 s after:\n" + top_processes())
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "model": args.model,
                    "started": started.isoformat(),
                    "rows": {f"c{c} {s}": v for (c, s), v in med.items()},
                    "busy_before": before,
                    "busy_during": busy_during,
                    "per_batch": batches,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
