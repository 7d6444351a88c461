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
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..backends import get_spec
from ..functional import default_backend
from ..latent import MultiHeadLatentAttention
from ..module import MultiHeadAttention

__all__ = ["capture", "Capture", "LayerInfo", "find_layers", "DEFAULT_LIMIT_BYTES", "WORKSPACE_COPIES", "WHAT"]

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


def find_layers(model: nn.Module) -> list[tuple[str, MultiHeadAttention]]:
    """The :class:`MultiHeadAttention` layers of ``model`` in module order, named as the model
    names them: a layer inside a :class:`multihead.hf.PatchedAttention` takes the wrapper's
    name (``encoder.layer.0.attention``), so names match the unpatched model's.

    Raises:
        TypeError: ``model`` is not an nn.Module.
        ValueError: ``model`` holds multi-head latent attention (DeepSeek), whose heads are not
            recorded, Hugging Face attention modules that are not patched, or on
            :func:`multihead.hf.patch`'s kernel route (they would be missing from the list),
            or no attention layer at all.
    """
    from .. import hf, interop
    from ..interop import hf_routes
    from ..interop.hf_patch import attention_modules

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    candidates = attention_modules(model)
    kernel = [(n, type(m).__name__) for n, m in candidates if hf_routes.routed(m)]
    if kernel:
        raise ValueError(f"model has {len(kernel)} attention module(s) on multihead.hf.patch's kernel route (Hugging "
                         f"Face's module, multihead's kernel), e.g. {_listed(kernel)}: multihead.heads records the "
                         "layers patched with a wrapper only; output_attentions=True returns these modules' weights")
    unpatched = [(n, type(m).__name__) for n, m in candidates if interop.hf_family(m) is not None]
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
    found = [(wrapper_of.get(id(m), n), m) for n, m in model.named_modules() if isinstance(m, MultiHeadAttention)]
    if not found:
        raise ValueError(f"model {type(model).__name__} contains no multihead.MultiHeadAttention layer "
                         "(nor a patched Hugging Face attention module)")
    return found


def _listed(modules: list[tuple[str, str]]) -> str:
    """The first three (name, class) pairs, as an error message lists them."""
    return ", ".join(f"{n or '<model>'} ({t})" for n, t in modules[:3])


def resolve_layers(found: Sequence[tuple[str, MultiHeadAttention]], layers: Iterable[int | str] | None,
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
        layers: captured layer names in model order (index = position in this list).
        info: name -> :class:`LayerInfo`.
        modules: name -> the :class:`MultiHeadAttention` itself (for o_proj, pruning...).
        weights: name -> (B, H', S, Sk) attention weights (H' = stored query heads).
        heads: name -> (B, H', S, D) head outputs before o_proj.
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
        self.modules: dict[str, MultiHeadAttention] = {}
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
        per = {"weights": h * queries * keys, "heads": h * queries * d, "q": h * queries * d,
               "k": hkv * keys * d, "v": hkv * keys * d}
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
        info = cap.info[name]
        if "head_k" not in seen or ("weights" in cap.what and "weights" not in seen):
            raise ValueError(f"layer {name!r} ran without its attend step reporting (heads and weights) on this "
                             "path: nothing to capture")
        # what attention read: after QK-norm and RoPE, in the layer's order
        q = seen.get("Q_rot_norm", seen.get("Q_rot", seen.get("Q_norm", seen["Q_k"])))
        k = seen.get("K_cache", seen.get("K_rot_norm", seen.get("K_rot", seen.get("K_norm", seen["K_k"]))))
        v = seen.get("V_cache", seen["V_k"])
        sel = None if len(info.heads) == info.num_heads else torch.tensor(info.heads, device=q.device)
        for what, t, per_query in (("weights", seen.get("weights"), True), ("heads", seen["head_k"], True),
                                   ("q", q, True), ("k", k, False), ("v", v, False)):
            if what in cap.what and t is not None:
                if per_query and sel is not None:
                    t = t.index_select(1, sel)
                cap._store(name, what, t, rows=per_query)
        self.calls += 1
        seen.clear()


class capture:  # noqa: N801  (a context manager used like a function)
    """Record per-head weights, head outputs and (on request) q/k/v of attention layers.

    Args:
        model: a :class:`multihead.MultiHeadAttention`, any module containing them, or a
            Hugging Face model patched by :func:`multihead.hf.patch`.
        what: any of ``"weights"`` (B, H, Sq, Sk), ``"heads"`` (B, H, S, D, before
            o_proj), ``"q"`` (B, H, S, D, after RoPE), ``"k"``, ``"v"`` (B, Hkv, Sk, D,
            k after RoPE).
        layers: layer indices (model order, as in ``cap.layers`` when all are captured) or
            names; None = all.
        heads: query heads to keep for weights/heads/q (k and v keep every K/V head);
            None = all.
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
            call of one layer inside the block (raised from the forward pass).
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
        found = find_layers(model)
        picked = [found[i] for i in resolve_layers(found, layers)]
        self._cap = Capture(what, dtype, limit_bytes)
        for name, layer in picked:
            if not get_spec(default_backend(layer.backend, True)).weights:
                raise ValueError(f"layer {name!r} uses backend {layer.backend!r}, which returns no weights: "
                                 "set layer.backend = None while capturing")
            kept = tuple(range(layer.num_heads)) if heads is None else check_head_list(heads, layer.num_heads, "heads")
            if not kept:
                raise ValueError("heads must name at least one head, got []")
            self._cap.layers.append(name)
            self._cap.modules[name] = layer
            self._cap.info[name] = LayerInfo(name, layer.num_heads, layer.num_kv_heads, layer.head_dim,
                                             layer.causal, layer.window, kept)
        self._picked = picked

    def __enter__(self) -> Capture:
        self._stack = ExitStack()
        weights = "weights" in self._cap.what
        for name, layer in self._picked:
            if layer.watch is not None:
                self._stack.close()
                raise ValueError(f"layer {name!r} is already being captured or traced (nested capture of one layer)")
            self._stack.enter_context(layer.watched(self._cap._recorder(name), weights=weights))
        return self._cap

    def __exit__(self, *exc: object) -> None:
        self._stack.close()  # back to the fast paths: nobody watches the steps


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
