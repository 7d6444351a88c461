"""DeepSeek-V2/V3 models patched with multi-head latent attention equal transformers' (issue #15).

Notation: B batch, S tokens, H heads, r kv_lora_rank, dr qk_rope_head_dim.

Whole transformers models (2 layers: one dense, one MoE) from small configs with random
weights (2-D weights ×4 so that attention is far from uniform), float32: the patched model's
last hidden states equal the unpatched ones within 1e-5 on real tokens of right- and
left-padded batches, and greedy generation (HF's dynamic cache, and once its static cache;
left padding) gives the same tokens. Measured: at most ~2.2e-6 absolute (hidden states of
size ~3.5), for every combination below and both query paths of V2.
Settings compared: V3 with q_lora_rank set or None, rope_interleave true or false, yarn
with mscale / mscale_all_dim (the softmax scale changes) or default RoPE, eager and sdpa;
V2 (always interleaved RoPE, computed with complex numbers).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import multihead as mh
from multihead.interop import hf_layers, hf_registry

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, CONFIG_MAPPING  # noqa: E402
from test_zoo import sharpen  # noqa: E402 - same folder (pytest puts it on sys.path)

B, S, VOCAB, ATOL = 2, 9, 100, 1e-5
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}
SIZES = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2,
             intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=64, kv_lora_rank=16,
             qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, n_routed_experts=8, n_group=2, topk_group=1,
             num_experts_per_tok=2, first_k_dense_replace=1, moe_intermediate_size=32, n_shared_experts=1,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _config(model_type: str, *, q_lora_rank: int | None = 24, yarn: bool = True, **extra: Any) -> Any:
    rope = YARN if yarn else {"rope_type": "default", "rope_theta": 10000.0}
    return CONFIG_MAPPING[model_type](**SIZES, q_lora_rank=q_lora_rank, rope_parameters=dict(rope), **extra)


def _model(config: Any, impl: str = "eager") -> nn.Module:
    torch.random.default_generator.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config, attn_implementation=impl).eval()
    sharpen(model)
    return model


def _batch(side: str) -> dict[str, torch.Tensor]:
    """Two rows; the second has 3 padding tokens on ``side``."""
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(B, S, dtype=torch.long)
    if side == "right":
        mask[1, S - 3:] = 0
    else:
        mask[1, :3] = 0
    return {"input_ids": torch.randint(3, VOCAB, (B, S), generator=g), "attention_mask": mask}


def _hidden(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model.model(**batch).last_hidden_state  # (B, S, E)


def _generate(model: Any, **kw: Any) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(**_batch("left"), max_new_tokens=6, do_sample=False, pad_token_id=0, **kw)


def _differences(model: nn.Module, caches: tuple[str, ...] = ("dynamic",)) -> dict[str, Any]:
    """Max |patched - unpatched| on real tokens per padding side, and whether greedy tokens
    agree with each of HF's ``caches``."""
    batches = {side: _batch(side) for side in ("right", "left")}
    want = {side: _hidden(model, b) for side, b in batches.items()}
    tokens = {c: _generate(model, cache_implementation=c) for c in caches}
    mh.hf.patch(model)
    out: dict[str, Any] = {}
    for side, batch in batches.items():
        real = batch["attention_mask"].bool()
        out[side] = (_hidden(model, batch)[real] - want[side][real]).abs().max().item()
    out["same tokens"] = {c: torch.equal(_generate(model, cache_implementation=c), t) for c, t in tokens.items()}
    return out


def _assert_exact(model: nn.Module, caches: tuple[str, ...] = ("dynamic",)) -> None:
    d = _differences(model, caches)
    assert d["right"] <= ATOL and d["left"] <= ATOL, d
    assert all(d["same tokens"].values()), d


@pytest.mark.parametrize(("q_lora_rank", "rope_interleave"), [(24, True), (None, False)])
def test_patched_deepseek_v3_equals_transformers(q_lora_rank: int | None, rope_interleave: bool) -> None:
    _assert_exact(_model(_config("deepseek_v3", q_lora_rank=q_lora_rank, rope_interleave=rope_interleave)))


def test_patched_deepseek_v3_generates_the_same_tokens_with_a_static_cache() -> None:
    """HF's static cache hands back every preallocated slot (unwritten ones masked, or sliced
    off when the mask is dropped for a purely causal prefill)."""
    _assert_exact(_model(_config("deepseek_v3"), impl="sdpa"), caches=("static",))


def test_patched_deepseek_v3_with_sdpa_and_default_rope_equals_transformers() -> None:
    _assert_exact(_model(_config("deepseek_v3", yarn=False), impl="sdpa"))


