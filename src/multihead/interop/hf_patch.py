"""Run Hugging Face models on multihead: patch their attention modules, or register a kernel.

Notation: B batch, S tokens (queries), Sk keys, E embed_dim, H query heads, Hkv key/value
heads, D head_dim.

Two ways in, for two needs:

* :func:`patch` swaps every supported attention *module* of a model (the classes of
  :data:`multihead.interop.hf_registry.REGISTRY`, exact or refused: a class that is not
  listed, or carries something its description does not cover, is refused by name)
  for a wrapper around a converted
  :class:`~multihead.MultiHeadAttention`: our projections, split, RoPE, attention, concat
  and o_proj run; the wrapper keeps the HF module's forward signature and return value
  ``(attn_output (B, S, E), None)``, so the model runs unchanged. :func:`unpatch` puts the
  original module objects back. DeepSeek-V2/V3's latent attention is wrapped around a
  :class:`~multihead.MultiHeadLatentAttention` instead (HF's cache then holds the latent and
  the rotary key, and decoding attends through the absorbed up-projections).
* :func:`register` adds multihead's attention *kernel* to transformers'
  ``AttentionInterface`` under ``"multihead"``; then ``attn_implementation="multihead"``
  works for any model that dispatches through that registry (HF keeps its own
  projections and RoPE, we do the softmax(QKᵀ)V).

HF hands attention a 4-D mask (B or 1, 1, S, Sk): bool (True = attend, the ``"sdpa"``
format, which :func:`register` asks for) or additive float (``"eager"``: 0 or
``finfo.min``); or None when the mask is purely causal or absent, with causality in
``module.is_causal``. :func:`multihead.masks.from_additive` turns float masks into ours.

Every wrapper composes the layer's public steps (``project``, ``split``, ``rotate``,
``attend``, ``output``), with or without HF's cache, so what the steps do holds on every
patched class: ``output_attentions=True`` returns each layer's weights (B, H, S, Sk), as the
eager HF class does (transformers 5 records them with hooks that :func:`patch` installs on
the wrappers as they were on the originals), and :func:`multihead.heads.capture` records
every call, cached ones included. DeepSeek's latent attention refuses both by name.
A wrapper's ``state_dict`` is the original module's (names and layout), holding the
wrapper's current weights, so ``save_pretrained`` writes a checkpoint the unpatched class
loads; loading a state dict *into* a patched model is refused (unpatch first). Weights
trained while patched stay in the wrappers until saved or copied back with
:func:`multihead.interop.to_hf`. During generation
HF's own cache object is kept: the wrapper then runs the layer's modules step by step
around ``cache.update`` (see :meth:`PatchedAttention.attend`); BART, mBART and Whisper's
cross-attention fills and reads HF's ``EncoderDecoderCache`` as those classes do. Other
cross-attention modules (GPT-2's, BERT's) are refused.

This module imports transformers lazily: ``import multihead`` never imports it.
"""

from __future__ import annotations

import re
import warnings
from typing import Any, Literal, overload

from torch import nn

from ..latent import MultiHeadLatentAttention
from ..module import MultiHeadAttention
from . import hf_linears, hf_mrope, hf_registry, hf_routes, hf_wrappers, hf_wrappers_other
from .hf_kernel import NAME, attention_forward, register
from .hf_recorders import record_like_the_original, restore_recording
from .hf_routes import Route
from .hf_weights import convert
from .hf_wrappers import MRopeWrapper, PatchedAttention
from .hf_wrappers_other import LatentWrapper

__all__ = ["patch", "unpatch", "is_patched", "routes", "Route",
           "register", "attention_forward", "PatchedAttention", "NAME",
           "attention_modules", "set_submodule"]

#: The wrapper class of each registry ``call`` (DeepSeek's latent attention: :class:`LatentWrapper`).
_WRAPPERS = {**hf_wrappers.WRAPPERS, **hf_wrappers_other.WRAPPERS}


_ATTENTION_NAME = re.compile(r"Attention|Attn|SelfAttn", re.IGNORECASE)


def attention_modules(model: nn.Module, *, include_patched: bool = False) -> list[tuple[str, nn.Module]]:
    """Top-most attention modules (supported or not; wrappers too if asked), in model order.

    A registered class is always a candidate; any other module whose class name says
    attention, or whose forward dispatches through transformers' ``AttentionInterface``, is one
    (for the kernel route, or to be refused by name) unless a registered class sits inside it, or
    its class is in :data:`~multihead.interop.hf_registry.LEFT_ALONE` (it holds only torch's
    own ``nn.MultiheadAttention``: left as it is, with everything inside it).
    """
    found: list[tuple[str, nn.Module]] = []
    taken: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(f"{prefix}.") for prefix in taken):
            continue  # inside an attention module already taken (BertAttention.self, a wrapper's mh)
        if hf_registry.qualified_name(module) in hf_registry.LEFT_ALONE:
            taken.append(name)  # outside the patch's scope, its torch MHA too
        elif isinstance(module, PatchedAttention):
            taken.append(name)
            if include_patched:
                found.append((name, module))
        elif isinstance(module, (MultiHeadAttention, MultiHeadLatentAttention)):
            taken.append(name)  # ours already
        elif hf_registry.spec_of(module) is not None or (
                (_ATTENTION_NAME.search(type(module).__name__) or hf_routes.dispatches(module))
                and not _holds_registered(module)):
            taken.append(name)
            found.append((name, module))
    return found


