"""GPT-NeoX (Pythia), Falcon and BLOOM: fused ``query_key_value``, patched exactly or refused by name.

Each variant is a tiny random model (2 layers, E=64, H=4 (BLOOM also H=6), every 2-D
weight ×4 so that attention is far from uniform), float32: patched hidden states equal the
unpatched ones on a right- and a left-padded batch (within 1e-5 on real tokens, |h| ≈ 3),
greedy generation gives the same tokens (one prompt, and the padded batch), and
``from_hf`` of one attention module equals the HF module called with its own signature.
The zoo (tests/interop/test_zoo.py) compares one variant of each family again.

Notation: B batch, S tokens, E embed_dim, H heads, Hkv key/value heads, D head_dim.
Runtime: about 40 s on 2 shared, busy cores (the padded-batch generations dominate).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn
from transformers import (BloomConfig, BloomForCausalLM, FalconConfig, FalconForCausalLM, GPTNeoXConfig,
                          GPTNeoXForCausalLM)
from transformers.models.bloom.modeling_bloom import BloomAttention, build_alibi_tensor
from transformers.models.falcon.modeling_falcon import FalconAttention, FalconRotaryEmbedding
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXAttention, GPTNeoXRotaryEmbedding

import multihead as mh
from multihead.interop import hf_registry, hf_weights, hf_wrappers_other
from test_zoo import sharpen  # same folder (pytest puts it on sys.path)

B, S, VOCAB, RTOL, ATOL = 2, 9, 100, 1e-5, 1e-5
SMALL = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": VOCAB,
         "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
SCALED = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4}

#: name: (model class, config, attn_implementation)
VARIANTS: dict[str, tuple[Any, Any, str]] = {
    "neox": (GPTNeoXForCausalLM, lambda: GPTNeoXConfig(intermediate_size=128, **SMALL), "eager"),
    "neox-sdpa-full-rotary-no-bias": (GPTNeoXForCausalLM, lambda: GPTNeoXConfig(
        intermediate_size=128, rotary_pct=1.0, attention_bias=False, use_parallel_residual=False, **SMALL), "sdpa"),
    "neox-yarn": (GPTNeoXForCausalLM, lambda: GPTNeoXConfig(
        intermediate_size=128, max_position_embeddings=8, rope_parameters={
            **SCALED, "rope_theta": 10000.0, "partial_rotary_factor": 0.5}, **SMALL), "eager"),
    "neox-dynamic": (GPTNeoXForCausalLM, lambda: GPTNeoXConfig(
        intermediate_size=128, max_position_embeddings=8, rope_parameters={
            "rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0, "partial_rotary_factor": 0.25}, **SMALL),
        "eager"),
    "falcon-new-architecture": (FalconForCausalLM, lambda: FalconConfig(
        new_decoder_architecture=True, num_kv_heads=2, bias=True, **SMALL), "eager"),
    "falcon-multi-query": (FalconForCausalLM, lambda: FalconConfig(multi_query=True, parallel_attn=False, **SMALL),
                           "eager"),
    "falcon-mha-sdpa-linear-rope": (FalconForCausalLM, lambda: FalconConfig(
        multi_query=False, bias=True, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0},
        **SMALL), "sdpa"),
    "bloom": (BloomForCausalLM, lambda: BloomConfig(hidden_size=64, n_head=4, n_layer=2, vocab_size=VOCAB), "eager"),
    "bloom-6-heads-post-layernorm-tp": (BloomForCausalLM, lambda: BloomConfig(
        hidden_size=48, n_head=6, n_layer=2, vocab_size=VOCAB, apply_residual_connection_post_layernorm=True,
        pretraining_tp=2), "eager"),  # pretraining_tp without slow_but_exact changes nothing
}


def _model(name: str) -> nn.Module:
    cls, make_config, impl = VARIANTS[name]
    torch.random.default_generator.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = cls._from_config(make_config(), attn_implementation=impl).eval()
    sharpen(model)
    return model


def _batch(side: str) -> dict[str, torch.Tensor]:
    """Two rows; the second has 3 padding tokens on ``side``."""
    ids = torch.randint(3, VOCAB, (B, S), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, S - 3:] = 0 if side == "right" else 1
    mask[1, :3] = 0 if side == "left" else 1
    return {"input_ids": ids, "attention_mask": mask}


def _hidden(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model.base_model(**batch).last_hidden_state  # (B, S, E)


def _relative(got: torch.Tensor, want: torch.Tensor, mask: torch.Tensor) -> float:
    real = mask.bool()
    return ((got[real] - want[real]).abs().max() / want[real].abs().max()).item()


def _greedy(model: nn.Module, **inputs: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # right padding in a decoder: HF warns, and still runs
        return model.generate(**inputs, max_new_tokens=4, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_patched_model_equals_unpatched_on_padded_batches_and_greedy_tokens(name: str) -> None:
    model = _model(name)
    batches = [_batch(side) for side in ("right", "left")]
    wants = [_hidden(model, batch) for batch in batches]
    prompt = batches[0]["input_ids"][:1]
    tokens = [_greedy(model, input_ids=prompt), *(_greedy(model, **batch) for batch in batches)]
    mh.hf.patch(model)
    assert sum(isinstance(m, mh.hf.PatchedAttention) for m in model.modules()) == 2
    for batch, want in zip(batches, wants):
        real = batch["attention_mask"].bool()
        torch.testing.assert_close(_hidden(model, batch)[real], want[real], rtol=0, atol=ATOL)
    assert torch.equal(_greedy(model, input_ids=prompt), tokens[0])
    for batch, want_tokens in zip(batches, tokens[1:]):  # right padding: masks with holes while generating
        assert torch.equal(_greedy(model, **batch), want_tokens)


# ---- from_hf of one attention module equals the HF module ----------------------------------------
def _randomised(module: nn.Module) -> nn.Module:
    torch.random.default_generator.manual_seed(3)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.3)
    return module.eval()


def _hf_mask(pad: int) -> torch.Tensor:
    """(B, 1, S, S) additive causal mask, the last ``pad`` tokens of row 1 masked (HF eager format)."""
    allowed = torch.ones(S, S, dtype=torch.bool).tril().expand(B, 1, S, S).clone()
    allowed[1, :, :, S - pad:] = False
    return torch.zeros(B, 1, S, S).masked_fill(~allowed, torch.finfo(torch.float32).min)


def _compare_module(hf_out: torch.Tensor, layer: mh.MultiHeadAttention, x: torch.Tensor, pad: int,
                    positions: torch.Tensor | None) -> None:
    key_mask = torch.ones(B, S, dtype=torch.bool)
    key_mask[1, S - pad:] = False
    with torch.no_grad():
        got = layer(x, key_mask=key_mask, positions=positions)
    real = key_mask  # padding queries may see no key: compared on real tokens
    torch.testing.assert_close(got[real], hf_out[real], rtol=0, atol=1e-5)


@pytest.mark.parametrize("extra", [{}, {"rope_parameters": {**SCALED, "rope_theta": 10000.0,
                                                                 "partial_rotary_factor": 0.5}}])
def test_from_hf_gpt_neox_attention_equals_hf(extra: dict) -> None:
    config = GPTNeoXConfig(max_position_embeddings=16, **SMALL, **extra)
    hf = _randomised(GPTNeoXAttention(config, layer_idx=0))
    x = torch.randn(B, S, 64, generator=torch.Generator().manual_seed(4))
    pos = torch.arange(S)[None].expand(B, S)
    with torch.no_grad():
        want = hf(x, _hf_mask(3), position_embeddings=GPTNeoXRotaryEmbedding(config)(x, pos))[0]
    layer = mh.MultiHeadAttention.from_hf(hf)
    assert layer.rope.rotary_dim == hf.rotary_ndims
    _compare_module(want, layer, x, 3, pos)


@pytest.mark.parametrize("variant, kv_heads", [({"new_decoder_architecture": True, "num_kv_heads": 2}, 2),
                                               ({"multi_query": True}, 1), ({"multi_query": False, "bias": True}, 4)],
                         ids=["new-architecture", "multi-query", "mha"])
def test_from_hf_falcon_attention_equals_hf(variant: dict, kv_heads: int) -> None:
    config = FalconConfig(**SMALL, **variant)
    config._attn_implementation = "eager"
    hf = _randomised(FalconAttention(config, layer_idx=0))
    x = torch.randn(B, S, 64, generator=torch.Generator().manual_seed(4))
    pos = torch.arange(S)[None].expand(B, S)
    with torch.no_grad():
        want = hf(x, None, _hf_mask(2), position_embeddings=FalconRotaryEmbedding(config)(x, pos))[0]
    layer = mh.MultiHeadAttention.from_hf(hf)
    assert layer.num_kv_heads == kv_heads
    _compare_module(want, layer, x, 2, pos)


@pytest.mark.parametrize("heads", [4, 6])
def test_from_hf_bloom_attention_equals_hf(heads: int) -> None:
    hf = _randomised(BloomAttention(BloomConfig(hidden_size=8 * heads, n_head=heads), layer_idx=0))
    x = torch.randn(B, S, 8 * heads, generator=torch.Generator().manual_seed(4))
    key_mask = torch.ones(B, S, dtype=torch.long)
    key_mask[1, S - 3:] = 0
    with torch.no_grad():  # BloomAttention adds the residual: give it zeros
        want = hf(x, torch.zeros_like(x), build_alibi_tensor(key_mask, heads, torch.float32), _hf_mask(3))[0]
    layer = mh.MultiHeadAttention.from_hf(hf)
    assert layer.alibi_slopes is not None and layer.rope is None and layer.causal
    _compare_module(want, layer, x, 3, None)


# ---- layouts: our tensors are the fused rows, and a patched model saves the original layout --------
@pytest.mark.parametrize("name", ["neox", "falcon-new-architecture", "falcon-multi-query", "bloom"])
def test_fused_rows_round_trip_and_patched_state_dict_is_the_original(name: str) -> None:
    model = _model(name)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    module = next(m for m in model.modules() if hf_registry.spec_of(m) is not None)
    ours = hf_weights.state_from_hf(module)
    back = hf_weights.state_to_hf(ours, module)
    assert all(torch.equal(back[k], p) for k, p in module.named_parameters())
    mh.hf.patch(model)
    assert list(model.state_dict()) == list(before)
    assert all(torch.equal(model.state_dict()[k], before[k]) for k in before)


def test_falcon_new_architecture_groups_query_heads_by_kv_head() -> None:
    """Rows of query_key_value per K/V head i: [q_2i, q_2i+1, k_i, v_i] (H=4, Hkv=2, D=16)."""
    hf = FalconAttention(FalconConfig(new_decoder_architecture=True, num_kv_heads=2, **SMALL), layer_idx=0)
    w = hf.query_key_value.weight.view(2, 4, 16, 64)  # (Hkv, g + 2, D, E)
    layer = mh.MultiHeadAttention.from_hf(hf)
    assert torch.equal(layer.q_proj.weight, w[:, :2].reshape(64, 64))
    assert torch.equal(layer.k_proj.weight, w[:, 2].reshape(32, 64))
    assert torch.equal(layer.v_proj.weight, w[:, 3].reshape(32, 64))


def test_patched_falcon_new_architecture_caches_every_query_head_as_hf_does() -> None:
    model = _model("falcon-new-architecture")
    ids = _batch("right")["input_ids"]
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=True).cache.layers[0].keys.shape
        got = mh.hf.patch(model)(input_ids=ids, use_cache=True).cache.layers[0].keys.shape
    assert got == want == (B, 4, S, 16)


def test_saved_patched_falcon_reloads_unpatched_with_the_same_outputs(tmp_path) -> None:
    model = mh.hf.patch(_model("falcon-new-architecture"))
    with torch.no_grad():  # weights changed while patched are the ones saved
        for m in model.modules():
            if isinstance(m, mh.hf.PatchedAttention):
                m.mh.k_proj.weight.mul_(1.5)
    batch = _batch("left")
    want = _hidden(model, batch)
    model.save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = FalconForCausalLM.from_pretrained(tmp_path).eval()
    assert not mh.hf.is_patched(loaded)
    assert _relative(_hidden(loaded, batch), want, batch["attention_mask"]) <= RTOL


# ---- BLOOM's ALiBi counts positions over unmasked keys only ----------------------------------------------
def _holey_batch() -> dict[str, torch.Tensor]:
    batch = _batch("right")
    batch["attention_mask"][1] = torch.tensor([1, 1, 0, 0, 1, 1, 1, 0, 1])  # holes between real tokens
    return batch


@pytest.mark.parametrize("use_cache", [True, False])  # through HF's cache, or our layer alone
def test_patched_bloom_is_exact_with_a_mask_that_has_holes(use_cache: bool) -> None:
    model = _model("bloom")
    batch = {**_holey_batch(), "use_cache": use_cache}
    want = _hidden(model, batch)
    mh.hf.patch(model)
    assert _relative(_hidden(model, batch), want, batch["attention_mask"]) <= RTOL


def test_bloom_holes_need_the_reordering_of_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without reordering, key indices are not BLOOM's positions: the comparison above would fail."""
    model = _model("bloom")
    batch = _holey_batch()
    want = _hidden(model, batch)
    mh.hf.patch(model)
    monkeypatch.setattr(hf_wrappers_other, "_unmasked_keys_first",  # the keys left in their order
                        lambda k, v, mask: (k, v, mask, torch.arange(k.shape[2]).expand(k.shape[0], -1)))
    assert _relative(_hidden(model, batch), want, batch["attention_mask"]) > 1e-3


