"""Converters: torch.nn.MultiheadAttention and Hugging Face modules give the same numbers.

Each HF module is built from a small random config (E=64, H=4, Hkv=2 where the family
has GQA), with every parameter redrawn so that biases are not zero, in eval mode. HF
attention modules apply no mask by themselves in "eager" mode (the model builds it), so
the tests hand them the 4-D additive mask transformers would build (causal, window,
padding) and give our layer only ``key_mask``: causal and window come from the
conversion. Outputs and gradients (inputs and every parameter, mapped with
``state_from_hf``) are compared elementwise.

Notation: B batch, S tokens, E embed_dim, H heads, Hkv key/value heads, D head_dim.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from transformers import BertConfig, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config
from transformers.models.bert.modeling_bert import BertAttention, BertSelfAttention
from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding
from transformers.models.mistral.modeling_mistral import MistralAttention
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention

import multihead as mh
from multihead import interop
from multihead.interop import hf_config

E, H, HKV, B, S = 64, 4, 2, 2, 7
ATOL64 = 1e-10
ATOL32 = 1e-5  # RoPE families run in float32: HF's cos/sin tables are float32 by design
SMALL = {"num_hidden_layers": 2, "vocab_size": 100, "intermediate_size": 128, "attn_implementation": "eager"}


def _randomize(module: nn.Module) -> nn.Module:
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.2)  # HF zero-initialises Conv1D biases; we want them to matter
    return module.eval()


def _real(batch: int = B, s: int = S) -> torch.Tensor:
    """(B, S) True = real token; sequence 1 ends with 3 padding tokens (right padding)."""
    real = torch.ones(batch, s, dtype=torch.bool)
    real[1, s - 3:] = False
    return real


def _hf_mask(real: torch.Tensor, dtype: torch.dtype, *, causal: bool, window: int | None = None) -> torch.Tensor:
    """transformers' eager mask (B, 1, S, S): 0 = attend, finfo.min = blocked."""
    b, s = real.shape
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    allowed = real[:, None, None, :].expand(b, 1, s, s)
    if causal:
        allowed = allowed & (j <= i)
    if window is not None:
        allowed = allowed & (j > i - window)
    return torch.zeros(b, 1, s, s, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


def _backward_and_compare(got: torch.Tensor, want: torch.Tensor, upstream: torch.Tensor, ours, theirs,
                          x: torch.Tensor, x2: torch.Tensor, atol: float, rtol: float = 0.0) -> None:
    """Backpropagate the same upstream gradient through both modules and compare every gradient."""
    (got * upstream).sum().backward()
    (want * upstream).sum().backward()
    _compare_grads(ours, theirs, x, x2, atol, rtol=rtol)


def _compare_grads(ours: mh.MultiHeadAttention, theirs: nn.Module, x_ours: torch.Tensor,
                   x_theirs: torch.Tensor, atol: float, rtol: float = 0.0) -> None:
    got = {n: p.grad for n, p in ours.named_parameters() if p.grad is not None}
    want = interop.state_from_hf(theirs, grads=True)
    assert set(want) <= set(got)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=rtol, atol=atol, msg=name)
    torch.testing.assert_close(x_ours.grad, x_theirs.grad, rtol=rtol, atol=atol)


# ---- torch.nn.MultiheadAttention ------------------------------------------------------------
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_from_torch_equals_nn_multiheadattention(batch_first: bool, bias: bool) -> None:
    theirs = _randomize(nn.MultiheadAttention(E, H, bias=bias, batch_first=batch_first, dtype=torch.float64))
    ours = mh.MultiHeadAttention.from_torch(theirs)
    x = torch.randn(B, S, E, dtype=torch.float64)
    real = _real()
    inp = x if batch_first else x.transpose(0, 1)  # torch's default is (S, B, E): from_torch carries it
    want, _ = theirs(inp, inp, inp, key_padding_mask=~real, need_weights=False)  # True = ignore
    torch.testing.assert_close(ours(inp, key_mask=real), want, rtol=0, atol=ATOL64)


def test_from_torch_carries_kdim_vdim_for_cross_attention() -> None:
    theirs = _randomize(nn.MultiheadAttention(E, H, kdim=24, vdim=24, batch_first=True, dtype=torch.float64))
    ours = interop.from_torch(theirs)
    assert (ours.kdim, ours.vdim) == (24, 24)
    x, ctx = torch.randn(B, S, E, dtype=torch.float64), torch.randn(B, 5, 24, dtype=torch.float64)
    want, _ = theirs(x, ctx, ctx, need_weights=False)
    torch.testing.assert_close(ours(x, ctx), want, rtol=0, atol=ATOL64)


