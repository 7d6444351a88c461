"""Record what each head of each attention layer computed during a forward pass.

Notation: B batch, S tokens (queries), Sk keys, H query heads, Hkv key/value heads,
D head_dim, E embed_dim, L captured layers.

    with mh.heads.capture(model) as cap:
        model(**batch)
    cap.layers                 # layer names in the model's order (index = position)
    cap.weights[name]          # (B, H, S, Sk) per head, never averaged
    cap.heads[name]            # (B, H, S, D) each head's output, before o_proj

A captured layer is watched (:meth:`multihead.MultiHeadAttention.watched`): each of its
steps reports what it computed, and its attention runs on a backend that returns weights
(the ``"explicit"`` backend, unless the layer names another one that does); every other
layer, and every layer once the context has ended, keeps its fast path. The steps report
on every path that composes them: the module, and every patched Hugging Face class, with
or without a cache. Calls through a KV cache (``use_cache=True``, ``generate``) append
their rows: after a prefill of P tokens and N single-token steps, ``cap.weights[name]``
is (B, H, P+N, Sk), each call's rows zero-padded to the longest key count, and
``cap.heads``/``cap.q`` (B, H, P+N, D); ``cap.k``/``cap.v`` are the last call's (the cache's
keys and values: every token's).

A module on :func:`multihead.hf.patch`'s kernel route (Hugging Face's module, multihead's kernel
through ``AttentionInterface``) is captured too, under its own name: the kernel reports each call
(:data:`multihead.interop.hf_kernel.WATCH_ATTR`), which records what it received and computed,
after HF's projections, QK-norm, RoPE and cache: ``q``, ``k``, ``v``, the weights and ``heads``,
the kernel's per-head output (HF's module may still change it before its output projection, a
gate). Its :class:`LayerInfo` is read from its first call (the shapes, the ``is_causal`` and
``sliding_window`` it passes, checked against its mask), so such a layer appears in
``cap.layers`` once it has run. Its later calls continue the rows only as a decoding step: a
causal layer whose keys hold every earlier query's and the new ones (a cache), or a layer that is
not causal (cross-attention) given one query over the same keys; anything else is refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..backends import get_spec
from ..functional import default_backend
from ..latent import MultiHeadLatentAttention
from ..masks import Structure, full_mask
from ..module import MultiHeadAttention

if TYPE_CHECKING:
    from ..interop.hf_kernel import KernelCall

__all__ = ["capture", "Capture", "LayerInfo", "find_layers", "capture_layers", "DEFAULT_LIMIT_BYTES",
           "WORKSPACE_COPIES", "WHAT"]

#: What a capture can record (``what=``).
WHAT = ("weights", "heads", "q", "k", "v")
#: The default ceiling on the bytes a capture may hold (``limit_bytes=`` raises it).
DEFAULT_LIMIT_BYTES = 1 << 30
#: How many (B, H, S, Sk) tensors of every head the weights-returning backend (``"explicit"``)
#: holds at once while a captured layer runs: the scores, their masked copy and the softmax
#: (measured with the profiler's allocation events; tests/heads/test_capture_memory.py).
WORKSPACE_COPIES = 3


@dataclass(frozen=True)
class LayerInfo:
    """Facts about one captured layer that the metrics and pictures need."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    causal: bool
    window: int | None
    heads: tuple[int, ...]  # the query heads stored (row h of a stored tensor is head heads[h])
    value_dim: int | None = None  # the values' (and heads') width where it differs from head_dim (MiMo-V2)


def find_layers(model: nn.Module) -> list[tuple[str, MultiHeadAttention]]:
    """The :class:`MultiHeadAttention` layers of ``model`` in module order, named as the model
    names them: a layer inside a :class:`multihead.hf.PatchedAttention` takes the wrapper's
    name (``encoder.layer.0.attention``), so names match the unpatched model's. What
    :mod:`multihead.heads.edit` changes (ablation, scaling, pruning).

    Raises:
        TypeError: ``model`` is not an nn.Module.
        ValueError: ``model`` holds multi-head latent attention (DeepSeek), whose heads are not
            recorded, Hugging Face attention modules that are not patched, or on
            :func:`multihead.hf.patch`'s kernel route (HF's module holds their heads; they would be
            missing from the list), or no attention layer at all.
    """
    return [(n, m) for n, m in capture_layers(model, kernel=False) if isinstance(m, MultiHeadAttention)]


