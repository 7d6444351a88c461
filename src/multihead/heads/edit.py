"""Remove heads: ablate them for a while, rank them by importance, prune them for good.

Notation: B batch, S tokens, E embed_dim, H query heads, Hkv key/value heads, D head_dim,
G = H / Hkv query heads per K/V head, z^h (B, S, D) head h's output before o_proj.

A **head spec** maps each layer, by its index in the model's order (as in
``capture(model).layers``) or by its name, to a list of query-head indices:
``{0: [3, 7], "encoder.layer.5.attention": [0]}``.

Every edit here acts on z^h, o_proj's input ``concat`` (B, S, H·D) where head h owns the
columns h·D .. (h+1)·D − 1; a forward pre-hook on o_proj does it, so it works on the step
path, on Hugging Face's cached-generation path of a patched model, and with gradients.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from ..config import AttentionConfig
from ..module import MultiHeadAttention
from .capture import Capture, check_head_list, find_layers, layer_index

__all__ = ["scale", "ablate", "importance", "Importance", "prune", "pruning_curve", "CurvePoint",
           "config_of", "resolve_spec"]

#: Layers (by index or name) to their heads; a union because Mapping is invariant in its key.
Spec = Mapping[int, Iterable[int]] | Mapping[str, Iterable[int]] | Mapping[int | str, Iterable[int]]
LossFn = Callable[[nn.Module, Any], torch.Tensor]


def resolve_spec(model: nn.Module, spec: Spec, *, argname: str = "spec"
                 ) -> list[tuple[str, MultiHeadAttention, tuple[int, ...]]]:
    """(name, layer, sorted heads) per layer named in ``spec``, model order, validated.

    Raises:
        TypeError: ``spec`` not a mapping, or keys/heads of the wrong type.
        ValueError: an unknown layer name or index, a head out of range or repeated, a
            layer named twice (by index and by name), an unpatched HF model.
    """
    if not isinstance(spec, Mapping):
        raise TypeError(f"{argname} must map layers (index or name) to lists of heads, got {type(spec).__name__}")
    found = find_layers(model)
    names = [n for n, _ in found]
    picked: dict[int, tuple[int, ...]] = {}
    for key, heads in spec.items():
        i = layer_index(names, key, argname)
        if i in picked:
            raise ValueError(f"{argname} names layer {names[i]!r} twice (by index and by name)")
        picked[i] = check_head_list(heads, found[i][1].num_heads, f"{argname}[{key!r}]")
    return [(names[i], found[i][1], picked[i]) for i in sorted(picked) if picked[i]]


def _columns(layer: MultiHeadAttention, heads: Sequence[int]) -> torch.Tensor:
    """Column indices of ``heads`` in o_proj's input (H·D,)."""
    d = layer.head_dim
    return torch.cat([torch.arange(h * d, (h + 1) * d) for h in heads])


@contextmanager
def _pre_hooks(hooks: Sequence[tuple[MultiHeadAttention, Callable]]) -> Iterator[None]:
    handles = []
    try:
        for layer, fn in hooks:
            handles.append(layer.o_proj.register_forward_pre_hook(fn))
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def scale(model: nn.Module, spec: Spec, factor: float) -> Iterator[None]:
    """Multiply the outputs z^h of the heads in ``spec`` by ``factor`` inside the block.

    ``factor = 0`` is zero ablation; ``1 ± ε`` is the gate ξ_h of Michel et al.

    Raises:
        TypeError, ValueError: a bad spec (see :func:`resolve_spec`) or a non-finite factor.
    """
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor):
        raise ValueError(f"factor must be a finite number, got {factor!r}")
    hooks = []
    for _, layer, heads in resolve_spec(model, spec):
        gate = torch.ones(layer.num_heads * layer.head_dim, dtype=torch.float64)
        gate[_columns(layer, heads)] = float(factor)

        def hook(module: nn.Module, args: tuple, gate: torch.Tensor = gate) -> tuple:
            x = args[0]
            return (x * gate.to(x.device, x.dtype), *args[1:])

        hooks.append((layer, hook))
    with _pre_hooks(hooks):
        yield


