"""The config zoo: ``AttentionConfig.from_hf`` and ``mh.cost`` against the models transformers builds.

For every model type ``from_hf`` accepts, the config transformers writes for a tiny model
(the zoo's recipe) is read back and compared with the model built from it: attention
layers, KV heads and head_dim as the real KV cache holds them after a forward, the cache's
bytes per token against ``mh.cost``, query width (H·D) against the query projection, and
causality measured by perturbing the last token. At default sizes (the published model
each config class describes) the same config is compared on the ``meta`` device, where a
forward costs no memory. Every other model type must be refused by ``from_hf``.

Runtime: about 30 s on 2 shared cores.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn
from transformers import AutoModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

import multihead as mh
from multihead.interop.hf_config import DECODERS, ENCODERS

from test_zoo import tiny_config  # same folder (pytest puts it on sys.path)

VISION = {"vit", "deit", "clip_vision_model"}
S = 4  # fewer tokens than the zoo's windows (6): a sliding cache holds them all


def _build(config: Any, device: str) -> nn.Module:
    with warnings.catch_warnings(), torch.device(device):
        warnings.simplefilter("ignore")
        torch.random.default_generator.manual_seed(0)
        # eager experts: the grouped-GEMM path wants bfloat16 on CPU and meta
        return AutoModel.from_config(config, attn_implementation="eager", experts_implementation="eager").eval()


def _inputs(model_type: str, config: Any, device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if model_type in VISION:
        size = config.image_size
        return {"pixel_values": torch.randn(1, config.num_channels, size, size, generator=g).to(device)}
    return {"input_ids": torch.randint(3, 90, (1, S), generator=g).to(device)}


def _perturbed_last(model_type: str, inputs: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    if model_type in VISION:
        x = inputs["pixel_values"].clone()
        x[..., -config.patch_size:, -config.patch_size:] += 1.0  # the last patch
        return {"pixel_values": x}
    ids = inputs["input_ids"].clone()
    ids[0, -1] = 2 if ids[0, -1] != 2 else 1
    return {"input_ids": ids}


def _kv_cache(model: nn.Module, inputs: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    with torch.no_grad():
        out = model(**inputs, use_cache=True)
    cache = out.past_key_values
    return [(layer.keys, layer.values) for layer in cache.layers]


def _query_width(model: nn.Module, cfg: mh.AttentionConfig) -> int | None:
    """H·D from the first layer's query projection, where the layout names it."""
    for name, m in model.named_modules():
        leaf = name.rpartition(".")[2]
        if isinstance(m, nn.Linear) and leaf in ("q_proj", "query", "q_lin", "q"):
            return m.out_features
        if leaf in ("c_attn", "query_key_value", "qkv_proj", "Wqkv") and hasattr(m, "weight"):
            rows = max(m.weight.shape)  # fused (H + 2·Hkv)·D (Conv1D stores [in, out])
            return rows - 2 * cfg.num_kv_heads * cfg.head_dim
    return None


def _read_or_none(config: Any) -> mh.AttentionConfig | None:
    """The config read by from_hf, or None when it is refused (a ValueError naming the field)."""
    try:
        return mh.AttentionConfig.from_hf(config.to_dict())
    except ValueError:
        return None


MOE = {"mixtral", "qwen2_moe", "qwen3_moe"}
ACCEPTED = sorted(t for t in ENCODERS | set(DECODERS) if t != "albert")


@pytest.mark.parametrize("model_type", ACCEPTED)
def test_tiny_config_matches_the_model_and_its_kv_cache(model_type: str) -> None:
    config = tiny_config(model_type)
    cfg = _read_or_none(config)
    if cfg is None:
        return  # refused by name: allowed (exact or refused)
    model = _build(config, "cpu")
    inputs = _inputs(model_type, config, "cpu")
    with torch.no_grad():
        out = model(**inputs).last_hidden_state  # (1, S, E)
        moved = model(**_perturbed_last(model_type, inputs, config)).last_hidden_state
    # MoE layers differ by rounding when the batch changes: a real dependence is far larger
    earlier_changed = bool((moved[:, :-1] - out[:, :-1]).abs().max() > 1e-4 * out.abs().max())
    assert cfg.causal == (not earlier_changed), f"causal={cfg.causal} but earlier outputs changed={earlier_changed}"
    width = _query_width(model, cfg)
    assert width is None or width == cfg.num_heads * cfg.head_dim
    if cfg.causal:
        cache = _kv_cache(model, inputs)
        assert len(cache) == cfg.num_layers
        assert all(k.shape[1:] == (cfg.num_kv_heads, S, cfg.head_dim) == v.shape[1:] for k, v in cache)
        held = sum(k.nbytes + v.nbytes for k, v in cache) // S
        assert held == mh.cost(cfg, S, dtype=torch.float32).kv_cache_bytes_per_token


