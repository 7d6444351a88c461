"""The peers of ``multihead bench --embed``: the worker (:mod:`multihead.tools.embed_peer`) and its
client (:mod:`multihead.tools.bench_embed_peers`).

The worker runs here in this environment's own Python with sentence-transformers' default backend
(``torch``), so no ONNX Runtime or OpenVINO is needed: one worker is loaded for the module on 16
texts. Peers that cannot start, and bad protocol input, are checked without loading a model.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import time
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from multihead.tools import bench_embed, bench_embed_peers, embed_peer, machine, models
from multihead.tools.bench_embed_peers import Peer, PeerError, start_peers
from multihead.tools.cli import main

TEXTS = bench_embed.corpus(16, seed=3)
DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("peer") / "corpus.json"
    path.write_text(json.dumps(TEXTS), encoding="utf-8")
    return str(path)


class LoadingPeer:
    """A worker in this Python, sentence-transformers' backend torch, told to load :data:`TEXTS` at once:
    it loads while the tests that need no model run; :meth:`loaded` waits for it."""

    def __init__(self, corpus_file: str) -> None:
        self.peer = Peer(sys.executable)
        self.peer.send("load", model=str(models.bundled_model_dir()), backend="torch", precision="default",
                       threads=1, corpus=corpus_file, cache_dir=None)
        self._info: dict | None = None

    def loaded(self) -> tuple[Peer, dict]:
        """The peer once loaded, and its load ``info``."""
        if self._info is None:
            self._info = self.peer.receive("load")["info"]
        return self.peer, self._info


@pytest.fixture(scope="module", autouse=True)
def loading_peer(corpus_file: str) -> Iterator[LoadingPeer]:
    """The module's :class:`LoadingPeer`, started before its first test."""
    loading = LoadingPeer(corpus_file)
    yield loading
    loading.peer.close()


def _script(tmp_path: Path, body: str) -> str:
    """An executable shell script standing in for a Python."""
    path = tmp_path / "python"
    path.write_text("#!/bin/sh\n" + body + "\n", encoding="utf-8")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_a_peer_that_cannot_start_is_a_skipped_row_with_its_reason(tmp_path: Path, corpus_file: str) -> None:
    no_packages = _script(tmp_path, f'exec "{sys.executable}" -I -S "$@"')  # no site-packages: no torch
    kwargs = {"model": str(models.bundled_model_dir()), "corpus": corpus_file, "threads": 1}
    peers, infos, skipped = start_peers(no_packages, peers={"bare": ("torch", "default")}, **kwargs)
    assert not peers and not infos and "No module named" in skipped["bare"]
    peers, _, skipped = start_peers(sys.executable, peers={"bad": ("tensorflow", "default")}, **kwargs)
    assert not peers and "backend 'tensorflow' is not one of torch, onnx, openvino" in skipped["bad"]
    _, _, skipped = start_peers(None, **kwargs)
    assert skipped == {name: bench_embed_peers.NO_PYTHON for name in bench_embed_peers.PEERS}
    _, _, skipped = start_peers(str(tmp_path / "nothing"), **kwargs)
    assert set(skipped) == set(bench_embed_peers.PEERS) and all("no Python at" in r for r in skipped.values())


@pytest.mark.parametrize(("line", "error"), [
    ("not json", "not a JSON line"),
    ('["load"]', "unknown op ['load']"),
    ('{"op": "fly"}', "unknown op 'fly': expected one of load, time, embeddings, quit"),
    ('{"op": "time", "batch_size": 8}', "'time' before 'load'"),
    ('{"op": "load", "backend": "torch"}', "'load' needs 'model'"),
    ('{"op": "load", "model": "m", "backend": "torch", "threads": "2", "corpus": "c"}', "'threads' has the wrong type"),
    ('{"op": "load", "model": "m", "backend": "torch", "precision": "f8", "threads": 2, "corpus": "c"}',
     "precision 'f8' is not one of default, f32"),
])
def test_bad_requests_are_answered_with_a_clear_error(line: str, error: str) -> None:
    reply = embed_peer.answer(embed_peer.Worker(), line)
    assert reply["ok"] is False and error in reply["error"]


def test_the_worker_serves_errors_and_goes_on_until_quit() -> None:
    lines = "\n".join(["garbage", '{"op": "quit"}', '{"op": "never answered"}']) + "\n"
    done = subprocess.run([sys.executable, str(bench_embed_peers.WORKER)], input=lines, capture_output=True,
                          text=True, timeout=60, check=True)
    replies = [json.loads(x) for x in done.stdout.splitlines()]
    assert [r["ok"] for r in replies] == [False, True]


def test_a_worker_that_breaks_the_protocol_is_a_clear_error(tmp_path: Path) -> None:
    peer = Peer(_script(tmp_path, 'read line; echo "Loading weights 100%"; read line'))
    with pytest.raises(PeerError, match="'time': the worker answered 'Loading weights 100%', not a JSON answer"):
        peer.time(8)
    peer.close()
    peer = Peer(_script(tmp_path, 'echo "it broke" >&2; exit 3'))
    with pytest.raises(PeerError, match="the worker exited (before|during) 'time': it broke"):
        peer.time(8)
    peer.close()


