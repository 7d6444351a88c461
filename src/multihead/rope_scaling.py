"""RoPE scaling: the inverse frequencies and attention factor of every scaled RoPE type.

Notation: D head dim, R rotary dims (R = int(D · partial_rotary_factor), even),
L the sequence length a call covers (largest position + 1).

Each type rewrites the R/2 inverse frequencies ``θ^(-2p/R)`` of plain RoPE and may set an
*attention factor* ``a`` that multiplies cos and sin (so q·k gains ``a²``):

==========  ===================================================  ===================
type        inverse frequencies                                  depends on L
==========  ===================================================  ===================
default     ``θ^(-2p/R)``                                        no
linear      ``θ^(-2p/R) / factor`` (position interpolation)      no
dynamic     NTK: θ raised to ``θ·(factor·L/M - (factor-1))^(R/(R-2))`` for L > M   yes
llama3      low frequencies / factor, high kept, smooth between  no
yarn        ramp between interpolated and extrapolated; ``a``    no
longrope    ``θ^(-2p/R) / ext[p]``, ext = short or long factors  yes (L > M_orig)
==========  ===================================================  ===================

(M is ``max_position_embeddings``, M_orig ``original_max_position_embeddings``.) The
formulas are those of transformers' ``ROPE_INIT_FUNCTIONS``, operation for operation, so
that the float32 results are bitwise equal (tested); :func:`rope_frequencies` is the one
place they live. A length-dependent type follows transformers' forward pass: ``dynamic``
keeps the plain frequencies up to M and grows with L past it (computed from the call's
own L, where transformers keeps the largest L it has seen); ``longrope`` uses the short
factors up to M_orig and the long ones past it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import torch

__all__ = ["RopeScaling", "ROPE_TYPES", "rope_frequencies", "FACTOR_RANGE", "MAX_SCALING_POSITIONS"]

#: The RoPE types multihead computes (transformers' table, plus the unscaled default).
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
_NEEDS = {
    "linear": ("factor",),
    "dynamic": ("factor", "max_positions"),
    "yarn": ("original_max_positions",),
    "longrope": ("short_factor", "long_factor", "original_max_positions"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_positions"),
}
_SCALARS = ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "mscale",
            "mscale_all_dim", "attention_factor")
#: The closed range every scalar and every longrope entry must lie in (mscale and mscale_all_dim
#: may also be 0, "off"). Real checkpoints use 1 to 64; outside this range the tables are
#: meaningless or overflow (a linear factor of 1e-300 gives infinite angles: zeros, then NaN).
FACTOR_RANGE = (1e-3, 1e6)
#: The largest ``max_positions`` / ``original_max_positions`` (as ``AttentionConfig.max_positions``):
#: 10^30 overflows float conversion in llama3's and yarn's formulas.
MAX_SCALING_POSITIONS = 1 << 30
_T = TypeVar("_T")


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """A RoPE scaling rule, with transformers' ``rope_parameters`` names (M = ``max_positions``).

    Args:
        rope_type: one of :data:`ROPE_TYPES`.
        factor: the context extension factor (linear, dynamic, llama3, yarn, longrope);
            yarn and longrope default to ``max_positions / original_max_positions``.
        max_positions: ``max_position_embeddings`` (dynamic's M; yarn/longrope default factor).
        original_max_positions: ``original_max_position_embeddings`` (llama3, yarn, longrope).
        low_freq_factor, high_freq_factor: llama3's band edges.
        beta_fast, beta_slow, mscale, mscale_all_dim, truncate: yarn's ramp and factor.
        attention_factor: yarn/longrope's factor on cos and sin; default from ``factor``.
        short_factor, long_factor: longrope's R/2 per-frequency factors.

    Raises:
        ValueError: unknown type, a field the type needs missing, a factor outside
            :data:`FACTOR_RANGE` (non-finite, zero, negative or absurd), a position count
            outside [1, :data:`MAX_SCALING_POSITIONS`]; longrope factors of the wrong length
            and dynamic scaling over 2 rotary dims by :meth:`check_rotary_dim`.
        TypeError: a field of the wrong type.
    """

    rope_type: str = "default"
    factor: float | None = None
    max_positions: int | None = None
    original_max_positions: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type must be one of {list(ROPE_TYPES)}, got {self.rope_type!r}")
        for name in _SCALARS:
            value = getattr(self, name)
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
                _check_factor(name, value, zero_ok=name in ("mscale", "mscale_all_dim"))
        for name in ("max_positions", "original_max_positions"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name} must be a positive int, got {type(value).__name__} {value!r}")
            if value is not None and not 1 <= value <= MAX_SCALING_POSITIONS:
                raise ValueError(f"{name} must be an int in [1, {MAX_SCALING_POSITIONS}], got {value}")
        if not isinstance(self.truncate, bool):
            raise TypeError(f"truncate must be a bool, got {type(self.truncate).__name__}")
        for name in ("short_factor", "long_factor"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _factor_list(name, value))
        missing = [n for n in _NEEDS.get(self.rope_type, ()) if getattr(self, n) is None]
        if self.rope_type in ("yarn", "longrope") and self.factor is None and self.max_positions is None:
            missing.append("factor (or max_positions)")
        if missing:
            raise ValueError(f"rope_type={self.rope_type!r} needs {', '.join(missing)}, got None")
        if self.rope_type == "llama3" and self.high_freq_factor == self.low_freq_factor:
            raise ValueError(f"llama3 needs high_freq_factor != low_freq_factor, got both {self.low_freq_factor}")

    def check_rotary_dim(self, rotary_dim: int) -> None:
        """Refuse a rule that cannot apply to R = ``rotary_dim`` rotated coordinates per head.

        Longrope needs R/2 short and long factors (one per frequency); dynamic raises θ to
        the power R/(R-2), so it needs R >= 4. Checked when a config is read and when a
        :class:`~multihead.RoPE` is built, not at the first position past the original length.

        Raises:
            ValueError: naming the field, with the expected and the actual count.
        """
        if self.rope_type == "dynamic" and rotary_dim < 4:
            raise ValueError(f"rotary_dim must be >= 4 for rope_type='dynamic' (θ is raised to R/(R-2)), "
                             f"got {rotary_dim}")
        for name in ("short_factor", "long_factor"):
            value = getattr(self, name)
            if self.rope_type == "longrope" and value is not None and len(value) != rotary_dim // 2:
                raise ValueError(f"{name} must have rotary_dim/2 = {rotary_dim // 2} entries, got {len(value)}")

    @property
    def length_dependent(self) -> bool:
        """Whether the frequencies depend on the call's length (dynamic, longrope)."""
        return self.rope_type in ("dynamic", "longrope")

    @classmethod
    def from_hf(cls, params: Mapping[str, Any], *, max_positions: int | None = None) -> RopeScaling:
        """From a transformers ``rope_parameters`` / ``rope_scaling`` dict (``type`` or ``rope_type``).

        Raises:
            ValueError, TypeError: as the constructor, naming the key.
        """
        if not isinstance(params, Mapping):
            raise TypeError(f"rope_parameters must be a dict, got {type(params).__name__}")
        rope_type = params.get("rope_type", params.get("type", "default"))
        names = {f.name for f in fields(cls)} - {"rope_type", "max_positions", "original_max_positions"}
        given = {k: params[k] for k in names if params.get(k) is not None}
        original = params.get("original_max_position_embeddings")
        return cls(rope_type=rope_type, max_positions=max_positions, original_max_positions=original, **given)


def _check_factor(name: str, value: float, *, zero_ok: bool = False) -> None:
    """Refuse ``value`` outside :data:`FACTOR_RANGE` (NaN and infinities included), naming ``name``."""
    low, high = FACTOR_RANGE
    if not (low <= value <= high or zero_ok and value == 0):
        allowed = f"0 or in [{low:g}, {high:g}]" if zero_ok else f"in [{low:g}, {high:g}]"
        raise ValueError(f"{name} must be a finite number {allowed}, got {value!r}")


def _factor_list(name: str, value: object) -> tuple[float, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a list of numbers, got {type(value).__name__}")
    out = []
    for i, f in enumerate(value):
        if isinstance(f, bool) or not isinstance(f, (int, float)):
            raise ValueError(f"{name}[{i}] must be a finite number in [{FACTOR_RANGE[0]:g}, {FACTOR_RANGE[1]:g}], "
                             f"got {f!r}")
        _check_factor(f"{name}[{i}]", f)
        out.append(float(f))
    return tuple(out)


def _needed(s: RopeScaling, name: str, value: _T | None) -> _T:
    """``value`` (the field ``name`` of ``s``), which ``s.rope_type`` needs; checked, not assumed."""
    if value is None:  # __post_init__ refuses this; kept so the type is narrowed by a check
        raise ValueError(f"rope_type={s.rope_type!r} needs {name}, got None")
    return value


def _extension_factor(s: RopeScaling) -> float:
    """yarn/longrope's factor: ``factor``, or ``max_positions / original_max_positions``."""
    if s.factor is not None:
        return s.factor
    return _needed(s, "max_positions", s.max_positions) / _needed(s, "original_max_positions",
                                                                  s.original_max_positions)


def rope_frequencies(rotary_dim: int, base: float, scaling: RopeScaling | None = None, *,
                     seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq (R/2,) float32, attention_factor) for RoPE over R dims, as transformers computes them.

    Args:
        rotary_dim: R (even).
        base: θ (``rope_theta``).
        scaling: the rule; None = plain RoPE.
        seq_len: L, the length the call covers, for the length-dependent types (dynamic:
            frequencies change past M; longrope: long factors past M_orig); None = at
            initialisation (L ≤ M).

    Raises:
        ValueError: longrope factors whose length is not R/2, dynamic with R < 4
            (:meth:`RopeScaling.check_rotary_dim`).
    """
    s = scaling or RopeScaling()
    s.check_rotary_dim(rotary_dim)
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim  # (R/2,)
    if s.rope_type in ("default", "linear", "llama3"):
        inv_freq = 1.0 / (base ** exponents)
        if s.rope_type == "linear":
            inv_freq /= _needed(s, "factor", s.factor)
        elif s.rope_type == "llama3":
            inv_freq = _llama3(inv_freq, s)
        return inv_freq, 1.0
    if s.rope_type == "dynamic":
        return _dynamic(rotary_dim, base, exponents, s, seq_len), 1.0
    if s.rope_type == "yarn":
        return _yarn(rotary_dim, base, s)
    return _longrope(rotary_dim, base, exponents, s, seq_len)


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    factor, low = _needed(s, "factor", s.factor), _needed(s, "low_freq_factor", s.low_freq_factor)
    high = _needed(s, "high_freq_factor", s.high_freq_factor)
    old = _needed(s, "original_max_positions", s.original_max_positions)
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _dynamic(dim: int, base: float, exponents: torch.Tensor, s: RopeScaling, seq_len: int | None) -> torch.Tensor:
    m, factor = _needed(s, "max_positions", s.max_positions), _needed(s, "factor", s.factor)
    if seq_len is None or seq_len <= m:  # transformers' initial table, kept up to M
        grown: float | torch.Tensor = base * ((factor * m / m) - (factor - 1)) ** (dim / (dim - 2))
    else:  # its forward pass recomputes with L as a tensor (float32 arithmetic)
        length = torch.tensor(seq_len)
        grown = base * ((factor * length / m) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (grown ** exponents)


def _yarn(dim: int, base: float, s: RopeScaling) -> tuple[torch.Tensor, float]:
    original = _needed(s, "original_max_positions", s.original_max_positions)
    factor = _extension_factor(s)

    def mscale_of(scale: float, mscale: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention = s.attention_factor
    if attention is None:
        attention = (float(mscale_of(factor, s.mscale) / mscale_of(factor, s.mscale_all_dim))
                     if s.mscale and s.mscale_all_dim else mscale_of(factor))
    beta_fast, beta_slow = s.beta_fast or 32, s.beta_slow or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)  # (R/2,)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1 = extrapolate (high frequencies), 0 = interpolate
    return interpolation * (1 - keep) + extrapolation * keep, attention


def _longrope(dim: int, base: float, exponents: torch.Tensor, s: RopeScaling, seq_len: int | None
              ) -> tuple[torch.Tensor, float]:
    original = _needed(s, "original_max_positions", s.original_max_positions)
    factor = _extension_factor(s)
    attention = s.attention_factor
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    name = "long_factor" if seq_len is not None and seq_len > original else "short_factor"
    chosen = _needed(s, name, s.long_factor if name == "long_factor" else s.short_factor)
    if len(chosen) != dim // 2:
        raise ValueError(f"{name} must have rotary_dim/2 = {dim // 2} entries, got {len(chosen)}")
    ext = torch.tensor(chosen, dtype=torch.float32)
    return 1.0 / (ext * base ** exponents), attention
