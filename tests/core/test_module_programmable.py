"""The layer takes programmable attention: ``layer(x, mask_mod=, block_mask=, bias=, score_mod=)``.

Notation: B batch, S tokens (queries), Sk keys, E embed_dim, H query heads, Hkv key/value heads,
D head_dim.

Oracles: the layer's own steps (project, split, RoPE, o_proj) around attention written out in
float64 (:func:`written_out`: scores, the bias or score function, the allowed pairs, softmax),
and the layer with the equivalent dense ``mask=`` on the float64 ``"explicit"`` backend; a full
pass for decoding through the KV cache (each decoded row must equal the full pass's row).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import multihead as mh
from multihead import decode
from multihead import score_mods as sm
from multihead.mask_mods import prefix_lm_mask_mod

B, S, E, H, HKV = 2, 11, 32, 4, 2
Allowed = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
ScoreFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def layer_of(*, causal: bool = True, rope: bool = True, dtype: torch.dtype = torch.float64,
             backend: str | None = None, kdim: int | None = None, seed: int = 0) -> mh.MultiHeadAttention:
    torch.random.default_generator.manual_seed(seed)
    return mh.MultiHeadAttention(E, H, num_kv_heads=HKV, causal=causal, kdim=kdim, backend=backend, dtype=dtype,
                                 rope=mh.RoPE(E // H, max_positions=128) if rope else None).eval()


def inputs(s: int = S, *, b: int = B, width: int = E, dtype: torch.dtype = torch.float64, seed: int = 1
           ) -> torch.Tensor:
    return torch.randn(b, s, width, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def indices(b: int, h: int, sq: int, sk: int) -> tuple[torch.Tensor, ...]:
    """b (B,1,1,1), h (1,H,1,1), q_idx (1,1,Sq,1) bottom-right aligned (i + Sk - Sq), kv_idx (1,1,1,Sk)."""
    return (torch.arange(b).view(b, 1, 1, 1), torch.arange(h).view(1, h, 1, 1),
            (torch.arange(sq) + sk - sq).view(1, 1, sq, 1), torch.arange(sk).view(1, 1, 1, sk))


def written_out(layer: mh.MultiHeadAttention, x: torch.Tensor, context: torch.Tensor | None = None, *,
                allowed: Allowed | None = None, bias: torch.Tensor | None = None,
                score_fn: ScoreFn | None = None, positions: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(y (B, S, E), weights (B, H, S, Sk)) with attention written out in float64: the layer's
    steps around softmax(scale · q kᵀ + bias, then score_fn) over the pairs ``allowed`` and the
    layer's causal rule allows (a row with none: zeros); RoPE at ``positions`` (default 0 .. S-1)."""
    q, k, v = layer.split(*layer.project(x, context))
    q, k = layer.rotate(q, k, positions)
    q, k, v = q.double(), k.double(), v.double()
    g = H // HKV
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # (B, H, Sk, D)
    b, _, sq, _ = q.shape
    sk = k.shape[2]
    bi, hi, qi, ki = indices(b, H, sq, sk)
    scores = q @ k.transpose(-1, -2) * layer.scale  # (B, H, Sq, Sk)
    if bias is not None:
        scores = scores + bias.double()
    if score_fn is not None:
        scores = score_fn(scores, bi, hi, qi, ki)
    ok = torch.ones(b, H, sq, sk, dtype=torch.bool)
    if layer.causal:
        ok = ok & (ki <= qi)
    if allowed is not None:
        ok = ok & allowed(bi, hi, qi, ki)
    weights = torch.softmax(scores.masked_fill(~ok, -torch.inf), dim=-1).nan_to_num(0.0)  # empty rows: zeros
    y = layer.output((weights @ v).to(x.dtype))
    return y, weights


def dense(mask_mod: Allowed, b: int, sq: int, sk: int) -> torch.Tensor:
    """mask_mod's (B, H, Sq, Sk) bool mask at the bottom-right aligned indices."""
    return mask_mod(*indices(b, H, sq, sk)).expand(b, H, sq, sk)


