"""Where each micro-batch's count comes from, chosen once per step (:func:`choose`).

The count rule (:class:`~mbs_ext.counts.normalize.Rule`) says *what* a micro-batch counts
(its rows, 1, its loss items); a source says *how* the count is taken:

* :class:`Fixed` - ``"samples"`` (the rows), ``"micro_batches"`` and ``"sum"`` (1 each):
  known before the first micro-batch, nothing to take.
* :class:`Ahead` - every count at once before streaming: read from host targets by the
  rule's ``per_row`` (an ``nn`` loss's class targets, a few vectorized operations), or
  counted micro-batch by micro-batch ahead of the pass where the ranks must agree on the
  total first (FSDP2, :mod:`mbs_ext.world.shards`).
* :class:`Called` - the rule is called on each micro-batch as it streams (a user's count
  callable, targets on the device): a host number checked at once, or a device tensor
  checked on the device when the step settles (no read).

The :class:`~mbs_ext.counts.normalize.Normalizer` only asks a source for the next count and,
where it has one, the total ahead.
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Callable
from typing import Any

import torch

from mbs_ext.streaming.batch import row_slices

Count = float | torch.Tensor  # a host number, or a 0-dim float64 tensor on the device

INVALID_COUNT = "normalize count must be a non-negative finite number"


def check_count(value: Any, source: str = "the normalize callable") -> float:
    """A host count: a non-negative finite number (a weight or an integer count)."""
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{INVALID_COUNT} (an int, float or 0-dim tensor); {source} returned "
            f"{type(value).__name__} {value!r}"
        )
    v = float(value)
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"{INVALID_COUNT}; {source} returned {value!r}")
    return v


class Fixed:
    """A rule whose counts need no data: the rows, or 1 per micro-batch."""

    def __init__(self, kind: str, rows: int, num_micro_batches: int) -> None:
        self.kind = kind
        self._total = {"samples": float(rows), "micro_batches": float(num_micro_batches), "sum": 1.0}[kind]

    def take(self, micro_batch: Any, rows: tuple[int, int]) -> Count:
        return float(rows[1] - rows[0]) if self.kind == "samples" else 1.0

    def total(self) -> Count | None:
        return self._total


class Ahead:
    """Every count, taken before the first micro-batch."""

    def __init__(self, counts: list[Count]) -> None:
        self.counts = counts
        self._next = 0

    def take(self, micro_batch: Any, rows: tuple[int, int]) -> Count:
        c = self.counts[self._next]
        self._next += 1
        return c

    def total(self) -> Count | None:
        total = local_total(self.counts)
        if isinstance(total, torch.Tensor):
            return total
        return total or 1.0  # zero: every micro-batch is skipped, the check fails


class Called:
    """The rule called on each micro-batch as it streams."""

    def __init__(self, count: Callable[[Any], Any], source: str, device: torch.device) -> None:
        self.count, self.source, self.device = count, source, device

    def take(self, micro_batch: Any, rows: tuple[int, int]) -> Count:
        """Checked on the host, or a device tensor checked when the step settles (on the device)."""
        value = self.count(micro_batch)
        if not isinstance(value, torch.Tensor):
            return check_count(value, self.source)
        if value.numel() != 1:
            raise ValueError(f"{INVALID_COUNT}; {self.source} returned a tensor of shape {tuple(value.shape)}")
        if value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{INVALID_COUNT}; {self.source} returned a tensor of dtype {value.dtype}")
        c = value.detach().reshape(()).to(torch.float64)
        if c.device.type == "cpu" and self.device.type != "cpu":
            return check_count(c, self.source)  # read on the host: a copy to the device would block
        return c.to(self.device)

    def total(self) -> Count | None:
        return None


Source = Fixed | Ahead | Called


def choose(rule: Any, targets: torch.Tensor | None, indices: torch.Tensor | None, sizes: list[int],
           device: torch.device) -> Source:
    """The source of a step's counts."""
    if rule.kind != "count":
        return Fixed(rule.kind, sum(sizes), len(sizes))
    ahead = counts_ahead(rule, targets, indices, sizes)
    return Called(rule.count, rule.source, device) if ahead is None else Ahead(ahead)


def counts_ahead(rule: Any, targets: torch.Tensor | None, indices: torch.Tensor | None,
                 sizes: list[int]) -> list[float] | None:
    """Every micro-batch's count from host targets (their rows at ``indices`` in dataset mode):
    a few vectorized operations (one ``aminmax`` when no target can be ignored), no device
    work. None when the counts must be taken per micro-batch (a user's count callable,
    targets on a device)."""
    if rule.per_row is None or targets is None or targets.device.type != "cpu":
        return None
    rows = rule.per_row(targets if indices is None else targets.index_select(0, indices))
    if rows is None:
        return None
    if isinstance(rows, int):  # every row counts the same: whole numbers, nothing to validate
        return [float(rows * size) for size in sizes]
    if rows.is_floating_point():  # class weights: each micro-batch's own sum
        counts = torch.stack([part.sum() for part in rows.split(sizes)]).tolist()
    else:  # whole targets: running totals at the micro-batch ends are exact
        ends = list(itertools.accumulate(sizes))
        running = [0, *rows.cumsum(0)[torch.tensor(ends) - 1].tolist()]
        counts = [float(b - a) for a, b in zip(running, running[1:])]
    return [check_count(c, rule.source) for c in counts]


def local_total(counts: list[Count]) -> Count:
    """The sum of host and device counts (a device tensor where any count is one)."""
    on_device = [c for c in counts if isinstance(c, torch.Tensor)]
    if not on_device:  # the usual case: every count on the host
        return float(sum(counts))
    host = float(sum(c for c in counts if not isinstance(c, torch.Tensor)))
    total = torch.stack(on_device).sum()
    return total + host if host else total


def ahead(rule: Any, batch: Any, info: Any, sizes: list[int], device: torch.device) -> Ahead:
    """Every count of a rank's micro-batches, taken before the first one (an agreement across
    ranks needs this rank's total)."""
    source = choose(rule, info.targets, info.indices, sizes, device)
    if isinstance(source, Ahead):
        return source
    called = isinstance(source, Called)
    return Ahead([source.take(mb, rows) for mb, rows in row_slices(batch, sizes, info.indices, needed=called)])