def test_patched_deepseek_v2_equals_transformers() -> None:
    _assert_exact(_model(_config("deepseek_v2", q_lora_rank=None)))  # V2-Lite's query path; V3's test has both


def test_rope_interleave_null_is_rotate_half_as_in_transformers() -> None:
    """V3's forward tests ``if config.rope_interleave``: None pairs as rotate-half."""
    _assert_exact(_model(_config("deepseek_v3", rope_interleave=None)))


def test_the_comparison_catches_v2_read_with_rotate_half(monkeypatch: pytest.MonkeyPatch) -> None:
    """V2 pairs RoPE by complex numbers (interleaved), whatever ``rope_interleave`` says:
    reading it as rotate-half must be reported, or the V2 test above could not fail."""
    read = hf_layers.SPECIAL["deepseek_v2"]
    monkeypatch.setitem(hf_layers.SPECIAL, "deepseek_v2",  # type: ignore[arg-type]
                        lambda cfg, src: dataclasses.replace(read(cfg, src), rope_interleaved=False))
    d = _differences(_model(_config("deepseek_v2")), caches=())
    assert d["right"] > 100 * ATOL and d["left"] > 100 * ATOL


def test_patched_layers_cache_only_the_latent_and_rotary_key() -> None:
    model = _model(_config("deepseek_v3"))
    mh.hf.patch(model)
    with torch.no_grad():
        cache = model(**_batch("right"), use_cache=True).past_key_values
    assert [tuple(layer.keys.shape) for layer in cache.layers] == [(B, 1, S, 16)] * 2  # latent c, r numbers
    assert [tuple(layer.values.shape) for layer in cache.layers] == [(B, 1, S, 8)] * 2  # rotary key, dr numbers


def test_patched_layer_is_latent_and_saves_transformers_names() -> None:
    model = _model(_config("deepseek_v3"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    mh.hf.patch(model)
    wrapper = model.model.layers[0].self_attn
    assert isinstance(wrapper, mh.hf.PatchedAttention) and isinstance(wrapper.mh, mh.MultiHeadLatentAttention)
    assert wrapper.mh.scale == wrapper.original.scaling != wrapper.original.qk_head_dim ** -0.5  # yarn's mscale²
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    mh.hf.unpatch(model)
    assert type(model.model.layers[0].self_attn).__name__ == "DeepseekV3Attention"


def test_unequal_key_value_heads_are_refused_by_name() -> None:
    """transformers' kernels repeat K/V by num_attention_heads // num_key_value_heads though
    kv_b_proj already gives every head its own: refused rather than guessed."""
    config = _config("deepseek_v3")
    config.num_key_value_heads = 2
    with pytest.raises(ValueError, match=r"num_key_value_heads=2 != config.num_attention_heads=4"):
        mh.hf.patch(_model(config), kernel=False)  # the wrapper's description: the kernel route is HF's module


def test_an_attribute_the_description_lacks_is_refused() -> None:
    model = _model(_config("deepseek_v2"))
    model.model.layers[1].self_attn.softcap = 30.0
    with pytest.raises(ValueError, match=r"layers.1.self_attn .*attributes its description does not cover: "
                                         r"\['softcap'\]"):
        mh.hf.patch(model, kernel=False)


def test_both_query_paths_present_is_refused() -> None:
    model = _model(_config("deepseek_v3"))
    attn = model.model.layers[0].self_attn
    attn.q_proj = nn.Linear(64, 4 * 20, bias=False)  # beside q_a_proj / q_b_proj
    with pytest.raises(ValueError, match="submodules its description does not account for: q_a_layernorm"):
        mh.hf.patch(model, kernel=False)


def test_plain_converter_points_to_the_latent_layer() -> None:
    attn = _model(_config("deepseek_v3")).model.layers[0].self_attn
    with pytest.raises(ValueError, match="MultiHeadLatentAttention.from_hf"):
        mh.interop.from_hf(attn)
    assert hf_registry.why_not(attn) is None


def test_deepseek_v2_config_reads_as_latent_attention_with_interleaved_rope() -> None:
    config = mh.AttentionConfig.from_hf({**_config("deepseek_v2").to_dict(), "rope_interleave": False})
    assert config.latent and config.rope_interleaved and config.kv_lora_rank == 16


@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3"])
def test_config_cost_is_what_transformers_caches(model_type: str) -> None:
    """The KV-cache bytes per token that mh.cost reads from the config are what the unpatched model holds."""
    config = _config(model_type)
    with torch.no_grad():
        cache = _model(config)(**_batch("right"), use_cache=True).past_key_values
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers) // (B * S)
    assert held == mh.cost(mh.AttentionConfig.from_hf(config.to_dict()), S).kv_cache_bytes_per_token == 2 * 24 * 4
