"""What each head does, as numbers: one row of metrics per (layer, head).

Notation: B batch, H heads, S tokens (Sq = Sk = S: self-attention over the whole
sequence), A = A^{l,h}_b the (S, S) weights of one head on one sequence (rows sum to 1).

Which rows and keys count:

* real tokens are those with ``key_mask`` True (all when it is None); padding queries and
  padding keys are excluded everywhere;
* K(i), the keys query i may see: real keys allowed by the layer's causal flag and window;
  n_i = |K(i)|; a query with no allowed key (a fully masked row) is skipped;
* positions are indices among the row's real tokens (``pos = cumsum(key_mask) - 1``), so
  left and right padding give the same numbers;
* a per-query score s_i becomes the head's score by a **token-weighted mean** over every
  real query of the batch that the score applies to (its *eligible* rows).

Definitions (all ranges inclusive; every sum runs over j in K(i)):

* ``entropy``: normalised entropy Ĥ_i = −Σ_j A_ij ln A_ij / ln n_i (0·ln 0 = 0;
  Ĥ_i = 0 when n_i = 1). Range [0, 1]: 0 = all mass on one key, 1 = uniform.
* ``distance``: mean attention distance D_i = Σ_j A_ij |pos_i − pos_j|, in tokens.
  Range [0, n_i − 1].
* ``previous_token``: R₋₁ = mean over rows having a previous real key of A_{i, i−1}.
  ``next_token``: R₊₁, the same with i+1. ``diagonal``: R₀ = mean A_{i,i}. Range [0, 1].
* ``first_token`` (sink score, Xiao et al. 2023; Gu et al. 2024's α₁): mean over rows
  other than the first real token of A_{i, k0}, k0 the first real token. Range [0, 1].
* ``special_tokens``: mean_i Σ_{j special} A_ij (Clark et al. 2019), tokens required;
  ``punctuation``: the same over punctuation keys. Range [0, 1].
* ``induction`` (prefix matching, Olsson et al. 2022), only with ``induction=True``: for
  query i, J_i = keys j whose previous real token equals token i and comes before i
  (j follows an earlier copy of the current token); Ind = mean over rows with J_i
  non-empty of Σ_{j ∈ J_i} A_ij. Range [0, 1]. Meant for repeated random sequences
  (:func:`repeated_tokens`), where J_i is the one key after the earlier copy.
* ``norm_weight`` (Kobayashi et al. 2020), when ``v`` was captured: mean_i Σ_j A_ij ‖f^h(x_j)‖₂
  with f^h(x_j) = W_O^h v_j (W_O^h = the head's columns of o_proj, bias excluded): the
  size of what the head writes, beside the plain weight Σ_j A_ij = 1. Range [0, ∞). Not
  measured (None) on a layer of :func:`multihead.hf.patch`'s kernel route: W_O is Hugging Face's
  module's, which may change the heads before it (a gate).

Relation to TransformerLens' head detector (``compute_head_attention_similarity_score``
with ``error_measure="mul"``, no exclusions, one sequence of n tokens, no padding): it
divides the attention mass on its detection pattern by ΣA = n, all rows; we divide by the
m rows where the pattern has a key. Hence **TL = (m / n) · ours** exactly:
m = n − 1 for ``previous_token`` (TL's ``previous_token_head``), and m = the number of
queries with an earlier copy of their token for ``induction`` (TL's ``induction_head``).
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, fields

import torch

from ..backends import full_mask
from ..module import MultiHeadAttention
from .capture import Capture, weighted_layers

__all__ = ["HeadMetrics", "metrics", "norm_weights", "format_table", "to_json", "repeated_tokens",
           "is_special", "is_punctuation", "METRIC_FIELDS", "METRIC_HELP"]


@dataclass
class HeadMetrics:
    """One head's scores (see the module docstring for each definition); None = not measured."""

    layer: int
    head: int
    entropy: float | None
    distance: float | None
    previous_token: float | None
    next_token: float | None
    diagonal: float | None
    first_token: float | None
    special_tokens: float | None
    punctuation: float | None
    induction: float | None
    norm_weight: float | None
    label: str | None = None