def test_others_load_counts_helpers_as_its_own() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert machine._helpers_cpu_seconds([gone.pid]) == 0.0
    mine = machine._helpers_cpu_seconds([os.getpid()])
    assert abs(mine - time.process_time()) < 0.5


def test_an_earlier_single_batch_result_still_formats() -> None:
    """A result file of the earlier format (one batch size, no peers) still formats."""
    result = json.loads((DOCS.parent / "tests/data/results/embed-single-batch.json").read_text(encoding="utf-8"))
    assert "runs" not in result
    text = bench_embed.format_embed(result)
    assert "batches of 32:" in text and "multihead embed, bfloat16" in text


def test_the_worker_loads_times_and_embeds_as_sentence_transformers(loading_peer: LoadingPeer) -> None:
    from sentence_transformers import SentenceTransformer

    want = SentenceTransformer(str(models.bundled_model_dir()), device="cpu").encode(TEXTS, batch_size=8)
    peer, info = loading_peer.loaded()  # the reference was computed while the worker loaded
    assert (info["backend"], info["precision"], info["threads"], info["texts"]) == ("torch", "float32", 1, 16)
    assert "sentence-transformers" in info["versions"] and info["load_s"] > 0
    peer.time(8)
    assert len(peer.seconds) == 1 and peer.seconds[0] > 0
    vectors = peer.embeddings(8)
    assert vectors.shape == (16, 384) and vectors.dtype == np.float32
    cosines = (vectors * want).sum(1) / (np.linalg.norm(vectors, axis=1) * np.linalg.norm(want, axis=1))
    assert cosines.min() > 1 - 1e-6


def test_a_peer_is_one_more_way_in_the_round_robin(loading_peer: LoadingPeer) -> None:
    """Rows for our ways, the loaded peer (its own clock kept too) and a skipped peer with its reason;
    timed beside a competing process, which the table names."""
    peer, _ = loading_peer.loaded()
    vectors = peer.embeddings(8)
    ours = {bench_embed.WAYS[0]: lambda batch: vectors}  # the base way: this peer's own vectors
    run = bench_embed._run_batch(ours, {"torch peer": peer}, {"ST backend=onnx": "no onnx here"}, 8, 2, True,
                                 lambda line: None)
    rows = run["ways"]
    assert run["batch_size"] == 8 and list(rows) == [bench_embed.WAYS[0], "torch peer", "ST backend=onnx"]
    assert rows["torch peer"]["least_cosine"] > 1 - 1e-6 and rows["torch peer"]["median_s"] > 0
    assert rows["torch peer"]["peer_median_s"] <= rows["torch peer"]["median_s"]
    assert rows["ST backend=onnx"] == {"skipped": "no onnx here"}
    result = {"corpus": {"texts": 16, "tokens": 1, "median_tokens": 1, "longest": 1}, "threads": 1, "competing": True,
              "machine": {}, "runs": [run], "peers": {"python": sys.executable, "info": {"torch peer": _info()}}}
    text = bench_embed.format_embed(result)
    assert "ST backend=onnx                        skipped: no onnx here" in text
    assert "torch peer: float32, 1 threads" in text
    assert "beside one competing CPU-bound process:" in text and "(the competing process included)" in text


def _info() -> dict:
    return {"precision": "float32", "threads": 1, "python": "3.11", "versions": {"sentence-transformers": "x"}}


def test_the_cli_passes_the_embed_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    seen: dict = {}

    def fake_run(**kwargs: object) -> dict:
        seen.update(kwargs)
        return json.loads((DOCS / "results/embed/intel-xeon-amx.json").read_text(encoding="utf-8"))

    monkeypatch.setattr(bench_embed, "run_embed", fake_run)
    argv = ["bench", "--embed", "--texts", "2000", "--batch-size", "32", "128", "--reps", "3", "--peers-python",
            "/p/bin/python", "--peers-cache", str(tmp_path / "cache"), "--competing", "--out", str(tmp_path)]
    assert main(argv) == 0
    assert (seen["texts"], seen["batch_sizes"], seen["reps"], seen["competing"]) == (2000, [32, 128], 3, True)
    assert (seen["peers_python"], seen["peers_cache"]) == ("/p/bin/python", str(tmp_path / "cache"))
    assert "batches of 32:" in capsys.readouterr().out and (tmp_path / "embed.json").is_file()


@pytest.mark.parametrize("flag", [["--texts", "9"], ["--batch-size", "8"], ["--peers-python", "p"],
                                  ["--peers-cache", "d"]])
def test_the_cli_refuses_embed_options_without_embed(flag: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--quick", *flag])
    assert exit_.value.code == 2 and f"{flag[0]} applies to --embed only" in capsys.readouterr().err
