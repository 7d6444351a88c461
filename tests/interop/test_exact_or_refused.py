"""Exact or refused, cause by cause (issue #16): each family the old name-based guess got
wrong is now exact or refused by name, and none crashes with anything but a ValueError.

Models are built on the ``meta`` device (no memory, no weights) from the zoo's tiny
configs, except where numbers are compared (tiny, CPU). Runtime: about 10 s.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn
from transformers import AutoModel, CohereConfig, LlamaConfig, Qwen2Config
from transformers.models.cohere.modeling_cohere import CohereAttention
from transformers.models.llama.modeling_llama import LlamaAttention
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention
from transformers.models.vit.modeling_vit import ViTAttention

import multihead as mh
from multihead.interop import hf_config, hf_registry

from test_zoo import compare, tiny_config  # same folder (pytest puts it on sys.path)

SMALL = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
         "intermediate_size": 128, "vocab_size": 100}


def _meta_model(model_type: str, **extra: Any) -> nn.Module:
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        return AutoModel.from_config(tiny_config(model_type, **extra))


def _refused(model_type: str, **extra: Any) -> str:
    """The ValueError message of patching ``model_type`` with registered wrappers only (any other
    exception fails the test); the kernel route, which may take such a model, is in test_kernel_zoo.py."""
    model = _meta_model(model_type, **extra)
    with pytest.raises(ValueError) as e:
        mh.hf.patch(model, kernel=False)
    with pytest.raises(ValueError, match="no supported attention module to patch") as lenient:
        mh.hf.patch(model, strict=False, kernel=False)  # lenient, but nothing at all could be patched
    assert type(model).__name__ in str(lenient.value)
    return str(e.value)


# ---- 1. RoPE where there is none ----------------------------------------------------------------
def test_vit_is_converted_without_rope_and_exact() -> None:
    from transformers import ViTConfig
    assert mh.MultiHeadAttention.from_hf(ViTAttention(ViTConfig(hidden_size=64, num_attention_heads=4))).rope is None
    assert compare("vit") == "exact"


# DeiT's, DINOv2's and I-JEPA's attention were refused here until registered as ViT's copies
# (multihead.interop.hf_copies): their sources are compared in test_copied_families.py, their
# models numerically in test_zoo.py.
@pytest.mark.parametrize("model_type, cls", [("nemotron_h", "NemotronHAttention")])
def test_vit_like_classes_not_described_are_refused_by_name(model_type: str, cls: str) -> None:
    assert f"{cls} is not a supported attention class" in _refused(model_type)


# ---- 2. interleaved RoPE ------------------------------------------------------------------------
def test_cohere_rope_is_interleaved_and_exact() -> None:
    layer = mh.MultiHeadAttention.from_hf(CohereAttention(CohereConfig(**SMALL), layer_idx=0))
    assert layer.rope.interleaved
    assert compare("cohere") == "exact"


def test_cohere_with_qk_norm_is_refused_naming_it() -> None:
    module = CohereAttention(CohereConfig(use_qk_norm=True, **SMALL), layer_idx=0)
    with pytest.raises(ValueError, match="q_norm"):
        mh.MultiHeadAttention.from_hf(module)


def test_cohere2_rotates_only_its_sliding_layers_and_is_exact() -> None:
    """Cohere 2 (once refused by name): interleaved RoPE in its sliding layers, none in its global ones."""
    model = mh.hf.patch(_meta_model("cohere2", layer_types=["sliding_attention", "full_attention"]))
    ropes = [m.mh.rope for m in model.modules() if isinstance(m, mh.hf.PatchedAttention)]
    assert ropes[0] is not None and ropes[0].interleaved and ropes[1] is None
    assert compare("cohere2") == "exact"


# ---- 3. RoPE parameters per layer type ----------------------------------------------------------
def test_per_layer_type_rope_bases_are_read_per_layer() -> None:
    cfg = {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                               "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}}}
    assert hf_config.module_rope_base(cfg, "sliding_attention", "c") == 10_000.0
    assert hf_config.module_rope_base(cfg, "full_attention", "c") == 1_000_000.0
    with pytest.raises(ValueError, match="per layer type"):
        hf_config.module_rope_base(cfg, None, "c")


def test_a_class_without_layer_types_given_nested_rope_parameters_is_refused() -> None:
    config = LlamaConfig(**SMALL)
    config.rope_parameters = {"sliding_attention": {"rope_theta": 1.0}, "full_attention": {"rope_theta": 2.0}}
    with pytest.raises(ValueError, match="per layer type"):
        mh.MultiHeadAttention.from_hf(LlamaAttention(config, layer_idx=0))


def test_ultrabert_is_refused_by_name() -> None:
    assert "UltrabertAttention" in _refused("ultrabert")


# ---- 4. windows only where the module has one -----------------------------------------------------
def test_qwen2_window_follows_each_layers_type() -> None:
    config = Qwen2Config(layer_types=["full_attention", "sliding_attention"], use_sliding_window=True,
                         sliding_window=6, **SMALL)
    windows = [mh.MultiHeadAttention.from_hf(Qwen2Attention(config, layer_idx=i)).window for i in range(2)]
    assert windows == [None, 6]
    assert compare("qwen2") == "exact"


def test_llama_ignores_a_sliding_window_its_class_never_uses() -> None:
    config = LlamaConfig(sliding_window=3, **SMALL)
    assert mh.MultiHeadAttention.from_hf(LlamaAttention(config, layer_idx=0)).window is None


# ---- 5. q/k normalisation under any name -----------------------------------------------------------
def test_a_qk_norm_its_description_does_not_name_is_refused_by_name() -> None:
    """Llama 4's weightless L2 q/k norm is described (tests/interop/test_llama4.py; Qwen3's, OLMo 2's
    and HunYuan dense's q/k norms too: see the zoo); a norm of another class in its place is refused."""
    from transformers.models.llama4.modeling_llama4 import Llama4TextAttention, Llama4TextRMSNorm

    module = Llama4TextAttention(tiny_config("llama4_text", head_dim=16), layer_idx=0)
    module.qk_norm = Llama4TextRMSNorm(16)  # a weight: not what the description covers
    with pytest.raises(ValueError, match=r"Llama4TextAttention has submodules .*qk_norm \(Llama4TextRMSNorm\)"):
        mh.MultiHeadAttention.from_hf(module)


