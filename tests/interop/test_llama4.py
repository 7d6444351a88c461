"""Llama 4's text attention on its registered wrapper: chunks, temperature tuning, weightless q/k norm.

Notation: B batch, S tokens, E embed_dim.

The zoo (tests/interop/test_zoo.py, ``LLAMA4``) compares the tiny model patched with eager on a
right- and a left-padded batch of 9 tokens (chunks of 4: layer 0 rotates, L2-normalises q and k and
attends inside chunks; layer 1 has no RoPE and scales q by position from position 2 on), its greedy
tokens across a chunk boundary and the HF cache it fills. Here: generation on multihead's in-place
cache (left padding: HF counts chunks from each row's first real token, the temperature at the
cache's positions, padding counted), the fused step taken only where it is exact, ``from_hf`` against
the HF module, a call without a mask, and the planted mistakes the comparisons must catch.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import multihead as mh
from multihead.interop import hf_cache, hf_registry, hf_wrappers

pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402

from test_zoo import LLAMA4, RTOL, build, compare, sharpen, tiny_config  # noqa: E402

KEY = "transformers.models.llama4.modeling_llama4.Llama4TextAttention"
S, NEW, VOCAB = 9, 8, 100  # 9 + 8 tokens: positions 0 .. 16 cross three chunk boundaries (4, 8, 12)
GREEDY = {"max_new_tokens": NEW, "min_new_tokens": NEW, "do_sample": False, "pad_token_id": 0,
          "output_logits": True, "return_dict_in_generate": True}


def _model(impl: str = "eager", **extra: Any) -> nn.Module:
    """The zoo's tiny Llama 4 text model (``LLAMA4``, fields overridden by ``extra``), weights ×4."""
    torch.random.default_generator.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build("llama4_text", tiny_config("llama4_text", **{**LLAMA4, **extra}), AutoModelForCausalLM, impl)
    return sharpen(model.eval())


def _prompts(padded: bool) -> dict[str, torch.Tensor]:
    """Two prompts of S tokens; with ``padded`` the second has 3 padding tokens on the left."""
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(2, S, dtype=torch.long)
    mask[1, :3] = 0 if padded else 1
    return {"input_ids": torch.randint(3, VOCAB, (2, S), generator=g), "attention_mask": mask}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def _generate_on_adapter(model: nn.Module, prompts: dict[str, torch.Tensor]) -> tuple[Any, Any, Any]:
    """(HF's generate unpatched, the patched model's on a KVCacheAdapter, the adapter)."""
    with torch.no_grad():
        want = model.generate(**prompts, **GREEDY)
        mh.hf.patch(model)
        cache = mh.hf.KVCacheAdapter(model, max_len=S + NEW)
        got = model.generate(**prompts, **GREEDY, cache=cache)
    return want, got, cache


def _same(want: Any, got: Any) -> bool:
    """The same tokens, and every step's logits within RTOL."""
    return torch.equal(got.sequences, want.sequences) and all(
        _rel(g, w) <= RTOL for g, w in zip(got.logits, want.logits, strict=True))


@pytest.mark.parametrize("impl, padded", [("eager", True), ("sdpa", True), ("sdpa", False)])
def test_generates_hf_tokens_on_the_in_place_cache_across_chunks(impl: str, padded: bool) -> None:
    want, got, cache = _generate_on_adapter(_model(impl), _prompts(padded))
    assert _same(want, got)
    # the chunks and the temperature change every call of this config: never the fused step
    assert cache.paths == ["update", "update"]


def _force_the_modules_cached_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the adapter's own step is taken, run the module's cached call ``layer(x, cache=kv)``."""
    monkeypatch.setattr(hf_cache, "fused_for", lambda layer, x, kv: object())  # "fused": not a reason
    monkeypatch.setattr(hf_cache, "_bare", lambda layer: False)


def test_the_adapters_own_step_is_taken_only_where_it_is_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 64 and floor_scale 64: positions 0 .. 16 change nothing, so decoding takes the
    adapter's own step (the module's cached call here, forced), with HF's logits."""
    _force_the_modules_cached_call(monkeypatch)
    want, got, cache = _generate_on_adapter(_model("sdpa", attention_chunk_size=64, floor_scale=64),
                                            _prompts(padded=False))
    assert _same(want, got)
    assert cache.paths == ["fused", "fused"]


