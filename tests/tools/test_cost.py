"""cost(): parameters, FLOPs and KV-cache bytes, checked against published figures,
transformers' own attention modules and torch's FLOP counter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from multihead.config import AttentionConfig
from multihead.tools.cost import Cost, cost

CONFIGS = Path(__file__).parents[1] / "data" / "configs"
KIB = 1024


def real(name: str) -> Path:
    return CONFIGS / f"{name}.json"


# ---- published KV-cache figures -----------------------------------------------------

def test_llama2_7b_kv_cache_is_512_kib_per_token_in_float16():
    c = cost(real("llama-2-7b"), 4096, dtype="float16")
    assert c.kv_cache_bytes_per_token == 32 * 2 * 4096 * 2 == 512 * KIB


def test_llama3_8b_kv_cache_is_128_kib_per_token_in_float16():
    assert cost(real("meta-llama-3-8b"), 8192, dtype="float16").kv_cache_bytes_per_token == 128 * KIB


def test_mistral_7b_caches_as_much_per_token_as_llama3_8b():
    mistral = cost(real("mistral-7b-v0.1"), 4096, dtype="bfloat16")
    llama3 = cost(real("meta-llama-3-8b"), 4096, dtype="bfloat16")
    assert mistral.kv_cache_bytes_per_token == llama3.kv_cache_bytes_per_token == 128 * KIB


@pytest.mark.parametrize(("name", "saving"), [("meta-llama-3-8b", 4.0), ("qwen2-7b", 7.0),
                                              ("llama-2-7b", 1.0), ("gpt2", 1.0)])
def test_gqa_saving_is_query_heads_over_kv_heads(name, saving):
    c = cost(real(name), 1024, dtype="float16")
    assert c.gqa_saving == saving
    assert c.mha_kv_cache_bytes == saving * c.kv_cache_bytes


def test_kv_cache_scales_with_batch_and_seq_len():
    c = cost(real("meta-llama-3-8b"), 8192, batch=3, dtype="float16")
    assert c.kv_cache_bytes == 128 * KIB * 3 * 8192  # 3 GiB


@pytest.mark.parametrize(("dtype", "nbytes"), [("float64", 8), ("float32", 4), ("float16", 2), ("bfloat16", 2),
                                               ("int8", 1), ("fp8", 1), (torch.float16, 2),
                                               (torch.float8_e4m3fn, 1)])
def test_dtype_sets_bytes_per_cached_element(dtype, nbytes):
    c = cost(real("llama-2-7b"), 16, dtype=dtype)
    assert c.bytes_per_element == nbytes
    assert c.kv_cache_bytes_per_token == 32 * 2 * 4096 * nbytes


# ---- parameters ---------------------------------------------------------------------

def test_gpt2_attention_has_2362368_parameters_per_layer():
    # c_attn 768×2304 + 2304, c_proj 768×768 + 768
    c = cost(real("gpt2"), 1024)
    assert c.params_per_layer == 768 * 2304 + 2304 + 768 * 768 + 768 == 2_362_368
    assert c.params_total == 12 * 2_362_368


def _hf_attention_params(name: str) -> int:
    """Linear/Conv1D weights and biases of layer 0's attention in transformers' own model."""
    transformers = pytest.importorskip("transformers")
    raw = {k: v for k, v in json.loads(real(name).read_text()).items() if not k.startswith("_")}
    config = transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)
    for key in ("num_hidden_layers", "n_layer"):
        if hasattr(config, key):
            setattr(config, key, 1)
    with torch.device("meta"):
        model = transformers.AutoModel.from_config(config)
    candidates = [(n, m) for n, m in model.named_modules() if n.split(".")[-1] in ("attn", "self_attn", "attention")]
    _, attn = min(candidates, key=lambda nm: len(nm[0]))
    projections = [m for m in attn.modules() if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"]
    return sum(p.numel() for m in projections for p in m.parameters(recurse=False))


@pytest.mark.parametrize("name", ["gpt2", "bert-base-uncased", "all-MiniLM-L6-v2", "vit-base-patch16-224",
                                  "llama-2-7b", "meta-llama-3-8b", "mistral-7b-v0.1", "qwen2-7b", "qwen3-4b",
                                  "gemma-7b", "pythia-1b", "phi-2"])
def test_params_per_layer_match_transformers_attention_module(name):
    assert cost(real(name), 1).params_per_layer == _hf_attention_params(name)


def test_per_layer_head_counts_are_summed_layer_by_layer():
    config = AttentionConfig(embed_dim=64, num_heads=8, num_kv_heads=8, head_dim=8, num_layers=2,
                             layer_num_heads=(8, 4), bias=False)
    c = cost(config, 10, dtype="float32")
    assert c.params_total == (4 * 64 * 64) + (64 * 32 * 3 + 32 * 64)
    assert c.kv_cache_bytes_per_token == 2 * (8 + 4) * 8 * 4


# ---- FLOPs --------------------------------------------------------------------------

def _explicit_attention(x, wq, wk, wv, wo, num_heads, num_kv_heads):
    """Plain matmuls: the oracle for FlopCounterMode. x (B, S, E) -> (B, S, E)."""
    b, s, _ = x.shape
    q = (x @ wq.T).view(b, s, num_heads, -1).transpose(1, 2)  # (B, H, S, D)
    k = (x @ wk.T).view(b, s, num_kv_heads, -1).transpose(1, 2)  # (B, Hkv, S, D)
    v = (x @ wv.T).view(b, s, num_kv_heads, -1).transpose(1, 2)  # (B, Hkv, S, D)
    k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)  # (B, H, S, D)
    v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)  # (B, H, S, D)
    a = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)  # (B, H, S, S)
    return (a @ v).transpose(1, 2).reshape(b, s, -1) @ wo.T  # (B, S, E)


@pytest.mark.parametrize(("embed_dim", "num_heads", "num_kv_heads", "head_dim"),
                         [(32, 4, 4, 8), (48, 6, 2, 8), (40, 4, 1, 16)])
def test_flops_match_torch_flop_counter(embed_dim, num_heads, num_kv_heads, head_dim):
    b, s = 2, 7
    x = torch.randn(b, s, embed_dim)
    wq = torch.randn(num_heads * head_dim, embed_dim)
    wk = torch.randn(num_kv_heads * head_dim, embed_dim)
    wv = torch.randn(num_kv_heads * head_dim, embed_dim)
    wo = torch.randn(embed_dim, num_heads * head_dim)
    with FlopCounterMode(display=False) as counter:
        _explicit_attention(x, wq, wk, wv, wo, num_heads, num_kv_heads)
    config = AttentionConfig(embed_dim=embed_dim, num_heads=num_heads, num_kv_heads=num_kv_heads,
                             head_dim=head_dim)
    assert cost(config, s, batch=b).flops_total == counter.get_total_flops()


def test_gpt2_flops_by_hand():
    c = cost(real("gpt2"), 1024)
    projections = 2 * 1024 * 4 * 768 * 768  # 2·S·(4·E²) per layer
    scores_and_mix = 2 * (2 * 12 * 1024 * 1024 * 64) // 2  # QKᵀ and A·V, causal half
    assert c.flops_projections == 12 * projections == 57_982_058_496
    assert c.flops_attention == 12 * scores_and_mix == 19_327_352_832
    assert c.flops_total == c.flops_projections + c.flops_attention


def test_causal_mask_halves_the_s_squared_term():
    bidirectional = AttentionConfig(embed_dim=768, num_heads=12, num_kv_heads=12, head_dim=64, num_layers=12)
    causal = AttentionConfig(**{**bidirectional.to_dict(), "causal": True})
    full, half = cost(bidirectional, 1023), cost(causal, 1023)
    assert 2 * half.flops_attention == full.flops_attention
    assert half.flops_projections == full.flops_projections


def test_gqa_changes_projection_flops_not_attention_flops():
    mha = AttentionConfig(embed_dim=4096, num_heads=32, num_kv_heads=32, head_dim=128, causal=True)
    gqa = AttentionConfig(embed_dim=4096, num_heads=32, num_kv_heads=8, head_dim=128, causal=True)
    assert cost(mha, 512).flops_attention == cost(gqa, 512).flops_attention
    assert cost(mha, 512).flops_projections > cost(gqa, 512).flops_projections


def test_sliding_window_counts_min_of_seq_len_and_window_keys_per_query():
    b, h, d, s, w = 2, 4, 8, 100, 16
    base = dict(embed_dim=32, num_heads=h, num_kv_heads=h, head_dim=d)
    windowed = cost(AttentionConfig(**base, window=w), s, batch=b)
    assert windowed.flops_attention == 4 * b * h * d * s * w
    causal = cost(AttentionConfig(**base, window=w, causal=True), s, batch=b)
    assert causal.flops_attention == 4 * b * h * d * s * w - 2 * b * h * d * w * w  # P = S·W − W²/2
    wide = cost(AttentionConfig(**base, window=s + 5, causal=True), s, batch=b)
    assert wide.flops_attention == cost(AttentionConfig(**base, causal=True), s, batch=b).flops_attention


def test_mistral_window_caps_attention_flops_beyond_4096_tokens():
    mistral, llama3 = cost(real("mistral-7b-v0.1"), 32768), cost(real("meta-llama-3-8b"), 32768)
    assert mistral.flops_projections == llama3.flops_projections
    assert mistral.flops_attention < llama3.flops_attention


# ---- inputs and outputs -------------------------------------------------------------

def test_cost_accepts_a_hf_dict_a_path_or_a_config():
    raw = json.loads(real("gpt2").read_text())
    expected = cost(AttentionConfig.from_hf(raw), 64)
    assert cost(raw, 64) == cost(real("gpt2"), 64) == cost(str(real("gpt2")), 64) == expected


def test_to_dict_is_json_ready_and_complete():
    d = cost(real("meta-llama-3-8b"), 128, dtype="bfloat16").to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["gqa_saving"] == 4.0 and d["config"]["num_kv_heads"] == 8
    assert d["flops_total"] == d["flops_projections"] + d["flops_attention"]


def test_format_returns_a_table_without_printing(capsys):
    text = cost(real("llama-2-7b"), 4096, dtype="float16").format()
    assert capsys.readouterr().out == ""
    assert "512.0 KiB" in text and "MHA" in text and "float16" in text
    assert "KV cache per token" in text and "GQA saving" in text


def test_cost_is_frozen():
    c = cost(real("gpt2"), 8)
    assert isinstance(c, Cost)
    with pytest.raises(AttributeError):
        c.seq_len = 9


BAD_ARGS = [
    ({"seq_len": 0}, ValueError, "seq_len"),
    ({"seq_len": -5}, ValueError, "seq_len"),
    ({"seq_len": 1.5}, TypeError, "seq_len"),
    ({"seq_len": True}, TypeError, "seq_len"),
    ({"batch": 0}, ValueError, "batch"),
    ({"batch": "2"}, TypeError, "batch"),
    ({"dtype": "float12"}, ValueError, "dtype.*float12"),
    ({"dtype": "FP16"}, ValueError, "dtype"),
    ({"dtype": 2}, TypeError, "dtype"),
    ({"dtype": torch.bool}, ValueError, "dtype"),
    ({"config": 42}, TypeError, "config"),
    ({"config": CONFIGS / "missing.json"}, ValueError, "missing.json"),
]


@pytest.mark.parametrize(("changes", "error", "message"), BAD_ARGS)
def test_bad_arguments_raise_errors_naming_the_argument(changes, error, message):
    args = {"config": real("gpt2"), "seq_len": 16, **changes}
    config, seq_len = args.pop("config"), args.pop("seq_len")
    with pytest.raises(error, match=message):
        cost(config, seq_len, **args)


# ---- Gemma 2's logit scale and soft-capping in the text output -----------------------

def _gemma2_logits() -> tuple[float, float]:
    """(scale, softcap) as Gemma 2's config.json states them: query_pre_attn_scalar^-1/2 and the cap."""
    raw = json.loads(real("gemma-2-9b").read_text())
    return raw["query_pre_attn_scalar"] ** -0.5, raw["attn_logit_softcapping"]