@contextmanager
def ablate(model: nn.Module, spec: Spec, mode: str = "zero", *, reference: Capture | None = None,
           key_mask: torch.Tensor | None = None) -> Iterator[None]:
    """Remove the contributions of the heads in ``spec`` inside the block.

    Args:
        model: a MultiHeadAttention, a module containing them, or a patched HF model.
        spec: layer (index or name) -> head indices.
        mode: ``"zero"``: z^h = 0 (equals :func:`prune`); ``"mean"``: z^h = the head's mean
            output over the real tokens of a reference batch, at every position.
        reference: for ``"mean"``, a :class:`Capture` holding ``"heads"`` of the layers in
            ``spec`` (all their heads).
        key_mask: (B, S) real tokens of the reference batch (default: all real).

    Raises:
        TypeError, ValueError (before anything runs): a bad spec or mode, a missing or
            incomplete reference, a key_mask of the wrong shape.
    """
    if mode not in ("zero", "mean"):
        raise ValueError(f"mode must be 'zero' or 'mean', got {mode!r}")
    resolved = resolve_spec(model, spec)
    if mode == "zero":
        if reference is not None:
            raise ValueError("reference is only used by mode='mean'")
        with scale(model, spec, 0.0):
            yield
        return
    hooks = [(layer, _mean_hook(layer, heads, _head_means(reference, key_mask, name, layer)))
             for name, layer, heads in resolved]
    with _pre_hooks(hooks):
        yield


def _head_means(reference: Capture | None, key_mask: torch.Tensor | None, name: str,
                layer: MultiHeadAttention) -> torch.Tensor:
    """(H, D) mean of each head's output over the reference batch's real tokens."""
    if not isinstance(reference, Capture):
        raise TypeError(f"mode='mean' needs reference=a Capture with 'heads', got {type(reference).__name__}")
    if name not in reference.heads or len(reference.info[name].heads) != layer.num_heads:
        raise ValueError(f"reference holds no 'heads' of all {layer.num_heads} heads of layer {name!r}")
    z = reference.heads[name].double()  # (B, H, S, D)
    b, _, s, _ = z.shape
    real = torch.ones(b, s, dtype=torch.bool) if key_mask is None else key_mask
    if not isinstance(real, torch.Tensor) or tuple(real.shape) != (b, s):
        raise ValueError(f"key_mask must be a (B, S) = ({b}, {s}) tensor, got "
                         f"{list(real.shape) if isinstance(real, torch.Tensor) else type(real).__name__}")
    w = real.to(z.device, torch.float64)[:, None, :, None]  # (B, 1, S, 1)
    return (z * w).sum(dim=(0, 2)) / w.sum().clamp_min(1)  # (H, D)


def _mean_hook(layer: MultiHeadAttention, heads: Sequence[int], means: torch.Tensor) -> Callable:
    cols = _columns(layer, heads)
    fill = means[list(heads)].reshape(-1)  # (len(heads)·D,)

    def hook(module: nn.Module, args: tuple) -> tuple:
        x = args[0].clone()  # (B, S, H·D); never write into the layer's own tensor
        x[..., cols.to(x.device)] = fill.to(x.device, x.dtype)
        return (x, *args[1:])

    return hook


# ---- importance ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Importance:
    """Head importance, (L, H) tensors over the model's layers (NaN where a layer has fewer heads).

    Attributes:
        layers: layer names in model order.
        gradient: Michel et al.'s score after the chosen normalisations, or None.
        ablation: mean loss change when the head alone is ablated (zero), or None.
        normalize: the normalisation steps applied to ``gradient``, in order.
        granularity: ``"example"`` or ``"batch"``.
    """

    layers: tuple[str, ...]
    gradient: torch.Tensor | None
    ablation: torch.Tensor | None
    normalize: tuple[str, ...]
    granularity: str

    def ranking(self, by: str = "gradient") -> list[tuple[int, int, float]]:
        """(layer, head, score), most important first."""
        scores = {"gradient": self.gradient, "ablation": self.ablation}.get(by, "bad")
        if isinstance(scores, str):
            raise ValueError(f"by must be 'gradient' or 'ablation', got {by!r}")
        if scores is None:
            raise ValueError(f"this Importance has no {by!r} scores (it was not computed)")
        cells = [(i, h, float(scores[i, h])) for i in range(scores.shape[0]) for h in range(scores.shape[1])
                 if not math.isnan(float(scores[i, h]))]
        return sorted(cells, key=lambda c: (-c[2], c[0], c[1]))


