"""Sentence embeddings of many texts with a real model run on multihead's attention.

Notation: N texts, B texts in a batch, S tokens (the batch's longest text, others padded),
E embed_dim.

:class:`Embedder` loads a checkpoint (default: the bundled all-MiniLM-L6-v2), patches its
attention with multihead's (:func:`multihead.hf.patch`) and embeds texts as
``SentenceTransformer(model_dir).encode(texts)`` does for that folder:

* the tokenizer cuts each text at the model's limit (``max_seq_length`` of
  ``sentence_bert_config.json``, at most ``max_position_embeddings``; 256 tokens for MiniLM),
  and every text so cut is reported (:attr:`Embedded.truncated`), never silently;
* mean pooling over the real tokens, then L2 normalisation when the folder's ``modules.json``
  lists a ``Normalize`` module (MiniLM's does); a folder without ``modules.json`` is pooled by
  mean and not normalised, as sentence-transformers does for a plain checkpoint; a module
  or pooling mode other than these is refused by name;
* texts are sorted by token count, batched, and the rows put back in input order, so that a
  batch pads little (the order changes no embedding beyond float rounding); a BERT-family
  encoder then runs each batch on its real tokens only (:func:`multihead.hf.pack_padding`).

Empty texts (``""`` or only whitespace) are refused with their index (a line number in
:func:`embed_file`): sentence-transformers would embed them as ``[CLS] [SEP]`` alone, which is
almost always a stray blank line rather than a text. Files are read as strict UTF-8 (a BOM is
dropped), one text per ``\\n``-ended line (a ``\\r`` before it dropped too).
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from ..threads import ThreadChooser
from . import machine, models

__all__ = ["Embedder", "Embedded", "embed", "embed_file", "read_texts", "check_texts", "check_batch_size",
           "bf16_emulated", "check_dtype", "DTYPES", "check_out_path", "OUT_FORMATS", "DEFAULT_BATCH_SIZE",
           "Threads", "check_embed_threads"]

#: Texts per batch unless told (sentence-transformers' default too).
DEFAULT_BATCH_SIZE = 32
#: The encoder precisions :class:`Embedder` runs. bfloat16 keeps 8 bits of mantissa: on the
#: bundled MiniLM its embeddings' cosine to float32's is about 0.9999, and its error against a
#: float64 run stays within 2× that of transformers' own model run in bfloat16 (tested).
DTYPES = (torch.float32, torch.bfloat16)
#: The output formats :func:`embed_file` writes, by file extension.
OUT_FORMATS = (".npy", ".jsonl")
#: The modules of ``modules.json`` that :class:`Embedder` reproduces (by their class name).
_KNOWN_MODULES = ("Transformer", "Pooling", "Normalize")


@dataclass(frozen=True)
class Embedded:
    """The embeddings of N texts and how they were made.

    Attributes:
        vectors: (N, E) float32, row i for text i.
        tokens: each text's token count before any cut (special tokens included).
        max_length: the model's limit; a text over it was cut to its first ``max_length`` tokens.
        truncated: the indices of the texts cut, ascending.
        normalized: whether the rows are unit vectors (the model's ``Normalize`` module).
        batches: how many forward passes ran.
        threads: torch's intra-op threads while they ran (with ``threads="auto"``: the most).
        seconds: wall time of the tokenizing and the passes (not the model's loading).
        others_cpu_share: the share of the machine's CPUs other processes used meanwhile (0: none;
            None where the machine does not tell): over :data:`machine.BUSY_SHARE`, ``seconds``
            says little of an idle machine's.
        batch_threads: the threads each batch ran on, in the order they ran (longest texts first).
    """

    vectors: np.ndarray
    tokens: list[int]
    max_length: int
    truncated: list[int]
    normalized: bool
    batches: int
    threads: int
    seconds: float
    others_cpu_share: float | None = None
    batch_threads: tuple[int, ...] = ()


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON file ({e})") from e


def _pipeline(path: Path) -> bool:
    """Whether ``path``'s sentence-transformers pipeline normalises (its ``modules.json``:
    Transformer, mean Pooling, optional Normalize; anything else refused by name)."""
    spec = path / "modules.json"
    if not spec.is_file():
        return False  # a plain checkpoint: SentenceTransformer adds mean pooling, no Normalize
    kinds = []
    for module in _read_json(spec):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind not in _KNOWN_MODULES:
            raise ValueError(f"{spec}: module {module.get('type')!r} is not one multihead embed reproduces "
                             f"(it runs {', '.join(_KNOWN_MODULES)})")
        if kind == "Pooling":
            _check_mean_pooling(path / str(module.get("path", "")) / "config.json")
        kinds.append(kind)
    return "Normalize" in kinds


def _check_mean_pooling(config_path: Path) -> None:
    config = _read_json(config_path) if config_path.is_file() else {"pooling_mode_mean_tokens": True}
    if "pooling_mode" in config:  # the newer spelling: "mean", "cls", ...
        modes = [str(config["pooling_mode"])]
    else:  # the older one: "pooling_mode_mean_tokens": true, "pooling_mode_cls_token": false, ...
        modes = [k.removeprefix("pooling_mode_").removesuffix("_tokens").removesuffix("_token")
                 for k, v in config.items() if k.startswith("pooling_mode_") and v is True]
    if modes != ["mean"]:
        raise ValueError(f"{config_path}: pooling {modes} is not supported: multihead embed pools by mean only")


def _token_limit(path: Path, config: Any, tokenizer: Any) -> int:
    """sentence-transformers' cut: ``max_seq_length`` where the folder sets one, else the
    tokenizer's ``model_max_length``; at most ``max_position_embeddings`` either way."""
    limit = models._max_length(path, config)
    if not (path / "sentence_bert_config.json").is_file():
        limit = min(limit, int(min(tokenizer.model_max_length, 1 << 30)))  # "no limit" is a huge int
    return limit


