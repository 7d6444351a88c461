"""See, measure and edit what each attention head does.

Notation: B batch, S tokens, H heads, D head_dim, L layers.

    import multihead as mh
    with mh.heads.capture(model) as cap:          # model: MultiHeadAttention(s) or mh.hf.patch(hf_model)
        model(**batch)
    rows = mh.heads.label(mh.heads.metrics(cap, tokens, key_mask=batch["attention_mask"]))
    print(mh.heads.format_table(rows))
    mh.heads.plot(cap, "heads.png", tokens=tokens[0])  # PNG grid, L × H, of the first sequence
    mh.heads.to_html(cap, tokens, "heads.html")        # one self-contained page, every sequence
    with mh.heads.ablate(model, {0: [3]}):         # head 3 of layer 0 removed for a while
        ...
    mh.heads.prune(model, {0: [3]})                # ... or for good

Modules: :mod:`.capture` (recording), :mod:`.metrics` and :mod:`.labels` (what a head
does), :mod:`.edit` (ablation, importance, pruning), :mod:`.pictures` (PNG and HTML),
:mod:`.command` (``multihead heads``).
"""

from .capture import DEFAULT_LIMIT_BYTES, WORKSPACE_COPIES, Capture, LayerInfo, capture, find_layers
from .edit import (CurvePoint, Importance, ablate, config_of, importance, prune, pruning_curve, resolve_spec,
                   scale)
from .labels import LABELS, THRESHOLDS, label
from .metrics import (METRIC_FIELDS, METRIC_HELP, HeadMetrics, format_table, is_punctuation, is_special, metrics,
                      norm_weights, repeated_tokens, to_json)
from .pictures import DEFAULT_MAX_TOKENS, DEFAULT_PNG_TOKENS, plot, to_html

__all__ = [
    "capture", "Capture", "LayerInfo", "find_layers", "DEFAULT_LIMIT_BYTES", "WORKSPACE_COPIES",
    "metrics", "HeadMetrics", "METRIC_FIELDS", "METRIC_HELP", "norm_weights", "format_table", "to_json",
    "repeated_tokens",
    "is_special", "is_punctuation",
    "label", "LABELS", "THRESHOLDS",
    "scale", "ablate", "importance", "Importance", "prune", "pruning_curve", "CurvePoint", "config_of",
    "resolve_spec",
    "plot", "to_html", "DEFAULT_MAX_TOKENS", "DEFAULT_PNG_TOKENS",
]