def test_the_adapters_own_step_where_the_temperature_changes_q_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: the own step taken whatever the positions (the module's call has no temperature)."""
    _force_the_modules_cached_call(monkeypatch)
    monkeypatch.setattr(hf_wrappers._Llama4Wrapper, "_plain", lambda self, past, s: True)
    want, got, _ = _generate_on_adapter(_model("sdpa", attention_chunk_size=64), _prompts(padded=False))
    assert not _same(want, got)


def _hf_chunked_mask(s: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(bool (1, 1, S, S), additive float (1, 1, S, S)): causal inside chunks of ``chunk`` tokens."""
    i = torch.arange(s)
    allowed = (i[None, :] <= i[:, None]) & (i[None, :] // chunk == i[:, None] // chunk)  # (S, S)
    additive = torch.zeros(s, s).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return allowed[None, None], additive[None, None]


def _hf_layer(model: nn.Module, idx: int, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """HF's own attention module of layer ``idx`` on x (B, S, E) with an additive mask -> (B, S, E)."""
    positions = torch.arange(x.shape[1])[None]  # (1, S)
    freqs = model.model.rotary_emb(x, positions)
    with torch.no_grad():
        return model.model.layers[idx].self_attn(x, freqs, mask)[0]


def test_from_hf_equals_the_hf_module() -> None:
    """RoPE layer 0 (its chunks the caller's mask, as for HF's module): equal; its L2 norm holds no
    weight. No-RoPE layer 1: refused while it scales q by position, equal without."""
    model, x = _model(), torch.randn(2, S, 64, generator=torch.Generator().manual_seed(3))
    allowed, additive = _hf_chunked_mask(S, LLAMA4["attention_chunk_size"])
    layer = mh.MultiHeadAttention.from_hf(model.model.layers[0].self_attn)
    assert layer.qk_norm == "head_after_rope" and not list(layer.q_norm.parameters())
    assert not any("norm" in key for key in layer.state_dict())
    with torch.no_grad():
        got = layer(x, mask=allowed, positions=torch.arange(S))
    assert _rel(got, _hf_layer(model, 0, x, additive)) <= RTOL
    nope = model.model.layers[1].self_attn
    with pytest.raises(ValueError, match="attn_temperature_tuning=True"):
        mh.MultiHeadAttention.from_hf(nope)
    nope.attn_temperature_tuning = False
    causal = torch.zeros(S, S).masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), torch.finfo(torch.float32).min)
    with torch.no_grad():
        got = mh.MultiHeadAttention.from_hf(nope)(x)
    assert _rel(got, _hf_layer(model, 1, x, causal[None, None])) <= RTOL


def _unmasked_call(model: nn.Module) -> float:
    """Layer 0's wrapper called without a mask (S > chunk) against HF's module given its chunked mask."""
    x = torch.randn(1, S, 64, generator=torch.Generator().manual_seed(4))
    want = _hf_layer(model, 0, x, _hf_chunked_mask(S, LLAMA4["attention_chunk_size"])[1])
    mh.hf.patch(model)
    with torch.no_grad():
        got = model.model.layers[0].self_attn(x, None, None, position_ids=torch.arange(S)[None])[0]
    return _rel(got, want)


def test_a_call_without_a_mask_attends_inside_chunks() -> None:
    assert _unmasked_call(_model()) <= RTOL


def test_chunks_ignored_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hf_registry, "llama4_chunk", lambda module, config: None)
    assert _unmasked_call(_model()) > 1e-3


def test_temperature_tuning_ignored_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hf_registry, "llama4_temperature", lambda module, config: None)
    assert compare("llama4_text").startswith("wrong")


def test_qk_l2_norm_dropped_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(hf_registry.REGISTRY, KEY, dataclasses.replace(hf_registry.REGISTRY[KEY], qk_norm=None))
    assert compare("llama4_text").startswith("wrong")


def test_a_layer_type_it_does_not_describe_is_refused_by_name() -> None:
    model = _model()
    model.config.layer_types = ["sliding_attention", "full_attention"]
    with pytest.raises(ValueError, match="layer_types\\[0\\]='sliding_attention' is not supported"):
        mh.hf.patch(model, kernel=False)


def test_capture_records_the_queries_attention_read() -> None:
    """mh.heads.capture's q of the no-RoPE layer is the temperature-scaled one: its weights follow from q and k."""
    model = mh.hf.patch(_model())
    ids = _prompts(padded=False)["input_ids"][:1]
    with mh.heads.capture(model, what=("weights", "q", "k")) as cap, torch.no_grad():
        model(ids, use_cache=False)
    name = "model.layers.1.self_attn"
    q, k = cap.q[name], cap.k[name]  # (1, H, S, D), (1, Hkv, S, D)
    logits = q @ k.repeat_interleave(q.shape[1] // k.shape[1], dim=1).transpose(-1, -2) * q.shape[-1] ** -0.5
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    want = logits.masked_fill(~causal, float("-inf")).softmax(-1)  # (1, H, S, S)
    assert _rel(cap.weights[name], want) <= RTOL
