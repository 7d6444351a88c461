"""``multihead embed`` and :mod:`multihead.tools.embed`: the bundled MiniLM, patched with
multihead's attention, against ``SentenceTransformer(bundled_dir).encode`` (the oracle).

The model loads once per module (:func:`embedder`); the command-line tests reuse it where they
check files and refusals, and one test runs the real command in a subprocess.
"""

from __future__ import annotations

import copy
import json
import re
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from multihead import cli
from multihead.tools import embed as embed_mod
from multihead.tools import models

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

#: ~40 texts: short and long (past MiniLM's 256 tokens and past BERT's 512 positions), cased,
#: accented, CJK, emoji, right-to-left, code, numbers, spaces and tabs at the edges.
TEXTS = [
    "Hello world",
    "Multi-head attention splits the model width into heads.",
    "  leading and trailing spaces  ",
    "\ttabs\tinside\tand around\t",
    "UPPER CASE and lower case",
    "Café, naïve, façade, jalapeño, Ångström",
    "日本語の文章を埋め込みます。",
    "中文句子，测试一下。",
    "한국어 문장입니다",
    "Emoji 🙂🚀🔥 in a sentence 👍🏽",
    "مرحبا بالعالم، هذه جملة عربية",
    "שלום עולם",
    "Ελληνικά γράμματα αβγδ",
    "Кириллица: съешь же ещё этих мягких французских булок",
    "def f(x): return x ** 2",
    "3.14159 2.71828 1e-10 -42 0x1F",
    "a",
    "?",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "word " * 300,  # 302 tokens: cut to 256
    "Attention is all you need. " * 120,  # ~720 tokens: past the 512 positions too
    " ".join(f"token{i}" for i in range(400)),
    "Zero\u200bwidth\u200bspaces and a soft\u00adhyphen",
    "Mixed: English, français, Deutsch (Größe), español (¿qué?), 日本",
    "https://example.com/path?query=1&other=two#frag",
    "email@example.org wrote: \"quoted\" 'single' `back`",
    "Line with   many     internal      spaces",
    "A sentence about heads, keys, values and queries.",
    "Each head attends on its own.",
    "The heads are concatenated and mixed by the output projection.",
    "Short.",
    "Another short one",
    "Numbers: one two three four five six seven eight nine ten",
    "Punctuation!!! ... ??? ;;; ::: ---",
    "ﬁ ligature and fullwidth ＡＢＣ１２３",
    "Combining: e\u0301 a\u0308 o\u0302",
    "Tamil தமிழ் and Hindi हिन्दी",
    "Thai ภาษาไทย no spaces between words",
    "x " * 255,  # 257 tokens: just past the limit
    "y " * 254,  # 256 tokens: exactly at the limit, not cut
]


@pytest.fixture(scope="module")
def embedder() -> embed_mod.Embedder:
    return embed_mod.Embedder()


@pytest.fixture(scope="module")
def sentence_transformer():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(models.bundled_model_dir()), device="cpu", local_files_only=True)


@pytest.fixture(scope="module")
def theirs(sentence_transformer) -> np.ndarray:
    return sentence_transformer.encode(TEXTS, show_progress_bar=False)  # (N, E)


@pytest.fixture(scope="module")
def ours(embedder: embed_mod.Embedder) -> embed_mod.Embedded:
    return embedder.embed(TEXTS, batch_size=8)


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return (a64 * b64).sum(-1) / (np.linalg.norm(a64, axis=-1) * np.linalg.norm(b64, axis=-1))


@pytest.fixture
def reuse(monkeypatch: pytest.MonkeyPatch, embedder: embed_mod.Embedder) -> None:
    """:func:`embed_file` (and so the command) given the module's loaded model, not a new one."""
    monkeypatch.setattr(embed_mod, "Embedder", lambda model_dir=None, normalize=None, dtype=torch.float32: embedder)


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading a model fails the test: refusals must come before it."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded before the refusal")
    monkeypatch.setattr(embed_mod, "Embedder", refuse)


def _write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


# ---- equal to sentence-transformers ----------------------------------------------------------------
def test_embeddings_equal_sentence_transformers_encode(ours: embed_mod.Embedded, theirs: np.ndarray) -> None:
    assert ours.vectors.shape == theirs.shape == (len(TEXTS), 384) and ours.vectors.dtype == np.float32
    cos = _cosines(ours.vectors, theirs)
    assert cos.min() >= 1 - 1e-5, (cos.argmin(), cos.min())
    assert np.abs(ours.vectors - theirs).max() <= 1e-5
    np.testing.assert_allclose(np.linalg.norm(ours.vectors, axis=-1), 1.0, atol=1e-5)  # the Normalize module
    assert ours.normalized


