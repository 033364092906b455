"""The anchors of the MiniLM benchmark (host/benches/minilm.rs): the same sentences embedded
by sentence-transformers on PyTorch and by ONNX Runtime, both on the CPU with the same thread
count, with the same weights (the model directory tpubox uses).

Run by the Rust benchmark with the benchmark venv's python (scripts/venvs/bench.txt, installed
by `bash scripts/dev.sh bench`, never by CI):

    python minilm_anchors.py MODEL_DIR SENTENCES.txt GUEST_EMB.f32 --threads 2 --rounds 5
    python minilm_anchors.py MODEL_DIR SENTENCES.txt GUEST_EMB.f32 --threads 2 --interleave

With --interleave it prints {"ready": true} once warm, then runs one pass of each system per
stdin line "round" (printing that round's seconds as JSON), until a line "done"; the benchmark
writes GUEST_EMB.f32 before "done". Its rounds then alternate with tpubox's on the same machine.

SENTENCES.txt holds one sentence per line; GUEST_EMB.f32 the guest's embeddings (little-endian
f32, one 384-wide row per sentence), compared with the PyTorch ones. Prints one JSON object:
per system, the median seconds per pass over the set, and the minimum cosine similarity of its
embeddings with sentence-transformers' (the reference).

ONNX Runtime runs the model exported once from the same PyTorch module (torch.onnx.export, opset
17, dynamic batch and sequence axes, cached next to the model under the benchmark's cache
directory), with graph optimizations on (ORT_ENABLE_ALL) as a user would; tokenization,
length-sorted batches of 32 and mean pooling are done as sentence-transformers does them, and
are timed, as they are for PyTorch."""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("sentences")
    ap.add_argument("guest_embeddings")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--interleave", action="store_true", help="run a round per stdin line (see below)")
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/tpubox/bench"))
    a = ap.parse_args()

    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(a.threads)
    sentences = Path(a.sentences).read_text().split("\n")
    model = SentenceTransformer(a.model_dir, device="cpu")
    model.eval()

    def st_pass():
        return model.encode(sentences, batch_size=a.batch, normalize_embeddings=True, convert_to_numpy=True)

    reference = st_pass()  # warm-up and reference
    st_times = []

    import onnxruntime as ort

    onnx_path = Path(a.cache) / f"minilm-torch{torch.__version__}.onnx"
    if not onnx_path.exists():
        onnx_path.parent.mkdir(parents=True, exist_ok=True)
        bert = model[0].auto_model

        class Encoder(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.bert = bert

            def forward(self, input_ids, attention_mask, token_type_ids):
                out = self.bert(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
                return out.last_hidden_state

        ids = torch.ones((2, 8), dtype=torch.int64)
        tmp = onnx_path.with_suffix(".tmp.onnx")
        with torch.no_grad():
            torch.onnx.export(
                Encoder().eval(),
                (ids, ids, torch.zeros_like(ids)),
                str(tmp),
                input_names=["input_ids", "attention_mask", "token_type_ids"],
                output_names=["last_hidden_state"],
                dynamic_axes={n: {0: "batch", 1: "seq"} for n in ["input_ids", "attention_mask", "token_type_ids", "last_hidden_state"]},
                opset_version=17,
                dynamo=False,
            )
        tmp.rename(onnx_path)
    so = ort.SessionOptions()
    so.intra_op_num_threads = a.threads
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    sess = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
    tokenizer = model.tokenizer
    max_len = model.max_seq_length

    def ort_pass():
        order = np.argsort([-len(s) for s in sentences], kind="stable")  # as sentence-transformers
        out = np.zeros((len(sentences), 384), np.float32)
        for i in range(0, len(order), a.batch):
            idx = order[i : i + a.batch]
            enc = tokenizer([sentences[j] for j in idx], padding=True, truncation=True, max_length=max_len, return_tensors="np")
            feed = {k: enc[k].astype(np.int64) for k in ["input_ids", "attention_mask", "token_type_ids"]}
            (h,) = sess.run(None, feed)
            m = feed["attention_mask"][..., None].astype(np.float32)
            e = (h * m).sum(1) / np.maximum(m.sum(1), 1e-9)
            out[idx] = e / np.linalg.norm(e, axis=1, keepdims=True)
        return out

    ort_out = ort_pass()  # warm-up
    ort_times = []

    def one_round():
        nonlocal ort_out
        t = time.perf_counter()
        st_pass()
        st_times.append(time.perf_counter() - t)
        t = time.perf_counter()
        ort_out = ort_pass()
        ort_times.append(time.perf_counter() - t)

    if a.interleave:
        # Driven round by round by the Rust benchmark, between its own passes, so that both
        # sides see the same machine: a line "round" runs one pass of each, "done" ends.
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            if line.strip() == "done":
                break
            one_round()
            print(json.dumps({"pytorch_s": st_times[-1], "onnxruntime_s": ort_times[-1]}), flush=True)
    else:
        for _ in range(a.rounds):
            one_round()

    def min_cos(x):
        x = x / np.linalg.norm(x, axis=1, keepdims=True)
        return float(np.min(np.sum(x * reference, axis=1)))

    guest = np.fromfile(a.guest_embeddings, dtype="<f4").reshape(len(sentences), 384)
    tokens = sum(len(t) for t in tokenizer(sentences, truncation=True, max_length=max_len)["input_ids"])
    json.dump(
        {
            "sentences": len(sentences),
            "tokens": tokens,
            "threads": a.threads,
            "torch": torch.__version__,
            "onnxruntime": ort.__version__,
            "pytorch_s": statistics.median(st_times),
            "onnxruntime_s": statistics.median(ort_times),
            "onnxruntime_min_cosine": min_cos(ort_out),
            "guest_min_cosine": min_cos(guest),
        },
        sys.stdout,
    )
    print()


if __name__ == "__main__":
    main()