def test_from_torch_overrides_settings_but_not_sizes() -> None:
    theirs = nn.MultiheadAttention(E, H, batch_first=True)
    assert interop.from_torch(theirs, causal=True, backend="explicit").causal
    with pytest.raises(ValueError, match="num_heads"):
        interop.from_torch(theirs, num_heads=2)


def test_from_torch_refuses_bias_kv_and_other_modules() -> None:
    with pytest.raises(ValueError, match="add_bias_kv"):
        interop.from_torch(nn.MultiheadAttention(E, H, add_bias_kv=True))
    with pytest.raises(TypeError, match="module"):
        interop.from_torch(nn.Linear(E, E))


# ---- BERT -------------------------------------------------------------------------------------
def _bert(dtype: torch.dtype = torch.float64) -> BertAttention:
    config = BertConfig(hidden_size=E, num_attention_heads=H, **SMALL)
    return _randomize(BertAttention(config).to(dtype))


def test_bert_attention_converts_with_output_dense_as_o_proj() -> None:
    theirs = _bert()
    ours = mh.MultiHeadAttention.from_hf(theirs)
    assert (ours.num_heads, ours.head_dim, ours.causal, ours.rope) == (H, E // H, False, None)
    x = torch.randn(B, S, E, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    real = _real()
    got = ours(x, key_mask=real)
    want = theirs.output.dense(theirs.self(x2, attention_mask=_hf_mask(real, x.dtype, causal=False))[0])
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL64)
    _backward_and_compare(got, want, torch.randn_like(got), ours, theirs, x, x2, 1e-9)


def test_bert_attention_output_is_ours_plus_residual_and_layernorm() -> None:
    theirs = _bert()
    ours = interop.from_hf(theirs)
    x, real = torch.randn(B, S, E, dtype=torch.float64), _real()
    want = theirs(x, attention_mask=_hf_mask(real, x.dtype, causal=False))[0]
    got = theirs.output.LayerNorm(ours(x, key_mask=real) + x)  # BertSelfOutput without dropout (eval)
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL64)


def test_bert_self_attention_alone_gets_identity_o_proj() -> None:
    theirs = _bert().self
    assert isinstance(theirs, BertSelfAttention)
    ours = interop.from_hf(theirs)
    x, real = torch.randn(B, S, E, dtype=torch.float64), _real()
    want = theirs(x, attention_mask=_hf_mask(real, x.dtype, causal=False))[0]
    torch.testing.assert_close(ours(x, key_mask=real), want, rtol=0, atol=ATOL64)


def test_bert_cross_attention_is_refused() -> None:
    config = BertConfig(hidden_size=E, num_attention_heads=H, is_decoder=True, add_cross_attention=True, **SMALL)
    with pytest.raises(ValueError, match="cross-attention"):
        interop.from_hf(BertAttention(config, is_cross_attention=True))


# ---- GPT-2 ------------------------------------------------------------------------------------
@pytest.mark.parametrize("options", [{}, {"scale_attn_by_inverse_layer_idx": True}, {"scale_attn_weights": False}],
                         ids=["default", "inverse_layer_idx", "unscaled"])
def test_gpt2_attention_converts_fused_transposed_conv1d(options: dict) -> None:
    config = GPT2Config(n_embd=E, n_head=H, n_layer=2, vocab_size=100, attn_implementation="eager", **options)
    theirs = _randomize(GPT2Attention(config, layer_idx=1).double())
    ours = interop.from_hf(theirs)
    assert ours.causal and ours.scale == pytest.approx(theirs.scaling)
    x = torch.randn(B, S, E, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    real = _real()
    got = ours(x, key_mask=real)
    want = theirs(x2, attention_mask=_hf_mask(real, x.dtype, causal=True))[0]
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL64)
    _backward_and_compare(got, want, torch.randn_like(got), ours, theirs, x, x2, 1e-9)


def test_gpt2_cross_attention_is_refused() -> None:
    config = GPT2Config(n_embd=E, n_head=H, n_layer=2, vocab_size=100, add_cross_attention=True)
    with pytest.raises(ValueError, match="cross-attention"):
        interop.from_hf(GPT2Attention(config, is_cross_attention=True, layer_idx=0))


