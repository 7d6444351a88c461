"""mh.heads.capture: what it records equals Hugging Face's own weights, changes nothing, refuses early."""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from heads_helpers import minilm


def test_captured_weights_equal_hf_eager_attentions_on_a_padded_batch() -> None:
    # float64, so that the per-layer comparison is not blurred by float32 drift accumulated
    # over earlier layers (in float32 the largest difference is 1.2e-5 after 5 layers).
    import copy

    model, patched, batch, _ = minilm()
    model, patched = copy.deepcopy(model).double(), copy.deepcopy(patched).double()
    assert not bool(batch["attention_mask"].all())  # the batch is padded
    with torch.no_grad():
        ref = model(**batch, output_attentions=True)
        with mh.heads.capture(patched) as cap:
            patched(**batch)
    assert cap.layers == [f"encoder.layer.{i}.attention" for i in range(6)]
    for i, name in enumerate(cap.layers):
        s = batch["input_ids"].shape[1]
        assert cap.weights[name].shape == ref.attentions[i].shape == (3, 12, s, s)
        torch.testing.assert_close(cap.weights[name], ref.attentions[i], rtol=0, atol=1e-5)
        assert float((cap.weights[name] - ref.attentions[i]).abs().max()) < 1e-10


def test_captured_heads_through_o_proj_give_the_layer_output() -> None:
    _, patched, batch, _ = minilm()
    outputs = {}
    layers = dict(mh.heads.find_layers(patched))
    hooks = [m.register_forward_hook(lambda mod, a, y, n=n: outputs.__setitem__(n, y)) for n, m in layers.items()]
    try:
        with torch.no_grad(), mh.heads.capture(patched) as cap:
            patched(**batch)
    finally:
        for h in hooks:
            h.remove()
    for name in cap.layers:
        layer = layers[name]
        y = layer.o_proj(mh.merge_heads(cap.heads[name]))  # (B, S, E)
        torch.testing.assert_close(y, outputs[name], rtol=1e-5, atol=1e-5)  # GEMM rounding only


def test_capturing_changes_no_output_and_the_tap_is_gone_after_the_block() -> None:
    _, patched, batch, _ = minilm()
    with torch.no_grad():
        before = patched(**batch).last_hidden_state
        with mh.heads.capture(patched, what=("weights", "heads", "q", "k", "v")):
            during = patched(**batch).last_hidden_state
    real = batch["attention_mask"].bool()  # padding positions carry no meaning
    torch.testing.assert_close(during[real], before[real], rtol=0, atol=1e-5)
    assert all("_heads_tap" not in m.__dict__ for _, m in mh.heads.find_layers(patched))


def test_q_and_k_are_recorded_after_rope_and_only_the_heads_asked_for() -> None:
    layer = mh.MultiHeadAttention(32, 4, num_kv_heads=2, causal=True, rope=mh.RoPE(8))
    x = torch.randn(2, 5, 32)
    with torch.no_grad(), mh.heads.capture(layer, what=("weights", "q", "k"), heads=[1, 3]) as cap:
        layer(x)
    q = layer.rope(mh.split_heads(layer.q_proj(x), 4), torch.arange(5))
    k = layer.rope(mh.split_heads(layer.k_proj(x), 2), torch.arange(5))
    torch.testing.assert_close(cap.q[""], q[:, [1, 3]].detach())
    torch.testing.assert_close(cap.k[""], k.detach())  # all K/V heads
    _, w = layer(x, return_weights=True)
    torch.testing.assert_close(cap.weights[""], w[:, [1, 3]].detach())
    assert cap.heads == {}  # not asked for


def test_capture_of_some_layers_by_index_or_name() -> None:
    _, patched, batch, _ = minilm()
    layers = [5, "encoder.layer.1.attention"]
    with torch.no_grad(), mh.heads.capture(patched, layers=layers, dtype=torch.float16) as cap:
        patched(**batch)
    assert cap.layers == ["encoder.layer.1.attention", "encoder.layer.5.attention"]
    assert cap.weights["encoder.layer.5.attention"].dtype == torch.float16


def test_a_capture_over_the_limit_is_refused_before_the_layer_attends() -> None:
    layer = mh.MultiHeadAttention(16, 2)
    calls = []
    layer.o_proj.register_forward_hook(lambda *a: calls.append(1))
    with mh.heads.capture(layer, limit_bytes=1000) as cap:
        # kept: weights 2·8·8 + heads 2·8·8 (D = 8) = 256 floats = 1,024 bytes; workspace 3 · 2·8·8 floats
        with pytest.raises(ValueError, match=r"layer '' would need 2,560 bytes.*1,024 kept \+ 1,536 while.*"
                                             r"limit_bytes=1,000"):
            layer(torch.randn(1, 8, 16))
    assert calls == [] and cap.nbytes == 0


@pytest.mark.parametrize("make, match", [
    (lambda m: mh.heads.capture(m), "not patched"),
])
def test_capture_of_an_unpatched_hf_model_is_refused(make, match) -> None:
    model, _, _, _ = minilm()
    with pytest.raises(ValueError, match=match):
        make(model)


def test_capture_names_a_missing_layer_and_heads_out_of_range() -> None:
    _, patched, _, _ = minilm()
    with pytest.raises(ValueError, match="no attention layer named 'encoder.layer.9.attention'"):
        mh.heads.capture(patched, layers=["encoder.layer.9.attention"])
    with pytest.raises(ValueError, match=r"layer index must be in \[0, 5\], got 6"):
        mh.heads.capture(patched, layers=[6])
    with pytest.raises(ValueError, match=r"head index must be in \[0, 11\], got 12"):
        mh.heads.capture(patched, heads=[12])
    with pytest.raises(ValueError, match="what must be"):
        mh.heads.capture(patched, what=("pattern",))


def test_a_layer_with_a_backend_without_weights_is_refused() -> None:
    layer = mh.MultiHeadAttention(16, 2, backend="sdpa")
    with pytest.raises(ValueError, match="returns no weights"):
        mh.heads.capture(layer)
