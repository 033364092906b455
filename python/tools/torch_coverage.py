"""Which Hugging Face architectures run through torch.compile(backend="tpubox"), TorchTPU's
coverage table: model / tested / runs / numbers match.

Each architecture is built from a tiny config written here (hidden size <= 128, <= 2 layers;
random weights, nothing downloaded), run by PyTorch eager and through the tpubox backend on the
same inputs, in eval mode, in f32. "runs" means every graph was lowered by torch-mlir,
compiled and executed by the daemon (the session's executions grew); "numbers match" means the
first output agrees with eager to rtol = atol = 1e-4.

    python python/tools/torch_coverage.py                 # starts its own daemon (tpubox_daemon)
    python python/tools/torch_coverage.py --address unix:/tmp/tpubox.sock --token T
    python python/tools/torch_coverage.py BERT Llama      # only these
    python python/tools/torch_coverage.py --train         # and a training step's gradients

Prints a Markdown table (docs/PYTORCH.md records it) and exits 0 when every architecture
tested matched. Needs the venv of scripts/venvs/torch.txt and ./python on PYTHONPATH (or
installed).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tpubox from this checkout
sys.path.insert(0, str(HERE.parent / "tests"))  # tpubox_daemon

RTOL = ATOL = 1e-4


def _text_inputs(vocab: int = 200, batch: int = 2, seq: int = 12) -> Callable[[], dict]:
    import torch

    def make() -> dict:
        g = torch.Generator().manual_seed(1)
        return {
            "input_ids": torch.randint(0, vocab, (batch, seq), generator=g),
            "attention_mask": torch.ones(batch, seq, dtype=torch.long),
        }

    return make


def _ids_only(vocab: int = 200, batch: int = 2, seq: int = 12) -> Callable[[], dict]:
    import torch

    def make() -> dict:
        g = torch.Generator().manual_seed(1)
        return {"input_ids": torch.randint(0, vocab, (batch, seq), generator=g)}

    return make


def _pixels(size: int = 32, channels: int = 3) -> Callable[[], dict]:
    import torch

    def make() -> dict:
        g = torch.Generator().manual_seed(1)
        return {"pixel_values": torch.randn(2, channels, size, size, generator=g)}

    return make


def architectures() -> dict[str, tuple[Callable[[], Any], Callable[[], dict]]]:
    """name -> (a function building the randomly initialised model, one making its inputs)."""
    import transformers as tf

    enc = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    dec = dict(enc, num_key_value_heads=2, max_position_embeddings=64, vocab_size=200)
    text = _text_inputs()
    ids = _ids_only()

    def bert_like(cls: Any, cfg_cls: Any, **extra: Any) -> Callable[[], Any]:
        return lambda: cls(
            cfg_cls(vocab_size=200, max_position_embeddings=64, **{**enc, **extra})
        )

    return {
        "BERT": (bert_like(tf.BertModel, tf.BertConfig), text),
        "RoBERTa": (bert_like(tf.RobertaModel, tf.RobertaConfig), text),
        "DistilBERT": (
            lambda: tf.DistilBertModel(
                tf.DistilBertConfig(
                    vocab_size=200, max_position_embeddings=64, dim=64, n_layers=2, n_heads=4,
                    hidden_dim=128,
                )
            ),
            text,
        ),
        "ELECTRA": (bert_like(tf.ElectraModel, tf.ElectraConfig, embedding_size=32), text),
        "ALBERT": (bert_like(tf.AlbertModel, tf.AlbertConfig, embedding_size=32), text),
        "MobileBERT": (
            bert_like(
                tf.MobileBertModel, tf.MobileBertConfig, embedding_size=32,
                intra_bottleneck_size=32, true_hidden_size=32, num_feedforward_networks=2,
            ),
            text,
        ),
        "DeBERTa-v2": (bert_like(tf.DebertaV2Model, tf.DebertaV2Config), text),
        "Llama": (lambda: tf.LlamaModel(tf.LlamaConfig(**dec)), text),
        "Mistral": (lambda: tf.MistralModel(tf.MistralConfig(**dec)), text),
        "Qwen2": (lambda: tf.Qwen2Model(tf.Qwen2Config(**dec)), text),
        "Gemma": (lambda: tf.GemmaModel(tf.GemmaConfig(head_dim=16, **dec)), text),
        "Phi": (lambda: tf.PhiModel(tf.PhiConfig(**dec)), text),
        "OPT": (
            lambda: tf.OPTModel(
                tf.OPTConfig(
                    vocab_size=200, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    ffn_dim=128, max_position_embeddings=64, word_embed_proj_dim=64,
                )
            ),
            text,
        ),
        "GPT-2": (
            lambda: tf.GPT2Model(
                tf.GPT2Config(
                    vocab_size=200, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                    bos_token_id=0, eos_token_id=0,
                )
            ),
            text,
        ),
        "GPT-NeoX": (
            lambda: tf.GPTNeoXModel(
                tf.GPTNeoXConfig(vocab_size=200, max_position_embeddings=64, **enc)
            ),
            text,
        ),
        "T5 encoder": (
            lambda: tf.T5EncoderModel(
                tf.T5Config(
                    vocab_size=200, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4
                )
            ),
            text,
        ),
        "BART encoder": (
            lambda: tf.BartModel(
                tf.BartConfig(
                    vocab_size=200, d_model=64, encoder_layers=2, decoder_layers=2,
                    encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                    decoder_ffn_dim=128, max_position_embeddings=64,
                )
            ).get_encoder(),
            ids,
        ),
        "ViT": (
            lambda: tf.ViTModel(tf.ViTConfig(image_size=32, patch_size=8, **enc)),
            _pixels(),
        ),
        "ResNet": (
            lambda: tf.ResNetModel(
                tf.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1])
            ),
            _pixels(),
        ),
        "ConvNeXt": (
            lambda: tf.ConvNextModel(
                tf.ConvNextConfig(
                    num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], image_size=32
                )
            ),
            _pixels(),
        ),
    }


def first_output(out: Any) -> Any:
    """The model's first output tensor (``last_hidden_state`` for Hugging Face outputs)."""
    import torch

    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "last_hidden_state") and out.last_hidden_state is not None:
        return out.last_hidden_state
    if isinstance(out, (tuple, list)):
        return first_output(out[0])
    return out[0]


