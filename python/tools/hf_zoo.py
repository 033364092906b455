"""The Hugging Face zoo through tpubox, TorchTPU's coverage table: for each model type of a fixed
list and each head users load (base model, causal LM, sequence classification, seq2seq LM, image
classification), tested / runs / match in three modes against PyTorch eager on the CPU.

Every model is built from a TINY config generated from its config class's own fields
(``CONFIG_MAPPING[type]()`` shrunk by field name, recursively into sub-configs: hidden sizes
<= 64, <= 2 layers or 2 stages, <= 4 experts with top-2, vocab <= 256, 64 positions, 32x32
images, every dropout 0, eager attention), with random weights: nothing is downloaded. Modes:

- ``compile``: ``torch.compile(model, backend="tpubox")`` in eval mode under no_grad.
- ``fuse``: eager device tensors in DEFER_AND_FUSE (``model.to(tpubox.torch.device())``, the
  inputs likewise, the first output read back with ``.cpu()``).
- ``train``: one training step through ``torch.compile`` (train mode, dropout 0; loss: the mean
  of the first output squared; backward; ``SGD(lr=0.1).step()``), every parameter afterwards
  against the same step in PyTorch eager.

compile and fuse match when the first output's max abs error is <= 1e-3 x max(1, max abs of
eager's output); train when every parameter's max abs error is <= 1e-4 x its scale (max abs,
at least 1e-3). A row PyTorch eager itself cannot build or run is skipped (listed with its
reason) and counted nowhere.

    python python/tools/hf_zoo.py --slice ci           # the CI sample, its own daemon
    python python/tools/hf_zoo.py --json /tmp/zoo.json # the whole list
    python python/tools/hf_zoo.py --types llama,vit --modes compile,fuse
    python python/tools/hf_zoo.py --address unix:/tmp/tpubox.sock --token T

Each row runs in a child process (one at a time; ``--jobs N`` for more) with a memory limit
and a timeout, so that a hang or an out-of-memory fails its row, not the run. The children are
forked from the harness after it imported torch and transformers once (``--spawn``: a new
interpreter per row instead). Exits 0 when every row not skipped matches
in every mode asked for. Needs the venv of scripts/venvs/torch.txt and ./python on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tpubox from this checkout
sys.path.insert(0, str(HERE.parent / "tests"))  # tpubox_daemon

MODES = ("compile", "fuse", "train")
RTOL = 1e-3  # compile / fuse: of the output's scale, max(1, max |eager|)
TRAIN_RTOL = 1e-4  # train: of each parameter's scale, max(1e-3, max |eager's parameter|)
BATCH, SEQ = 2, 8
ROW_MEMORY_BYTES = 12 << 30  # address space of a row's child
ROW_TIMEOUT_S = 600
MARK = "HFZOO_ROW "  # the child's JSON line

# model_type -> kind. The kind says which heads a type gets and which inputs it takes.
TYPES: dict[str, str] = {
    # encoders: base, sequence classification
    "bert": "encoder", "roberta": "encoder", "distilbert": "encoder", "electra": "encoder",
    "albert": "encoder", "mobilebert": "encoder", "deberta-v2": "encoder", "deberta": "encoder",
    "xlm-roberta": "encoder", "camembert": "encoder", "mpnet": "encoder", "funnel": "encoder",
    "squeezebert": "encoder", "ernie": "encoder", "roformer": "encoder",
    "nystromformer": "encoder", "layoutlm": "encoder", "canine": "encoder",
    "data2vec-text": "encoder", "megatron-bert": "encoder", "convbert": "encoder",
    "modernbert": "encoder", "esm": "encoder", "longformer": "encoder", "fnet": "encoder",
    "big_bird": "encoder",
    # decoders: base, causal LM, sequence classification
    "llama": "decoder", "mistral": "decoder", "qwen2": "decoder", "gemma": "decoder",
    "phi": "decoder", "opt": "decoder", "gpt2": "decoder", "gpt_neox": "decoder",
    "qwen3": "decoder", "gemma2": "decoder", "gemma3_text": "decoder", "phi3": "decoder",
    "falcon": "decoder", "gptj": "decoder", "gpt_bigcode": "decoder", "bloom": "decoder",
    "codegen": "decoder", "stablelm": "decoder", "olmo": "decoder", "olmo2": "decoder",
    "cohere": "decoder", "granite": "decoder", "starcoder2": "decoder", "mpt": "decoder",
    "persimmon": "decoder", "gpt_neo": "decoder", "xglm": "decoder", "smollm3": "decoder",
    "glm": "decoder", "helium": "decoder", "biogpt": "decoder", "nemotron": "decoder",
    "ministral": "decoder",
    # mixtures of experts (decoders)
    "mixtral": "decoder", "qwen2_moe": "decoder", "qwen3_moe": "decoder", "olmoe": "decoder",
    "granitemoe": "decoder", "deepseek_v3": "decoder", "phimoe": "decoder",
    "jetmoe": "decoder",
    # encoder-decoders: base, seq2seq LM
    "t5": "seq2seq", "mt5": "seq2seq", "umt5": "seq2seq", "bart": "seq2seq", "mbart": "seq2seq",
    "pegasus": "seq2seq", "marian": "seq2seq", "m2m_100": "seq2seq", "blenderbot": "seq2seq",
    "blenderbot-small": "seq2seq", "led": "seq2seq", "longt5": "seq2seq", "plbart": "seq2seq",
    # vision: base, image classification
    "vit": "vision", "deit": "vision", "beit": "vision", "swin": "vision", "swinv2": "vision",
    "convnext": "vision", "convnextv2": "vision", "resnet": "vision", "regnet": "vision",
    "mobilenet_v2": "vision", "mobilenet_v1": "vision", "efficientnet": "vision",
    "dinov2": "vision", "levit": "vision", "poolformer": "vision", "segformer": "vision",
    "data2vec-vision": "vision", "pvt": "vision", "cvt": "vision", "bit": "vision",
    # speech: base (whisper also its seq2seq LM)
    "wav2vec2": "audio", "hubert": "audio", "wavlm": "audio", "data2vec-audio": "audio",
    "sew": "audio", "unispeech": "audio", "whisper": "whisper",
    # multimodal: the dual encoder (text and image)
    "clip": "dual", "siglip": "dual",
}

# head -> (the Auto class in transformers, its mapping in transformers.models.auto.modeling_auto)
HEADS = {
    "base": ("AutoModel", "MODEL_MAPPING_NAMES"),
    "causal": ("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    "seqcls": (
        "AutoModelForSequenceClassification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"
    ),
    "seq2seq": ("AutoModelForSeq2SeqLM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    "speech2seq": ("AutoModelForSpeechSeq2Seq", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES"),
    "imgcls": ("AutoModelForImageClassification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"),
}
KIND_HEADS = {
    "encoder": ("base", "seqcls"),
    "decoder": ("base", "causal", "seqcls"),
    "seq2seq": ("base", "seq2seq"),
    "vision": ("base", "imgcls"),
    "audio": ("base",),
    "whisper": ("base", "speech2seq"),
    "dual": ("base",),
}

# The CI slice: one row of each kind of model (a few minutes on 2 cores).
CI_SLICE = (
    "bert/seqcls", "llama/base", "gpt2/causal", "t5/seq2seq", "vit/imgcls", "resnet/base",
    "mixtral/base", "wav2vec2/base", "swin/base", "deberta-v2/base", "qwen2/causal",
    "convnext/imgcls",
)

# Per-type config overrides, applied after the generic shrinking; each says why the generic
# rules cannot do.
OVERRIDES: dict[str, dict[str, Any]] = {
    # The defaults are EfficientNet-B7 (width 2.0, depth 3.1: 64 blocks); B0's coefficients
    # scaled down keep 7 stages of one block each.
    # Its last BatchNorm has hidden_dim features, the conv before it round_filters(1280).
    "efficientnet": {"width_coefficient": 0.25, "depth_coefficient": 0.25, "hidden_dim": 320},
    # LeViT's patch embedding is 4 stride-2 convolutions whatever patch_size says (16); its
    # down_ops list one entry per stage transition (2 stages: 1), [op, key_dim, heads, ratios..].
    "levit": {"patch_size": 16, "down_ops": [["Subsample", 8, 2, 4, 2, 2]], "key_dim": [8, 8]},
    # Nystromformer approximates attention with num_landmarks segment means of the sequence
    # (which must divide it); its depthwise conv kernel (65) is sized for 512 tokens.
    # SqueezeBERT's encoder takes the embeddings as they are (no projection): same width.
    "squeezebert": {"embedding_size": 64},
    # CvT's stage i indexes its drop-path rates (one per block) with i: stage 2 needs 2 blocks.
    "cvt": {"depth": [1, 2]},
    # GPT-Neo lists its attention kinds per layer pair ([["global", "local"], 12]): 1 pair.
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    # ESM's config has no vocabulary (its tokenizer's alphabet of 33 gives it).
    "esm": {"vocab_size": 33, "pad_token_id": 1, "mask_token_id": 32},
    # Nemotron's default leaves num_key_value_heads None, which its attention divides by.
    "nemotron": {"num_key_value_heads": 2},
    "nystromformer": {"num_landmarks": 4, "segment_means_seq_len": SEQ, "conv_kernel_size": 3},
}


# ---------------------------------------------------------------------------------------------
# Tiny configs


_HIDDEN = {"hidden_size", "d_model", "n_embd", "dim", "embed_dim", "d_embed", "model_dim",
           "word_embed_proj_dim", "encoder_hidden_size", "projection_size"}
_HEADS = {"num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads",
          "decoder_attention_heads"}
_KV_HEADS = {"num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num"}
_HEAD_DIM = {"head_dim", "d_kv", "d_head", "attention_head_dim", "kv_channels",
             "attention_head_size", "v_head_dim", "qk_nope_head_dim"}
_INTERMEDIATE = {"intermediate_size", "ffn_dim", "d_ff", "n_inner", "encoder_ffn_dim",
                 "decoder_ffn_dim", "d_inner", "hidden_dim", "mlp_dim", "ffn_hidden_size",
                 "decoder_hidden_size", "global_intermediate_size"}
_EXPERT_INTERMEDIATE = {"moe_intermediate_size", "shared_expert_intermediate_size",
                        "expert_intermediate_size"}
_EXPERTS = {"num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"}
_TOP_K = {"num_experts_per_tok", "moe_topk", "num_experts_per_token", "top_k"}
_POSITIONS = {"max_position_embeddings", "n_positions", "n_ctx", "max_target_positions",
              "max_seq_len", "max_sequence_length", "max_encoder_position_embeddings",
              "max_decoder_position_embeddings"}
_LAYERS = re.compile(r"^(num_hidden_layers|num_layers|n_layer|n_layers|encoder_layers|"
                     r"decoder_layers|num_decoder_layers|num_encoder_layers)$")
_DROPOUT = re.compile(r"dropout|drop_path|pdrop|drop_rate|layerdrop|drop_prob|drop_connect|"
                      r"stochastic_depth|jitter_noise|mask_time_prob|mask_feature_prob")
# Lists with one entry per stage of a hierarchical (vision) model.
_STAGES = ("depths", "depth", "hidden_sizes", "num_encoder_blocks", "num_stages")


def _pow2_at_most(n: int, cap: int) -> int:
    p = 1
    while p * 2 <= min(n, cap):
        p *= 2
    return p


def _shrink(d: dict[str, Any]) -> dict[str, Any]:
    """The fields of a config (its ``to_dict()``, sub-configs excluded) made tiny by name;
    returns only the fields that changed."""
    out: dict[str, Any] = {}
    heads = d.get("num_attention_heads") or d.get("num_heads") or d.get("n_head")
    stage_lists = [d[k] for k in ("depths", "depth") if isinstance(d.get(k), list)]
    n_stages = len(stage_lists[0]) if stage_lists else None
    for k, v in d.items():
        new = v
        if v is None and k == "n_inner":  # GPT-2's and GPT-J's: None means 4 x hidden
            new = 128
        elif v is None and k == "head_dim":  # hidden / heads where the model computes it
            new = 16
        elif isinstance(v, bool) or v is None:
            pass
        elif isinstance(v, float) and _DROPOUT.search(k):
            new = 0.0
        elif isinstance(v, int) and not isinstance(v, bool):
            if k in _HIDDEN:
                new = min(v, 32 if n_stages else 64)
            elif k in ("embedding_size", "projection_dim", "true_hidden_size",
                       "intra_bottleneck_size", "codevector_dim", "proj_codevector_dim",
                       "classifier_proj_size", "kv_lora_rank", "q_lora_rank"):
                new = min(v, 32)
            elif k in _HEADS:
                new = min(v, 4)
            elif k in _KV_HEADS:
                new = 2 if heads and v < heads else min(v, 4)
            elif k in _HEAD_DIM:
                new = min(v, 16)
            elif k in ("qk_rope_head_dim", "rotary_dim"):
                new = min(v, 8)
            elif _LAYERS.match(k):
                new = min(v, 2)
            elif k in ("first_k_dense_replace",):
                new = min(v, 1)
            elif k in _INTERMEDIATE:
                new = min(v, 128)
            elif k in _EXPERT_INTERMEDIATE:
                new = min(v, 64)
            elif k in _EXPERTS:
                new = min(v, 4)
            elif k in _TOP_K:
                new = min(v, 2)
            elif k in ("n_shared_experts", "n_group", "topk_group"):
                new = min(v, 1)
            elif k in ("vocab_size", "num_hash_buckets"):
                new = min(v, 256)
            elif k in _POSITIONS:
                new = min(v, 64)
            elif k == "max_source_positions":  # Whisper's encoder: 2 x this many frames
                new = min(v, 16)
            elif k == "image_size":
                new = min(v, 32)
            elif k == "patch_size":
                new = min(v, 4)
            elif k in ("window_size", "attention_window", "local_radius", "global_block_size"):
                new = min(v, 4)
            elif k in ("num_stages", "num_encoder_blocks"):
                new = min(v, 2)
            elif k == "num_conv_pos_embeddings":
                new = min(v, 16)
            elif k == "num_conv_pos_embedding_groups":
                new = min(v, 4)
            elif k in ("groups_width", "num_groups"):  # RegNet's groups, BiT's GroupNorm
                new = min(v, 8 if k == "groups_width" else 4)
        elif isinstance(v, float) and k == "depth_multiplier":
            new = min(v, 0.35)
        elif isinstance(v, list):
            if _DROPOUT.search(k) and all(isinstance(x, float) for x in v):
                v = new = [0.0] * len(v)
            if k == "image_size":
                new = [min(x, 32) for x in v]
            elif k == "attention_window":
                new = [min(x, 4) for x in v]
            elif k == "conv_dim":
                new = [min(x, 32) for x in v]
            elif k in ("out_features", "stage_names"):  # a backbone's, derived again
                new = None
            elif k == "out_indices":
                new = [1, 2]
            elif n_stages and len(v) == n_stages and n_stages > 2:
                new = [v[0], v[-1]]  # the first stage and the last (e.g. its cls token)
            if n_stages and isinstance(new, list) and len(new) <= 2:
                if k in ("depths", "depth"):
                    new = [min(x, 1) for x in new]
                elif k == "hidden_sizes":
                    new = [16 * 2**i for i in range(len(new))]
                elif k in ("embed_dim",):
                    new = [16 * 2**i for i in range(len(new))]
                elif k in _HEADS and all(isinstance(x, int) for x in new):
                    new = [_pow2_at_most(x, 2 * 2**i) for i, x in enumerate(new)]
        if k in ("apply_spec_augment",) and v:
            new = False
        if new != d[k]:
            out[k] = new
    # Special token ids inside the new vocab (distinct ones stay distinct).
    vocab = out.get("vocab_size", d.get("vocab_size"))
    if isinstance(vocab, int):
        remap: dict[int, int] = {}

        def fix(i: Any) -> Any:
            if isinstance(i, int) and not isinstance(i, bool) and i >= vocab:
                remap.setdefault(i, vocab - 1 - len(remap))
                return remap[i]
            return i

        for k, v in d.items():
            if k.endswith("_token_id") or k.endswith("_token_ids"):
                nv = [fix(x) for x in v] if isinstance(v, list) else fix(v)
                if nv != v:
                    out[k] = nv
            elif k in ("suppress_tokens", "begin_suppress_tokens") and v is not None:
                out[k] = None
    return out


def _init_fields(cls: Any) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls) if f.init}
    import inspect

    return set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs"}


def tiny_kwargs(cls: Any) -> dict[str, Any]:
    """The keyword arguments making config class CLS tiny: its default's fields shrunk by name
    (:func:`_shrink`), sub-configs (text_config, vision_config, ...) likewise, as dicts."""
    default = cls()
    fields = _init_fields(cls)
    subs = dict(getattr(cls, "sub_configs", None) or {})
    flat = {k: v for k, v in default.to_dict().items() if k not in subs}
    alias = {real: a for a, real in (getattr(cls, "attribute_map", None) or {}).items()}
    kw = {}
    for k, v in _shrink(flat).items():
        if k in fields:
            kw[k] = v
        elif alias.get(k) in fields:  # to_dict()'s name of a field __init__ calls otherwise
            kw[alias[k]] = v
    for name in subs:
        sub = getattr(default, name, None)
        if sub is None or not hasattr(sub, "to_dict"):
            continue
        sub_kw = tiny_kwargs(type(sub))
        kw[name] = {**sub.to_dict(), **sub_kw}
    return kw


def tiny_config(model_type: str, head: str) -> Any:
    """The tiny config of MODEL_TYPE for HEAD (num_labels 3 for the classification heads, a pad
    token for the decoders' sequence classification), attention "eager"."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    kw = tiny_kwargs(cls)
    kw.update(OVERRIDES.get(model_type, {}))
    if head in ("seqcls", "imgcls"):
        kw["num_labels"] = 3
    cfg = cls(**kw)
    if head == "seqcls" and getattr(cfg, "pad_token_id", 0) is None:
        # Sequence classification of a decoder pools the last token that is not padding; a
        # batch of 2 needs a pad id (none of the inputs' ids is it).
        cfg.pad_token_id = 0
    cfg._attn_implementation = "eager"
    for sub in (getattr(type(cfg), "sub_configs", None) or {}):
        sc = getattr(cfg, sub, None)
        if sc is not None and hasattr(sc, "_attn_implementation"):
            sc._attn_implementation = "eager"
    return cfg


def build(model_type: str, head: str) -> Any:
    """The randomly initialised model of (MODEL_TYPE, HEAD) in f32, eval mode."""
    import torch
    import transformers
    from transformers.models.auto import modeling_auto

    auto = getattr(transformers, HEADS[head][0])
    torch.manual_seed(0)
    cfg = tiny_config(model_type, head)
    classes = getattr(modeling_auto, HEADS[head][1]).get(model_type)
    if isinstance(classes, (list, tuple)):  # several (DeiT's with a teacher): the first
        cfg.architectures = [classes[0]]
    model = auto.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    return model.float().eval()


def make_inputs(model_type: str, model: Any) -> dict[str, Any]:
    """The inputs of MODEL (batch 2, fixed seed): input_ids and attention_mask of 8 tokens for
    text, decoder_input_ids for encoder-decoders, pixel_values for images, input_values (1600
    samples) for speech, input_features for Whisper."""
    import torch

    kind = TYPES[model_type]
    cfg = model.config
    g = torch.Generator().manual_seed(1)

    def ids(c: Any) -> Any:
        vocab = getattr(c, "vocab_size", 256) or 256
        return torch.randint(4, min(vocab, 256), (BATCH, SEQ), generator=g)

    def pixels(c: Any) -> Any:
        size = getattr(c, "image_size", 32)
        h, w = (size, size) if isinstance(size, int) else tuple(size)
        return torch.randn(BATCH, getattr(c, "num_channels", 3), h, w, generator=g)

    if kind in ("encoder", "decoder", "seq2seq"):
        x = {"input_ids": ids(cfg), "attention_mask": torch.ones(BATCH, SEQ, dtype=torch.long)}
        if kind == "seq2seq":
            x["decoder_input_ids"] = ids(cfg)
        return x
    if kind == "vision":
        return {"pixel_values": pixels(cfg)}
    if kind == "audio":
        return {"input_values": torch.randn(BATCH, 1600, generator=g)}
    if kind == "whisper":
        frames = 2 * cfg.max_source_positions
        return {
            "input_features": torch.randn(BATCH, cfg.num_mel_bins, frames, generator=g),
            "decoder_input_ids": ids(cfg),
        }
    if kind == "dual":
        return {
            "input_ids": ids(cfg.text_config),
            "attention_mask": torch.ones(BATCH, SEQ, dtype=torch.long),
            "pixel_values": pixels(cfg.vision_config),
        }
    raise ValueError(kind)


def rows_of(types: list[str]) -> list[str]:
    """The rows ("type/head") of TYPES: each kind's heads that transformers has for the type."""
    from transformers.models.auto import modeling_auto

    rows = []
    for t in types:
        for h in KIND_HEADS[TYPES[t]]:
            if t in getattr(modeling_auto, HEADS[h][1]):
                rows.append(f"{t}/{h}")
    return rows


# ---------------------------------------------------------------------------------------------
# One row (in a child process)


def first_output(out: Any) -> Any:
    """The first output tensor of OUT (a tensor, a tuple, or a ModelOutput: its first field
    that is not None: logits, last_hidden_state, ...)."""
    import torch

    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        out = out.to_tuple() if hasattr(out, "to_tuple") else tuple(out.values())
    return first_output(out[0])


def _output_err(got: Any, want: Any) -> float:
    """GOT's max abs error from WANT over the scale max(1, max |WANT|); inf when the shapes or
    the non-finite entries differ."""
    import torch

    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    if got.shape != want.shape:
        return float("inf")
    fin = torch.isfinite(want)
    if not torch.equal(fin, torch.isfinite(got)) or not torch.equal(
        torch.nan_to_num(want[~fin], 0.0, 1.0, -1.0), torch.nan_to_num(got[~fin], 0.0, 1.0, -1.0)
    ):
        return float("inf")
    if not bool(fin.any()):
        return 0.0
    scale = max(1.0, float(want[fin].abs().max()))
    return float((got[fin] - want[fin]).abs().max()) / scale


_CAUSES = (
    re.compile(r"failed to legalize operation '([\w.]+)'"),
    re.compile(r"'([\w.]+)' op unsupported op for export to XLA"),
    re.compile(r"(UNIMPLEMENTED: [^\n]{0,100})"),
    re.compile(r"(Lowering TorchFX IR -> Torch Backend IR failed)"),
    re.compile(r"unsupported (?:op|operation)[^\n]{0,20}?((?:torch\.)?aten[.:]+\w+(?:\.\w+)?)"),
    re.compile(r"((?:torch\.)?aten[.:]+\w+(?:\.\w+)?)"),
)


def cause_of(exc_type: str, text: str) -> str:
    """A failure's cause for the table: EXC_TYPE and the op or pass its message TEXT names (the
    first of: torch-mlir's op it failed to legalize, the op XLA's import refuses, an
    UNIMPLEMENTED status, the torch-mlir pass that failed, an ATen op), else the message's
    first line."""
    for rx in _CAUSES:
        m = rx.search(text)
        if m:
            return f"{exc_type}: {m.group(1)}"
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return f"{exc_type}: {first[:140]}"


def _failure(e: BaseException) -> dict[str, Any]:
    """The error of a failed mode: its first line, its cause (:func:`cause_of`, from the
    message, else the traceback) and the traceback's end."""
    msg = str(e).strip()
    tb = traceback.format_exc()
    first = msg.splitlines()[0][:200] if msg else ""
    cause = cause_of(type(e).__name__, msg)
    if cause == f"{type(e).__name__}: {first[:140]}":  # no op named in the message
        named = cause_of(type(e).__name__, tb)
        if named != f"{type(e).__name__}: Traceback (most recent call last):":
            cause = named if "aten" in named or "torch." in named else cause
    return {"error": f"{type(e).__name__}: {first}", "cause": cause, "traceback": tb[-2000:]}


def _no_dropout(model: Any) -> None:
    """Every dropout probability of MODEL set to 0 (a random op in a graph needs a custom call
    the daemon's default program policy refuses; and eager's draws would differ)."""
    from torch import nn

    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        for k, v in list(vars(m).items()):
            if ("dropout" in k or "drop_prob" in k or "layerdrop" in k) and isinstance(v, float):
                setattr(m, k, 0.0)


def _mode_compile(model: Any, x: dict, want: Any, s: Any) -> dict[str, Any]:
    import torch

    import tpubox.torch as tt  # registers the backend

    torch._dynamo.reset()
    tt.reset_stats()
    before = s.usage().executions
    compiled = torch.compile(model, backend="tpubox", options={"session": s})
    with torch.no_grad():
        got = first_output(compiled(**x))
    r = {"runs": s.usage().executions - before > 0, "err": _output_err(got, want)}
    r["match"] = r["runs"] and r["err"] <= RTOL
    # The nodes the backend's partitions left to PyTorch on the CPU.
    r["fallbacks"] = sorted(tt.cpu_fallback_ops())
    return r


def _mode_fuse(model: Any, x: dict, want: Any, s: Any) -> dict[str, Any]:
    import torch

    import tpubox.torch as tt

    dev = tt.device(session=s)
    tt.reset_eager_stats()
    with tt.set_eager_mode("DEFER_AND_FUSE"):
        m = model.to(dev)
        xd = {k: v.to(dev) for k, v in x.items()}
        with torch.no_grad():
            got = first_output(m(**xd)).cpu()
    r = {"runs": tt.eager_stats()["launches"] > 0, "err": _output_err(got, want)}
    r["match"] = r["runs"] and r["err"] <= RTOL
    r["fallbacks"] = sorted(tt.cpu_fallback_ops())
    return r


def _sgd_step(model: Any, fwd: Any, x: dict) -> None:
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.zero_grad()
    first_output(fwd(**x)).float().pow(2).mean().backward()
    opt.step()


def _train_reference(pristine: Any, x: dict) -> Any:
    """A copy of PRISTINE after PyTorch eager's training step (train mode, dropout 0) on X; run
    before the other modes, so that what they leave behind cannot fail it."""
    import torch

    ref = copy.deepcopy(pristine).train()
    _no_dropout(ref)
    _sgd_step(ref, ref, x)
    # The same step in f64: the truth PyTorch's own f32 step is measured against.
    ref.f64 = None
    try:
        r64 = copy.deepcopy(pristine).train().double()
        _no_dropout(r64)
        x64 = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
               for k, v in x.items()}  # fmt: skip
        _sgd_step(r64, r64, x64)
        ref.f64 = dict(r64.named_parameters())
    except Exception:  # a model without an f64 path: the f32 criterion alone
        pass
    return ref


