"""Pictures of the heads: a PNG grid (matplotlib) and one self-contained HTML page.

Notation: B sequences, L captured layers, H heads, n real tokens of one sequence.

The page (:func:`to_html`) is one file: the data as JSON in a ``<script type=
"application/json">`` element (``<``, ``>``, ``&``, U+2028/U+2029 written as ``\\uXXXX``,
so no token or title can end it), the script and the styles inline, nothing fetched (no
CDN, no font, no image), so it works offline and from ``file://``. Every text is set with
``textContent``, never parsed as HTML. Weights are stored quantised to 0–255 (a step of
1/255) and deflated, about 1 byte per weight or less before base64; the browser inflates
them with its own ``DecompressionStream``. Sequences longer than ``max_tokens`` are
refused (raise the limit to allow them).

Files are written whole or not at all: the content is built and encoded first, written to
a temporary file in the same folder, then renamed over the target.
"""

from __future__ import annotations

import base64
import json
import os
import re
import tempfile
import zlib
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

import torch

from .capture import Capture, weighted_layers
from .labels import THRESHOLDS, label
from .metrics import METRIC_HELP, HeadMetrics, _check_key_mask, metrics

__all__ = ["plot", "to_html", "page_data", "DEFAULT_MAX_TOKENS", "DEFAULT_PNG_TOKENS", "LEVELS"]

#: The default token limit of :func:`to_html` and :func:`plot` (``max_tokens=`` raises it).
DEFAULT_MAX_TOKENS = 256
#: The most tokens a PNG cell shows: a longer sequence is cropped to its first ones (the picture says so).
DEFAULT_PNG_TOKENS = 48
#: Token labels are drawn on the PNG's axes up to this many shown tokens.
PNG_LABELLED_TOKENS = 24
#: The page stores a weight w as round(w · LEVELS) in one byte.
LEVELS = 255
#: What the label rules mean, for the page's legend.
_LABEL_EXTRA = {"induction": " (causal layers only)", "mixed": ""}


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
    return names, idx, w  # w: (L, H', n, n)


def _rows(cap: Capture, rows: Sequence[HeadMetrics] | None, key_mask: torch.Tensor | None) -> list[HeadMetrics]:
    if rows is not None:
        return list(rows)
    return label(metrics(cap, None, key_mask), causal=[cap.info[n].causal for n in cap.layers])


def _real_tokens(tokens: object, s: int, idx: torch.Tensor, argname: str) -> list[str]:
    """One sequence's tokens as its n real ones (given as those n or as all S positions)."""
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
        raise TypeError(f"{argname} must be a list of strings, got {type(tokens).__name__}")
    if len(tokens) == s and s != idx.numel():
        tokens = [tokens[i] for i in idx.tolist()]  # the padded row: keep its real tokens
    if len(tokens) != idx.numel():
        raise ValueError(f"{argname} must hold the sequence's {idx.numel()} real tokens (or all S={s} positions), "
                         f"got {len(tokens)}")
    return [str(t) for t in tokens]