def _count_tokens(batch: Any) -> int:
    if isinstance(batch, Mapping) and isinstance(batch.get("attention_mask"), torch.Tensor):
        return int(batch["attention_mask"].sum())
    raise ValueError("normalize 'tokens' needs batches that are mappings with an 'attention_mask' tensor")


def _per_example(loss: object, where: str) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.dim() != 1:
        raise ValueError(f"loss_fn must return a 1-D tensor of per-example losses (B,), got "
                         f"{list(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__} ({where})")
    return loss


def _gradient_scores(model: nn.Module, batches: Sequence[Any], loss_fn: LossFn, granularity: str,
                     found: list[tuple[str, MultiHeadAttention]]) -> tuple[list[torch.Tensor], int]:
    """Σ over units (examples or batches) of |∂L_unit/∂ξ_h|, per layer (H,); and the unit count."""
    totals = [torch.zeros(layer.num_heads, dtype=torch.float64) for _, layer in found]
    units = 0
    for batch in batches:
        gates: list[torch.Tensor | None] = [None] * len(found)
        hooks = [(layer, _gate_hook(i, layer, gates, granularity)) for i, (_, layer) in enumerate(found)]
        with _pre_hooks(hooks), torch.enable_grad():
            losses = _per_example(loss_fn(model, batch), "gradient pass")
            used = [g for g in gates if g is not None]
            if len(used) != len(found):
                raise ValueError("some attention layers did not run during loss_fn(model, batch)")
            total = losses.sum() if granularity == "example" else losses.mean()
            grads = torch.autograd.grad(total, used, allow_unused=True)
        for i, g in enumerate(grads):
            g = torch.zeros_like(used[i]) if g is None else g
            totals[i] += g.detach().abs().double().cpu().reshape(-1, totals[i].numel()).sum(0)
        units += losses.shape[0] if granularity == "example" else 1
    return totals, units


def _gate_hook(i: int, layer: MultiHeadAttention, gates: list, granularity: str) -> Callable:
    """Multiply z^h by ξ_h = 1 (a leaf that collects ∂L/∂ξ): (B, H) per example, or (H,)."""
    def hook(module: nn.Module, args: tuple) -> tuple:
        x = args[0]  # (B, S, H·D)
        shape = (x.shape[0], layer.num_heads) if granularity == "example" else (layer.num_heads,)
        if gates[i] is not None:
            raise ValueError("a layer ran twice inside one loss_fn call; the gate would be shared")
        gates[i] = torch.ones(shape, dtype=x.dtype, device=x.device, requires_grad=True)
        xi = gates[i].repeat_interleave(layer.head_dim, dim=-1)  # (B, H·D) or (H·D,)
        return (x * (xi[:, None, :] if xi.dim() == 2 else xi), *args[1:])
    return hook


def _normalise(scores: list[torch.Tensor], steps: Sequence[str], units: int, tokens: int | None) -> list[torch.Tensor]:
    # tokens: the real-token count, given exactly when "tokens" is among the steps (else None).
    scores = [s / (units if tokens is None else tokens) for s in scores]
    if "layer" in steps:  # Michel et al.: L2 per layer
        scores = [s / s.norm().clamp_min(1e-20) for s in scores]
    if "global" in steps:  # bertology: min-max over all heads
        flat = torch.cat(scores)
        lo, hi = flat.min(), flat.max()
        scores = [(s - lo) / (hi - lo).clamp_min(1e-20) for s in scores]
    return scores