def _mode_train(model: Any, ref: Any, x: dict, s: Any) -> dict[str, Any]:
    """One SGD step through ``torch.compile``; every parameter after it against PyTorch eager's
    step (REF): within TRAIN_RTOL of the parameter's scale, or, where PyTorch's own f32 step is
    itself that far from the same step in f64 (a gradient that is rounding noise: a
    zero-initialised token whose true gradient is 1e-7), no farther from the f64 step than
    twice PyTorch's distance plus TRAIN_RTOL of the scale (``within_f32_rounding`` names those
    parameters)."""
    import torch

    import tpubox.torch as tt

    model.train()
    _no_dropout(model)
    torch._dynamo.reset()
    tt.reset_stats()
    before = s.usage().executions
    compiled = torch.compile(model, backend="tpubox", options={"session": s})
    _sgd_step(model, compiled, x)
    worst = 0.0
    by_rounding: list[str] = []
    want = dict(ref.named_parameters())
    truth = getattr(ref, "f64", None) or {}
    for name, p in model.named_parameters():
        q = want[name].detach()
        if not q.numel():
            continue
        scale = max(1e-3, float(q.abs().max()))
        e = float((p.detach() - q).abs().max()) / scale
        e = e if e == e else float("inf")
        t64 = truth.get(name)
        if e > TRAIN_RTOL and t64 is not None:
            t64 = t64.detach()
            ours = float((p.detach().double() - t64).abs().max())
            theirs = float((q.double() - t64).abs().max())
            if ours == ours and ours <= 2 * theirs + TRAIN_RTOL * scale:
                by_rounding.append(name)
                continue
        worst = max(worst, e)
    r = {"runs": s.usage().executions - before > 0, "err": worst}
    r["match"] = r["runs"] and worst <= TRAIN_RTOL
    if by_rounding:
        r["within_f32_rounding"] = by_rounding
    r["fallbacks"] = sorted(tt.cpu_fallback_ops())
    return r


