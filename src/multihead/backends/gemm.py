"""The float32 GEMM of the projections and the torch-only kernels: oneDNN's or torch.matmul's.

Notation: M, N, K the GEMM's sizes (x (M, K) · wᵀ with w (N, K)).

Which of the two is faster depends on the machine, not on its vendor: oneDNN's GEMM ran at
198 GFLOP/s against torch.matmul's (MKL) 148 on an Intel Xeon, 107-120 against 88-99 on one
AMD EPYC Zen 3 VM, and 128-148 against 131-172 on another of the same CPU model (2 threads,
the layer's shapes). So it is measured, once per machine (:func:`gemm_choice`), and the
verdict kept in the cache folder, so that every process on the machine computes with the
same GEMM (bitwise the same results run to run). Processes that first ask at the same time
take turns (a lock beside the record): the first measures and writes, the others read its
verdict back, so there is one verdict per machine. A damaged record is discarded, measured
again and replaced, never fatal. ``$MULTIHEAD_GEMM`` (``onednn`` or
``torch``) chooses without measuring; it is read once per process (the choice is asked at every
call of a layer), and again after :func:`refresh_settings`, for a program or test that changes
it at run time; ``torch.backends.mkldnn.enabled = False`` means torch.matmul.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .._compile import constant_in_graphs

__all__ = ["MatMul", "onednn_available", "onednn_usable", "gemm_choice", "gemm_setting", "refresh_settings",
           "gemm_measurement", "keep_gemm_measurement",
           "gemm_for", "mm_nt", "matmul_nt", "onednn_mm_nt", "onednn_linear_op", "compiled_onednn"]

#: The choices of ``$MULTIHEAD_GEMM``.
GEMM_CHOICES = ("onednn", "torch")
#: torch.matmul is chosen where its time is below this fraction of oneDNN's (the median of
#: paired rounds, and faster in three rounds out of four); at near-equal rates, or when a busy
#: machine blurs the rounds, oneDNN stays, the faster on the machines measured before.
TORCH_WINS_BELOW = 0.95
#: The shape measured: the projections of a d = 768 layer at 1,024 tokens (x (M, K), w (N, K)).
PROBE_SHAPE = (1024, 768, 768)
_CHOICE_FILE = "gemm-choice.json"
_LOCK_FILE = "gemm-choice.lock"

MatMul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@functools.cache
def onednn_gemm() -> Callable[..., torch.Tensor] | None:
    """oneDNN's fp32 GEMM as exposed by torch (the op Inductor uses), or None."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise.default
    except (AttributeError, RuntimeError):  # a torch built without it
        return None


def onednn_usable() -> bool:
    """Whether torch has oneDNN's GEMM here and it is enabled (``torch.backends.mkldnn``)."""
    # torch's stub declares the module attribute as its ContextProp descriptor; it reads a bool.
    return onednn_gemm() is not None and torch.backends.mkldnn.enabled  # type: ignore[return-value]


def onednn_available() -> bool:
    """Whether float32 GEMMs run on oneDNN here (else on ``torch.matmul``): oneDNN exists, is
    enabled, and is this machine's choice (:func:`gemm_choice`).

    False while ``torch.compile`` traces: Inductor cannot lower the oneDNN op that
    eager mode calls, and picks its own GEMMs for ``torch.matmul``."""
    if torch.compiler.is_compiling():
        return False
    return gemm_choice() == "onednn"


def gemm_choice() -> str:
    """``"onednn"`` or ``"torch"``: the float32 GEMM of this machine's projections.

    ``"torch"`` where oneDNN is missing or disabled (``torch.backends.mkldnn.enabled``);
    else ``$MULTIHEAD_GEMM`` if set (:func:`gemm_setting`); else the verdict of :func:`gemm_measurement`, taken
    once per machine (CPU, torch version) and kept in the cache folder.

    Raises:
        ValueError: ``$MULTIHEAD_GEMM`` is set to something else than ``onednn`` or ``torch``.
    """
    env = gemm_setting()
    if env is not None and env not in GEMM_CHOICES:
        raise ValueError(f"MULTIHEAD_GEMM must be one of {GEMM_CHOICES}, got {env!r}")
    if not onednn_usable():
        return "torch"
    return env or _measured_choice()


@functools.cache
def gemm_setting() -> str | None:
    """``$MULTIHEAD_GEMM`` as this process read it first (None: not set); read again after
    :func:`refresh_settings`."""
    return os.environ.get("MULTIHEAD_GEMM")