def capture_layers(model: nn.Module, *, kernel: bool = True) -> list[tuple[str, nn.Module]]:
    """The attention layers :func:`capture` can record, in module order, named as the unpatched model
    names them: each :class:`MultiHeadAttention` (a wrapper's under the wrapper's name) and, with
    ``kernel``, each Hugging Face attention module on :func:`multihead.hf.patch`'s kernel route.

    Raises:
        TypeError, ValueError: as :func:`find_layers`; with ``kernel``, a kernel-route module that
            runs the kernel in more than one submodule (one call per layer is recorded).
    """
    from .. import hf, interop
    from ..interop import hf_routes
    from ..interop.hf_patch import attention_modules

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    candidates = attention_modules(model)
    routed = [(n, m) for n, m in candidates if hf_routes.routed(m)]
    if routed and not kernel:
        listed = _listed([(n, type(m).__name__) for n, m in routed])
        raise ValueError(f"model has {len(routed)} attention module(s) on multihead.hf.patch's kernel route (Hugging "
                         f"Face's module, multihead's kernel), e.g. {listed}: multihead.heads edits the heads of "
                         "layers patched with a wrapper only (multihead.heads.capture records both routes)")
    for n, m in routed:
        inside = [type(d).__name__ for d in hf_routes.dispatchers(m)]
        if len(inside) != 1:
            raise ValueError(f"{n or '<model>'} ({type(m).__name__}) runs the multihead kernel in {len(inside)} "
                             f"modules ({', '.join(inside)}): multihead.heads.capture records one attention per layer")
    on_kernel = {id(m) for _, m in routed}
    unpatched = [(n, type(m).__name__) for n, m in candidates
                 if id(m) not in on_kernel and interop.hf_family(m) is not None]
    if unpatched:
        raise ValueError(f"model has {len(unpatched)} Hugging Face attention module(s) that are not patched, "
                         f"e.g. {_listed(unpatched)}: call multihead.hf.patch(model) first so that multihead computes "
                         "(and can record) their heads")
    wrapper_of: dict[int, str] = {}
    for name, module in model.named_modules():
        if isinstance(module, hf.PatchedAttention):
            wrapper_of[id(module.mh)] = name
    latent = [wrapper_of.get(id(m), n) for n, m in model.named_modules() if isinstance(m, MultiHeadLatentAttention)]
    if latent:
        raise ValueError(f"model has {len(latent)} multi-head latent attention layer(s) (DeepSeek), e.g. "
                         f"{latent[0] or '<model>'}: multihead.heads does not record latent attention's heads")
    found = [(wrapper_of.get(id(m), n), m) for n, m in model.named_modules()
             if isinstance(m, MultiHeadAttention) or id(m) in on_kernel]
    if not found:
        raise ValueError(f"model {type(model).__name__} contains no multihead.MultiHeadAttention layer "
                         "(nor a patched Hugging Face attention module)")
    return found


def _listed(modules: list[tuple[str, str]]) -> str:
    """The first three (name, class) pairs, as an error message lists them."""
    return ", ".join(f"{n or '<model>'} ({t})" for n, t in modules[:3])


def resolve_layers(found: Sequence[tuple[str, nn.Module]], layers: Iterable[int | str] | None,
                   argname: str = "layers") -> list[int]:
    """Indices into ``found`` for ``layers`` (indices in model order or names), in model order.

    Raises:
        TypeError: an entry that is neither int nor str.
        ValueError: an index out of range or an unknown name (the valid ones are listed).
    """
    if layers is None:
        return list(range(len(found)))
    if isinstance(layers, (str, int)):
        layers = [layers]
    names = [n for n, _ in found]
    picked: set[int] = set()
    for entry in layers:
        picked.add(layer_index(names, entry, argname))
    return sorted(picked)


def layer_index(names: Sequence[str], entry: object, argname: str) -> int:
    """One layer given by its index in model order or by its name, as an index."""
    if isinstance(entry, bool) or not isinstance(entry, (int, str)):
        raise TypeError(f"{argname} entries must be layer indices (int) or names (str), got "
                        f"{type(entry).__name__} {entry!r}")
    if isinstance(entry, int):
        if not 0 <= entry < len(names):
            raise ValueError(f"{argname}: layer index must be in [0, {len(names) - 1}], got {entry}")
        return entry
    if entry not in names:
        shown = ", ".join(repr(n) for n in names[:4]) + (", ..." if len(names) > 4 else "")
        raise ValueError(f"{argname}: no attention layer named {entry!r}; the model's layers are {shown}")
    return names.index(entry)