def _compare(got: Any, want: Any) -> tuple[float, bool]:
    """GOT's largest absolute difference from WANT, and whether it matches (same shape, within
    RTOL and ATOL)."""
    import numpy as np

    g, w = got.float(), want.float()
    err = float((g - w).abs().max())
    return err, bool(got.shape == want.shape and np.allclose(g.numpy(), w.numpy(), rtol=RTOL, atol=ATOL))


def _first_line(e: Exception) -> str:
    """E as one line for the table: its type and the first line of its message (160 chars)."""
    msg = f"{type(e).__name__}: {e}".splitlines()
    return msg[0][:160] if msg else type(e).__name__


def check(name: str, build: Callable[[], Any], inputs: Callable[[], dict], session: Any) -> dict:
    """Runs one architecture eager and through the backend; returns its row."""
    import torch

    import tpubox.torch as tt

    torch._dynamo.reset()
    torch.manual_seed(0)
    row: dict[str, Any] = {"model": name, "runs": False, "match": False, "error": ""}
    t0 = time.monotonic()
    try:
        model = build().eval()
        x = inputs()
        with torch.no_grad():
            want = first_output(model(**x))
        before = session.usage().executions
        compiled = torch.compile(model, backend="tpubox", options={"session": session})
        with torch.no_grad():
            got = first_output(compiled(**x))
        ran = session.usage().executions - before
        row["runs"] = ran > 0
        row["executions"] = ran
        row["max_abs_err"], row["match"] = _compare(got, want)
    except Exception as e:  # a row, not a crash: the table says what failed
        row["error"] = _first_line(e)
        row["traceback"] = traceback.format_exc()
    row["seconds"] = time.monotonic() - t0
    row["graphs"] = tt.stats()["graphs"]
    return row