def random_table(b: int, sq: int, sk: int, *, empty_row: int | None = None, seed: int = 5) -> torch.Tensor:
    """A per-batch, per-head random (B, H, Sq, Sk) pattern, query row ``empty_row`` of batch 0 all False."""
    table = torch.rand(b, H, sq, sk, generator=torch.Generator().manual_seed(seed)) < 0.6
    if empty_row is not None:
        table[0, :, empty_row] = False
    return table


def table_mask_mod(table: torch.Tensor) -> Allowed:
    """The pattern ``table`` (indexed by row, so only for Sq == Sk or the call it was drawn for)."""
    sq, sk = table.shape[-2:]
    return lambda b, h, q_idx, kv_idx: table[b, h, q_idx - (sk - sq), kv_idx]


def close(got: torch.Tensor, want: torch.Tensor, atol: float = 1e-10) -> None:
    torch.testing.assert_close(got.double(), want.double(), atol=atol, rtol=0.0)


# -- each keyword against the dense mask / the written-out scores ---------------------------------------------


@pytest.mark.parametrize("backend", [None, "explicit", "sdpa"])
def test_mask_mod_is_the_dense_mask(backend: str | None) -> None:
    """A per-batch, per-head mask_mod with a fully masked row equals mask= of its dense form, on the
    float64 reference; the masked row gives zeros from attention (y = o_proj's bias there)."""
    layer, x = layer_of(backend=backend), inputs()
    table = random_table(B, S, S, empty_row=3)
    got = layer(x, mask_mod=table_mask_mod(table))
    reference = layer_of(backend="explicit")
    want = reference(x, mask=table)
    close(got, want)
    close(got[0, 3], layer.o_proj.bias.expand(E))


def test_mask_mod_weights_are_the_written_out_softmax() -> None:
    layer, x = layer_of(causal=False), inputs()
    mod = prefix_lm_mask_mod(4)
    y, weights = layer(x, mask_mod=mod, return_weights=True)
    want_y, want_w = written_out(layer, x, allowed=mod)
    close(y, want_y)
    close(weights, want_w)


@pytest.mark.parametrize("backend", [None, "explicit"])
def test_block_mask_is_its_dense_form(backend: str | None) -> None:
    layer, x = layer_of(causal=False, backend=backend), inputs(40)
    mod = table_mask_mod(random_table(B, 40, 40))
    block = mh.BlockMask.from_mask_mod(mod, B, H, 40, 40, block_size=(16, 32))
    close(layer(x, block_mask=block), layer_of(causal=False, backend="explicit")(x, mask=block.dense()))


@pytest.mark.parametrize("backend", ["native", None])
def test_a_float32_layer_on_the_native_tiles_equals_the_float64_reference(backend: str | None) -> None:
    """The native kernel takes the block mask as tiles (empty ones skipped): the same rows as float64."""
    layer, x = layer_of(backend=backend, dtype=torch.float32), inputs(70, dtype=torch.float32)
    mod = table_mask_mod(random_table(B, 70, 70, empty_row=9))
    block = mh.BlockMask.from_mask_mod(sliding(20), 1, 1, 70, 70, block_size=(16, 32))
    with torch.no_grad():
        got = layer(x, mask_mod=mod, block_mask=block)
    reference = layer_of(dtype=torch.float64)
    reference.load_state_dict(layer.state_dict())
    both = lambda b, h, q, kv: mod(b, h, q, kv) & sliding(20)(b, h, q, kv)  # noqa: E731
    want, _ = written_out(reference, x.double(), allowed=both)
    close(got, want, atol=1e-5)


def test_block_mask_and_mask_mod_and_mask_combine_by_and() -> None:
    layer, x = layer_of(causal=False), inputs()
    window = lambda b, h, q, kv: (q - kv).abs() < 4  # noqa: E731
    prefix = prefix_lm_mask_mod(5)
    block = mh.BlockMask.from_mask_mod(prefix, 1, 1, S, S, block_size=(16, 32))
    keep = torch.rand(B, 1, S, S, generator=torch.Generator().manual_seed(2)) < 0.8
    got = layer(x, mask=keep, mask_mod=window, block_mask=block)
    want, _ = written_out(layer, x, allowed=lambda b, h, q, kv: window(b, h, q, kv) & prefix(b, h, q, kv)
                          & keep[b, 0, q, kv])
    close(got, want)


