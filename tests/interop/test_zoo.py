"""The zoo: every model type of the installed transformers is patched exactly or refused.

Two passes, because patching decides by class (``hf_registry.REGISTRY``):

* **every model type** (822 in transformers 5.24): its modeling module is imported and the
  registered attention classes it holds are listed. A type holding none is refused by
  construction (``patch`` only wraps registered classes); a type holding one must be in
  ``ZOO`` below, so that it is compared. Types whose modeling module does not import are
  counted and listed.
* **every accepted type** (``ZOO``): built from a tiny config (E=64, H=4, Hkv=2 where the
  class has GQA, 2 layers, windows shrunk to 6 with 9 tokens, every 2-D weight ×4 so that
  attention is far from uniform), run on a right-padded batch, patched, run again:
  relative difference ≤ 1e-5 on real tokens, and the same greedy tokens for generators.

``test_zoo_catches_rope_planted_in_vit`` plants the mistake this file exists to catch
(RoPE added to ViT) and requires the comparison to report it.

Runtime: about 25 s on 2 shared cores (14 s of it importing every modeling module).
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import multihead as mh
from multihead.interop import hf_registry

transformers = pytest.importorskip("transformers")
from transformers import AutoModel, AutoModelForCausalLM  # noqa: E402
from transformers.models.auto.configuration_auto import (CONFIG_MAPPING, CONFIG_MAPPING_NAMES,  # noqa: E402
                                                          model_type_to_module_name)

B, S, VOCAB, RTOL = 2, 9, 100, 1e-5
TINY = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
        "intermediate_size": 128, "vocab_size": VOCAB, "max_position_embeddings": 64, "n_embd": 64, "n_head": 4,
        "n_layer": 2, "image_size": 32, "patch_size": 8, "num_channels": 3, "sliding_window": 6,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}

#: Accepted model types: (extra config fields, generator?). Their classes are registered.
ZOO: dict[str, tuple[dict[str, Any], bool]] = {
    "llama": ({"attention_bias": True}, True),
    "mistral": ({}, True),
    "mixtral": ({"num_local_experts": 2}, True),
    "qwen2": ({"layer_types": ["full_attention", "sliding_attention"], "use_sliding_window": True}, True),
    "gemma": ({"head_dim": 16}, True),
    "granite": ({"attention_multiplier": 0.3}, True),
    "olmo": ({}, True),
    "starcoder2": ({}, True),
    "cohere": ({}, True),
    "gpt2": ({}, True),
    "bert": ({}, False),
    "roberta": ({}, False),
    "xlm-roberta": ({}, False),
    "electra": ({"embedding_size": 64}, False),
    "vit": ({}, False),
}


def tiny_config(model_type: str, **extra: Any) -> Any:
    """The model type's config class at tiny sizes (only fields the class has)."""
    cls = CONFIG_MAPPING[model_type]
    default = cls()
    fields = {k: v for k, v in {**TINY, **extra}.items() if hasattr(default, k) or k in extra}
    return cls(**fields)


def _build(model_type: str, spec_override: Any = None) -> tuple[nn.Module, bool]:
    extra, generator = ZOO[model_type]
    torch.manual_seed(0)
    auto = AutoModelForCausalLM if generator else AutoModel
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = auto.from_config(tiny_config(model_type, **extra), attn_implementation="eager").eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4)  # far from uniform attention
    return model, generator


def _inputs(model_type: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if model_type == "vit":
        return {"pixel_values": torch.randn(B, 3, 32, 32, generator=g)}
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, S - 3:] = 0  # the second row is right-padded
    return {"input_ids": torch.randint(3, VOCAB, (B, S), generator=g), "attention_mask": mask}


def _out(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        out = model(**inputs)
    return out.logits if hasattr(out, "logits") and out.logits is not None else out.last_hidden_state


def compare(model_type: str) -> str:
    """``"exact"``, or what differs (``"wrong: ..."``) after patching ``model_type``'s tiny model."""
    model, generator = _build(model_type)
    inputs = _inputs(model_type)
    want = _out(model, inputs)
    prompt = inputs.get("input_ids", torch.zeros(1, 1, dtype=torch.long))[:1]
    greedy = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    tokens = model.generate(prompt, **greedy) if generator else None
    mh.hf.patch(model)
    got = _out(model, inputs)
    real = inputs["attention_mask"].bool() if "attention_mask" in inputs else torch.ones(want.shape[:2], dtype=bool)
    rel = ((got[real] - want[real]).abs().max() / want[real].abs().max()).item()
    if not rel <= RTOL:
        return f"wrong: relative difference {rel:.2e} on real tokens"
    if generator and not torch.equal(model.generate(prompt, **greedy), tokens):
        return "wrong: different greedy tokens"
    return "exact"


@pytest.mark.parametrize("model_type", list(ZOO))
def test_accepted_model_type_is_exact(model_type: str) -> None:
    assert compare(model_type) == "exact"


def _modeling_modules(model_type: str) -> list[Any]:
    """The modeling modules of ``model_type``'s package (data2vec has three, donut one named donut_swin)."""
    name = model_type_to_module_name(model_type)
    try:
        package = importlib.import_module(f"transformers.models.{name}")
    except ImportError:
        return []
    names = [m.name for m in pkgutil.iter_modules(package.__path__) if m.name.startswith("modeling_")
             and not m.name.startswith(("modeling_tf_", "modeling_flax_"))]
    modules = []
    for n in names:
        try:
            modules.append(importlib.import_module(f"{package.__name__}.{n}"))
        except ImportError:  # an optional dependency (torchaudio) is missing: listed as unimportable
            pass
    return modules


def test_every_registered_class_is_in_the_zoo() -> None:
    covered = {t for spec in hf_registry.REGISTRY.values() for t in spec.model_types}
    assert covered == set(ZOO)


def test_every_model_type_is_accepted_and_compared_or_refused_by_class(capsys: pytest.CaptureFixture) -> None:
    """All model types: the registered classes each modeling module holds are compared in ZOO."""
    accepted, refused, unimportable, uncompared = [], [], [], []
    for model_type in sorted(CONFIG_MAPPING_NAMES):
        modules = _modeling_modules(model_type)
        if not modules:
            unimportable.append(model_type)
            continue
        held = {f"{v.__module__}.{v.__qualname__}" for m in modules for v in vars(m).values() if isinstance(v, type)}
        specs = [hf_registry.REGISTRY[c] for c in held if c in hf_registry.REGISTRY]
        if not specs:
            refused.append(model_type)
        elif model_type in ZOO:
            accepted.append(model_type)
        else:
            uncompared.append(f"{model_type} ({', '.join(s.name for s in specs)})")
    with capsys.disabled():
        print(f"\nzoo: {len(CONFIG_MAPPING_NAMES)} model types: {len(accepted)} accepted and compared, "
              f"{len(refused)} refused by class, {len(unimportable)} without an importable modeling module "
              f"({', '.join(unimportable)}), {len(uncompared)} accepted but not compared")
    assert len(CONFIG_MAPPING_NAMES) > 800  # the whole zoo was enumerated
    assert uncompared == []
    assert sorted(accepted) == sorted(ZOO)


def test_zoo_catches_rope_planted_in_vit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison fails when the registry is wrong: ViT described with RoPE (cause 1)."""
    key = "transformers.models.vit.modeling_vit.ViTAttention"
    planted = dataclasses.replace(hf_registry.REGISTRY[key], rope="half")
    monkeypatch.setitem(hf_registry.REGISTRY, key, planted)
    assert compare("vit").startswith("wrong")
