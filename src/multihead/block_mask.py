"""Block masks: a ``mask_mod`` (FlexAttention's signature) classified tile by tile.

Notation: B batch, H query heads, Sq queries, Sk keys; bq x bk the tile (block) size,
nQ = ceil(Sq / bq) query blocks, nK = ceil(Sk / bk) key blocks, Bm in {1, B} and
Hm in {1, H} the batch and head sizes a mask really has (1 where it does not depend on
them), P the number of partial tiles.

A ``mask_mod(b, h, q_idx, kv_idx) -> bool`` says whether query ``q_idx`` of head ``h`` of
batch row ``b`` may attend to key ``kv_idx`` (**True = may attend**, as everywhere in
multihead). It is evaluated on broadcast int64 index tensors, so mask_mods written with
tensor operations and tensor indexing work unchanged (``q_idx >= kv_idx``,
``document_id[q_idx] == document_id[kv_idx]``)::

    b (B, 1, 1, 1)   h (1, H, 1, 1)   q_idx (1, 1, Sq, 1)   kv_idx (1, 1, 1, Sk)

**Alignment**: ``q_idx`` is the query's *position on the key axis*, bottom-right aligned
as everywhere in multihead: query row i has ``q_idx = i + Sk - Sq``. With Sq == Sk it is
the row index, as in FlexAttention (whose ``q_idx`` is always the row index, top-left);
with a cache of Sk keys and Sq new queries it is each query's cache position, so
``q_idx >= kv_idx`` is the causal mask of decoding. With Sq > Sk the first Sq - Sk
queries have negative positions (a mask_mod that indexes a tensor with ``q_idx`` then
reads from its end: give such a call Sq <= Sk).

A :class:`BlockMask` holds the classification of every (query block, key block) tile,
the contract with the native kernels::

    tiles    int32 (Bm, Hm, nQ, nK):  EMPTY (-1)  no pair of the tile may attend: skipped
                                      FULL  (-2)  every in-range pair may attend: no mask
                                      p >= 0      partial: its mask is partial[p]
    partial  uint8 (P, bq, bk), contiguous: 1 = may attend; rows/cols past Sq/Sk are 0

Tiles at the ragged edge (the last query or key block) are classified on their in-range
part only. Building evaluates one block-row of queries at a time (memory
O(Bm · Hm · bq · Sk)) and classifies it with tensor reductions, never a loop over tiles.
A mask_mod that carries a :class:`multihead.masks.Structure` as its ``structure``
attribute (the built-in causal and sliding-window ones, :mod:`multihead.mask_mods`) is
classified from the structure's key spans instead (:meth:`BlockMask.from_structure`:
O(nQ · nK) plus the partial tiles' bytes, no pair evaluated); the two agree (tested).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ._checks import _broadcastable, check_int, check_tensor
from .masks import Structure

__all__ = ["MaskMod", "BlockMask", "EMPTY", "FULL", "DEFAULT_BLOCK_SIZE", "mask_mod_indices",
           "evaluate_mask_mod", "create_block_mask"]

#: ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor`` (FlexAttention's signature; see the module).
MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

#: A tile no (query, key) pair of which may attend.
EMPTY = -1
#: A tile every in-range (query, key) pair of which may attend.
FULL = -2
#: The tile size (bq = bk) when none is given, as FlexAttention's.
DEFAULT_BLOCK_SIZE = 128
#: The key block must be a multiple of this (the native kernels' vector loops).
KEY_BLOCK_MULTIPLE = 32
#: Pairs (query, key) a mask_mod is evaluated on per call at most when building a block mask
#: (4 Mi: 4 MiB of bools), unless one block-row alone has more.
GROUP_PAIRS = 1 << 22


def mask_mod_indices(batch: int, heads: int, sq: int, sk: int, *, rows: tuple[int, int] | None = None,
                     cols: tuple[int, int] | None = None, device: torch.device | str | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The broadcast int64 index tensors a mask_mod or score_mod is evaluated on.

    Args:
        batch, heads: B and H (1 where the mask is broadcast over that dim).
        sq, sk: Sq queries and Sk keys: ``q_idx`` holds the query positions
            ``i + sk - sq`` (bottom-right alignment, see the module).
        rows: only query rows ``[r0, r1)``; default all.
        cols: only keys ``[c0, c1)``; default all.
        device: where to build them.

    Returns:
        ``b (B, 1, 1, 1)``, ``h (1, H, 1, 1)``, ``q_idx (1, 1, R, 1)``, ``kv_idx (1, 1, 1, C)``
        with R = r1 - r0, C = c1 - c0.
    """
    r0, r1 = (0, sq) if rows is None else rows
    c0, c1 = (0, sk) if cols is None else cols
    b = torch.arange(batch, device=device).view(batch, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, heads, 1, 1)
    q_idx = (torch.arange(r0, r1, device=device) + (sk - sq)).view(1, 1, r1 - r0, 1)
    kv_idx = torch.arange(c0, c1, device=device).view(1, 1, 1, c1 - c0)
    return b, h, q_idx, kv_idx


