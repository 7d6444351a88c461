"""Thread counts chosen by measurement: torch's threads or one, whichever runs faster now.

Notation: B batch, S tokens, E embed_dim.

torch's CPU products split their work evenly across torch's threads, so beside another busy
process a descheduled thread holds up every product, and one thread on the free core can be
faster. Measured on a 2-core AMD EPYC (Zen 3), a 0.5B Qwen3's 512-token prefill, patched:
idle 3.2 s on two threads and 5.4 s on one; beside one CPU-bound process 7.9 s on two threads
and 5.4 s on one.

* :class:`ThreadChooser` makes that choice from timings, call by call: after a warm-up call,
  one call on each count, the faster one kept, the other tried again after ``period`` calls
  or at once when the kept one slows down (the machine's load changed).
* :func:`auto_threads` applies it to a model's repeated blocks (a decoder's layers, an
  encoder's), each block call on the count its chooser gives, so that a ``generate`` or a
  forward pass adapts from its first layers on. The rest of the model (embeddings, the
  final norm, the LM head) runs on torch's setting.

A thread count changes the order of no sum in multihead's kernels, but torch's own products
can round differently at one thread and at two (``F.linear`` of 9 or 11 rows by a 384 x 384
weight on an AMD EPYC): under :func:`auto_threads` a model's outputs are those of a fixed count
within float rounding, and which count ran depends on the clock, so two runs can differ in
their last bits. In the tests greedy tokens equal a fixed count's.
"""

from __future__ import annotations

import time
from statistics import median
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["ThreadChooser", "AutoThreads", "auto_threads", "repeated_blocks"]