def test_hunyuan_ntk_alpha_rope_with_a_bad_alpha_is_refused_naming_it() -> None:
    """HunYuan dense's own 'dynamic' RoPE with an alpha (θ · alpha^(D/(D-2))) is read; a bad alpha is refused."""
    params = {"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": -2.0, "factor": 1.0}
    assert "alpha=-2.0" in _refused("hunyuan_v1_dense", head_dim=16, rope_parameters=params)


# ---- 6-8. extra computation, relative positions, not plain softmax attention -------------------------
@pytest.mark.parametrize("model_type, cls", [
    ("bitnet", "BitNetAttention"), ("diffllama", "DiffLlamaAttention"), ("granite_swa", "GraniteSWAAttention"),
    ("parakeet_encoder", "ParakeetEncoderAttention"),
    ("roformer", "RoFormerAttention"), ("nystromformer", "NystromformerAttention"),
    ("bridgetower", "BridgeTowerResidualAttention"),
])
def test_extra_computation_and_relative_positions_are_refused_by_name(model_type: str, cls: str) -> None:
    assert cls in _refused(model_type)


def test_olmo_clip_qkv_is_refused_naming_the_key() -> None:
    assert "clip_qkv" in _refused("olmo", clip_qkv=8.0)


# ---- 9. multi-axis RoPE ------------------------------------------------------------------------------
def test_multi_axis_rope_whose_sections_do_not_fit_the_heads_is_refused_by_name() -> None:
    """M-RoPE is computed (Qwen2-VL's sections; the whole VL models in test_qwen_vl.py); the default
    sections [16, 24, 24] with the tiny text model's 8 frequency slots are refused naming both."""
    assert "sections must sum to rotary_dim / 2 = 8 frequency slots, got [16, 24, 24]" in _refused("qwen2_vl_text")


# ---- the crashes of the old converter ------------------------------------------------------------------
@pytest.mark.parametrize("model_type", [
    "megatron-bert", "roberta-prelayernorm", "xlm-roberta-xl", "clap", "esm", "gpt_bigcode", "big_bird",
    "longformer", "bros", "canine", "mra", "yoso", "markuplm", "luke",
])
def test_families_that_crashed_are_refused_with_a_value_error(model_type: str) -> None:
    assert "is not a supported attention class" in _refused(model_type)


# ALIGN's, AltCLIP's, LayoutLM's and Splinter's attention were refused here until LayoutLM's encoder-only
# BERT attention was described (its copies in multihead.interop.hf_copies); compared in test_zoo.py.
def test_git_is_refused_naming_its_text_attention_and_lenient_patches_its_vision_tower() -> None:
    """GIT's vision tower is SigLIP's attention (a registered copy); its text attention is not described."""
    model = _meta_model("git")
    with pytest.raises(ValueError, match="GitAttention is not a supported attention class"):
        mh.hf.patch(model)
    with pytest.warns(UserWarning, match="GitAttention"):
        mh.hf.patch(model, strict=False)
    patched = {type(m.original).__name__ for m in model.modules() if isinstance(m, mh.hf.PatchedAttention)}
    assert patched == {"GitVisionAttention"}


def test_a_subclass_of_a_registered_class_is_not_accepted() -> None:
    class Mine(LlamaAttention):
        pass

    reason = hf_registry.why_not(Mine(LlamaConfig(**SMALL), layer_idx=0))
    assert reason is not None and "Mine is not a supported attention class" in reason


def test_an_undescribed_attribute_is_refused() -> None:
    module = LlamaAttention(LlamaConfig(**SMALL), layer_idx=0)
    module.attn_temperature = 0.5  # behaviour a later transformers might add
    with pytest.raises(ValueError, match="attn_temperature"):
        mh.MultiHeadAttention.from_hf(module)