# ---- refused by name --------------------------------------------------------------------------------
def _reason(module: nn.Module, config: Any = None) -> str:
    with pytest.raises(ValueError) as e:
        mh.MultiHeadAttention.from_hf(module, config)
    return str(e.value)


def test_falcon_alibi_is_refused_naming_the_key() -> None:
    model = FalconForCausalLM(FalconConfig(alibi=True, **SMALL))
    with pytest.raises(ValueError, match="alibi=True is not supported"):
        mh.hf.patch(model)


def test_falcon_kv_heads_that_transformers_cannot_run_are_refused() -> None:
    mha = FalconAttention(FalconConfig(multi_query=False, num_kv_heads=2, **SMALL), layer_idx=0)
    assert "num_kv_heads=2 with multi_query=False" in _reason(mha)
    grouped = FalconAttention(FalconConfig(new_decoder_architecture=True, num_kv_heads=2, **SMALL), layer_idx=0)
    grouped.num_kv_heads = 3
    assert "num_kv_heads=3 must divide" in _reason(grouped)


def test_falcon_malformed_fields_are_refused_naming_the_key() -> None:
    module = FalconAttention(FalconConfig(**SMALL), layer_idx=0)
    config = {**module.config.to_dict(), "alibi": "yes"}
    assert "alibi must be true or false" in _reason(module, config)
    module.multi_query = "no"
    assert "multi_query must be true or false" in _reason(module)


