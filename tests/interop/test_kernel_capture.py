"""``mh.heads.capture`` on ``mh.hf.patch``'s kernel route: HF's module, multihead's kernel, recorded.

Notation: B batch, H query heads, Hkv key/value heads, S tokens, Sk keys, D head_dim.

The oracle is Hugging Face's eager model with ``output_attentions=True``: the weights captured on
the kernel route equal its attentions on the real query rows (relative to 1e-5 absolute) of a
right- and a left-padded batch, for a model with GQA (BitNet) and one with a sliding window
(Ministral 3, window 6 < S = 9). A step-by-step decode through HF's cache captures the full
pass's rows; a model with both routes (GPT-2 with cross-attention) captures all its layers; the
metrics of a kernel-route capture are those of eager's attentions. Planted mistakes (weights
recorded before the mask, a module that claims no causality over a causal mask) must fail.

Runtime: about 10 s on 2 shared cores.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import multihead as mh
from multihead.heads.capture import Capture, LayerInfo
from multihead.interop.hf_kernel import WATCH_ATTR

pytest.importorskip("transformers")

from test_kernel_zoo import _eager, gpt2_with_cross_attention  # noqa: E402
from test_zoo import _inputs  # noqa: E402

ATOL = 1e-5
capture_module = importlib.import_module("multihead.heads.capture")  # the module (the package's name is the class)
#: What each captured model's layers are, as the kernel call shows them (H, Hkv, D, causal, window).
FACTS = {"bitnet": (4, 2, 16, True, None), "ministral3": (4, 2, 128, True, 6)}  # Ministral 3's own head_dim


def _watchers(model: nn.Module) -> list[str]:
    """Modules still holding a capture's watcher."""
    return [n for n, m in model.named_modules() if WATCH_ATTR in m.__dict__]


def _eager_and_patched(model_type: str) -> tuple[nn.Module, list[dict[str, torch.Tensor]], list[Any]]:
    """The tiny model patched (every module on the kernel route), its right- and left-padded batches,
    and eager's attentions for each, taken before patching."""
    model = _eager(model_type)
    batches = [_inputs(model_type, side) for side in ("right", "left")]
    with torch.no_grad():
        wants = [model(**inputs, output_attentions=True).attentions for inputs in batches]
    assert {r.route for r in mh.hf.patch(model, report=True)} == {"kernel"}
    return model, batches, wants


def _worst(cap: Capture, want: Any, mask: torch.Tensor) -> float:
    """The largest difference between the captured weights and eager's, on real query rows."""
    real = mask.bool()  # (B, S)
    assert len(cap.layers) == len(want)
    return max((cap.weights[n].transpose(1, 2)[real] - w.transpose(1, 2)[real]).abs().max().item()
               for n, w in zip(cap.layers, want))


@pytest.mark.parametrize("model_type", list(FACTS))
def test_capture_on_the_kernel_route_equals_eager_attentions(model_type: str) -> None:
    model, batches, wants = _eager_and_patched(model_type)
    names = [f"model.layers.{i}.self_attn" for i in range(2)]
    for inputs, want in zip(batches, wants):
        with torch.no_grad(), mh.heads.capture(model) as cap:
            got = model(**inputs, output_attentions=True).attentions
        assert cap.layers == names and _watchers(model) == []
        assert _worst(cap, want, inputs["attention_mask"]) <= ATOL
        for g, w in zip(got, want):  # output_attentions inside the capture: the kernel's weights too
            real = inputs["attention_mask"].bool()
            assert torch.allclose(g.transpose(1, 2)[real], w.transpose(1, 2)[real], atol=1e-6)
        h, hkv, d, causal, window = FACTS[model_type]
        assert cap.info[names[1]] == LayerInfo(names[1], h, hkv, d, causal, window, tuple(range(h)))
        assert cap.heads[names[0]].shape == (2, h, 9, d)


