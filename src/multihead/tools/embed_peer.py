"""A peer of ``multihead bench --embed``: sentence-transformers with one backend, in its own Python.

Notation: N texts, E embed_dim.

sentence-transformers' ONNX Runtime and OpenVINO backends need ``optimum`` packages that pin older
transformers than multihead's, so they live in a separate environment. This file is run there as a
script (``PYTHON embed_peer.py``) by :mod:`multihead.tools.bench_embed_peers`; it imports only the
standard library until told to load, then sentence-transformers and the backend: never multihead,
which need not be installed there.

Protocol: one JSON object a line on stdin, one answer a line on stdout, ``{"ok": true, ...}`` or
``{"ok": false, "error": "..."}`` (the worker goes on after an error; anything the libraries print
goes to stderr, so stdout carries only answers):

* ``{"op": "load", "model": DIR, "backend": "torch"|"onnx"|"openvino", "precision": "default"|"f32",
  "threads": T, "corpus": PATH, "cache_dir": DIR|null}``: load ``SentenceTransformer(DIR,
  backend=...)`` on the CPU with T threads (torch: ``torch.set_num_threads``; ONNX Runtime:
  ``SessionOptions.intra_op_num_threads``; OpenVINO: ``ov_config["INFERENCE_NUM_THREADS"]``) and
  read the corpus (a JSON list of N strings). ``precision`` "f32" asks OpenVINO for
  ``INFERENCE_PRECISION_HINT="f32"``; "default" leaves each backend's own choice (OpenVINO: bf16 on
  a CPU with AMX; ONNX Runtime and torch run float32 either way). The ONNX / OpenVINO model is
  exported from DIR once and kept under ``cache_dir`` (keyed by the model file and the backend's
  package versions; no ``cache_dir``: a temporary folder for this process). Answers ``info``:
  the precision that runs, the package versions, the load time.
* ``{"op": "time", "batch_size": B}``: encode the whole corpus once, batches of B; answers
  ``seconds`` (this worker's own clock around ``encode``) and ``cpu_s`` (the process's CPU time).
* ``{"op": "embeddings", "batch_size": B, "path": PATH}``: encode once and save the (N, E) float32
  rows to PATH (``.npy``; numpy comes with sentence-transformers).
* ``{"op": "quit"}``: answer and exit (end of input does the same, silently).
"""

from __future__ import annotations

import os
import sys

# Run as a file, Python puts this folder first on sys.path, where multihead's own modules would
# shadow the standard library's and the libraries' (trace, cost, ...): take it off.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import hashlib  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from importlib import metadata  # noqa: E402
from typing import IO, Any  # noqa: E402

BACKENDS = ("torch", "onnx", "openvino")
PRECISIONS = ("default", "f32")
#: The distributions whose versions a load reports (those installed).
_DISTS = ("sentence-transformers", "transformers", "torch", "optimum", "optimum-onnx", "onnxruntime",
          "optimum-intel", "openvino")
#: The exported model's file inside an exported folder, by backend.
_EXPORTED = {"onnx": os.path.join("onnx", "model.onnx"), "openvino": os.path.join("openvino", "openvino_model.xml")}


class ProtocolError(ValueError):
    """A request this worker cannot take (bad JSON, unknown op, missing field, no model loaded)."""


def _versions() -> dict[str, str]:
    """The installed versions of :data:`_DISTS`."""
    found = {}
    for name in _DISTS:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


