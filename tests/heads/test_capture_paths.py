"""Weights on every path: a capture and ``output_attentions`` give the same numbers whichever
path the layer takes — no cache, a KV cache one token at a time, the fused decoding step
allowed or not, Hugging Face's own cache or ours — and never an empty result.

Notation: B batch, S tokens, P prompt tokens, N decoded tokens, H heads, E embed_dim.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import multihead as mh
from multihead import decode

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

B, P, N, E, H = 2, 6, 4, 64, 4


def _layer() -> mh.MultiHeadAttention:
    torch.random.default_generator.manual_seed(0)
    return mh.MultiHeadAttention(E, H, num_kv_heads=2, causal=True, bias=False, rope=mh.RoPE(E // H)).eval()


def _captured(layer: mh.MultiHeadAttention, run: Any) -> mh.heads.Capture:
    with torch.no_grad(), mh.heads.capture(layer, what=("weights", "heads", "q", "k", "v")) as cap:
        run()
    return cap


def test_a_cached_call_by_call_capture_equals_the_whole_forwards() -> None:
    """Prefill P, then N single tokens through a KVCache, captured: the rows of every call, in
    order, equal one capture of the whole sequence without a cache."""
    layer = _layer()
    x = torch.randn(B, P + N, E)
    whole = _captured(layer, lambda: layer(x))
    cache = layer.new_cache(B, P + N)

    def stepped() -> None:
        layer(x[:, :P], cache=cache)
        for t in range(P, P + N):
            layer(x[:, t:t + 1], cache=cache)

    steps = _captured(layer, stepped)
    name = whole.layers[0]
    for what in ("weights", "heads", "q", "k", "v"):
        got, want = getattr(steps, what)[name], getattr(whole, what)[name]
        assert got.shape == want.shape, what
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=what)
    assert steps.nbytes == sum(t.numel() * t.element_size() for w in ("weights", "heads", "q", "k", "v")
                               for t in getattr(steps, w).values())


def test_the_fused_step_and_the_watched_steps_give_the_same_outputs() -> None:
    """Without a capture, single tokens take the fused native step; watched, the step-by-step
    path (the fused step never reports weights): the outputs agree within rounding."""
    layer = _layer()
    x = torch.randn(B, P + N, E)
    outs: dict[bool, list[torch.Tensor]] = {}
    for watched in (False, True):
        cache = layer.new_cache(B, P + N)
        with torch.no_grad():
            layer(x[:, :P], cache=cache)
            outs[watched] = []
            for t in range(P, P + N):
                token = x[:, t:t + 1]
                if watched:
                    with mh.heads.capture(layer) as cap:
                        outs[watched].append(layer(token, cache=cache))
                    assert cap.weights[cap.layers[0]].shape == (B, H, 1, t + 1)
                else:
                    if mh.native.available() and mh.native.vector_bits() >= 256:
                        assert decode.why_not_fused(layer, token, cache) is None  # the fused step runs
                    outs[watched].append(layer(token, cache=cache))
    for fused, stepped in zip(outs[False], outs[True]):
        torch.testing.assert_close(fused, stepped, rtol=1e-5, atol=1e-5)


def test_a_second_call_without_a_cache_is_refused_and_a_cached_one_appends() -> None:
    layer = _layer()
    x = torch.randn(1, 5, E)
    with torch.no_grad(), mh.heads.capture(layer) as cap:
        layer(x)
        with pytest.raises(ValueError, match="called twice inside one capture without a cache"):
            layer(x)
    assert cap.weights[cap.layers[0]].shape == (1, H, 5, 5)  # the first call's, intact


# ---- a Hugging Face model, patched ---------------------------------------------------------------
def _llama(impl: str = "sdpa") -> Any:
    torch.random.default_generator.manual_seed(0)
    cfg = LlamaConfig(hidden_size=E, num_attention_heads=H, num_key_value_heads=2, num_hidden_layers=2,
                      intermediate_size=128, vocab_size=100, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation(impl)
    for p in model.parameters():  # sharper attention than the initial near-uniform one
        if p.dim() == 2:
            p.data.mul_(4)
    return model


@pytest.fixture(scope="module")
def models() -> tuple[Any, Any]:
    """The eager model (the oracle) and the same weights patched from the sdpa one (HF then drops
    the purely causal mask, so the adapter's fused step can apply)."""
    return _llama("eager"), mh.hf.patch(_llama("sdpa"))


def _prompt() -> torch.Tensor:
    return torch.randint(3, 100, (1, P), generator=torch.Generator().manual_seed(1))


def _whole_capture(model: Any, ids: torch.Tensor) -> mh.heads.Capture:
    with torch.no_grad(), mh.heads.capture(model) as cap:
        model(ids, use_cache=False)
    return cap


@pytest.mark.parametrize("ours", [False, True], ids=["hf-cache", "kv-cache-adapter"])
def test_capture_inside_generate_equals_the_whole_sequence_and_changes_no_token(models: tuple[Any, Any],
                                                                              ours: bool) -> None:
    """generate on HF's DynamicCache or on mh.hf.KVCacheAdapter (which takes the fused step
    when nothing watches): captured, the same tokens, and every step's rows equal a capture of
    the whole generated sequence without a cache."""
    _, patched = models
    ids = _prompt()
    greedy: dict[str, Any] = {"max_new_tokens": N, "do_sample": False}

    def cache() -> dict[str, Any]:
        return {"cache": mh.hf.KVCacheAdapter(patched, max_len=P + N)} if ours else {}

    with torch.no_grad():
        plain_cache = cache()
        plain = patched.generate(ids, **greedy, **plain_cache)
        with mh.heads.capture(patched) as cap:
            watched_cache = cache()
            watched = patched.generate(ids, **greedy, **watched_cache)
    assert torch.equal(plain, watched)
    if ours and mh.native.available() and mh.native.vector_bits() >= 256:
        assert "fused" in plain_cache["cache"].paths  # unwatched, the fused step ran
        assert "fused" not in watched_cache["cache"].paths  # watched, never
    whole = _whole_capture(patched, watched[:, :-1])
    assert cap.layers == whole.layers == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    for name in cap.layers:
        assert cap.weights[name].shape == (1, H, P + N - 1, P + N - 1)
        torch.testing.assert_close(cap.weights[name], whole.weights[name], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(cap.heads[name], whole.heads[name], rtol=1e-5, atol=1e-5)


def test_output_attentions_inside_generate_equals_the_eager_models(models: tuple[Any, Any]) -> None:
    """``generate(..., output_attentions=True)``: each step's weights per layer, as the eager HF model's."""
    eager, patched = models
    ids = _prompt()
    kw: dict[str, Any] = {"max_new_tokens": 3, "do_sample": False, "output_attentions": True,
                          "return_dict_in_generate": True}
    with torch.no_grad():
        want = eager.generate(ids, **kw)
        got = patched.generate(ids, **kw)
        ours = patched.generate(ids, **kw, cache=mh.hf.KVCacheAdapter(patched, max_len=P + 3))
    assert torch.equal(want.sequences, got.sequences) and torch.equal(want.sequences, ours.sequences)
    for result in (got, ours):
        assert len(result.attentions) == len(want.attentions) == 3  # one entry per generated token
        for step_want, step_got in zip(want.attentions, result.attentions):
            assert len(step_got) == len(step_want) == 2  # one tensor per layer, never empty
            for w, g in zip(step_want, step_got):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_output_attentions_survives_unpatch_after_being_used_while_patched() -> None:
    """transformers installs its recording hooks once per model: first asked while patched,
    the wrappers get them; after unpatch the original modules do."""
    eager = _llama("eager")
    ids = _prompt()
    with torch.no_grad():
        want = eager(ids, output_attentions=True).attentions
        model = mh.hf.patch(_llama("eager"))  # the same seed: the same weights
        got = model(ids, output_attentions=True).attentions
        mh.hf.unpatch(model)
        back = model(ids, output_attentions=True).attentions
    assert len(got) == len(back) == len(want) == 2
    for w, g, b in zip(want, got, back):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b, w, rtol=1e-5, atol=1e-6)


def test_a_ring_cache_that_dropped_keys_refuses_to_append_rows_it_cannot_align() -> None:
    """A sliding-window layer decoding through a ring cache holds only the last keys: once a
    call's keys no longer cover every earlier token, its row cannot be placed by key position,
    so the capture refuses it by name (never a misaligned matrix)."""
    torch.random.default_generator.manual_seed(0)
    layer = mh.MultiHeadAttention(E, H, causal=True, window=3, rope=mh.RoPE(E // H)).eval()
    cache = layer.new_cache(1, 16, ring=True)
    x = torch.randn(1, 8, E)
    with torch.no_grad(), mh.heads.capture(layer) as cap:
        layer(x[:, :2], cache=cache)
        layer(x[:, 2:3], cache=cache)  # 3 keys, 3 tokens: still every one
        with pytest.raises(ValueError, match="no longer holds every earlier token"):
            layer(x[:, 3:4], cache=cache)
    assert cap.weights[cap.layers[0]].shape == (1, H, 3, 3)  # the rows that could be placed


def test_capture_records_the_normed_keys_of_a_layer_without_rope() -> None:
    """QK-norm and no RoPE (EXAONE 4's global layers): q and k as attention read them, after the
    norm, the same with and without a cache (they were the keys before the norm without one)."""
    import multihead as mh

    torch.random.default_generator.manual_seed(0)
    layer = mh.MultiHeadAttention(32, 4, qk_norm="head", causal=True).eval()
    with torch.no_grad():
        layer.k_norm.weight.mul_(3.0)  # a norm that changes the keys visibly
        layer.q_norm.weight.mul_(0.5)
    x = torch.randn(1, 6, 32)
    with mh.heads.capture(layer, what=("q", "k")) as whole, torch.no_grad():
        layer(x)
    q, k = layer.split(*layer.project(x))[:2]
    torch.testing.assert_close(whole.k[""], k)  # normed (B, Hkv, S, D)
    torch.testing.assert_close(whole.q[""], q)
    cache = layer.new_cache(batch_size=1, max_len=8)
    with mh.heads.capture(layer, what=("k",)) as stepwise, torch.no_grad():
        for t in range(6):
            layer(x[:, t:t + 1], cache=cache)
    torch.testing.assert_close(stepwise.k[""][:, :, :6], k, atol=1e-6, rtol=1e-5)