def test_bloom_slow_but_exact_tensor_parallel_is_refused_naming_it() -> None:
    model = BloomForCausalLM(BloomConfig(hidden_size=64, n_head=4, n_layer=2, vocab_size=VOCAB, pretraining_tp=2,
                                         slow_but_exact=True))
    with pytest.raises(ValueError, match="pretraining_tp=2 with slow_but_exact=True"):
        mh.hf.patch(model)
    module = BloomAttention(BloomConfig(hidden_size=64, n_head=4), layer_idx=0)
    module.pretraining_tp = 2.5
    assert "pretraining_tp must be an int" in _reason(module)


def test_bloom_attention_with_another_models_config_is_refused() -> None:
    module = BloomAttention(BloomConfig(hidden_size=64, n_head=4), layer_idx=0)
    assert "model_type='gpt2' is not verified" in _reason(module, {"model_type": "gpt2"})


@pytest.mark.parametrize("change, message", [
    ({"head_dim": 8}, "config.head_dim=8 differs"),
    ({"hidden_size": 48}, "rotates 3 of 12 dims"),  # int(12 · 0.25) = 3: odd, HF's table rotates 4
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": "half"}},
     "partial_rotary_factor"),
])
def test_gpt_neox_configs_it_cannot_match_are_refused_naming_the_key(change: dict, message: str) -> None:
    config = GPTNeoXConfig(**{**SMALL, **{k: v for k, v in change.items() if k != "rope_parameters"}})
    module = GPTNeoXAttention(config, layer_idx=0)
    assert message in _reason(module, {**config.to_dict(), **change})


def test_gpt_neox_japanese_stays_refused_by_name() -> None:
    from transformers import GPTNeoXJapaneseConfig, GPTNeoXJapaneseModel

    model = GPTNeoXJapaneseModel(GPTNeoXJapaneseConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1,
                                                       intermediate_multiple_size=2, vocab_size=VOCAB))
    with pytest.raises(ValueError, match="GPTNeoXJapaneseAttention is not a supported attention class"):
        mh.hf.patch(model)


def test_heads_capture_records_a_patched_bloom_on_a_padded_batch_and_refuses_holes() -> None:
    model = mh.hf.patch(_model("bloom"))
    with mh.heads.capture(model) as cap:  # capture records forwards without HF's cache
        _hidden(model, {**_batch("left"), "use_cache": False})
    assert [cap.weights[name].shape for name in cap.layers] == [(B, 4, S, S)] * 2
    with pytest.raises(ValueError, match="capture of a patched BloomAttention"), mh.heads.capture(model):
        _hidden(model, {**_holey_batch(), "use_cache": False})
