"""Every count rule, and the Normalizer that weighs micro-batches by their counts.

A rule gives each micro-batch a *count* ``c_i``; the mini-batch loss is
``sum_i c_i * loss_i / D``. For a mean (``"samples"``, a count callable, a ``torch.nn``
loss with class weights or ignored targets) ``D = sum_i c_i`` over every micro-batch of
every rank, so the result is the mean over all items of the mini-batch whatever the
split. For a sum (``"sum"``, ``reduction="sum"``) ``c_i = 1`` and ``D = 1``.
``"micro_batches"`` (``c_i = 1``, ``D = M``) is the rule of the micro-batch streaming
papers, kept for comparison: it is wrong whenever micro-batches differ in size.

Where the counts come from is chosen once per step (:mod:`mbs_ext.counts.sources`). ``D`` is
exact from the first micro-batch when the world knows it ahead (:meth:`Normalizer.fix`);
otherwise a provisional denominator of the right magnitude (first count times M) weights
the micro-batches, and what they accumulated is rescaled once the total is known
(:meth:`Normalizer.settle`, the one place totals are settled). Device counts are
validated on the device and read in the step's one host sync (:meth:`Normalizer.check`);
nothing here reads a device value or talks to other ranks.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mbs_ext.counts import sources
from mbs_ext.counts.ledger import Ledger
from mbs_ext.counts.sources import INVALID_COUNT, Count, Source


@dataclass(frozen=True)
class Rule:
    """``kind`` is "samples", "micro_batches", "sum" or "count" (``count(micro_batch)``)."""

    kind: str
    count: Callable[[Any], Any] | None = None
    source: str = ""  # what the rule was read from, for messages
    # For counts read from an nn loss's targets: each row's part of the count, so that the
    # counts of all micro-batches can be taken at once from host targets (counts_ahead).
    per_row: Callable[[torch.Tensor], torch.Tensor | int | None] | None = None


def rule_of(normalize: Any) -> Rule:
    """The rule an already validated ``normalize`` option names (None means "samples")."""
    if normalize is None:
        return Rule("samples")
    if isinstance(normalize, str):
        return Rule(normalize)
    return Rule("count", normalize, "the normalize callable")


class Normalizer:
    """Counts, weights and totals of one step over ``num_micro_batches`` local micro-batches.

    Per micro-batch it only hands the count and the detached loss to the step's
    :class:`~mbs_ext.counts.ledger.Ledger` (a fixed block of slots, folded on the device as it
    fills): what a step keeps does not grow with its
    micro-batches, and nothing is read from a device before the step's one sync.
    """

    def __init__(self, rule: Rule, source: Source, *, num_micro_batches: int, device: torch.device,
                 alone: bool = False) -> None:
        self.rule, self.source = rule, source
        self.alone = alone  # no other rank weighs this one's counts
        self.num_mb = num_micro_batches
        self.device = device
        self.is_sum = rule.kind == "sum"
        self.ledger = Ledger(device, num_micro_batches)
        # Each micro-batch's (start, stop) positions, for messages: two machine ints per
        # micro-batch in one array made here, not a tuple of Python ints appended per micro-batch
        # (about 100 bytes each, made while the micro-batch's activations are live).
        self.rows_of = array("q", bytes(16 * num_micro_batches))
        self.taken = 0  # micro-batches counted so far
        # How messages name the rows at positions [start, stop): the split's own words (the step
        # sets them; under a token split positions are not row numbers).
        self.describe_rows: Callable[[int, int], str] = lambda start, stop: f"rows [{start}, {stop})"
        self.loss_sum: torch.Tensor | None = None  # set by settle (global across ranks)
        self.factor = 1.0  # what the loss sum read is multiplied by (the ledger's, in one process)
        self.total: Count | None = None  # the global D, once settled
        self.settled = False
        # Whether any rank had an invalid device count (across ranks): a device value until the
        # finish reads it. This rank's own mark is the ledger's ``invalid_at``.
        self.invalid_anywhere: torch.Tensor | float = 0.0
        self.denom: Count | None = 1.0 if self.is_sum else source.total()
        self.exact = self.is_sum  # every weight is final from the first micro-batch

    def fix(self, total: Count) -> None:
        """The total over every rank, known before the first micro-batch: every weight is exact."""
        if not self.is_sum:
            self.denom = total
        self.exact = True

    def count(self, micro_batch: Any, rows: tuple[int, int]) -> Count:
        """The count of the next micro-batch (rows ``[start, stop)``); sets the provisional denominator."""
        k, self.taken = self.taken, self.taken + 1
        if 2 * k + 2 > len(self.rows_of):  # more micro-batches than planned: room for as many again
            self.rows_of.extend([0] * (len(self.rows_of) + 2))
        self.rows_of[2 * k], self.rows_of[2 * k + 1] = rows
        c = self.source.take(micro_batch, rows)
        self.ledger.count(k, c)
        if self.denom is None and self.alone and self.num_mb == 1:
            # One micro-batch and no other rank: its count is the total, its weight exactly 1. A
            # count of 0 divides by 1 instead (weight 0, not 0/0), and check() fails the step, as a
            # zero total does at any split.
            self.fix(torch.where(c > 0, c, 1.0) if isinstance(c, torch.Tensor) else c or 1.0)
        elif self.denom is None:
            self.denom = c.clamp(min=1.0) * self.num_mb if isinstance(c, torch.Tensor) else max(c, 1.0) * self.num_mb
        return c

    def add_loss(self, loss: torch.Tensor, c: Count) -> None:
        """Record the micro-batch's loss; it counts ``c`` times in the mini-batch loss."""
        self.ledger.loss(loss)

    def weight(self, c: Count) -> Count:
        """The gradient weight of a micro-batch before the total is known (``c / provisional D``)."""
        return c / self.denom

    def final_weight(self, c: Count) -> Count:
        """The exact weight of a micro-batch after :meth:`settle`."""
        return c / self.total

    @property
    def invalid_at(self) -> torch.Tensor | float:
        """1 + the position of this rank's first invalid device count (0: none), on the device."""
        return self.ledger.invalid_at

    def local_values(self) -> tuple[Count, torch.Tensor, Count]:
        """This rank's part of the step's collective: its total count, its ``sum_i c_i * loss_i``
        and whether one of its device counts is invalid (all on the device, no read)."""
        total, loss_sum = self.ledger.totals()
        if self.ledger.factor != 1.0:  # the ranks add products, not a lone loss and its count
            loss_sum = loss_sum.to(torch.float64) * self.ledger.factor
        invalid_at = self.ledger.invalid_at
        flag = (invalid_at > 0).to(torch.float64) if isinstance(invalid_at, torch.Tensor) else float(invalid_at > 0)
        return (1.0 if self.is_sum else total), loss_sum, flag

    def settle(self, shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
        """The totals: this process's own, or ``shared`` - the ranks' sums of :meth:`local_values`."""
        if shared is None:
            total, self.loss_sum = self.ledger.totals()
            self.factor = self.ledger.factor
        else:
            total, self.loss_sum, self.invalid_anywhere = shared
        self.total = 1.0 if self.is_sum else total
        self.settled = True

    def rescale_factor(self) -> Count:
        """What to multiply provisionally weighted sums by: ``D_provisional / D`` (the sums of all
        ranks are added up, not averaged)."""
        if isinstance(self.total, torch.Tensor) or isinstance(self.denom, torch.Tensor) or self.total != 0:
            return self.denom / self.total
        return 1.0  # a zero host total: check() fails the step

    def device_values(self) -> list[Count]:
        """To read on the host for :meth:`check`: the loss sum, the total, where this rank's first
        invalid count is, and whether some rank had one."""
        return [self.loss_sum, self.total, self.invalid_at, self.invalid_anywhere]

    def check(self, loss_sum: float, total: float, invalid_at: float, invalid_anywhere: float) -> float:
        """Raise on an invalid count or a zero total; return the mini-batch loss (``read``: :meth:`device_values`)."""
        if invalid_at or invalid_anywhere:
            where = "on another DDP rank"
            if invalid_at:
                where = f"at {self.describe(int(invalid_at) - 1)}"
            raise ValueError(f"{INVALID_COUNT}; {self.rule.source} returned an invalid count {where}")
        if total == 0:
            raise ValueError(
                "normalize: the counts of the whole mini-batch sum to 0 (no loss items); the mean loss is undefined"
            )
        return loss_sum * self.factor / total

    def describe(self, k: int) -> str:
        """Micro-batch ``k`` and its rows, for messages."""
        return f"micro-batch {k} of {self.num_mb} ({self.describe_rows(self.rows_of[2 * k], self.rows_of[2 * k + 1])})"


def for_step(rule: Rule, batch: Any, info: Any, sizes: list[int], device: torch.device, *, ahead: bool,
             alone: bool) -> Normalizer:
    """The step's normalizer, its count source chosen here, once, for every world. The world
    says two things only: whether it needs this rank's total before the first micro-batch
    (``ahead``: FSDP2, paired BatchNorm micro-batches, for their agreement) and whether no
    other rank weighs this one's counts (``alone``: then a total the source knows ahead is exact
    at once, and so is the count of a lone micro-batch when it is taken)."""
    if ahead:
        source: Source = sources.ahead(rule, batch, info, sizes, device)
    else:
        source = sources.choose(rule, info.targets, info.indices, sizes, device)
    normalizer = Normalizer(rule, source, num_micro_batches=len(sizes), device=device, alone=alone)
    if alone and normalizer.denom is not None:
        normalizer.fix(normalizer.denom)
    return normalizer


def first_nonfinite(normalizer: Normalizer) -> torch.Tensor | float:
    """Where the first non-finite micro-batch loss is, as a device mark for :func:`nonfinite_at`."""
    return normalizer.ledger.first_nonfinite()


def nonfinite_at(normalizer: Normalizer, mark: float) -> str:
    """Where a non-finite loss was, from the mark read on the host."""
    return f"at {normalizer.describe(int(mark) - 1)}" if mark > 0 else "on another DDP rank"