def evaluate_mask_mod(mask_mod: MaskMod, batch: int, heads: int, sq: int, sk: int, *,
                      rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None,
                      device: torch.device | str | None = None) -> torch.Tensor:
    """``mask_mod`` on the index tensors of :func:`mask_mod_indices` (all its arguments), checked.

    Returns:
        bool (Bm, Hm, R, C), possibly an expanded view: Bm = 1 where the result does not
        depend on ``b`` (else B), Hm likewise for ``h``.

    Raises:
        TypeError: ``mask_mod`` is not callable or returns something else than a bool tensor.
        ValueError: its result does not broadcast to (B, H, R, C).
    """
    if not callable(mask_mod):
        raise TypeError(f"mask_mod must be a callable (b, h, q_idx, kv_idx) -> bool tensor, "
                        f"got {type(mask_mod).__name__}")
    b, h, q_idx, kv_idx = mask_mod_indices(batch, heads, sq, sk, rows=rows, cols=cols, device=device)
    n, c = q_idx.shape[2], kv_idx.shape[3]
    result = mask_mod(b, h, q_idx, kv_idx)
    if not isinstance(result, torch.Tensor) or result.dtype != torch.bool:
        got = f"dtype {result.dtype}" if isinstance(result, torch.Tensor) else type(result).__name__
        raise TypeError(f"mask_mod must return a bool tensor (True = may attend), got {got}")
    target = (batch, heads, n, c)
    if result.dim() > 4 or not _broadcastable(tuple(result.shape), target):
        raise ValueError(f"mask_mod must return a bool tensor broadcastable to (B, H, Sq, Sk) = {target} "
                         f"on the broadcast index tensors, got shape {tuple(result.shape)}")
    result = result[(None,) * (4 - result.dim())]  # (Bm|1, Hm|1, R|1, Sk|1)
    bm = batch if result.shape[0] == batch else 1
    hm = heads if result.shape[1] == heads else 1
    return result.expand(bm, hm, n, c)


def _within(mask_mod: object) -> Structure | None:
    """The :class:`~multihead.masks.Structure` ``mask_mod`` declares it never allows more than (its
    ``within`` attribute, e.g. :func:`multihead.mask_mods.and_masks`'), unless trivial; else None."""
    bound = getattr(mask_mod, "within", None)
    return bound if isinstance(bound, Structure) and not bound.trivial else None


def _block_size(block_size: object) -> tuple[int, int]:
    """(bq, bk) from an int or a pair, checked: bq >= 1, bk a positive multiple of 32."""
    if isinstance(block_size, Sequence) and not isinstance(block_size, str):
        if len(block_size) != 2:
            raise ValueError(f"block_size must be an int or a pair (bq, bk), got {block_size!r}")
        bq, bk = (check_int("block_size", n) for n in block_size)
    else:
        bq = bk = check_int("block_size", block_size)
    if bk % KEY_BLOCK_MULTIPLE:
        raise ValueError(f"block_size's key block (bk) must be a multiple of {KEY_BLOCK_MULTIPLE}, got {bk}")
    return bq, bk


