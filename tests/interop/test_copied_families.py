"""Families registered as copies of verified classes (hf_registry._COPIES): the options and
neighbours their descriptions do not cover are refused by name. Their exactness is the zoo's
(tests/interop/test_zoo.py). Models on ``meta`` (no weights). Runtime: a few seconds.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

import multihead as mh
from multihead.interop import hf_copies, hf_registry

from test_zoo import tiny_config  # same folder (pytest puts it on sys.path)

transformers = pytest.importorskip("transformers")
from transformers import AutoModel  # noqa: E402


def _meta_model(model_type: str, **extra: Any) -> nn.Module:
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        return AutoModel.from_config(tiny_config(model_type, **extra))


def _attention(model: nn.Module, layer: int = 0) -> nn.Module:
    return model.get_submodule(f"layers.{layer}.self_attn")


def test_phimoe_with_scaled_rope_is_refused_naming_rope_type() -> None:
    """PhimoeRotaryEmbedding scales cos/sin by short_mscale / long_mscale: only the default type."""
    model = _meta_model("phimoe", num_local_experts=2, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
        "short_mscale": 1.2, "long_mscale": 1.3, "original_max_position_embeddings": 32})
    with pytest.raises(ValueError, match="rope_type='longrope' is not supported"):
        mh.hf.patch(model, kernel=False)  # the kernel route takes it: test_kernel_zoo.py


def test_smollm3_use_rope_other_than_0_or_1_is_refused_naming_it() -> None:
    module = _attention(_meta_model("smollm3", no_rope_layers=[1, 0]))
    module.use_rope = 2
    assert "use_rope" in str(hf_registry.why_not(module))


def test_olmo3_reads_each_layers_rope_by_its_attention_type() -> None:
    model = mh.hf.patch(_meta_model("olmo3", layer_types=["sliding_attention", "full_attention"], rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 500000.0}}))
    bases = [m.mh.rope.base for m in model.modules() if isinstance(m, mh.hf.PatchedAttention)]
    assert bases == [10000.0, 500000.0]


@pytest.mark.parametrize("model_type, cls", [
    ("nanochat", "NanoChatAttention"),  # RoPE -> weightless norm, each pair turned by -θ
])
def test_near_copies_not_described_are_refused_by_name(model_type: str, cls: str) -> None:
    with pytest.raises(ValueError, match=f"{cls} is not a supported attention class"):
        mh.hf.patch(_meta_model(model_type, head_dim=16), kernel=False)


@pytest.mark.parametrize("model_type", ["phi", "stablelm", "persimmon"])
def test_qk_layernorm_is_refused_naming_it(model_type: str) -> None:
    """Phi's, StableLM's and Persimmon's optional per-head LayerNorm on q and k is not described."""
    with pytest.raises(ValueError, match="q_layernorm"):  # its submodules, named
        mh.hf.patch(_meta_model(model_type, qk_layernorm=True), kernel=False)


@pytest.mark.parametrize("model_type", ["phi", "stablelm", "glm"])
def test_an_odd_rotary_width_is_refused_naming_the_factor(model_type: str) -> None:
    """int(16 · 0.5625) = 9 dims would rotate: an odd count, refused before any conversion."""
    params = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5625}
    model = _meta_model(model_type, head_dim=16, rope_parameters=params)
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5625 rotates 9 of 16 dims"):
        mh.hf.patch(model, kernel=False)


# ---- hf_copies.COPIES: each class's source is its original's, but for the lines its entry names ----
def _source_lines(obj: Any, prefix: str, original_prefix: str) -> list[str]:
    """``obj``'s source without comments, docstrings, blank lines and trailing blanks, its class
    prefix written as the original's (``CamembertSelfOutput`` -> ``BertSelfOutput``)."""
    import inspect
    import re

    text = re.sub(r'"""(.|\n)*?"""', "", inspect.getsource(obj))
    text = re.sub(r"#.*", "", text).replace(prefix, original_prefix)
    return [line.rstrip() for line in text.splitlines() if line.strip()]