def _dynamo_fails(pristine: Any, x: dict, train: bool) -> bool:
    """Whether ``torch.compile(model, backend="eager")`` (Dynamo with PyTorch's own backend,
    no tpubox) fails on the model too (in train mode with a backward when TRAIN)."""
    import torch

    torch._dynamo.reset()
    m = copy.deepcopy(pristine)
    try:
        if train:
            m.train()
            _no_dropout(m)
            first_output(torch.compile(m, backend="eager")(**x)).float().pow(2).mean().backward()
        else:
            with torch.no_grad():
                torch.compile(m.eval(), backend="eager")(**x)
        return False
    except Exception:
        return True
    finally:
        torch._dynamo.reset()


def run_row(row: str, modes: list[str], address: str, token: str | None) -> dict[str, Any]:
    """Runs ROW ("type/head") eager on the CPU, then in each of MODES on the daemon at ADDRESS;
    returns its result (``skipped`` when eager cannot build or run it, else one dict per mode:
    runs, match, err, fallbacks, or error and cause)."""
    import torch

    import tpubox

    model_type, head = row.split("/")
    out: dict[str, Any] = {"row": row, "type": model_type, "head": head}
    t0 = time.monotonic()
    try:
        model = build(model_type, head)
        pristine = copy.deepcopy(model)
        x = make_inputs(model_type, model)
        with torch.no_grad():
            want = first_output(model(**x)).detach().clone()
    except Exception as e:
        out["skipped"] = _failure(e)["error"]
        return out
    out["params"] = sum(p.numel() for p in model.parameters())
    ref, train_skip = None, None
    if "train" in modes:
        try:
            ref = _train_reference(pristine, x)
        except Exception as e:  # eager cannot train it: not counted
            train_skip = _failure(e)["error"]
    with tpubox.connect(address, token, label=f"hf_zoo {row}") as s:
        for mode in modes:
            t = time.monotonic()
            try:
                m = copy.deepcopy(pristine)
                if mode == "compile":
                    r = _mode_compile(m, x, want, s)
                elif mode == "fuse":
                    r = _mode_fuse(m, x, want, s)
                elif train_skip is not None:
                    r = {"skipped": train_skip}
                else:
                    r = _mode_train(m, ref, x, s)
            except Exception as e:  # the mode's failure, not the row's
                r = {"runs": False, "match": False, **_failure(e)}
                if mode == "fuse":
                    import tpubox.torch as tt

                    r["fallbacks"] = sorted(tt.cpu_fallback_ops())
                elif _dynamo_fails(pristine, x, train=mode == "train"):
                    # Not tpubox's: Dynamo cannot capture the model with any backend.
                    r = {"skipped": "Dynamo fails with PyTorch's own backend='eager' too: "
                         + r.get("error", "")}  # fmt: skip
            r["seconds"] = round(time.monotonic() - t, 1)
            out[mode] = r
    out["seconds"] = round(time.monotonic() - t0, 1)
    return out


