"""Ablation, importance and pruning: pruned == zero-ablated, exact cost shrinkage, Michel's score."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import multihead as mh


class Stack(nn.Module):
    """Two attention layers with a residual, enough for heads to matter downstream."""

    def __init__(self, num_kv_heads: int | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.a = mh.MultiHeadAttention(32, 4, num_kv_heads=num_kv_heads, causal=True, rope=mh.RoPE(8), dtype=dtype)
        self.b = mh.MultiHeadAttention(32, 4, num_kv_heads=num_kv_heads, causal=True, rope=mh.RoPE(8), dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.a(x)
        return x + torch.tanh(self.b(x))


@pytest.mark.parametrize("kv, spec", [(None, {0: [1, 2], "b": [0]}), (2, {0: [0, 1], 1: [1, 3]})])
def test_pruning_equals_zero_ablation(kv, spec) -> None:
    model = Stack(kv)
    x = torch.randn(2, 6, 32)
    with torch.no_grad():
        with mh.heads.ablate(model, spec, "zero"):
            ablated = model(x)
        pruned = mh.heads.prune(copy.deepcopy(model), spec)(x)
    torch.testing.assert_close(pruned, ablated, rtol=0, atol=1e-6)


def test_gqa_drops_a_kv_head_only_when_all_its_query_heads_go() -> None:
    model = mh.heads.prune(Stack(2), {0: [0, 1], 1: [1, 3]})
    assert (model.a.num_heads, model.a.num_kv_heads) == (2, 1)  # group {0, 1} gone with K/V head 0
    assert (model.b.num_heads, model.b.num_kv_heads) == (2, 2)  # one head left in each group
    assert model.a.k_proj.weight.shape == (8, 32) and model.b.k_proj.weight.shape == (16, 32)


def test_pruned_parameters_and_cost_shrink_by_the_exact_amount() -> None:
    model = Stack()
    full = mh.cost(mh.heads.config_of(model), 16, batch=2)
    n_full = sum(p.numel() for p in model.parameters())
    mh.heads.prune(model, {0: [1, 2], 1: [0]})
    e, d, s, b, removed = 32, 8, 16, 2, 3
    per_head_params = (e * d + d) * 3 + d * e  # q, k, v rows with biases; o columns (MHA: K/V go too)
    assert n_full - sum(p.numel() for p in model.parameters()) == removed * per_head_params
    after = mh.cost(mh.heads.config_of(model), 16, batch=2)
    assert full.params_total - after.params_total == removed * per_head_params
    assert full.flops_projections - after.flops_projections == removed * 2 * b * s * (3 * e * d + d * e)
    assert full.flops_attention - after.flops_attention == removed * (4 * b * d * s * s - 2 * b * d * s * s)
    assert full.kv_cache_bytes - after.kv_cache_bytes == removed * 2 * d * 4 * b * s
    assert model.a.new_cache(1, 4).k.shape[1] == 2  # the cache holds the K/V heads left


def test_mean_ablation_puts_the_reference_mean_in_place_of_the_head() -> None:
    layer = mh.MultiHeadAttention(16, 2)
    x = torch.randn(3, 5, 16)
    key_mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2, [True] * 4 + [False]])
    with torch.no_grad(), mh.heads.capture(layer, what=("heads",)) as ref:
        layer(x, key_mask=key_mask)
    z = ref.heads[""].clone()  # (B, H, S, D)
    mean = z[:, 1][key_mask].mean(0)  # (D,)
    with torch.no_grad(), mh.heads.ablate(layer, {0: [1]}, "mean", reference=ref, key_mask=key_mask):
        y = layer(x, key_mask=key_mask)
    z[:, 1] = mean
    torch.testing.assert_close(y, layer.o_proj(mh.merge_heads(z)).detach(), rtol=0, atol=1e-6)


def _loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).pow(2).mean(dim=(1, 2))  # (B,)


def test_michel_score_equals_a_finite_difference_of_the_gate() -> None:
    model = Stack(2, dtype=torch.float64)
    batches = [torch.randn(3, 5, 32, dtype=torch.float64), torch.randn(2, 5, 32, dtype=torch.float64)]
    imp = mh.heads.importance(model, batches, _loss, ablation=False, normalize=())
    eps = 1e-6
    for layer in (0, 1):
        for head in range(4):
            grads = []
            for batch in batches:
                with torch.no_grad(), mh.heads.scale(model, {layer: [head]}, 1 + eps):
                    up = _loss(model, batch)
                with torch.no_grad(), mh.heads.scale(model, {layer: [head]}, 1 - eps):
                    down = _loss(model, batch)
                grads.append((up - down) / (2 * eps))  # (B,) per example
            expected = torch.cat(grads).abs().mean()
            assert float(imp.gradient[layer, head]) == pytest.approx(float(expected), rel=1e-6, abs=1e-10)


def test_per_batch_granularity_and_normalisations() -> None:
    model = Stack(dtype=torch.float64)
    one = [torch.randn(1, 5, 32, dtype=torch.float64)]
    a = mh.heads.importance(model, one, _loss, ablation=False, normalize=())
    b = mh.heads.importance(model, one, _loss, ablation=False, normalize=(), granularity="batch")
    torch.testing.assert_close(a.gradient, b.gradient)  # batch of one: the two agree
    n = mh.heads.importance(model, one, _loss, ablation=False, normalize=("layer", "global"))
    layer_normed = a.gradient / a.gradient.norm(dim=1, keepdim=True)
    expected = (layer_normed - layer_normed.min()) / (layer_normed.max() - layer_normed.min())
    torch.testing.assert_close(n.gradient, expected)


def test_ablation_importance_is_the_loss_change() -> None:
    model = Stack()
    batches = [torch.randn(2, 5, 32)]
    imp = mh.heads.importance(model, batches, _loss, gradient=False)
    with torch.no_grad():
        base = _loss(model, batches[0]).mean()
        with mh.heads.ablate(model, {1: [2]}):
            ablated = _loss(model, batches[0]).mean()
    assert float(imp.ablation[1, 2]) == pytest.approx(float(ablated - base), rel=1e-5, abs=1e-7)
    assert len(imp.ranking("ablation")) == 8


def test_pruning_curve_removes_a_share_per_step_and_leaves_the_model_alone() -> None:
    model = Stack()
    x = torch.randn(2, 5, 32)
    before = model(x).detach()
    points = mh.heads.pruning_curve(model, [x], _loss, step=0.25)
    assert [p.heads_left for p in points] == [8, 6, 4, 2]  # never the last head of a layer
    assert points[0].share_left == 1.0 and points[-1].share_left == 0.25
    torch.testing.assert_close(model(x).detach(), before)


def test_bad_specs_are_refused_before_anything_changes() -> None:
    model = Stack(2)
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="removes every head of layer 'a'"):
        mh.heads.prune(model, {1: [0], 0: [0, 1, 2, 3]})
    with pytest.raises(ValueError, match="unequal sizes"):
        mh.heads.prune(model, {0: [0]})
    with pytest.raises(ValueError, match=r"head index must be in \[0, 3\], got 4"):
        mh.heads.prune(model, {0: [4]})
    with pytest.raises(ValueError, match="no attention layer named 'c'"):
        mh.heads.ablate(model, {"c": [0]}).__enter__()
    with pytest.raises(ValueError, match="names layer 'a' twice"):
        mh.heads.prune(model, {0: [1], "a": [2]})
    assert model.a.num_heads == 4 and all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


def _tiny_llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                      num_hidden_layers=2, intermediate_size=128, vocab_size=100,
                                      max_position_embeddings=64)
    torch.random.default_generator.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def test_a_pruned_patched_model_refuses_its_hf_state_dict_by_name(tmp_path) -> None:
    """HF's class has no pruned shapes: state_dict/save_pretrained name the pruning and the way
    out (save before pruning, prune again after loading: the same outputs), never a bare shape error."""
    model = mh.hf.patch(_tiny_llama())
    model.save_pretrained(tmp_path / "base")  # unpruned: saved as the HF class loads it
    spec = {0: [0, 1]}  # layer 0: 4 -> 2 heads, Hkv 2 -> 1
    mh.heads.prune(model, spec)
    want = r"heads were pruned \(4 query / 2 K/V heads -> 2 / 1\).*prune again after loading"
    with pytest.raises(ValueError, match=want):
        model.state_dict()
    with pytest.raises(ValueError, match=want):
        model.save_pretrained(tmp_path / "pruned")
    again = mh.heads.prune(mh.hf.patch(type(model).from_pretrained(tmp_path / "base").eval()), spec)
    ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, model(ids).logits, rtol=0, atol=0)
