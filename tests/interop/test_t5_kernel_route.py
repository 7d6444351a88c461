"""The T5 family through the AttentionInterface route (``attn_implementation="multihead"``, or
``mh.hf.patch``'s kernel route): T5's relative position bias reaches the core as ``bias=`` (HF
passes it as ``position_bias``), exact against eager attention.

Notation: B batch, S tokens, H heads.

Each type is a tiny random-weight encoder-decoder from its own config: logits and encoder states
on a right- and a left-padded batch within 1e-5 (relative) of the eager model's, the same greedy
tokens through ``generate`` (the decoder's self-attention bias at cache positions, its
cross-attention without one), and the gradient of the relative-bias table equal to eager's.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import multihead as mh

pytest.importorskip("transformers")

NAME = mh.hf.register()
TYPES = ["t5", "mt5", "umt5"]
TINY = {"vocab_size": 64, "d_model": 32, "d_kv": 8, "d_ff": 48, "num_layers": 2, "num_decoder_layers": 2,
        "num_heads": 4, "relative_attention_num_buckets": 8, "relative_attention_max_distance": 16,
        "decoder_start_token_id": 0, "pad_token_id": 0, "eos_token_id": 1, "num_experts": 2,
        "expert_capacity": 64, "dropout_rate": 0.0}


def _model(model_type: str) -> torch.nn.Module:
    from transformers import AutoModelForSeq2SeqLM, CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    default = cls()
    config = cls(**{k: v for k, v in TINY.items() if hasattr(default, k)})
    config._attn_implementation = "eager"
    torch.random.default_generator.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForSeq2SeqLM.from_config(config)
    for p in model.parameters():  # larger weights than the init: the bias and the softmax matter
        p.data.normal_(0.0, 0.3)
    return model.eval()


def _batch(side: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 64, (2, 9), generator=g)
    mask = torch.ones(2, 9, dtype=torch.long)
    pad = slice(6, 9) if side == "right" else slice(0, 3)
    mask[1, pad] = 0
    ids[1, pad] = 0
    dec = torch.randint(2, 64, (2, 5), generator=g)
    return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": dec,
            "decoder_attention_mask": torch.ones(2, 5, dtype=torch.long)}


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def _to_kernel(model: torch.nn.Module, way: str) -> None:
    """Put the kernel in ``model``: ``attn_implementation`` set by hand, or ``mh.hf.patch``'s kernel route
    (no wrapper is registered for T5's classes), every attention module on it."""
    if way == "attn_implementation":
        model.set_attn_implementation(NAME)
    else:
        assert {r.route for r in mh.hf.patch(model, report=True)} == {"kernel"}


@pytest.mark.parametrize("way", ["attn_implementation", "patch"])
@pytest.mark.parametrize("model_type", TYPES)
def test_t5_family_through_the_kernel_equals_eager(model_type: str, way: str) -> None:
    eager = _model(model_type)
    kernel = copy.deepcopy(eager)
    _to_kernel(kernel, way)
    for side in ("right", "left"):
        batch = _batch(side)
        with torch.no_grad():
            want, got = eager(**batch), kernel(**batch)
        real = batch["attention_mask"].bool()
        assert _relative(got.logits, want.logits) < 1e-5, side
        assert _relative(got.encoder_last_hidden_state[real], want.encoder_last_hidden_state[real]) < 1e-5, side
    prompt = _batch("right")["input_ids"][:1]
    greedy = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False, "decoder_start_token_id": 0}
    assert torch.equal(kernel.generate(prompt, **greedy), eager.generate(prompt, **greedy))


def test_switch_transformers_is_refused_by_name() -> None:
    """Its class keeps transformers' SDPA off (``_supports_sdpa = False``): refused, never computed, on
    both ways in."""
    kernel = _model("switch_transformers")
    kernel.set_attn_implementation(NAME)
    with torch.no_grad(), pytest.raises(ValueError, match="'switch_transformers'.*_supports_sdpa=False"):
        kernel(**_batch("right"))
    with pytest.raises(ValueError, match="the kernel route: .*'switch_transformers'.*_supports_sdpa=False"):
        mh.hf.patch(_model("switch_transformers"))


def test_t5_relative_bias_table_gradient_equals_eager() -> None:
    """The learned bias table's gradient flows through the core's ``bias=`` (and q, k, v's)."""
    eager = _model("t5")
    kernel = copy.deepcopy(eager)
    kernel.set_attn_implementation(NAME)
    batch = _batch("left")
    grads = []
    for model in (eager, kernel):
        model.zero_grad()
        model(**batch).logits.square().sum().backward()
        grads.append((model.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight.grad,
                      model.encoder.block[1].layer[0].SelfAttention.q.weight.grad))
    for want, got in zip(*grads):
        assert _relative(got, want) < 1e-5


def test_an_additive_mask_with_real_values_is_added_as_eager_adds_it() -> None:
    """A float mask holding a bias (not only 0 and the dtype's minimum) was refused; it is now the
    core's ``bias``, with the minimum where masked, exactly as eager attention adds it."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 6, 8, generator=g), torch.randn(2, 2, 6, 8, generator=g), torch.randn(2, 2, 6, 8,
                                                                                                          generator=g)
    additive = torch.randn(2, 1, 6, 6, generator=g)
    additive[1, :, :, :2] = torch.finfo(torch.float32).min  # padding of the second row
    out, _ = mh.hf.attention_forward(torch.nn.Module(), q, k, v, additive, scaling=0.5)  # (B, S, H, D)
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    want = torch.softmax(q @ kr.transpose(-1, -2) * 0.5 + additive, -1) @ vr  # (B, H, S, D)
    torch.testing.assert_close(out.transpose(1, 2), want, rtol=1e-5, atol=1e-6)
