"""A patched model's other nn.Linear layers on the few-row kernel (``mh.hf.patch(linears=True)``).

Oracles: float64 products and ``nn.Linear``'s own forward; HF's generate for the tokens.
Tiny random models (2 layers, E=64). Runtime: a few seconds.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import multihead as mh
from multihead.backends import native
from multihead.interop import hf_linears
from multihead.interop.hf_linears import FewRowLinear
from multihead.linear import few_rows

SMALL = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
         "intermediate_size": 128, "vocab_size": 100}

needs_kernel = pytest.mark.skipif(native.vector_bits() < 256,
                                  reason=f"the few-row kernel needs an AVX2 or AVX-512 build ({native.status()})")


def _llama() -> LlamaForCausalLM:
    torch.random.default_generator.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SMALL)).eval()


def _few_row_linear(n_in: int, n_out: int, bias: bool = True) -> tuple[nn.Linear, FewRowLinear]:
    torch.manual_seed(n_in + n_out)
    plain = nn.Linear(n_in, n_out, bias=bias)
    holder = nn.Sequential(copy.deepcopy(plain))
    hf_linears.patch_linears(holder, ["0"])
    return plain, holder[0]


@needs_kernel
@pytest.mark.parametrize("shape", [(1,), (3,), (8,), (2, 1), (4, 2)], ids=str)
@pytest.mark.parametrize("n_in, n_out, bias", [(64, 100, True), (1027, 37, False), (2816, 1024, True)])
def test_few_rows_are_as_accurate_as_torch(shape: tuple[int, ...], n_in: int, n_out: int, bias: bool) -> None:
    """1 to 8 rows take the kernel; its error against float64 is at most 2× nn.Linear's (and a floor)."""
    plain, patched = _few_row_linear(n_in, n_out, bias)
    x = torch.randn(*shape, n_in)
    with torch.no_grad():
        assert few_rows(x, [(patched.weight, patched.bias)]) is not None
        got, torch_out = patched(x), plain(x)
        exact = nn.functional.linear(x.double(), plain.weight.double(),
                                     None if plain.bias is None else plain.bias.double())
    assert got.shape == torch_out.shape == (*shape, n_out)
    ours, theirs = (got.double() - exact).abs().max().item(), (torch_out.double() - exact).abs().max().item()
    assert ours <= 2 * theirs + 1e-6, (ours, theirs)


def _refused_calls() -> list[tuple[str, torch.Tensor, dict]]:
    return [("9 rows", torch.randn(9, 64), {}), ("3x3 rows", torch.randn(3, 3, 64), {}),
            ("bfloat16", torch.randn(2, 64, dtype=torch.bfloat16), {"dtype": torch.bfloat16}),
            ("float64", torch.randn(2, 64, dtype=torch.float64), {"dtype": torch.float64}),
            ("no rows", torch.randn(0, 64), {})]


@pytest.mark.parametrize("what, x, cast", _refused_calls(), ids=[c[0] for c in _refused_calls()])
def test_every_other_call_is_nn_linear_bitwise(what: str, x: torch.Tensor, cast: dict) -> None:
    plain, patched = _few_row_linear(64, 48)
    plain.to(**cast), patched.to(**cast)
    with torch.no_grad():
        assert few_rows(x, [(patched.weight, patched.bias)]) is None
        assert torch.equal(patched(x), plain(x))


def test_autograd_and_autocast_keep_nn_linear() -> None:
    plain, patched = _few_row_linear(64, 48)
    x = torch.randn(2, 64, requires_grad=True)
    got, want = patched(x), plain(x)  # autograd on: the kernel has no backward
    assert torch.equal(got, want)
    got.sum().backward()
    assert patched.weight.grad is not None and torch.equal(patched.weight.grad, x.detach().sum(0).expand(48, 64))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert patched(x).dtype == plain(x).dtype == torch.bfloat16
        assert torch.equal(patched(x), plain(x))


@needs_kernel
def test_compiled_few_rows_are_the_kernels_operator_and_more_rows_nn_linear() -> None:
    """Traced by torch.compile (one graph, fullgraph), a call of 2 rows is the operator
    multihead::linear_few_rows, bitwise the eager kernel's result; 9 rows are nn.Linear's, bitwise."""
    plain, patched = _few_row_linear(64, 48)
    ops: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> torch.fx.GraphModule:
        ops.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm

    compiled = torch.compile(patched, backend=backend, fullgraph=True)
    two, nine = torch.randn(2, 64), torch.randn(9, 64)
    with torch.no_grad():
        assert torch.equal(compiled(two), patched(two))
        assert few_rows(two, [(patched.weight, patched.bias)]) is not None
        assert any(op.startswith("multihead.linear_few_rows") for op in ops), ops
        assert torch.equal(compiled(nine), plain(nine))


def test_patch_gives_the_path_to_plain_linears_outside_its_wrappers() -> None:
    class Adapter(nn.Linear):
        """A subclass of nn.Linear (as adapters' and quantizers' layers are): left as it is."""

    model = _llama()
    model.model.layers[0].mlp.up_proj.__class__ = Adapter
    mh.hf.patch(model)
    patched = sorted(name for name, m in model.named_modules() if type(m) is FewRowLinear)
    want = sorted([f"model.layers.{i}.mlp.{p}" for i in range(2) for p in ("gate_proj", "up_proj", "down_proj")
                   if (i, p) != (0, "up_proj")] + ["lm_head"])
    assert patched == want
    assert type(model.model.layers[0].mlp.up_proj) is Adapter
    inside = [m for w in model.modules() if isinstance(w, mh.hf.PatchedAttention) for m in w.modules()]
    assert not any(type(m) is FewRowLinear for m in inside)
    assert mh.hf.is_patched(model)
    mh.hf.unpatch(model)
    assert not mh.hf.is_patched(model)
    assert not any(type(m) is FewRowLinear for m in model.modules())
    assert type(model.lm_head) is nn.Linear and type(model.model.layers[0].mlp.up_proj) is Adapter