def test_captured_q_k_v_are_what_the_kernel_attended() -> None:
    """q and k after RoPE, v and the per-head outputs: softmax(q kᵀ/√D) over the allowed keys is the
    weights, the weights times v (query head h reads K/V head h // 2) the heads; a subset of heads."""
    model, batches, _ = _eager_and_patched("bitnet")
    inputs = batches[1]  # left-padded
    with torch.no_grad(), mh.heads.capture(model, ("weights", "heads", "q", "k", "v"), heads=[1, 3]) as cap:
        model(**inputs)
    name = "model.layers.1.self_attn"
    q, k, v, a = cap.q[name].double(), cap.k[name].double(), cap.v[name].double(), cap.weights[name].double()
    k, v = k[:, [0, 1]], v[:, [0, 1]]  # (B, 2, S, D): the K/V heads of query heads 1 and 3
    real = inputs["attention_mask"].bool()  # (B, S)
    allowed = torch.ones(9, 9, dtype=torch.bool).tril() & real[:, None, None, :]  # (B, 1, S, S)
    scores = (q @ k.transpose(-1, -2) / 16 ** 0.5).masked_fill(~allowed, float("-inf"))
    rows = real[:, :, None].expand(2, 9, 2)  # (B, S, H'): real queries
    assert torch.allclose(scores.softmax(-1).transpose(1, 2)[rows], a.transpose(1, 2)[rows], atol=ATOL)
    assert torch.allclose((a @ v).transpose(1, 2)[rows], cap.heads[name].double().transpose(1, 2)[rows], atol=ATOL)
    assert cap.info[name].heads == (1, 3) and cap.k[name].shape == (2, 2, 9, 16)


