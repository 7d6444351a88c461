"""Qwen2-VL and Qwen2.5-VL text attention on registered wrappers, with M-RoPE (multihead.mrope).

Notation: B batch, S tokens, D head_dim.

Oracle: the same tiny models run eagerly by transformers. The text models (in the zoo too, on
text batches) are compared here on (3, B, S) positions whose rows differ, as an image's tokens
produce; the whole vision-language models (one vision block, a 4 × 4 patch grid merged into 4
image tokens per row, a left-padded batch) are compared on their logits, their greedy tokens (on
HF's cache and on mh.hf.KVCacheAdapter) and the keys and values they cache. Planted mistakes
(the sections swapped, the image rows ignored) must fail the comparison; a layer called without
the positions its model computed is refused by name. Qwen3-VL (and its MoE model) take the same
wrapper with the interleaved M-RoPE layout and their per-head q/k RMSNorm.

Runtime: about 15 s on 2 shared cores.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

import multihead as mh
from multihead.backends import native
from multihead.interop import hf_config, hf_mrope, hf_registry

pytest.importorskip("transformers")
from transformers import AutoModel  # noqa: E402

from test_zoo import RTOL, ZOO, _inputs, sharpen, tiny_config  # noqa: E402

B, S = 2, 12
_QWEN3_VISION = {"num_heads": 2, "intermediate_size": 64, "out_hidden_size": 64, "num_position_embeddings": 16,
                 "deepstack_visual_indexes": [0]}
#: Per family: the text model type, the VL config and model classes, and the vision sizes (one block).
FAMILIES = {
    "qwen2_vl": ("qwen2_vl_text", "Qwen2VLConfig", "Qwen2VLForConditionalGeneration",
                 {"embed_dim": 32, "num_heads": 2, "mlp_ratio": 2}),
    "qwen2_5_vl": ("qwen2_5_vl_text", "Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration",
                   {"num_heads": 2, "intermediate_size": 64, "out_hidden_size": 64, "window_size": 8,
                    "fullatt_block_indexes": [0]}),
    "qwen3_vl": ("qwen3_vl_text", "Qwen3VLConfig", "Qwen3VLForConditionalGeneration", _QWEN3_VISION),
    "qwen3_vl_moe": ("qwen3_vl_moe_text", "Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration", _QWEN3_VISION),
}
GREEDY = {"max_new_tokens": 4, "min_new_tokens": 4, "do_sample": False, "pad_token_id": 0}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def _text_model(model_type: str, **extra: Any) -> nn.Module:
    """The zoo's tiny text model of ``model_type``, its config updated with ``extra``."""
    torch.random.default_generator.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = tiny_config(model_type, **{**ZOO[model_type][0], **extra})
        model = AutoModel.from_config(config, attn_implementation="eager")
    return sharpen(model.eval())


def _image_rows() -> torch.Tensor:
    """(3, B, S) positions: text rows equal, tokens 3..6 of each row a 2 × 2 grid (as get_rope_index)."""
    rows = torch.arange(S).expand(3, B, S).clone()
    rows[:, :, 3:7] = 3
    rows[1, :, 3:7] += torch.tensor([0, 0, 1, 1])
    rows[2, :, 3:7] += torch.tensor([0, 1, 0, 1])
    rows[:, :, 7:] -= 2  # the text after the image continues from the grid's largest position + 1
    return rows


def _compare_text(model_type: str, **extra: Any) -> str:
    """``"exact"`` or what differs: the patched text model on a left-padded batch at image rows."""
    model = _text_model(model_type, **extra)
    g = torch.Generator().manual_seed(1)
    ids, mask = torch.randint(3, 100, (B, S), generator=g), torch.ones(B, S, dtype=torch.long)
    mask[1, :2] = 0
    inputs = {"input_ids": ids, "attention_mask": mask, "position_ids": _image_rows()}
    with torch.no_grad():
        want = model(**inputs, use_cache=True)
        mh.hf.patch(model)
        got = model(**inputs, use_cache=True)
    real = mask.bool()
    rel = _rel(got.last_hidden_state[real], want.last_hidden_state[real])
    if not rel <= RTOL:
        return f"wrong: relative difference {rel:.2e} on real tokens"
    return _same_cache(got.cache, want.cache, mask)


def _same_cache(got: Any, want: Any, mask: torch.Tensor, *, holds_all: bool = False) -> str:
    """``"exact"`` or the first layer whose cached keys or values (B, Hkv, Sk, D) differ on real tokens
    (HF's sliding layer holds the last keys only; ``holds_all``: ``got`` holds every key, its last
    ones compared)."""
    for i, (a, b) in enumerate(zip(got.layers, want.layers)):
        for kind in ("keys", "values"):
            x, y = getattr(a, kind), getattr(b, kind)
            x = x[:, :, x.shape[2] - y.shape[2]:] if holds_all else x
            real = mask[:, -y.shape[2]:].bool()  # (B, Sk)
            rel = _rel(x.transpose(1, 2)[real], y.transpose(1, 2)[real]) if x.shape == y.shape else float("inf")
            if not rel <= RTOL:
                return f"wrong: layer {i} cached {kind}, relative difference {rel:.2e}"
    return "exact"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_text_model_at_image_rows_is_exact(family: str) -> None:
    """Hidden states and the cache's keys and values equal HF's where the three position rows differ."""
    assert _compare_text(FAMILIES[family][0]) == "exact"


