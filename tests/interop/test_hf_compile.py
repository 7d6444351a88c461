"""A Hugging Face model patched by ``mh.hf.patch`` under ``torch.compile``, and generating on
``mh.hf.KVCacheAdapter`` with its forward compiled.

Notation: B batch, S tokens. A small random Llama (2 layers, E=128, H=8, Hkv=2). Graph breaks and
graphs are dynamo's own counters (``torch._dynamo.utils.counters``).
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import LlamaConfig, LlamaForCausalLM

import multihead as mh


def _model(layers: int = 2) -> LlamaForCausalLM:
    torch.random.default_generator.manual_seed(0)
    config = LlamaConfig(hidden_size=128, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=layers,
                         vocab_size=100, intermediate_size=256)
    return LlamaForCausalLM._from_config(config, attn_implementation="sdpa").eval()


def test_patched_model_compiles_without_graph_breaks_and_generates_the_same_tokens() -> None:
    ids = torch.randint(1, 100, (1, 40))  # (B, S)
    model = _model()
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=6, do_sample=False)
        mh.hf.patch(model)
        explained = torch._dynamo.explain(model.model)(ids)
        assert explained.graph_break_count == 0, explained.break_reasons
        model.forward = torch.compile(model.forward)
        got = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)



# ---- generate on mh.hf.KVCacheAdapter, model.forward compiled --------------------------------
def _compiled(model: LlamaForCausalLM, backend: str = "eager") -> LlamaForCausalLM:
    """``model`` patched, its forward compiled as users do (dynamo's graphs and graph breaks are
    the same whatever the backend), dynamo's counters from zero."""
    mh.hf.patch(model)
    torch._dynamo.reset()
    counters.clear()
    model.forward = torch.compile(model.forward, backend=backend)
    return model


def test_compiled_decoding_on_the_adapter_is_one_graph_for_64_steps_without_graph_breaks() -> None:
    """Traced, the adapter answers with static shapes (the whole buffers, HF's mask sized to
    max_len, a tensor length): no graph break, one graph for the prompt and one for the decoding
    step, reused at all 64 steps and by the next generate calls. The second generate traces its
    prompt once more (the first one made the buffers inside its graph); the third traces nothing.
    Same tokens as unpatched HF each time: nothing carried over."""
    ids = torch.randint(3, 100, (1, 10))  # (B, S)
    model = _model()
    greedy = dict(max_new_tokens=64, do_sample=False, eos_token_id=None)  # all 64 steps
    with torch.no_grad():
        want = model.generate(ids, **greedy)
    cache = mh.hf.KVCacheAdapter(_compiled(model), max_len=10 + 64)
    graphs = []
    for _ in range(3):
        with torch.no_grad():
            assert torch.equal(model.generate(ids, **greedy, cache=cache), want)
        graphs.append(counters["stats"]["unique_graphs"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert graphs == [2, 3, 3] and want.shape == (1, 10 + 64)
    assert cache.paths == ["update", "update"] and cache.get_seq_length() == 10 + 63


def test_compiled_beam_search_on_a_left_padded_batch_gives_hf_tokens() -> None:
    """Beam search (``reorder_cache`` between compiled steps) on 4 left-padded prompts (8 rows:
    HF's mask hides the padding and the slots not yet written alike), through AOT autograd's
    functionalization of the in-place writes (``aot_eager``): unpatched HF's beams, no graph break,
    one graph for the prompt and one for every step."""
    mask = (torch.arange(10)[None, :] >= torch.arange(4)[:, None]).long()  # (B, S): row b padded by b
    prompts = {"input_ids": torch.randint(3, 100, (4, 10)), "attention_mask": mask}
    beams = dict(max_new_tokens=12, do_sample=False, num_beams=2, pad_token_id=0)
    model = _model()
    with torch.no_grad():
        want = model.generate(**prompts, **beams)
    cache = mh.hf.KVCacheAdapter(_compiled(model, "aot_eager"), max_len=10 + 12)
    with torch.no_grad():
        assert torch.equal(model.generate(**prompts, **beams, cache=cache), want)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 2


def test_a_compiled_write_past_max_len_fails_before_writing() -> None:
    """Traced, the room check is a device assertion (no length is read on the host): a
    RuntimeError naming max_len, raised before anything is written."""
    model = _compiled(_model(layers=1))
    cache = mh.hf.KVCacheAdapter(model, max_len=8)
    with pytest.raises(RuntimeError, match=r"cache overflow: 10 more tokens per row exceed max_len=8 "
                                           r"\(nothing was written\)"):
        with torch.no_grad():
            model.generate(torch.randint(3, 100, (1, 10)), max_new_tokens=2, do_sample=False, cache=cache)
    assert cache.get_seq_length() == 0 and cache.slots[0].kv is None  # the graph's buffers never stored


def test_a_compiled_generate_not_starting_at_position_0_is_refused() -> None:
    """Every generate starts the adapter empty: one that passes only new tokens (with a longer
    mask, to continue tokens the adapter does not hold) is refused at its first write, traced
    too (a device assertion: a RuntimeError), before anything is written."""
    model = _compiled(_model(layers=1))
    cache = mh.hf.KVCacheAdapter(model, max_len=32)
    with pytest.raises(RuntimeError, match="starts every generate empty, but this generate's first tokens "
                                           "are not at position 0: pass generate the whole sequence"):
        with torch.no_grad():
            model.generate(torch.full((1, 2), 5), attention_mask=torch.ones(1, 12, dtype=torch.long),
                           max_new_tokens=2, do_sample=False, cache=cache)
    assert cache.get_seq_length() == 0

