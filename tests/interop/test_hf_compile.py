"""A Hugging Face model patched by ``mh.hf.patch`` under ``torch.compile``.

Notation: B batch, S tokens. A small random Llama (2 layers, E=128, H=8, Hkv=2).
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import multihead as mh


def _model() -> LlamaForCausalLM:
    torch.random.default_generator.manual_seed(0)
    config = LlamaConfig(hidden_size=128, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=2,
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
