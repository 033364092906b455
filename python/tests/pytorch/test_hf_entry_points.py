"""Hugging Face's own entry points on the tpubox device (issue 50, item 3), against the same
models on the CPU: ``from_pretrained(dir, device_map="tpubox")`` (weights loaded straight onto
the device, without accelerate: tpubox.torch.hf), ``model.to("tpubox")`` after a CPU load, and
``pipeline(..., device="tpubox")`` for feature extraction, text classification and text
generation; a load converting the dtype (launches from transformers' loading threads) and
``param.data =``.

The models are tiny (BERT, BERT for sequence classification, Llama and GPT-2 causal LMs, random
weights) and saved with ``save_pretrained`` into temporary directories with a WordPiece
tokenizer built here (nothing is downloaded). The model tests check that the device ran
programs (eager_stats' launches) and that every parameter and buffer is a device tensor.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import tpubox
import tpubox.torch as tt
from tpubox.torch import hf

transformers = pytest.importorskip("transformers")

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("tpubox_tests_conftest", HERE.parent / "conftest.py")
_parent = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_parent)
ALICE = _parent.ALICE

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = "the a cat dog sat on mat ran fast red blue big small hello world device runs".split()
VOCAB = 200
TEXTS = ["the cat sat on the mat", "hello world", "a big red dog ran fast"]
RTOL, ATOL = 1e-4, 1e-5
MAX_ERR: dict[str, float] = {}


def _tokenizer(directory: Path) -> None:
    """A WordPiece tokenizer of VOCAB entries (BERT's normalizer and template), saved."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    names = SPECIALS + WORDS + ["##s", "##ed"]
    names += [f"w{i}" for i in range(VOCAB - len(names))]
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(names)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
    )
    tok.decoder = decoders.WordPiece()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        eos_token="[SEP]",
        bos_token="[CLS]",
    )
    fast.save_pretrained(directory)