def test_linears_false_leaves_them_and_a_second_patch_adds_them() -> None:
    model = mh.hf.patch(_llama(), linears=False)
    assert not any(type(m) is FewRowLinear for m in model.modules())
    mh.hf.patch(model)  # the attention is patched already; the linears are not: no "nothing changed" warning
    assert type(model.lm_head) is FewRowLinear


def test_a_refused_patch_leaves_the_linears_alone() -> None:
    model = nn.Sequential(nn.Linear(8, 8))
    with pytest.raises(ValueError, match="no supported attention module"):
        mh.hf.patch(model)
    assert type(model[0]) is nn.Linear
    with pytest.raises(TypeError, match="must be a torch.nn.Linear"):
        hf_linears.patch_linears(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), ["0", "1"])


def test_a_patched_model_copies_and_its_linears_pickle_with_their_outputs() -> None:
    """deepcopy of the model (transformers' own hooks keep a whole model from pickling); a pickled
    FewRowLinear loads back as one."""
    model = mh.hf.patch(_llama())
    ids = torch.randint(0, 100, (1, 5))
    buffer = io.BytesIO()
    torch.save(nn.Sequential(model.lm_head), buffer)
    buffer.seek(0)
    head = torch.load(buffer, weights_only=False)[0]
    x = torch.randn(1, 64)
    with torch.no_grad():
        assert type(head) is FewRowLinear and torch.equal(head(x), model.lm_head(x))
        copied = copy.deepcopy(model)
        assert type(copied.lm_head) is FewRowLinear
        assert torch.equal(copied(ids).logits, model(ids).logits)


@needs_kernel
@pytest.mark.parametrize("batch", [1, 4])
def test_generate_runs_the_linears_on_the_kernel_with_hf_tokens(batch: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy tokens equal the unpatched model's; the decoding steps' MLP and LM head calls run on
    the kernel (counted), and so does the prefill's LM head (one row per prompt), while the
    prefill's MLPs (more than 8 rows) run on torch's."""
    hf = _llama()
    model = mh.hf.patch(copy.deepcopy(hf))
    torch.manual_seed(1)
    ids = torch.randint(3, 100, (batch, 11))
    mask = torch.ones_like(ids)
    mask[1:, :3] = 0  # rows after the first left-padded
    kwargs = {"attention_mask": mask, "max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False,
              "pad_token_id": 0}
    calls = {"kernel": 0, "torch": 0}
    real = hf_linears.few_rows

    def counting(x: torch.Tensor, layers: list) -> list[torch.Tensor] | None:
        out = real(x, layers)
        calls["torch" if out is None else "kernel"] += 1
        return out

    monkeypatch.setattr(hf_linears, "few_rows", counting)
    with torch.no_grad():
        want = hf.generate(ids, **kwargs)
        got = model.generate(ids, **kwargs)
    assert torch.equal(got, want)
    per_step = 2 * 3 + 1  # two layers' gate, up and down projections, and the LM head
    assert calls["kernel"] == 5 * per_step + 1  # the 5 steps after the first token, the prefill's LM head
    assert calls["torch"] == 2 * 3  # the prefill's MLPs


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5, 8])
def test_several_weights_in_chunks_that_straddle_them(rows: int) -> None:
    """The threads take the weights' rows in chunks (256 KB: 16 rows at K=4096) that cross from
    one weight to the next; every output row is computed once, as accurately as torch's."""
    torch.manual_seed(rows)
    x = torch.randn(rows, 4096)
    layers = [(torch.randn(n, 4096), torch.randn(n) if n != 3 else None) for n in (70, 3, 129, 1)]
    outs = native.linear_few_rows(x, layers)
    for out, (w, b) in zip(outs, layers):
        exact = nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
        theirs = (nn.functional.linear(x, w, b).double() - exact).abs().max().item()
        assert (out.double() - exact).abs().max().item() <= 2 * theirs + 1e-6


@needs_kernel
def test_the_same_bits_on_any_number_of_threads() -> None:
    """The kernel picks one thread or all per call (whichever has been faster for the size: timed
    from 1 MB of weights); every output row is computed by one thread with the same chunks, so
    the result never depends on it."""
    torch.manual_seed(0)
    x = torch.randn(3, 1024)
    layers = [(torch.randn(700, 1024), torch.randn(700)), (torch.randn(90, 1024), None)]  # 3.2 MB: timed
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = native.linear_few_rows(x, layers)
        torch.set_num_threads(2)
        for _ in range(40):  # both choices measured, then the faster one and the other now and then
            got = native.linear_few_rows(x, layers)
            assert all(torch.equal(g, w) for g, w in zip(got, want))
    finally:
        torch.set_num_threads(before)


def test_multiheads_own_layers_keep_their_projections() -> None:
    """A model holding a multihead layer beside HF modules: the layer's projections stay nn.Linear
    (its fused decoding step reads plain nn.Linear projections only)."""
    class Both(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = _llama()
            self.extra = mh.MultiHeadAttention(64, 4)

    model = mh.hf.patch(Both())
    assert type(model.lm.lm_head) is FewRowLinear
    assert [type(m) for m in model.extra.modules() if isinstance(m, nn.Linear)] == [nn.Linear] * 4
