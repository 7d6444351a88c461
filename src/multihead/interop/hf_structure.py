"""Which causal/window rule a patched layer attends with under Hugging Face's mask.

Notation: B batch, S tokens (queries), Sk keys, H query heads.

A wrapper's layer has its own rule (:class:`~multihead.masks.Structure`: causal, a window),
and-ed with the mask HF hands it. That is exact while HF's mask is causal and something (padding,
a sliding window, chunks). Some models' masks let a query see later keys: Gemma 3 with
``token_type_ids`` lets an image's tokens attend to each other both ways (bidirectional inside
each image, causal elsewhere), PaliGemma's prefix does the same where its text config sets
``use_bidirectional_attention=False`` (by default its layers are bidirectional, ``is_causal``
False, and the whole rule is HF's mask). HF's own kernels then attend with the mask alone, so
must the layer: :func:`attend_structure` says with which rule, the layer's or none (HF's mask
then holds the window too, as HF builds it for the layer).

Only the causal rule is compared: a mask that passes it and allows keys beyond the layer's
window keeps the layer's window (a window described wrong in the registry must still show in
the zoo's comparison, not be papered over by HF's mask).

The question costs one tensor comparison of the mask against the causal rule and one bool read
back to the host, asked only where that rule hides some key of the call (a causal layer's call
with more than one query; decoding one token hides nothing) and remembered for HF's mask tensor,
which a model shares among its layers: once per mask and model call, not once per layer.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from .._memo import remember
from ..masks import Structure

__all__ = ["attend_structure", "is_own_rule", "hides_keys", "exceeds"]

#: HF masks whose answer is remembered: the model's full and sliding masks of a call, and a few more.
SEEN_SIZE = 8
#: id of HF's mask -> (a weak reference to it, its version, (S, Sk), the answer). Weak: a
#: remembered mask is freed with the model call that made it (a prefill's masks are S × Sk).
_seen: dict[int, tuple[Any, int, Any, bool]] = {}
#: The same for :func:`is_own_rule`'s answers.
_own: dict[int, tuple[Any, int, Any, bool]] = {}


def hides_keys(structure: Structure, sq: int, sk: int) -> bool:
    """Whether ``structure`` hides any of Sk keys from S queries (bottom-right aligned), from the
    shapes alone: the first query's span ends last and the last query's begins first."""
    first, last = sk - sq, sk - 1  # the queries' positions
    return structure.span(first, sk)[1] < sk or structure.span(last, sk)[0] > 0


def exceeds(mask: torch.Tensor, structure: Structure, sq: int) -> torch.Tensor:
    """Whether ``mask`` (B|1, 1|H, S|1, Sk) bool, True = attend, allows a key ``structure`` hides
    (bottom-right aligned, S = ``sq`` queries): a 0-d bool tensor on the mask's device."""
    rule = structure.dense(sq, mask.shape[-1], device=mask.device)  # (S, Sk)
    return (mask & ~rule).any()


def attend_structure(structure: Structure, attention_mask: torch.Tensor | None, mask: torch.Tensor | None,
                     sq: int) -> Structure:
    """The rule a layer attends with: its own ``structure`` where HF's mask lets no query see a later key
    (or the layer is not causal), else none (``Structure()``: HF's mask is the whole mask, window
    included, as HF's kernels read it).

    Args:
        structure: the layer's causal/window rule (:attr:`MultiHeadAttention.structure`).
        attention_mask: HF's mask as handed to the module (bool or additive float), the tensor the
            answer is remembered for; None where HF gave none (then the layer's rule holds).
        mask: ``attention_mask`` as ours, bool (B|1, 1|H, S, Sk), cut to the call's keys.
        sq: S, the call's queries.

    While a compiler traces, no value is read back: HF's mask alone (exact whatever it holds).
    """
    causal = Structure(causal=True)
    if not structure.causal or mask is None or attention_mask is None or not hides_keys(causal, sq, mask.shape[-1]):
        return structure
    if torch.compiler.is_compiling():
        return Structure()  # no data-dependent branch in a graph; the mask alone is HF's own reading
    beyond = _answer(_seen, attention_mask, (sq, mask.shape[-1]), lambda: bool(exceeds(mask, causal, sq)))
    return Structure() if beyond else structure


def is_own_rule(structure: Structure, attention_mask: torch.Tensor | None, mask: torch.Tensor | None,
                sq: int, starts: torch.Tensor | None = None) -> bool:
    """Whether HF's mask is exactly the layer's own rule over the call's keys, for every row:
    nothing hidden or shown beyond ``structure`` (a sliding layer's mask once the cache passes
    its window, an eager model's all-True decoding mask) but, given ``starts``, each row's keys
    before its start (left padding). The layer's fused step then computes what HF's call would
    (:func:`multihead.interop.hf_cache.own_step`).

    Args: as :func:`attend_structure`'s, ``mask`` (B|1, 1|H, S, Sk) with Sk the keys after the
    call's write; ``starts``: (B,) int64, each row's first key, or None (every row from key 0).
    False while a compiler traces (no value read back) or without a mask.
    """
    if mask is None or attention_mask is None or torch.compiler.is_compiling():
        return False
    sk = mask.shape[-1]
    what = ("own", sq, sk, structure.causal, structure.window, None if starts is None else tuple(starts.tolist()))

    def ask() -> bool:
        rule = structure.dense(sq, sk, device=mask.device)  # (S, Sk)
        if starts is not None:  # (B, 1, S, Sk): and each row's keys from its start
            rule = rule & (torch.arange(sk, device=mask.device) >= starts.to(mask.device)[:, None, None, None])
        return bool((mask == rule).all())

    return _answer(_own, attention_mask, what, ask)


def _answer(table: dict[int, tuple[Any, int, Any, bool]], attention_mask: torch.Tensor, what: Any,
            ask: Callable[[], bool]) -> bool:
    """``ask()`` (one value read back), remembered in ``table`` for HF's mask tensor while it is
    unchanged (the same object at the same version) and asked about the same ``what``."""
    version = None if attention_mask.is_inference() else attention_mask._version  # (inference: not counted)
    found = table.get(id(attention_mask))
    if version is not None and found is not None and found[0]() is attention_mask and found[1:3] == (version, what):
        return found[3]
    answer = ask()
    if version is not None:
        remember(table, id(attention_mask), (weakref.ref(attention_mask), version, what, answer), SEEN_SIZE)
    return answer