def check_eager(name: str, build: Callable[[], Any], inputs: Callable[[], dict], session: Any,
                mode: str) -> dict:  # fmt: skip
    """Runs one architecture on eager device tensors (``model.to(tpubox.torch.device())``) in
    eager MODE (an ``EagerMode`` name); returns the row's eager columns: whether it ran, whether
    the first output matches PyTorch on the CPU, and the distinct ops that fell back to the
    CPU."""
    import torch

    import tpubox.torch as tt

    torch.manual_seed(0)
    out: dict[str, Any] = {"eager_runs": False, "eager_match": False, "eager_error": "", "eager_fallbacks": []}
    t0 = time.monotonic()
    try:
        model = build().eval()
        x = inputs()
        with torch.no_grad():
            want = first_output(model(**x))
        dev = tt.device(session=session)
        tt.reset_eager_stats()
        with tt.set_eager_mode(tt.EagerMode[mode]):
            m = model.to(dev)
            xd = {k: v.to(dev) for k, v in x.items()}
            with torch.no_grad():
                got = first_output(m(**xd)).cpu()
        out["eager_fallbacks"] = tt.cpu_fallback_ops()
        out["eager_runs"] = tt.eager_stats()["launches"] > 0
        out["eager_max_abs_err"], out["eager_match"] = _compare(got, want)
    except Exception as e:  # a row, not a crash
        out["eager_error"] = _first_line(e)
    out["eager_seconds"] = time.monotonic() - t0
    return out


def _no_dropout(model: Any) -> None:
    """Training mode without randomness: every dropout probability of MODEL set to 0 (random
    ops in a graph need a custom call the daemon's default program policy refuses)."""
    from torch import nn

    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        for k, v in list(vars(m).items()):
            if "dropout" in k and isinstance(v, float):
                setattr(m, k, 0.0)


def check_training(
    name: str, build: Callable[[], Any], inputs: Callable[[], dict], session: Any
) -> dict:
    """One training step's forward and backward (loss = mean of the first output squared),
    compiled and eager: the gradients of every parameter must match."""
    import copy

    import numpy as np
    import torch

    import tpubox.torch  # noqa: F401  (registers the backend)

    torch._dynamo.reset()
    torch.manual_seed(0)
    row: dict[str, Any] = {"train": False, "train_error": ""}
    try:
        model = build().train()
        _no_dropout(model)
        ref = copy.deepcopy(model)
        x = inputs()
        first_output(ref(**x)).pow(2).mean().backward()
        compiled = torch.compile(model, backend="tpubox", options={"session": session})
        first_output(compiled(**x)).pow(2).mean().backward()
        worst = 0.0
        ok = True
        for (pn, p), q in zip(model.named_parameters(), ref.parameters()):
            if q.grad is None:
                continue
            if p.grad is None:
                ok = False
                continue
            g, w = p.grad.float().numpy(), q.grad.float().numpy()
            worst = max(worst, float(np.abs(g - w).max()))
            ok = ok and bool(np.allclose(g, w, rtol=RTOL, atol=ATOL))
        row["train"] = ok
        row["train_err"] = worst
    except Exception as e:
        msg = f"{type(e).__name__}: {e}".splitlines()
        row["train_error"] = msg[0][:160] if msg else type(e).__name__
    return row


# Memory a training check may take (address space): torch-mlir's lowering of a backward graph
# can grow until the kernel's OOM killer ends the process (the Llama family's did, while
# attention was traced with -inf masks).
TRAIN_MEMORY_BYTES = 12 << 30