def _source_diff(copy: hf_copies.Copy) -> list[str]:
    """``"<object>: -line"`` / ``"<object>: +line"`` for the copy's class and helpers against the original's."""
    import difflib
    import importlib

    where, _, name = copy.qualified.rpartition(".")
    of_where, _, of_name = copy.original.rpartition(".")
    mine, theirs = importlib.import_module(where), importlib.import_module(of_where)
    prefix, of_prefix = hf_copies.class_prefix(name), hf_copies.class_prefix(of_name)
    lines = []
    for obj_name, of_obj_name in [(name, of_name), *((h, h) for h in hf_copies.HELPERS)]:
        a, b = getattr(theirs, of_obj_name, None), getattr(mine, obj_name, None)
        if a is None:
            continue  # a helper the original's module lacks: its class (compared) calls it nowhere
        old = _source_lines(a, of_prefix, of_prefix) if a is not None else []
        new = _source_lines(b, prefix, of_prefix) if b is not None else []
        label = "class" if obj_name == name else obj_name
        lines += [f"{label}: {d}" for d in difflib.unified_diff(old, new, lineterm="", n=0)
                  if d[:1] in "+-" and not d.startswith(("+++", "---"))]
    return lines


@pytest.mark.parametrize("copy", hf_copies.COPIES, ids=lambda c: c.cls)
def test_copy_differs_from_its_original_only_where_its_entry_says(copy: hf_copies.Copy) -> None:
    assert _source_diff(copy) == list(copy.differs)


def test_copy_entry_is_its_originals_with_renamed_parts() -> None:
    spec = hf_registry.REGISTRY["transformers.models.camembert.modeling_camembert.CamembertAttention"]
    bert = hf_registry.REGISTRY["transformers.models.bert.modeling_bert.BertAttention"]
    assert spec.copy_of == "BertAttention" and spec.model_types == ("camembert",)
    assert spec.parts["self"] == "CamembertSelfAttention" and spec.parts["output"] == "CamembertSelfOutput"
    assert spec.parts["self.query"] == "Linear" and spec.attrs == bert.attrs and spec.layout == bert.layout


def test_a_copy_is_refused_where_its_original_is() -> None:
    """DeiT's attention with a submodule ViT's description does not cover is refused by name."""
    model = _meta_model("deit")
    module = model.get_submodule("layers.0.attention")
    module.add_module("gate", nn.Linear(4, 4))
    assert "gate (Linear)" in str(hf_registry.why_not(module))


def test_glm4_moe_qk_norm_is_refused_naming_it() -> None:
    """GLM-4 MoE's optional per-head q/k RMSNorm (use_qk_norm) is not described."""
    with pytest.raises(ValueError, match="q_norm"):
        mh.hf.patch(_meta_model("glm4_moe", head_dim=16, use_qk_norm=True, n_routed_experts=4, num_experts_per_tok=2,
                                n_group=1, topk_group=1), kernel=False)


def test_modernbert_out_drop_is_dropout_or_identity_and_nothing_else() -> None:
    """ModernBERT's dropout after Wo is nn.Dropout(attention_dropout), or nn.Identity at 0: both
    described; any other module there is refused by name."""
    module = _meta_model("modernbert", attention_dropout=0.1).get_submodule("layers.0.attn")
    assert type(module.out_drop).__name__ == "Dropout" and hf_registry.why_not(module) is None
    module.out_drop = nn.Linear(4, 4)
    assert "out_drop (Linear)" in str(hf_registry.why_not(module))


#: What a modeling file of a model rotating by multimodal positions (M-RoPE) holds: its section
#: sizes or its 3-row position builder.
_MROPE_MARKS = ("mrope_section", "get_rope_index")


def _mrope_mismatches(registry: dict[str, Any]) -> list[str]:
    """Registered classes whose modeling file rotates by M-RoPE while their description does not:
    a wrapper that would rotate an image's batch by 1-D positions (as Cosmos3-Edge's, described as
    Llama's copy, once did)."""
    import importlib
    import inspect

    sources: dict[str, str] = {}
    found = []
    for name, spec in registry.items():
        module = name.rsplit(".", 1)[0]
        if module not in sources:
            sources[module] = inspect.getsource(importlib.import_module(module))
        if any(mark in sources[module] for mark in _MROPE_MARKS) and "mrope" not in str(spec.rope):
            found.append(f"{name} (rope={spec.rope!r})")
    return found


def test_no_registered_class_of_an_mrope_model_is_described_with_plain_rope() -> None:
    """The whole registry: a class in a modeling file with M-RoPE is described with M-RoPE."""
    assert _mrope_mismatches(hf_registry.REGISTRY) == []


def test_the_mrope_sweep_reports_a_class_described_with_plain_rope() -> None:
    """Planted: Qwen3-VL's text attention described with 1-D RoPE is reported by name."""
    import dataclasses

    name = "transformers.models.qwen3_vl.modeling_qwen3_vl.Qwen3VLTextAttention"
    planted = {name: dataclasses.replace(hf_registry.REGISTRY[name], rope="rope")}
    assert _mrope_mismatches(planted) == [f"{name} (rope='rope')"]
