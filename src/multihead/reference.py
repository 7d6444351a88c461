"""The float64 reference: the seed's multi-head attention, step by step, in its convention.

Matrices are **[features, tokens]** (rows = features, columns = tokens), so a projection
is ``Q = W_q · X``; PyTorch and :class:`multihead.MultiHeadAttention` use the transpose.
Symbols are the seed's: d model width, h heads, d_head = d / h, S tokens.

One small function per step, in the seed's order (SPEC.md, "The pipeline"):

=====  ==========================  ====================================  =================
step   seed                        function                              shape
=====  ==========================  ====================================  =================
1      Q, K, V = W·X (+ b)         :func:`project`                       [d, S]
2      split into h heads          :func:`split_heads`                   h × [d_head, S]
3      RoPE per head, on Q and K   :func:`rope`                          [d_head, S]
4      head_k = V_k softmax(...)ᵀ  :func:`attention_head`                [d_head, S]
5      concat                      :func:`concat`                        [d, S]
6      O = W_o · Concat            :func:`project` (W_o)                 [d, S]
7      residual X + O              :func:`residual`                      [d, S]
=====  ==========================  ====================================  =================

It is written for reading and as the oracle the fast paths are tested against, not
for speed. A query with no allowed key outputs zeros.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "project",
    "split_heads",
    "rope",
    "attention_head",
    "concat",
    "residual",
    "multi_head_attention",
    "SEED_TABLE",
]

Array = np.ndarray

#: The seed's section-7 table: step, the tensor's name in ``steps``, its shape.
SEED_TABLE: tuple[tuple[str, str, str], ...] = (
    ("input (after norm)", "X", "[d, S]"),
    ("Q/K/V projection", "Q, K, V", "[d, S]"),
    ("split heads", "Q_k, K_k, V_k", "h × [d_head, S]"),
    ("RoPE", "Q_rot, K_rot", "h × [d_head, S]"),
    ("single-head attention", "head_k", "h × [d_head, S]"),
    ("concat", "concat", "[d, S]"),
    ("W_o", "O", "[d, S]"),
    ("residual", "residual", "[d, S]"),
)


def _f64(name: str, a: Any, ndim: int | None = None) -> Array:
    try:
        arr = np.asarray(a.detach().cpu().numpy() if hasattr(a, "detach") else a, dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise TypeError(f"{name} must be a real array, got {type(a).__name__}") from err
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {list(arr.shape)}")
    return arr


def project(W: Array, X: Array, b: Array | None = None) -> Array:
    """Step 1 (and 6): ``W · X + b``.

    Args:
        W: [d_out, d_in].
        X: [d_in, S].
        b: [d_out] or None ("depends on the implementation").

    Returns:
        [d_out, S].
    """
    Y = W @ X
    return Y if b is None else Y + b[:, None]


def split_heads(M: Array, num_heads: int) -> list[Array]:
    """Step 2: cut the feature rows into ``num_heads`` blocks of d_head rows.

    A reshape, not new weights. ``[h·d_head, S] -> h × [d_head, S]``.
    """
    d_head = M.shape[0] // num_heads
    return [M[i * d_head : (i + 1) * d_head] for i in range(num_heads)]


def rope(M: Array, positions: Array, base: float, *, interleaved: bool = False,
         rotary_dim: int | None = None) -> Array:
    """Step 3: rotate pairs of rows of one head by ``position · base^(-2p/R)``.

    Args:
        M: [d_head, S], one head's Q_k or K_k.
        positions: [S] integer positions of the columns.
        base: rope_theta.
        interleaved: pair p is rows (2p, 2p+1) if True, else (p, p + R/2) (rotate-half).
        rotary_dim: R, rows that rotate (default all).

    Returns:
        [d_head, S].
    """
    d_head = M.shape[0]
    r = d_head if rotary_dim is None else rotary_dim
    p = np.arange(r // 2)
    theta = np.outer(base ** (-2.0 * p / r), positions)  # [R/2, S]
    cos, sin = np.cos(theta), np.sin(theta)
    first, second = (2 * p, 2 * p + 1) if interleaved else (p, p + r // 2)
    out = M.copy()
    out[first] = M[first] * cos - M[second] * sin
    out[second] = M[second] * cos + M[first] * sin
    return out


def attention_head(Q_k: Array, K_k: Array, V_k: Array, *, scale: float,
                   mask: Array | None = None) -> tuple[Array, Array]:
    """Step 4: ``head_k = V_k · softmax(Q_kᵀ K_k · scale)ᵀ``.

    Args:
        Q_k: [d_head, Sq].
        K_k, V_k: [d_head, Sk].
        scale: 1/√d_head in the seed.
        mask: [Sq, Sk] bool, True = may attend, or None.

    Returns:
        (head_k [d_head, Sq], A [Sq, Sk]): the softmax weights, rows summing to 1
        (or all zero for a query with no allowed key).
    """
    scores = (Q_k.T @ K_k) * scale  # [Sq, Sk]
    if mask is not None:
        scores = np.where(mask, scores, -np.inf)
    row_max = scores.max(axis=1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    e = np.exp(scores - row_max)
    total = e.sum(axis=1, keepdims=True)
    A = e / np.where(total == 0, 1.0, total)  # [Sq, Sk], softmax over keys
    return V_k @ A.T, A


def concat(heads: list[Array]) -> Array:
    """Step 5: stack the heads' rows back: ``h × [d_head, S] -> [h·d_head, S]``."""
    return np.concatenate(heads, axis=0)