def _ablation_scores(model: nn.Module, batches: Sequence[Any], loss_fn: LossFn,
                     found: list[tuple[str, MultiHeadAttention]], removed: Mapping[int, Sequence[int]],
                     progress: Callable[[str], None] | None) -> list[torch.Tensor]:
    """Mean loss change (over all examples) when each remaining head is zero-ablated too."""
    def mean_loss(extra: Mapping[int, Sequence[int]]) -> float:
        spec = {i: sorted(set(removed.get(i, ())) | set(extra.get(i, ()))) for i in set(removed) | set(extra)}
        total, count = 0.0, 0
        with torch.no_grad(), scale(model, spec, 0.0):
            for batch in batches:
                losses = _per_example(loss_fn(model, batch), "ablation pass")
                total += float(losses.double().sum())
                count += losses.shape[0]
        return total / max(count, 1)

    base = mean_loss({})
    out = []
    for i, (name, layer) in enumerate(found):
        row = torch.full((layer.num_heads,), math.nan, dtype=torch.float64)
        for h in range(layer.num_heads):
            if h not in removed.get(i, ()):
                row[h] = mean_loss({i: [h]}) - base
        out.append(row)
        if progress is not None:
            progress(f"ablation: layer {i + 1}/{len(found)} ({name})")
    return out


def _stack(rows: list[torch.Tensor]) -> torch.Tensor:
    width = max(r.numel() for r in rows)
    out = torch.full((len(rows), width), math.nan, dtype=torch.float64)
    for i, r in enumerate(rows):
        out[i, :r.numel()] = r
    return out


def importance(model: nn.Module, batches: Iterable[Any], loss_fn: LossFn, *, gradient: bool = True,
               ablation: bool = True, granularity: str = "example", normalize: Sequence[str] = ("layer",),
               progress: Callable[[str], None] | None = None) -> Importance:
    """Rank heads by Michel et al.'s gradient score and by the loss change when ablated.

    Gradient score (Michel et al. 2019, "Are Sixteen Heads Really Better than One?"): a gate
    ξ_h = 1 multiplies each head's output z^h; I_h = E_x |∂L(x)/∂ξ_h|.

    * ``granularity="example"`` (the paper's definition): |∂L_x/∂ξ_h| per example x (one
      gate per example and head, so one backward pass gives them all), summed, then
      divided by the number of examples.
    * ``granularity="batch"`` (Hugging Face's old ``run_bertology.py``): |∂ L̄_batch/∂ξ_h|
      of each batch's mean loss, summed, divided by the number of batches.

    Normalisation steps, each optional, applied in this order when listed in ``normalize``:
    ``"tokens"`` divides the sum by the total number of real tokens instead (bertology;
    batches must be mappings with an ``attention_mask``), ``"layer"`` divides each layer's
    scores by their L2 norm (the paper), ``"global"`` min-max scales all heads to [0, 1]
    (bertology). The gradient at ξ = 1 must be informative: a loss that is minimal at the
    unablated model (e.g. 1 − cos to its own embeddings) has zero gradient there.

    Ablation score: Δ_h = mean_x L_x(z^h = 0) − mean_x L_x, one forward pass per head.

    Args:
        model: a MultiHeadAttention, a module containing them, or a patched HF model.
        batches: a re-iterable collection of batches, each passed as ``loss_fn(model, batch)``.
        loss_fn: returns the per-example losses (B,) of one batch.
        gradient, ablation: which scores to compute.
        progress: called with a short line after each layer of the ablation pass.

    Returns:
        an :class:`Importance` with (L, H) score tables.

    Raises:
        TypeError, ValueError (before any pass): bad arguments; (during) a loss_fn that
            does not return (B,) losses.
    """
    if granularity not in ("example", "batch"):
        raise ValueError(f"granularity must be 'example' or 'batch', got {granularity!r}")
    normalize = (normalize,) if isinstance(normalize, str) else tuple(normalize)
    bad = [n for n in normalize if n not in ("tokens", "layer", "global")]
    if bad:
        raise ValueError(f"normalize steps must be among 'tokens', 'layer', 'global', got {bad}")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable (model, batch) -> (B,) losses, got {type(loss_fn).__name__}")
    if not (gradient or ablation):
        raise ValueError("nothing to compute: gradient and ablation are both False")
    batches = list(batches)
    if not batches:
        raise ValueError("batches must hold at least one batch")
    tokens = sum(_count_tokens(b) for b in batches) if "tokens" in normalize else None
    found = find_layers(model)
    grad = abl = None
    if gradient:
        sums, units = _gradient_scores(model, batches, loss_fn, granularity, found)
        grad = _stack(_normalise(sums, normalize, units, tokens))
    if ablation:
        abl = _stack(_ablation_scores(model, batches, loss_fn, found, {}, progress))
    return Importance(tuple(n for n, _ in found), grad, abl, normalize, granularity)