def _target(path: str | os.PathLike[str], suffix: str | None) -> Path:
    """The file to write: a folder is refused; ``suffix`` (".png") is added when the name has none,
    and any other suffix is refused (what is reported is what is written)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    out = Path(path)
    if out.is_dir() or str(path).endswith(("/", os.sep)):
        raise ValueError(f"path must name a file, got the folder {str(path)!r}: add a file name, e.g. "
                         f"{str(out / ('heads' + (suffix or '.html')))!r}")
    if suffix is not None:
        if out.suffix == "":
            out = out.with_name(out.name + suffix)
        elif out.suffix.lower() != suffix:
            raise ValueError(f"path must end in {suffix} (the picture is a PNG), got {str(path)!r}")
    if not out.parent.is_dir():
        raise ValueError(f"path {str(path)!r}: the folder {str(out.parent)!r} does not exist")
    return out


def _write_whole(out: Path, data: bytes) -> None:
    """``data`` into ``out``, atomically: a temporary file in the same folder, then renamed."""
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            # mkstemp's file is private (0600): give it the mode a plain open() would have
            os.fchmod(f.fileno(), out.stat().st_mode & 0o7777 if out.exists() else 0o666 & ~_umask())
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)  # the only way to read it
    os.umask(mask)
    return mask


def _utf8(text: object, argname: str) -> str:
    if not isinstance(text, str):
        raise TypeError(f"{argname} must be a str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{argname} must be encodable as UTF-8, got a lone surrogate "
                         f"{text[e.start]!r} at index {e.start}") from None
    return text


def plot(cap: Capture, path: str | os.PathLike[str], *, sequence: int = 0, key_mask: torch.Tensor | None = None,
         rows: Sequence[HeadMetrics] | None = None, tokens: Sequence[str] | None = None,
         max_tokens: int = DEFAULT_MAX_TOKENS, crop: int = DEFAULT_PNG_TOKENS, dpi: int = 130) -> Path:
    """A PNG grid, layers × heads: each cell one head's weights on one sequence (real tokens
    only; rows = queries, columns = keys), titled with its label; the sequence named on top,
    a colour bar (square-root scale, so that weights of long rows stay visible), token
    labels on the axes of the left column and the bottom row when few enough tokens are
    shown. A sequence longer than ``crop`` tokens is cropped to its first ``crop`` queries
    and keys, and the picture says so.

    Args:
        cap: a capture holding ``"weights"``.
        path: the PNG to write (``.png`` is added to a name without a suffix); a folder is refused.
        sequence: which sequence of the batch.
        key_mask: (B, S) real tokens; padding rows and columns are left out.
        rows: labelled metrics (default: computed from ``cap`` without tokens).
        tokens: the shown sequence's tokens (its n real ones or all S), for its name and the axes.
        crop: the most tokens shown per axis.

    Returns:
        the path written.

    Raises:
        ImportError: matplotlib missing (the ``bench`` extra).
        TypeError, ValueError: before drawing, as in :func:`to_html`; a folder or another suffix.
    """
    out = _target(path, ".png")
    names, idx, w = _sequence(cap, sequence, key_mask, max_tokens)
    if isinstance(crop, bool) or not isinstance(crop, int) or crop < 2:
        raise ValueError(f"crop must be an int ≥ 2, got {crop!r}")
    s = cap.weights[names[0]].shape[2]
    toks = None if tokens is None else _real_tokens(tokens, s, idx, "tokens")
    labels = {(r.layer, r.head): r.label for r in _rows(cap, rows, key_mask)}
    n = w.shape[-1]
    shown = min(n, crop)
    w = w[..., :shown, :shown]  # (L, H', shown, shown)
    import io

    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.colors import PowerNorm

    n_layers, n_heads = w.shape[0], w.shape[1]
    cell = 1.25 if shown <= PNG_LABELLED_TOKENS else 1.1
    fig, axes = plt.subplots(n_layers, n_heads, figsize=(cell * n_heads + 1.6, cell * n_layers + 1.4),
                             squeeze=False)
    norm = PowerNorm(gamma=0.5, vmin=0.0, vmax=1.0)
    image = None
    tick = [t if len(t) <= 10 else t[:9] + "…" for t in (toks or [])[:shown]]
    for li, name in enumerate(names):
        layer = cap.layers.index(name)
        for k, head in enumerate(cap.info[name].heads):
            ax = axes[li][k]
            image = ax.imshow(w[li, k].numpy(), cmap="Blues", norm=norm, interpolation="nearest")
            ax.set_xticks([]), ax.set_yticks([])
            ax.set_title(f"L{layer} H{head}: {labels.get((layer, head)) or ''}", fontsize=6, pad=2)
            if toks and shown <= PNG_LABELLED_TOKENS:  # the tokens themselves on the outer axes
                if k == 0:
                    ax.set_yticks(range(shown), tick, fontsize=4)
                if li == n_layers - 1:
                    ax.set_xticks(range(shown), tick, fontsize=4, rotation=90)
            else:  # too many to read: token positions every few tokens
                at = list(range(0, shown, -(-shown // 4)))
                if k == 0:
                    ax.set_yticks(at, [str(a) for a in at], fontsize=5)
                if li == n_layers - 1:
                    ax.set_xticks(at, [str(a) for a in at], fontsize=5)
        axes[li][0].set_ylabel("queries", fontsize=6)
    for ax in axes[-1]:
        ax.set_xlabel("keys", fontsize=6)
    text = "" if not toks else " ".join(toks)
    text = text if len(text) <= 110 else text[:109] + "…"
    what = f"sequence {sequence}" + (f": “{text}”" if text else "") + f" — {n} tokens"
    note = (f"cropped: the first {shown} of {n} tokens shown (queries and keys)" if shown < n
            else f"all {n} tokens shown")
    fig.suptitle(f"{what}\nrows = queries, columns = keys, one cell per head (layer L, head H); {note}",
                 fontsize=8)
    fig.tight_layout(rect=(0, 0, 0.93, 0.97))
    assert image is not None  # every layer has a head
    bar = fig.colorbar(image, ax=axes.ravel().tolist(), fraction=0.015, pad=0.01)
    bar.set_label("attention weight (square-root colour scale)", fontsize=7)
    bar.ax.tick_params(labelsize=6)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    _write_whole(out, buf.getvalue())
    return out


def _quantised(w: torch.Tensor) -> str:
    """(L, H', n, n) weights in [0, 1] as round(w · LEVELS) bytes, deflated (zlib), base64."""
    q = (w.clamp(0.0, 1.0) * LEVELS).round().to(torch.uint8).contiguous()
    return base64.b64encode(zlib.compress(q.numpy().tobytes(), 9)).decode("ascii")


def page_data(cap: Capture, tokens: Sequence[str] | Sequence[Sequence[str]], *, sequence: int = 0,
              key_mask: torch.Tensor | None = None, rows: Sequence[HeadMetrics] | None = None,
              max_tokens: int = DEFAULT_MAX_TOKENS, title: str = "multihead: heads",
              texts: Sequence[str] | None = None, cut: Sequence[int | None] | None = None) -> dict:
    """The JSON the page embeds (``window.__mhData``): layers, heads, every text's tokens and
    weights (quantised, deflated, base64: ``"w"``), metrics, the legend. Arguments as :func:`to_html`."""
    title = _utf8(title, "title")
    names = weighted_layers(cap)
    b, s = cap.weights[names[0]].shape[0], cap.weights[names[0]].shape[2]
    nested = not isinstance(tokens, (str, bytes)) and isinstance(tokens, Sequence) and len(tokens) > 0 \
        and all(not isinstance(t, (str, bytes)) and isinstance(t, Sequence) for t in tokens)
    if nested and len(tokens) != b:
        raise ValueError(f"tokens must hold one list per sequence (B={b}) or one sequence's tokens, "
                         f"got {len(tokens)} lists")
    if nested and (isinstance(sequence, bool) or not isinstance(sequence, int) or not 0 <= sequence < b):
        raise ValueError(f"sequence must be an index in [0, {b - 1}], got {sequence!r}")
    shown = list(range(b)) if nested else [sequence]
    for argname, given in (("texts", texts), ("cut", cut)):
        if given is not None and (isinstance(given, (str, bytes)) or not isinstance(given, Sequence)
                                  or len(given) != len(shown)):
            raise ValueError(f"{argname} must hold one entry per shown sequence ({len(shown)}), got {given!r}")
    out_texts = []
    for k, seq in enumerate(shown):
        _, idx, w = _sequence(cap, seq, key_mask, max_tokens)
        toks = _real_tokens(tokens[seq] if nested else tokens, s, idx,
                            f"tokens[{seq}]" if nested else "tokens")
        was = None if cut is None else cut[k]
        if was is not None and (isinstance(was, bool) or not isinstance(was, int) or was < 1):
            raise ValueError(f"cut[{k}] must be the text's token count before it was cut (int) or None, got {was!r}")
        name = str(texts[k]) if texts is not None else " ".join(toks)
        out_texts.append({"index": seq, "text": name, "tokens": toks, "cut": was, "w": _quantised(w)})
    all_rows = _rows(cap, rows, key_mask)
    return {
        "title": title,
        "layers": [cap.layers.index(n) for n in names],
        "names": names,
        "heads": list(cap.info[names[0]].heads),
        "causal": [cap.info[n].causal for n in names],
        "levels": LEVELS,
        "first": shown.index(sequence),
        "texts": out_texts,
        "metrics": [dict(r.__dict__) for r in all_rows],
        "legend": {
            "labels": [[name, f"{field} {'≥' if op == '>=' else '≤'} {value:g}{_LABEL_EXTRA.get(name, '')}"]
                       for name, (field, op, value) in THRESHOLDS.items()] + [["mixed", "none of the rules above"]],
            "metrics": [[field, text] for field, text in METRIC_HELP.items()],
        },
    }


def _script_json(data: dict) -> str:
    """JSON that no content can end early inside a ``<script>`` element: ``<``, ``>``, ``&`` and
    the line separators U+2028/U+2029 written as ``\\uXXXX`` (non-ASCII too: ensure_ascii)."""
    blob = json.dumps(data, allow_nan=False, separators=(",", ":"), ensure_ascii=True)
    return blob.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def to_html(cap: Capture, tokens: Sequence[str] | Sequence[Sequence[str]], path: str | os.PathLike[str], *,
            sequence: int = 0, key_mask: torch.Tensor | None = None, rows: Sequence[HeadMetrics] | None = None,
            max_tokens: int = DEFAULT_MAX_TOKENS, title: str = "multihead: heads",
            texts: Sequence[str] | None = None, cut: Sequence[int | None] | None = None) -> Path:
    """Write one self-contained HTML page: a text selector, the selected head's weights as a
    matrix (hover a cell for its value), a head view, a model view, the metrics table and a
    legend of every label and metric.

    * Matrix: rows = queries, columns = keys, token labels on both axes; hovering a cell
      shows the query, the key and the weight.
    * Head view: the tokens in two columns (queries left, keys right) joined by lines whose
      opacity is the weight; hovering a token shows what it attends to (left) or what
      attends to it (right), the other column shaded and labelled with the weights.
    * Model view: every head as a thumbnail heatmap; click one to open it.
    * Metrics table: one row per head with its label; click a header to sort.

    Args:
        cap: a capture holding ``"weights"`` (self-attention).
        tokens: every sequence's tokens (B lists: all are on the page, with a selector), or
            one sequence's (the one ``sequence`` names); each its n real tokens, or all S positions.
        path: the HTML file to write (a folder is refused); replaced whole, or left as it was.
        sequence: the sequence shown (one list of tokens) or opened first (B lists).
        key_mask: (B, S) real tokens.
        rows: labelled metrics for the table (default: computed from ``cap``).
        max_tokens: refuse longer sequences (the page grows as L·H·n², about a byte per weight).
        title: the page's title (as text, never markup).
        texts: the shown sequences' original texts, for the selector (default: their tokens).
        cut: per shown sequence, its token count before the tokenizer cut it (None = not cut):
            the page shows a notice for each cut text.

    Returns:
        the path written.

    Raises:
        TypeError, ValueError (before writing): a token list of the wrong length, too many
            tokens, a bad sequence index, no weights captured, a title that is not valid
            text (a lone surrogate), a folder as ``path``.
    """
    out = _target(path, None)
    data = page_data(cap, tokens, sequence=sequence, key_mask=key_mask, rows=rows, max_tokens=max_tokens,
                     title=title, texts=texts, cut=cut)
    template = resources.files(__package__).joinpath("view.html").read_text(encoding="utf-8")
    values = {"TITLE": _escape(data["title"]), "DATA": _script_json(data)}
    # One pass: what is substituted is never scanned again for placeholders.
    html = re.sub(r"__MH_(TITLE|DATA)__", lambda m: values[m.group(1)], template)
    _write_whole(out, html.encode("utf-8"))
    return out