#: Four bools whose bytes are all 1, as one int32 word (the classification reads bools 4 at a time).
_ALL_TRUE = int.from_bytes(b"\x01" * 4, "little")


def _words(tiles: torch.Tensor) -> torch.Tensor:
    """bool (..., w) as int32 (..., w / 4), 4 bools per word (a copy only where the view cannot be)."""
    try:
        return tiles.view(torch.int32)
    except RuntimeError:  # rows not 4-byte aligned in memory (a ragged Sk, a transposed mask, an offset)
        return tiles.clone(memory_format=torch.contiguous_format).view(torch.int32)


def _any_all(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(any, all) of bool (Bm, Hm, m, R, n, w) over R and w, each (Bm, Hm, m, n).

    Read as int32 words when w is a multiple of 4: a word is 0 when its 4 bools are False
    and :data:`_ALL_TRUE` (its largest value) when they are all True; its max and min are
    vectorised reductions, 4x fewer elements than bool ones (which are not, measured 30x
    slower per element). Reduced over the last dim first, then over the rows."""
    if tiles.shape[-1] % 4:
        return tiles.any(dim=-1).any(dim=-2), tiles.all(dim=-1).all(dim=-2)
    words = _words(tiles)  # (Bm, Hm, m, R, n, w / 4)
    anyv = words.amax(dim=-1).amax(dim=-2) > 0
    allv = words.amin(dim=-1).amin(dim=-2) == _ALL_TRUE
    return anyv, allv


def _classify_rows(block: torch.Tensor, bq: int, bk: int, first: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-rows' tiles, classified, and their partial tiles' masks.

    Args:
        block: bool (Bm, Hm, R, Sk): m whole block-rows (R = m·bq), or R < bq in-range query
            rows of one block-row (m = 1).
        first: the index in ``partial`` of the first partial tile.

    Returns:
        tiles int32 (Bm, Hm, m, nK) and partial uint8 (p, bq, bk), zero past R rows and Sk keys,
        numbered block-row by block-row, each over (Bm, Hm, nK) in order.
    """
    bm, hm, r, sk = block.shape
    m = r // bq if r % bq == 0 else 1
    rows = r // m
    whole, tail = divmod(sk, bk)
    parts = []  # (Bm, Hm, m, R', n, w): the key blocks of the rows, whole ones then the ragged one
    if whole:
        parts.append(block[..., :whole * bk].reshape(bm, hm, m, rows, whole, bk))
    if tail:
        parts.append(block[..., whole * bk:].reshape(bm, hm, m, rows, 1, tail))
    found = [_any_all(part) for part in parts]
    anyv = torch.cat([a for a, _ in found], dim=3)  # (Bm, Hm, m, nK)
    allv = torch.cat([a for _, a in found], dim=3)
    partial_here = (anyv & ~allv).permute(2, 0, 1, 3)  # (m, Bm, Hm, nK): numbering order
    order = torch.cumsum(partial_here.flatten(), 0).view_as(partial_here) - 1 + first
    tiles = torch.where(allv, FULL, torch.where(anyv, order.permute(1, 2, 0, 3), EMPTY)).to(torch.int32)
    masks = torch.zeros(int(partial_here.sum()), bq, bk, dtype=torch.uint8, device=block.device)
    start = 0
    for part in parts:
        n = part.shape[4]
        chosen = partial_here[..., start:start + n]  # (m, Bm, Hm, n)
        picked = part.permute(2, 0, 1, 4, 3, 5)[chosen]  # (p', R', w), in numbering order
        rank = order[..., start:start + n][chosen] - first  # (p',): each one's index in ``masks``
        masks[rank, :rows, :part.shape[5]] = picked.to(torch.uint8)
        start += n
    return tiles, masks


class BlockMask:
    """A mask classified in tiles of bq x bk (queries x keys): empty, full or partial.

    Build one with :meth:`from_mask_mod` (or :func:`create_block_mask`, FlexAttention's
    spelling) or :meth:`from_dense`, once per shape, and pass it to
    :func:`multihead.attention` as ``block_mask=``. The layout is the module's.

    Attributes:
        shape: (B, H, Sq, Sk) it was built for (1 for a broadcast B or H).
        block_size: (bq, bk).
        tiles: int32 (Bm, Hm, nQ, nK): :data:`EMPTY`, :data:`FULL` or an index into ``partial``.
        partial: uint8 (P, bq, bk), contiguous: each partial tile's mask (1 = may attend).
    """

    __slots__ = ("shape", "block_size", "tiles", "partial")

    def __init__(self, tiles: torch.Tensor, partial: torch.Tensor, shape: tuple[int, int, int, int],
                 block_size: tuple[int, int]) -> None:
        """Wrap a classification made elsewhere (the layout of the module, checked by size).

        Args:
            tiles: int32 (Bm, Hm, nQ, nK).
            partial: uint8 (P, bq, bk).
            shape: (B, H, Sq, Sk).
            block_size: (bq, bk).

        Raises:
            TypeError, ValueError: dtypes or sizes that do not fit the layout.
        """
        bq, bk = _block_size(block_size)
        b, h, sq, sk = (check_int(name, n, minimum=0) for name, n in zip(("B", "H", "Sq", "Sk"), shape))
        check_tensor("tiles", tiles, ndim=4)
        check_tensor("partial", partial, ndim=3)
        if tiles.dtype != torch.int32 or partial.dtype != torch.uint8:
            raise TypeError(f"tiles must be int32 and partial uint8, got {tiles.dtype} and {partial.dtype}")
        want = (-(-sq // bq), -(-sk // bk))
        if tiles.shape[0] not in (1, b) or tiles.shape[1] not in (1, h) or tuple(tiles.shape[2:]) != want:
            raise ValueError(f"tiles must have shape (1|{b}, 1|{h}, {want[0]}, {want[1]}), "
                             f"got {tuple(tiles.shape)}")
        if tuple(partial.shape[1:]) != (bq, bk):
            raise ValueError(f"partial must have shape (P, {bq}, {bk}), got {tuple(partial.shape)}")
        self.shape = (b, h, sq, sk)
        self.block_size = (bq, bk)
        self.tiles = tiles
        self.partial = partial.contiguous()

    @classmethod
    def from_mask_mod(cls, mask_mod: MaskMod, B: int | None, H: int | None, Sq: int, Sk: int,
                      block_size: int | tuple[int, int] = DEFAULT_BLOCK_SIZE,
                      device: torch.device | str | None = None) -> BlockMask:
        """Classify ``mask_mod`` over (B, H, Sq, Sk), one block-row of queries at a time.

        Args:
            mask_mod: ``(b, h, q_idx, kv_idx) -> bool tensor`` (see the module: ``q_idx`` is
                bottom-right aligned, ``i + Sk - Sq``).
            B, H: batch rows and heads; None = the mask does not depend on it (size 1).
            Sq, Sk: queries and keys.
            block_size: bq = bk, or (bq, bk); bk a multiple of 32.
            device: where to evaluate it and keep the result (default the CPU).

        A ``mask_mod`` with a :class:`~multihead.masks.Structure` as its ``structure``
        attribute is classified by :meth:`from_structure` (the same tiles, without evaluating it);
        one with a Structure as its ``within`` attribute (allowing no pair it forbids: an
        :func:`~multihead.mask_mods.and_masks` with a causal or window part) is evaluated only on
        the key blocks the structure reaches in each block-row, the others empty.

        Raises:
            TypeError, ValueError: bad sizes, or a mask_mod that does not return a bool
                tensor broadcastable to the block (:func:`evaluate_mask_mod`).
        """
        bq, bk = _block_size(block_size)
        b = 1 if B is None else check_int("B", B)
        h = 1 if H is None else check_int("H", H)
        sq, sk = check_int("Sq", Sq, minimum=0), check_int("Sk", Sk, minimum=0)
        structure = getattr(mask_mod, "structure", None)
        if isinstance(structure, Structure):
            return cls.from_structure(structure, b, h, sq, sk, (bq, bk), device)

        within = _within(mask_mod)

        def rows(r0: int, r1: int) -> tuple[torch.Tensor | None, int]:
            c0, c1 = 0, sk
            if within is not None:  # the key blocks the structure reaches from these rows
                lo, hi = within.key_range(r0 + sk - sq, r1 + sk - sq, sk)
                if hi <= lo:
                    return None, 0
                c0, c1 = lo // bk * bk, min(sk, -(-hi // bk) * bk)
            return evaluate_mask_mod(mask_mod, b, h, sq, sk, rows=(r0, r1), cols=(c0, c1), device=device), c0 // bk
        # Block-rows evaluated together up to GROUP_PAIRS pairs a call (one at a time where a structure
        # narrows each one's keys).
        group = 1 if within is not None else max(1, GROUP_PAIRS // max(1, bq * sk * b * h))
        return cls._classify(rows, (b, h, sq, sk), (bq, bk), device, group)

    @classmethod
    def from_structure(cls, structure: Structure, B: int | None, H: int | None, Sq: int, Sk: int,
                       block_size: int | tuple[int, int] = DEFAULT_BLOCK_SIZE,
                       device: torch.device | str | None = None) -> BlockMask:
        """Classify a causal / sliding-window :class:`~multihead.masks.Structure` (bottom-right
        aligned) from its key spans: a tile is full when its last row's span starts at or before
        the tile's first key and its first row's span ends at or after its last (spans only grow
        with the position), empty when the hull of its rows' spans (:meth:`Structure.key_range`)
        misses it; only partial tiles' bytes are computed (``Structure.allows``).

        Args:
            structure: the rule. B, H: as :meth:`from_mask_mod` (the mask depends on neither).
            Sq, Sk: queries and keys. block_size: bq = bk, or (bq, bk). device: where to build it.
        """
        bq, bk = _block_size(block_size)
        b = 1 if B is None else check_int("B", B)
        h = 1 if H is None else check_int("H", H)
        sq, sk = check_int("Sq", Sq, minimum=0), check_int("Sk", Sk, minimum=0)
        n_q, n_k = -(-sq // bq), -(-sk // bk)
        spans = []  # per block-row: the hull of its spans, its first row's end, its last row's start
        for r0 in range(0, sq, bq):
            p0, p1 = r0 + sk - sq, min(sq, r0 + bq) + sk - sq  # positions of rows r0 .. r1-1
            lo, hi = structure.key_range(p0, p1, sk)
            spans.append((lo, hi, structure.span(p0, sk)[1], structure.span(p1 - 1, sk)[0]))
        lo_t, hi_t, first_hi, last_lo = torch.tensor(spans, dtype=torch.int64).reshape(n_q, 4).T[:, :, None]
        k0 = torch.arange(n_k)[None, :] * bk  # (1, nK): each tile's keys [k0, k1)
        k1 = torch.clamp(k0 + bk, max=sk)
        anyv = (lo_t < hi_t) & (k0 < hi_t) & (lo_t < k1)  # (nQ, nK)
        allv = (last_lo <= k0) & (first_hi >= k1)
        partial_here = anyv & ~allv
        order = torch.cumsum(partial_here.flatten(), 0).view_as(partial_here) - 1
        tiles = torch.where(allv, FULL, torch.where(anyv, order, EMPTY)).to(torch.int32)[None, None]
        qb, kb = partial_here.nonzero(as_tuple=True)  # (P,) each, row-major: the order of ``order``
        rows = qb[:, None, None] * bq + torch.arange(bq)[None, :, None]  # (P, bq, 1)
        cols = kb[:, None, None] * bk + torch.arange(bk)[None, None, :]  # (P, 1, bk)
        allowed = structure.allows(rows + (sk - sq), cols) & (rows < sq) & (cols < sk)  # (P, bq, bk)
        return cls(tiles.to(device), allowed.to(torch.uint8).to(device), (b, h, sq, sk), (bq, bk))

    @classmethod
    def from_dense(cls, mask: torch.Tensor, block_size: int | tuple[int, int] = DEFAULT_BLOCK_SIZE) -> BlockMask:
        """Classify a dense mask.

        Args:
            mask: bool (B|1, H|1, Sq, Sk), True = may attend.
            block_size: bq = bk, or (bq, bk); bk a multiple of 32.

        Raises:
            TypeError: not a bool tensor. ValueError: not 4-D, or a bad block size.
        """
        check_tensor("mask", mask, ndim=4)
        if mask.dtype != torch.bool:
            raise TypeError(f"mask must be a bool tensor (True = may attend), got dtype {mask.dtype}")
        size = _block_size(block_size)
        b, h, sq, sk = mask.shape
        return cls._classify(lambda r0, r1: (mask[:, :, r0:r1], 0), (b, h, sq, sk), size, mask.device)

    @classmethod
    def _classify(cls, rows: Callable[[int, int], tuple[torch.Tensor | None, int]],
                  shape: tuple[int, int, int, int], block_size: tuple[int, int],
                  device: torch.device | str | None, group: int = 1) -> BlockMask:
        """The block mask of what ``rows(r0, r1)`` gives for up to ``group`` whole block-rows at a
        time (or the last, ragged one alone): (bool (Bm, Hm, r1 - r0, C), the key block it starts
        at), the keys outside it empty; or (None, 0): every tile empty. Fewer, larger calls cost
        less per pair (a plain lambda at S = 8192: 64 calls of 128 rows took 1.4x the time of 16
        of 512; Intel Xeon, 2 threads)."""
        bq, bk = block_size
        _, _, sq, sk = shape
        n_k = -(-sk // bk)
        tiles, partial, count, r0 = [], [], 0, 0
        while r0 < sq:
            whole = min(group, (sq - r0) // bq)
            r1 = r0 + whole * bq if whole else sq
            block, first = rows(r0, r1)
            m = -(-(r1 - r0) // bq)
            if block is None:
                row_tiles = torch.full((1, 1, m, n_k), EMPTY, dtype=torch.int32, device=device)
                masks = torch.empty(0, bq, bk, dtype=torch.uint8, device=device)
            else:
                reached, masks = _classify_rows(block, bq, bk, count)  # (Bm, Hm, m, n): key blocks first..
                row_tiles = torch.full((*reached.shape[:3], n_k), EMPTY, dtype=torch.int32, device=device)
                row_tiles[..., first:first + reached.shape[3]] = reached
            tiles.append(row_tiles)
            partial.append(masks)
            count += masks.shape[0]
            r0 = r1
        if not tiles:  # no queries
            tiles_t = torch.empty(1, 1, 0, n_k, dtype=torch.int32, device=device)
            partial_t = torch.empty(0, bq, bk, dtype=torch.uint8, device=device)
        else:
            bm, hm = max(t.shape[0] for t in tiles), max(t.shape[1] for t in tiles)
            tiles_t = torch.cat([t.expand(bm, hm, *t.shape[2:]) for t in tiles], dim=2)  # (Bm, Hm, nQ, nK)
            partial_t = torch.cat(partial)  # (P, bq, bk)
        return cls(tiles_t, partial_t, shape, block_size)

    def dense(self) -> torch.Tensor:
        """bool (Bm, Hm, Sq, Sk): the mask the tiles describe (the inverse of :meth:`from_dense`)."""
        bm, hm, n_q, n_k = self.tiles.shape
        bq, bk = self.block_size
        _, _, sq, sk = self.shape
        full = (self.tiles == FULL)[..., None, None].expand(bm, hm, n_q, n_k, bq, bk)
        out = full.to(torch.uint8).clone()  # (Bm, Hm, nQ, nK, bq, bk)
        where = self.tiles >= 0
        out[where] = self.partial[self.tiles[where].long()]
        grid = out.permute(0, 1, 2, 4, 3, 5).reshape(bm, hm, n_q * bq, n_k * bk)  # (Bm, Hm, nQ·bq, nK·bk)
        return grid[:, :, :sq, :sk].bool()

    def counts(self) -> tuple[int, int, int]:
        """(empty, full, partial): how many tiles of ``tiles`` are of each kind."""
        empty = int((self.tiles == EMPTY).sum())
        full = int((self.tiles == FULL).sum())
        return empty, full, self.tiles.numel() - empty - full

    def sparsity(self) -> float:
        """The fraction of tiles that are empty (0.0 for a mask without tiles)."""
        return self.counts()[0] / self.tiles.numel() if self.tiles.numel() else 0.0

    def __and__(self, other: object) -> BlockMask:
        """The intersection with another BlockMask or a bool mask broadcastable to (B, H, Sq, Sk),
        re-classified tile by tile in this one's tiles: an empty tile stays empty, a full one takes
        the other's, only tiles partial on either side are and-ed byte by byte (a dense mask is
        classified first, one pass over it; a BlockMask of other tiles through its dense form).

        Raises:
            TypeError: ``other`` is neither. ValueError: its Sq, Sk differ, or it does not broadcast.
        """
        if isinstance(other, BlockMask):
            if other.shape[2:] != self.shape[2:]:
                raise ValueError(f"other must have (Sq, Sk) = {self.shape[2:]} like this BlockMask, "
                                 f"got {other.shape[2:]}")
            blocks = other if other.block_size == self.block_size else BlockMask.from_dense(other.dense(),
                                                                                            self.block_size)
        elif isinstance(other, torch.Tensor) and other.dtype == torch.bool:
            blocks = BlockMask.from_dense(self._broadcast(other), self.block_size)
        else:
            return NotImplemented
        for i, name in ((0, "B"), (1, "H")):
            if 1 not in (self.shape[i], blocks.shape[i]) and self.shape[i] != blocks.shape[i]:
                raise ValueError(f"other must have {name} = 1 or {self.shape[i]} like this BlockMask, "
                                 f"got {blocks.shape[i]}")
        return self._intersect(blocks)

    def _broadcast(self, mask: torch.Tensor) -> torch.Tensor:
        """A bool mask broadcastable to (B, H, Sq, Sk) (B, H may differ where this one has 1) as a
        (B'|1, H'|1, Sq, Sk) view."""
        _, _, sq, sk = self.shape
        if mask.dim() > 4 or not _broadcastable(tuple(mask.shape[-2:]), (sq, sk)):
            raise ValueError(f"other must broadcast to (B, H, Sq, Sk) = {self.shape}, got {tuple(mask.shape)}")
        mask = mask[(None,) * (4 - mask.dim())]
        return mask.expand(mask.shape[0], mask.shape[1], sq, sk)

    def _in_range(self, qb: torch.Tensor, kb: torch.Tensor) -> torch.Tensor:
        """uint8 (n, bq, bk): 1 on the pairs of tiles (qb, kb) (each (n,)) inside [0, Sq) x [0, Sk)."""
        bq, bk = self.block_size
        rows = qb[:, None, None] * bq + torch.arange(bq, device=qb.device)[None, :, None] < self.shape[2]
        cols = kb[:, None, None] * bk + torch.arange(bk, device=kb.device)[None, None, :] < self.shape[3]
        return (rows & cols).to(torch.uint8)  # (n, bq, bk)

    def _tile_bytes(self, kinds: torch.Tensor, in_range: torch.Tensor) -> torch.Tensor:
        """uint8 (n, bq, bk): the bytes of n non-empty tiles of classes ``kinds`` (n,)."""
        pick = torch.where(kinds >= 0, kinds, 0).long()
        found = self.partial[pick] if self.partial.shape[0] else torch.zeros_like(in_range)
        return torch.where((kinds == FULL)[:, None, None], in_range, found)

    def _intersect(self, other: BlockMask) -> BlockMask:
        """This block mask and-ed with ``other`` of the same (Sq, Sk) and tile size."""
        bm, hm = max(self.tiles.shape[0], other.tiles.shape[0]), max(self.tiles.shape[1], other.tiles.shape[1])
        n_q, n_k = self.tiles.shape[2:]
        mine, theirs = (t.tiles.expand(bm, hm, n_q, n_k) for t in (self, other))
        empty = (mine == EMPTY) | (theirs == EMPTY)
        full = (mine == FULL) & (theirs == FULL)
        where = (~empty & ~full).nonzero(as_tuple=True)  # tiles partial on either side, row-major
        in_range = self._in_range(where[2], where[3])  # (n, bq, bk)
        both = self._tile_bytes(mine[where], in_range) & other._tile_bytes(theirs[where], in_range)
        anyv = both.flatten(1).amax(1) > 0 if both.shape[0] else torch.zeros(0, dtype=torch.bool)
        allv = (both == in_range).flatten(1).all(1)
        keep = anyv & ~allv
        rank = (torch.cumsum(keep, 0) - 1).to(torch.int32)
        tiles = torch.where(full, FULL, EMPTY).to(torch.int32)  # (Bm, Hm, nQ, nK)
        tiles[where] = torch.where(allv, FULL, torch.where(anyv, rank, EMPTY)).to(torch.int32)
        shape = (max(self.shape[0], other.shape[0]), max(self.shape[1], other.shape[1]), self.shape[2], self.shape[3])
        return BlockMask(tiles, both[keep].contiguous(), shape, self.block_size)

    __rand__ = __and__

    def __repr__(self) -> str:
        empty, full, partial = self.counts()
        head = (f"BlockMask(shape={self.shape}, block_size={self.block_size}, sparsity={100 * self.sparsity():.2f}%, "
                f"empty={empty}, full={full}, partial={partial}")
        n_q, n_k = self.tiles.shape[2:]
        if not 0 < n_q <= 32 or not 0 < n_k <= 32:
            return head + ")"
        marks = {EMPTY: " ", FULL: "█"}
        grid = ["".join(marks.get(t, "░") for t in row) for row in self.tiles[0, 0].tolist()]
        return head + ",\n(0, 0)  █ full, ░ partial\n" + "\n".join(grid) + "\n)"


def create_block_mask(mask_mod: MaskMod, B: int | None, H: int | None, Q_LEN: int, KV_LEN: int,
                      block_size: int | tuple[int, int] = DEFAULT_BLOCK_SIZE,
                      device: torch.device | str | None = None) -> BlockMask:
    """:meth:`BlockMask.from_mask_mod` with FlexAttention's argument names
    (``torch.nn.attention.flex_attention.create_block_mask``; ``q_idx`` bottom-right aligned).

    Args:
        mask_mod: ``(b, h, q_idx, kv_idx) -> bool tensor``.
        B, H: batch rows and heads, or None (broadcast).
        Q_LEN, KV_LEN: Sq and Sk.
        block_size: bq = bk, or (bq, bk).
        device: where to evaluate it.
    """
    return BlockMask.from_mask_mod(mask_mod, B, H, Q_LEN, KV_LEN, block_size, device)