def check_head_list(heads: object, num_heads: int, argname: str) -> tuple[int, ...]:
    """Validated, sorted, distinct head indices in [0, num_heads)."""
    if isinstance(heads, (str, bytes)) or not isinstance(heads, Iterable):
        raise TypeError(f"{argname} must be a list of head indices, got {type(heads).__name__}")
    out = []
    for h in heads:
        if isinstance(h, bool) or not isinstance(h, int):
            raise TypeError(f"{argname} must hold ints, got {type(h).__name__} {h!r}")
        if not 0 <= h < num_heads:
            raise ValueError(f"{argname}: head index must be in [0, {num_heads - 1}], got {h}")
        out.append(h)
    if len(set(out)) != len(out):
        raise ValueError(f"{argname} has repeated heads: {out}")
    return tuple(sorted(out))


class Capture:
    """What :func:`capture` recorded; filled while the context is open.

    Attributes:
        layers: captured layer names in model order (index = position in this list); a layer on
            the kernel route is kept once it has run.
        info: name -> :class:`LayerInfo` (a kernel-route layer's from its first call).
        modules: name -> the :class:`MultiHeadAttention` itself (for o_proj, pruning...), or
            Hugging Face's module for a layer on the kernel route.
        weights: name -> (B, H', S, Sk) attention weights (H' = stored query heads).
        heads: name -> (B, H', S, D) head outputs before o_proj (D: ``info[name].value_dim`` where set).
        q: name -> (B, H', S, D) queries after RoPE.
        k, v: name -> (B, Hkv, Sk, D) keys after RoPE and values (all K/V heads).
        nbytes: bytes held so far.
    """

    def __init__(self, what: tuple[str, ...], dtype: torch.dtype | None, limit_bytes: int) -> None:
        self.what = what
        self.dtype = dtype
        self.limit_bytes = limit_bytes
        self.layers: list[str] = []
        self.info: dict[str, LayerInfo] = {}
        self.modules: dict[str, nn.Module] = {}
        self.weights: dict[str, torch.Tensor] = {}
        self.heads: dict[str, torch.Tensor] = {}
        self.q: dict[str, torch.Tensor] = {}
        self.k: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}
        self.nbytes = 0

    def __repr__(self) -> str:
        return f"Capture(layers={len(self.layers)}, what={self.what}, nbytes={self.nbytes})"

    def call_bytes(self, name: str, batch: int, queries: int, keys: int, dtype: torch.dtype) -> tuple[int, int]:
        """What one call of layer ``name`` costs the capture, from that layer's own shapes:
        ``(kept, workspace)`` bytes. ``kept``: its records (weights B·H'·S·Sk, heads and q
        B·H'·S·D, k and v B·Hkv·Sk·D, H' = the heads asked for, in the capture's dtype).
        ``workspace``: the weights the layer's backend computes while it runs, which are every
        head's, not only the asked ones (:data:`WORKSPACE_COPIES` · B·H·S·Sk in the
        accumulation dtype); freed when the layer's call ends. 0 without ``"weights"``.

        Raises:
            ValueError: ``name`` is not a captured layer.
        """
        if name not in self.info:
            raise ValueError(f"name must be a captured layer ({self.layers[:4]}...), got {name!r}")
        i = self.info[name]
        h, hkv, d = len(i.heads), i.num_kv_heads, i.head_dim
        dv = d if i.value_dim is None else i.value_dim
        per = {"weights": h * queries * keys, "heads": h * queries * dv, "q": h * queries * d,
               "k": hkv * keys * d, "v": hkv * keys * dv}
        kept = batch * sum(per[w] for w in self.what) * (self.dtype or dtype).itemsize
        workspace = 0
        if "weights" in self.what:
            acc = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
            workspace = WORKSPACE_COPIES * batch * i.num_heads * queries * keys * acc.itemsize
        return kept, workspace

    def _recorder(self, name: str) -> _Recorder:
        """What watches layer ``name``'s steps (:meth:`MultiHeadAttention.watched`) for this capture."""
        return _Recorder(self, name)

    def _check_budget(self, name: str, b: int, s: int, sk: int, dtype: torch.dtype) -> None:
        """Refuse, before layer ``name``'s attention runs, a call whose records (on top of what is
        held) and the weights its backend computes would pass ``limit_bytes``; from this layer's
        own shapes (B, S queries, Sk keys)."""
        kept, workspace = self.call_bytes(name, b, s, sk, dtype)
        need = self.nbytes + kept + workspace
        if need > self.limit_bytes:
            heads = len(self.info[name].heads)
            raise ValueError(
                f"capture of layer {name!r} would need {need:,} bytes for this call (B={b}, S={s} queries, "
                f"Sk={sk} keys, {heads} of {self.info[name].num_heads} heads, what={self.what}): "
                f"{self.nbytes:,} held + {kept:,} kept + {workspace:,} while the backend computes every head's "
                f"weights, over limit_bytes={self.limit_bytes:,}: capture fewer layers, shorter inputs, "
                "a smaller dtype, or raise limit_bytes")

    def _keep(self, name: str, records: dict[str, torch.Tensor | None]) -> None:
        """Store one call's records of layer ``name`` that :attr:`what` asks for: ``weights``,
        ``heads`` and ``q`` (B, H, S, ...) keep the asked heads and append rows; ``k`` and ``v``
        (B, Hkv, Sk, D) are replaced."""
        info = self.info[name]
        sel = None
        for what, t in records.items():
            if what in self.what and t is not None:
                per_query = what in ("weights", "heads", "q")
                if per_query and len(info.heads) != info.num_heads:
                    sel = torch.tensor(info.heads, device=t.device) if sel is None else sel
                    t = t.index_select(1, sel)
                self._store(name, what, t, rows=per_query)

    def _store(self, name: str, what: str, t: torch.Tensor, rows: bool) -> None:
        """Keep ``t`` (detached, a copy in the capture's dtype): rows of a later cached call are
        appended along the query axis (weights zero-padded to the longest key count); k and v
        are replaced (a cache's keys hold every earlier one)."""
        store: dict[str, torch.Tensor] = getattr(self, what)
        t = t.detach().to(self.dtype or t.dtype, copy=True)  # never aliases the model's tensors
        old = store.get(name)
        if old is not None:
            self.nbytes -= old.numel() * old.element_size()
            if rows:
                if what == "weights" and old.shape[-1] != t.shape[-1]:
                    width = max(old.shape[-1], t.shape[-1])
                    old, t = (F.pad(a, (0, width - a.shape[-1])) for a in (old, t))
                t = torch.cat((old, t), dim=2)  # (B, H', S_old + S, ...)
        store[name] = t
        self.nbytes += t.numel() * t.element_size()


