"""The peers of ``multihead bench --embed``: sentence-transformers' ONNX Runtime and OpenVINO backends,
each run by :mod:`multihead.tools.embed_peer` in a Python of their own.

Notation: N texts, E embed_dim.

Their ``optimum`` packages pin older transformers than multihead's, so they are installed in a
separate environment (``docs/performance.md``, "The peers' environment") and driven from here: one
persistent worker process per peer of :data:`PEERS`, started by that environment's Python on the
worker file, loaded once, then asked to encode the whole corpus for each timed call. A peer's way
in :func:`multihead.tools.bench.time_interleaved` is :meth:`Peer.time`, so its times are this
process's wall clock around the request: the worker's encode plus one JSON line each way (well
under a millisecond against calls of seconds); the worker's own clock around ``encode`` is kept
beside them (``peer_median_s``).

A peer that cannot start (no such Python, a package missing there, an export that fails) is
returned as skipped with its reason, never dropped.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import numpy as np

__all__ = ["PEERS", "WORKER", "Peer", "PeerError", "start_peers", "default_cache_dir"]

#: name -> (sentence-transformers backend, precision): OpenVINO as it runs by default (bf16 on a
#: CPU with AMX) and held to float32; ONNX Runtime runs float32 by default, so once.
PEERS: dict[str, tuple[str, str]] = {
    "ST backend=onnx": ("onnx", "default"),
    "ST backend=openvino": ("openvino", "default"),
    "ST backend=openvino, f32": ("openvino", "f32"),
}
#: The worker script, run as a file by the peers' Python.
WORKER = Path(__file__).with_name("embed_peer.py")
#: The reason given for every peer when no peers' Python is named.
NO_PYTHON = "not run: no --peers-python (docs/performance.md, the peers' environment)"


class PeerError(RuntimeError):
    """A peer worker failed: it exited, answered an error, or broke the protocol."""


def default_cache_dir() -> Path:
    """Where the peers keep the model exported to ONNX and OpenVINO: ``embed-peers`` in multihead's
    cache folder (``$MULTIHEAD_CACHE_DIR``, else ``$XDG_CACHE_HOME`` or ``~/.cache``, ``/multihead``),
    the folder the kernels' builds use first."""
    from ..backends.native.files import cache_dirs

    return cache_dirs()[0] / "embed-peers"


class Peer:
    """One worker process (:mod:`multihead.tools.embed_peer`) and its requests.

    Args:
        python: the interpreter that runs the worker (the peers' environment's).
    """

    def __init__(self, python: str | os.PathLike[str]) -> None:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        self._stderr: IO[bytes] = tempfile.TemporaryFile()
        self._proc = subprocess.Popen([os.fspath(python), str(WORKER)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._stderr, text=True, encoding="utf-8",
                                      env=env)
        self.seconds: list[float] = []

    @property
    def pid(self) -> int:
        """The worker's process id."""
        return self._proc.pid

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send one request, return its answer (:meth:`send` then :meth:`receive`).

        Raises:
            PeerError: the worker exited, answered something other than a JSON object, or
                answered ``ok: false`` (its error is the message).
        """
        self.send(op, **fields)
        return self.receive(op)

    def send(self, op: str, **fields: Any) -> None:
        """Send one request without waiting for its answer (:meth:`receive` takes it).

        Raises:
            PeerError: the worker has exited.
        """
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
            self._proc.stdin.flush()
        except OSError:
            raise PeerError(f"the worker exited before {op!r}{self._stderr_tail()}") from None

    def receive(self, op: str) -> dict[str, Any]:
        """The answer to the request ``op`` sent last (see :meth:`request`)."""
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            raise PeerError(f"the worker exited during {op!r}{self._stderr_tail()}")
        try:
            reply = json.loads(line)
        except ValueError:
            reply = None
        if not isinstance(reply, dict) or not isinstance(reply.get("ok"), bool):
            raise PeerError(f"{op!r}: the worker answered {line.strip()[:200]!r}, not a JSON answer")
        if not reply["ok"]:
            raise PeerError(str(reply.get("error", "failed, no error given")))
        return reply

    def load(self, *, model: str, backend: str, precision: str, threads: int, corpus: str,
             cache_dir: str | None) -> dict[str, Any]:
        """Load the model and corpus (the worker's ``load``); returns the worker's ``info``."""
        return dict(self.request("load", model=model, backend=backend, precision=precision, threads=threads,
                                 corpus=corpus, cache_dir=cache_dir)["info"])

    def time(self, batch_size: int) -> None:
        """Encode the corpus once (the worker's ``time``), its own seconds kept in :attr:`seconds`."""
        self.seconds.append(float(self.request("time", batch_size=batch_size)["seconds"]))

    def embeddings(self, batch_size: int) -> np.ndarray:
        """The corpus's (N, E) embeddings from the worker (through a temporary ``.npy`` file)."""
        with tempfile.TemporaryDirectory(prefix="embed-peer-") as tmp:
            path = os.path.join(tmp, "vectors.npy")
            self.request("embeddings", batch_size=batch_size, path=path)
            return np.load(path)

    def close(self) -> None:
        """Ask the worker to quit and wait for it (killed if it does not within 10 s)."""
        try:
            if self._proc.poll() is None:
                self.request("quit")
        except PeerError:
            pass
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        for pipe in (self._proc.stdin, self._proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):  # a worker that died leaves unsent bytes
                    pipe.close()
        self._stderr.close()

    def _stderr_tail(self, lines: int = 3) -> str:
        """``": "`` and the last lines the worker wrote to stderr, or ``""``."""
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self._stderr.seek(0)
        tail = [x for x in self._stderr.read().decode("utf-8", "replace").splitlines() if x.strip()][-lines:]
        return (": " + " | ".join(x.strip() for x in tail)) if tail else ""


def start_peers(python: str | os.PathLike[str] | None, *, model: str, corpus: str, threads: int,
                cache_dir: str | os.PathLike[str] | None = None, peers: dict[str, tuple[str, str]] | None = None,
                progress: Callable[[str], None] | None = None,
                ) -> tuple[dict[str, Peer], dict[str, dict[str, Any]], dict[str, str]]:
    """Start and load one worker per peer.

    Args:
        python: the peers' environment's interpreter; None: every peer skipped (:data:`NO_PYTHON`).
        model: the model folder; corpus: a JSON file with the list of texts.
        threads: the threads each peer computes with (the same as the ways it is timed against).
        cache_dir: where exported models are kept (None: :func:`default_cache_dir`).
        peers: name -> (backend, precision); default :data:`PEERS`.

    Returns:
        (name -> loaded :class:`Peer`, name -> the worker's load ``info``, name -> why it was skipped).
        The caller closes the peers (:meth:`Peer.close`).
    """
    peers = PEERS if peers is None else peers
    if python is None:
        return {}, {}, {name: NO_PYTHON for name in peers}
    if not os.access(python, os.X_OK):
        return {}, {}, {name: f"no Python at {os.fspath(python)}" for name in peers}
    cache = os.fspath(cache_dir if cache_dir is not None else default_cache_dir())
    started: dict[str, Peer] = {}
    infos: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    for name, (backend, precision) in peers.items():
        if progress:
            progress(f"starting the peer {name} (an export the first time: a minute)")
        peer = Peer(python)
        try:
            infos[name] = peer.load(model=model, backend=backend, precision=precision, threads=threads,
                                    corpus=corpus, cache_dir=cache)
        except PeerError as e:
            peer.close()
            skipped[name] = str(e)[:300]
            continue
        started[name] = peer
    return started, infos, skipped