def check_texts(texts: Sequence[str], *, what: str = "texts") -> list[str]:
    """``texts`` as a list, or a ValueError/TypeError naming the first few bad entries."""
    if isinstance(texts, (str, bytes)) or not isinstance(texts, Sequence):
        raise TypeError(f"{what} must be a sequence of strings, got {type(texts).__name__}")
    texts = list(texts)
    if not texts:
        raise ValueError(f"{what} must hold at least one text, got none")
    wrong = [i for i, t in enumerate(texts) if not isinstance(t, str)]
    if wrong:
        raise TypeError(f"{what} must be strings: {what}[{wrong[0]}] is {type(texts[wrong[0]]).__name__}")
    empty = [i for i, t in enumerate(texts) if not t.strip()]
    if empty:
        raise ValueError(f"{what} must not be empty or only whitespace: {what}{empty[:5]} "
                         f"({len(empty)} in all)")
    return texts


def check_dtype(dtype: object) -> torch.dtype:
    """``dtype`` if it is one of :data:`DTYPES`.

    Raises:
        TypeError: anything else, naming the accepted ones.
    """
    if not isinstance(dtype, torch.dtype) or dtype not in DTYPES:
        raise TypeError(f"dtype must be one of {', '.join(map(str, DTYPES))}, got {dtype!r}")
    return dtype


def bf16_emulated() -> str | None:
    """Why bfloat16 is the slow choice on this CPU, or None where the CPU multiplies bfloat16 in
    hardware (:func:`multihead.backends.native.bf16_instructions`): without those instructions
    torch emulates bfloat16 products in float32 arithmetic (the bundled model took 6.7x its float32
    time on an AMD EPYC with AVX2)."""
    from ..backends import native

    if native.bf16_instructions():
        return None
    return (f"this CPU has no bfloat16 instructions ({', '.join(native.BF16_FLAGS)}): torch emulates bfloat16 "
            "products, several times slower than float32")


#: ``threads`` of :meth:`Embedder.embed`: a count, None (as set) or ``"auto"``.
Threads = int | Literal["auto"] | None


def check_embed_threads(threads: object) -> int | str | None:
    """``threads`` if it is None, a positive int or ``"auto"``, else a TypeError/ValueError naming it."""
    if threads == "auto":
        return "auto"
    if threads is None or isinstance(threads, int):
        return models.check_threads(threads)  # a bool refused there too
    raise TypeError(f"threads must be None, a positive int or 'auto', got {threads!r}")