def residual(X: Array, O: Array) -> Array:
    """Step 7: ``X + O``."""
    return X + O


def multi_head_attention(
    X: npt.ArrayLike,
    W_q: npt.ArrayLike,
    W_k: npt.ArrayLike,
    W_v: npt.ArrayLike,
    W_o: npt.ArrayLike,
    num_heads: int,
    *,
    num_kv_heads: int | None = None,
    b_q: npt.ArrayLike | None = None,
    b_k: npt.ArrayLike | None = None,
    b_v: npt.ArrayLike | None = None,
    b_o: npt.ArrayLike | None = None,
    causal: bool = False,
    rope_base: float | None = None,
    rope_interleaved: bool = False,
    rotary_dim: int | None = None,
    positions: npt.ArrayLike | None = None,
    context: npt.ArrayLike | None = None,
    mask: npt.ArrayLike | None = None,
    key_mask: npt.ArrayLike | None = None,
    window: int | None = None,
    scale: float | None = None,
    return_steps: bool = False,
) -> Array | tuple[Array, dict[str, Any]]:
    """The seed's layer: ``O = W_o · Concat(head_0, …, head_{h-1})``.

    Args:
        X: [d, S] input (after the norm).
        W_q: [h·d_head, d]; W_k, W_v: [h_kv·d_head, d_kv]; W_o: [d, h·d_head].
        num_heads: h.
        num_kv_heads: h_kv (GQA); query head k uses K/V head ``k // (h // h_kv)``.
        b_q, b_k, b_v, b_o: optional biases.
        causal: bottom-right causal mask (query i at position ``i + Sk - Sq``).
        rope_base: apply RoPE to each head's Q and K with this base; None = no RoPE.
        rope_interleaved, rotary_dim: RoPE pairing and partial width.
        positions: [S] token positions for RoPE; default 0..S-1.
        context: [d_kv, Sk] for cross-attention (K, V from it); default X.
        mask: bool broadcastable to [h, Sq, Sk], True = may attend.
        key_mask: [Sk] bool, True = real token.
        window: sliding window (with causal: the query and ``window - 1`` keys before).
        scale: default 1/√d_head.
        return_steps: also return every intermediate of the seed's section-7 table.

    Returns:
        O [d, S] (without the residual), or ``(O, steps)`` with steps keyed
        ``X, Q, K, V, Q_k, K_k, V_k, Q_rot, K_rot, A, head_k, concat, O, residual``.
    """
    X = _f64("X", X, 2)
    C = X if context is None else _f64("context", context, 2)
    W_q, W_k, W_v, W_o = (_f64(n, w, 2) for n, w in (("W_q", W_q), ("W_k", W_k), ("W_v", W_v), ("W_o", W_o)))
    b_q, b_k, b_v, b_o = (None if b is None else _f64(n, b, 1)
                          for n, b in (("b_q", b_q), ("b_k", b_k), ("b_v", b_v), ("b_o", b_o)))
    h = num_heads
    h_kv = h if num_kv_heads is None else num_kv_heads
    if h <= 0 or h_kv <= 0 or h % h_kv or W_q.shape[0] % h:
        raise ValueError(f"num_heads={h} must be a positive multiple of num_kv_heads={h_kv} "
                         f"and divide W_q's rows {W_q.shape[0]}")
    d_head = W_q.shape[0] // h
    scale = 1.0 / np.sqrt(d_head) if scale is None else scale
    S, Sk = X.shape[1], C.shape[1]

    Q, K, V = project(W_q, X, b_q), project(W_k, C, b_k), project(W_v, C, b_v)
    Q_k, K_k, V_k = split_heads(Q, h), split_heads(K, h_kv), split_heads(V, h_kv)
    Q_rot, K_rot = Q_k, K_k
    if rope_base is not None:
        pos = np.arange(S) if positions is None else _f64("positions", positions, 1)
        Q_rot = [rope(q, pos, rope_base, interleaved=rope_interleaved, rotary_dim=rotary_dim) for q in Q_k]
        K_rot = [rope(k, pos, rope_base, interleaved=rope_interleaved, rotary_dim=rotary_dim) for k in K_k]

    allowed = np.ones((h, S, Sk), dtype=bool)
    offset = np.arange(Sk)[None, :] - (np.arange(S)[:, None] + Sk - S)  # key pos - query pos
    if causal:
        allowed &= offset <= 0
    if window is not None:
        allowed &= (offset > -window) & (offset < window)
    if mask is not None:
        allowed &= np.asarray(mask, dtype=bool)
    if key_mask is not None:
        allowed &= np.asarray(key_mask, dtype=bool)[None, None, :]

    group = h // h_kv
    results = [attention_head(Q_rot[i], K_rot[i // group], V_k[i // group], scale=scale, mask=allowed[i])
               for i in range(h)]
    head_k = [r[0] for r in results]
    C_heads = concat(head_k)
    O = project(W_o, C_heads, b_o)
    if not return_steps:
        return O
    steps = {
        "X": X, "Q": Q, "K": K, "V": V, "Q_k": Q_k, "K_k": K_k, "V_k": V_k,
        "Q_rot": Q_rot, "K_rot": K_rot, "A": [r[1] for r in results], "head_k": head_k,
        "concat": C_heads, "O": O, "residual": residual(X, O) if O.shape == X.shape else None,
    }
    return O, steps
