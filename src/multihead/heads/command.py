"""``multihead heads``: the bundled all-MiniLM-L6-v2 (or ``--model DIR``), head by head.

Runs the patched model on the texts, prints the per-head table with labels, writes the
page (``--html``) and the picture (``--png``); ``--importance`` ranks the heads by
ablation (1 − cosine between the ablated and the full mean-pooled sentence embeddings;
the encoder has no labelled task, and the gradient score of that loss is zero at the
full model) and reports the embeddings' cosine after pruning the least important
10/25/50% of the heads. The induction column is measured on 4 repeated random sequences.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["run_heads", "PRUNE_SHARES", "INDUCTION_LENGTH"]

#: Shares of heads removed for the pruning report.
PRUNE_SHARES = (0.10, 0.25, 0.50)
#: Tokens per copy of the repeated random sequence (induction score).
INDUCTION_LENGTH = 20


def _embed(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    from ..tools.models import mean_pool

    out = model(**batch)
    return mean_pool(out.last_hidden_state, batch["attention_mask"])  # (B, E)


def model_name(path: Path) -> str:
    """A checkpoint's name for people: its model card's first heading (``# all-MiniLM-L6-v2``),
    else the folder's name."""
    card = path / "README.md"
    if card.is_file():
        for line in card.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("# ") and line[2:].strip():
                return line[2:].strip()
    return path.name


def _least_important(ranking: Sequence[tuple[int, int, float]], count: int, heads_per_layer: Sequence[int]
                     ) -> dict[int, list[int]]:
    """The ``count`` least important heads, never the last head of a layer."""
    removed: dict[int, list[int]] = {}
    for layer, head, _ in reversed(ranking):
        if sum(len(v) for v in removed.values()) == count:
            break
        if heads_per_layer[layer] - len(removed.get(layer, [])) > 1:
            removed.setdefault(layer, []).append(head)
    return {k: sorted(v) for k, v in removed.items()}


def run_heads(texts: Sequence[str] | None, model_dir: str | None, *, importance: bool = False,
              html: str | None = None, png: str | None = None,
              progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Everything ``multihead heads`` prints, as a JSON-ready dict.

    Returns:
        ``{"model", "name", "texts", "cut", "heads": [row dicts], "table", "wrote": [...]}``
        (``cut``: the texts the tokenizer cut, with their token counts; ``wrote``: the paths
        actually written) and, with
        ``importance``, ``"importance"`` (ranking by ablation) and ``"pruning"`` (share
        removed -> heads removed and mean/min cosine to the full embeddings).

    Raises:
        ValueError: empty texts, a folder as ``html`` or ``png``, or a bad model directory
            (before loading anything heavy).
    """
    from .. import hf
    from ..tools import models
    from .capture import capture
    from .edit import importance as rank_heads, prune
    from .labels import label
    from .metrics import format_table, metrics, repeated_tokens
    from .pictures import plot, to_html

    texts = list(models.DEFAULT_TEXTS if not texts else texts)
    if not all(isinstance(t, str) and t.strip() for t in texts):
        raise ValueError(f"texts must be non-empty strings, got {texts!r}")
    for argname, target in (("html", html), ("png", png)):
        if target is not None and Path(target).is_dir():
            raise ValueError(f"--{argname} must name a file, got the folder {target!r}")
    path = models._checkpoint_dir(model_dir)
    say = progress or (lambda line: None)
    say("loading the model")
    model, tok = models.load_model(path), models.load_tokenizer(path)
    hf.patch(model)
    limit = models._max_length(path, model.config)
    batch = dict(tok(texts, padding=True, truncation=True, max_length=limit, return_tensors="pt"))
    whole = [len(ids) for ids in tok(texts, verbose=False)["input_ids"]]  # each text's tokens before the cut
    cut = [n if n > limit else None for n in whole]
    batch = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
    tokens = [tok.convert_ids_to_tokens(row) for row in batch["input_ids"].tolist()]
    with torch.no_grad(), capture(model, what=("weights", "heads", "v")) as cap:
        full = _embed(model, batch)
    causal = [cap.info[n].causal for n in cap.layers]
    rows = metrics(cap, tokens, batch["attention_mask"], special=tok.all_special_tokens)

    say("induction: repeated random tokens")
    special = set(tok.all_special_ids)
    vocab = [i for i in range(min(tok.vocab_size, 30000)) if i not in special]
    ids = repeated_tokens(vocab, INDUCTION_LENGTH, 4, seed=0, bos=tok.cls_token_id or tok.bos_token_id,
                          eos=tok.sep_token_id or tok.eos_token_id)
    rep = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if "token_type_ids" in batch:
        rep["token_type_ids"] = torch.zeros_like(ids)
    with torch.no_grad(), capture(model, what=("weights",)) as cap_rep:
        model(**rep)
    for row, r in zip(rows, metrics(cap_rep, ids, induction=True)):
        row.induction = r.induction
    label(rows, causal=causal)

    result: dict[str, Any] = {"model": str(path), "name": model_name(path), "texts": texts,
                              "cut": [{"text": i, "tokens": n, "kept": limit} for i, n in enumerate(cut) if n],
                              "heads": [dict(r.__dict__) for r in rows], "table": format_table(rows), "wrote": []}
    if html:
        result["wrote"].append(str(to_html(cap, tokens, html, key_mask=batch["attention_mask"], rows=rows,
                                           title=f"multihead heads: {result['name']}", texts=texts, cut=cut)))
    if png:
        result["wrote"].append(str(plot(cap, png, key_mask=batch["attention_mask"], rows=rows, tokens=tokens[0])))
    if importance:
        result.update(_importance(model, batch, full, [cap.info[n].num_heads for n in cap.layers], say,
                                  rank_heads, prune))
    return result


def _importance(model: torch.nn.Module, batch: dict[str, torch.Tensor], full: torch.Tensor,
                heads_per_layer: list[int], say: Callable[[str], None], rank_heads: Callable,
                prune: Callable) -> dict[str, Any]:
    def loss_fn(m: torch.nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
        return 1.0 - (_embed(m, b) * full).sum(-1)  # (B,): 1 − cos (unit vectors)

    imp = rank_heads(model, [batch], loss_fn, gradient=False, ablation=True, progress=say)
    ranking = imp.ranking("ablation")
    total = sum(heads_per_layer)
    pruning = []
    for share in PRUNE_SHARES:
        count = round(share * total)
        removed = _least_important(ranking, count, heads_per_layer)
        say(f"pruning {count} of {total} heads")
        pruned = prune(copy.deepcopy(model), removed)
        with torch.no_grad():
            cos = (_embed(pruned, batch) * full).sum(-1)  # (B,)
        params = sum(p.numel() for p in pruned.parameters())
        pruning.append({"share_removed": share, "heads_removed": count, "removed": removed,
                        "mean_cosine": float(cos.mean()), "min_cosine": float(cos.min()), "parameters": params})
    return {"importance": [{"layer": layer, "head": h, "one_minus_cosine": s} for layer, h, s in ranking],
            "pruning": pruning, "parameters_full": sum(p.numel() for p in model.parameters())}


def format_result(result: dict[str, Any]) -> str:
    """The command's text output."""
    threads = f"; {result['threads']} torch threads" if "threads" in result else ""
    lines = [f"{result['name']} ({result['model']}): {len(result['texts'])} texts; induction on repeated random "
             f"tokens ({INDUCTION_LENGTH} × 2){threads}"]
    lines += [f"note: text {c['text'] + 1} was cut to its first {c['kept']} tokens (it has {c['tokens']})"
              for c in result["cut"]]
    lines += ["", result["table"]]
    if "importance" in result:
        top = result["importance"]
        lines += ["", "importance by ablation (mean 1 − cosine of the sentence embeddings with the head zeroed):",
                  "  most:  " + ", ".join(f"L{r['layer']}H{r['head']} {r['one_minus_cosine']:.4f}" for r in top[:6]),
                  "  least: " + ", ".join(f"L{r['layer']}H{r['head']} {r['one_minus_cosine']:.4f}" for r in top[-6:]),
                  "", "pruning the least important heads (real removal), cosine to the full model's embeddings:"]
        for p in result["pruning"]:
            lines.append(f"  {p['share_removed']:.0%} ({p['heads_removed']} heads): mean {p['mean_cosine']:.4f}, "
                         f"min {p['min_cosine']:.4f}, parameters {p['parameters']:,} "
                         f"(full {result['parameters_full']:,})")
    if result["wrote"]:
        lines += ["", "wrote " + " and ".join(result["wrote"])]
    return "\n".join(lines)


def main(args: Any) -> int:
    """The ``multihead heads`` subcommand on parsed arguments (text, model, html, png, json, importance,
    threads: torch's threads while it runs, restored after, and ``"threads"`` in the result)."""
    import json

    from ..tools.models import torch_threads

    progress = lambda line: print(f"  {line}", file=sys.stderr, flush=True)  # noqa: E731
    with torch_threads(getattr(args, "threads", None)) as threads:
        result = run_heads(args.text or None, args.model, importance=args.importance, html=args.html, png=args.png,
                           progress=progress)
    result["threads"] = threads
    if args.json:
        payload = {k: v for k, v in result.items() if k != "table"}
        print(json.dumps(payload, indent=2, allow_nan=False))
    else:
        print(format_result(result))
    return 0