def _save(model: torch.nn.Module, directory: Path) -> str:
    model.save_pretrained(directory)
    _tokenizer(directory)
    return str(directory)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Directories of the tiny models saved with save_pretrained, with the tokenizer."""
    root = tmp_path_factory.mktemp("hf")
    bert = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
    )
    decoder = dict(
        vocab_size=VOCAB,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
    )
    out = {}
    torch.manual_seed(0)
    out["bert"] = _save(transformers.BertModel(transformers.BertConfig(**bert)), root / "bert")
    cls = transformers.BertForSequenceClassification(
        transformers.BertConfig(**bert, num_labels=3)
    )
    out["bert-cls"] = _save(cls, root / "bert-cls")
    llama = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **decoder,
    )
    out["llama"] = _save(transformers.LlamaForCausalLM(llama), root / "llama")
    gpt2 = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, **decoder)
    out["gpt2"] = _save(transformers.GPT2LMHeadModel(gpt2), root / "gpt2")
    return out


@pytest.fixture(scope="module")
def dev(daemon):
    """The eager device, its ops running in one session of tenant alice for the module."""
    with tpubox.connect(daemon.unix, ALICE, label="pytest hf") as s:
        yield tt.device(session=s)
        tt.mark_step()


@pytest.fixture(autouse=True)
def _counters():
    tt.reset_eager_stats()
    yield
    tt.mark_step()


def _inputs(directory: str, texts=TEXTS) -> dict:
    tok = transformers.AutoTokenizer.from_pretrained(directory)
    return dict(tok(texts, return_tensors="pt", padding=True))


def _on(batch: dict, device) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


def _close(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.device.type == "cpu" and got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=RTOL, atol=ATOL)
    MAX_ERR[name] = max(MAX_ERR.get(name, 0.0), float((got - want).abs().max()))


def _on_device(model: torch.nn.Module) -> None:
    """Every parameter and buffer of MODEL is a device tensor."""
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    off = [n for n, t in tensors.items() if not tt.is_device_tensor(t)]
    assert not off, f"not on the device: {off}"
    assert model.device == torch.device("tpubox", 0)


def test_device_map_resolution():
    """Maps onto the tpubox device pass transformers' check without accelerate; others are
    left to transformers."""
    from transformers import modeling_utils

    assert modeling_utils.check_and_set_device_map._tpubox
    assert hf.onto_device("tpubox") == {"": torch.device("tpubox")}
    assert hf.onto_device("tpubox:0") == {"": torch.device("tpubox", 0)}
    assert hf.onto_device(torch.device("tpubox")) == {"": torch.device("tpubox")}
    assert hf.onto_device({"": "tpubox", "pooler": "tpubox:0"}) is not None
    for other in ("cpu", "auto", {"": "cpu"}, {"": "tpubox", "pooler": "cpu"}, {}, 0, None):
        assert hf.onto_device(other) is None
    assert modeling_utils.check_and_set_device_map({"": "tpubox"}) == {"": "tpubox"}
    if importlib.util.find_spec("accelerate") is None:
        with pytest.raises(ValueError, match="accelerate"):
            modeling_utils.check_and_set_device_map("cpu")


@pytest.mark.parametrize("device_map", ["tpubox", {"": "tpubox"}])
def test_bert_from_pretrained_device_map(dev, saved, device_map):
    """BertModel loaded straight onto the device: one put per tensor, the forward on device
    inputs matching the CPU model loaded from the same directory."""
    ref = transformers.AutoModel.from_pretrained(saved["bert"])
    n_tensors = len(ref.state_dict())
    tt.reset_eager_stats()
    model = transformers.AutoModel.from_pretrained(saved["bert"], device_map=device_map)
    loaded = tt.eager_stats()
    _on_device(model)
    assert loaded["puts"] >= n_tensors - 2, loaded  # the non-persistent buffers are written
    assert loaded["fetches"] == 0, loaded  # nothing came back to the host
    batch = _inputs(saved["bert"])
    with torch.no_grad():
        want = ref(**batch)
        got = model(**_on(batch, dev))
    _close("bert", got.last_hidden_state.cpu(), want.last_hidden_state)
    _close("bert", got.pooler_output.cpu(), want.pooler_output)
    stats = tt.eager_stats()
    assert stats["launches"] > loaded["launches"], stats
    assert stats["cpu_fallbacks"] == 0, tt.cpu_fallback_ops()


def test_bert_to_device_after_cpu_load(dev, saved):
    """``model.to("tpubox")`` after an ordinary CPU load."""
    ref = transformers.AutoModel.from_pretrained(saved["bert"])
    model = transformers.AutoModel.from_pretrained(saved["bert"]).to("tpubox")
    _on_device(model)
    batch = _inputs(saved["bert"])
    with torch.no_grad():
        want = ref(**batch).last_hidden_state
        got = model(**_on(batch, "tpubox")).last_hidden_state.cpu()
    _close("bert", got, want)
    assert tt.eager_stats()["launches"] > 0


def test_bert_from_pretrained_in_device_context(dev, saved):
    """``from_pretrained`` inside ``with torch.device("tpubox"):`` (transformers makes the
    context's device the map)."""
    ref = transformers.AutoModel.from_pretrained(saved["bert"])
    with torch.device("tpubox"):
        model = transformers.AutoModel.from_pretrained(saved["bert"])
    _on_device(model)
    batch = _inputs(saved["bert"])
    with torch.no_grad():
        got = model(**_on(batch, dev)).last_hidden_state.cpu()
        _close("bert", got, ref(**batch).last_hidden_state)


def test_from_pretrained_converting_dtype(dev, saved):
    """``dtype=torch.float16``: each f32 tensor put, then converted by a program launched from
    transformers' loading threads (launches from several threads reach the daemon in the order
    of their reserved result numbers: this failed one load in two before)."""
    want = transformers.AutoModel.from_pretrained(saved["bert"], dtype=torch.float16).state_dict()
    for _ in range(3):
        model = transformers.AutoModel.from_pretrained(
            saved["bert"], device_map="tpubox", dtype=torch.float16
        )
        _on_device(model)
        got = model.state_dict()
        assert got.keys() == want.keys()
        for k, v in got.items():
            assert v.dtype == want[k].dtype, k
            assert torch.equal(v.cpu(), want[k]), k
    assert tt.eager_stats()["launches"] > 0


def test_param_data_assignment(dev):
    """``param.data = t`` (older loading code, user code): the parameter takes T's value."""
    lin = torch.nn.Linear(3, 2).to("tpubox")
    lin.weight.data = torch.ones(2, 3).to("tpubox")
    lin.bias.data = torch.zeros(2, device="tpubox")
    assert tt.is_device_tensor(lin.weight) and isinstance(lin.weight, torch.nn.Parameter)
    x = torch.arange(6.0).reshape(2, 3)
    assert lin(x.to("tpubox")).cpu().tolist() == [[3.0, 3.0], [12.0, 12.0]]
    lin.weight.data.mul_(2)  # `.data` shares the value
    assert lin.weight.cpu().tolist() == [[2.0] * 3] * 2


def test_llama_from_pretrained_and_generate(dev, saved):
    """A Llama causal LM onto the device: logits, and greedy generate() giving the CPU's
    tokens (in DEFER_AND_FUSE: a program per forward rather than a launch per op)."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(saved["llama"])
    model = transformers.AutoModelForCausalLM.from_pretrained(saved["llama"], device_map="tpubox")
    _on_device(model)
    batch = _inputs(saved["llama"], TEXTS[:1])
    want = ref.generate(**batch, max_new_tokens=4, do_sample=False)
    with tt.set_eager_mode(tt.EagerMode.DEFER_AND_FUSE):
        with torch.no_grad():
            _close("llama", model(**_on(batch, dev)).logits.cpu(), ref(**batch).logits)
        got = model.generate(**_on(batch, dev), max_new_tokens=4, do_sample=False)
        assert tt.is_device_tensor(got)
        assert got.cpu().tolist() == want.tolist()
    stats = tt.eager_stats()
    assert stats["fused_graphs"] >= 5 and stats["launches"] >= 5, stats
    assert stats["cpu_fallbacks"] == 0, tt.cpu_fallback_ops()


def test_gpt2_tied_weights(dev, saved):
    """GPT-2's LM head tied to its token embedding: one device tensor for both, the logits
    matching the CPU's."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(saved["gpt2"])
    model = transformers.AutoModelForCausalLM.from_pretrained(
        saved["gpt2"], device_map=torch.device("tpubox")
    )
    _on_device(model)
    assert model.lm_head.weight is model.transformer.wte.weight
    batch = _inputs(saved["gpt2"], TEXTS[1:2])
    with torch.no_grad(), tt.set_eager_mode(tt.EagerMode.DEFER_AND_FUSE):
        _close("gpt2", model(**_on(batch, dev)).logits.cpu(), ref(**batch).logits)
    assert tt.eager_stats()["fused_graphs"] > 0


def _pipes(task: str, directory: str, **kwargs):
    """The pipeline of TASK on the CPU and on the device (``device="tpubox"``)."""
    cpu, on = (
        transformers.pipeline(task, model=directory, tokenizer=directory, device=d, **kwargs)
        for d in ("cpu", "tpubox")
    )
    _on_device(on.model)
    assert on.device.type == "tpubox"
    return cpu, on


def test_pipeline_feature_extraction(dev, saved):
    """``pipeline("feature-extraction", device="tpubox")`` and with ``device_map``."""
    cpu, on = _pipes("feature-extraction", saved["bert"])
    want = cpu(TEXTS)
    got = on(TEXTS)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        _close("feature-extraction", torch.tensor(g), torch.tensor(w))
    assert tt.eager_stats()["launches"] > 0
    mapped = transformers.pipeline(
        "feature-extraction", model=saved["bert"], tokenizer=saved["bert"], device_map="tpubox"
    )
    _on_device(mapped.model)
    got = mapped(TEXTS[0], return_tensors=True)
    _close("feature-extraction", got, torch.tensor(want[0]))


def test_pipeline_text_classification(dev, saved):
    """``pipeline("text-classification", device="tpubox")``: the same labels and scores."""
    cpu, on = _pipes("text-classification", saved["bert-cls"], top_k=None)
    want, got = cpu(TEXTS), on(TEXTS)
    for g, w in zip(got, want):
        assert [d["label"] for d in g] == [d["label"] for d in w]
        _close(
            "text-classification",
            torch.tensor([d["score"] for d in g]),
            torch.tensor([d["score"] for d in w]),
        )
    assert tt.eager_stats()["launches"] > 0


def test_pipeline_text_generation(dev, saved):
    """``pipeline("text-generation", device="tpubox")``: the CPU's greedy continuation (in
    DEFER_AND_FUSE, whose programs the Llama test compiled)."""
    cpu, on = _pipes("text-generation", saved["llama"])
    kw = dict(max_new_tokens=4, do_sample=False)
    want = cpu(TEXTS[0], **kw)[0]["generated_text"]
    with tt.set_eager_mode(tt.EagerMode.DEFER_AND_FUSE):
        got = on(TEXTS[0], **kw)[0]["generated_text"]
    assert got == want
    assert len(want) > len(TEXTS[0])
    stats = tt.eager_stats()
    # generate()'s programs again (and one more, of the pipeline's own)
    assert stats["fused_graphs"] > 0 and stats["compiles"] <= 1 < stats["op_cache_hits"], stats


def teardown_module(module):
    """Prints the largest differences seen (pytest -s)."""
    if MAX_ERR:
        print("\nmax abs error vs CPU: " + ", ".join(f"{k} {v:.2e}" for k, v in MAX_ERR.items()))
    sys.stdout.flush()