class _Recorder:
    """The observer of one captured layer: collects a call's steps, stores them once it ends."""

    def __init__(self, cap: Capture, name: str) -> None:
        self.cap, self.name = cap, name
        self.seen: dict[str, torch.Tensor] = {}
        self.calls = 0  # calls stored
        self.held = 0  # tokens of the cache's sequence queried so far (every call's S since it started)
        self.cached = True  # every stored call attended a cache (so later calls continue it)

    def __call__(self, step: str, t: torch.Tensor) -> None:
        seen, cap, name = self.seen, self.cap, self.name
        if step == "X":
            seen.clear()
        seen[step] = t
        if step in ("K_k", "K_cache"):
            # Refuse what would not fit, from this layer's own shapes, once its keys are known and
            # before its attention computes anything (a cache's keys: every one attended).
            q = seen["Q_k"]  # (B, H, S, D)
            cap._check_budget(name, q.shape[0], q.shape[2], t.shape[-2], q.dtype)
        elif step == "head_k":
            cached = "K_cache" in seen
            if self.calls and not (cached and self.cached):
                raise ValueError(f"layer {name!r} was called twice inside one capture without a cache: record one "
                                 "forward pass per `with multihead.heads.capture(...)` block (calls through a KV "
                                 "cache, as in generate, append their rows)")
            s, keys = t.shape[2], seen["K_cache" if cached else "K_k"].shape[2]
            held = s if keys == s else self.held + s  # keys == s: the cache started again (HF's Phi-3 does)
            if self.calls and cap.info[name].causal and keys < held:
                # A sliding-window or ring cache holds only the last keys: their columns are not positions.
                raise ValueError(f"layer {name!r} attends {keys} cached keys for its {held} queries so far: the "
                                 "cache no longer holds every earlier token (a sliding window or a ring), so the "
                                 "calls' rows cannot be aligned by key position; capture a forward pass with "
                                 "use_cache=False, or decode within the window")
            self.cached = self.cached and cached
            self.held = held
        elif step == "O":
            self._finish()

    def _finish(self) -> None:
        """Store the call's records (the steps always report Q_k, K_k, V_k and head_k)."""
        seen, cap, name = self.seen, self.cap, self.name
        if "head_k" not in seen or ("weights" in cap.what and "weights" not in seen):
            raise ValueError(f"layer {name!r} ran without its attend step reporting (heads and weights) on this "
                             "path: nothing to capture")
        # what attention read: after QK-norm and RoPE, in the layer's order
        q = seen.get("Q_rot_norm", seen.get("Q_rot", seen.get("Q_norm", seen["Q_k"])))
        k = seen.get("K_cache", seen.get("K_rot_norm", seen.get("K_rot", seen.get("K_norm", seen["K_k"]))))
        v = seen.get("V_cache", seen["V_k"])
        cap._keep(name, {"weights": seen.get("weights"), "heads": seen["head_k"], "q": q, "k": k, "v": v})
        self.calls += 1
        seen.clear()