def check_batch_size(batch_size: int) -> int:
    """``batch_size`` if it is a positive int, else a TypeError/ValueError naming it."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int):
        raise TypeError(f"batch_size must be an int, got {batch_size!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size}")
    return batch_size


class Embedder:
    """A checkpoint loaded once, patched with multihead's attention, ready to embed texts.

    Args:
        model_dir: a checkpoint directory (config.json + model.safetensors + tokenizer; a
            sentence-transformers folder for its pooling and normalisation); default the
            bundled all-MiniLM-L6-v2.
        normalize: L2-normalise the pooled vectors; default (None) what the folder's
            ``modules.json`` says (a ``Normalize`` module listed; no ``modules.json``: no).
        dtype: the encoder's precision: ``torch.float32`` (default: equal to
            sentence-transformers' own float32 encode within float rounding) or
            ``torch.bfloat16`` (weights and activations in bfloat16, the pooling in float32:
            about twice as fast where the CPU has AMX or AVX512-BF16, with a bfloat16
            computation's accuracy: see :data:`DTYPES`; on a CPU without them torch emulates
            bfloat16 products, several times slower than float32: a ``UserWarning`` says so).

    Raises:
        ValueError: a bad folder or checkpoint, a sentence-transformers module or pooling mode
            other than Transformer / mean Pooling / Normalize, or attention multihead cannot patch.
        TypeError: ``normalize`` not None or a bool, ``dtype`` not one of :data:`DTYPES`.
    """

    def __init__(self, model_dir: str | os.PathLike[str] | None = None, *, normalize: bool | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        if normalize is not None and not isinstance(normalize, bool):
            raise TypeError(f"normalize must be None or a bool, got {normalize!r}")
        check_dtype(dtype)
        from .. import hf

        if dtype == torch.bfloat16 and (why := bf16_emulated()) is not None:
            warnings.warn(f"Embedder in bfloat16: {why}; float32 is the faster choice here", UserWarning,
                          stacklevel=2)
        self.path = models._checkpoint_dir(model_dir)
        listed = _pipeline(self.path)  # before loading: a refused pipeline costs nothing
        self.normalize = listed if normalize is None else normalize
        self.model, self.tokenizer = models.load_model(self.path), models.load_tokenizer(self.path)
        hf.patch(self.model.to(dtype))
        self.dtype = dtype
        # BERT-family encoders run each batch on its real tokens only (the padding costs nothing)
        self.packing = hf.pack_padding(self.model) if hf.packable(self.model) else None
        self.max_length = _token_limit(self.path, self.model.config, self.tokenizer)
        settings = self.path / "sentence_bert_config.json"
        self.lower_case = settings.is_file() and bool(_read_json(settings).get("do_lower_case", False))

    def embed(self, texts: Sequence[str], *, batch_size: int = DEFAULT_BATCH_SIZE, threads: Threads = None,
              progress: Callable[[int, int], None] | None = None) -> Embedded:
        """The embeddings of ``texts``, batched by length, in input order.

        Args:
            texts: N non-empty strings.
            batch_size: texts per forward pass (B).
            threads: torch's intra-op threads while embedding (restored after); default as set;
                ``"auto"``: as set or one, batch by batch, whichever runs faster now
                (:class:`multihead.threads.ThreadChooser`: beside a busy process, one thread often does).
            progress: called after each batch with (texts done, N).

        Returns:
            an :class:`Embedded`, its ``vectors`` (N, E) float32.

        Raises:
            ValueError: no texts, an empty or whitespace-only text (by index), ``batch_size``
                or ``threads`` below 1.
            TypeError: a text that is not a string, a non-integer ``batch_size`` or ``threads``.
        """
        texts = check_texts(texts)
        check_batch_size(batch_size)
        count = check_embed_threads(threads)
        load = machine.OthersLoad()
        with models.torch_threads(None if isinstance(count, str) else count) as most, torch.no_grad(), load:
            chooser = ThreadChooser(most) if count == "auto" else None
            start = time.perf_counter()
            rows, tokens = self._tokenize([t.lower() for t in texts] if self.lower_case else texts)
            order = sorted(range(len(texts)), key=lambda i: -len(rows[i]["input_ids"]))  # longest first, stable
            parts: list[np.ndarray] = []
            used: list[int] = []
            for done in range(0, len(texts), batch_size):
                chunk = [rows[i] for i in order[done:done + batch_size]]
                used.append(most if chooser is None else chooser.next())
                if chooser is not None:
                    torch.set_num_threads(used[-1])  # torch's own count restored by torch_threads at the end
                began = time.perf_counter()
                parts.append(self._forward(chunk).numpy())  # (B, E)
                if chooser is not None:
                    chooser.record(used[-1], time.perf_counter() - began, sum(len(r["input_ids"]) for r in chunk))
                if progress is not None:
                    progress(min(done + batch_size, len(texts)), len(texts))
            by_length = np.concatenate(parts).astype(np.float32, copy=False)  # (N, E), longest text first
            vectors = np.empty_like(by_length)
            vectors[order] = by_length  # back to input order
            seconds = time.perf_counter() - start
        return Embedded(vectors=vectors, tokens=tokens, max_length=self.max_length,
                        truncated=[i for i, n in enumerate(tokens) if n > self.max_length],
                        normalized=self.normalize, batches=len(used), threads=max(used), seconds=seconds,
                        others_cpu_share=load.share, batch_threads=tuple(used))

    def _tokenize(self, texts: list[str]) -> tuple[list[dict[str, list[int]]], list[int]]:
        """Each text's features (cut at :attr:`max_length`) and its token count before the cut."""
        whole = self.tokenizer(texts, verbose=False)  # verbose=False: no "longer than" warning per text
        tokens = [len(ids) for ids in whole["input_ids"]]
        rows = [{k: whole[k][i] for k in whole.keys()} for i in range(len(texts))]
        long = [i for i, n in enumerate(tokens) if n > self.max_length]
        if long:  # re-tokenized with the tokenizer's own cut (it keeps the closing special token)
            cut = self.tokenizer([texts[i] for i in long], truncation=True, max_length=self.max_length)
            for j, i in enumerate(long):
                rows[i] = {k: cut[k][j] for k in cut.keys()}
        return rows, tokens

    def _forward(self, rows: list[dict[str, list[int]]]) -> torch.Tensor:
        """(B, E) pooled vectors of one batch of tokenized texts."""
        batch = self.tokenizer.pad(rows, padding=True, return_tensors="pt")
        inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
        if getattr(self.model.config, "is_decoder", False) or getattr(self.model.config, "use_cache", False):
            inputs["use_cache"] = False
        hidden = self.model(**inputs).last_hidden_state.float()  # (B, S, E), pooled in float32
        m = batch["attention_mask"].to(hidden.dtype)[..., None]  # (B, S, 1)
        pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)  # (B, E)
        return torch.nn.functional.normalize(pooled, dim=-1) if self.normalize else pooled