def _holds_registered(module: nn.Module) -> bool:
    return any(hf_registry.spec_of(m) is not None or isinstance(m, PatchedAttention)
               for _, m in module.named_modules() if m is not module)


def _wrap(module: nn.Module, overrides: dict[str, Any]) -> PatchedAttention:
    """The wrapper for one candidate; ValueError naming the class and the reason otherwise."""
    spec = hf_registry.require_spec(module)
    if spec.call is None:
        raise ValueError(f"{spec.name} is converted with multihead.MultiHeadAttention.from_hf but not patched "
                         "alone; patch the model that holds its parent attention module")
    if spec.layout == "latent":  # DeepSeek
        return LatentWrapper(module, MultiHeadLatentAttention.from_hf(module, **overrides))
    return _WRAPPERS[spec.call](module, convert(module, **overrides))  # the layer its wrapper completes


#: What a module on the kernel route runs (:attr:`Route.why`).
_ON_KERNEL = "HF's module, the multihead kernel through AttentionInterface"


def _wrapper_route(name: str, original: nn.Module) -> Route:
    """The route of a module ``original`` that a registered wrapper takes (or took)."""
    spec = hf_registry.require_spec(original)
    return Route(name, type(original).__name__, hf_routes.WRAPPER, f"registered: {spec.name}")


def _decide(name: str, module: nn.Module, overrides: dict[str, Any],
            kernel: bool) -> tuple[Route, PatchedAttention | None]:
    """The best exact route for one candidate: its registered wrapper, else (``kernel``) the kernel
    through AttentionInterface, else refused with both reasons."""
    cls = type(module).__name__
    try:
        wrapper = _wrap(module, overrides)
    except ValueError as e:
        not_wrapped = str(e)
    else:
        return _wrapper_route(name, module), wrapper
    if not kernel:
        return Route(name, cls, hf_routes.REFUSED, not_wrapped), None
    why_not_kernel = hf_routes.kernel_refusal(module)
    if why_not_kernel is None:
        if hf_registry.spec_of(module) is None:
            not_wrapped = f"{cls} is not a registered class"
        return Route(name, cls, hf_routes.KERNEL, f"{_ON_KERNEL} (no wrapper: {not_wrapped})"), None
    return Route(name, cls, hf_routes.REFUSED, f"{not_wrapped}; the kernel route: {why_not_kernel}"), None


