"""Patching twice, saving a patched model, loading into one (issue #14, items 12 and 13).

Tiny random models (2 layers, E=64, H=4), eval mode. Runtime: about 5 s.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM

import multihead as mh

SMALL = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 128,
         "vocab_size": 100}


def _llama() -> LlamaForCausalLM:
    torch.random.default_generator.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(num_key_value_heads=2, **SMALL)).eval()


def _bert() -> BertModel:
    torch.random.default_generator.manual_seed(0)
    return BertModel(BertConfig(**SMALL)).eval()


def test_patching_a_patched_model_is_a_no_op_that_warns() -> None:
    model = mh.hf.patch(_llama())
    wrappers = [m for m in model.modules() if isinstance(m, mh.hf.PatchedAttention)]
    with pytest.warns(UserWarning, match="already patched"):
        assert mh.hf.patch(model) is model
    assert [m for m in model.modules() if isinstance(m, mh.hf.PatchedAttention)] == wrappers


@pytest.mark.parametrize("make, out", [(_llama, "logits"), (_bert, "last_hidden_state")], ids=["llama", "bert"])
def test_saved_patched_model_reloads_unpatched_with_the_same_outputs(make, out: str, tmp_path: Path) -> None:
    model = mh.hf.patch(make())
    with torch.no_grad():  # weights changed while patched must be the ones saved
        for m in model.modules():
            if isinstance(m, mh.hf.PatchedAttention):
                m.mh.q_proj.weight.mul_(1.5)
    ids = torch.randint(0, 100, (2, 7))
    with torch.no_grad():
        want = getattr(model(input_ids=ids), out)
    model.save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a missing or unexpected key would warn
        loaded = type(model).from_pretrained(tmp_path).eval()
    assert not mh.hf.is_patched(loaded)
    with torch.no_grad():
        got = getattr(loaded(input_ids=ids), out)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_state_dict_of_a_patched_model_has_the_original_keys() -> None:
    model = _llama()
    keys = list(model.state_dict())
    assert list(mh.hf.patch(model).state_dict()) == keys


def test_loading_a_state_dict_into_a_patched_model_is_refused() -> None:
    model = _llama()
    state = model.state_dict()
    mh.hf.patch(model)
    with pytest.raises(ValueError, match="unpatch"):
        model.load_state_dict(state)


def test_lenient_patch_warns_once_listing_every_skipped_module() -> None:
    from transformers import GPT2Config, GPT2Model

    model = GPT2Model(GPT2Config(n_embd=64, n_head=4, n_layer=2, vocab_size=100, add_cross_attention=True)).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mh.hf.patch(model, strict=False, kernel=False)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "2 attention module(s) unpatched" in message
    assert "h.0.crossattention" in message and "h.1.crossattention" in message
    assert isinstance(model.h[0].attn, mh.hf.PatchedAttention)  # the self-attention is patched