def embed(texts: Sequence[str], *, model_dir: str | os.PathLike[str] | None = None,
          batch_size: int = DEFAULT_BATCH_SIZE, threads: Threads = None, normalize: bool | None = None,
          dtype: torch.dtype = torch.float32, progress: Callable[[int, int], None] | None = None) -> np.ndarray:
    """(N, E) float32 sentence embeddings of ``texts``, equal to ``SentenceTransformer.encode``.

    One-shot form of :class:`Embedder` (which see for the arguments; load one to embed many
    times). A text over the model's limit is cut as sentence-transformers cuts it, and a
    :class:`UserWarning` says how many were (:meth:`Embedder.embed` returns their indices).

    Raises:
        ValueError, TypeError: as :class:`Embedder` and :meth:`Embedder.embed`, before loading.
    """
    texts = check_texts(texts)
    check_batch_size(batch_size)
    check_dtype(dtype)
    check_embed_threads(threads)
    result = Embedder(model_dir, normalize=normalize, dtype=dtype).embed(texts, batch_size=batch_size, threads=threads,
                                                            progress=progress)
    if result.truncated:
        warnings.warn(f"{len(result.truncated)} of {len(texts)} texts were cut to the model's "
                      f"{result.max_length} tokens: texts{result.truncated[:10]}", UserWarning, stacklevel=2)
    return result.vectors