def routes(model: nn.Module, *, kernel: bool = True) -> list[Route]:
    """How :func:`patch` handles (or handled) each attention module of ``model``, in model order;
    nothing is changed.

    On a model not patched yet, each module's :class:`~multihead.interop.hf_routes.Route` is what
    :func:`patch` would do; on a patched one, a wrapper reads ``"wrapper"``, a module running the
    kernel ``"kernel"``, and a module left as it was ``"refused"`` with the reason.

    Raises:
        TypeError: ``model`` is not an nn.Module.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    found = []
    for name, module in attention_modules(model, include_patched=True):
        if isinstance(module, PatchedAttention):
            found.append(_wrapper_route(name, module.original))
        elif hf_routes.routed(module):
            found.append(Route(name, type(module).__name__, hf_routes.KERNEL, _ON_KERNEL))
        else:
            found.append(_decide(name, module, {}, kernel)[0])
    return found


#: The modules whose projections multihead already runs (their nn.Linear stay as they are).
_OURS = (PatchedAttention, MultiHeadAttention, MultiHeadLatentAttention)


@overload
def patch(model: nn.Module, *, strict: bool = ..., backend: str | None = ..., kernel: bool = ...,
          linears: bool = ..., report: Literal[False] = ...) -> nn.Module: ...


@overload
def patch(model: nn.Module, *, strict: bool = ..., backend: str | None = ..., kernel: bool = ...,
          linears: bool = ..., report: Literal[True]) -> list[Route]: ...


def patch(model: nn.Module, *, strict: bool = True, backend: str | None = None, kernel: bool = True,
          linears: bool = True, report: bool = False) -> nn.Module | list[Route]:
    """Run every attention module of ``model`` on multihead, in place, each by the best exact route.

    Exact or refused, per module (:func:`routes` lists the decision and its reason):

    * ``"wrapper"``: its class is in :data:`multihead.interop.hf_registry.REGISTRY` and its
      description covers it (see :func:`multihead.interop.hf_registry.why_not`): the module is
      replaced by a wrapper around a converted :class:`~multihead.MultiHeadAttention` (our
      projections, RoPE, in-place cache, fused decoding step, packing and head capture);
    * ``"kernel"`` (``kernel=True``): otherwise, where the module dispatches through
      transformers' ``AttentionInterface`` and transformers lets its model run ``"sdpa"``: HF's
      module stays, and multihead's kernel computes its softmax(QKᵀ)V
      (:mod:`multihead.interop.hf_routes`); a keyword argument the kernel does not implement is
      refused by name when the module runs;
    * ``"refused"``: neither, with both reasons.

    With ``linears=True``, the model's other plain ``nn.Linear`` layers (MLPs, the LM head)
    also run their few-row calls without autograd (decoding) on multihead's few-row kernel,
    which streams the weights faster than torch's GEMM; every other call is unchanged
    (:mod:`multihead.interop.hf_linears`).

    Args:
        model: a transformers model (e.g. BertModel, GPT2Model, LlamaForCausalLM).
        strict: raise on an attention module that cannot be converted exactly; False leaves
            such modules as they are, with one warning that lists them and why.
        backend: multihead backend for the converted layers and the kernel (default: the library's).
        kernel: allow the kernel route (False: registered wrappers only).
        linears: also give the model's other ``nn.Linear`` layers the few-row path (False: they
            stay torch's).
        report: return :func:`routes` of the patched model instead of the model.

    Returns:
        ``model`` (patched in place; weights are copied, mode and dtype kept), or with
        ``report=True`` each attention module's :class:`~multihead.interop.hf_routes.Route`.
        Patching a model that is already patched, with nothing left to patch, changes nothing
        and warns so.

    Raises:
        TypeError: ``model`` is not an nn.Module.
        ValueError: no supported attention module found, or (``strict``) one that is not
            supported, naming it and why; the model is left unchanged then.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    overrides = {} if backend is None else {"backend": backend}
    candidates = attention_modules(model)
    if any(name == "" for name, _ in candidates):
        raise ValueError(f"model is itself an attention module ({type(model).__name__}): patch the model that "
                         "contains it, or convert it with multihead.MultiHeadAttention.from_hf")
    plan: list[tuple[str, PatchedAttention]] = []
    to_kernel: list[nn.Module] = []
    skipped: list[str] = []
    for name, module in candidates:
        if hf_routes.routed(module):
            continue  # on the kernel route already
        decided, wrapper = _decide(name, module, overrides, kernel)
        if wrapper is not None:
            plan.append((name, wrapper))
        elif decided.route == hf_routes.KERNEL:
            to_kernel.append(module)
        elif strict:
            raise ValueError(f"cannot patch {name} ({decided.cls}): {decided.why}; "
                             "pass strict=False to leave it unpatched")
        else:
            skipped.append(f"{name} ({decided.why})")
    already = is_patched(model)
    inside = tuple(f"{name}." for name, _ in plan)  # the modules the wrappers replace
    few_row = [n for n in hf_linears.linears_to_patch(model, skip=_OURS) if not n.startswith(inside)
               ] if linears else []
    if not plan and not to_kernel and not already:
        why = f": {'; '.join(skipped[:3])}" if skipped else ""
        raise ValueError(f"model {type(model).__name__} has no supported attention module to patch{why}")
    if skipped:
        warnings.warn(f"multihead.hf.patch left {len(skipped)} attention module(s) unpatched: "
                      + "; ".join(skipped), stacklevel=2)
    if not plan and not to_kernel and not few_row:
        warnings.warn(f"model {type(model).__name__} is already patched; nothing left to patch, "
                      "nothing changed", stacklevel=2)
    for name, wrapper in plan:  # only now, so that a failure above leaves the model untouched
        set_submodule(model, name, wrapper)
        record_like_the_original(model, name, wrapper)
    hf_linears.patch_linears(model, few_row)
    hf_mrope.link(model, [(name, w) for name, w in plan if isinstance(w, MRopeWrapper)])
    hf_routes.route(model, to_kernel, backend)
    return routes(model) if report else model


def unpatch(model: nn.Module) -> nn.Module:
    """Put the original HF modules back (the same objects :func:`patch` removed).

    The originals follow the mode (train/eval), dtype and device the model was given
    while patched. Weights changed while patched are *not* copied back; use
    :func:`multihead.interop.to_hf` on ``wrapper.mh`` and ``wrapper.original`` for that. Modules
    on the kernel route get their configs' attention implementation back.

    Returns:
        ``model``.
    """
    for name, module in list(model.named_modules()):
        if isinstance(module, PatchedAttention):
            original = module.original
            # The original sat outside the module tree while patched: bring it to the
            # mode, dtype and device the model was moved to meanwhile.
            weight = module.mh.o_proj.weight  # every layer class has o_proj (latent ones may lack q_proj)
            original.to(device=weight.device, dtype=weight.dtype).train(module.training)
            set_submodule(model, name, original)
            restore_recording(model, name, module)
            hf_mrope.unlink(module)
    hf_routes.restore(model)
    hf_linears.unpatch_linears(model)
    return model


def is_patched(model: nn.Module) -> bool:
    """Whether any module of ``model`` is a :class:`PatchedAttention`, runs the multihead kernel
    through the kernel route, or is a :class:`~multihead.interop.hf_linears.FewRowLinear`."""
    return any(isinstance(m, (PatchedAttention, hf_linears.FewRowLinear)) or hf_routes.dispatches_here(m)
               for m in model.modules())


def set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` at the dotted ``name`` inside ``model`` (replacing what is there)."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)