# Read by per-layer rules (latent attention, per-stage or per-layer heads): checked against the published
# architecture and transformers' DeepSeek-V3 attention in these files instead.
CHECKED_ELSEWHERE = {"deepseek_v3": "tests/interop/test_modern_configs.py, tests/core/test_latent.py",
                     "deepseek_v2": "tests/interop/test_deepseek.py (whole models, the cache's bytes)",
                     "swin": "tests/interop/test_modern_configs.py (per-stage heads)",
                     "openelm": "tests/interop/test_modern_configs.py (per-layer heads)",
                     # DeepSeek-V3's attention copied or held with configs of V3's keys: read by V3's
                     # reader when patched, whole models compared
                     **{t: "tests/interop/test_zoo.py (patched models, latent attention read from the config)"
                        for t in ("glm4_moe_lite", "youtu", "sarvam_mla")}}

# gpt_oss's model cannot be built on the meta device (its MoE router calls torch.nonzero
# while building); its config reading is checked at tiny size above.
META_UNBUILDABLE = {"gpt_oss"}


@pytest.mark.parametrize("model_type", sorted(set(DECODERS) - META_UNBUILDABLE))
def test_default_size_config_matches_the_kv_cache_on_meta(model_type: str) -> None:
    config = CONFIG_MAPPING[model_type]()
    cfg = _read_or_none(config)
    if cfg is None:
        return  # refused by name: allowed (exact or refused)
    model = _build(config, "meta")
    if model_type in MOE:  # expert routing cannot run on meta: the cache is what k_proj/v_proj write
        projections = [m for n, m in model.named_modules() if n.rpartition(".")[2] in ("k_proj", "v_proj")]
        assert len(projections) == 2 * cfg.num_layers
        assert all(m.out_features == cfg.num_kv_heads * cfg.head_dim for m in projections)
        per_token = sum(m.out_features for m in projections) * 4  # float32
        assert per_token == mh.cost(cfg, S, dtype=torch.float32).kv_cache_bytes_per_token
        return
    cache = _kv_cache(model, _inputs(model_type, config, "meta"))
    assert len(cache) == cfg.num_layers
    assert all(k.shape[1:] == (cfg.num_kv_heads, S, cfg.head_dim) for k, _ in cache)
    dtype = cache[0][0].dtype
    held = sum(k.nbytes + v.nbytes for k, v in cache) // S
    assert held == mh.cost(cfg, S, dtype=dtype).kv_cache_bytes_per_token


def test_falcon_cache_bytes_equal_what_transformers_caches() -> None:
    config = CONFIG_MAPPING["falcon"]()  # Falcon-7B: 71 heads, multi_query
    cfg = mh.AttentionConfig.from_hf(config.to_dict())  # its to_dict says num_kv_heads=71
    assert config.to_dict()["num_kv_heads"] == 71 and cfg.num_kv_heads == 1
    cache = _kv_cache(_build(config, "meta"), _inputs("falcon", config, "meta"))
    assert sum(k.nbytes + v.nbytes for k, v in cache) // S == mh.cost(cfg, S).kv_cache_bytes_per_token


@pytest.mark.parametrize("model_type", ["gpt_neox_japanese", "evolla", "musicgen", "canary", "dia", "cohere_asr",
                                        "moonshine_streaming", "convbert", "reformer", "esm", "albert"])
def test_families_read_wrongly_before_are_refused(model_type: str) -> None:
    if model_type not in CONFIG_MAPPING_NAMES:
        pytest.fail(f"{model_type} is not a model type of this transformers")
    with pytest.raises(ValueError):
        mh.AttentionConfig.from_hf(CONFIG_MAPPING[model_type]().to_dict())


def test_every_model_type_is_read_as_a_checked_type_or_refused(capsys: pytest.CaptureFixture) -> None:
    """All model types' default configs: from_hf refuses, or reads a type compared above
    (multimodal files are read from their text_config, whose type must be one of those)."""
    read, refused, unbuildable = [], [], []
    for model_type in sorted(CONFIG_MAPPING_NAMES):
        try:
            raw = CONFIG_MAPPING[model_type]().to_dict()
        except Exception:  # noqa: BLE001 - a config class that needs arguments
            unbuildable.append(model_type)
            continue
        try:
            cfg = mh.AttentionConfig.from_hf(raw)
        except (ValueError, TypeError):
            refused.append(model_type)
            continue
        assert cfg.model_type in ACCEPTED or cfg.model_type in CHECKED_ELSEWHERE, \
            f"{model_type} read as unchecked model_type={cfg.model_type!r}"
        read.append(model_type)
    with capsys.disabled():
        print(f"\nconfig zoo: {len(CONFIG_MAPPING_NAMES)} model types: {len(read)} read (as one of "
              f"{len(ACCEPTED)} checked types), {len(refused)} refused, {len(unbuildable)} without a default config")
    assert len(read) + len(refused) + len(unbuildable) == len(CONFIG_MAPPING_NAMES) > 800