def read_texts(path: str | os.PathLike[str]) -> list[str]:
    """The lines of a UTF-8 text file, one text each.

    Lines end at ``\\n`` (a ``\\r`` before it is dropped, a final ``\\n`` ends the last line);
    a UTF-8 byte-order mark at the start is dropped.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a folder, an empty file, bytes that are not UTF-8 (with the byte offset and
            line), or empty / whitespace-only lines (by line number).
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a folder, not a text file")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ValueError(f"{path} is not UTF-8: byte {e.start} (line {line}) is {data[e.start:e.start + 1]!r} "
                         f"({e.reason})") from None
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()  # the final newline ends the last line
    lines = [t.removesuffix("\r") for t in lines]
    if not lines:
        raise ValueError(f"{path} is empty: no text to embed")
    empty = [i + 1 for i, t in enumerate(lines) if not t.strip()]
    if empty:
        raise ValueError(f"{path} has empty lines (one text per line, none blank): line "
                         f"{', '.join(map(str, empty[:10]))}{' ...' if len(empty) > 10 else ''} "
                         f"({len(empty)} of {len(lines)})")
    return lines


def check_out_path(out_path: str | os.PathLike[str], source: str | os.PathLike[str] | None = None) -> Path:
    """``out_path`` as a Path if :func:`embed_file` can write there, else a ValueError naming it:
    an extension other than :data:`OUT_FORMATS`, a folder, a missing parent folder, or the input."""
    out = Path(out_path)
    if out.suffix.lower() not in OUT_FORMATS:
        raise ValueError(f"out must end in {' or '.join(OUT_FORMATS)}, got {str(out)!r}")
    if out.is_dir():
        raise ValueError(f"out must name a file, got the folder {str(out)!r}")
    if not out.parent.is_dir():
        raise ValueError(f"out {str(out)!r}: the folder {str(out.parent)!r} does not exist")
    if source is not None and out.exists() and out.resolve() == Path(source).resolve():
        raise ValueError(f"out {str(out)!r} is the input file")
    return out


def _write(out: Path, vectors: np.ndarray) -> None:
    """Write (N, E) ``vectors`` as .npy or JSONL (``{"line": i, "embedding": [...]}``, i from 1),
    through a temporary file beside ``out`` so that an interrupted run leaves no half file."""
    tmp = out.with_name(f".{out.name}.partial")
    try:
        if out.suffix.lower() == ".npy":
            with tmp.open("wb") as f:
                np.save(f, vectors)
        else:
            with tmp.open("w", encoding="utf-8") as f:
                for i, row in enumerate(vectors.tolist(), 1):  # float32 -> float: exact, read back equal
                    f.write(json.dumps({"line": i, "embedding": row}) + "\n")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def embed_file(path: str | os.PathLike[str], out_path: str | os.PathLike[str] | None = None, *,
               model_dir: str | os.PathLike[str] | None = None, batch_size: int = DEFAULT_BATCH_SIZE,
               threads: Threads = None, normalize: bool | None = None, dtype: torch.dtype = torch.float32,
               progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Embed each line of ``path`` (:func:`read_texts`) and write the (N, E) float32 rows.

    Args:
        path: a UTF-8 text file, one text per line.
        out_path: ``.npy`` (``numpy.load`` gives (N, E) float32) or ``.jsonl`` (line i:
            ``{"line": i, "embedding": [E floats]}``); default ``path`` with the suffix ``.npy``.
        model_dir, batch_size, threads, normalize, dtype, progress: as :class:`Embedder` and
            :meth:`Embedder.embed`.

    Returns:
        a JSON-ready dict: ``input``, ``out``, ``model_dir``, ``texts`` (N), ``embed_dim`` (E),
        ``normalized``, ``batch_size``, ``batches``, ``threads``, ``auto_threads``, ``batch_threads``,
        ``seconds``, ``others_cpu_share``,
        ``max_length`` and
        ``truncated`` (``{"count", "lines"}``: the lines cut to ``max_length`` tokens, from 1).

    Raises:
        FileNotFoundError, ValueError, TypeError: a bad file (:func:`read_texts`), output path
            (:func:`check_out_path`), argument or model, all before the model loads.
    """
    source = Path(path)
    out = check_out_path(source.with_suffix(".npy") if out_path is None else out_path, source)
    texts = read_texts(source)
    check_batch_size(batch_size)
    check_dtype(dtype)
    check_embed_threads(threads)
    embedder = Embedder(model_dir, normalize=normalize, dtype=dtype)
    result = embedder.embed(texts, batch_size=batch_size, threads=threads, progress=progress)
    _write(out, result.vectors)
    return {"input": str(source), "out": str(out), "model_dir": str(embedder.path), "texts": len(texts),
            "embed_dim": int(result.vectors.shape[1]), "normalized": result.normalized, "batch_size": batch_size,
            "dtype": str(dtype).removeprefix("torch."),
            "batches": result.batches, "threads": result.threads, "seconds": result.seconds,
            "auto_threads": threads == "auto", "batch_threads": list(result.batch_threads),
            "others_cpu_share": result.others_cpu_share,
            "max_length": result.max_length,
            "truncated": {"count": len(result.truncated), "lines": [i + 1 for i in result.truncated]}}