def _field(request: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    """``request[name]``, checked to be of ``kind``."""
    if name not in request:
        raise ProtocolError(f"{request.get('op')!r} needs {name!r}")
    value = request[name]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ProtocolError(f"{name!r} has the wrong type: {value!r}")
    return value


def _export_key(model: str, backend: str) -> str:
    """A folder name for ``model`` exported to ``backend`` by these package versions."""
    stats = [(name, os.path.getsize(os.path.join(model, name)), os.path.getmtime(os.path.join(model, name)))
             for name in sorted(os.listdir(model)) if os.path.isfile(os.path.join(model, name))]
    blob = json.dumps([os.path.abspath(model), stats, _versions()], sort_keys=True).encode()
    return f"{backend}-{hashlib.sha256(blob).hexdigest()[:16]}"


def _exported(model: str, backend: Any, cache_dir: str) -> str:
    """A folder with ``model`` and its ``backend`` export (made now unless ``cache_dir`` has it)."""
    from sentence_transformers import SentenceTransformer

    final = os.path.join(cache_dir, _export_key(model, backend))
    if os.path.isfile(os.path.join(final, _EXPORTED[backend])):
        return final
    os.makedirs(cache_dir, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".export-", dir=cache_dir)
    SentenceTransformer(model, device="cpu", backend=backend).save_pretrained(staging)
    try:
        os.replace(staging, final)
    except OSError:  # another run exported it meanwhile
        shutil.rmtree(staging, ignore_errors=True)
    return final


def _model_kwargs(backend: str, precision: str, threads: int) -> dict[str, Any]:
    """The ``model_kwargs`` that give ``backend`` ``threads`` threads (and OpenVINO ``precision``)."""
    if backend == "onnx":
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        return {"session_options": options, "provider": "CPUExecutionProvider"}
    if backend == "openvino":
        config = {"INFERENCE_NUM_THREADS": str(threads)}
        if precision == "f32":
            config["INFERENCE_PRECISION_HINT"] = "f32"
        return {"ov_config": config}
    return {}


def _precision(model: Any, backend: str) -> str:
    """The precision the loaded model computes in."""
    inner = model[0].auto_model
    if backend == "openvino":
        hint = inner.request.get_property("INFERENCE_PRECISION_HINT")  # an openvino Type: its name is "bf16"
        return str(hint.get_type_name() if hasattr(hint, "get_type_name") else hint)
    if backend == "onnx":
        return "f32"
    return str(next(inner.parameters()).dtype).replace("torch.", "")


class Worker:
    """The state between requests: the model and the corpus, once loaded."""

    def __init__(self) -> None:
        self.model: Any = None
        self.texts: list[str] = []
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    def close(self) -> None:
        """Remove the temporary folder of exports, if one was made."""
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def load(self, request: dict[str, Any]) -> dict[str, Any]:
        """The ``load`` request (see the module's docstring)."""
        model, backend = _field(request, "model", str), _field(request, "backend", str)
        precision, threads = request.get("precision", "default"), _field(request, "threads", int)
        if backend not in BACKENDS:
            raise ProtocolError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
        if precision not in PRECISIONS:
            raise ProtocolError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
        if threads < 1:
            raise ProtocolError(f"threads must be positive, not {threads}")
        with open(_field(request, "corpus", str), encoding="utf-8") as f:
            texts = json.load(f)
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise ProtocolError("the corpus file must hold a JSON list of strings")
        t0 = time.perf_counter()
        import torch
        from sentence_transformers import SentenceTransformer

        torch.set_num_threads(threads)
        path = model
        if backend != "torch":
            cache = request.get("cache_dir")
            if cache is None:
                self._tmp = self._tmp or tempfile.TemporaryDirectory(prefix="embed-peer-")
                cache = self._tmp.name
            path = _exported(model, backend, str(cache))
        self.model = SentenceTransformer(path, device="cpu", backend=backend,
                                         model_kwargs=_model_kwargs(backend, precision, threads))
        self.texts = texts
        return {"info": {"backend": backend, "precision": _precision(self.model, backend), "threads": threads,
                         "texts": len(texts), "versions": _versions(), "python": sys.version.split()[0],
                         "load_s": time.perf_counter() - t0}}

    def encode(self, request: dict[str, Any]) -> Any:
        """The corpus encoded at the request's batch size, an (N, E) float32 array."""
        if self.model is None:
            raise ProtocolError(f"{request['op']!r} before 'load'")
        batch = _field(request, "batch_size", int)
        if batch < 1:
            raise ProtocolError(f"batch_size must be positive, not {batch}")
        return self.model.encode(self.texts, batch_size=batch, convert_to_numpy=True)

    def time(self, request: dict[str, Any]) -> dict[str, Any]:
        """The ``time`` request: one whole encode, timed."""
        t0 = time.perf_counter()
        self.encode(request)
        return {"seconds": time.perf_counter() - t0, "cpu_s": time.process_time()}

    def embeddings(self, request: dict[str, Any]) -> dict[str, Any]:
        """The ``embeddings`` request: one whole encode, saved as ``.npy``."""
        import numpy as np

        path = _field(request, "path", str)
        vectors = np.asarray(self.encode(request), dtype=np.float32)
        np.save(path, vectors)
        return {"shape": list(vectors.shape)}


def answer(worker: Worker, line: str) -> dict[str, Any]:
    """The answer to one request line (errors as ``{"ok": false, "error": ...}``)."""
    try:
        request = json.loads(line)
    except ValueError as e:
        return {"ok": False, "error": f"not a JSON line: {e}: {line[:80]!r}"}
    ops = {"load": worker.load, "time": worker.time, "embeddings": worker.embeddings}
    try:
        if not isinstance(request, dict) or request.get("op") not in (*ops, "quit"):
            op = request.get("op") if isinstance(request, dict) else request
            raise ProtocolError(f"unknown op {op!r}: expected one of {', '.join((*ops, 'quit'))}")
        if request["op"] == "quit":
            return {"ok": True, "quit": True}
        return {"ok": True, **ops[request["op"]](request)}
    except Exception as e:  # the worker reports every failure and goes on
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}


def serve(requests: IO[str], answers: IO[str]) -> Worker:
    """Answer each line of ``requests`` on ``answers`` until ``quit`` or the end of input; returns the
    worker (to :meth:`Worker.close`)."""
    worker = Worker()
    for line in requests:
        if not line.strip():
            continue
        reply = answer(worker, line)
        answers.write(json.dumps(reply) + "\n")
        answers.flush()
        if reply.get("quit"):
            break
    return worker


def main() -> None:
    """Serve stdin, answering on the real stdout; whatever else writes to stdout goes to stderr."""
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    serve(sys.stdin, answers).close()
    sys.stderr.flush()
    os._exit(0)  # skips the interpreter's teardown of torch and the backends: seconds, nothing to keep


if __name__ == "__main__":
    main()
