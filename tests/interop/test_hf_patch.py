"""multihead inside whole Hugging Face models: ``mh.hf.patch`` and ``attn_implementation="multihead"``.

Small random models (2 layers, E=64, H=4, Hkv=2 where the family has GQA), eval mode, a
batch of two sequences where the second is right-padded. Outputs are compared on real
tokens only: a padding query may see no key at all, where multihead returns zeros and
HF's eager softmax a uniform row.

Notation: B batch, S tokens, E embed_dim.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import (BertConfig, BertModel, GPT2Config, GPT2LMHeadModel, GPT2Model, LlamaConfig,
                          LlamaForCausalLM, LlamaModel, MistralConfig, MistralModel, Qwen2Config, Qwen2Model)

import multihead as mh

B, S, E, H, HKV = 2, 9, 64, 4, 2
ATOL32 = 1e-5
SMALL = {"num_hidden_layers": 2, "vocab_size": 100, "intermediate_size": 128}

MODELS = {
    "bert": (BertModel, lambda: BertConfig(hidden_size=E, num_attention_heads=H, **SMALL)),
    "gpt2": (GPT2Model, lambda: GPT2Config(n_embd=E, n_head=H, n_layer=2, vocab_size=100,
                                           bos_token_id=0, eos_token_id=0)),
    "llama": (LlamaModel, lambda: LlamaConfig(hidden_size=E, num_attention_heads=H, num_key_value_heads=HKV,
                                              attention_bias=True, **SMALL)),
    "mistral": (MistralModel, lambda: MistralConfig(hidden_size=E, num_attention_heads=H,
                                                    num_key_value_heads=HKV, sliding_window=4, **SMALL)),
    "qwen2": (Qwen2Model, lambda: Qwen2Config(hidden_size=E, num_attention_heads=H, num_key_value_heads=HKV,
                                              **SMALL)),
}


def _model(name: str, impl: str = "sdpa") -> nn.Module:
    cls, make_config = MODELS[name]
    torch.random.default_generator.manual_seed(0)
    return cls._from_config(make_config(), attn_implementation=impl).eval()


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(1, 100, (B, S))
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, S - 4:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _hidden(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch).last_hidden_state  # (B, S, E)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("name", list(MODELS))
def test_patched_model_gives_the_same_hidden_states(name: str, impl: str) -> None:
    model, batch = _model(name, impl), _batch()
    want = _hidden(model, batch)
    mh.hf.patch(model)
    assert mh.hf.is_patched(model)
    got = _hidden(model, batch)
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=ATOL32)


@pytest.mark.parametrize("name", list(MODELS))
def test_unpatch_restores_the_original_modules(name: str) -> None:
    model, batch = _model(name), _batch()
    before = dict(model.named_modules())
    want = _hidden(model, batch)
    mh.hf.patch(model)
    assert any(isinstance(m, mh.hf.PatchedAttention) for m in model.modules())
    mh.hf.unpatch(model)
    after = dict(model.named_modules())
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    assert not mh.hf.is_patched(model)
    torch.testing.assert_close(_hidden(model, batch), want, rtol=0, atol=0)


def test_patched_layers_run_multihead() -> None:
    model = mh.hf.patch(_model("llama"))
    wrappers = [m for m in model.modules() if isinstance(m, mh.hf.PatchedAttention)]
    assert len(wrappers) == 2
    calls = []
    wrappers[0].mh.register_forward_hook(lambda *a: calls.append(1))
    with torch.no_grad():  # without an HF cache the wrapper calls the layer itself
        model(**_batch(), use_cache=False)
    assert calls == [1]
    assert wrappers[0].mh.num_kv_heads == HKV and wrappers[0].mh.rope is not None


def test_patched_model_gives_the_same_input_gradients() -> None:
    model, batch = _model("llama", "eager"), _batch()
    embeds = model.embed_tokens(batch["input_ids"]).detach()
    real = batch["attention_mask"].bool()

    def grad() -> torch.Tensor:
        x = embeds.clone().requires_grad_()
        out = model(inputs_embeds=x, attention_mask=batch["attention_mask"]).last_hidden_state
        (out[real] ** 2).sum().backward()
        return x.grad

    want = grad()
    mh.hf.patch(model)
    # float32 through 2 layers of RMSNorm and a sum of squares: agreement to ~1e-4 of grads ~1
    torch.testing.assert_close(grad(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cls, make_config, cache", [
    (LlamaForCausalLM, MODELS["llama"][1], "dynamic"),
    (LlamaForCausalLM, MODELS["llama"][1], "static"),
    (GPT2LMHeadModel, MODELS["gpt2"][1], "dynamic"),
], ids=["llama-dynamic", "llama-static", "gpt2-dynamic"])
def test_patched_model_generates_the_same_tokens_with_hf_cache(cls, make_config, cache: str) -> None:
    torch.random.default_generator.manual_seed(0)
    model = cls._from_config(make_config(), attn_implementation="sdpa").eval()
    prompt = torch.randint(1, 100, (2, 5))
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1, :2] = 0  # HF pads prompts on the left for generation
    kw = {"attention_mask": mask, "max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    if cache == "static":
        kw["cache_implementation"] = "static"
    want = model.generate(prompt, **kw)
    mh.hf.patch(model)
    got = model.generate(prompt, **kw)
    assert got.tolist() == want.tolist()


def test_unsupported_attention_raises_unless_not_strict() -> None:
    config = GPT2Config(n_embd=E, n_head=H, n_layer=2, vocab_size=100, add_cross_attention=True)
    model = GPT2Model._from_config(config).eval()
    before = dict(model.named_modules())
    with pytest.raises(ValueError, match=r"h\.0\.crossattention.*strict=False"):
        mh.hf.patch(model, kernel=False)  # the kernel route takes it: test_kernel_zoo.py
    assert all(a is b for a, b in zip(dict(model.named_modules()).values(), before.values()))
    mh.hf.patch(model, strict=False, kernel=False)
    assert isinstance(model.h[0].attn, mh.hf.PatchedAttention)
    assert not isinstance(model.h[0].crossattention, mh.hf.PatchedAttention)


def test_model_without_attention_is_refused() -> None:
    with pytest.raises(ValueError, match="no supported attention"):
        mh.hf.patch(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(TypeError, match="model"):
        mh.hf.patch("bert")


# ---- attn_implementation="multihead" ---------------------------------------------------------
@pytest.mark.parametrize("name", list(MODELS))
def test_registered_kernel_matches_eager_and_sdpa(name: str) -> None:
    assert mh.hf.register() == "multihead"
    batch = _batch()
    real = batch["attention_mask"].bool()
    got = _hidden(_model(name, "multihead"), batch)
    for impl in ("eager", "sdpa"):
        want = _hidden(_model(name, impl), batch)
        torch.testing.assert_close(got[real], want[real], rtol=0, atol=ATOL32, msg=impl)


def test_registered_kernel_generates_like_sdpa() -> None:
    mh.hf.register()
    prompt = torch.randint(1, 100, (1, 5))
    out = {}
    for impl in ("sdpa", "multihead"):
        torch.random.default_generator.manual_seed(0)
        model = LlamaForCausalLM._from_config(MODELS["llama"][1](), attn_implementation=impl).eval()
        out[impl] = model.generate(prompt, max_new_tokens=6, do_sample=False).tolist()
    assert out["multihead"] == out["sdpa"]


def test_registered_kernel_returns_per_head_weights_when_asked() -> None:
    mh.hf.register()
    model = _model("bert", "multihead")
    with torch.no_grad():
        out = model(**_batch(), output_attentions=True)
    weights = out.attentions[0]  # (B, H, S, S)
    assert weights.shape == (B, H, S, S)
    torch.testing.assert_close(weights.sum(-1), torch.ones(B, H, S))
    assert float(weights[1, :, :, S - 4:].abs().max()) == 0.0  # padding keys get no weight


def test_kernel_applies_softcap_and_adds_bias_masks() -> None:
    """Soft-capping is the core's; an additive mask holding real values is added as a bias, as eager
    attention adds it (it was refused before the core took ``bias=``)."""
    q = torch.randn(1, H, 3, 16)
    module = nn.Module()
    out, _ = mh.hf.attention_forward(module, q, q, q, None, softcap=0.5)
    torch.testing.assert_close(out.transpose(1, 2), mh.attention(q, q, q, softcap=0.5), rtol=0, atol=0)
    alibi = torch.tensor([[0.0, -0.5, -1.0], [-0.5, 0.0, -0.5], [-1.0, -0.5, 0.0]]).expand(1, 1, 3, 3)
    out, _ = mh.hf.attention_forward(module, q, q, q, alibi)
    eager = torch.softmax(q @ q.transpose(-1, -2) / 4 + alibi, -1) @ q  # D = 16: scale 1/4
    torch.testing.assert_close(out.transpose(1, 2), eager, rtol=1e-5, atol=1e-6)


def test_register_refuses_hf_names() -> None:
    with pytest.raises(ValueError, match="name"):
        mh.hf.register("sdpa")


def test_patching_a_bare_attention_module_is_refused() -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention

    cfg = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1)
    att = LlamaAttention(cfg, layer_idx=0)
    with pytest.raises(ValueError, match="itself an attention module"):
        mh.hf.patch(att)
    assert not mh.hf.is_patched(att) and "" not in dict(att.named_children())


def test_unpatch_restores_the_mode_and_dtype_given_while_patched() -> None:
    from transformers import BertConfig, BertModel

    cfg = BertConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=1, intermediate_size=64,
                     vocab_size=50)
    model = BertModel(cfg).eval()
    mh.hf.patch(model)
    model.train().double()
    mh.hf.unpatch(model)
    att = model.encoder.layer[0].attention
    assert att.training and att.self.query.weight.dtype == torch.float64
    out = model(torch.tensor([[1, 2, 3]])).last_hidden_state
    assert out.dtype == torch.float64