def test_explain_text_shows_gemma2_scale_and_softcap(capsys):
    from multihead.tools import cli

    scale, softcap = _gemma2_logits()
    assert cli.main(["explain", str(real("gemma-2-9b")), "--seq", "8"]) == 0
    kinds = [line for line in capsys.readouterr().out.splitlines() if "_attention:" in line]
    assert len(kinds) == 2  # sliding and full
    assert all(f"scale {scale:.6g}" in line and f"softcap {softcap:g}" in line for line in kinds)


# ---- latent attention (DeepSeek-V3): one parameter count everywhere ------------------

def _hf_deepseek_attention_params(**changes) -> int:
    """Linear weights and biases of transformers' DeepseekV3Attention for deepseek-v3.json + changes."""
    transformers = pytest.importorskip("transformers")
    raw = {k: v for k, v in json.loads(real("deepseek-v3").read_text()).items() if not k.startswith("_")}
    raw.pop("model_type")
    config = transformers.DeepseekV3Config(**{**raw, **changes, "num_hidden_layers": 1})
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    with torch.device("meta"):
        attn = DeepseekV3Attention(config, layer_idx=0)
    linears = [m for m in attn.modules() if isinstance(m, torch.nn.Linear)]
    return sum(p.numel() for m in linears for p in m.parameters(recurse=False))