@pytest.mark.parametrize("backend", [None, "explicit", "sdpa"])
@pytest.mark.parametrize("shape", [(B, H, S, S), (1, H, S, S), (B, 1, 1, S), (S, S)])
def test_bias_is_added_to_the_scaled_scores(backend: str | None, shape: tuple[int, ...]) -> None:
    layer, x = layer_of(backend=backend), inputs()
    bias = torch.randn(shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    want, _ = written_out(layer, x, bias=bias)
    close(layer(x, bias=bias), want)


def test_score_mod_is_the_written_out_score_function() -> None:
    """An arbitrary Python score_mod (per head, by distance) on the explicit path."""
    layer, x = layer_of(), inputs()
    slopes = torch.tensor([0.5, -0.25, 1.0, 0.125], dtype=torch.float64)

    def by_distance(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                    kv_idx: torch.Tensor) -> torch.Tensor:
        return torch.tanh(score) * 3 + slopes[h] * (q_idx - kv_idx) + 0.1 * b

    want, _ = written_out(layer, x, score_fn=by_distance)
    close(layer(x, score_mod=by_distance), want)


def test_relative_bias_building_block_is_the_gathered_table() -> None:
    """T5's relative bias as a score_mod (lowered to an additive bias for the fast paths)."""
    layer, x = layer_of(causal=False, rope=False), inputs()
    table = torch.randn(H, 8, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    buckets = sm.t5_buckets(8, 20, bidirectional=True)
    _, _, qi, ki = indices(B, H, S, S)
    want, _ = written_out(layer, x, bias=table[:, buckets(qi[0, 0], ki[0, 0])][None])
    close(layer(x, score_mod=sm.relative_bias(table, buckets)), want)


def test_layer_features_apply_before_the_bias_and_the_score_mod() -> None:
    """Soft-capping (a layer feature) applies to the scores first, then the bias, then the score_mod."""
    torch.random.default_generator.manual_seed(0)
    layer = mh.MultiHeadAttention(E, H, num_kv_heads=HKV, causal=True, softcap=2.0, dtype=torch.float64).eval()
    x = inputs()
    bias = torch.randn(1, H, S, S, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    twice = lambda score, b, h, q, kv: score * 2  # noqa: E731
    want, _ = written_out(layer, x, score_fn=lambda s, b, h, q, kv: (2.0 * torch.tanh(s / 2.0) + bias) * 2)
    close(layer(x, bias=bias, score_mod=twice), want)


def test_cross_attention_takes_each_keyword_at_bottom_right_positions() -> None:
    """Cross-attention (S queries, Sk = 7 context keys): q_idx = i + Sk - S, bias (B, 1, S, Sk)."""
    layer = layer_of(causal=False, rope=False, kdim=24)
    x, context = inputs(5), inputs(7, width=24, seed=2)
    mod = lambda b, h, q, kv: (kv <= q + 1) | (b == 1)  # noqa: E731
    bias = torch.randn(B, 1, 5, 7, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    want, _ = written_out(layer, x, context, allowed=mod, bias=bias)
    close(layer(x, context, mask_mod=mod, bias=bias), want)
    block = mh.BlockMask.from_mask_mod(mod, B, 1, 5, 7, block_size=(16, 32))
    close(layer(x, context, block_mask=block, bias=bias), want)


def test_packed_sequences_and_a_mask_mod_combine_by_and() -> None:
    """packed=True (two sequences per row, positions restarting) with a mask_mod over the row's tokens."""
    layer, x = layer_of(), inputs()
    positions = torch.cat((torch.arange(5), torch.arange(S - 5)))  # (S,): sequences [0, 5) and [5, S)
    segment = (torch.arange(S) >= 5).long()
    mod = lambda b, h, q, kv: (q - kv) % 2 == 0  # noqa: E731
    want, _ = written_out(layer, x, positions=positions,
                          allowed=lambda b, h, q, kv: mod(b, h, q, kv) & (segment[q] == segment[kv]))
    close(layer(x, positions=positions, packed=True, mask_mod=mod), want)


def test_a_seq_first_layer_takes_batch_first_bias_and_masks() -> None:
    """batch_first=False changes x and y only: bias and block masks stay (B, H, S, Sk), as mask= does."""
    layer, x = layer_of(), inputs()
    seq_first = mh.MultiHeadAttention(E, H, num_kv_heads=HKV, causal=True, rope=mh.RoPE(E // H, max_positions=128),
                                      batch_first=False, dtype=torch.float64).eval()
    seq_first.load_state_dict(layer.state_dict())
    bias = torch.randn(B, 1, S, S, generator=torch.Generator().manual_seed(13), dtype=torch.float64)
    want, _ = written_out(layer, x, bias=bias, allowed=sliding(5))
    close(seq_first(x.transpose(0, 1), bias=bias, mask_mod=sliding(5)).transpose(0, 1), want)


def test_trace_passes_the_keywords_to_the_layer() -> None:
    layer, x = layer_of(), inputs()
    bias = torch.randn(1, H, S, S, generator=torch.Generator().manual_seed(14), dtype=torch.float64)
    traced = mh.trace(layer, x, bias=bias, score_mod=sm.tanh, mask_mod=sliding(4),
                      block_mask=mh.BlockMask.from_mask_mod(prefix_lm_mask_mod(3), 1, 1, S, S))
    want, _ = written_out(layer, x, bias=bias, score_fn=lambda s, b, h, q, kv: torch.tanh(s),
                          allowed=lambda b, h, q, kv: sliding(4)(b, h, q, kv) & prefix_lm_mask_mod(3)(b, h, q, kv))
    close(traced.output, want)


# -- decoding through the cache equals the full pass ----------------------------------------------------------


def decoded(layer: mh.MultiHeadAttention, x: torch.Tensor, chunks: list[int],
            **per_call: Callable[[int, int], dict[str, object]]) -> torch.Tensor:
    """The layer through a cache, x (B, S, E) fed in ``chunks`` of tokens; ``per_call["kwargs"](start, end)``
    gives each call's keywords. Returns the rows (B, S, E)."""
    make = per_call.get("kwargs", lambda start, end: {})
    cache = layer.new_cache(x.shape[0], x.shape[1])
    rows, start = [], 0
    with torch.no_grad():
        for n in chunks:
            rows.append(layer(x[:, start:start + n], cache=cache, **make(start, start + n)))
            start += n
    assert start == x.shape[1]
    return torch.cat(rows, dim=1)


def sliding(window: int) -> Allowed:
    return lambda b, h, q, kv: (kv <= q) & (q - kv < window)


@pytest.mark.parametrize("chunks", [[1] * S, [4, 1, 3, 1, 1, 1]])
def test_decoding_with_a_sliding_window_mask_mod_is_the_full_pass(chunks: list[int]) -> None:
    """A sliding window written as a mask_mod on a bidirectional layer: token by token (and chunked
    prefill) each query sees the keys at its cache position's window, as in the full pass."""
    layer, x = layer_of(causal=False), inputs()
    full = layer(x, mask_mod=sliding(3))
    close(decoded(layer, x, chunks, kwargs=lambda start, end: {"mask_mod": sliding(3)}), full)
    close(full, written_out(layer, x, allowed=sliding(3))[0])


def test_decoding_with_a_prefix_lm_mask_mod_is_the_full_pass() -> None:
    """PaliGemma's prefix-LM: the 5-token prefix in one call (it sees itself bidirectionally), then
    one token at a time."""
    layer, x = layer_of(causal=False), inputs()
    mod = prefix_lm_mask_mod(5)
    full = layer(x, mask_mod=mod)
    close(decoded(layer, x, [5] + [1] * (S - 5), kwargs=lambda start, end: {"mask_mod": mod}), full)


def test_decoding_with_block_masks_built_for_each_call_is_the_full_pass() -> None:
    layer, x = layer_of(causal=False), inputs()
    mod = sliding(4)
    full = layer(x, block_mask=mh.BlockMask.from_mask_mod(mod, 1, 1, S, S, block_size=(16, 32)))
    per_call = lambda start, end: {"block_mask": mh.BlockMask.from_mask_mod(mod, 1, 1, end - start, end,  # noqa: E731
                                                                            block_size=(16, 32))}
    close(decoded(layer, x, [3, 1, 2] + [1] * (S - 6), kwargs=per_call), full)


def test_decoding_with_a_score_mod_and_a_bias_is_the_full_pass() -> None:
    """A distance score_mod (q_idx - kv_idx at cache positions) and the rows of a full bias."""
    layer, x = layer_of(), inputs()
    slopes = torch.tensor([0.5, -0.25, 1.0, 0.125], dtype=torch.float64)
    mod = lambda score, b, h, q, kv: score - slopes[h] * (q - kv)  # noqa: E731
    bias = torch.randn(B, H, S, S, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    full = layer(x, score_mod=mod, bias=bias)
    per_call = lambda start, end: {"score_mod": mod, "bias": bias[:, :, start:end, :end]}  # noqa: E731
    close(decoded(layer, x, [2] + [1] * (S - 2), kwargs=per_call), full)
    close(full, written_out(layer, x, bias=bias, score_fn=mod)[0])


def test_a_fused_decoding_layer_routes_a_mask_mod_to_the_composed_steps() -> None:
    """A float32 layer whose plain decoding step may run fused: with a mask_mod the fused step is not
    taken (its reason names the keywords) and the mask_mod is applied, as the float64 reference."""
    layer, x = layer_of(dtype=torch.float32), inputs(dtype=torch.float32)
    mod = lambda b, h, q, kv: kv != 1  # noqa: E731  key 1 hidden from every query
    cache = layer.new_cache(B, S)
    reason = decode.why_not_fused(layer, x[:, :1], cache, mask_mod=mod)
    assert reason is not None and "mask_mod" in reason
    got = decoded(layer, x, [3] + [1] * (S - 3), kwargs=lambda start, end: {"mask_mod": mod})
    reference = layer_of(dtype=torch.float64)
    reference.load_state_dict(layer.state_dict())  # the same weights, in float64
    want, _ = written_out(reference, x.double(), allowed=mod)
    close(got, want, atol=1e-5)
    assert (got[:, 3:] - decoded(layer, x, [3] + [1] * (S - 3))[:, 3:]).abs().max() > 1e-3  # the mask_mod acted


# -- gradients ------------------------------------------------------------------------------------------------


def core_attention(layer: mh.MultiHeadAttention, x: torch.Tensor, **keywords: object) -> torch.Tensor:
    """The layer's steps around mh.attention itself (the gradients' oracle)."""
    q, k, v = layer.split(*layer.project(x))
    q, k = layer.rotate(q, k)
    heads = mh.attention(q, k, v, causal=layer.causal, scale=layer.scale, **keywords)  # type: ignore[call-overload]
    return layer.output(heads)


def test_a_learned_bias_table_gets_the_gradient_it_gets_through_attention() -> None:
    layer, x = layer_of(causal=False, rope=False), inputs()
    weight = torch.randn(B, S, E, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    grads = []
    for run in (lambda t, b: layer(x, score_mod=sm.relative_bias(t, sm.t5_buckets(8, 20)), bias=b),
                lambda t, b: core_attention(layer, x, score_mod=sm.relative_bias(t, sm.t5_buckets(8, 20)), bias=b)):
        table = torch.linspace(-1, 1, H * 8, dtype=torch.float64).view(H, 8).requires_grad_()
        bias = torch.zeros(1, H, S, S, dtype=torch.float64, requires_grad=True)
        (run(table, bias) * weight).sum().backward()
        grads.append((table.grad, bias.grad, layer.q_proj.weight.grad.clone()))
        layer.zero_grad()
    for got, want in zip(*grads):
        assert got is not None and want is not None and got.abs().max() > 0
        close(got, want, atol=1e-12)


def test_a_table_captured_by_a_python_score_mod_gets_its_gradient() -> None:
    """A Python score_mod reading a learned (H, S, S) table: its gradient equals the dense bias's."""
    layer, x = layer_of(), inputs()
    weight = torch.randn(B, S, E, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    table = torch.randn(H, S, S, dtype=torch.float64, generator=torch.Generator().manual_seed(11)).requires_grad_()
    (layer(x, score_mod=lambda s, b, h, q, kv: s + table[h, q, kv]) * weight).sum().backward()
    assert table.grad is not None
    via_mod = table.grad.clone()
    table.grad = None
    (core_attention(layer, x, bias=table[None]) * weight).sum().backward()
    close(via_mod, table.grad)


# -- refusals and watchers ------------------------------------------------------------------------------------


def test_a_block_mask_not_built_for_the_cache_length_after_the_write_is_refused() -> None:
    layer, x = layer_of(causal=False), inputs()
    cache = layer.new_cache(B, S)
    with torch.no_grad():
        layer(x[:, :4], cache=cache)
        k_before = cache.k.clone()
        stale = mh.BlockMask.from_mask_mod(sliding(3), 1, 1, 1, 4)  # (Sq, Sk) before the write
        with pytest.raises(ValueError, match=r"block_mask must be built for \(B, H, Sq, Sk\) = \(2, 4, 1, 5\).*"
                                             r"got \(1, 1, 1, 4\)"):
            layer(x[:, 4:5], cache=cache, block_mask=stale)
        with pytest.raises(ValueError, match=r"bias must be broadcastable to \[B, H, Sq, Sk\] = \[2, 4, 1, 5\]"):
            layer(x[:, 4:5], cache=cache, bias=torch.zeros(1, H, 1, 4, dtype=torch.float64))
    assert cache.host_lengths() == [4, 4] and torch.equal(cache.k, k_before)  # nothing was written


@pytest.mark.parametrize("keyword", ["mask_mod", "block_mask", "bias", "score_mod"])
def test_a_cache_whose_keys_are_not_positions_is_refused_by_name(keyword: str) -> None:
    layer, x = layer_of(causal=False), inputs()
    value = {"mask_mod": sliding(3), "block_mask": mh.BlockMask.from_mask_mod(sliding(3), 1, 1, 4, 4),
             "bias": torch.zeros(1, 1, 4, 4, dtype=torch.float64),
             "score_mod": lambda s, b, h, q, kv: s}[keyword]
    cache = layer.new_cache(B, S)
    padded = torch.tensor([[True] * 4, [True, True, False, False]])
    with torch.no_grad(), pytest.raises(ValueError, match=rf"^{keyword} with a cache .*key_mask padding"):
        layer(x[:, :4], cache=cache, key_mask=padded, **{keyword: value})
    assert cache.host_lengths() == [0, 0]


def test_a_wrapping_ring_cache_is_refused_by_name() -> None:
    torch.random.default_generator.manual_seed(0)
    layer = mh.MultiHeadAttention(E, H, causal=True, window=4, dtype=torch.float64).eval()
    x = inputs()
    cache = layer.new_cache(B, S, ring=True)
    with torch.no_grad():
        layer(x[:, :4], cache=cache, mask_mod=sliding(4))  # fills the ring: its slots are still positions
        with pytest.raises(ValueError, match=r"^mask_mod with a cache .*a ring cache that wraps"):
            layer(x[:, 4:5], cache=cache, mask_mod=sliding(4))
    assert cache.host_lengths() == [4, 4]


def test_a_backend_without_the_capability_refuses_by_name() -> None:
    layer, x = layer_of(backend="native", dtype=torch.float32), inputs(dtype=torch.float32)
    with pytest.raises(ValueError, match=r"backend 'native' cannot do .*score_mod"):
        layer(x, score_mod=lambda s, b, h, q, kv: s * 2)


def test_capture_records_the_weights_the_bias_and_mask_mod_gave() -> None:
    """mh.heads.capture takes its weights from the attend step: the programmable keywords applied."""
    layer, x = layer_of(), inputs()
    bias = torch.randn(1, H, S, S, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    mod = prefix_lm_mask_mod(3)
    with torch.no_grad(), mh.heads.capture(layer) as cap:
        y = layer(x, bias=bias, mask_mod=mod)
    want_y, want_w = written_out(layer, x, allowed=mod, bias=bias)
    close(y, want_y)
    close(cap.weights[cap.layers[0]], want_w)
