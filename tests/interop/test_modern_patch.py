"""Patching Llama checkpoints with scaled RoPE: patched equals unpatched, same greedy tokens.

The families with QK-norm, soft-capping, per-layer windows and RoPE bases, and sinks
(Qwen3, OLMo 2, Gemma 2, Gemma 3 text, gpt-oss) are in the zoo (tests/interop/test_zoo.py),
checked the same way. Models: tiny configs, random weights, float32, a right-padded batch.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import multihead as mh

B, S, VOCAB = 2, 9, 100
ROPES = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 4},
    "linear": {"rope_type": "linear", "factor": 2.5},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},  # M = 8 < S: the frequencies grow with the length
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4},
    "longrope": {"rope_type": "longrope", "long_factor": [1.0 + 0.5 * i for i in range(8)],
                 "short_factor": [1.0 + 0.05 * i for i in range(8)], "original_max_position_embeddings": 4},
}


def _model(rope: dict) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                      intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=8,
                      rope_parameters={**rope, "rope_theta": 10000.0}, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = LlamaForCausalLM(cfg).eval()
    cfg._attn_implementation = "eager"
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4)
    return model


@pytest.mark.parametrize("name", list(ROPES))
def test_scaled_rope_llama_patched_equals_unpatched(name: str) -> None:
    model = _model(ROPES[name])
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, S - 3:] = 0
    greedy = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        tokens = model.generate(ids[:1], **greedy)
        mh.hf.patch(model)
        got = model(input_ids=ids, attention_mask=mask).logits
        real = mask.bool()
        rel = ((got[real] - want[real]).abs().max() / want[real].abs().max()).item()
        assert rel <= 1e-5, rel
        assert torch.equal(model.generate(ids[:1], **greedy), tokens)


def test_converted_llama3_layer_has_hf_frequencies() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model = _model(ROPES["llama3"])
    layer = mh.MultiHeadAttention.from_hf(model.model.layers[0].self_attn)
    assert torch.equal(layer.rope.inv_freq, ROPE_INIT_FUNCTIONS["llama3"](model.config, None)[0])


def test_a_rope_type_multihead_does_not_compute_is_refused_by_name() -> None:
    model = _model({"rope_type": "proportional", "factor": 1.0})
    with pytest.raises(ValueError, match="rope_type must be one of"):
        mh.hf.patch(model)