def _train_in_child(name: str, address: str, token: str | None) -> dict:
    """check_training of NAME in a child process with at most TRAIN_MEMORY_BYTES of address
    space: a lowering that runs out of memory fails its row, not the run."""
    import resource
    import subprocess

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (TRAIN_MEMORY_BYTES, TRAIN_MEMORY_BYTES))

    cmd = [sys.executable, str(Path(__file__).resolve()), "--train-only", name]
    cmd += ["--address", address]
    if token is not None:
        cmd += ["--token", token]
    p = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=limit, timeout=1800)
    try:
        return json.loads(p.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        err = [line for line in p.stderr.splitlines() if line.strip()]
        why = err[-1][:160] if err else f"exit status {p.returncode}"
        if "bad_alloc" in p.stderr or "MemoryError" in p.stderr or p.returncode in (-9, 137):
            why = f"out of memory ({TRAIN_MEMORY_BYTES >> 30} GiB) lowering: {why}"
        return {"train": False, "train_error": why}


def table(rows: list[dict]) -> str:
    """The Markdown table of ROWS."""
    yes = lambda b: "yes" if b else "no"  # noqa: E731
    train = any("train" in r for r in rows)
    eager = any("eager_runs" in r for r in rows)
    head = "| model | tested | runs | numbers match | max abs error | time (s) |"
    head += " training step (gradients match) |" if train else ""
    head += " eager: runs | eager: numbers match | eager: ops on the CPU |" if eager else ""
    lines = [head + " note |", "|---" * (head.count("|") - 1 + 1) + "|"]
    for r in rows:
        err = r.get("max_abs_err")
        line = (
            f"| {r['model']} | yes | {yes(r['runs'])} | {yes(r['match'])} | "
            f"{'' if err is None else f'{err:.1e}'} | {r['seconds']:.1f} |"
        )
        note = r["error"]
        if train:
            line += f" {yes(r.get('train'))} |"
            if r.get("train_error"):
                note = (note + "; " if note else "") + "training: " + r["train_error"]
        if eager:
            fb = ", ".join(r.get("eager_fallbacks", [])) or "none"
            line += f" {yes(r.get('eager_runs'))} | {yes(r.get('eager_match'))} | {fb} |"
            if r.get("eager_error"):
                note = (note + "; " if note else "") + "eager: " + r["eager_error"]
        lines.append(line + f" {note.replace('|', '/')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Runs the architectures named in ARGV (default all), prints the table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("models", nargs="*", help="architectures to run (default: all)")
    ap.add_argument("--address", help="the daemon's session address (default: start one)")
    ap.add_argument("--token", default=None, help="a tenant token of that daemon")
    ap.add_argument("--verbose", action="store_true", help="print each failure's traceback")
    ap.add_argument(
        "--train", action="store_true",
        help="also one training step's backward (dropout off), gradients against eager",
    )
    ap.add_argument(
        "--eager", metavar="MODE", nargs="?", const="DEFER_AND_FUSE",
        help="also on eager device tensors in eager MODE (default DEFER_AND_FUSE)",
    )
    ap.add_argument("--train-only", help=argparse.SUPPRESS)  # one training check, JSON out
    args = ap.parse_args(argv)

    import torch

    import tpubox

    torch.set_num_threads(max(1, torch.get_num_threads() // 2))
    archs = architectures()
    if args.train_only:
        build, inputs = archs[args.train_only]
        with tpubox.connect(args.address, args.token, label="torch_coverage train") as s:
            print(json.dumps(check_training(args.train_only, build, inputs, s)))
        return 0
    names = args.models or list(archs)
    unknown = [n for n in names if n not in archs]
    if unknown:
        ap.error(f"unknown architectures {unknown}; known: {list(archs)}")
    daemon = None
    address, token = args.address, args.token
    if address is None:
        from tpubox_daemon import Daemon

        root = Path(tempfile.mkdtemp(prefix="tpubox-torch-coverage-"))
        tenants = {"coverage": {"token": "coverage", "session": {"max_device_mib": 4096}}}
        daemon = Daemon(root, tenants).start()
        address, token = daemon.unix, "coverage"
    rows = []
    try:
        with tpubox.connect(address, token, label="torch_coverage") as s:
            for n in names:
                build, inputs = archs[n]
                row = check(n, build, inputs, s)
                if args.train:
                    row.update(_train_in_child(n, address, token))
                if args.eager:
                    row.update(check_eager(n, build, inputs, s, args.eager))
                rows.append(row)
                status = "ok" if row["match"] else ("MISMATCH" if row["runs"] else "FAILED")
                if args.train:
                    status += " / training " + ("ok" if row["train"] else "FAILED")
                if args.eager:
                    status += " / eager " + ("ok" if row["eager_match"] else "FAILED")
                print(f"{n}: {status} ({row['seconds']:.1f} s) {row['error']}", file=sys.stderr)
                if args.verbose and row.get("traceback"):
                    print(row["traceback"], file=sys.stderr)
    finally:
        if daemon is not None:
            daemon.stop()
    print(table(rows))
    passed = sum(r["match"] for r in rows)
    print(f"\n{passed} of {len(rows)} architectures match PyTorch eager "
          f"(rtol = atol = {RTOL:g}, f32).")
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
