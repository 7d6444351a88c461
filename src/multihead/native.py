"""The native CPU kernels (``csrc/``): built on first use, loaded with ctypes.

Notation: B batch, H query heads, Hkv key/value heads, Sq queries, Sk keys, D head dim,
Dv value head dim.

The kernels are C++ with no dependency but OpenMP: ``attention.cpp`` (the FlashAttention
loop), ``decode.cpp`` (decoding: attention, few-row linear layers, a whole layer step),
``common.h`` (what they share). The first call that needs them compiles them for this
machine (``-O3 -march=native``, one or two seconds) into a cache folder,
``$MULTIHEAD_CACHE_DIR`` or ``~/.cache/multihead`` (or, if that cannot be written, a
private folder under the system's temporary folder), under a name that hashes the
sources, the compiler and the CPU's flags, so a shared home folder or an upgraded
compiler never loads a stale or foreign build. A folder that is not the user's own, or
that others may write to, is never used. Nothing happens at import time.

Without a C++ compiler (``$CXX``, ``g++`` or ``c++``), or with ``MULTIHEAD_NATIVE=0``,
:func:`available` is False and the ``"auto"`` backend uses its torch paths; the reason
is in :func:`status`. The library is written with ``-fopenmp`` and loaded after torch,
so its threads come from torch's own OpenMP runtime (no second thread pool).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

import torch

from ._checks import check_int, check_tensor

__all__ = ["available", "status", "build", "vector_bits", "attention_f32", "decode_f32", "linear_few_rows", "decode_step",
           "FEW_ROWS"]

_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
_SOURCES = ("common.h", "attention.cpp", "decode.cpp")
_status = "not built yet"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_dirs() -> list[Path]:
    """Where a build may go, in order of preference."""
    root = os.environ.get("MULTIHEAD_CACHE_DIR")
    first = Path(root) if root else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "multihead"
    return [first, Path(tempfile.gettempdir()) / f"multihead-{os.getuid()}"]


def _private_dir(path: Path) -> bool:
    """Create ``path`` if needed; True if it is ours and no one else may write to it.

    A shared library is loaded from here: a folder others can write to could hand us
    theirs under the expected name.
    """
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.stat()
    except OSError:
        return False
    return st.st_uid == os.getuid() and not st.st_mode & 0o022 and os.access(path, os.W_OK)


@functools.cache
def _library() -> ctypes.CDLL | None:
    """Compile (once per machine and source) and load the kernel, or None with a reason."""
    global _status
    if os.environ.get("MULTIHEAD_NATIVE", "1") == "0":
        _status = "disabled by MULTIHEAD_NATIVE=0"
        return None
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        _status = "no C++ compiler found (set CXX or install g++)"
        return None
    csrc = resources.files("multihead").joinpath("csrc")
    sources = {name: csrc.joinpath(name).read_bytes() for name in _SOURCES}
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as err:
        _status = f"compiler {compiler!r} does not run: {err}"
        return None
    key = hashlib.sha256(b"\0".join([*sources.values(), version.encode(), " ".join(_FLAGS).encode(),
                                     _cpu_flags().encode()])).hexdigest()[:20]
    folder = next((d for d in _cache_dirs() if _private_dir(d)), None)
    if folder is None:
        _status = f"no private folder to build into (tried {', '.join(map(str, _cache_dirs()))})"
        return None
    target = folder / f"attention-{key}.so"
    if not target.exists():
        try:
            with tempfile.TemporaryDirectory(dir=folder) as tmp:
                for name, text in sources.items():
                    (Path(tmp) / name).write_bytes(text)
                out = Path(tmp) / target.name
                units = [str(Path(tmp) / name) for name in _SOURCES if name.endswith(".cpp")]
                done = subprocess.run([compiler, *_FLAGS, "-o", str(out), *units], capture_output=True,
                                      text=True, timeout=300)
                if done.returncode != 0:
                    _status = f"compiling the native kernel failed: {done.stderr.strip()[-2000:]}"
                    return None
                os.replace(out, target)  # atomic: concurrent builders each write a whole file
        except (OSError, subprocess.SubprocessError) as err:
            _status = f"building the native kernel failed: {err}"
            return None
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as err:
        _status = f"loading {target} failed: {err}"
        return None
    common = [ctypes.c_void_p] * 5 + [ctypes.POINTER(ctypes.c_int64)] * 2 + [ctypes.c_float, ctypes.c_int,
                                                                            ctypes.c_int64]
    lib.mh_attention_f32.argtypes = common + [ctypes.c_int64, ctypes.c_int]  # + query tile, threads
    lib.mh_decode_f32.argtypes = common + [ctypes.c_int]  # + threads
    ptrs = ctypes.POINTER(ctypes.c_void_p)
    lib.mh_linear_few_rows_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ptrs,
                                           ctypes.POINTER(ctypes.c_int64), ptrs, ptrs, ctypes.c_int]
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    lib.mh_decode_step_f32.argtypes = [vp, i64, i64, ptrs, ptrs, i64, i64, i64, vp, vp, i64, ctypes.c_int, vp, vp,
                                       ctypes.POINTER(i64), vp, vp, i64, ctypes.c_float, vp, ctypes.c_int]
    lib.mh_vector_bits.argtypes = []
    for fn in (lib.mh_attention_f32, lib.mh_decode_f32, lib.mh_linear_few_rows_f32, lib.mh_decode_step_f32,
               lib.mh_vector_bits):
        fn.restype = ctypes.c_int
    _status = f"ready: {target}"
    return lib


def build() -> bool:
    """Build and load the kernel now (instead of on first use); True when available."""
    return _library() is not None


def available() -> bool:
    """Whether the native kernel can run here (builds it on first call)."""
    return _library() is not None


def vector_bits() -> int:
    """The SIMD width the kernels were compiled for here: 512 (AVX-512), 256 or 128; 0 if
    they are not available.

    Their register tiles were designed for and measured with AVX-512; narrower vectors
    are correct but not measured, so ``"auto"`` only picks the kernels at 512.
    """
    lib = _library()
    return 0 if lib is None else int(lib.mh_vector_bits())


def status() -> str:
    """Why the kernel is or is not available (after :func:`available` or a call)."""
    return _status


#: Query positions per work item: items are (batch, K/V head, query tile).
_QUERY_TILE = 48


def attention_f32(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal: bool = False,
    window: int | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention with the native kernel, forward only (no autograd).

    Work items are (batch, K/V head, tile of query positions); each packs its keys in
    panels and runs the FlashAttention loop over chunks of keys.

    Args:
        q: (B, H, Sq, D); k: (B, Hkv, Sk, D); v: (B, Hkv, Sk, Dv); float32 CPU tensors,
            H a multiple of Hkv. Any strides (rows are made contiguous if their last
            dim is not).
        scale, causal, window: as in :func:`multihead.attention` (bottom-right aligned).
        mask: bool, broadcastable to (B, H, Sq, Sk), True = may attend; or None.

    Returns:
        (B, H, Sq, Dv), a view of a (B, Sq, H, Dv) buffer; zeros for rows with no key.

    Raises:
        TypeError, ValueError: tensors of the wrong dtype, device or shapes.
        RuntimeError: the kernel is not available (see :func:`status`).
    """
    return _run("mh_attention_f32", q, k, v, scale, causal, window, mask, _QUERY_TILE)


