"""The picture, the page (in a real headless Chromium) and the ``multihead heads`` command."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

import multihead as mh
from heads_helpers import minilm

DOCS = Path(__file__).resolve().parents[2] / "docs"
#: The README's pictures are these tests' own output: with MULTIHEAD_WRITE_DOCS=1 the tests
#: copy them into docs/; otherwise they stay in pytest's temporary folder (no test run
#: changes the working tree).
WRITE_DOCS = os.environ.get("MULTIHEAD_WRITE_DOCS") == "1"


def _publish(picture: Path, name: str) -> None:
    """Copy ``picture`` to docs/``name`` when MULTIHEAD_WRITE_DOCS=1."""
    if WRITE_DOCS:
        DOCS.mkdir(exist_ok=True)
        shutil.copyfile(picture, DOCS / name)
CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _minilm_capture():
    _, patched, batch, tok = minilm()
    with torch.no_grad(), mh.heads.capture(patched, what=("weights", "v")) as cap:
        patched(**batch)
    tokens = [tok.convert_ids_to_tokens(r) for r in batch["input_ids"].tolist()]
    rows = mh.heads.label(mh.heads.metrics(cap, tokens, batch["attention_mask"], special=tok.all_special_tokens))
    return cap, tokens, batch, rows


def test_the_png_grid_has_a_cell_per_head(tmp_path: Path) -> None:
    cap, _, batch, rows = _minilm_capture()
    out = mh.heads.plot(cap, tmp_path / "grid.png", sequence=1, key_mask=batch["attention_mask"], rows=rows)
    import matplotlib.image

    img = matplotlib.image.imread(out)
    assert img.shape[0] > 500 and img.shape[1] > 1000 and float(img[..., :3].std()) > 0.05
    _publish(out, "heads_grid.png")


def test_the_page_refuses_a_token_list_of_the_wrong_length_and_long_inputs(tmp_path: Path) -> None:
    cap, tokens, batch, _ = _minilm_capture()
    n = int(batch["attention_mask"][2].sum())
    with pytest.raises(ValueError, match=f"real tokens .*got {n - 1}"):
        mh.heads.to_html(cap, tokens[2][:n - 1], tmp_path / "x.html", sequence=2, key_mask=batch["attention_mask"])
    with pytest.raises(ValueError, match="over max_tokens=4"):
        mh.heads.to_html(cap, tokens[0], tmp_path / "x.html", max_tokens=4)
    assert not (tmp_path / "x.html").exists()


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (apt-get install chromium); .ci/run installs it")
def test_the_page_works_offline_in_a_real_browser(tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    cap, tokens, batch, rows = _minilm_capture()
    seq = 1
    path = mh.heads.to_html(cap, tokens[seq], tmp_path / "heads.html", sequence=seq,
                            key_mask=batch["attention_mask"], rows=rows)
    html = path.read_text(encoding="utf-8")
    assert not re.search(r"""(src|href)\s*=\s*["']?https?:|import\s*\(|@import""", html)
    n = int(batch["attention_mask"][seq].sum())
    real = batch["attention_mask"][seq].bool()
    requests, errors = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page(viewport={"width": 1100, "height": 900}, device_scale_factor=1)
        page.on("request", lambda r: requests.append(r.url))
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.route("**/*", lambda r: r.continue_() if r.request.url.startswith(("file:", "data:", "about:"))
                   else r.abort())
        page.goto(path.as_uri())
        page.wait_for_function("window.__mhReady === true", timeout=10000)
        # the embedded data is the captured weights (rounded to 3 places)
        attn = torch.tensor(page.evaluate("window.__mhData.attn[3][5]"), dtype=torch.float64)
        expected = cap.weights[cap.layers[3]][seq, 5][real][:, real].double()
        assert attn.shape == (n, n) and float((attn - expected).abs().max()) <= 5e-4 + 1e-9
        assert page.locator("canvas.mh-thumb").count() == 6 * 12
        assert page.locator("#mh-layer option").count() == 6 and page.locator("#mh-head option").count() == 12
        lines = lambda: page.eval_on_selector_all(  # noqa: E731
            "#mh-lines line",
            "ls => ls.map(l => l.dataset.q + ':' + l.dataset.k + ':' + l.getAttribute('stroke-opacity'))")
        first = lines()
        page.select_option("#mh-layer", "2")
        after_layer = lines()
        page.select_option("#mh-head", "7")
        after_head = lines()
        assert first != after_layer != after_head and len(after_head) > 0
        assert "layer 2" in page.inner_text("#mh-title") and "head 7" in page.inner_text("#mh-title")
        page.locator("canvas.mh-thumb").nth(0).click()  # the model view opens layer 0, head 0
        assert page.eval_on_selector("#mh-layer", "s => s.value") == "0" and lines() == first
        # hovering query token i: its row is highlighted; only its lines remain; keys shaded by A[i]
        i = 3
        page.hover(f"#mh-left .mh-tok >> nth={i}")
        assert "mh-active" in page.get_attribute(f"#mh-left .mh-tok >> nth={i}", "class")
        shown = lines()
        assert shown and all(s.split(":")[0] == str(i) for s in shown)
        row = torch.tensor(page.evaluate("window.__mhData.attn[0][0][3]"))
        shades = page.eval_on_selector_all("#mh-right .mh-tok", "ts => ts.map(t => t.style.background)")
        strongest = int(row.argmax())
        assert shades[strongest] != "" and len(shades) == n
        # the metrics table sorts
        page.click("#mh-metrics th[data-col=entropy]")
        ent = [float(t) for t in page.eval_on_selector_all(
            "#mh-metrics tbody tr td:nth-child(4)", "ts => ts.map(t => t.textContent)")]
        assert ent == sorted(ent) and len(ent) == 72
        page.mouse.move(1, 1)
        page.select_option("#mh-head", "2")  # layer 0, head 2: the previous-token head
        page.hover("#mh-right .mh-tok >> nth=5")  # what attends to key 5
        page.screenshot(path=str(tmp_path / "shot.png"))
        browser.close()
    assert errors == []
    assert [u for u in requests if not u.startswith(("file:", "data:", "about:"))] == []
    assert (tmp_path / "shot.png").stat().st_size > 20000
    _publish(tmp_path / "shot.png", "heads.png")


def test_the_command_prints_every_metric_as_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from multihead.tools.cli import main

    assert main(["heads", "A short sentence.", "Another, longer sentence for padding.", "--json",
                 "--html", str(tmp_path / "h.html"), "--png", str(tmp_path / "h.png")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["texts"] == ["A short sentence.", "Another, longer sentence for padding."]
    assert len(out["heads"]) == 72 and out["heads"][0]["layer"] == 0 and out["heads"][0]["head"] == 0
    assert set(out["heads"][0]) == {"layer", "head", "label", *mh.heads.METRIC_FIELDS}
    assert all(h["induction"] is not None and h["label"] in mh.heads.LABELS for h in out["heads"])
    assert (tmp_path / "h.html").stat().st_size > 0 and (tmp_path / "h.png").stat().st_size > 0