class _KernelRecorder:
    """The watcher of one captured layer on the kernel route
    (:class:`~multihead.interop.hf_kernel.KernelWatcher`): reads the layer's facts from its first
    call, checks every call before the kernel computes, stores what it computed."""

    def __init__(self, cap: Capture, name: str, asked: tuple[int, ...] | None) -> None:
        self.cap, self.name, self.asked = cap, name, asked
        self.weights = "weights" in cap.what
        self.calls = 0  # calls stored
        self.held = 0  # queries stored so far (the rows)
        self.keys = 0  # the first call's key count

    def before(self, call: KernelCall) -> None:
        """Refuse, before anything is computed, a call whose facts differ from the layer's first
        call, that does not continue a cache, or that would pass ``limit_bytes``."""
        cap, name = self.cap, self.name
        info = kernel_layer_info(name, call, self.asked)
        known = cap.info.get(name)
        if known is None:
            cap.info[name] = known = info
        elif info != known:
            raise ValueError(f"layer {name!r} was called as {info} after {known}: one layer, one description")
        b, s, keys = call.query.shape[0], call.query.shape[2], call.key.shape[2]
        if self.calls:
            self._check_continues(known.causal, s, keys)
        cap._check_budget(name, b, s, keys, call.query.dtype)

    def _check_continues(self, causal: bool, s: int, keys: int) -> None:
        """A later call of the layer must be a decoding step through a cache (its rows follow the
        stored ones): a causal layer's keys hold every earlier query's and its own; a layer that is
        not causal (cross-attention) takes one query over the first call's keys."""
        if (keys >= self.held + s) if causal else (s == 1 and keys == self.keys):
            return
        if not causal or keys == s:
            raise ValueError(f"layer {self.name!r} was called again inside one capture, not as a step through a KV "
                             f"cache ({s} queries over {keys} keys after {self.held} rows): record one forward pass "
                             "per `with multihead.heads.capture(...)` block (calls through a KV cache, as in "
                             "generate, append their rows)")
        raise ValueError(f"layer {self.name!r} attends {keys} cached keys for its {self.held + s} queries so far: the "
                         "cache no longer holds every earlier token (a sliding window or a ring), so the calls' rows "
                         "cannot be aligned by key position; capture a forward pass with use_cache=False, or decode "
                         "within the window")

    def after(self, call: KernelCall, out: torch.Tensor, weights: torch.Tensor | None) -> None:
        """Store the call: ``out`` (B, H, S, D) the kernel's per-head output, ``weights`` (B, H, S, Sk)."""
        if self.weights and weights is None:
            raise ValueError(f"layer {self.name!r}: the kernel returned no weights to capture")
        self.cap._keep(self.name, {"weights": weights, "heads": out, "q": call.query, "k": call.key,
                                   "v": call.value})
        self.held = self.held + call.query.shape[2] if self.calls else call.query.shape[2]
        self.keys = self.keys if self.calls else call.key.shape[2]
        self.calls += 1


