"""Patching Llama checkpoints with scaled RoPE: patched equals unpatched, same greedy tokens.

Phi-3-mini-128k's longrope (tests/data/configs/phi-3-mini-128k.json: 48 long and 48 short
factors, D = 96): frequencies and attention factor bitwise transformers' at lengths around
the original maximum 4096, and a Phi-3 model with those parameters (lengths scaled to an
original maximum of 8) patched on either side of it and through greedy generation that
crosses it.

The families with QK-norm, soft-capping, per-layer windows and RoPE bases, and sinks
(Qwen3, OLMo 2, Gemma 2, Gemma 3 text, gpt-oss) are in the zoo (tests/interop/test_zoo.py),
checked the same way. Models: tiny configs, random weights, float32, a right-padded batch.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import multihead as mh

from test_zoo import sharpen  # same folder (pytest puts it on sys.path)

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
    torch.random.default_generator.manual_seed(0)
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
        mh.hf.patch(model, kernel=False)


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
    torch.random.default_generator.manual_seed(0)
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


# ---- Phi-3-mini-128k's longrope parameters (tests/data/configs/phi-3-mini-128k.json) --------------------
# 48 = D/2 factors (D = 96), original_max_position_embeddings 4096, max_position_embeddings 131072.
# NB: the file's factor values are placeholders of the published count and range (see its
# "_comment"); every other rope field is as published.
PHI3_FILE = Path(__file__).resolve().parents[1] / "data" / "configs" / "phi-3-mini-128k.json"
PHI3_ORIG = 8  # the tiny model's original_max_position_embeddings: 8 tokens and below short, past 8 long


def _phi3_file() -> dict[str, Any]:
    cfg = json.loads(PHI3_FILE.read_text(encoding="utf-8"))
    cfg.pop("_comment")
    return cfg


def _phi3_config(**sizes: Any) -> Any:
    from transformers import Phi3Config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers recommends `factor` over the original maximum
        return Phi3Config(**{**_phi3_file(), **sizes})


@pytest.mark.parametrize("length", [None, 1, 4095, 4096, 4097, 8192, 131072])
def test_phi3_128k_longrope_frequencies_are_transformers(length: int | None) -> None:
    """The file's factors at lengths below, at and above original_max_position_embeddings (4096):
    inverse frequencies bitwise and the attention factor exactly as ROPE_INIT_FUNCTIONS["longrope"]."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from multihead.rope_scaling import rope_frequencies

    config = mh.AttentionConfig.from_hf(PHI3_FILE)
    s = config.rope_scaling
    assert s is not None and s.rope_type == "longrope" and len(s.long_factor or ()) == config.head_dim // 2 == 48
    want, want_factor = ROPE_INIT_FUNCTIONS["longrope"](_phi3_config(), None, seq_len=length)
    got, factor = rope_frequencies(config.head_dim, config.rope_base or 0.0, s, seq_len=length)
    assert torch.equal(got, want) and factor == want_factor == math.sqrt(1 + math.log(32) / math.log(4096))
    factors = s.long_factor if length is not None and length > 4096 else s.short_factor
    assert torch.equal(want, 1.0 / (torch.tensor(factors) * 10000.0 ** (torch.arange(0, 96, 2).float() / 96)))


def _phi3_model() -> torch.nn.Module:
    """Phi3ForCausalLM with the file's RoPE parameters, D = 96 (H=4, Hkv=2, E=384, 2 layers), the
    lengths scaled by 4096 / 8 (original maximum 8, maximum 256: the file's ratio of 32)."""
    from transformers import Phi3ForCausalLM

    cfg = _phi3_config(hidden_size=384, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                       intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=32 * PHI3_ORIG,
                       original_max_position_embeddings=PHI3_ORIG, pad_token_id=0, bos_token_id=1,
                       eos_token_id=2)
    torch.random.default_generator.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = Phi3ForCausalLM(cfg).eval()
    model.set_attn_implementation("eager")
    return sharpen(model)


def test_phi3_128k_tiny_model_has_the_file_rope() -> None:
    """The converted layer's frequencies and factor at both sides of the (scaled) original maximum."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model = _phi3_model()
    layer = mh.MultiHeadAttention.from_hf(model.model.layers[0].self_attn)
    assert layer.head_dim == 96 and layer.rope is not None and layer.rope.rotary_dim == 96
    for length in (PHI3_ORIG, PHI3_ORIG + 1):
        want, factor = ROPE_INIT_FUNCTIONS["longrope"](model.config, None, seq_len=length)
        assert torch.equal(layer.rope.inv_freq_for(length), want)
        assert layer.rope.attention_factor == factor == model.model.rotary_emb.attention_scaling


@pytest.mark.parametrize("length", [PHI3_ORIG - 2, PHI3_ORIG + 5])  # short factors; long factors
def test_phi3_128k_patched_equals_unpatched(length: int) -> None:
    """A right-padded batch (3 padding tokens) of 6 tokens (short factors) and of 13 (long)."""
    model = _phi3_model()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (B, length), generator=g)
    mask = torch.ones(B, length, dtype=torch.long)
    mask[1, length - 3:] = 0
    real = mask.bool()
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        mh.hf.patch(model)
        assert sum(isinstance(m, mh.hf.PatchedAttention) for m in model.modules()) == 2
        got = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    for mine, theirs in zip(got.hidden_states[1:], want.hidden_states[1:], strict=True):
        assert _rel(mine[real], theirs[real]) <= 1e-5
    assert _rel(got.logits[real], want.logits[real]) <= 1e-5
    if length > PHI3_ORIG:  # not vacuous: past the original maximum every position takes the long factors
        with torch.no_grad():
            prefix = model(input_ids=ids[:1, :PHI3_ORIG]).logits
        assert _rel(prefix[0], got.logits[0, :PHI3_ORIG]) > 1e-3


def test_phi3_128k_greedy_generation_crosses_to_the_long_factors() -> None:
    """A left-padded prompt of 6 tokens, 8 new ones: the steps past position 8 take the long
    factors (HF switches when max(position_ids) + 1 > 8); tokens and every step's logits equal."""
    model = _phi3_model()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, VOCAB, (B, PHI3_ORIG - 2), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    greedy = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False, "pad_token_id": 0,
              "output_logits": True, "return_dict_in_generate": True}
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, **greedy)
        got = mh.hf.patch(model).generate(ids, attention_mask=mask, **greedy)
    assert torch.equal(got.sequences, want.sequences)
    assert _rel(torch.stack(got.logits), torch.stack(want.logits)) <= 1e-5


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()