def run_in_child(row: str, modes: list[str], address: str, token: str | None,
                 timeout: float) -> dict[str, Any]:  # fmt: skip
    """:func:`run_row` in a child process with at most ROW_MEMORY_BYTES of address space and
    TIMEOUT seconds: a hang or an out-of-memory fails the row's modes, not the run."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (ROW_MEMORY_BYTES, ROW_MEMORY_BYTES))

    cmd = [sys.executable, str(Path(__file__).resolve()), "--row", row,
           "--modes", ",".join(modes), "--address", address]  # fmt: skip
    if token is not None:
        cmd += ["--token", token]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=limit,
                           timeout=timeout)  # fmt: skip
        for line in reversed(p.stdout.splitlines()):
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        err = [ln for ln in p.stderr.splitlines() if ln.strip()]
        why = err[-1][:200] if err else f"exit status {p.returncode}"
        if "bad_alloc" in p.stderr or "MemoryError" in p.stderr or p.returncode in (-9, 137):
            why = f"out of memory ({ROW_MEMORY_BYTES >> 30} GiB): {why}"
        else:
            why = f"child died (exit status {p.returncode}): {why}"
    except subprocess.TimeoutExpired:
        why = f"timeout ({timeout:.0f} s)"
    return _child_failure(why, row, modes, time.monotonic() - t0)


def preload(rows: list[str]) -> None:
    """Imports torch, transformers, tpubox.torch and the model classes of ROWS in this process,
    without running an op or connecting, so that the children :func:`run_forked` forks start
    with them imported (a fresh interpreter spends 6 to 20 s of a busy 2-core machine on it)."""
    import torch  # noqa: F401
    import transformers
    from transformers.models.auto import modeling_auto

    import tpubox.torch  # noqa: F401
    import tpubox.torch.dynamo  # noqa: F401

    for row in rows:
        model_type, head = row.split("/")
        names = getattr(modeling_auto, HEADS[head][1]).get(model_type)
        for name in [names] if isinstance(names, str) else list(names or ()):
            getattr(transformers, name, None)


def _child_failure(why: str, row: str, modes: list[str], seconds: float) -> dict[str, Any]:
    model_type, head = row.split("/")
    fail = {"runs": False, "match": False, "error": why, "cause": why.split(":")[0]}
    return {"row": row, "type": model_type, "head": head, "seconds": round(seconds, 1),
            **{m: dict(fail) for m in modes}}  # fmt: skip


class _Forked:
    """A row running in a child forked from this process: its pid, the pipe its JSON result
    comes through, the file its output goes to."""

    def __init__(self, row: str, modes: list[str], address: str, token: str | None):
        import signal

        self.row, self.modes, self.t0 = row, modes, time.monotonic()
        self.log = tempfile.NamedTemporaryFile(prefix="hf-zoo-row-", suffix=".log", delete=False)
        rfd, wfd = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child
            code = 0
            try:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.close(rfd)
                os.dup2(self.log.fileno(), 1)
                os.dup2(self.log.fileno(), 2)
                resource.setrlimit(resource.RLIMIT_AS, (ROW_MEMORY_BYTES, ROW_MEMORY_BYTES))
                import torch

                torch.set_num_threads(1)
                data = json.dumps(run_row(row, modes, address, token)).encode()
                with os.fdopen(wfd, "wb") as f:
                    f.write(data)
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        os.close(wfd)
        self.fd, self.chunks = rfd, []

    def result(self, why: str | None = None) -> dict[str, Any]:
        """Waits for the child (killed first when WHY, e.g. a timeout, is given) and returns
        its row, or the row failed with why it died."""
        import signal

        if why is not None:
            os.kill(self.pid, signal.SIGKILL)
        os.close(self.fd)
        _, status = os.waitpid(self.pid, 0)
        text = Path(self.log.name).read_text(errors="replace")
        self.log.close()
        os.unlink(self.log.name)
        if why is None and self.chunks:
            try:
                return json.loads(b"".join(self.chunks))
            except ValueError:
                pass
        if why is None:
            err = [ln for ln in text.splitlines() if ln.strip()]
            last = err[-1][:200] if err else ""
            sig = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            if "bad_alloc" in text or "MemoryError" in text or sig == -signal.SIGKILL:
                why = f"out of memory ({ROW_MEMORY_BYTES >> 30} GiB): {last}"
            else:
                why = f"child died (exit status {sig}): {last}"
        return _child_failure(why, self.row, self.modes, time.monotonic() - self.t0)


def run_forked(rows: list[str], modes: list[str], address: str, token: str | None,
               timeout: float, jobs: int = 1) -> Any:  # fmt: skip
    """Yields (index, result) of each of ROWS, run by :func:`run_row` in children forked from
    this process (after :func:`preload`), at most JOBS at once, each with at most
    ROW_MEMORY_BYTES of address space and TIMEOUT seconds, its output in a file whose end says
    why when it dies. As :func:`run_in_child`, without a new interpreter per row."""
    todo = list(enumerate(rows))
    running: dict[int, tuple[int, _Forked]] = {}  # fd -> (index, child)
    try:
        yield from _forked_loop(todo, running, modes, address, token, timeout, jobs)
    finally:  # the run stopped (SIGTERM, an error): its children with it
        for _, c in running.values():
            c.result("stopped")


def _forked_loop(todo: list, running: dict, modes: list[str], address: str, token: str | None,
                 timeout: float, jobs: int) -> Any:  # fmt: skip
    import select

    while todo or running:
        while todo and len(running) < max(1, jobs):
            i, row = todo.pop(0)
            c = _Forked(row, modes, address, token)
            running[c.fd] = (i, c)
        now = time.monotonic()
        for fd, (i, c) in list(running.items()):
            if now - c.t0 > timeout:
                del running[fd]
                yield i, c.result(f"timeout ({timeout:.0f} s)")
        if not running:
            continue
        ready, _, _ = select.select(list(running), [], [], 2.0)
        for fd in ready:
            i, c = running[fd]
            chunk = os.read(fd, 1 << 20)
            if chunk:
                c.chunks.append(chunk)
            else:
                del running[fd]
                yield i, c.result()


# ---------------------------------------------------------------------------------------------
# The tables


def summary(rows: list[dict], modes: list[str]) -> str:
    """Per mode: tested (rows eager runs), runs, match (and its percentage of tested)."""
    lines = []
    for m in modes:
        tested = [r for r in rows if m in r and "skipped" not in r[m]]
        runs = sum(bool(r[m].get("runs")) for r in tested)
        match = sum(bool(r[m].get("match")) for r in tested)
        pct = 100.0 * match / len(tested) if tested else 0.0
        lines.append(f"{m:8s} tested {len(tested)}, runs {runs}, match {match} ({pct:.0f}%)")
    return "\n".join(lines)


def _cell(r: dict | None) -> str:
    if r is None:
        return ""
    if "skipped" in r:
        return "n/a"
    err = r.get("err")
    e = "" if err is None else (" (inf)" if err == float("inf") else f" ({err:.1e})")
    if r.get("match"):
        return "yes" + e
    return ("no, runs" + e) if r.get("runs") else "no"


def table(rows: list[dict], modes: list[str]) -> str:
    """The Markdown table: a row per (type, head) that eager ran, yes/no per mode with the max
    relative error."""
    head = "| type | head | " + " | ".join(modes) + " |"
    lines = [head, "|---|---|" + "---|" * len(modes)]
    for r in rows:
        if "skipped" in r:
            continue
        lines.append(f"| {r['type']} | {r['head']} | "
                     + " | ".join(_cell(r.get(m)) for m in modes) + " |")  # fmt: skip
    return "\n".join(lines)


def failures(rows: list[dict], modes: list[str]) -> list[str]:
    """One line per failed (row, mode): its cause, then its error's first line."""
    out = []
    for r in rows:
        for m in modes:
            x = r.get(m)
            if not x or "skipped" in x or x.get("match"):
                continue
            if x.get("runs"):
                what = f"mismatch (rel err {x.get('err', float('nan')):.2e})"
            else:
                what = x.get("cause") or x.get("error", "")
                if x.get("error") and x["error"] not in what:
                    what += f" -- {x['error'][:160]}"
            out.append(f"- {r['row']} {m}: {what}")
    return out