def kernel_layer_info(name: str, call: KernelCall, asked: tuple[int, ...] | None) -> LayerInfo:
    """The :class:`LayerInfo` of a kernel-route layer, from one of its calls: heads and head_dim from
    the shapes, ``causal`` and ``window`` as the module passes them (``is_causal``,
    ``sliding_window``), checked against its mask.

    Raises:
        ValueError: a window on a layer that is not causal, a mask that lets a query see a key its
            causality or window forbids, a causal mask on a layer that says it is not causal, or
            ``asked`` heads out of range.
    """
    _, h, s, d = call.query.shape
    hkv, keys = call.key.shape[1], call.key.shape[2]
    window = call.sliding_window
    if window is not None and (not call.is_causal or isinstance(window, bool) or not isinstance(window, int)):
        raise ValueError(f"layer {name!r} passes sliding_window={window!r} with is_causal={call.is_causal}: "
                         "multihead.heads describes a window as a token count on a causal layer only")
    allowed = call.mask  # (B|1, 1|H, S, Sk), True = attend
    if call.bias is not None:  # an additive mask masks with the dtype's minimum
        visible = call.bias > torch.finfo(call.bias.dtype).min / 2
        allowed = visible if allowed is None else allowed & visible
    if allowed is not None:
        said = full_mask(None, call.is_causal, window, s, keys, allowed.device)  # (S, Sk) or None
        if call.mask is None and said is not None:
            allowed = allowed & said  # without HF's mask the kernel applies the stated structure itself (T5's bias)
        if said is not None and bool((allowed & ~said).any()):
            raise ValueError(f"layer {name!r}'s mask lets a query see keys that is_causal={call.is_causal}, "
                             f"sliding_window={window} forbid: its heads' description would be false")
        future = ~Structure(causal=True).dense(s, keys, allowed.device)  # (S, Sk) keys after each query
        if said is None and s > 1 and bool(allowed.any()) and not bool((allowed & future).any()):
            raise ValueError(f"layer {name!r} says is_causal=False but its mask is causal: its heads' description "
                             "would be false")
    kept = tuple(range(h)) if asked is None else check_head_list(asked, h, "heads")
    dv = call.value.shape[-1]
    return LayerInfo(name, h, hkv, d, call.is_causal, window, kept, None if dv == d else dv)