@pytest.mark.parametrize(("model_type", "scaling"), [
    ("qwen2_vl_text", {"rope_type": "dynamic", "factor": 2.0}),  # M = 8 < S: the frequencies grow
    ("qwen3_vl_text", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4}),
])
def test_scaled_mrope_at_image_rows_is_exact(model_type: str, scaling: dict[str, Any]) -> None:
    rope = {**ZOO[model_type][0]["rope_parameters"], **scaling}
    assert _compare_text(model_type, rope_parameters=rope, max_position_embeddings=8) == "exact"


def test_planted_swapped_sections_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """M-RoPE read with the sections reversed ([3, 3, 2] for [2, 3, 3]): the comparison fails."""
    real = hf_config.module_mrope_sections
    monkeypatch.setattr(hf_config, "module_mrope_sections", lambda *a: tuple(reversed(real(*a))))
    assert _compare_text("qwen2_vl_text").startswith("wrong")


def test_planted_chunked_layout_for_qwen3_vl_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3-VL's interleaved slots (T H W T H W T T) read as Qwen2-VL's chunks: the comparison fails."""
    monkeypatch.setitem(hf_registry.MROPE_KINDS, "mrope_interleaved", ("chunked", (24, 20, 20)))
    assert _compare_text("qwen3_vl_text").startswith("wrong")


def test_planted_text_positions_for_image_tokens_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """The image tokens' height and width rows ignored (row 0 for every section): the comparison fails."""
    real = hf_mrope.PositionsRecord.positions_for
    monkeypatch.setattr(hf_mrope.PositionsRecord, "positions_for",
                        lambda self, *a: real(self, *a)[:1].expand(3, -1, -1))
    assert _compare_text("qwen2_vl_text").startswith("wrong")


def _vl_model(family: str) -> nn.Module:
    import transformers

    text_type, config_cls, model_cls, vision = FAMILIES[family]
    text = {**tiny_config(text_type, **ZOO[text_type][0]).to_dict(), "vocab_size": 100}
    config = getattr(transformers, config_cls)(
        text_config=text, vision_config={"depth": 1, "hidden_size": 64, "patch_size": 2, "temporal_patch_size": 1,
                                         "spatial_merge_size": 2, **vision},
        image_token_id=5, video_token_id=6, vision_start_token_id=3, vision_end_token_id=4, pad_token_id=0)
    torch.random.default_generator.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = getattr(transformers, model_cls)._from_config(config, attn_implementation="eager")
    return sharpen(model.eval())