def fallbacks(rows: list[dict], modes: list[str]) -> list[str]:
    """One line per (row, mode) with ops that ran on the CPU."""
    out = []
    for r in rows:
        for m in modes:
            fb = (r.get(m) or {}).get("fallbacks")
            if fb:
                out.append(f"- {r['row']} {m}: {', '.join(fb)}")
    return out


def report(rows: list[dict], modes: list[str]) -> str:
    """Everything printed at the end: counts, table, failures, CPU fallbacks, skipped rows."""
    parts = [summary(rows, modes), "", table(rows, modes), ""]
    f = failures(rows, modes)
    parts += [f"Failures ({len(f)}):", *f, ""] if f else ["Failures: none", ""]
    fb = fallbacks(rows, modes)
    parts += ["Ops on the CPU (fallback):", *fb, ""] if fb else ["Ops on the CPU: none", ""]
    skipped = [r for r in rows if "skipped" in r]
    skipped_modes = [(r, m) for r in rows if "skipped" not in r for m in modes
                     if "skipped" in (r.get(m) or {})]  # fmt: skip
    if skipped or skipped_modes:
        parts.append("Skipped (PyTorch itself cannot build or run them, or Dynamo cannot capture them with any backend):")
        parts += [f"- {r['row']}: {r['skipped']}" for r in skipped]
        parts += [f"- {r['row']} {m}: {r[m]['skipped']}" for r, m in skipped_modes]
    return "\n".join(parts)


