"""The picture, the page (in a real headless Chromium) and the ``multihead heads`` command.

Notation: B sequences, L layers, H heads, n real tokens of one sequence.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import multihead as mh
from browser import RecordedPage, needs_chromium
from heads_helpers import TEXTS, hand_capture, minilm

DOCS = Path(__file__).resolve().parents[2] / "docs"
#: The README's pictures are these tests' own output: with MULTIHEAD_WRITE_DOCS=1 the tests
#: copy them into docs/; otherwise they stay in pytest's temporary folder (no test run
#: changes the working tree).
WRITE_DOCS = os.environ.get("MULTIHEAD_WRITE_DOCS") == "1"
#: A text the tokenizer cuts at the model's 256 tokens.
LONG = " ".join(["Attention heads, each on its own, look at different things in the sentence!"] * 20)
#: One step of the page's stored weights (round(w · 255) / 255), and its rounding bound.
STEP = 1 / mh.heads.pictures.LEVELS


def _publish(picture: Path, name: str) -> None:
    """Copy ``picture`` to docs/``name`` when MULTIHEAD_WRITE_DOCS=1."""
    if WRITE_DOCS:
        DOCS.mkdir(exist_ok=True)
        shutil.copyfile(picture, DOCS / name)


def _minilm_capture():
    _, patched, batch, tok = minilm()
    with torch.no_grad(), mh.heads.capture(patched, what=("weights", "v")) as cap:
        patched(**batch)
    tokens = [tok.convert_ids_to_tokens(r) for r in batch["input_ids"].tolist()]
    rows = mh.heads.label(mh.heads.metrics(cap, tokens, batch["attention_mask"], special=tok.all_special_tokens))
    return cap, tokens, batch, rows


@pytest.fixture(scope="module")
def long_capture() -> tuple[mh.heads.Capture, list[list[str]], dict[str, torch.Tensor], int]:
    """MiniLM on a short text and one cut to 256 tokens: (capture, tokens, batch, uncut length)."""
    _, patched, _, tok = minilm()
    texts = [TEXTS[0], LONG]
    batch = {k: v for k, v in tok(texts, padding=True, truncation=True, max_length=256, return_tensors="pt").items()
             if k in ("input_ids", "attention_mask", "token_type_ids")}
    with torch.no_grad(), mh.heads.capture(patched, what=("weights",)) as cap:
        patched(**batch)
    tokens = [tok.convert_ids_to_tokens(r) for r in batch["input_ids"].tolist()]
    return cap, tokens, batch, len(tok(LONG, verbose=False)["input_ids"])


class Page(RecordedPage):
    """The heads page opened from file:// with every console error, request, dialog and page error kept."""

    def __init__(self, browser: Any, path: Path) -> None:
        super().__init__(browser, path, ready="window.__mhReady === true", width=1100, height=900)

    def lines(self) -> list[str]:
        return self.page.eval_on_selector_all(
            "#mh-lines line",
            "ls => ls.map(l => l.dataset.q + ':' + l.dataset.k + ':' + l.getAttribute('stroke-opacity'))")

    def hover_cell(self, i: int, j: int) -> str:
        """Hover matrix cell (query i, key j); the readout's text."""
        n = self.page.evaluate("window.__mhData.texts[+document.getElementById('mh-text').value].tokens.length")
        pad, cell = 90, max(2, min(18, 640 // n))  # the page's layout of the matrix
        at = lambda k: pad + k * cell + cell / 2  # noqa: E731  (relative to the padding box)
        self.page.locator("#mh-matrix").hover(position={"x": at(j), "y": at(i)})
        return self.page.inner_text("#mh-readout")


# ---- the PNG ------------------------------------------------------------------------------------

def _drawn(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The matplotlib figures plot() saves, kept for inspection."""
    import matplotlib.figure

    figures: list[Any] = []
    save = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda self, *a, **k: (figures.append(self), save(self, *a, **k))[1])
    return figures


def test_the_png_grid_names_the_sentence_labels_the_tokens_and_has_a_colour_bar(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cap, tokens, batch, rows = _minilm_capture()
    figures = _drawn(monkeypatch)
    out = mh.heads.plot(cap, tmp_path / "grid.png", sequence=0, key_mask=batch["attention_mask"], rows=rows,
                        tokens=tokens[0])
    import matplotlib.image

    img = matplotlib.image.imread(out)
    assert img.shape[0] > 500 and img.shape[1] > 1000 and float(img[..., :3].std()) > 0.05
    fig = figures[0]
    n = int(batch["attention_mask"][0].sum())
    real = [t for t, m in zip(tokens[0], batch["attention_mask"][0].tolist()) if m]
    title = fig._suptitle.get_text()
    assert " ".join(real) in title and f"{n} tokens" in title and "rows = queries, columns = keys" in title
    cells = [ax for ax in fig.axes if ax.images]
    assert len(cells) == 6 * 12 and len(fig.axes) == 6 * 12 + 1  # one more: the colour bar
    assert "attention weight" in fig.axes[-1].get_ylabel()
    assert [t.get_text() for t in cells[0].get_yticklabels()] == real  # queries of the first column
    assert [t.get_text() for t in cells[-1].get_xticklabels()] == real  # keys of the bottom row
    _publish(out, "heads_grid.png")


def test_the_png_of_a_long_sequence_is_cropped_and_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, long_capture) -> None:
    cap, tokens, batch, _ = long_capture
    figures = _drawn(monkeypatch)
    mh.heads.plot(cap, tmp_path / "long.png", sequence=1, key_mask=batch["attention_mask"], tokens=tokens[1])
    fig = figures[0]
    crop = mh.heads.pictures.DEFAULT_PNG_TOKENS
    assert f"cropped: the first {crop} of 256 tokens shown" in fig._suptitle.get_text()
    shown = fig.axes[0].images[0].get_array()
    expected = cap.weights[cap.layers[0]][1, 0, :crop, :crop]
    assert shown.shape == (crop, crop) and float(abs(torch.as_tensor(shown.data) - expected).max()) < 1e-6


def test_plot_reports_the_file_it_wrote_and_refuses_a_folder(tmp_path: Path) -> None:
    cap = hand_capture(torch.softmax(torch.randn(1, 2, 5, 5, dtype=torch.float64), -1))
    out = mh.heads.plot(cap, tmp_path / "grid")
    assert out == tmp_path / "grid.png" and out.is_file() and not (tmp_path / "grid").exists()
    with pytest.raises(ValueError, match="must name a file, got the folder"):
        mh.heads.plot(cap, tmp_path)
    with pytest.raises(ValueError, match=r"must end in \.png"):
        mh.heads.plot(cap, tmp_path / "grid.jpg")
    with pytest.raises(ValueError, match="must name a file, got the folder"):
        mh.heads.to_html(cap, ["a"] * 5, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["grid.png"]


# ---- the page -----------------------------------------------------------------------------------

def test_the_page_refuses_a_token_list_of_the_wrong_length_and_long_inputs(tmp_path: Path) -> None:
    cap, tokens, batch, _ = _minilm_capture()
    n = int(batch["attention_mask"][2].sum())
    with pytest.raises(ValueError, match=f"real tokens .*got {n - 1}"):
        mh.heads.to_html(cap, tokens[2][:n - 1], tmp_path / "x.html", sequence=2, key_mask=batch["attention_mask"])
    with pytest.raises(ValueError, match="over max_tokens=4"):
        mh.heads.to_html(cap, tokens[0], tmp_path / "x.html", max_tokens=4)
    with pytest.raises(ValueError, match=r"sequence must be an index in \[0, 2\], got 3"):
        mh.heads.to_html(cap, tokens, tmp_path / "x.html", sequence=3, key_mask=batch["attention_mask"])
    with pytest.raises(ValueError, match=r"cut must hold one entry per shown sequence \(3\)"):
        mh.heads.to_html(cap, tokens, tmp_path / "x.html", key_mask=batch["attention_mask"], cut=[None])
    assert not (tmp_path / "x.html").exists()


@needs_chromium
def test_the_page_works_offline_in_a_real_browser(tmp_path: Path, browser: Any) -> None:
    cap, tokens, batch, rows = _minilm_capture()
    seq = 1
    path = mh.heads.to_html(cap, tokens[seq], tmp_path / "heads.html", sequence=seq,
                            key_mask=batch["attention_mask"], rows=rows, title="multihead heads: all-MiniLM-L6-v2")
    html = path.read_text(encoding="utf-8")
    assert not re.search(r"""(src|href)\s*=\s*["']?https?:|import\s*\(|@import""", html)
    n = int(batch["attention_mask"][seq].sum())
    real = batch["attention_mask"][seq].bool()
    view = Page(browser, path)
    page = view.page
    # the embedded data is the captured weights, to the nearest 1/255
    attn = torch.tensor(page.evaluate("window.__mhWeights(0, 3, 5)"), dtype=torch.float64)
    expected = cap.weights[cap.layers[3]][seq, 5][real][:, real].double()
    assert attn.shape == (n, n) and float((attn - expected).abs().max()) <= STEP / 2 + 1e-9
    assert page.locator("canvas.mh-thumb").count() == 6 * 12
    assert page.locator("#mh-layer option").count() == 6 and page.locator("#mh-head option").count() == 12
    first = view.lines()
    page.select_option("#mh-layer", "2")
    after_layer = view.lines()
    page.select_option("#mh-head", "7")
    after_head = view.lines()
    assert first != after_layer != after_head and len(after_head) > 0
    assert "layer 2" in page.inner_text("#mh-title") and "head 7" in page.inner_text("#mh-title")
    page.locator("canvas.mh-thumb").nth(0).click()  # the model view opens layer 0, head 0
    assert page.eval_on_selector("#mh-layer", "s => s.value") == "0" and view.lines() == first
    # hovering query token i: its row is highlighted; only its lines remain; keys shaded and labelled by A[i]
    i = 3
    page.hover(f"#mh-left .mh-tok >> nth={i}")
    assert "mh-active" in page.get_attribute(f"#mh-left .mh-tok >> nth={i}", "class")
    shown = view.lines()
    assert shown and all(s.split(":")[0] == str(i) for s in shown)
    row = torch.tensor(page.evaluate("window.__mhWeights(0, 0, 0)[3]"))
    shades = page.eval_on_selector_all("#mh-right .mh-tok", "ts => ts.map(t => t.style.background)")
    values = torch.tensor([float(v) for v in page.eval_on_selector_all(
        "#mh-right .mh-v", "vs => vs.map(v => v.textContent)")], dtype=torch.float64)
    assert shades[int(row.argmax())] != "" and len(shades) == n
    want_row = cap.weights[cap.layers[0]][seq, 0][real][:, real][i].double()
    assert values.shape == (n,) and float((values - want_row).abs().max()) <= STEP / 2 + 5e-4  # shown to 3 places
    # hovering a matrix cell shows its query, key and value
    page.mouse.move(1, 1)
    page.select_option("#mh-layer", "1")
    page.select_option("#mh-head", "8")
    q, k = 4, 5
    text = view.hover_cell(q, k)
    want = float(cap.weights[cap.layers[1]][seq, 8][real][:, real][q, k])
    toks = [t for t, m in zip(tokens[seq], real.tolist()) if m]
    assert text.startswith(f"query {q} “{toks[q]}” → key {k} “{toks[k]}”: ")
    assert abs(float(text.rsplit(": ", 1)[1]) - want) <= STEP / 2 + 5e-4
    # the metrics table sorts; the legend explains every label and metric
    page.click("#mh-metrics th[data-col=entropy]")
    ent = [float(t) for t in page.eval_on_selector_all(
        "#mh-metrics tbody tr td:nth-child(4)", "ts => ts.map(t => t.textContent)")]
    assert ent == sorted(ent) and len(ent) == 72
    legend = page.inner_text("#mh-legend")
    assert all(f"label “{name}”" in legend for name in mh.heads.LABELS)
    assert all(field in legend for field in mh.heads.METRIC_FIELDS)
    page.mouse.move(1, 1)
    page.select_option("#mh-layer", "0")
    page.select_option("#mh-head", "2")  # layer 0, head 2: the previous-token head
    view.hover_cell(5, 4)
    page.screenshot(path=str(tmp_path / "shot.png"))
    page.close()
    assert view.errors == [] and view.foreign() == []
    assert (tmp_path / "shot.png").stat().st_size > 20000
    _publish(tmp_path / "shot.png", "heads_page.png")


def test_the_metric_help_covers_every_metric() -> None:
    assert tuple(mh.heads.METRIC_HELP) == mh.heads.METRIC_FIELDS


@needs_chromium
def test_every_text_is_on_the_page_with_a_notice_for_the_cut_one(tmp_path: Path, browser: Any,
                                                                   long_capture) -> None:
    cap, tokens, batch, whole = long_capture
    assert whole > 256  # the tokenizer did cut it
    path = mh.heads.to_html(cap, tokens, tmp_path / "texts.html", key_mask=batch["attention_mask"],
                            texts=[TEXTS[0], LONG], cut=[None, whole], title="multihead heads: all-MiniLM-L6-v2")
    size = path.stat().st_size
    assert size <= 5_000_000  # 256 tokens: 6 · 12 · 256² weights, a byte each before deflate
    view = Page(browser, path)
    page = view.page
    assert page.title() == "multihead heads: all-MiniLM-L6-v2" == page.inner_text("#mh-h1")
    assert page.locator("#mh-text option").count() == 2
    notice = page.locator("#mh-cut")
    assert notice.is_visible() and f"Text 2 was cut to its first 256 tokens (it has {whole})" in notice.inner_text()
    real0 = batch["attention_mask"][0].bool()
    before = (view.lines(), page.evaluate("document.getElementById('mh-matrix').toDataURL()"),
              page.locator("#mh-left .mh-tok").count())
    assert before[2] == int(real0.sum())
    page.select_option("#mh-text", "1")
    after = (view.lines(), page.evaluate("document.getElementById('mh-matrix').toDataURL()"),
             page.locator("#mh-left .mh-tok").count())
    assert after[0] != before[0] and after[1] != before[1] and after[2] == 256
    got = torch.tensor(page.evaluate("window.__mhWeights(1, 5, 11)"), dtype=torch.float64)
    assert float((got - cap.weights[cap.layers[5]][1, 11].double()).abs().max()) <= STEP / 2 + 1e-9
    text = view.hover_cell(200, 3)
    assert text.startswith(f"query 200 “{tokens[1][200]}” → key 3 “{tokens[1][3]}”: ")
    page.close()
    assert view.errors == [] and view.foreign() == []


# ---- the page's safety --------------------------------------------------------------------------

HOSTILE = ["</script>", "<!--<script>", "<!--", "<script>", "<img src=x onerror=\"window.__pwned=1;alert(1)\">",
           "\"'`", "\u202eevil\u200f", "x" * 10_000, "__MH_DATA__", "__MH_TITLE__", "/*__MH_DATA__*/null",
           "a\u2028b\u2029c", "<script>window.__pwned=2</script>", "&amp;&lt;", "${1}\\u003c"]
HOSTILE_TITLE = ("__MH_DATA__ </title><script>window.__pwned=3</script>"
                 "<img src=x onerror=\"window.__pwned=4;alert(4)\"> __MH_TITLE__ \u202e")


@needs_chromium
def test_hostile_tokens_and_titles_are_shown_as_text_and_never_run(tmp_path: Path, browser: Any) -> None:
    n = len(HOSTILE)
    cap = hand_capture(torch.softmax(torch.randn(1, 2, n, n, dtype=torch.float64), -1))
    path = mh.heads.to_html(cap, HOSTILE, tmp_path / "hostile.html", title=HOSTILE_TITLE)
    view = Page(browser, path)
    page = view.page
    assert page.evaluate("window.__pwned === undefined") and view.dialogs == []
    assert page.title() == HOSTILE_TITLE
    assert page.eval_on_selector("#mh-h1", "h => h.textContent") == HOSTILE_TITLE
    for side in ("left", "right"):
        shown = page.eval_on_selector_all(f"#mh-{side} .mh-t", "ts => ts.map(t => t.textContent)")
        assert shown == HOSTILE
    assert page.evaluate("document.querySelectorAll('img').length") == 0
    assert page.evaluate("document.querySelectorAll('script').length") == 2  # the data and the page's own
    page.hover("#mh-left .mh-tok >> nth=2")
    view.hover_cell(1, 2)
    assert page.evaluate("window.__pwned === undefined") and view.dialogs == []
    page.close()
    assert view.errors == [] and view.foreign() == []


def test_a_title_that_is_not_text_leaves_the_existing_page_whole(tmp_path: Path) -> None:
    cap = hand_capture(torch.softmax(torch.randn(1, 2, 3, 3, dtype=torch.float64), -1))
    path = mh.heads.to_html(cap, ["a", "b", "c"], tmp_path / "page.html")
    before = path.read_bytes()
    with pytest.raises(ValueError, match="title must be encodable as UTF-8"):
        mh.heads.to_html(cap, ["a", "b", "c"], path, title="broken \ud800 title")
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["page.html"]
    mode = path.stat().st_mode & 0o777
    mh.heads.to_html(cap, ["x", "y", "z"], path)  # replaced whole, same mode
    assert path.read_bytes() != before and path.stat().st_mode & 0o777 == mode


# ---- the command --------------------------------------------------------------------------------

def test_the_command_prints_every_metric_as_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from multihead.tools.cli import main

    assert main(["heads", "A short sentence.", LONG, "--json",
                 "--html", str(tmp_path / "h.html"), "--png", str(tmp_path / "h")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["texts"] == ["A short sentence.", LONG] and out["name"] == "all-MiniLM-L6-v2"
    assert len(out["heads"]) == 72 and out["heads"][0]["layer"] == 0 and out["heads"][0]["head"] == 0
    assert set(out["heads"][0]) == {"layer", "head", "label", *mh.heads.METRIC_FIELDS}
    assert all(h["induction"] is not None and h["label"] in mh.heads.LABELS for h in out["heads"])
    assert [c["text"] for c in out["cut"]] == [1] and out["cut"][0]["kept"] == 256 < out["cut"][0]["tokens"]
    assert out["wrote"] == [str(tmp_path / "h.html"), str(tmp_path / "h.png")]  # what was written
    assert (tmp_path / "h.png").stat().st_size > 0 and not (tmp_path / "h").exists()
    html = (tmp_path / "h.html").read_text(encoding="utf-8")
    assert "<title>multihead heads: all-MiniLM-L6-v2</title>" in html
    data = json.loads(re.search(r'id="mh-data">(.*?)</script>', html, re.S).group(1))
    assert [t["cut"] for t in data["texts"]] == [None, out["cut"][0]["tokens"]]


def test_the_command_refuses_a_folder_as_its_output(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from multihead.tools.cli import main

    for flag in ("--png", "--html"):
        with pytest.raises(SystemExit) as exit_:
            main(["heads", "A sentence.", flag, str(tmp_path)])
        assert exit_.value.code == 2 and "must name a file, got the folder" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [] and not Path(str(tmp_path) + ".png").exists()