#: The metric fields (everything but layer, head and label), in table order.
METRIC_FIELDS = tuple(f.name for f in fields(HeadMetrics) if f.name not in ("layer", "head", "label"))

#: One line per metric, for people (the page's legend); the definitions are in the module docstring.
METRIC_HELP: dict[str, str] = {
    "entropy": "how spread the weights are: 0 = all on one key, 1 = uniform over the keys a query may see",
    "distance": "mean distance in tokens between a query and the keys it attends to",
    "previous_token": "mean weight on the token just before the query",
    "next_token": "mean weight on the token just after the query",
    "diagonal": "mean weight of a token on itself",
    "first_token": "mean weight on the first token ([CLS] or BOS; an attention 'sink')",
    "special_tokens": "total weight on special tokens ([CLS], [SEP], ...)",
    "punctuation": "total weight on punctuation tokens",
    "induction": "weight on the token after an earlier copy of the current one (repeated random text)",
    "norm_weight": "weights times the size of what each key writes through o_proj (Kobayashi et al.)",
}

_SPECIAL = re.compile(r"^(\[[A-Z]+\]|<\|?[A-Za-z_]+\|?>|</?s>)$")


def is_special(token: str) -> bool:
    """The default special-token rule: ``[CLS]``-style or ``<bos>``/``<|endoftext|>``/``<s>``."""
    return bool(_SPECIAL.match(token))


def is_punctuation(token: str) -> bool:
    """Every character (after a word-piece marker ``##``, ``Ġ`` or ``▁``) is Unicode punctuation."""
    core = token.removeprefix("##").lstrip("Ġ▁")
    return bool(core) and all(unicodedata.category(c).startswith("P") for c in core)


def repeated_tokens(vocab: Sequence[int], length: int, batch: int, *, seed: int = 0,
                    bos: int | None = None, eos: int | None = None) -> torch.Tensor:
    """Random token sequences repeated twice, for the induction score: each row is
    ``[bos] r_1 … r_T r_1 … r_T [eos]`` with r drawn without repetition from ``vocab``.

    Returns:
        (batch, 2·length + [bos] + [eos]) int64 ids.

    Raises:
        ValueError: ``length`` < 2, ``batch`` < 1 or ``vocab`` smaller than ``length``.
    """
    if isinstance(length, bool) or not isinstance(length, int) or length < 2:
        raise ValueError(f"length must be an int >= 2, got {length!r}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a positive int, got {batch!r}")
    pool = torch.as_tensor(list(vocab), dtype=torch.long)
    if pool.numel() < length:
        raise ValueError(f"vocab must hold at least length={length} ids, got {pool.numel()}")
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        r = pool[torch.randperm(pool.numel(), generator=gen)[:length]]
        parts = ([torch.tensor([bos])] if bos is not None else []) + [r, r] + (
            [torch.tensor([eos])] if eos is not None else [])
        rows.append(torch.cat(parts))
    return torch.stack(rows)


def _check_tokens(tokens: object, b: int, s: int) -> list[list[object]] | None:
    """tokens as B lists of S entries (strings or ids); a flat list is accepted for B = 1."""
    if tokens is None:
        return None
    if isinstance(tokens, torch.Tensor):
        if tuple(tokens.shape) != (b, s):
            raise ValueError(f"tokens must have shape [B, S] = [{b}, {s}], got {list(tokens.shape)}")
        return tokens.tolist()
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
        raise TypeError(f"tokens must be a list of B token lists (or one list when B = 1), got {type(tokens).__name__}")
    rows = [tokens] if tokens and not isinstance(tokens[0], (list, tuple)) else list(tokens)
    if len(rows) != b:
        raise ValueError(f"tokens must hold B={b} sequences, got {len(rows)}")
    for i, row in enumerate(rows):
        if len(row) != s:
            raise ValueError(f"tokens[{i}] must hold S={s} tokens (one per position, padding included), "
                             f"got {len(row)}")
    return [list(r) for r in rows]