def test_planted_weights_recorded_before_the_mask_fail_the_comparison(monkeypatch: pytest.MonkeyPatch) -> None:
    """A planted mistake: the recorder keeps softmax(q kᵀ/√D) over every key (no mask). The comparison
    with eager's attentions must see it."""
    model, batches, wants = _eager_and_patched("bitnet")
    after = capture_module._KernelRecorder.after

    def unmasked(self: Any, call: Any, out: torch.Tensor, weights: torch.Tensor | None) -> None:
        k = call.key.repeat_interleave(call.query.shape[1] // call.key.shape[1], dim=1)  # (B, H, Sk, D)
        after(self, call, out, (call.query @ k.transpose(-1, -2) / call.query.shape[-1] ** 0.5).softmax(-1))

    monkeypatch.setattr(capture_module._KernelRecorder, "after", unmasked)
    with torch.no_grad(), mh.heads.capture(model) as cap:
        model(**batches[0])
    assert _worst(cap, wants[0], batches[0]["attention_mask"]) > 0.01


def test_capture_through_a_cached_decode_equals_the_full_pass() -> None:
    """Prefill 6 tokens, then 3 single-token steps through HF's DynamicCache on a left-padded batch:
    the rows (weights zero-padded to the last key count), q, heads, and the cache's k and v equal the
    capture of one pass over the 9 tokens."""
    from transformers import DynamicCache

    model, batches, _ = _eager_and_patched("bitnet")
    ids, mask = batches[1]["input_ids"], batches[1]["attention_mask"]
    what = ("weights", "heads", "q", "k", "v")
    with torch.no_grad():
        with mh.heads.capture(model, what) as whole:
            model(input_ids=ids, attention_mask=mask)
        with mh.heads.capture(model, what) as steps:
            cache = DynamicCache(config=model.config)
            model(input_ids=ids[:, :6], attention_mask=mask[:, :6], cache=cache, use_cache=True)
            for t in range(6, 9):
                model(input_ids=ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache,
                      use_cache=True)
    real = mask.bool()
    for name in whole.layers:
        for store in ("weights", "heads", "q"):
            got, want = getattr(steps, store)[name], getattr(whole, store)[name]
            assert got.shape == want.shape, (name, store)
            assert torch.allclose(got.transpose(1, 2)[real], want.transpose(1, 2)[real], atol=ATOL), (name, store)
        for store in ("k", "v"):
            got, want = getattr(steps, store)[name], getattr(whole, store)[name]
            assert torch.allclose(got.transpose(1, 2)[real], want.transpose(1, 2)[real], atol=ATOL), (name, store)


def test_a_cache_that_dropped_tokens_and_a_second_pass_are_refused() -> None:
    """Ministral 3's sliding-window cache keeps 5 of 9 earlier tokens: the next step's rows cannot be
    aligned, refused by name; two passes without a cache in one block are refused; no watcher stays."""
    from transformers import DynamicCache

    model, batches, _ = _eager_and_patched("ministral3")
    ids, mask = batches[0]["input_ids"], batches[0]["attention_mask"]
    with torch.no_grad(), pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn.*no longer holds"):
        with mh.heads.capture(model):
            cache = DynamicCache(config=model.config)
            model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
            model(input_ids=ids[:, :1], attention_mask=torch.ones(2, 10, dtype=torch.long), cache=cache,
                  use_cache=True)
    with torch.no_grad(), pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn.*called again"):
        with mh.heads.capture(model):
            model(input_ids=ids, attention_mask=mask)
            model(input_ids=ids, attention_mask=mask)
    assert _watchers(model) == []


def test_capture_refuses_a_mask_its_module_misdescribes() -> None:
    """A planted mistake: the modules say is_causal=False while HF hands them a causal mask; their
    LayerInfo would be false, so the capture refuses, naming the layer."""
    model, batches, _ = _eager_and_patched("bitnet")
    for m in model.modules():
        if "is_causal" in m.__dict__:
            m.is_causal = False
    with torch.no_grad(), pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn' says is_causal=False"):
        with mh.heads.capture(model):
            model(**batches[0])
    assert _watchers(model) == []


def test_capture_on_the_kernel_route_keeps_its_limits() -> None:
    """limit_bytes refuses a call before its kernel computes; a nested capture of one layer and heads out
    of range are refused by name; the watchers are gone after each. Editing heads (ablate) stays
    refused there: HF's module holds them."""
    model, batches, _ = _eager_and_patched("bitnet")
    with torch.no_grad(), pytest.raises(ValueError, match=r"capture of layer 'model\.layers\.0\.self_attn'.*limit"):
        with mh.heads.capture(model, limit_bytes=1000):
            model(**batches[0])
    assert _watchers(model) == []
    with mh.heads.capture(model, layers=[1]):
        with pytest.raises(ValueError, match=r"'model\.layers\.1\.self_attn' is already being captured"):
            mh.heads.capture(model).__enter__()
        assert _watchers(model) == ["model.layers.1.self_attn"]
    assert _watchers(model) == []
    with torch.no_grad(), pytest.raises(ValueError, match=r"heads: head index must be in \[0, 3\], got 4"):
        with mh.heads.capture(model, heads=[0, 4]):
            model(**batches[0])
    assert _watchers(model) == []
    with pytest.raises(ValueError, match="kernel route.*edits the heads of layers patched with a wrapper only"):
        with mh.heads.ablate(model, {0: [1]}):
            pass


def test_heads_functions_work_on_a_kernel_route_capture(tmp_path: Path) -> None:
    """metrics, labels, the HTML page: the metrics equal those of eager's attentions held in a capture
    with the same facts; norm_weights, whose W_O is HF's module's, is refused by name."""
    model, batches, wants = _eager_and_patched("bitnet")
    inputs = batches[1]
    with torch.no_grad(), mh.heads.capture(model, ("weights", "v")) as cap:
        model(**inputs)
    eager = Capture(("weights",), None, 1 << 30)
    for name, w in zip(cap.layers, wants[1]):
        eager.layers.append(name)
        eager.info[name] = cap.info[name]
        eager.weights[name] = w
    mask, ids = inputs["attention_mask"], inputs["input_ids"]
    rows = mh.heads.label(mh.heads.metrics(cap, ids, mask, induction=True), causal=True)
    oracle = mh.heads.metrics(eager, ids, mask, induction=True)
    assert len(rows) == 8 and all(r.label in mh.heads.LABELS for r in rows)
    for r, o in zip(rows, oracle):
        assert r.norm_weight is None  # not measured on the kernel route
        assert r.entropy == pytest.approx(o.entropy, abs=1e-5) and r.distance == pytest.approx(o.distance, abs=1e-4)
    tokens = [[str(t) for t in row] for row in ids.tolist()]
    assert mh.heads.to_html(cap, tokens, tmp_path / "heads.html", key_mask=mask).stat().st_size > 0
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn.*W_O.*kernel route"):
        mh.heads.norm_weights(cap, 0)


def test_a_model_with_both_routes_captures_every_layer() -> None:
    """GPT-2 with cross-attention: self-attention wrapped, cross-attention on the kernel route; the
    capture lists all four in model order, equal to eager's attentions and cross-attentions; a step
    through the cache appends one row to each, equal to the full pass's last row."""
    model, ids, mask, context = gpt2_with_cross_attention(10)
    with torch.no_grad():
        want = model(ids, attention_mask=mask, encoder_hidden_states=context, output_attentions=True)
        mh.hf.patch(model)
        with mh.heads.capture(model) as whole:
            model(ids, attention_mask=mask, encoder_hidden_states=context)
        with mh.heads.capture(model) as steps:
            out = model(ids[:, :9], attention_mask=mask[:, :9], encoder_hidden_states=context, use_cache=True)
            model(ids[:, 9:], attention_mask=mask, encoder_hidden_states=context, cache=out.past_key_values)
    assert whole.layers == steps.layers == ["h.0.attn", "h.0.crossattention", "h.1.attn", "h.1.crossattention"]
    real = mask.bool()
    wants = [w for pair in zip(want.attentions, want.cross_attentions) for w in pair]
    assert _worst(whole, wants, mask) <= ATOL
    assert whole.info["h.1.crossattention"] == LayerInfo("h.1.crossattention", 4, 4, 16, False, None, (0, 1, 2, 3))
    for name in whole.layers:
        assert steps.weights[name].shape == whole.weights[name].shape
        got, full = steps.weights[name].transpose(1, 2)[real], whole.weights[name].transpose(1, 2)[real]
        assert torch.allclose(got, full, atol=ATOL), name


def test_values_wider_than_keys_are_captured_with_their_width() -> None:
    """MiMo-V2-Flash's values are 128 wide, its queries and keys 192: the heads (B, H, S, 128) are the
    weights times the values (query head h reads K/V head h // (H / Hkv)), and LayerInfo says both widths."""
    model = _eager("mimo_v2_flash")
    mh.hf.patch(model)
    inputs = _inputs("mimo_v2_flash", "left")
    with torch.no_grad(), mh.heads.capture(model, ("weights", "heads", "v")) as cap:
        model(**inputs)
    real = inputs["attention_mask"].bool()
    for name in cap.layers:
        info, a, v = cap.info[name], cap.weights[name].double(), cap.v[name].double()  # v (B, Hkv, S, 128)
        assert (info.head_dim, info.value_dim) == (192, 128) and cap.heads[name].shape == (2, 4, 9, 128)
        heads = a @ v.repeat_interleave(info.num_heads // info.num_kv_heads, dim=1)  # (B, H, S, 128)
        assert torch.allclose(heads.transpose(1, 2)[real], cap.heads[name].double().transpose(1, 2)[real], atol=ATOL)


def test_t5_with_its_relative_bias_captures_encoder_decoder_and_cross_attention() -> None:
    """T5 on the kernel route (its relative bias as the core's bias=): the six attention modules of a
    left-padded encoder-decoder batch, their weights equal to eager's, the decoder's self-attention
    causal (the kernel's own causality where HF passes no mask), the rest not."""
    from test_t5_kernel_route import _batch, _model

    model = _model("t5").eval()
    batch = _batch("left")
    with torch.no_grad():
        want = model(**batch, output_attentions=True)
        mh.hf.patch(model)
        with mh.heads.capture(model) as cap:
            model(**batch)
    decoder = [w for pair in zip(want.decoder_attentions, want.cross_attentions) for w in pair]
    wants = [*want.encoder_attentions, *decoder]
    assert cap.layers == ["encoder.block.0.layer.0", "encoder.block.1.layer.0", "decoder.block.0.layer.0",
                          "decoder.block.0.layer.1", "decoder.block.1.layer.0", "decoder.block.1.layer.1"]
    assert [cap.info[n].causal for n in cap.layers] == [False, False, True, False, True, False]
    for name, w in zip(cap.layers, wants):
        real = batch["attention_mask" if name.startswith("encoder") else "decoder_attention_mask"].bool()
        assert (cap.weights[name].transpose(1, 2)[real] - w.transpose(1, 2)[real]).abs().max() <= ATOL, name