def decode_f32(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal: bool = False,
    window: int | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """As :func:`attention_f32`, for few query rows per K/V head (G·Sq, e.g. decoding).

    K and V are streamed once, in place (no packing); work items are (batch, K/V head,
    key split), the keys being split (and the parts merged by their log-sum-exp, as in
    flash-decoding) only when there are fewer K/V heads than threads.
    """
    return _run("mh_decode_f32", q, k, v, scale, causal, window, mask)


def _check_qkv(q: object, k: object, v: object, mask: object, window: object) -> None:
    """The kernel reads raw memory: shapes, dtypes and devices are checked first."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, ndim=4)
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise TypeError(f"{name} must be a float32 CPU tensor, got {t.dtype} on {t.device}")
    b, h, sq, d = q.shape
    if k.shape[0] != b or v.shape[0] != b or k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v must be (B={b}, Hkv, Sk, D) and (B, Hkv, Sk, Dv) alike, "
                         f"got {list(k.shape)} and {list(v.shape)}")
    if k.shape[-1] != d:
        raise ValueError(f"k must have head dim {d} like q, got shape {list(k.shape)}")
    if k.shape[1] == 0 or h % k.shape[1] or 0 in (d, v.shape[-1]):
        raise ValueError(f"q's heads ({h}) must be a positive multiple of k's ({k.shape[1]}), head dims > 0")
    if mask is not None:
        check_tensor("mask", mask, ndim=(2, 3, 4))
        if mask.dtype != torch.bool:
            raise TypeError(f"mask must be a bool tensor (True = may attend), got dtype {mask.dtype}")
        try:
            torch.broadcast_shapes(mask.shape, (b, h, sq, k.shape[2]))
        except RuntimeError:
            raise ValueError(f"mask must broadcast to [B, H, Sq, Sk] = {[b, h, sq, k.shape[2]]}, "
                             f"got {list(mask.shape)}") from None
    if window is not None:
        check_int("window", window)


def _run(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
         window: int | None, mask: torch.Tensor | None, *extra: int) -> torch.Tensor:
    _check_qkv(q, k, v, mask, window)
    lib = _library()
    if lib is None:
        raise RuntimeError(f"the native kernel is not available: {_status}")
    b, h, sq, d = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[-1]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = torch.empty((b, sq, h, dv), dtype=torch.float32).permute(0, 2, 1, 3)  # (B, H, Sq, Dv)
    if mask is not None:
        mask = mask[(None,) * (4 - mask.dim())].expand(b, h, sq, sk)  # strides 0 where broadcast
    dims = (ctypes.c_int64 * 7)(b, h, hkv, sq, sk, d, dv)
    strides = (ctypes.c_int64 * 16)(*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
                                    *(mask.stride() if mask is not None else (0, 0, 0, 0)))
    code = getattr(lib, name)(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                              mask.data_ptr() if mask is not None else None, dims, strides, float(scale),
                              int(causal), int(window or 0), *extra, torch.get_num_threads())
    if code == -1:
        raise MemoryError("the native attention kernel could not allocate its buffers")
    if code != 0:
        raise RuntimeError(f"the native attention kernel refused the problem (code {code})")
    return out


#: Most rows of x that :func:`linear_few_rows` takes.
FEW_ROWS = 4


def linear_few_rows(
    x: torch.Tensor, layers: list[tuple[torch.Tensor, torch.Tensor | None]]
) -> list[torch.Tensor]:
    """``x · wᵀ + b`` for each ``(w, b)`` of ``layers`` in one call, for few rows of x.

    For decoding: the weights are streamed once, all of them split across threads in
    one parallel region (the q, k and v projections of a token cost one call). Forward
    only.

    Args:
        x: (M, K) float32, contiguous, 1 ≤ M ≤ :data:`FEW_ROWS`.
        layers: (w (N_i, K), b (N_i,) or None), float32 and contiguous.

    Returns:
        One (M, N_i) tensor per layer.

    Raises:
        TypeError, ValueError: tensors of the wrong dtype, device, layout or shapes.
        RuntimeError: the kernel is not available (see :func:`status`).
    """
    check_tensor("x", x, ndim=2)
    if not 1 <= x.shape[0] <= FEW_ROWS:
        raise ValueError(f"x must have 1 to {FEW_ROWS} rows, got shape {list(x.shape)}")
    for name, t in [("x", x)] + [(f"layers[{i}][{j}]", t) for i, layer in enumerate(layers)
                                 for j, t in enumerate(layer) if t is not None]:
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
            raise TypeError(f"{name} must be a contiguous float32 CPU tensor, got {t.dtype} on {t.device}"
                            f"{'' if t.is_contiguous() else ', not contiguous'}")
    for i, (w, bias) in enumerate(layers):
        if w.dim() != 2 or w.shape[1] != x.shape[1] or w.shape[0] == 0:
            raise ValueError(f"layers[{i}] weight must be (N, {x.shape[1]}), got {list(w.shape)}")
        if bias is not None and tuple(bias.shape) != (w.shape[0],):
            raise ValueError(f"layers[{i}] bias must be ({w.shape[0]},), got {list(bias.shape)}")
    lib = _library()
    if lib is None:
        raise RuntimeError(f"the native kernel is not available: {_status}")
    m, k = x.shape
    outs = [torch.empty((m, w.shape[0]), dtype=torch.float32) for w, _ in layers]
    n = len(layers)
    code = lib.mh_linear_few_rows_f32(
        x.data_ptr(), m, k, n, (ctypes.c_void_p * n)(*(w.data_ptr() for w, _ in layers)),
        (ctypes.c_int64 * n)(*(w.shape[0] for w, _ in layers)),
        (ctypes.c_void_p * n)(*(None if b is None else b.data_ptr() for _, b in layers)),
        (ctypes.c_void_p * n)(*(o.data_ptr() for o in outs)), torch.get_num_threads())
    if code != 0:
        raise RuntimeError(f"the native linear kernel refused the problem (code {code})")
    return outs


def decode_step(
    x: torch.Tensor,
    layers: list[tuple[torch.Tensor, torch.Tensor | None]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rope: tuple[torch.Tensor, torch.Tensor, int, bool] | None,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    lengths: torch.Tensor,
    slot_pos: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """A whole decoding step of a layer in one call (one token per row, B ≤ :data:`FEW_ROWS`).

    Projects x to q, k, v, rotates q and k at each row's position ``lengths[b]``, writes
    k and v into the cache at that slot, attends over the row's ``lengths[b] + 1`` keys,
    projects with W_o, and advances ``lengths`` and ``slot_pos`` in place. The caller
    (:class:`multihead.MultiHeadAttention`) has validated everything: this checks nothing.

    Args:
        x: (B, E) float32, contiguous.
        layers: (weight, bias or None) of q, k, v, o; contiguous float32.
        rope: (cos (P, R/2), sin (P, R/2), R, interleaved) float32 tables covering every
            row's position, or None.
        cache_k, cache_v: (B, Hkv, C, D) float32 with contiguous rows. lengths: (B,)
            int64; slot_pos: (B, C) int64, contiguous.

    Returns:
        y: (B, E).
    """
    lib = _library()
    if lib is None:
        raise RuntimeError(f"the native kernel is not available: {_status}")
    b, e = x.shape
    y = torch.empty((b, e), dtype=torch.float32)
    cos, sin, rotary_dim, interleaved = rope if rope is not None else (None, None, 0, False)
    code = lib.mh_decode_step_f32(
        x.data_ptr(), b, e, (ctypes.c_void_p * 4)(*(w.data_ptr() for w, _ in layers)),
        (ctypes.c_void_p * 4)(*(None if bias is None else bias.data_ptr() for _, bias in layers)),
        num_heads, num_kv_heads, head_dim, None if cos is None else cos.data_ptr(),
        None if sin is None else sin.data_ptr(), rotary_dim, int(interleaved), cache_k.data_ptr(), cache_v.data_ptr(),
        (ctypes.c_int64 * 3)(*cache_k.stride()[:3]), lengths.data_ptr(), slot_pos.data_ptr(), slot_pos.shape[1],
        float(scale), y.data_ptr(), torch.get_num_threads())
    if code == -1:
        raise MemoryError("the native decoding step could not allocate its buffers")
    if code != 0:
        raise RuntimeError(f"the native decoding step refused the problem (code {code})")
    return y
