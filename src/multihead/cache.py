"""The KV cache: preallocated, written in place, with explicit per-row lengths.

Notation: B batch, Hkv key/value heads, C capacity (slots per row), D head_dim,
Sn new tokens in this call, L tokens written so far in a row.

At inference each head's K and V are kept so that a new token costs O(S), not O(S²)
(the seed's section 9). Only the K/V heads are stored, so GQA's saving is real:
``nbytes = 2 · B · Hkv · C · D · itemsize``.

* **Per-row lengths.** Each row b has its own length ``L_b`` (``lengths``), kept on
  the device and mirrored on the host, so nothing is read back from the device on the
  hot path and nothing is ever inferred from the data. (A write traced by ``torch.compile``,
  :meth:`KVCache.append_static`, advances the device counters alone: the mirror is read
  back from them once, at its next use outside the graph.) Prompts of different lengths are
  given **right-padded** with ``key_mask`` (real tokens first): each row then
  continues from its own length, so its tokens sit at positions 0, 1, 2, … with no
  gaps and RoPE positions need no bookkeeping. (Left padding, as Hugging Face uses,
  leaves holes in the cache and shifts positions; it is refused with a message.)
* **In place.** New keys and values are scattered into their slots; the cache never
  grows or concatenates. (A chunk of several tokens into a ring buffer is attended
  together with the ring through a temporary concatenation, since writing first could
  overwrite keys the chunk's early queries still need; the ring itself is written in
  place.) Keys are stored after RoPE, at their absolute positions.
* **Ring buffer for sliding windows.** A layer with ``window=w`` can use a cache of
  ``w`` slots per row (``ring=True``): token ``p`` lives in slot ``p % w``, and the
  slot's position is recorded in ``slot_pos``, so memory stays bounded however long
  the sequence grows.
* **Errors lose nothing.** Every check (room, batch, heads, dtype, device) runs before
  anything is written; after an error the cache holds exactly what it held before.

The cache is for inference: it stores tensors without autograd history, and a call
with gradients enabled on tensors that require them is refused.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

from ._checks import check_int
from .backends import native
from .masks import Structure

__all__ = ["KVCache", "Append", "NativeStep"]


class NativeStep(Protocol):
    """A step bound to one layer and this cache that writes K/V and advances the counters in one
    native call (:class:`multihead.decode.FusedStep`): held by the cache, made by its layer."""

    def __call__(self, x: torch.Tensor, *, checked: bool = True) -> torch.Tensor: ...

_MAX_CACHE_BYTES = 1 << 40  # 1 TiB: anything larger is a mistake, refused before allocating


class KVCache:
    """Preallocated K/V buffers of one attention layer.

    Create it with :meth:`multihead.MultiHeadAttention.new_cache`.

    Attributes:
        k, v: (B, Hkv, C, D) buffers.
        lengths: (B,) int64 tokens written per row (device).
        slot_pos: (B, C) int64 absolute position held by each slot, -1 if empty.
        max_len: the most tokens a row may hold in total.
        ring: whether slots are reused (sliding window of ``capacity`` tokens).
    """

    def __init__(
        self,
        batch_size: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        window: int | None = None,
        ring: bool = False,
    ) -> None:
        check_int("batch_size", batch_size)
        check_int("max_len", max_len, maximum=1 << 31)
        check_int("num_kv_heads", num_kv_heads)
        check_int("head_dim", head_dim)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
        if ring and window is None:
            raise ValueError("ring=True needs a layer with a sliding window, got window=None")
        capacity = min(window, max_len) if ring and window is not None else max_len
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = 2 * batch_size * num_kv_heads * capacity * head_dim * itemsize
        if nbytes > _MAX_CACHE_BYTES:
            raise ValueError(
                f"a cache of batch_size={batch_size}, capacity={capacity}, num_kv_heads={num_kv_heads}, "
                f"head_dim={head_dim} would take {nbytes / 2**40:.1f} TiB; refusing to allocate it"
            )
        shape = (batch_size, num_kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # (B, Hkv, C, D)
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # (B, Hkv, C, D)
        self.lengths = torch.zeros(batch_size, dtype=torch.int64, device=device)  # (B,)
        self.slot_pos = torch.full((batch_size, capacity), -1, dtype=torch.int64, device=device)  # (B, C)
        #: mirror of ``lengths`` (no device reads); None after a traced write (see _host_lengths)
        self._mirror: list[int] | None = [0] * batch_size
        self.max_len = max_len
        self.window = window
        self.ring = bool(ring)
        self._owner: weakref.ref | None = None  # the layer whose K/V this holds (see claim)
        #: the fused decoding step bound to this cache and its layer (multihead.decode; None until used)
        self.fused: NativeStep | None = None

    # -- sizes -----------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self.k.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[1]

    @property
    def capacity(self) -> int:
        """Slots per row: ``max_len``, or the window for a ring cache."""
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def nbytes(self) -> int:
        """Bytes of the K and V buffers: ``2 · B · Hkv · C · D · itemsize``."""
        return self.k.nbytes + self.v.nbytes

    def host_lengths(self) -> list[int]:
        """Tokens written per row, from the host mirror (no device read but the first after a
        traced write)."""
        return list(self._host_lengths)

    @property
    def _host_lengths(self) -> list[int]:
        """The host mirror of ``lengths``. A write traced by ``torch.compile``
        (:meth:`append_static`) cannot update it without the graph depending on its values (a
        recompile per length), so it leaves it unset; it is read back here, once, at its next use."""
        if self._mirror is None:
            self._mirror = [int(n) for n in self.lengths.tolist()]
        return self._mirror

    @_host_lengths.setter
    def _host_lengths(self, lengths: list[int]) -> None:
        self._mirror = lengths

    def __repr__(self) -> str:
        return (f"KVCache(batch_size={self.batch_size}, max_len={self.max_len}, capacity={self.capacity}, "
                f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, dtype={self.dtype}, "
                f"ring={self.ring}, lengths={self._host_lengths})")

    # -- ownership ---------------------------------------------------------------------
    def owner(self) -> object | None:
        """The layer this cache is bound to (:meth:`claim`), or None (not yet, or it is gone)."""
        return None if self._owner is None else self._owner()

    def claim(self, layer: object) -> None:
        """Bind the cache to ``layer``: the layer whose ``new_cache`` made it, or else the
        first layer that uses it. A cache holds one layer's K/V, so any other layer is refused.

        Raises:
            ValueError: the cache belongs to another (still living) layer; nothing changes.
        """
        owner = None if self._owner is None else self._owner()
        if owner is None:
            self._owner = weakref.ref(layer)
        elif owner is not layer:
            raise ValueError(
                f"cache belongs to another layer ({type(owner).__name__} at {id(owner):#x}, not this "
                f"{type(layer).__name__} at {id(layer):#x}): a cache holds one layer's K/V; "
                "give each layer its own cache from layer.new_cache(...)"
            )

    def __getstate__(self) -> dict:
        # A weak reference cannot be pickled: a saved and reloaded cache belongs to the
        # first layer that uses it. The fused step (C pointers into this cache's buffers,
        # meaningless in a copy) is made again at the copy's first fused step.
        return {**self.__dict__, "_owner": None, "fused": None}

    # -- state changes ---------------------------------------------------------------
    def reset(self) -> None:
        """Forget every token (buffers are not cleared: empty slots are never read)."""
        self.lengths.zero_()
        self.slot_pos.fill_(-1)
        self._host_lengths = [0] * self.batch_size

    def crop(self, n: int | Sequence[int]) -> None:
        """Roll back to ``n`` tokens per row (e.g. after rejected speculative tokens).

        Args:
            n: an int for every row, or one int per row; rows shorter than n keep
                their length.

        Raises:
            TypeError: n is not integral (a bool is not a length).
            ValueError: negative n, wrong count, or (ring cache) a roll-back further than
                the ring still holds.
        """
        given = _integral(n)  # any integral number (int, NumPy or 0-d tensor integers), as Python's indexing takes
        targets: list[object]
        if isinstance(given, Sequence | torch.Tensor) and not isinstance(given, str | bytes):
            targets = list(given)  # one per row
        else:
            targets = [given] * self.batch_size  # a non-integral scalar is refused by check_int
        if len(targets) != self.batch_size:
            raise ValueError(f"n must be an int or {self.batch_size} ints (one per row), got {len(targets)}")
        counts = [check_int("n", _integral(t), minimum=0, maximum=self.max_len) for t in targets]
        new = [min(t, length) for t, length in zip(counts, self._host_lengths)]
        if self.ring:
            w = self.window
            assert w is not None  # a ring cache has a window (checked in __init__)
            for b, (t, length) in enumerate(zip(new, self._host_lengths)):
                # Slots hold positions length-C .. length-1; the next query (at t) needs t-w+1 .. t-1.
                if 0 < t < length and max(0, t - w + 1) < max(0, length - self.capacity):
                    raise ValueError(
                        f"cannot crop row {b} from {length} to {t} tokens: a ring cache of {self.capacity} "
                        f"slots no longer holds the window before position {t}"
                    )
        self._cut(torch.tensor(new, dtype=torch.int64, device=self.device))
        self._host_lengths = new

    def crop_static(self, lengths: torch.Tensor) -> None:
        """Roll back to ``lengths`` (B,) int64 on the device, each at most the row's length: the
        undo of :meth:`append_static` by device operations alone (traced, no host read; the host
        mirror is read back at its next use). A linear cache only (a ring checks what it still
        holds on the host: :meth:`crop`).

        Raises:
            ValueError: a ring cache.
        """
        if self.ring:
            raise ValueError("crop_static rolls back a linear cache; a ring cache crops through crop()")
        self._cut(lengths)
        self._mirror = None  # read back from lengths at its next use (_host_lengths)

    def _cut(self, lengths: torch.Tensor) -> None:
        """Set the device counters to ``lengths`` (B,), no longer than they are: slots past them emptied."""
        self.slot_pos.masked_fill_(self.slot_pos >= lengths[:, None], -1)
        self.lengths.copy_(lengths)

    # -- appending: append (K/V written, what it overwrote saved), then commit or rollback --
    def check_append(self, batch: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                     device: torch.device, new_tokens: int) -> None:
        """Raise before anything is written if ``new_tokens`` can't be appended."""
        self._check_shapes(batch, num_kv_heads, head_dim, dtype, device)
        longest = max(self._host_lengths)
        if longest + new_tokens > self.max_len:
            raise ValueError(
                f"cache overflow: a row holds {longest} tokens, {new_tokens} more exceed max_len={self.max_len}"
            )

    def _check_shapes(self, batch: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                      device: torch.device) -> None:
        """Raise if new K/V of this batch, heads, width, dtype or device do not fit the buffers."""
        shape = self.k.shape  # (B, Hkv, C, D), read once (asked at every decoding step)
        if batch != shape[0]:
            raise ValueError(f"cache has batch_size {self.batch_size}, got a batch of {batch}")
        if (num_kv_heads, head_dim) != (shape[1], shape[3]):
            raise ValueError(
                f"cache holds {self.num_kv_heads} K/V heads of dim {self.head_dim}, "
                f"the layer has {num_kv_heads} of dim {head_dim}"
            )
        if dtype != self.k.dtype:
            raise TypeError(f"cache has dtype {self.dtype}, the layer computes in {dtype}")
        if device != self.k.device:
            raise ValueError(f"cache is on device {self.device}, the layer on {device}")

    def positions(self, new_tokens: int) -> torch.Tensor:
        """(B, Sn) absolute positions of the next ``new_tokens`` tokens of each row."""
        return self.lengths[:, None] + torch.arange(new_tokens, device=self.device)

    def append_static(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``/``v`` (B, Hkv, Sn, D) at each row's length and advance the counters, by
        device operations alone: the write ``torch.compile`` traces, one graph for every length.

        The reader attends over the whole buffers (B, Hkv, C, D) with a mask hiding the slots
        not yet written (as transformers' ``StaticCache`` and gpt-fast's cache are read), so no
        shape depends on a length. Nothing is read back to the host: the host mirror is left
        unset and read back once at its next use. A write past ``max_len`` fails the step's
        device assertion (a ``RuntimeError`` on the CPU, raised before anything is written).

        Raises:
            ValueError: a ring cache (slots are not positions there: use :meth:`append`); a batch,
                head count or width other than the buffers'.
            TypeError: a dtype other than the buffers'.
        """
        if self.ring:
            raise ValueError("append_static writes a linear cache's slots in order; a ring cache appends "
                             "through append()")
        b, hkv, sn, d = k.shape
        self._check_shapes(b, hkv, d, k.dtype, k.device)
        torch._assert_async((self.lengths + sn <= self.max_len).all(),
                            f"cache overflow: {sn} more tokens per row exceed max_len={self.max_len} "
                            "(nothing was written)")
        positions = self.positions(sn)  # (B, Sn)
        index = positions[:, None, :, None].expand(b, hkv, sn, d)  # (B, Hkv, Sn, D)
        self.k.scatter_(2, index, k.detach())
        self.v.scatter_(2, index, v.detach())
        self.slot_pos.scatter_(1, positions, positions)
        self.lengths.add_(sn)
        self._mirror = None  # read back from lengths at its next use (_host_lengths)

    def append(self, k: torch.Tensor, v: torch.Tensor, real: Sequence[int] | None, *,
               structure: Structure) -> Append:
        """Stage new K/V and return what the new queries attend to; counters unchanged.

        K/V are written into their slots (what those slots held is saved, so
        :meth:`rollback` restores the cache bitwise); a chunk that would wrap a ring is
        written only at :meth:`commit`. Nothing a reader sees changes until
        :meth:`commit`, the writer of ``lengths``, ``slot_pos`` and their host mirror (but
        for the eager fused decoding step, whose kernel advances them itself: :meth:`mirror_step`).

        Args:
            k, v: (B, Hkv, Sn, D) new keys (after RoPE) and values.
            real: per row, how many of the Sn tokens are real (right padding); None = all.
            structure: the layer's causal/window rule.

        Returns:
            an :class:`Append`: ``keys``/``values`` (B, Hkv, Sk, D), ``mask`` (B, 1, Sn, Sk)
            or None (None: pass the layer's causal/window to the attention core, every row
            having the same length and slots in order).
        """
        b, _, sn, _ = k.shape
        old = self._host_lengths
        counts = [sn] * b if real is None else list(real)
        positions = self.positions(sn)  # (B, Sn)
        valid = None if real is None else (torch.arange(sn, device=self.device)[None, :]
                                           < torch.tensor(counts, device=self.device)[:, None])  # (B, Sn)
        new_pos = positions if valid is None else torch.where(valid, positions, -1)  # padding never becomes a key
        if self.ring and sn > 1 and max(old) + sn > self.capacity:  # the chunk would wrap the ring
            return self._stage_ring_chunk(k, v, counts, positions, new_pos, structure)
        slots = positions % self.capacity if self.ring else positions  # (B, Sn)
        index = self._write_index(old, slots, sn)
        used = min(self.capacity, max(length + sn for length in old))
        mask = None
        if not self._plain_tail(old, sn, real is None, structure):
            key_pos = self.slot_pos[:, :used].scatter(1, slots.clamp(max=used - 1), new_pos)  # (B, Sk), staged
            mask = self._mask(positions, key_pos, structure)
        saved = (_read_slots(self.k, index), _read_slots(self.v, index))
        # Everything is allocated: the writes come last, and a failed V write undoes the K write.
        _write_slots(self.k, index, k.detach())
        try:
            _write_slots(self.v, index, v.detach())
        except BaseException:
            _write_slots(self.k, index, saved[0])
            raise
        keys, values = self.k[:, :, :used], self.v[:, :, :used]  # (B, Hkv, Sk, D)
        return Append(keys, values, mask, counts, slots, new_pos, index, saved,
                      structure=structure if mask is None else Structure())

    def _write_index(self, old: list[int], slots: torch.Tensor, sn: int) -> torch.Tensor | slice:
        """Where :meth:`append` writes: the slots' range along the sequence dimension where every
        row's Sn slots are the same consecutive ones (eager mode: a copy, 0.08× the time of a
        scatter at a 1,536-token prompt), else a (B, Hkv, Sn, D) scatter index of ``slots``."""
        start = old[0] % self.capacity if self.ring else old[0]
        if (not torch.compiler.is_compiling() and all(n == old[0] for n in old)
                and start + sn <= self.k.shape[2]):
            return slice(start, start + sn)
        b = slots.shape[0]
        return slots[:, None, :, None].expand(b, self.num_kv_heads, sn, self.head_dim)

    def _plain_tail(self, old: list[int], sn: int, all_real: bool, structure: Structure) -> bool:
        """The new queries see the cache in order, bottom-right aligned: no mask needed.

        Every row has the same length and no padding, and the slots are in position order:
        a linear cache, a ring that has not wrapped, or one token into a ring whose window
        spans it.
        """
        if not all_real or len(set(old)) != 1:
            return False
        window = structure.window
        return (not self.ring or old[0] + sn <= self.capacity
                or (sn == 1 and window is not None and window >= self.capacity))

    def _stage_ring_chunk(self, k: torch.Tensor, v: torch.Tensor, counts: list[int], positions: torch.Tensor,
                          new_pos: torch.Tensor, structure: Structure) -> Append:
        """A chunk that wraps the ring: its queries see (ring, chunk) in a temporary pair.

        Writing first could overwrite keys that the chunk's early queries still need;
        :meth:`commit` then keeps each row's last ``capacity`` real tokens.
        """
        keys = torch.cat((self.k, k.detach()), dim=2)  # (B, Hkv, C + Sn, D), temporary
        values = torch.cat((self.v, v.detach()), dim=2)
        key_pos = torch.cat((self.slot_pos, new_pos), dim=1)  # (B, C + Sn)
        mask = self._mask(positions, key_pos, structure)
        return Append(keys, values, mask, counts, None, new_pos, None, None, chunk=(k.detach(), v.detach()),
                      structure=Structure())

    @contextmanager
    def staged(self, k: torch.Tensor, v: torch.Tensor, real: Sequence[int] | None, *,
               structure: Structure) -> Iterator[Append]:
        """:meth:`append` for the block's attention, then :meth:`commit` if the block succeeds,
        or :meth:`rollback` if it raises (the cache is then bitwise as it was).

        Yields:
            the :class:`Append`: ``keys``/``values`` (B, Hkv, Sk, D), ``mask`` and ``structure``.
        """
        step = self.append(k, v, real, structure=structure)
        try:
            yield step
        except BaseException:
            self.rollback(step)
            raise
        self.commit(step)

    def commit(self, step: Append | Sequence[int]) -> None:
        """Advance the counters: their writer (with the fused step's kernel: :meth:`mirror_step`).

        Args:
            step: what :meth:`append` returned (after the attention that used it
                succeeded), or the number of tokens each row gained from a writer that
                wrote K/V in order itself (the native decoding step).
        """
        if isinstance(step, Append):
            counts = step.counts
            gained = torch.tensor(counts, dtype=torch.int64, device=self.device)  # (B,)
            if step.chunk is not None:
                self._write_ring_chunk(*step.chunk, step.counts)
            else:
                assert step.slots is not None  # an in-place append records its slots
                self.slot_pos.scatter_(1, step.slots, step.key_pos)
        else:
            counts = [operator.index(c) for c in step]
            if len(counts) != self.batch_size:
                raise ValueError(f"step must give {self.batch_size} counts (one per row), got {len(counts)}")
            if self.ring or any(c != 1 for c in counts):
                raise ValueError("commit(counts) takes one in-order token per row of a linear cache; "
                                 "other appends go through append()")
            if max(self._host_lengths) >= self.max_len:
                raise ValueError(f"commit(counts): a row already holds max_len={self.max_len} tokens "
                                 f"(lengths {self._host_lengths}); nothing was advanced")
            self._advance_one_per_row()
            return
        self.lengths.add_(gained)
        self._host_lengths = [length + c for length, c in zip(self._host_lengths, counts)]

    def native_counters(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(lengths (B,), slot_pos (B, C))``: the counters a native step bound to this cache
        (``fused``) may advance in its own call, one in-order token per row of a linear cache;
        the cache then mirrors them (:meth:`mirror_step`) or undoes the step (:meth:`undo_native_step`)."""
        return self.lengths, self.slot_pos

    def mirror_step(self, held: list[int], gained: int = 1) -> None:
        """The host mirror of the counters after a native decoding step that advanced the
        counters itself, in the same C call as :meth:`commit` would have
        (:class:`multihead.backends.native.StepPlan`): ``held`` (each row's length before
        it) plus ``gained`` (0 where the step was undone)."""
        self._host_lengths = [n + gained for n in held]

    def undo_native_step(self, held: list[int], saved: torch.Tensor) -> None:
        """Undo a native step that failed after running (an interrupt as it returned): if the
        device counters moved past ``held`` (each row's length before it), the slots it wrote
        get back ``saved`` (B, 2, Hkv, D), their old K and V, and the counters are put back.
        The cache is then bitwise as it was."""
        if self.lengths.tolist() != held:
            for b, n in enumerate(held):
                self.k[b, :, n] = saved[b, 0]
                self.v[b, :, n] = saved[b, 1]
                self.slot_pos[b, n] = -1  # a linear cache's slots past its length hold -1
            self.lengths.copy_(torch.tensor(held, dtype=self.lengths.dtype, device=self.device))
        self.mirror_step(held, gained=0)

    def reorder(self, rows: torch.Tensor) -> None:
        """Beam search: row b takes row ``rows[b]``'s tokens, in place (buffers and counters).

        Args:
            rows: (B,) integer indices of this cache's rows.

        Raises:
            ValueError: ``rows`` is not B indices in [0, B).
        """
        idx = torch.as_tensor(rows).to(self.device)
        if idx.dim() != 1 or idx.numel() != self.batch_size or idx.dtype.is_floating_point or idx.dtype == torch.bool:
            raise ValueError(f"rows must be {self.batch_size} integer row indices, got {list(idx.shape)} {idx.dtype}")
        order = idx.tolist()
        if min(order) < 0 or max(order) >= self.batch_size:
            raise ValueError(f"rows must index the cache's {self.batch_size} rows, got {order}")
        for buf in (self.k, self.v, self.slot_pos, self.lengths):
            buf.copy_(buf.index_select(0, idx))
        self._host_lengths = [self._host_lengths[i] for i in order]

    def _advance_one_per_row(self) -> None:
        """:meth:`commit` of one in-order token per row: ``slot_pos[b, L_b] = L_b``, ``L_b += 1``.
        In eager mode on the CPU one C call writes both (:func:`multihead.backends.native.advance_counters`;
        measured after a decoding step's kernel, caches cold: the commit 0.16-0.19 → 0.11-0.13 ms);
        else torch operations (fewer when every row has the same length)."""
        held = self._host_lengths
        eager = not torch.compiler.is_compiling()
        if not (eager and native.advance_counters(self.lengths, self.slot_pos)):  # else one C call wrote both
            if eager and all(n == held[0] for n in held):
                self.slot_pos[:, held[0]] = held[0]  # every row's next slot holds that position
            else:
                positions = self.positions(1)  # (B, 1)
                self.slot_pos.scatter_(1, positions, positions)
            self.lengths.add_(1)
        self._host_lengths = [n + 1 for n in held]

    def rollback(self, step: Append) -> None:
        """Undo :meth:`append`'s writes (the attention that used it failed): the cache is
        then bitwise what it was before."""
        if step.saved is not None:
            assert step.index is not None  # recorded together with saved
            _write_slots(self.k, step.index, step.saved[0])
            _write_slots(self.v, step.index, step.saved[1])

    def _write_ring_chunk(self, k: torch.Tensor, v: torch.Tensor, real: list[int]) -> None:
        """Keep each row's last C *real* tokens of a chunk (chunk index real_b - C + i for slot i)."""
        b, hkv, sn, d = k.shape
        c = self.capacity
        positions = self.positions(sn)  # (B, Sn)
        real_t = torch.tensor(real, dtype=torch.int64, device=self.device)
        idx = real_t[:, None] - c + torch.arange(c, device=self.device)  # (B, C)
        keep = idx >= 0  # rows with fewer than C real tokens keep their older ring entries
        pos = positions[:, :1] + idx  # (B, C) absolute positions
        slots = pos % c  # distinct within a row: C consecutive positions
        expand = lambda t: t[:, None, :, None].expand(b, hkv, c, d)  # noqa: E731
        # Every new value first, then the in-place writes: an allocation failure changes nothing.
        rows = [torch.where(keep[:, None, :, None], new.gather(2, expand(idx.clamp(min=0))),
                            buf.gather(2, expand(slots))) for buf, new in ((self.k, k), (self.v, v))]  # (B, Hkv, C, D)
        new_pos = torch.where(keep, pos, self.slot_pos.gather(1, slots))  # (B, C)
        self.k.scatter_(2, expand(slots), rows[0])
        self.v.scatter_(2, expand(slots), rows[1])
        self.slot_pos.scatter_(1, slots, new_pos)

    @staticmethod
    def _mask(q_pos: torch.Tensor, key_pos: torch.Tensor, structure: Structure) -> torch.Tensor:
        """(B, 1, Sn, Sk) bool: slot j holds a token (position ≥ 0) the query may see."""
        qp = q_pos[:, :, None]  # (B, Sn, 1)
        kp = key_pos[:, None, :]  # (B, 1, Sk)
        return ((kp >= 0) & structure.allows(qp, kp))[:, None]  # (B, 1, Sn, Sk)


def _read_slots(buf: torch.Tensor, index: torch.Tensor | slice) -> torch.Tensor:
    """(B, Hkv, Sn, D) copy of what ``buf`` (B, Hkv, C, D) holds at ``index`` (:meth:`KVCache._write_index`)."""
    return buf[:, :, index].clone() if isinstance(index, slice) else buf.gather(2, index)


def _write_slots(buf: torch.Tensor, index: torch.Tensor | slice, rows: torch.Tensor) -> None:
    """Write ``rows`` (B, Hkv, Sn, D) into ``buf`` (B, Hkv, C, D) at ``index``, in place."""
    if isinstance(index, slice):
        buf[:, :, index] = rows
    else:
        buf.scatter_(2, index, rows)


def _integral(value: object) -> object:
    """``operator.index(value)`` for integral numbers that are not bools; anything else as given
    (for :func:`check_int` to refuse by name)."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        return value
    try:
        return operator.index(value)  # type: ignore[arg-type]  # has __index__
    except TypeError:  # e.g. a tensor with more than one element
        return value


@dataclass
class Append:
    """What :meth:`KVCache.append` staged: the attention's inputs and how to commit or undo.

    Attributes:
        keys, values: (B, Hkv, Sk, D) what the new queries attend to.
        mask: (B, 1, Sn, Sk) bool, or None (use the layer's causal/window).
        counts: real new tokens per row.
        slots: (B, Sn) the slots written, or None (a ring chunk, written at commit).
        key_pos: (B, Sn) the new tokens' positions, -1 for padding.
        index: where the write went (a range of slots, or a scatter index); saved: (K, V) the slots
            held before.
        chunk: (K, V) of a ring chunk, written at commit.
        structure: the causal/window rule the attention applies: the layer's, or none when
            ``mask`` carries it.
    """

    keys: torch.Tensor
    values: torch.Tensor
    mask: torch.Tensor | None
    counts: list[int]
    slots: torch.Tensor | None
    key_pos: torch.Tensor
    index: torch.Tensor | slice | None
    saved: tuple[torch.Tensor, torch.Tensor] | None
    chunk: tuple[torch.Tensor, torch.Tensor] | None = None
    structure: Structure = Structure()