SHRUNK_DEEPSEEK = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16,
                   "q_lora_rank": 24, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6}


@pytest.mark.parametrize("changes", [{}, SHRUNK_DEEPSEEK, {**SHRUNK_DEEPSEEK, "attention_bias": True},
                                     {**SHRUNK_DEEPSEEK, "q_lora_rank": None},
                                     {**SHRUNK_DEEPSEEK, "q_lora_rank": None, "attention_bias": True}],
                         ids=["v3", "shrunk", "shrunk-bias", "shrunk-no-q-lora", "shrunk-no-q-lora-bias"])
def test_latent_parameters_agree_in_summary_rows_total_and_transformers(changes):
    raw = {k: v for k, v in json.loads(real("deepseek-v3").read_text()).items() if not k.startswith("_")}
    c = cost({**raw, **changes}, 64)
    expected = _hf_deepseek_attention_params(**changes)
    assert c.params_per_layer == expected
    assert [lc.params for lc in c.layers] == [expected] * raw["num_hidden_layers"]
    assert c.params_total == raw["num_hidden_layers"] * expected


def test_deepseek_v3_parameters_by_hand_from_the_config_fields():
    raw = json.loads(real("deepseek-v3").read_text())
    e, h, r, rq = raw["hidden_size"], raw["num_attention_heads"], raw["kv_lora_rank"], raw["q_lora_rank"]
    dn, dr, dv = raw["qk_nope_head_dim"], raw["qk_rope_head_dim"], raw["v_head_dim"]
    by_hand = e * rq + rq * h * (dn + dr) + e * (r + dr) + r * h * (dn + dv) + h * dv * e
    text = cost(real("deepseek-v3"), 4096).format(per_layer=True)
    assert f"parameters per layer {by_hand:,}".split() == next(
        line for line in text.splitlines() if line.startswith("parameters per layer")).split()
    assert f"{raw['num_hidden_layers'] * by_hand:,}" in text
    rows = [line for line in text.splitlines() if line.split()[:1] and line.split()[0].isdigit()]
    assert len(rows) == raw["num_hidden_layers"] and all(f" {by_hand:,} " in row for row in rows)


