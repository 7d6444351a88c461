"""One word per head: its dominant behaviour, by documented thresholds.

The rules, tried in this order (the first that holds wins):

=================  ===================================================================
label              rule (scores from :mod:`multihead.heads.metrics`)
=================  ===================================================================
previous token     previous_token ≥ 0.5 (Clark et al. 2019's POSITION_THRESHOLD: half
                   of the row's mass on one relative position)
next token         next_token ≥ 0.5
self               diagonal ≥ 0.5
first token        first_token ≥ 0.5 (half the mass on the first token, [CLS] or BOS;
                   a "sink" in StreamingLLM's sense); wins over "special token" when the
                   first token is [CLS]
induction          induction ≥ 0.4 on a causal layer (the prefix-matching threshold
                   proposed in the notes; the anchors publish none); never on encoders
special token      special_tokens ≥ 0.6 (Clark's SPECIAL_TOKEN_THRESHOLD)
punctuation        punctuation ≥ 0.6 (Clark)
local              distance ≤ 2.0 tokens (mean attention distance; our convention)
broad              entropy ≥ 0.78 (Clark's 3.8 nats on 128-token segments, ln 128 = 4.85)
mixed              none of the above
=================  ===================================================================

A score that was not measured (None) never satisfies its rule.
"""

from __future__ import annotations

from collections.abc import Sequence

from .metrics import HeadMetrics

__all__ = ["label", "LABELS", "THRESHOLDS"]

#: Every label, in the order the rules are tried.
LABELS = ("previous token", "next token", "self", "first token", "induction", "special token",
          "punctuation", "local", "broad", "mixed")

#: label -> (metric field, comparison, threshold).
THRESHOLDS: dict[str, tuple[str, str, float]] = {
    "previous token": ("previous_token", ">=", 0.5),
    "next token": ("next_token", ">=", 0.5),
    "self": ("diagonal", ">=", 0.5),
    "first token": ("first_token", ">=", 0.5),
    "induction": ("induction", ">=", 0.4),
    "special token": ("special_tokens", ">=", 0.6),
    "punctuation": ("punctuation", ">=", 0.6),
    "local": ("distance", "<=", 2.0),
    "broad": ("entropy", ">=", 0.78),
}


def _holds(row: HeadMetrics, name: str, causal: bool) -> bool:
    field, op, threshold = THRESHOLDS[name]
    value = getattr(row, field)
    if value is None or (name == "induction" and not causal):
        return False
    return value >= threshold if op == ">=" else value <= threshold


def label(rows: Sequence[HeadMetrics], *, causal: bool | Sequence[bool] = False) -> list[HeadMetrics]:
    """Fill each row's ``label`` (in place) with exactly one of :data:`LABELS`.

    Args:
        rows: from :func:`multihead.heads.metrics`.
        causal: whether the layers are causal (the "induction" label needs it): one bool,
            or one per layer index.

    Returns:
        ``rows`` (the same objects), for chaining.

    Raises:
        TypeError: a row that is not a HeadMetrics.
        ValueError: per-layer ``causal`` too short for a row's layer index.
    """
    for row in rows:
        if not isinstance(row, HeadMetrics):
            raise TypeError(f"rows must hold HeadMetrics, got {type(row).__name__}")
        if isinstance(causal, bool):
            is_causal = causal
        else:
            if row.layer >= len(causal):
                raise ValueError(f"causal has {len(causal)} entries, but a row has layer {row.layer}")
            is_causal = bool(causal[row.layer])
        row.label = next((name for name in THRESHOLDS if _holds(row, name, is_causal)), "mixed")
    return list(rows)