class ThreadChooser:
    """Call by call, ``most`` threads or one, whichever has run faster lately (seconds per token).

    After a first call (warm-up, not counted) it runs ``tries`` calls on ``most`` threads, then
    tries one thread: a try call no faster than the median of the choice's latest ``baseline``
    calls ends the try; ``tries`` faster ones in a row make the other count the choice. The other
    count is tried again after ``period`` calls on the choice, or at once when that median runs
    :attr:`SLOWER` times slower than when the choice was made (the machine's load changed).
    Calls are compared with the calls just before them, which should do about the same work per
    token (the next batch of length-sorted texts, the next layer of the same pass).

    Args:
        most: the threads to run on when the machine is free (torch's setting); 1: always one.
        period: calls on the choice before the other count is tried again (default :attr:`PERIOD`).
        tries: faster calls in a row that make the other count the choice.
        baseline: the choice's latest calls whose median a try is compared with (more than one
            for short calls, whose times jump now and then).

    Raises:
        ValueError: ``most``, ``period``, ``tries`` or ``baseline`` below 1.
    """

    PERIOD = 32
    SLOWER = 1.3

    def __init__(self, most: int, period: int = PERIOD, tries: int = 1, baseline: int = 1) -> None:
        for name, value in (("most", most), ("period", period), ("tries", tries), ("baseline", baseline)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.most, self.period, self.tries = most, period, tries
        self.choice = most
        self.reference: float | None = None  # the choice's median seconds per token when it was chosen
        self.recent: deque[float] = deque(maxlen=baseline)  # the choice's latest seconds per token
        self.tried: list[float] = []  # the current try's seconds per token, all faster than the choice's
        self.trying = False
        self.since = 0  # calls on the choice since it was chosen or last kept
        self.calls = 0

    def next(self) -> int:
        """The threads for the next call."""
        other = 1 if self.choice == self.most else self.most
        if self.most == 1 or self.calls == 0 or len(self.recent) < self.tries:
            return self.choice  # one thread only; the warm-up; the choice's first calls
        if self.trying:
            return other
        if self.reference is None or self.since >= self.period or median(self.recent) > self.SLOWER * self.reference:
            self.trying = True
            return other
        return self.choice

    def record(self, threads: int, seconds: float, tokens: int) -> None:
        """A call on ``tokens`` tokens took ``seconds`` on ``threads`` threads (as :meth:`next` said)."""
        self.calls += 1
        if self.calls == 1 or tokens < 1:
            return  # the warm-up call: first calls' costs
        rate = seconds / tokens
        if threads == self.choice:
            self.recent.append(rate)
            self.since += 1
            return
        kept = median(self.recent)
        if rate >= kept:  # the other count is no faster: keep the choice
            self.reference, self.since, self.trying, self.tried = kept, 0, False, []
            return
        self.tried.append(rate)
        if len(self.tried) == self.tries:  # faster every time: it becomes the choice
            self.choice, self.recent = threads, deque(self.tried, maxlen=self.recent.maxlen)
            self.reference, self.since, self.trying, self.tried = median(self.tried), 0, False, []


def repeated_blocks(model: nn.Module) -> list[list[nn.Module]]:
    """The outermost ``nn.ModuleList``\\ s of ``model`` whose two or more entries share one class
    (a decoder's layers; a vision tower's blocks beside them), each as a list of its modules.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: ``model`` holds no such list.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 1
             and len({type(block) for block in m}) == 1]
    inner = {id(sub) for outer in lists for block in outer for sub in block.modules()}
    found = [list(m) for m in lists if id(m) not in inner]
    if not found:
        raise ValueError(f"{type(model).__name__} holds no nn.ModuleList of two or more blocks of one class; "
                         "pass blocks=")
    return found


def _tokens(block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The tokens of a block call: its hidden states' (B, S, E) -> B * S (the first tensor argument)."""
    for value in (*args, kwargs.get("hidden_states"), *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return value.shape[:-1].numel()
    raise TypeError(f"auto_threads times a block call by its hidden states (B, S, E); {type(block).__name__} "
                    "was called without a tensor of two or more dimensions")


class AutoThreads:
    """While active (``with``), each call of the given blocks runs on torch's threads or on one,
    as a :class:`ThreadChooser` per group of blocks and per call size says.

    The calls are grouped by block list and by their token count's power of two (a prefill's
    layers apart from a decoding step's), and each group's chooser tries the other count again
    after four passes over its list. torch's thread setting is restored after each block call
    and when the ``with`` block ends. One caller at a time: the blocks' calls are timed one
    after another, not from several Python threads at once.

    Args:
        groups: lists of blocks whose calls do the same work per token (:func:`repeated_blocks`).

    Attributes:
        calls: block calls run on each thread count (``{threads: calls}``) while active.

    Raises:
        TypeError: a block that is not an ``nn.Module``.
        ValueError: no blocks; a block given twice or inside another.
    """

    #: The choosers' ``tries`` and ``baseline``: a decoding step's layer calls take a few
    #: milliseconds, vary by ±15% on a free machine and now and then take twice as long, too
    #: noisy for one call to decide.
    TRIES, BASELINE = 2, 5

    def __init__(self, groups: Sequence[Sequence[nn.Module]]) -> None:
        blocks = [block for group in groups for block in group]
        if not blocks:
            raise ValueError("auto_threads needs at least one block")
        for block in blocks:
            if not isinstance(block, nn.Module):
                raise TypeError(f"blocks must be torch.nn.Modules, got {type(block).__name__}")
        twice = [block for i, block in enumerate(blocks) if any(block is other for other in blocks[:i])]
        if twice:
            raise ValueError(f"blocks must be distinct modules; a {type(twice[0]).__name__} is given twice")
        given = {id(block) for block in blocks}
        for block in blocks:  # one call timed at a time: a block inside another would cut the outer's timing
            inner = next((sub for sub in block.modules() if sub is not block and id(sub) in given), None)
            if inner is not None:
                raise ValueError(f"blocks must not hold one another; a {type(inner).__name__} is inside a "
                                 f"{type(block).__name__}")
        self.groups = [list(group) for group in groups]
        self.calls: Counter[int] = Counter()
        self._choosers: dict[tuple[int, int], ThreadChooser] = {}
        self._handles: list[Any] = []
        self._open: tuple[tuple[int, int], int, int, float] | None = None  # key, threads, tokens, start
        self._most = 1

    def __enter__(self) -> AutoThreads:
        if self._handles:
            raise RuntimeError("this AutoThreads is already active")
        self._most = torch.get_num_threads()
        for index, group in enumerate(self.groups):
            for block in group:
                self._handles += [block.register_forward_pre_hook(self._pre_hook(index), with_kwargs=True),
                                  block.register_forward_hook(self._post_hook)]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._open = [], None
        torch.set_num_threads(self._most)

    def _pre_hook(self, index: int) -> Any:
        period = 4 * len(self.groups[index])

        @torch.compiler.disable  # real clocks and thread settings, never traced into a graph
        def hook(block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            tokens = _tokens(block, args, kwargs)
            key = (index, tokens.bit_length())
            chooser = self._choosers.setdefault(key, ThreadChooser(self._most, period, self.TRIES, self.BASELINE))
            threads = chooser.next()
            torch.set_num_threads(threads)
            self._open = (key, threads, tokens, time.perf_counter())

        return hook

    @torch.compiler.disable
    def _post_hook(self, block: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        assert self._open is not None  # set by this block's pre-hook: blocks never nest
        key, threads, tokens, start = self._open
        self._choosers[key].record(threads, time.perf_counter() - start, tokens)
        self.calls[threads] += 1
        self._open = None
        torch.set_num_threads(self._most)


def auto_threads(model: nn.Module, blocks: Iterable[nn.Module] | None = None) -> AutoThreads:
    """A context in which ``model``'s repeated blocks run each call on torch's threads or on one,
    whichever runs faster now (:class:`AutoThreads`).

    ``with mh.auto_threads(model): model.generate(...)``: beside a busy process the layers move
    to one thread after the first few calls; on a free machine they stay on torch's threads
    (one layer in about every four passes is tried on one thread: a cost of about 1/(4 x layers)
    of a pass, times how much slower one thread is).

    Args:
        model: the model whose blocks are timed.
        blocks: the blocks, all doing the same work per token; default :func:`repeated_blocks`.

    Returns:
        an :class:`AutoThreads`, active inside its ``with`` block (its ``calls`` counts them).

    Raises:
        TypeError: ``model`` or a block is not an ``nn.Module``.
        ValueError: no repeated blocks found, no blocks given, a block given twice, inside another or
            not inside ``model``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if blocks is None:
        return AutoThreads(repeated_blocks(model))
    given = list(blocks)
    inside = {id(m) for m in model.modules()}
    outside = [b for b in given if isinstance(b, nn.Module) and id(b) not in inside]
    if outside:
        raise ValueError(f"blocks must be modules of the model; a {type(outside[0]).__name__} is not "
                         f"inside this {type(model).__name__}")
    return AutoThreads([given])
