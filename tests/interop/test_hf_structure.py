"""A patched causal layer under a Hugging Face mask that lets queries see later keys (Gemma 3's
images, PaliGemma's prefix, a custom 4-D mask): HF's mask alone, exact, or refused by name.

Notation: B batch, S tokens, Sk keys.

Oracle: the same tiny model run eagerly by transformers, which attends with the mask alone; the
mask here lets tokens 2..5 of each row attend to each other both ways (a bidirectional block),
causal elsewhere, the second row right-padded. Gemma 3 and PaliGemma themselves are compared in
test_zoo.py and test_paligemma.py.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

import multihead as mh
from multihead.interop import hf_structure
from multihead.masks import Structure

pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402
from test_zoo import B, S, VOCAB, build, sharpen, tiny_config  # noqa: E402 - same folder (pytest puts it on sys.path)

RTOL = 1e-5


def _model(model_type: str, **extra: Any) -> nn.Module:
    torch.random.default_generator.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build(model_type, tiny_config(model_type, **extra), AutoModelForCausalLM, "eager").eval()
    return sharpen(model)


def _block_mask() -> torch.Tensor:
    """(B, 1, S, S) additive float (eager's format): causal, tokens 2..5 both ways, row 1's last 3 padding."""
    allowed = Structure(causal=True).dense(S, S).clone()  # (S, S)
    allowed[2:6, 2:6] = True
    allowed = allowed.expand(B, 1, S, S).clone()
    allowed[1, :, :, S - 3:] = False
    return torch.zeros(B, 1, S, S).masked_fill(~allowed, torch.finfo(torch.float32).min)


def _causal_part(mask: torch.Tensor) -> torch.Tensor:
    """``mask`` (B, 1, S, S) additive with the later keys blocked too."""
    return torch.where(Structure(causal=True).dense(S, S), mask, torch.finfo(torch.float32).min)


def _ids() -> torch.Tensor:
    return torch.randint(3, VOCAB, (B, S), generator=torch.Generator().manual_seed(1))


def _hidden(model: nn.Module, mask: torch.Tensor, use_cache: bool) -> torch.Tensor:
    with torch.no_grad():
        return model.model(input_ids=_ids(), attention_mask=mask, use_cache=use_cache).last_hidden_state


def test_hides_keys_reads_the_rule_from_the_shapes() -> None:
    causal, window = Structure(causal=True), Structure(causal=True, window=4)
    assert not hf_structure.hides_keys(causal, 1, 9)  # one query, bottom-right: every key is before it
    assert hf_structure.hides_keys(causal, 2, 9)
    assert not hf_structure.hides_keys(window, 1, 4) and hf_structure.hides_keys(window, 1, 5)
    assert hf_structure.hides_keys(Structure(window=2), 3, 3)  # symmetric window: the far keys both ways
    assert not hf_structure.hides_keys(Structure(), 9, 9)


def test_a_padding_mask_keeps_the_layers_causal_rule() -> None:
    """HF's causal mask with padding allows nothing the rule hides: the backend keeps its structure."""
    causal = Structure(causal=True)
    padding = torch.ones(B, S, dtype=torch.bool)
    padding[1, :3] = False
    mask = causal.dense(S, S) & padding[:, None, None, :]  # (B, 1, S, S)
    assert hf_structure.attend_structure(causal, mask, mask, S) == causal
    assert hf_structure.attend_structure(causal, _block_mask(), _block_mask() == 0, S) == Structure()


def test_only_the_causal_rule_is_compared_a_window_is_kept() -> None:
    """A causal mask wider than the layer's window keeps the window: a window described wrong must
    still fail the zoo's comparison (test_zoo_catches_window_planted_in_exaone4_global_layer)."""
    full = Structure(causal=True).dense(S, S)[None, None]  # (1, 1, S, S)
    for layer in (Structure(causal=True, window=2), Structure(window=2)):
        assert hf_structure.attend_structure(layer, full, full, S) == layer
    everything = torch.ones(1, 1, S, S, dtype=torch.bool)
    assert hf_structure.attend_structure(Structure(window=2), everything, everything, S) == Structure(window=2)


@pytest.mark.parametrize("use_cache", [False, True], ids=["no cache", "dynamic cache"])
def test_a_mask_with_later_keys_is_honoured_on_a_causal_llama(use_cache: bool) -> None:
    model, mask = _model("llama"), _block_mask()
    want = _hidden(model, mask, use_cache)
    causal = _hidden(model, _causal_part(mask), use_cache)
    mh.hf.patch(model, kernel=False)
    got = _hidden(model, mask, use_cache)
    real = mask[:, 0, -1] == 0  # (B, S) the real tokens
    scale = want[real].abs().max()
    assert (causal - want)[real].abs().max() > 1e-3 * scale  # the block changes the result
    assert (got - want)[real].abs().max() <= RTOL * scale


def test_the_answer_is_read_once_per_mask_not_once_per_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layers share HF's mask: one comparison for the forward; a mask changed in place is read again."""
    model, mask = _model("llama"), _block_mask()
    mh.hf.patch(model, kernel=False)
    calls = []
    exceeds = hf_structure.exceeds
    monkeypatch.setattr(hf_structure, "exceeds", lambda *a: calls.append(1) or exceeds(*a))
    _hidden(model, mask, use_cache=False)
    assert len(model.model.layers) == 2 and len(calls) == 1
    _hidden(model, mask, use_cache=False)
    assert len(calls) == 1  # the same tensor, unchanged
    mask[:, :, 2:6, 2:6] = 0.0  # in place: its version moves
    _hidden(model, mask, use_cache=False)
    assert len(calls) == 2


@pytest.mark.parametrize("use_cache", [False, True], ids=["no cache", "dynamic cache"])
def test_latent_attention_refuses_a_mask_with_later_keys_by_name(use_cache: bool) -> None:
    """DeepSeek's latent layer always applies its causal rule: refused by name."""
    from test_deepseek import _config, _model as deepseek

    model = deepseek(_config("deepseek_v3"))
    mh.hf.patch(model, kernel=False)
    with pytest.raises(ValueError, match=r"DeepseekV3Attention \(multi-head latent attention\) always attends "
                                         r"causally, and HF's attention_mask lets a query attend to later keys"):
        _hidden(model, _block_mask(), use_cache)
    assert _hidden(model, _causal_part(_block_mask()), use_cache).isfinite().all()  # the same call, causal: runs


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_latent_attention_refuses_before_hfs_cache_is_written(kind: str) -> None:
    """A refused call leaves HF's cache as it was: its length and every tensor it holds, bitwise."""
    from transformers import DynamicCache, StaticCache
    from test_deepseek import _config, _model as deepseek

    model = deepseek(_config("deepseek_v3"))
    mh.hf.patch(model, kernel=False)
    cache = DynamicCache(config=model.config) if kind == "dynamic" else StaticCache(model.config, max_cache_len=2 * S)
    past = torch.zeros(B, 1, S, S)  # (B, 1, S, S) additive: the prefill's keys, all seen
    prefill = _causal_part(_block_mask())  # (B, 1, S, S)
    if kind == "static":  # HF's mask covers the whole buffer: its unwritten half hidden
        prefill = torch.cat((prefill, torch.full_like(prefill, torch.finfo(torch.float32).min)), dim=-1)
    with torch.no_grad():
        model.model(input_ids=_ids(), attention_mask=prefill, cache=cache, use_cache=True)
        before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        length = cache.get_seq_length()
        with pytest.raises(ValueError, match=r"\(multi-head latent attention\) always attends causally"):
            model.model(input_ids=_ids(), attention_mask=torch.cat((past, _block_mask()), dim=-1),
                        cache=cache, use_cache=True)  # (B, 1, S, 2S): the past, then the block
    assert length == S and cache.get_seq_length() == length
    for layer, (keys, values) in zip(cache.layers, before, strict=True):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