def refresh_settings() -> None:
    """Read ``$MULTIHEAD_GEMM`` again at the next :func:`gemm_choice` (after a change of the
    environment at run time, e.g. ``monkeypatch.setenv`` in a test)."""
    gemm_setting.cache_clear()


def _machine_key() -> str:
    from .native.cpu import cpuinfo

    info = cpuinfo()
    flags = hashlib.sha256(info.get("flags", "?").encode()).hexdigest()[:16]
    return "|".join((info.get("model name", "?"), f"flags={flags}", f"torch={torch.__version__}"))


@functools.cache
def _measured_choice() -> str:
    """The kept verdict for this machine, or a new measurement (kept where the folder allows).

    One verdict per machine (CPU, torch version), measured at the thread count of the
    process that asks first: with another thread count the same GEMM keeps running, so
    results do not change with it. Processes asking at once take turns (:func:`~.native.files.locked`)."""
    from .native.files import locked

    entry = _kept().get(_machine_key())
    if entry is not None:
        return str(entry["choice"])
    path = _record()
    if path is None:  # nowhere to keep it: this process's own measurement
        return str(gemm_measurement()["choice"])
    with locked(path.with_name(_LOCK_FILE)):
        entry = _kept().get(_machine_key())  # measured by another process while this one waited
        if entry is not None:
            return str(entry["choice"])
        return str(_measure_and_keep(path)["choice"])


def _record() -> Path | None:
    """The verdicts' file in the first private cache folder, or None (no folder may be used)."""
    from .native.files import cache_dirs, private_dir

    folders = [f for f in cache_dirs() if private_dir(f)]
    return folders[0] / _CHOICE_FILE if folders else None


def _kept() -> dict[str, dict[str, Any]]:
    """The well-formed verdicts kept so far (machine key -> measurement with a ``"choice"`` of
    :data:`GEMM_CHOICES`); {} if none, damaged or unsafe (:func:`~.native.files.read_record`)."""
    from .native.files import read_record

    path = _record()
    try:
        kept = {} if path is None else read_record(path)
    except (OSError, ValueError):  # missing, unsafe or damaged: measured again and replaced
        return {}
    if not isinstance(kept, dict):
        return {}
    return {k: v for k, v in kept.items() if isinstance(v, dict) and v.get("choice") in GEMM_CHOICES}


def keep_gemm_measurement() -> dict[str, Any]:
    """Measure (:func:`gemm_measurement`) and keep the verdict as this machine's, replacing
    any earlier one; this process uses it from now on. ``multihead bench`` calls it first, at
    a quiet moment (a first measurement taken under load falls back to oneDNN: see
    :data:`TORCH_WINS_BELOW`). Returns the measurement."""
    from .native.files import locked

    path = _record()
    if path is None:
        found = gemm_measurement()
    else:
        with locked(path.with_name(_LOCK_FILE)):
            found = _measure_and_keep(path)
    _measured_choice.cache_clear()
    return found


def _measure_and_keep(path: Path) -> dict[str, Any]:
    """Measure and write the verdict into ``path`` beside the other machines' well-formed ones
    (damaged entries are dropped); the caller holds the lock."""
    from .native.files import write_atomically

    found = gemm_measurement()
    kept = {**_kept(), _machine_key(): found}
    try:
        write_atomically(path, json.dumps(kept, indent=1, allow_nan=False).encode(), 0o600)
    except (OSError, ValueError):  # ValueError: a measurement that is not finite; not kept
        pass  # measured again by the next process
    return found


def gemm_measurement(rounds: int = 11) -> dict[str, Any]:
    """Time oneDNN's GEMM and ``torch.matmul`` on :data:`PROBE_SHAPE` in interleaved rounds
    (after two warm-up rounds; about 0.3 s on a 2-core machine).

    Returns:
        ``{"choice", "torch_over_onednn", "onednn_ms", "torch_ms"}``: the median over the
        rounds of torch.matmul's time over oneDNN's in the same round; ``"torch"`` where it is
        below :data:`TORCH_WINS_BELOW` and its upper quartile below 1 (faster in three rounds
        out of four), else ``"onednn"``. ``"torch"`` without timing where oneDNN is missing.
    """
    op = onednn_gemm()
    if op is None:
        return {"choice": "torch", "torch_over_onednn": None, "onednn_ms": None, "torch_ms": None}
    m, k, n = PROBE_SHAPE
    times: dict[str, list[float]] = {"onednn": [], "torch": []}
    # Real tensors and kernels even when first asked from inside a tracer (export's fake tensors).
    with torch.utils._python_dispatch._disable_current_modes(), torch.no_grad():
        x, w = torch.randn(m, k), torch.randn(n, k)
        kinds: dict[str, Callable[[], torch.Tensor]] = {
            "onednn": lambda: op(x, w, None, "none", [], ""), "torch": lambda: torch.matmul(x, w.t())}
        for r in range(rounds + 2):
            for name, fn in kinds.items():
                start = time.perf_counter()
                fn()
                if r >= 2:  # rounds 0 and 1 warm up
                    times[name].append(time.perf_counter() - start)
    ratios = [t / o for t, o in zip(times["torch"], times["onednn"])]
    return {"choice": _verdict(ratios), "torch_over_onednn": statistics.median(ratios),
            "onednn_ms": statistics.median(times["onednn"]) * 1e3, "torch_ms": statistics.median(times["torch"]) * 1e3}


