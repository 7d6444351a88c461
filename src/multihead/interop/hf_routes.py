"""The kernel route of :func:`multihead.hf.patch`: an attention module no registered wrapper takes,
run through transformers' ``AttentionInterface`` with multihead's kernel.

Notation: B batch, S tokens, H query heads, D head_dim.

A module is on this route when it *dispatches*: its class's ``forward`` looks its attention
function up in transformers' ``ALL_ATTENTION_FUNCTIONS`` by its config's ``_attn_implementation``
(the interface transformers documents for custom kernels), and the kernel accepts its model
(:func:`multihead.interop.hf_kernel.refusal`: transformers lets the model run ``"sdpa"``, whose
contract the kernel keeps). Then HF keeps its projections, RoPE and cache, and multihead computes
softmax(QKᵀ)V (:func:`multihead.interop.hf_kernel.attention_forward`), exact by construction.
A keyword argument the kernel does not implement is refused by name: at patch time where the
class's forward names it in its call of the attention function (:func:`unimplemented_keywords`:
DeepSeek-V3.2's sparse ``indices``), else when the module runs.

Routing sets ``_attn_implementation`` to :data:`~multihead.interop.hf_kernel.NAME` on exactly the
configs the dispatching modules read, and remembers what was there, so :func:`restore` puts it
back. transformers builds the model's masks for that name as it does for ``"sdpa"`` (bool, True =
attend), which registered wrappers sharing the config read as well as any other HF mask.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from dataclasses import dataclass
from typing import Any

from torch import nn

from .hf_kernel import BACKEND_ATTR, KEYWORDS, NAME, refusal, register

__all__ = ["Route", "WRAPPER", "KERNEL", "REFUSED", "dispatches", "dispatches_class", "dispatchers",
           "kernel_refusal", "unimplemented_keywords", "route", "restore", "routed", "dispatches_here", "BACKEND_ATTR"]

WRAPPER, KERNEL, REFUSED = "wrapper", "kernel", "refused"
#: Where a routed model remembers each config it changed and the implementation it held.
_SAVED = "_multihead_kernel_route"


@dataclass(frozen=True)
class Route:
    """How :func:`multihead.hf.patch` handles one attention module of a model.

    Attributes:
        name: the module's dotted name in the model (``model.layers.0.self_attn``).
        cls: its class name.
        route: ``"wrapper"`` (a registered wrapper around :class:`multihead.MultiHeadAttention`: our
            projections, RoPE, cache, fused decoding, packing and capture), ``"kernel"`` (HF's
            module, multihead's kernel through ``AttentionInterface``) or ``"refused"``.
        why: what runs, or why the module is refused (the reasons of both routes).
    """

    name: str
    cls: str
    route: str
    why: str


@functools.cache
def dispatches_class(cls: type) -> bool:
    """Whether ``cls.forward`` (under its decorators) looks its attention function up in
    ``ALL_ATTENTION_FUNCTIONS``."""
    forward = getattr(cls, "forward", None)
    if forward is None:
        return False
    code = getattr(inspect.unwrap(forward), "__code__", None)
    return code is not None and "ALL_ATTENTION_FUNCTIONS" in code.co_names


def dispatches(module: nn.Module) -> bool:
    """Whether ``module``'s forward dispatches through ``AttentionInterface``."""
    return dispatches_class(type(module))  # type: ignore[arg-type]  # classes hash by identity


def dispatchers(module: nn.Module) -> list[nn.Module]:
    """``module`` and the modules inside it whose forward dispatches through ``AttentionInterface``."""
    return [m for m in module.modules() if dispatches_class(type(m))]  # type: ignore[arg-type]


@functools.cache
def unimplemented_keywords(cls: type) -> frozenset[str]:
    """The keyword arguments ``cls.forward`` names in its call of the attention function it looks up
    (a name it assigns from an expression reading ``ALL_ATTENTION_FUNCTIONS``) that the kernel
    does not know (:data:`multihead.interop.hf_kernel.KEYWORDS`); empty where the source cannot be
    read (the kernel still checks every call)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(cls.forward))))  # type: ignore[attr-defined]
    except (OSError, TypeError, SyntaxError):
        return frozenset()
    looked_up = {target.id for node in ast.walk(tree) if isinstance(node, ast.Assign | ast.AnnAssign)
                 and node.value is not None and "ALL_ATTENTION_FUNCTIONS" in ast.unparse(node.value)
                 for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
                 if isinstance(target, ast.Name)}
    passed = {kw.arg for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in looked_up for kw in node.keywords if kw.arg is not None}
    return frozenset(passed - KEYWORDS)


def kernel_refusal(module: nn.Module) -> str | None:
    """Why ``module`` cannot take the kernel route, or None where it can (see the module's docstring)."""
    found = dispatchers(module)
    if not found:
        return ("its forward does not dispatch through transformers' AttentionInterface (no "
                "ALL_ATTENTION_FUNCTIONS lookup), so the multihead kernel cannot be put in it")
    for m in found:
        if getattr(m, "config", None) is None or not hasattr(m.config, "_attn_implementation"):
            return f"{type(m).__name__} dispatches through AttentionInterface without a config to set"
        why = refusal(m)
        if why is not None:
            return why
        unknown = unimplemented_keywords(type(m))  # type: ignore[arg-type]  # classes hash by identity
        if unknown:
            return (f"{type(m).__name__} passes {sorted(unknown)} to its attention function, which the "
                    "multihead kernel does not implement")
    return None


def route(model: nn.Module, modules: list[nn.Module], backend: str | None) -> None:
    """Put the kernel in ``modules`` (each accepted by :func:`kernel_refusal`), remembering what
    changes on ``model`` for :func:`restore`. ``backend``: the core backend the kernel uses (None:
    the library's choice)."""
    register()
    saved: list[tuple[Any, Any]] = model.__dict__.setdefault(_SAVED, [])
    for module in modules:
        for m in dispatchers(module):
            config: Any = m.config
            if not any(c is config for c, _ in saved):
                saved.append((config, config._attn_implementation))
            config._attn_implementation_internal = NAME  # this config only, not its sub-configs
            if backend is not None:
                m.__dict__[BACKEND_ATTR] = backend


def restore(model: nn.Module) -> None:
    """Undo :func:`route` everywhere inside ``model``: each config gets its implementation back."""
    for module in model.modules():
        for config, implementation in module.__dict__.pop(_SAVED, []):
            config._attn_implementation_internal = implementation
        module.__dict__.pop(BACKEND_ATTR, None)


def dispatches_here(module: nn.Module) -> bool:
    """Whether ``module`` itself dispatches through ``AttentionInterface`` to the multihead kernel now."""
    return dispatches(module) and getattr(getattr(module, "config", None), "_attn_implementation", None) == NAME


def routed(module: nn.Module) -> bool:
    """Whether ``module`` runs the multihead kernel through ``AttentionInterface`` now (every
    dispatching module inside it does)."""
    found = dispatchers(module)
    return bool(found) and all(dispatches_here(m) for m in found)