def _vl_inputs() -> dict[str, torch.Tensor]:
    """Two rows holding one 4 × 4-patch image each (4 tokens after merging); row 1 left-padded by 3."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(7, 100, (B, S), generator=g)
    ids[:, 2], ids[:, 3:7], ids[:, 7] = 3, 5, 4  # <vision_start> 4 × <image> <vision_end>
    ids[1] = torch.cat([torch.zeros(3, dtype=torch.long), ids[0, :S - 3]])
    mask = (ids != 0).long()
    return {"input_ids": ids, "attention_mask": mask, "mm_token_type_ids": (ids == 5).int(),
            "pixel_values": torch.randn(B * 16, 12, generator=g), "image_grid_thw": torch.tensor([[1, 4, 4]] * B)}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_vision_language_model_with_an_image_is_exact(family: str) -> None:
    """Logits (1e-5), the prompt's keys and values in HF's cache and in mh.hf.KVCacheAdapter's, and
    greedy tokens on both: equal to the eager model's (on the same cache), the text attention on wrappers.

    (Qwen3-VL-MoE's own generation on HF's DynamicCache differs after an image from the same model
    on the adapter and from its uncached forward, without multihead's wrappers too: each cache is
    compared with itself.)"""
    model, inputs = _vl_model(family), _vl_inputs()
    with torch.no_grad():
        want = model(**inputs, use_cache=True)
        tokens = model.generate(**inputs, **GREEDY)
        adapted = model.generate(**inputs, **GREEDY, cache=mh.hf.KVCacheAdapter(model, max_len=S + 4))
        mh.hf.patch(model)
        got = model(**inputs, use_cache=True)
        assert {r.route for r in mh.hf.routes(model) if "language_model" in r.name} == {"wrapper"}
        assert _rel(got.logits[inputs["attention_mask"].bool()], want.logits[inputs["attention_mask"].bool()]) <= RTOL
        assert _same_cache(got.past_key_values, want.past_key_values, inputs["attention_mask"]) == "exact"
        assert torch.equal(model.generate(**inputs, **GREEDY), tokens)
        held = mh.hf.KVCacheAdapter(model, max_len=S + 4)  # the in-place cache, filled by the prompt
        model(**inputs, cache=held, use_cache=True)
        assert _same_cache(held, want.past_key_values, inputs["attention_mask"], holds_all=True) == "exact"
        cache = mh.hf.KVCacheAdapter(model, max_len=S + 4)
        assert torch.equal(model.generate(**inputs, **GREEDY, cache=cache), adapted)
    # The image shifts every later position below its slot: the full layer's mask shows the slots
    # before the shift, so it takes update; the sliding layer's window hides them, so its positions
    # count from slot held - position (as a left-padded row's) and it takes the fused step.
    windows = [m.mh.window for n, m in model.named_modules() if isinstance(m, mh.hf.PatchedAttention)
               and "language_model" in n]
    assert cache.paths == ["fused" if native.vector_bits() >= 256 and w is not None else "update" for w in windows]
    assert family == "qwen3_vl_moe" or torch.equal(adapted, tokens)


def test_text_generation_takes_the_fused_step_at_its_own_positions() -> None:
    """Text only, one row, sdpa (no mask): every position row equal and the cache's own, so the full
    layer 0 decodes with the fused native step where the machine has it; the same greedy tokens as HF."""

    model = _vl_model("qwen2_vl")
    model.model.language_model.config._attn_implementation = "sdpa"  # HF passes no mask then
    ids = _inputs("qwen2_vl_text")["input_ids"][:1]
    with torch.no_grad():
        tokens = model.generate(ids, **GREEDY)
        mh.hf.patch(model)
        cache = mh.hf.KVCacheAdapter(model, max_len=ids.shape[1] + 4)
        assert torch.equal(model.generate(ids, **GREEDY, cache=cache), tokens)
    assert cache.paths[0] == "fused" or native.vector_bits() < 256 and "not compiled" in str(cache.paths[0])


def test_from_hf_equals_the_module_at_image_rows() -> None:
    """The converted layer (an MRoPE, the config's sections) through its steps equals the HF module
    given the cos/sin its model's rotary embedding makes of the same (3, B, S) rows."""
    model = _text_model("qwen2_vl_text")
    module, rows = model.layers[0].self_attn, _image_rows()
    layer = mh.MultiHeadAttention.from_hf(module)
    assert isinstance(layer.rope, mh.MRoPE) and layer.rope.sections == (2, 3, 3)
    x = torch.randn(B, S, 64, generator=torch.Generator().manual_seed(2))
    causal = torch.full((S, S), torch.finfo(torch.float32).min).triu(1)[None, None]
    with torch.no_grad():
        want = module(x, attention_mask=causal, position_embeddings=model.rotary_emb(x, rows))[0]
        q, k, v = layer.split(*layer.project(x))
        q, k = layer.rotate(q, k, rows)
        got = layer.output(layer.attend(q, k, v)[0])
    assert _rel(got, want) <= RTOL


def test_layer_without_its_models_positions_is_refused() -> None:
    """A patched layer handed cos/sin its text model's rotary embedding did not return: refused by name."""
    model = mh.hf.patch(_text_model("qwen2_vl_text"))
    x, layer = torch.randn(1, 4, 64), model.layers[0].self_attn
    with torch.no_grad():
        made = model.rotary_emb(x, torch.arange(4)[None])  # recorded: the layer may take these
        assert layer(x, position_embeddings=made)[0].shape == x.shape
        with pytest.raises(ValueError, match=r"needs the M-RoPE positions \(3, B, S\)"):
            layer(x, position_embeddings=tuple(t.clone() for t in made))  # equal values, not the model's
        with pytest.raises(ValueError, match=r"needs the M-RoPE positions \(3, B, S\)"):
            layer(x)
        unlinked = mh.hf.patch(_text_model("qwen2_vl_text").layers[0])  # a decoder layer: no rotary_emb
        with pytest.raises(ValueError, match="outside a text model with a rotary_emb"):
            unlinked(x, position_embeddings=made)


def test_unpatch_removes_the_positions_hook() -> None:
    model = _text_model("qwen2_vl_text")
    hooks = dict(model.rotary_emb._forward_hooks)
    mh.hf.patch(model)
    assert len(model.rotary_emb._forward_hooks) == len(hooks) + 1
    mh.hf.unpatch(model)
    assert dict(model.rotary_emb._forward_hooks) == hooks


def test_capture_records_the_image_rows_call() -> None:
    """mh.heads.capture sees the steps of a call at image rows (weights (B, H, S, S), rows summing to 1)."""
    model = mh.hf.patch(_text_model("qwen2_vl_text"))
    ids = torch.randint(3, 100, (B, S), generator=torch.Generator().manual_seed(3))
    with mh.heads.capture(model) as cap, torch.no_grad():
        model(input_ids=ids, position_ids=_image_rows())
    weights: Any = next(iter(cap.weights.values()))
    assert weights.shape == (B, 4, S, S) and torch.allclose(weights.sum(-1), torch.ones(B, 4, S))
