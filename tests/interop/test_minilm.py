"""The bundled all-MiniLM-L6-v2 (d=384, h=12, d_head=32, 6 layers), patched, offline.

A batch of sentences of different lengths (so the shorter ones are padded): the patched
model's hidden states equal the unpatched model's on real tokens, and our mean-pooled,
normalised embeddings equal ``SentenceTransformer.encode``. Checkpoint loading is
strict: tiny random checkpoints written here check the errors.

Notation: B batch, S tokens (padded), E = d = 384.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import multihead as mh
from multihead import models

os.environ["HF_HUB_OFFLINE"] = "1"

TEXTS = [
    "Attention is all you need.",
    "Each head sees its own slice of the model width, and the output projection mixes them again.",
    "Short one.",
    "Multi-head attention splits d into h heads of d_head = d / h features each.",
]
TOL = 1e-5


@pytest.fixture(scope="module")
def minilm() -> dict:
    """Model, tokenizer, batch and sentence-transformers' embeddings, loaded once."""
    path = models.bundled_model_dir()
    model, tokenizer = models.load_model(path), models.load_tokenizer(path)
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    st = models._sentence_transformers_encode(path, TEXTS)  # (B, E)
    return {"path": path, "model": model, "batch": batch, "st": st}


def _run(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch).last_hidden_state  # (B, S, E)


def test_bundled_model_is_minilm(minilm: dict) -> None:
    config = minilm["model"].config
    assert (config.hidden_size, config.num_attention_heads, config.num_hidden_layers) == (384, 12, 6)
    real = minilm["batch"]["attention_mask"].bool()
    assert not bool(real.all()), "the batch must contain padding"


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_patched_minilm_equals_unpatched_on_real_tokens(minilm: dict, impl: str) -> None:
    model, batch = minilm["model"], minilm["batch"]
    model.set_attn_implementation(impl)  # eager hands us additive float masks, sdpa bool ones
    try:
        want = _run(model, batch)
        mh.hf.patch(model)
        wrappers = [m for m in model.modules() if isinstance(m, mh.hf.PatchedAttention)]
        assert len(wrappers) == 6 and wrappers[0].mh.head_dim == 32
        got = _run(model, batch)
    finally:
        mh.hf.unpatch(model)
        model.set_attn_implementation("sdpa")
    real = batch["attention_mask"].bool()
    assert float((got - want)[real].abs().max()) <= TOL


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_an_additive_mask_is_converted_once_per_model_call(minilm: dict, mode: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The eager model hands every layer the same additive mask: it is converted to ours once per
    model call (also under inference_mode, where tensors count no change), the output still HF's."""
    from multihead.interop import hf_kernel

    model, batch = minilm["model"], minilm["batch"]
    model.set_attn_implementation("eager")  # additive float masks
    converted = []
    real = hf_kernel.from_additive
    monkeypatch.setattr(hf_kernel, "from_additive", lambda m: converted.append(1) or real(m))
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode
    try:
        with context():
            want = model(**batch).last_hidden_state
        mh.hf.patch(model)
        with context():
            got = [model(**batch).last_hidden_state for _ in range(2)]
    finally:
        mh.hf.unpatch(model)
        model.set_attn_implementation("sdpa")
    assert len(converted) == 2  # one per model call, for its 6 layers
    mask = batch["attention_mask"].bool()
    assert all(float((g - want)[mask].abs().max()) <= TOL for g in got)


def test_patched_embeddings_equal_sentence_transformers(minilm: dict) -> None:
    model, batch = minilm["model"], minilm["batch"]
    mh.hf.patch(model)
    try:
        ours = models.mean_pool(_run(model, batch), batch["attention_mask"])  # (B, E)
    finally:
        mh.hf.unpatch(model)
    cosine = torch.nn.functional.cosine_similarity(ours.double(), minilm["st"].double(), dim=-1)
    assert float(cosine.min()) >= 0.99999


def test_unpatch_restores_the_same_module_objects(minilm: dict) -> None:
    model = minilm["model"]
    originals = [layer.attention for layer in model.encoder.layer]
    mh.hf.patch(model)
    assert all(isinstance(layer.attention, mh.hf.PatchedAttention) for layer in model.encoder.layer)
    mh.hf.unpatch(model)
    assert all(layer.attention is o for layer, o in zip(model.encoder.layer, originals))


def test_run_model_reports_the_seed_table_for_minilm() -> None:
    info = models.run_model(TEXTS[:3])
    assert (info["embed_dim"], info["num_heads"], info["head_dim"], info["num_kv_heads"]) == (384, 12, 32, 12)
    s = info["seq_len"]
    assert s == max(info["tokens"]) and len(set(info["tokens"])) > 1
    rows = {r["tensor"]: r for r in info["table"]}
    assert rows["X"]["shape"] == f"[384, {s}]" and rows["X"]["torch_shape"] == [3, s, 384]
    assert rows["Q_k"]["shape"] == f"12 × [32, {s}]"
    assert rows["X + O"]["shape"] == f"[384, {s}]"
    assert "RoPE(Q_k)" not in rows  # BERT has absolute positions, no RoPE
    assert info["max_abs_diff_hidden"] <= TOL
    assert info["min_cosine"] >= 0.99999
    assert info["unpatch_restored"] and info["patched_layers"] == 6
    assert len(info["ms_per_layer"]["hf"]) == len(info["ms_per_layer"]["multihead"]) == 6


def test_run_model_validates_texts() -> None:
    with pytest.raises(ValueError, match="texts"):
        models.run_model([])


# ---- checkpoint directories ---------------------------------------------------------------------
def _tiny_bert_dir(tmp_path: Path, edit=None) -> Path:
    """A random 2-layer BERT checkpoint (config.json + model.safetensors + MiniLM's tokenizer)."""
    from transformers import BertConfig, BertModel

    config = BertConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=64)
    state = {k: v.contiguous() for k, v in BertModel(config).state_dict().items()}
    if edit is not None:
        edit(state)
    save_file(state, str(tmp_path / "model.safetensors"))
    config.save_pretrained(str(tmp_path))
    src = models.bundled_model_dir()
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(src / name, tmp_path / name)
    return tmp_path


def test_load_model_reads_a_checkpoint_directory(tmp_path: Path) -> None:
    path = _tiny_bert_dir(tmp_path)
    model = models.load_model(path)
    assert model.config.hidden_size == 32 and not model.training


@pytest.mark.parametrize("edit, message", [
    (lambda sd: sd.pop("encoder.layer.1.attention.self.key.weight"), "missing.*encoder.layer.1.attention.self.key"),
    (lambda sd: sd.update({"encoder.layer.9.extra": torch.zeros(1)}), "unexpected.*encoder.layer.9.extra"),
    (lambda sd: sd.update({"encoder.layer.0.attention.self.query.weight": torch.zeros(8, 32)}),
     "encoder.layer.0.attention.self.query.weight.*shape"),
], ids=["missing", "extra", "misshaped"])
def test_load_model_names_bad_tensors(tmp_path: Path, edit, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        models.load_model(_tiny_bert_dir(tmp_path, edit))


def test_load_model_refuses_pickled_checkpoints(tmp_path: Path, monkeypatch) -> None:
    path = _tiny_bert_dir(tmp_path)
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load was called"))
    with pytest.raises(ValueError, match="pytorch_model.bin"):
        models.load_model(path)


def test_load_model_needs_a_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config.json"):
        models.load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="model.safetensors"):
        models.load_model(tmp_path)