# ---- Llama, Mistral, Qwen2 -----------------------------------------------------------------------
def _llama_family(name: str) -> tuple[nn.Module, nn.Module, int | None]:
    """(attention module, its rotary embedding, expected window)."""
    common = {"hidden_size": E, "num_attention_heads": H, "num_key_value_heads": HKV,
              "max_position_embeddings": 64, **SMALL}
    if name == "llama":
        config = LlamaConfig(rope_theta=500000.0, attention_bias=True, **common)
        module, window = LlamaAttention(config, layer_idx=0), None
    elif name == "mistral":
        config = MistralConfig(sliding_window=3, **common)
        module, window = MistralAttention(config, layer_idx=0), 3
    else:
        config = Qwen2Config(use_sliding_window=True, sliding_window=4, max_window_layers=0, **common)
        module, window = Qwen2Attention(config, layer_idx=0), 4
    return _randomize(module), LlamaRotaryEmbedding(config), window


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2"])
def test_llama_family_converts_gqa_rope_bias_window(name: str) -> None:
    theirs, rotary, window = _llama_family(name)
    ours = interop.from_hf(theirs)
    assert (ours.num_heads, ours.num_kv_heads, ours.causal, ours.window) == (H, HKV, True, window)
    assert ours.rope.base == theirs.config.rope_parameters["rope_theta"]
    if name == "qwen2":  # q/k/v bias, no o bias
        assert ours.q_proj.bias is not None and ours.o_proj.bias is None
    x = torch.randn(B, S, E, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    real = _real()
    got = ours(x, key_mask=real)
    cos_sin = rotary(x2, torch.arange(S)[None])
    want = theirs(x2, position_embeddings=cos_sin,
                  attention_mask=_hf_mask(real, x.dtype, causal=True, window=window))[0]
    # A padding query whose window holds only padding has no key: we give zeros, HF's
    # eager softmax a uniform row over blocked keys. Only real queries are compared.
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=ATOL32)
    _backward_and_compare(got, want, torch.randn_like(got) * real[..., None], ours, theirs, x, x2,
                          1e-5, rtol=1e-4)  # float32 sums over B·S terms


def test_llama_rope_scaling_is_converted_and_an_unknown_type_refused() -> None:
    config = LlamaConfig(hidden_size=E, num_attention_heads=H, **SMALL,
                         rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    layer = interop.from_hf(LlamaAttention(config, layer_idx=0))  # issue #15: every ROPE_INIT_FUNCTIONS type
    assert layer.rope.scaling.rope_type == "linear" and layer.rope.scaling.factor == 2.0
    config.rope_parameters = {"rope_type": "proportional", "factor": 1.0, "rope_theta": 10000.0}
    with pytest.raises(ValueError, match="rope_type"):
        interop.from_hf(LlamaAttention(config, layer_idx=0))


def test_unsupported_module_is_named() -> None:
    with pytest.raises(ValueError, match="Linear is not a supported"):
        interop.from_hf(nn.Linear(4, 4))


# ---- copying back ---------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [_bert, lambda: _llama_family("qwen2")[0]], ids=["bert", "qwen2"])
def test_to_hf_round_trips_weights(make) -> None:
    theirs = make()
    before = {n: p.detach().clone() for n, p in theirs.named_parameters()}
    ours = interop.from_hf(theirs)
    with torch.no_grad():
        for p in theirs.parameters():
            p.zero_()
    interop.to_hf(ours, theirs)
    for n, p in theirs.named_parameters():
        if "LayerNorm" not in n:
            torch.testing.assert_close(p, before[n], rtol=0, atol=0, msg=n)


def test_state_to_hf_inverts_state_from_hf_for_gpt2() -> None:
    theirs = _randomize(GPT2Attention(GPT2Config(n_embd=E, n_head=H, n_layer=1), layer_idx=0))
    back = interop.state_to_hf(interop.state_from_hf(theirs), theirs)
    for name, p in theirs.named_parameters():
        torch.testing.assert_close(back[name], p.detach(), rtol=0, atol=0)


def test_rope_permutation_helpers_are_reexported() -> None:
    w = torch.randn(H * 16, E)
    assert interop.interleaved_to_half is mh.interleaved_to_half
    torch.testing.assert_close(interop.half_to_interleaved(interop.interleaved_to_half(w, H), H), w)


# ---- configs --------------------------------------------------------------------------------------
def test_from_config_builds_gqa_layer_on_meta() -> None:
    config = mh.AttentionConfig(embed_dim=4096, num_heads=32, num_kv_heads=8, head_dim=128, causal=True,
                                bias=False, rope_base=500000.0, window=None)
    layer = mh.MultiHeadAttention.from_config(config, device="meta")
    assert layer.q_proj.weight.is_meta and layer.k_proj.weight.shape == (8 * 128, 4096)
    assert layer.causal and layer.rope.base == 500000.0 and layer.rope.cos.is_meta


def test_from_config_honours_per_layer_heads() -> None:
    config = mh.AttentionConfig(embed_dim=64, num_heads=8, num_kv_heads=8, head_dim=8, num_layers=2,
                                layer_num_heads=(4, 8))
    assert mh.MultiHeadAttention.from_config(config, layer=0).num_heads == 4
    assert mh.MultiHeadAttention.from_config(config, layer=1).num_heads == 8
    with pytest.raises(TypeError, match="AttentionConfig"):
        mh.MultiHeadAttention.from_config({"embed_dim": 64})


@pytest.mark.parametrize("positions", [64, 100_000], ids=["short", "past the cap"])
def test_rope_table_length_is_one_rule_for_converted_and_built_layers(positions: int) -> None:
    config = LlamaConfig(hidden_size=E, num_attention_heads=H, max_position_embeddings=positions, **SMALL)
    converted = interop.from_hf(LlamaAttention(config, layer_idx=0)).rope
    built = mh.MultiHeadAttention.from_config(mh.AttentionConfig.from_hf(config.to_dict())).rope
    assert converted.max_positions == built.max_positions == min(positions, mh.rope.ROPE_TABLE_POSITIONS)


@pytest.mark.parametrize("rope", [
    {"rope_theta": 500000.0},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 250000.0, "partial_rotary_factor": 0.5}},
    {"rotary_emb_base": 20000.0, "rotary_pct": 0.25},  # GPT-NeoX's older names
    {"rope_theta": 1e6, "partial_rotary_factor": 0.5},
    {},  # silent: the default base, every dim rotated
], ids=["theta", "rope_parameters", "older names", "partial", "silent"])
def test_config_reader_and_converters_read_rope_by_one_rule(rope: dict) -> None:
    """AttentionConfig.from_hf (a whole file) and the converters (one module's config) agree on θ and R."""
    cfg = {"model_type": "gpt_neox", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1, **rope}
    config = mh.AttentionConfig.from_hf(cfg)
    base, scaling, factor = hf_config.module_rope(cfg, None, "c", partial=True)
    assert (base, int(config.head_dim * factor), scaling) == (config.rope_base, config.effective_rotary_dim, None)