def test_rows_come_back_in_input_order(ours: embed_mod.Embedded, theirs: np.ndarray) -> None:
    """Each row is nearest to the oracle's row of the same text, though batches ran longest first."""
    nearest = _cosines(ours.vectors[:, None, :], theirs[None, :, :]).argmax(1)
    assert nearest.tolist() == list(range(len(TEXTS)))


def test_texts_over_the_limit_are_cut_as_sentence_transformers_cuts_them_and_reported(
        ours: embed_mod.Embedded, sentence_transformer) -> None:
    limit = sentence_transformer.max_seq_length
    whole = [len(ids) for ids in sentence_transformer.tokenizer(TEXTS, verbose=False)["input_ids"]]
    assert ours.max_length == limit == 256
    assert ours.tokens == whole
    assert ours.truncated == [i for i, n in enumerate(whole) if n > limit]
    assert len(ours.truncated) == 4 and TEXTS.index("y " * 254) not in ours.truncated  # 256 tokens: kept whole


def test_batching_by_length_equals_one_text_at_a_time(embedder: embed_mod.Embedder,
                                                      ours: embed_mod.Embedded) -> None:
    some = [*range(0, len(TEXTS), 4), 20, 38]  # short, long and cut ones, batched with others in ``ours``
    one = embedder.embed([TEXTS[i] for i in some], batch_size=1)
    assert one.batches == len(some) and ours.batches == 5
    assert np.abs(one.vectors - ours.vectors[some]).max() <= 1e-5


def test_normalize_false_is_the_pooling_alone(embedder: embed_mod.Embedder, sentence_transformer) -> None:
    from sentence_transformers import SentenceTransformer

    pooled_only = SentenceTransformer(modules=[sentence_transformer[0], sentence_transformer[1]], device="cpu")
    theirs = pooled_only.encode(TEXTS[:6], show_progress_bar=False)
    raw = copy.copy(embedder)  # the same model and tokenizer, as Embedder(normalize=False) loads them
    raw.normalize = False
    mine = raw.embed(TEXTS[:6]).vectors
    assert np.abs(mine - theirs).max() <= 1e-5 and not np.allclose(np.linalg.norm(mine, axis=-1), 1.0)


def test_progress_is_called_after_each_batch(embedder: embed_mod.Embedder) -> None:
    calls: list[tuple[int, int]] = []
    embedder.embed(TEXTS[:5], batch_size=2, progress=lambda done, total: calls.append((done, total)))
    assert calls == [(2, 5), (4, 5), (5, 5)]


@pytest.fixture
def threads_seen(embedder: embed_mod.Embedder, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """torch's thread count at each of the embedder's forward passes, from now on."""
    seen: list[int] = []
    forward = embedder._forward

    def counting(rows):
        seen.append(torch.get_num_threads())
        return forward(rows)

    monkeypatch.setattr(embedder, "_forward", counting)
    return seen


def test_threads_are_set_while_embedding_and_restored(embedder: embed_mod.Embedder, threads_seen: list[int]) -> None:
    before = torch.get_num_threads()
    seen = threads_seen
    result = embedder.embed(TEXTS[:2], threads=1)
    assert result.threads == 1 and seen == [1] and torch.get_num_threads() == before


def test_auto_threads_choose_per_batch_give_the_same_embeddings_and_restore_torchs(
        embedder: embed_mod.Embedder, threads_seen: list[int]) -> None:
    """``threads="auto"`` runs each batch on torch's threads or one (:class:`multihead.threads.ThreadChooser`),
    says which in ``batch_threads``, embeds as a fixed count does and leaves torch's setting."""
    before = torch.get_num_threads()
    seen = threads_seen
    fixed = embedder.embed(TEXTS[:9], batch_size=2)
    seen.clear()
    auto = embedder.embed(TEXTS[:9], batch_size=2, threads="auto")
    assert list(auto.batch_threads) == seen and len(seen) == auto.batches == 5
    assert fixed.batch_threads == (before,) * 5 and torch.get_num_threads() == before
    if before > 1:  # the warm-up and the first timed batch on torch's count, then one on a single thread
        assert seen[:3] == [before, before, 1] and auto.threads == before
    assert _cosines(auto.vectors, fixed.vectors).min() >= 1 - 1e-6


# ---- the function on bad texts ---------------------------------------------------------------------
@pytest.mark.parametrize("texts, error, message", [
    ([], ValueError, "at least one"),
    (["fine", ""], ValueError, "texts[1]"),
    (["fine", "ok", "  \t "], ValueError, "texts[2]"),
    (["fine", 3], TypeError, "texts[1] is int"),
    ("a single string", TypeError, "sequence of strings"),
])
def test_bad_texts_are_refused_by_index(embedder: embed_mod.Embedder, texts, error, message: str) -> None:
    with pytest.raises(error) as e:
        embedder.embed(texts)
    assert message in str(e.value)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"batch_size": 0}, ValueError, "batch_size"), ({"batch_size": 2.0}, TypeError, "batch_size"),
    ({"threads": 0}, ValueError, "threads"), ({"threads": -1}, ValueError, "threads"),
    ({"threads": "2"}, TypeError, "threads"), ({"threads": True}, TypeError, "threads"),
    ({"threads": "Auto"}, TypeError, "'auto'"),
    ({"dtype": torch.float16}, TypeError, "dtype must be one of torch.float32, torch.bfloat16"),
    ({"dtype": "bfloat16"}, TypeError, "dtype"),
])
def test_bad_arguments_are_refused_before_the_model_loads(no_model: None, kwargs, error, message: str) -> None:
    with pytest.raises(error, match=message):
        embed_mod.embed(["a text"], **kwargs)


