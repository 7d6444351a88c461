"""Pictures of the heads: a PNG grid (matplotlib) and one self-contained HTML page.

Notation: L captured layers, H heads, n real tokens of the sequence shown.

The page (:func:`to_html`) is one file: the data as JSON, the script and the styles
inline, nothing fetched (no CDN, no font, no image), so it works offline and from
``file://``. Weights are rounded to ``decimals`` places to keep it small; sequences
longer than ``max_tokens`` are refused (raise the limit to allow them).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

import torch

from .capture import Capture, weighted_layers
from .labels import label
from .metrics import HeadMetrics, _check_key_mask, metrics

__all__ = ["plot", "to_html", "DEFAULT_MAX_TOKENS"]

#: The default token limit of :func:`to_html` and :func:`plot` (``max_tokens=`` raises it).
DEFAULT_MAX_TOKENS = 256


def _sequence(cap: Capture, sequence: int, key_mask: torch.Tensor | None, max_tokens: int
              ) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """(layer names, real-token index (n,), weights (L, H', n, n) float64) of one sequence."""
    names = weighted_layers(cap)
    b, _, s, sk = cap.weights[names[0]].shape
    if s != sk:
        raise ValueError(f"pictures need self-attention weights (S = Sk), got S={s}, Sk={sk}")
    if isinstance(sequence, bool) or not isinstance(sequence, int) or not 0 <= sequence < b:
        raise ValueError(f"sequence must be an index in [0, {b - 1}], got {sequence!r}")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
    real = _check_key_mask(key_mask, b, s)[sequence]
    idx = real.nonzero().flatten()
    if idx.numel() > max_tokens:
        raise ValueError(f"sequence {sequence} has {idx.numel()} real tokens, over max_tokens={max_tokens}: "
                         "shorten the text or raise max_tokens (the page grows as L·H·n²)")
    heads = {len(cap.info[n].heads) for n in names}
    if len(heads) != 1:
        raise ValueError(f"pictures need the same number of captured heads in every layer, got {sorted(heads)}")
    w = torch.stack([cap.weights[n][sequence].detach().to("cpu", torch.float64)[:, idx][:, :, idx] for n in names])
    return names, idx, w


def _rows(cap: Capture, rows: Sequence[HeadMetrics] | None, tokens: object, key_mask: torch.Tensor | None
          ) -> list[HeadMetrics]:
    if rows is not None:
        return list(rows)
    return label(metrics(cap, tokens, key_mask), causal=[cap.info[n].causal for n in cap.layers])


def plot(cap: Capture, path: str | os.PathLike[str], *, sequence: int = 0, key_mask: torch.Tensor | None = None,
         rows: Sequence[HeadMetrics] | None = None, max_tokens: int = DEFAULT_MAX_TOKENS, dpi: int = 100) -> Path:
    """A PNG grid, layers × heads: each cell one head's weights on one sequence (real tokens
    only; rows = queries, columns = keys), titled with its label.

    Args:
        cap: a capture holding ``"weights"``.
        path: the PNG to write.
        sequence: which sequence of the batch.
        key_mask: (B, S) real tokens; padding rows and columns are left out.
        rows: labelled metrics (default: computed from ``cap`` without tokens).

    Returns:
        the path written.

    Raises:
        ImportError: matplotlib missing (the ``bench`` extra).
        TypeError, ValueError: before drawing, as in :func:`to_html`.
    """
    names, _, w = _sequence(cap, sequence, key_mask, max_tokens)
    labels = {(r.layer, r.head): r.label for r in _rows(cap, rows, None, key_mask)}
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    n_layers, n_heads = w.shape[0], w.shape[1]
    fig, axes = plt.subplots(n_layers, n_heads, figsize=(1.5 * n_heads, 1.6 * n_layers), squeeze=False)
    for li, name in enumerate(names):
        layer = cap.layers.index(name)
        for k, head in enumerate(cap.info[name].heads):
            ax = axes[li][k]
            ax.imshow(w[li, k].numpy(), cmap="Blues", vmin=0.0, vmax=1.0, interpolation="nearest")
            ax.set_xticks([]), ax.set_yticks([])
            ax.set_title(f"L{layer} H{head}\n{labels.get((layer, head)) or ''}", fontsize=7)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out


def page_data(cap: Capture, tokens: Sequence[str], *, sequence: int = 0, key_mask: torch.Tensor | None = None,
              rows: Sequence[HeadMetrics] | None = None, max_tokens: int = DEFAULT_MAX_TOKENS,
              decimals: int = 3) -> dict:
    """The JSON the page embeds (``window.__mhData``): layers, heads, tokens, weights, metrics."""
    names, idx, w = _sequence(cap, sequence, key_mask, max_tokens)
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
        raise TypeError(f"tokens must be a list of strings, got {type(tokens).__name__}")
    s = cap.weights[names[0]].shape[2]
    if len(tokens) == s and s != idx.numel():
        tokens = [tokens[i] for i in idx.tolist()]  # the padded row: keep its real tokens
    if len(tokens) != idx.numel():
        raise ValueError(f"tokens must hold the sequence's {idx.numel()} real tokens (or all S={s} positions), "
                         f"got {len(tokens)}")
    if isinstance(decimals, bool) or not isinstance(decimals, int) or not 1 <= decimals <= 6:
        raise ValueError(f"decimals must be an int in [1, 6], got {decimals!r}")
    all_rows = _rows(cap, rows, None, key_mask)
    return {
        "layers": [cap.layers.index(n) for n in names],
        "names": names,
        "heads": list(cap.info[names[0]].heads),
        "causal": [cap.info[n].causal for n in names],
        "tokens": [str(t) for t in tokens],
        "attn": [[[[round(float(x), decimals) for x in row] for row in head] for head in layer]
                 for layer in w.tolist()],
        "metrics": [{k: v for k, v in r.__dict__.items()} for r in all_rows],
    }


def to_html(cap: Capture, tokens: Sequence[str], path: str | os.PathLike[str], *, sequence: int = 0,
            key_mask: torch.Tensor | None = None, rows: Sequence[HeadMetrics] | None = None,
            max_tokens: int = DEFAULT_MAX_TOKENS, decimals: int = 3, title: str = "multihead: heads") -> Path:
    """Write one self-contained HTML page: a head view, a model view and the metrics table.

    * Head view: the tokens in two columns (queries left, keys right) joined by lines whose
      opacity is the weight; a layer and a head selector; hovering a token shows what it
      attends to (left) or what attends to it (right), with the other column shaded by
      weight. Encoders are drawn bidirectional: nothing is masked that the model did not.
    * Model view: every head as a thumbnail heatmap; click one to open it in the head view.
    * Metrics table: one row per head with its label; click a header to sort.

    Args:
        cap: a capture holding ``"weights"`` (self-attention).
        tokens: the shown sequence's tokens: its n real tokens, or all S positions.
        path: the HTML file to write.
        sequence: which sequence of the batch.
        key_mask: (B, S) real tokens.
        rows: labelled metrics for the table (default: computed from ``cap``).
        max_tokens: refuse longer sequences (the page grows as L·H·n²).
        decimals: weights are rounded to this many places.

    Returns:
        the path written.

    Raises:
        TypeError, ValueError (before writing): a token list of the wrong length, too many
            tokens, a bad sequence index, no weights captured.
    """
    data = page_data(cap, tokens, sequence=sequence, key_mask=key_mask, rows=rows, max_tokens=max_tokens,
                     decimals=decimals)
    template = resources.files(__package__).joinpath("view.html").read_text(encoding="utf-8")
    # "</" inside the JSON would end the script element early.
    blob = json.dumps(data, allow_nan=False, separators=(",", ":")).replace("</", "<\\/")
    html = template.replace("__MH_TITLE__", _escape(title)).replace("/*__MH_DATA__*/null", blob)
    out = Path(path)
    out.write_text(html, encoding="utf-8")
    return out


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