# ---- pruning ------------------------------------------------------------------------------
def _new_linear(old: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    new = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None,
                    device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        new.weight.copy_(weight)
        if bias is not None:
            new.bias.copy_(bias)
    new.weight.requires_grad_(old.weight.requires_grad)
    if bias is not None:
        new.bias.requires_grad_(old.bias.requires_grad)
    return new


def _prune_plan(name: str, layer: MultiHeadAttention, heads: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """Kept query heads and kept K/V heads; refuses layouts the layer cannot express."""
    h, hkv = layer.num_heads, layer.num_kv_heads
    group = h // hkv
    keep = [i for i in range(h) if i not in heads]
    if not keep:
        raise ValueError(f"spec removes every head of layer {name!r} ({h} heads): keep at least one "
                         "(removing a whole attention layer is not head pruning)")
    keep_kv = sorted({i // group for i in keep})
    sizes = {kv: sum(1 for i in keep if i // group == kv) for kv in keep_kv}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"pruning heads {list(heads)} of layer {name!r} leaves K/V groups of unequal sizes "
                         f"{sizes} (K/V head -> query heads kept); query head i must read K/V head i // G with one G "
                         "per layer, so remove the same number of query heads from every group it keeps")
    if layer.per_head_extras:
        raise ValueError(f"layer {name!r} has per-head state {layer.per_head_extras} that pruning does not "
                         "slice; pruning it is not supported")
    for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
        if type(getattr(layer, p)) is not nn.Linear:
            raise TypeError(f"layer {name!r}: {p} is a {type(getattr(layer, p)).__name__}, not a plain "
                            "nn.Linear; pruning would drop its behaviour")
    return keep, keep_kv


def prune(model: nn.Module, spec: Spec) -> nn.Module:
    """Remove the heads in ``spec`` for real, in place: their rows of q_proj, the rows of
    k_proj/v_proj of K/V heads left with no query head (GQA: a K/V head goes when all its
    query heads go), and their columns of o_proj. ``num_heads`` and ``num_kv_heads`` are
    updated, so parameters, FLOPs and the KV cache shrink; the result equals
    ``ablate(model, spec, "zero")`` up to float rounding.

    Returns:
        ``model``.

    Raises:
        TypeError, ValueError (before anything changes): a bad spec, every head of a layer,
            GQA groups left unequal, projections that are not plain nn.Linear.
    """
    plans = [(name, layer, *_prune_plan(name, layer, heads)) for name, layer, heads in resolve_spec(model, spec)]
    for _name, layer, keep, keep_kv in plans:
        d = layer.head_dim
        rows_q = torch.cat([torch.arange(i * d, (i + 1) * d) for i in keep])
        rows_kv = torch.cat([torch.arange(i * d, (i + 1) * d) for i in keep_kv])
        with torch.no_grad():
            q, k, v, o = layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj
            layer.q_proj = _new_linear(q, q.weight[rows_q.to(q.weight.device)],
                                       None if q.bias is None else q.bias[rows_q.to(q.weight.device)])
            layer.k_proj = _new_linear(k, k.weight[rows_kv.to(k.weight.device)],
                                       None if k.bias is None else k.bias[rows_kv.to(k.weight.device)])
            layer.v_proj = _new_linear(v, v.weight[rows_kv.to(v.weight.device)],
                                       None if v.bias is None else v.bias[rows_kv.to(v.weight.device)])
            layer.o_proj = _new_linear(o, o.weight[:, rows_q.to(o.weight.device)], o.bias)
        layer.num_heads, layer.num_kv_heads = len(keep), len(keep_kv)
    return model


def config_of(model: nn.Module) -> AttentionConfig:
    """The :class:`multihead.AttentionConfig` of a model's attention layers (for :func:`multihead.cost`),
    with ``layer_num_heads`` when pruning left layers with different head counts.

    Raises:
        ValueError: layers that differ in anything but H (or, for MHA, Hkv = H), e.g. a
            GQA model pruned to different Hkv per layer, which one config cannot describe.
    """
    layers = [m for _, m in find_layers(model)]
    first = layers[0]

    def fields(m: MultiHeadAttention) -> dict[str, Any]:
        return {"embed_dim": m.embed_dim, "head_dim": m.head_dim, "causal": m.causal,
                "bias": m.q_proj.bias is not None, "o_bias": m.o_proj.bias is not None, "window": m.window,
                "rope_base": None if m.rope is None else float(m.rope.base), "scale": m.scale,
                "mha": m.num_kv_heads == m.num_heads, "hkv": None if m.num_kv_heads == m.num_heads else m.num_kv_heads}

    base = fields(first)
    for i, m in enumerate(layers):
        if fields(m) != base:
            raise ValueError(f"layer {i} differs from layer 0 in more than its head count "
                             f"({fields(m)} vs {base}); one AttentionConfig cannot describe them")
    heads = [m.num_heads for m in layers]
    h = max(heads)
    return AttentionConfig(embed_dim=first.embed_dim, num_heads=h,
                           num_kv_heads=h if base["mha"] else first.num_kv_heads, head_dim=first.head_dim,
                           num_layers=len(layers), causal=first.causal, bias=base["bias"], o_bias=base["o_bias"],
                           rope_base=base["rope_base"], window=first.window, scale=first.scale,
                           layer_num_heads=None if len(set(heads)) == 1 else tuple(heads))


# ---- pruning curve ------------------------------------------------------------------------
@dataclass(frozen=True)
class CurvePoint:
    """One step of :func:`pruning_curve`: the share of heads left and the mean loss then."""

    heads_left: int
    share_left: float
    loss: float
    removed: dict[int, list[int]]


def pruning_curve(model: nn.Module, batches: Iterable[Any], loss_fn: LossFn, *, step: float = 0.1,
                  stop: float = 0.0, progress: Callable[[str], None] | None = None) -> list[CurvePoint]:
    """Remove the least important ``step`` share of all heads (by the ablation score with the
    heads removed so far ablated), re-rank, repeat; record the mean loss at each step.

    Heads are removed by zero ablation (equal to :func:`prune`, which the tests check), never
    the last head of a layer. The model is left as it was.

    Args:
        step: share of the model's heads removed per step, in (0, 1).
        stop: end once the share of heads left is at or below this.

    Returns:
        points from all heads (share 1.0) down.
    """
    if isinstance(step, bool) or not isinstance(step, (int, float)) or not 0 < step < 1:
        raise ValueError(f"step must be in (0, 1), got {step!r}")
    if isinstance(stop, bool) or not isinstance(stop, (int, float)) or not 0 <= stop < 1:
        raise ValueError(f"stop must be in [0, 1), got {stop!r}")
    batches = list(batches)
    found = find_layers(model)
    total = sum(m.num_heads for _, m in found)
    per_step = max(1, round(step * total))
    removed: dict[int, list[int]] = {}

    def loss_now() -> float:
        spec = {i: hs for i, hs in removed.items() if hs}
        values = []
        with torch.no_grad(), scale(model, spec, 0.0):
            for batch in batches:
                values.append(_per_example(loss_fn(model, batch), "pruning curve").double())
        return float(torch.cat(values).mean())

    points = [CurvePoint(total, 1.0, loss_now(), {})]
    while True:
        left = total - sum(len(v) for v in removed.values())
        if left / total <= stop:
            break
        scores = _ablation_scores(model, batches, loss_fn, found, removed, None)
        cells = sorted((float(s[h]), i, h) for i, s in enumerate(scores) for h in range(s.numel())
                       if not math.isnan(float(s[h])))
        taken = 0
        for _, i, h in cells:
            if taken == per_step:
                break
            if found[i][1].num_heads - len(removed.get(i, [])) <= 1:
                continue  # never the last head of a layer
            removed.setdefault(i, []).append(h)
            taken += 1
        if taken == 0:
            break
        left = total - sum(len(v) for v in removed.values())
        points.append(CurvePoint(left, left / total, loss_now(), {i: sorted(v) for i, v in removed.items()}))
        if progress is not None:
            progress(f"pruning curve: {left}/{total} heads left")
    return points