def test_embed_function_warns_of_cut_texts(reuse: None, theirs: np.ndarray) -> None:
    with pytest.warns(UserWarning, match=r"1 of 3 texts were cut to the model's 256 tokens: texts\[1\]"):
        vectors = embed_mod.embed([TEXTS[0], TEXTS[19], TEXTS[1]])
    assert _cosines(vectors, theirs[[0, 19, 1]]).min() >= 1 - 1e-5


def test_a_pipeline_it_cannot_reproduce_is_refused_by_name(tmp_path: Path) -> None:
    bundled = models.bundled_model_dir()
    (tmp_path / "config.json").write_bytes((bundled / "config.json").read_bytes())
    modules = json.loads((bundled / "modules.json").read_text())
    dense = [*modules, {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}]
    (tmp_path / "modules.json").write_text(json.dumps(dense))
    with pytest.raises(ValueError, match="Dense"):
        embed_mod.Embedder(tmp_path)
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    with pytest.raises(ValueError, match=r"pooling \['cls'\]"):
        embed_mod.Embedder(tmp_path)


# ---- files -----------------------------------------------------------------------------------------
def test_lines_are_read_as_written(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_bytes("\ufeffone\r\ntwo é\nthree".encode())  # a BOM, CRLF, no final newline
    assert embed_mod.read_texts(path) == ["one", "two é", "three"]


def test_an_empty_file_is_refused_by_name(tmp_path: Path, no_model: None, capsys) -> None:
    path = tmp_path / "empty.txt"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.txt is empty"):
        embed_mod.embed_file(path)
    with pytest.raises(SystemExit) as e:
        cli.main(["embed", str(path)])
    assert e.value.code == 2 and "empty.txt is empty" in capsys.readouterr().err


def test_empty_lines_are_refused_by_line_number(tmp_path: Path, no_model: None) -> None:
    path = _write_lines(tmp_path / "t.txt", ["one", "", "three", "   ", "five"])
    with pytest.raises(ValueError, match=r"t\.txt has empty lines .*line 2, 4 \(2 of 5\)"):
        embed_mod.embed_file(path)


def test_non_utf8_is_refused_with_its_byte_and_line(tmp_path: Path, no_model: None) -> None:
    path = tmp_path / "latin1.txt"
    path.write_bytes("first line\nsecond\ncaf".encode() + b"\xe9 au lait\n")
    with pytest.raises(ValueError, match=r"latin1\.txt is not UTF-8: byte 21 \(line 3\) is b'\\xe9'"):
        embed_mod.embed_file(path)


def test_a_missing_file_is_refused(tmp_path: Path, no_model: None, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["embed", str(tmp_path / "nope.txt")])
    assert e.value.code == 2 and "nope.txt" in capsys.readouterr().err


@pytest.mark.parametrize("out, message", [
    ("out.csv", "must end in .npy or .jsonl"),
    ("folder.npy", "must name a file, got the folder"),
    ("missing/out.npy", "does not exist"),
    ("t.jsonl", "is the input file"),
])
def test_bad_out_paths_are_refused_by_name(tmp_path: Path, no_model: None, out: str, message: str) -> None:
    source = _write_lines(tmp_path / "t.jsonl", ["one"])
    (tmp_path / "folder.npy").mkdir()
    with pytest.raises(ValueError, match=message):
        embed_mod.embed_file(source, tmp_path / out)


def test_the_command_writes_npy_and_jsonl_that_load_back_equal(tmp_path: Path, reuse: None, theirs: np.ndarray,
                                                             capsys) -> None:
    some = [*range(0, 10), 19, 38]  # lines 11 and 12 are over the limit
    source = _write_lines(tmp_path / "texts.txt", [TEXTS[i] for i in some])
    assert cli.main(["embed", str(source), "--batch-size", "5", "--json"]) == 0  # default: texts.npy
    out, err = capsys.readouterr()
    info = json.loads(out)
    assert info["out"] == str(tmp_path / "texts.npy") and info["texts"] == len(some) and info["batches"] == 3
    assert info["truncated"] == {"count": 2, "lines": [11, 12]} and info["max_length"] == 256
    assert "2 of 12 lines were cut to the model's 256 tokens" in err and "line 11, 12" in err
    assert "multihead embed" in err  # the progress bar
    npy = np.load(tmp_path / "texts.npy")
    assert npy.dtype == np.float32 and npy.shape == (len(some), 384)
    assert _cosines(npy, theirs[some]).min() >= 1 - 1e-5

    jsonl = tmp_path / "texts.jsonl"
    assert cli.main(["embed", str(source), "--out", str(jsonl), "--batch-size", "5", "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"wrote {jsonl}: 12 embeddings of 384 float32 (unit vectors)")
    assert "multihead embed" not in err and "2 of 12 lines were cut" in err
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [r["line"] for r in records] == list(range(1, len(some) + 1))
    assert np.array_equal(np.array([r["embedding"] for r in records], dtype=np.float32), npy)  # the same batches
    assert not list(tmp_path.glob(".*partial"))


class _Load:
    """machine.OthersLoad reporting the share set on the class."""

    share_to_report: float | None = None

    def __init__(self) -> None:
        self.share: float | None = None

    def __enter__(self) -> "_Load":
        return self

    def __exit__(self, *exc: object) -> None:
        self.share = _Load.share_to_report


@pytest.mark.parametrize("share, busy", [(0.6, True), (0.05, False), (None, False)])
def test_the_command_says_when_other_processes_kept_the_machine_busy(tmp_path: Path, reuse: None, capsys,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    share: float | None, busy: bool) -> None:
    monkeypatch.setattr(embed_mod.machine, "OthersLoad", _Load)
    _Load.share_to_report = share
    source = _write_lines(tmp_path / "texts.txt", TEXTS[:3])
    assert cli.main(["embed", str(source), "--no-progress"]) == 0
    said = "other processes used 60% of the CPUs meanwhile (busy: these figures are not a verdict)"
    assert (said in capsys.readouterr().out) is busy
    assert cli.main(["embed", str(source), "--no-progress", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["others_cpu_share"] == share


def test_the_command_with_auto_threads_says_each_counts_batches(tmp_path: Path, reuse: None, capsys) -> None:
    source = _write_lines(tmp_path / "texts.txt", TEXTS[:5])
    assert cli.main(["embed", str(source), "--no-progress", "--threads", "auto", "--batch-size", "1"]) == 0
    said = re.search(r"torch threads chosen per batch \(auto\): ((?:\d+ on \d+ batch(?:es)?(?:, )?)+), ",
                     capsys.readouterr().out)  # which count ran faster is the machine's to say
    assert said is not None
    counts = {int(n): int(k) for n, k in re.findall(r"(\d+) on (\d+) batch", said.group(1))}  # threads: batches
    assert sum(counts.values()) == 5 and set(counts) <= {1, torch.get_num_threads()}
    assert cli.main(["embed", str(source), "--no-progress", "--threads", "auto", "--batch-size", "1", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["auto_threads"] is True and len(info["batch_threads"]) == info["batches"] == 5


def test_the_embedding_tells_what_share_of_the_cpus_others_used(ours: embed_mod.Embedded) -> None:
    share = ours.others_cpu_share  # measured from /proc/stat on Linux
    assert share is None if not Path("/proc/stat").exists() else (share is not None and 0.0 <= share <= 1.0)


def test_the_command_end_to_end(tmp_path: Path, theirs: np.ndarray) -> None:
    source = _write_lines(tmp_path / "texts.txt", TEXTS[:3])
    done = subprocess.run([sys.executable, "-m", "multihead", "embed", str(source), "--out",
                           str(tmp_path / "e.npy"), "--threads", "1", "--json"],
                          capture_output=True, text=True, env=ENV, timeout=300)
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["threads"] == 1 and info["truncated"]["count"] == 0
    assert _cosines(np.load(tmp_path / "e.npy"), theirs[:3]).min() >= 1 - 1e-5


@pytest.mark.parametrize("value", ["0", "-1", "x", "1.5"])
@pytest.mark.parametrize("flag", ["--threads", "--batch-size"])
def test_the_command_refuses_bad_counts(tmp_path: Path, no_model: None, capsys, flag: str, value: str) -> None:
    source = _write_lines(tmp_path / "t.txt", ["one"])
    with pytest.raises(SystemExit) as e:
        cli.main(["embed", str(source), flag, value])
    said = "a positive integer or auto" if flag == "--threads" else "a positive integer"
    assert e.value.code == 2 and f"argument {flag}: must be {said}, got '{value}'" in capsys.readouterr().err


def _hf_embeddings(texts: list[str], dtype: torch.dtype) -> torch.Tensor:
    """(N, E) float64 unit vectors of transformers' own (unpatched) bundled model run in ``dtype``:
    mean pooling over real tokens, then L2 normalisation, as the bundled pipeline does."""
    path = models.bundled_model_dir()
    model, tokenizer = models.load_model(path).to(dtype), models.load_tokenizer(path)
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state.double()  # (N, S, E)
    m = batch["attention_mask"].double()[..., None]  # (N, S, 1)
    return torch.nn.functional.normalize((hidden * m).sum(1) / m.sum(1), dim=-1)


def test_bfloat16_encoder_is_as_accurate_as_transformers_own_in_bfloat16() -> None:
    """``dtype=torch.bfloat16``: against a float64 run of the model, the error of our bfloat16
    embeddings is at most 2× that of transformers' model run in bfloat16 (flash-attention's
    criterion: a naive run in the same precision), and their cosine to float32's is above 0.999."""
    texts = TEXTS[:12]
    exact = _hf_embeddings(texts, torch.float64)
    naive = (_hf_embeddings(texts, torch.bfloat16) - exact).norm(dim=-1)  # (N,)
    with warnings.catch_warnings():  # said on a CPU without bfloat16 instructions (tested below)
        warnings.filterwarnings("ignore", "Embedder in bfloat16", UserWarning)
        ours = embed_mod.Embedder(dtype=torch.bfloat16).embed(texts, batch_size=4).vectors
    err = (torch.from_numpy(ours).double() - exact).norm(dim=-1)
    assert err.max() <= 2 * naive.max() and err.mean() <= 2 * naive.mean(), (err, naive)
    assert _cosines(ours, exact.numpy()).min() > 0.999


@pytest.mark.parametrize("hardware", [True, False], ids=["bf16 instructions", "emulated"])
def test_bfloat16_without_bfloat16_instructions_warns_and_the_bench_skips_it(
        monkeypatch: pytest.MonkeyPatch, hardware: bool) -> None:
    """On a CPU without AVX512-BF16 or AMX, torch emulates bfloat16 products (6.7× float32's time with
    AVX2): ``Embedder(dtype=torch.bfloat16)`` says so in a ``UserWarning`` (float32 does not), and the
    embedding benchmark lists its bfloat16 way as skipped with that reason instead of timing it."""
    from multihead.backends import native
    from multihead.tools import bench_embed

    monkeypatch.setattr(native, "bf16_instructions", lambda: hardware)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        embed_mod.Embedder(dtype=torch.float32)
        assert not [w for w in caught if "bfloat16" in str(w.message)]
        embed_mod.Embedder(dtype=torch.bfloat16)
    said = [str(w.message) for w in caught if issubclass(w.category, UserWarning) and "bfloat16" in str(w.message)]
    assert bool(said) == (not hardware)
    assert not said or ("avx512_bf16, amx_bf16" in said[0] and "slower than float32" in said[0])
    made: list[torch.dtype] = []

    class Counted(embed_mod.Embedder):
        def __init__(self, *args: object, dtype: torch.dtype = torch.float32, **kwargs: object) -> None:
            made.append(dtype)  # not loaded: what the bench asks for is the point
    monkeypatch.setattr(embed_mod, "Embedder", Counted)
    ways, skipped, facts = bench_embed._ways(TEXTS[:4])
    assert (bench_embed.WAYS[3] in ways) == hardware and (torch.bfloat16 in made) == hardware
    assert set(ways) | set(skipped) == set(bench_embed.WAYS) and facts["texts"] == 4
    assert hardware or "no bfloat16 instructions (avx512_bf16, amx_bf16)" in skipped[bench_embed.WAYS[3]]