def _check_key_mask(key_mask: object, b: int, s: int) -> torch.Tensor:
    if key_mask is None:
        return torch.ones(b, s, dtype=torch.bool)
    if not isinstance(key_mask, torch.Tensor):
        raise TypeError(f"key_mask must be a (B, S) tensor (True/1 = real token), got {type(key_mask).__name__}")
    if tuple(key_mask.shape) != (b, s):
        raise ValueError(f"key_mask must have shape [B, S] = [{b}, {s}], got {list(key_mask.shape)}")
    return key_mask.detach().to("cpu").bool()


def _mean(score: torch.Tensor, rows: torch.Tensor) -> torch.Tensor | None:
    """Token-weighted mean of score (B, H, S) over the rows (B, S) that are True: (H,), or None if none."""
    count = int(rows.sum())
    if count == 0:
        return None
    return (score * rows[:, None, :]).sum(dim=(0, 2)) / count  # (H,)


def _layer_scores(a: torch.Tensor, real: torch.Tensor, causal: bool, window: int | None,
                  tok: list[list[object]] | None, special: Collection[str] | None,
                  induction: bool, fnorm: torch.Tensor | None) -> dict[str, torch.Tensor | None]:
    """Per-head scores of one layer. a (B, H, S, S) float64 (a new tensor), real (B, S)."""
    b, h, s, _ = a.shape
    structural = full_mask(None, causal, window, s, s, torch.device("cpu"))
    allowed = real[:, None, :] & real[:, :, None]  # (B, S, S): real query, real key
    if structural is not None:
        allowed = allowed & structural
    a = a * allowed[:, None]  # padding keys and rows out; a fresh tensor
    n = allowed.sum(-1)  # (B, S) keys per query
    rows = n > 0  # (B, S) real queries with at least one key
    pos = real.long().cumsum(-1) - 1  # (B, S) index among real tokens
    rel = pos[:, None, :] - pos[:, :, None]  # (B, S, S): pos_j - pos_i

    def mass_on(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys = keys & allowed  # (B, S, S)
        return (a * keys[:, None]).sum(-1), keys.any(-1) & rows  # (B, H, S), eligible (B, S)

    plogp = torch.where(a > 0, a * torch.log(a.clamp_min(1e-300)), torch.zeros((), dtype=a.dtype))
    log_n = torch.log(n.clamp_min(1).double())  # (B, S)
    ent = torch.where(n[:, None] > 1, -plogp.sum(-1) / log_n.clamp_min(1e-300)[:, None], torch.zeros((), dtype=a.dtype))
    out: dict[str, torch.Tensor | None] = {
        "entropy": _mean(ent, rows),
        "distance": _mean((a * rel.abs()[:, None].double()).sum(-1), rows),
    }
    for field, offset in (("previous_token", -1), ("next_token", 1), ("diagonal", 0)):
        out[field] = _mean(*mass_on(rel == offset))
    first = (pos == 0) & real  # (B, S)
    score, eligible = mass_on(first[:, None, :].expand(b, s, s))
    out["first_token"] = _mean(score, eligible & ~first)
    out["special_tokens"] = out["punctuation"] = out["induction"] = None
    if tok is not None:
        strings = [[str(t) for t in row] for row in tok]
        spec = torch.tensor([[(t in special) if special is not None else is_special(t) for t in row]
                             for row in strings], dtype=torch.bool).reshape(b, s)
        punct = torch.tensor([[is_punctuation(t) for t in row] for row in strings], dtype=torch.bool).reshape(b, s)
        out["special_tokens"] = _mean(mass_on(spec[:, None, :].expand(b, s, s))[0], rows)
        out["punctuation"] = _mean(mass_on((punct & ~spec)[:, None, :].expand(b, s, s))[0], rows)
        if induction:
            out["induction"] = _mean(*mass_on(_after_earlier_copy(tok, real, pos)))
    out["norm_weight"] = None if fnorm is None else _mean((a * fnorm[:, :, None, :]).sum(-1), rows)
    return out


def _after_earlier_copy(tok: list[list[object]], real: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """(B, S, S): key j is right after an earlier real copy m of query i's token (x_m = x_i, pos_m < pos_i)."""
    ids: dict[object, int] = {}
    t = torch.tensor([[ids.setdefault(x, len(ids)) for x in row] for row in tok])  # (B, S)
    both = real[:, :, None] & real[:, None, :]
    copy = (t[:, :, None] == t[:, None, :]) & both & (pos[:, None, :] < pos[:, :, None])  # (B, i, m)
    follows = both & (pos[:, None, :] == pos[:, :, None] + 1)  # (B, m, j): j is the real token after m
    return (copy.double() @ follows.double()) > 0  # (B, i, j)


def norm_weights(cap: Capture, layer: int | str) -> torch.Tensor:
    """Kobayashi et al.'s norm-based weights N_ij = A_ij ‖W_O^h v_j‖₂ of one captured layer.

    Needs ``"weights"`` and ``"v"`` in the capture. With GQA, query head h reads K/V head
    h // (H / Hkv). Σ_h Σ_j A_ij W_O^h v_j + b_O is the layer's output (the identity the
    tests check).

    Returns:
        (B, H', S, Sk) float64 (H' = the captured query heads).

    Raises:
        ValueError: the layer or what it needs was not captured, or the layer is on
            :func:`multihead.hf.patch`'s kernel route (its W_O is Hugging Face's module's).
    """
    name = _layer_name(cap, layer)
    for what, store in (("weights", cap.weights), ("v", cap.v)):
        if name not in store:
            raise ValueError(f"norm_weights needs {what!r} captured for layer {name!r}: "
                             f"use capture(..., what=('weights', 'v', ...))")
    if not _knows_w_o(cap, name):
        raise ValueError(f"norm_weights needs layer {name!r}'s W_O, which Hugging Face's module holds on the kernel "
                         f"route ({type(cap.modules[name]).__name__}; it may change the heads before it)")
    return cap.weights[name].double() * _fnorm(cap, name)[:, :, None, :]


def _knows_w_o(cap: Capture, name: str) -> bool:
    """Whether layer ``name``'s output projection is multihead's (a wrapped layer, not the kernel route)."""
    return isinstance(cap.modules[name], MultiHeadAttention)


def _fnorm(cap: Capture, name: str) -> torch.Tensor:
    """‖W_O^h v_j‖₂ per captured query head and key: (B, H', Sk) float64."""
    info, v, layer = cap.info[name], cap.v[name].double(), cap.modules[name]  # v (B, Hkv, Sk, D)
    assert isinstance(layer, MultiHeadAttention)  # _knows_w_o
    w_o = layer.o_proj.weight.detach().double().cpu()  # (E, H·D)
    group = info.num_heads // info.num_kv_heads
    d = info.head_dim
    out = []
    for h in info.heads:
        w_h = w_o[:, h * d:(h + 1) * d]  # (E, D)
        f = v[:, h // group].cpu() @ w_h.T  # (B, Sk, E)
        out.append(f.norm(dim=-1))
    return torch.stack(out, dim=1)  # (B, H', Sk)


def _layer_name(cap: Capture, layer: int | str) -> str:
    if not isinstance(cap, Capture):
        raise TypeError(f"cap must be a multihead.heads.Capture, got {type(cap).__name__}")
    if isinstance(layer, bool) or not isinstance(layer, (int, str)):
        raise TypeError(f"layer must be an index or a name, got {type(layer).__name__}")
    if isinstance(layer, int):
        if not 0 <= layer < len(cap.layers):
            raise ValueError(f"layer must be in [0, {len(cap.layers) - 1}], got {layer}")
        return cap.layers[layer]
    if layer not in cap.info:
        raise ValueError(f"layer {layer!r} was not captured; captured: {cap.layers[:4]}")
    return layer


def metrics(cap: Capture, tokens: object = None, key_mask: torch.Tensor | None = None, *,
            special: Collection[str] | None = None, induction: bool = False) -> list[HeadMetrics]:
    """One :class:`HeadMetrics` per captured (layer, head); definitions in the module docstring.

    Args:
        cap: a capture holding ``"weights"`` of self-attention calls (Sq = Sk).
        tokens: the batch's tokens, B lists of S strings (or ids) including padding
            positions, or a (B, S) tensor of ids; a flat list when B = 1. Needed for
            ``special_tokens``, ``punctuation`` and ``induction``.
        key_mask: (B, S), True/1 = real token (Hugging Face's ``attention_mask``).
        special: the special-token strings (e.g. ``tokenizer.all_special_tokens``);
            default :func:`is_special`.
        induction: compute the prefix-matching score (needs ``tokens``).

    Returns:
        rows in model order, heads ascending; ``layer`` is the index in ``cap.layers``.
        Inputs are never modified (every computation works on new float64 tensors).

    Raises:
        TypeError, ValueError (before any computation): no weights captured, non-square
            weights, a key_mask or token list of the wrong shape, induction without tokens.
    """
    names = weighted_layers(cap)
    b, _, s, sk = cap.weights[names[0]].shape
    for name in names:
        shape = tuple(cap.weights[name].shape)
        if shape[2] != shape[3] or (shape[0], shape[2]) != (b, s):
            raise ValueError(f"metrics need self-attention weights over one batch, (B, H, S, S); layer {name!r} "
                             f"has {list(shape)}")
    real = _check_key_mask(key_mask, b, s)
    tok = _check_tokens(tokens, b, s)
    if induction and tok is None:
        raise ValueError("induction=True needs tokens (ids or strings of the batch)")
    if special is not None and (isinstance(special, str) or not isinstance(special, Collection)):
        raise TypeError(f"special must be a collection of token strings, got {type(special).__name__}")
    special = None if special is None else frozenset(special)
    rows: list[HeadMetrics] = []
    for name in names:
        info = cap.info[name]
        fnorm = _fnorm(cap, name) if name in cap.v and _knows_w_o(cap, name) else None
        scores = _layer_scores(cap.weights[name].detach().to("cpu", torch.float64, copy=True), real,
                               info.causal, info.window, tok, special, induction, fnorm)
        for k, head in enumerate(info.heads):
            values = {f: (None if (sc := scores[f]) is None else float(sc[k])) for f in METRIC_FIELDS}
            rows.append(HeadMetrics(layer=cap.layers.index(name), head=head, label=None, **values))
    return rows


def format_table(rows: Sequence[HeadMetrics], *, digits: int = 2) -> str:
    """An aligned plain-text table, one line per head ("-" = not measured)."""
    short = {"previous_token": "prev", "next_token": "next", "diagonal": "self", "first_token": "first",
             "special_tokens": "special", "punctuation": "punct", "induction": "induct", "norm_weight": "norm"}
    header = ["layer", "head", "label", *(short.get(f, f) for f in METRIC_FIELDS)]
    body = [[str(r.layer), str(r.head), r.label or "-",
             *("-" if getattr(r, f) is None else f"{getattr(r, f):.{digits}f}" for f in METRIC_FIELDS)]
            for r in rows]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    fmt = lambda cells: "  ".join(c.ljust(w) if i == 2 else c.rjust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return "\n".join([fmt(header), "  ".join("-" * w for w in widths), *(fmt(r) for r in body)])


def to_json(rows: Sequence[HeadMetrics]) -> str:
    """The rows as a JSON list of objects with every field (null = not measured; NaN refused)."""
    return json.dumps([asdict(r) for r in rows], allow_nan=False)