class capture:  # noqa: N801  (a context manager used like a function)
    """Record per-head weights, head outputs and (on request) q/k/v of attention layers.

    Args:
        model: a :class:`multihead.MultiHeadAttention`, any module containing them, or a
            Hugging Face model patched by :func:`multihead.hf.patch`, on either route (a
            kernel-route layer is listed in ``cap.layers`` once it has run: see the module's
            docstring).
        what: any of ``"weights"`` (B, H, Sq, Sk), ``"heads"`` (B, H, S, D, before
            o_proj), ``"q"`` (B, H, S, D, after RoPE), ``"k"``, ``"v"`` (B, Hkv, Sk, D,
            k after RoPE).
        layers: layer indices (model order, as in ``cap.layers`` when all are captured) or
            names; None = all.
        heads: query heads to keep for weights/heads/q (k and v keep every K/V head);
            None = all. Checked against a kernel-route layer's head count at its first call.
        dtype: store in this dtype (e.g. ``torch.float16`` halves the memory); None = as
            computed.
        limit_bytes: refuse a layer's call, before its attention computes anything, when
            what the capture holds, plus that call's records, plus the weights its backend
            computes meanwhile would pass this many bytes; checked per layer from that
            layer's own shapes (queries, keys, heads: :meth:`Capture.call_bytes`). The
            backend computes every head's weights even when ``heads`` asks for fewer, so
            they count in full. The message names the layer and the figures.

    Yields:
        a :class:`Capture`, filled by the forward pass run inside the block.

    Raises:
        TypeError, ValueError (before anything runs): an unpatched HF model, an unknown
            layer name or index, heads out of range, an unknown ``what``, a layer whose
            named backend cannot return weights; a call over ``limit_bytes`` or a second
            call of one layer inside the block (raised from the forward pass), and on the
            kernel route (raised from the layer's call, before its kernel computes): heads
            out of range, a description its call contradicts (:func:`kernel_layer_info`).
    """

    def __init__(self, model: nn.Module, what: Sequence[str] = ("weights", "heads"),
                 layers: Iterable[int | str] | None = None,
                 *, heads: Iterable[int] | None = None, dtype: torch.dtype | None = None,
                 limit_bytes: int = DEFAULT_LIMIT_BYTES) -> None:
        what = (what,) if isinstance(what, str) else tuple(what)
        bad = [w for w in what if w not in WHAT]
        if bad or not what:
            raise ValueError(f"what must be a non-empty subset of {WHAT}, got {what}")
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise TypeError(f"dtype must be a floating-point torch.dtype or None, got {dtype!r}")
        if isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int) or limit_bytes < 1:
            raise ValueError(f"limit_bytes must be a positive int, got {limit_bytes!r}")
        found = capture_layers(model)
        picked = [found[i] for i in resolve_layers(found, layers)]
        self._cap = Capture(what, dtype, limit_bytes)
        # heads checked against each layer's count: a wrapped layer's now, a kernel-route one's at its first call
        asked = None if heads is None else check_head_list(heads, 1 << 62, "heads")
        if asked == ():
            raise ValueError("heads must name at least one head, got []")
        for name, layer in picked:
            backend = layer.backend if isinstance(layer, MultiHeadAttention) else _kernel_backend(layer)
            if not get_spec(default_backend(backend, True)).weights:
                raise ValueError(f"layer {name!r} uses backend {backend!r}, which returns no weights: "
                                 + ("set layer.backend = None while capturing" if isinstance(layer, MultiHeadAttention)
                                    else "patch the model with backend=None to capture it"))
            self._cap.layers.append(name)
            self._cap.modules[name] = layer
            if isinstance(layer, MultiHeadAttention):
                kept = tuple(range(layer.num_heads)) if asked is None else check_head_list(asked, layer.num_heads,
                                                                                            "heads")
                self._cap.info[name] = LayerInfo(name, layer.num_heads, layer.num_kv_heads, layer.head_dim,
                                                 layer.causal, layer.window, kept)
        self._picked = picked
        self._asked = asked

    def __enter__(self) -> Capture:
        self._stack = ExitStack()
        weights = "weights" in self._cap.what
        for name, layer in self._picked:
            if not isinstance(layer, MultiHeadAttention):
                self._watch_kernel(name, layer)
            elif layer.watch is not None:
                self._stack.close()
                raise ValueError(f"layer {name!r} is already being captured or traced (nested capture of one layer)")
            else:
                self._stack.enter_context(layer.watched(self._cap._recorder(name), weights=weights))
        return self._cap

    def _watch_kernel(self, name: str, layer: nn.Module) -> None:
        """Put a recorder on the kernel-route module ``layer``'s dispatching module until the block ends."""
        from ..interop import hf_routes
        from ..interop.hf_kernel import WATCH_ATTR

        (module,) = hf_routes.dispatchers(layer)  # one, checked by capture_layers
        if WATCH_ATTR in module.__dict__:
            self._stack.close()
            raise ValueError(f"layer {name!r} is already being captured (nested capture of one layer)")
        module.__dict__[WATCH_ATTR] = _KernelRecorder(self._cap, name, self._asked)
        self._stack.callback(module.__dict__.pop, WATCH_ATTR, None)

    def __exit__(self, *exc: object) -> None:
        self._stack.close()  # back to the fast paths: nobody watches the steps
        cap = self._cap
        for name in [n for n in cap.layers if n not in cap.info]:  # a kernel-route layer that never ran
            del cap.modules[name]
        cap.layers[:] = [n for n in cap.layers if n in cap.info]


def _kernel_backend(layer: nn.Module) -> str | None:
    """The core backend the kernel runs in ``layer`` (``multihead.hf.patch(backend=...)``), or None."""
    from ..interop import hf_routes
    from ..interop.hf_kernel import BACKEND_ATTR

    backend: str | None = hf_routes.dispatchers(layer)[0].__dict__.get(BACKEND_ATTR)
    return backend


def weighted_layers(cap: Capture) -> list[str]:
    """The names of ``cap``'s layers that hold weights, in model order.

    Raises:
        TypeError: ``cap`` is not a :class:`Capture`.
        ValueError: it holds no weights.
    """
    if not isinstance(cap, Capture):
        raise TypeError(f"cap must be a multihead.heads.Capture, got {type(cap).__name__}")
    names = [n for n in cap.layers if n in cap.weights]
    if not names:
        raise ValueError("cap holds no weights: capture with what=('weights', ...) and run the model inside the block")
    return names