def test_config_reader_and_converters_refuse_the_same_contradiction() -> None:
    cfg = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1,
           "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "rope_theta": 500000.0}
    with pytest.raises(ValueError, match="contradict"):
        mh.AttentionConfig.from_hf(cfg)
    with pytest.raises(ValueError, match="contradict"):
        interop.from_hf(LlamaAttention(LlamaConfig(hidden_size=E, num_attention_heads=H, **SMALL), layer_idx=0), cfg)


# ---- checkpoint files -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["model.bin", "pytorch_model.bin", "w.pt", "w.pth", "w.ckpt", "w.pkl"])
def test_pickles_are_refused_without_unpickling(tmp_path, monkeypatch, name: str) -> None:
    path = tmp_path / name
    path.write_bytes(b"\x80\x04not really a pickle")
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load was called"))
    with pytest.raises(ValueError, match="never unpickles"):
        interop.load_safetensors(path)


def test_folder_with_only_pickles_is_refused(tmp_path) -> None:
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="pytorch_model.bin"):
        interop.load_safetensors(tmp_path)


def test_corrupt_safetensors_names_the_file(tmp_path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{bad")
    with pytest.raises(ValueError, match="model.safetensors"):
        interop.load_safetensors(path)


def _layer() -> mh.MultiHeadAttention:
    return mh.MultiHeadAttention(E, H, num_kv_heads=HKV, bias=False)


def test_safetensors_round_trip_into_a_layer(tmp_path) -> None:
    src = _layer()
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, str(tmp_path / "model.safetensors"))
    dst = interop.load_state(_layer(), interop.load_safetensors(tmp_path))
    for (n, a), b in zip(src.state_dict().items(), dst.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)


@pytest.mark.parametrize("edit, message", [
    (lambda sd: sd.pop("k_proj.weight"), "missing tensor 'k_proj.weight'"),
    (lambda sd: sd.update({"extra.weight": torch.zeros(2)}), "unexpected tensor 'extra.weight'"),
    (lambda sd: sd.update({"v_proj.weight": torch.zeros(3, E)}), "'v_proj.weight' has shape \\[3, 64\\]"),
], ids=["missing", "extra", "misshaped"])
def test_bad_checkpoints_name_the_key(tmp_path, edit, message: str) -> None:
    sd = {k: v.contiguous() for k, v in _layer().state_dict().items()}
    edit(sd)
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=message):
        interop.load_state(_layer(), interop.load_safetensors(tmp_path / "model.safetensors"))