def test_deepseek_v3_header_names_latent_attention_not_mha_heads():
    raw = json.loads(real("deepseek-v3").read_text())
    text = cost(real("deepseek-v3"), 4096).format()
    header = text.splitlines()[0]
    assert "MLA" in header and f"r={raw['kv_lora_rank']}" in header
    assert "Hkv=" not in header and "MHA" not in header
    assert "GQA saving" not in text and "latent cache saving" in text


def test_latent_cache_bytes_agree_with_the_latent_cache_new_cache_allocates():
    from multihead.latent import MultiHeadLatentAttention

    config = AttentionConfig.from_hf(real("deepseek-v3"))
    b, s = 2, 3000
    c = cost(config, s, batch=b, dtype="bfloat16")
    layer = MultiHeadLatentAttention.from_config(config, device="meta", dtype=torch.bfloat16)
    assert c.kv_cache_bytes == config.num_layers * layer.new_cache(b, s).nbytes


# ---- sliding windows: the cache is the ring new_cache allocates ------------------------

@pytest.mark.parametrize(("name", "seq_len"), [("mistral-7b-v0.1", 32768), ("mistral-7b-v0.1", 1000),
                                               ("gemma-2-9b", 32768), ("gemma-3-4b", 20000),
                                               ("meta-llama-3-8b", 5000)])
def test_kv_cache_bytes_agree_with_the_caches_new_cache_allocates(name, seq_len):
    from multihead.module import MultiHeadAttention

    config = AttentionConfig.from_hf(real(name))
    b = 2
    c = cost(config, seq_len, batch=b, dtype="float16")
    built = sum(MultiHeadAttention.from_config(config, layer=i, device="meta", dtype=torch.float16)
                .new_cache(b, seq_len).nbytes for i in range(config.num_layers))
    assert c.kv_cache_bytes == built
    assert c.kv_cache_bytes == b * sum(lc.kv_cache_bytes_per_token * lc.cache_tokens for lc in c.layers)


def test_mistral_7b_at_32768_tokens_caches_its_4096_token_window_in_float16():
    raw = json.loads(real("mistral-7b-v0.1").read_text())
    per_token = raw["num_hidden_layers"] * 2 * raw["num_key_value_heads"] * (
        raw["hidden_size"] // raw["num_attention_heads"]) * 2
    c = cost(real("mistral-7b-v0.1"), 32768, dtype="float16")
    assert c.kv_cache_bytes == per_token * raw["sliding_window"] == 512 * KIB * KIB
    assert "512.0 MiB" in c.format() and "4.0 GiB" not in c.format()


def test_cost_text_shows_gemma2_scale_softcap_and_windowed_layers():
    scale, softcap = _gemma2_logits()
    raw = json.loads(real("gemma-2-9b").read_text())
    header = cost(real("gemma-2-9b"), 8192).format().splitlines()[0]
    assert f"scale {scale:.6g}" in header and f"softcap {softcap:g}" in header
    assert f"window {raw['sliding_window']} on {raw['num_hidden_layers'] // 2} of {raw['num_hidden_layers']}" in header