def all_match(rows: list[dict], modes: list[str]) -> bool:
    """Whether every row eager ran matches in every mode of MODES eager ran."""
    return all(
        (r.get(m) or {}).get("match") or "skipped" in (r.get(m) or {})
        for r in rows if "skipped" not in r for m in modes
    )


def main(argv: list[str] | None = None) -> int:
    """Runs the rows asked for, prints the tables; 0 when every row not skipped matched."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--slice", choices=["ci", "all"], default="all",
                    help="ci: the fixed CI sample of 12 rows; all (default): every type")
    ap.add_argument("--types", help="comma-separated model types (default: the slice's)")
    ap.add_argument("--heads", help="comma-separated heads to keep (default: all)")
    ap.add_argument("--modes", default=",".join(MODES), help="of compile,fuse,train (default all)")
    ap.add_argument("--address", help="the daemon's session address (default: start one)")
    ap.add_argument("--token", default=None, help="a tenant token of that daemon")
    ap.add_argument("--json", help="write the rows as JSON to this file (after each row)")
    ap.add_argument("--timeout", type=float, default=ROW_TIMEOUT_S, help="seconds per row")
    ap.add_argument("--list", action="store_true", help="print the rows and exit")
    ap.add_argument("--jobs", type=int, default=1,
                    help="rows at once (default 1; each child computes with one thread)")
    ap.add_argument("--spawn", action="store_true",
                    help="each row in a new interpreter (default: forked from this one after "
                         "importing torch and transformers once)")  # fmt: skip
    ap.add_argument("--row", help=argparse.SUPPRESS)  # the child: one row, JSON out
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"unknown modes {bad}; known: {MODES}")

    if args.row:
        import torch

        torch.set_num_threads(1)
        print(MARK + json.dumps(run_row(args.row, modes, args.address, args.token)), flush=True)
        return 0

    if args.types:
        types = args.types.split(",")
        unknown = [t for t in types if t not in TYPES]
        if unknown:
            ap.error(f"unknown types {unknown}; known: {sorted(TYPES)}")
        rows = rows_of(types)
    elif args.slice == "ci":
        rows = list(CI_SLICE)
    else:
        rows = rows_of(list(TYPES))
    if args.heads:
        rows = [r for r in rows if r.split("/")[1] in args.heads.split(",")]
    if args.list:
        print("\n".join(rows))
        return 0

    daemon = None
    address, token = args.address, args.token
    if address is None:
        from tpubox_daemon import Daemon

        root = Path(tempfile.mkdtemp(prefix="tpubox-hf-zoo-"))
        tenants = {"zoo": {"token": "zoo", "session": {"max_device_mib": 4096}}}
        daemon = Daemon(root, tenants).start()
        address, token = daemon.unix, "zoo"
    import signal

    # SIGTERM ends the run through its finally blocks (the daemon it started stops).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    fork = not args.spawn and hasattr(os, "fork")
    if fork:
        preload(rows)
    results: list[dict] = []
    done: Any = None
    try:
        if fork:
            done = run_forked(rows, modes, address, token, args.timeout, args.jobs)
        else:
            done = ((i, run_in_child(row, modes, address, token, args.timeout))
                    for i, row in enumerate(rows))  # fmt: skip
        by_index: dict[int, dict] = {}
        for i, r in done:
            by_index[i] = r
            results = [by_index[k] for k in sorted(by_index)]
            row = rows[i]
            if "skipped" in r:
                status = f"skipped: {r['skipped'][:120]}"
            else:
                status = " ".join(f"{m}={_cell(r.get(m)) or '-'}" for m in modes)
            print(f"[{i + 1}/{len(rows)}] {row}: {status} ({r.get('seconds', 0):.0f} s)",
                  file=sys.stderr, flush=True)  # fmt: skip
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=1))
    finally:
        if hasattr(done, "close"):
            done.close()  # run_forked's children end with the run
        if daemon is not None:
            daemon.stop()
    print(report(results, modes))
    return 0 if all_match(results, modes) else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
