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


def test_phi3_fused_qkv_round_trips_through_patch_and_unpatch() -> None:
    from transformers import Phi3Config, Phi3ForCausalLM

    cfg = Phi3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                     intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0)
    model = Phi3ForCausalLM(cfg).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    layer = mh.MultiHeadAttention.from_hf(model.model.layers[0].self_attn)
    q_rows = 4 * 16
    assert torch.equal(layer.k_proj.weight, before["model.layers.0.self_attn.qkv_proj.weight"][q_rows:q_rows + 32])
    mh.hf.unpatch(mh.hf.patch(model))
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("model_type", ["gemma2", "gpt_oss"])
def test_the_attention_interface_kernel_applies_softcap_and_sinks(model_type: str) -> None:
    """attn_implementation="multihead": transformers passes softcap= (Gemma 2) and s_aux= (gpt-oss)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from multihead.interop import hf_kernel

    extra = {"attn_logit_softcapping": 2.0, "query_pre_attn_scalar": 16} if model_type == "gemma2" else {
        "num_local_experts": 4, "num_experts_per_tok": 2}
    cfg = AutoConfig.for_model(model_type, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=16, num_hidden_layers=2, intermediate_size=128, vocab_size=VOCAB,
                               max_position_embeddings=64, pad_token_id=0, **extra)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 or name.endswith("sinks"):
                p.mul_(4) if p.dim() == 2 else p.normal_()
    ids = torch.randint(3, VOCAB, (1, S), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        model.set_attn_implementation(hf_kernel.register())
        got = model(input_ids=ids).logits
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5