def _verdict(ratios: list[float]) -> str:
    """``"torch"`` where torch.matmul's time over oneDNN's, round by round, has its median below
    :data:`TORCH_WINS_BELOW` and its upper quartile below 1; else ``"onednn"``."""
    ordered = sorted(ratios)
    faster = statistics.median(ordered) < TORCH_WINS_BELOW and ordered[(3 * len(ordered)) // 4] < 1.0
    return "torch" if faster else "onednn"


def matmul_nt(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x · wᵀ`` by ``torch.matmul``: x (M, K), w (N, K) -> (M, N)."""
    return torch.matmul(x, w.transpose(0, 1))


def gemm_for(x: torch.Tensor) -> MatMul:
    """The GEMM ``(x, w) -> x · wᵀ`` to use for tensors like ``x``, chosen once per call.

    oneDNN for float32 CPU tensors where it is this machine's choice (:func:`gemm_choice`),
    else ``torch.matmul``. oneDNN needs ``w`` with contiguous
    rows or a plain transpose of such a matrix: a row-strided ``w`` is copied slowly
    inside it, so callers pass contiguous K/V rows.
    """
    op = None if torch.compiler.is_compiling() else onednn_gemm()
    if op is not None and x.dtype == torch.float32 and x.device.type == "cpu" and onednn_available():
        empty: list[float] = []
        return lambda a, w: op(a, w, None, "none", empty, "")
    return matmul_nt


def onednn_mm_nt(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x · wᵀ`` on oneDNN's GEMM whatever this machine's choice (the benchmark's limits).
    x (M, K), w (N, K) float32 CPU -> (M, N).

    Raises:
        RuntimeError: this torch has no oneDNN GEMM.
    """
    op = onednn_gemm()
    if op is None:
        raise RuntimeError("oneDNN's linear is not available in this torch build")
    return op(x, w, None, "none", [], "")


def mm_nt(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x · wᵀ``: x (M, K), w (N, K) -> (M, N), with :func:`gemm_for` ``x``'s GEMM."""
    return gemm_for(x)(x, w)


@constant_in_graphs  # a traced graph takes it as a constant
def compiled_onednn() -> bool:
    """Whether traced graphs call :func:`onednn_linear_op`: oneDNN is this machine's GEMM
    (:func:`gemm_choice`)."""
    return gemm_choice() == "onednn"


@torch.library.custom_op("multihead::linear", mutates_args=())
def onednn_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x · weightᵀ + bias`` on oneDNN's GEMM, as an operator ``torch.compile`` keeps opaque.

    Inductor cannot lower torch's ``mkldnn._linear_pointwise`` and its own GEMM for
    ``F.linear`` is MKL's (AVX2 on AMD CPUs, about half oneDNN's rate), so compiled
    layers call this instead. x: (..., in) float32 CPU; weight (out, in); bias (out,) or None.
    """
    op = onednn_gemm()
    if op is None:
        raise RuntimeError("oneDNN's linear is not available in this torch build")
    x2 = x.reshape(-1, x.shape[-1]).contiguous()  # (N, in)
    return op(x2, weight.contiguous(), bias, "none", [], "").view(*x.shape[:-1], weight.shape[0])


@onednn_linear_op.register_fake
def _linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _linear_setup(ctx: Any, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _linear_backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    x, weight = ctx.saved_tensors
    gy2 = gy.reshape(-1, gy.shape[-1])  # (N, out)
    gx = onednn_linear_op(gy, weight.t().contiguous(), None)  # gy · w   (..., in)
    gw = onednn_linear_op(gy2.t().contiguous(), x.reshape(-1, x.shape[-1]).t().contiguous(), None)  # gyᵀ · x
    return gx, gw, gy2.sum(0) if ctx.has_bias else None


onednn_linear_op.register_autograd(_linear_backward, setup_context=_linear_setup)
