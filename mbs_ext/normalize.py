"""Every count rule: how much each micro-batch's loss counts in the mini-batch loss.

A rule gives each micro-batch a *count* ``c_i``; the mini-batch loss is
``sum_i c_i * loss_i / D``. For a mean (``"samples"``, a count callable, a ``torch.nn``
loss with class weights or ignored targets) ``D = sum_i c_i`` over every micro-batch of
every rank, so the result is the mean over all items of the mini-batch whatever the
split. For a sum (``"sum"``, ``reduction="sum"``) ``c_i = 1`` and ``D = 1``.
``"micro_batches"`` (``c_i = 1``, ``D = M``) is the rule of the micro-batch streaming
papers, kept for comparison: it is wrong whenever micro-batches differ in size.

``D`` is known before the first micro-batch only for fixed rules. Otherwise a
provisional denominator of the right magnitude (first count times M) weights the
micro-batches, and what they accumulated is rescaled once the total is known
(:meth:`Normalizer.settle`). Device counts are validated on the device and read in
the step's one host sync (:meth:`Normalizer.check`); nothing here reads a device value.
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mbs_ext.ranks import Ranks

Count = float | torch.Tensor  # a host number, or a 0-dim float64 tensor on the device

INVALID_COUNT = "normalize count must be a non-negative finite number"


@dataclass(frozen=True)
class Rule:
    """``kind`` is "samples", "micro_batches", "sum" or "count" (``count(micro_batch)``)."""

    kind: str
    count: Callable[[Any], Any] | None = None
    source: str = ""  # what the rule was read from, for messages
    # For counts read from an nn loss's targets: each row's part of the count, so that the
    # counts of all micro-batches can be taken at once from host targets (counts_ahead).
    per_row: Callable[[torch.Tensor], torch.Tensor | int | None] | None = None

    @property
    def known_ahead(self) -> bool:
        return self.kind != "count"


def rule_of(normalize: Any) -> Rule:
    """The rule an already validated ``normalize`` option names (None means "samples")."""
    if normalize is None:
        return Rule("samples")
    if isinstance(normalize, str):
        return Rule(normalize)
    return Rule("count", normalize, "the normalize callable")


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


def counts_ahead(rule: Rule, targets: torch.Tensor | None, indices: torch.Tensor | None,
                 sizes: list[int]) -> list[float] | None:
    """Every micro-batch's count before the first one streams, when the rule reads it from
    targets on the host (their rows at ``indices`` in dataset mode; an ``nn`` loss's class
    targets): a few vectorized operations (one ``aminmax`` when no target can be ignored), no
    device work, and the step knows its total ahead (no provisional denominator, nothing to
    rescale). None when the counts must be taken per micro-batch (a user's count callable,
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


def on_trust(rule: Rule, num_micro_batches: int, ranks: Ranks) -> bool:
    """Whether the count of a rule that reads targets is not taken: a single micro-batch in one
    process weighs 1 whatever its count, and its mean loss is the mini-batch's. Taking the count
    would cost an operation over the targets every step (a reduction, then a read). torch's mean
    over no items (every target ignored, or weighted 0) is NaN, so a count can matter only when
    the loss is not finite: :meth:`Normalizer.check` takes it then."""
    return rule.per_row is not None and num_micro_batches == 1 and ranks.group is None


def _device_count(value: torch.Tensor, source: str) -> torch.Tensor:
    if value.numel() != 1:
        raise ValueError(f"{INVALID_COUNT}; {source} returned a tensor of shape {tuple(value.shape)}")
    if value.is_complex() or value.dtype == torch.bool:
        raise TypeError(f"{INVALID_COUNT}; {source} returned a tensor of dtype {value.dtype}")
    return value.detach().reshape(()).to(torch.float64)


def _called_count(rule: Rule, micro_batch: Any, device: torch.device) -> Count:
    """The count ``rule`` calls for: checked on the host, or a device tensor checked in
    :meth:`Normalizer.settle` (on the device, no read)."""
    value = rule.count(micro_batch)
    if not isinstance(value, torch.Tensor):
        return check_count(value, rule.source)
    c = _device_count(value, rule.source)
    if c.device.type == "cpu" and device.type != "cpu":
        return check_count(c, rule.source)  # read on the host: a copy to the device would block
    return c.to(device)


class Normalizer:
    """Counts, weights and totals of one step over ``num_micro_batches`` local micro-batches.

    Per micro-batch it only records (the count, the detached loss): the totals, the loss
    and the validation of device counts are computed in a few vectorized operations when
    the step settles, so the cost per micro-batch does not grow with bookkeeping.
    """

    def __init__(self, rule: Rule, *, rows: int, num_micro_batches: int, device: torch.device, ranks: Ranks,
                 ahead: list[float] | None = None) -> None:
        self.rule = rule
        self.num_mb = num_micro_batches
        self.device, self.ranks = device, ranks
        self.summing = rule.kind == "sum"
        self.counts: list[Count] = []
        self.losses: list[tuple[int, torch.Tensor, Count]] = []  # (index, detached loss, count)
        self.rows_of: list[tuple[int, int]] = []
        self.loss_sum: torch.Tensor | None = None  # set by settle (global under DDP)
        self.total: Count | None = None  # the global D, once settled
        # 1 + the first micro-batch whose device count is invalid (0: none; -1: only another rank's).
        self.bad: torch.Tensor | float = 0.0
        self._device_index: list[int] = []  # which counts are device tensors (set by _local_total)
        fixed = {"samples": float(rows), "micro_batches": float(num_micro_batches), "sum": 1.0}
        self.denom: Count | None = fixed.get(rule.kind)
        self.ahead = ahead  # every count, taken before the first micro-batch (counts_ahead)
        self.trusted: Any = None  # the micro-batch counted on trust (on_trust), for check() if need be
        if ahead is not None:
            self.denom = sum(ahead) or 1.0  # a zero total: every micro-batch is skipped, check() fails

    @property
    def exact_ahead(self) -> bool:
        """Every weight is exact from the start (one process; a fixed rule or counts taken ahead)."""
        return (self.rule.known_ahead or self.ahead is not None) and self.ranks.group is None

    def count(self, micro_batch: Any, rows: tuple[int, int]) -> Count:
        """The count of the next micro-batch (rows ``[start, stop)``); sets the provisional denominator."""
        self.rows_of.append(rows)
        kind = self.rule.kind
        if kind == "samples":
            c: Count = float(rows[1] - rows[0])
        elif kind in ("micro_batches", "sum"):
            c = 1.0
        elif self.ahead is not None:
            c = self.ahead[len(self.rows_of) - 1]
        elif on_trust(self.rule, self.num_mb, self.ranks):
            c, self.trusted = 1.0, micro_batch
        else:
            c = _called_count(self.rule, micro_batch, self.device)
        self.counts.append(c)
        if self.denom is None:
            self.denom = c.clamp(min=1.0) * self.num_mb if isinstance(c, torch.Tensor) else max(c, 1.0) * self.num_mb
        return c

    def count_ahead(self, micro_batches: Any) -> Count:
        """Count every ``(micro_batch, rows)`` first (FSDP2); returns this rank's total, for :meth:`agree`."""
        for mb, rows in micro_batches:
            self.count(mb, rows)
        total = self._local_total()
        self.ahead, self.counts, self.rows_of = self.counts, [], []
        return total

    def agree(self, global_total: Count) -> None:
        """The total over all ranks, known before the first micro-batch: every weight is exact."""
        if not self.summing:
            self.denom = global_total

    def add_loss(self, loss: torch.Tensor, c: Count) -> None:
        """Record the micro-batch's loss; it counts ``c`` times in the mini-batch loss."""
        self.losses.append((len(self.rows_of) - 1, loss, c))

    def weight(self, c: Count) -> Count:
        """The gradient weight of a micro-batch before the total is known (``c / provisional D``)."""
        return c / self.denom

    def final_weight(self, c: Count) -> Count:
        """The exact weight of a micro-batch after :meth:`settle`."""
        return c / self.total

    def settle(self, extra: list[Count] = (), host_tail: list[float] | None = None) -> torch.Tensor | None:
        """Local totals and checks, then the global ones over the ranks in one collective (with
        ``extra`` values riding along). Returns the reduced ``extra`` + ``host_tail`` (None on one process)."""
        total = self._local_total()
        # One process, host counts: the losses are read as they are and weighed on the host (check).
        on_host = self.ranks.group is None and not self._device_index
        self.loss_sum = None if on_host else _loss_sum(self.losses, self.device)
        self.counted = [(loss, c) for _, loss, c in self.losses if c != 0] if on_host else []  # c != 0: no NaN mean
        reduced = None
        if self.ranks.group is not None:
            flag = (self.bad > 0).to(torch.float64) if isinstance(self.bad, torch.Tensor) else 0.0
            values = self.ranks.all_reduce_sum([total, self.loss_sum, flag, *extra], self.device, host_tail=host_tail)
            if not self.summing:
                total = values[0]
            self.loss_sum = values[1]
            local = self.bad if isinstance(self.bad, torch.Tensor) else torch.zeros_like(values[2])
            # Keep this rank's first bad micro-batch, or -1 when only another rank had one.
            self.bad = torch.where(values[2] > 0, torch.where(local > 0, local, -1.0), 0.0)
            reduced = values[3:]
        self.total = total
        return reduced

    def _local_total(self) -> Count:
        """This rank's total count; device counts are validated here, on the device."""
        if self.summing:
            return 1.0
        host = float(sum(c for c in self.counts if not isinstance(c, torch.Tensor)))
        self._device_index = [i for i, c in enumerate(self.counts) if isinstance(c, torch.Tensor)]
        if not self._device_index:
            return host
        counts = torch.stack([self.counts[i] for i in self._device_index])
        self.bad = _first_position(~((counts >= 0) & (counts < math.inf)))  # negative, NaN or inf
        return counts.sum() + host if host else counts.sum()

    def rescale_factor(self) -> Count:
        """What to multiply provisionally weighted sums by: ``D_provisional / D`` (the sums of all
        ranks are added up, not averaged)."""
        if isinstance(self.total, torch.Tensor) or isinstance(self.denom, torch.Tensor) or self.total != 0:
            return self.denom / self.total
        return 1.0  # a zero host total: check() fails the step

    def device_values(self) -> list[Count]:
        """To read on the host for :meth:`check`: the loss sum (or its weighed parts), total, bad-count mark."""
        if self.loss_sum is not None:
            return [self.loss_sum, self.total, self.bad]
        return [*(loss for loss, _ in self.counted), self.total, self.bad]

    def check(self, *read: float) -> float:
        """Raise on an invalid count or a zero total; return the mini-batch loss (``read``: :meth:`device_values`)."""
        *parts, total, bad = read
        if bad != 0:
            raise ValueError(f"{INVALID_COUNT}; {self.rule.source} returned an invalid count {self._where(bad)}")
        if self.trusted is not None and not all(map(math.isfinite, parts)) \
                and check_count(self.rule.count(self.trusted), self.rule.source) == 0:
            total = 0.0  # the count taken on trust (on_trust) was 0
        if total == 0:
            raise ValueError(
                "normalize: the counts of the whole mini-batch sum to 0 (no loss items); the mean loss is undefined"
            )
        return (parts[0] if self.loss_sum is not None else sum(c * v for (_, c), v in zip(self.counted, parts))) / total

    def _where(self, mark: float) -> str:
        return "on another DDP rank" if mark < 0 else f"at {self.describe(self._device_index[int(mark) - 1])}"

    def describe(self, k: int) -> str:
        """Micro-batch ``k`` and its rows, for messages."""
        start, stop = self.rows_of[k]
        return f"micro-batch {k} of {self.num_mb} (rows [{start}, {stop}))"


def first_nonfinite(normalizer: Normalizer) -> torch.Tensor | float:
    """Where the first non-finite micro-batch loss is, as a device mark for :func:`nonfinite_at`."""
    if not normalizer.losses:
        return 0.0
    return _first_position(~torch.isfinite(torch.stack([loss for _, loss, _ in normalizer.losses])))


def nonfinite_at(normalizer: Normalizer, mark: float) -> str:
    """Where a non-finite loss was, from the mark read on the host."""
    return f"at {normalizer.describe(normalizer.losses[int(mark) - 1][0])}" if mark > 0 else "on another DDP rank"


def join(ranks: Ranks, device: torch.device, extra: int, host_tail: list[float]) -> torch.Tensor:
    """A failed rank's part in :meth:`Normalizer.settle`'s collective: zeros where the totals and
    the ``extra`` values go, then ``host_tail``; returns the reduced ``host_tail``."""
    values = ranks.all_reduce_sum([0.0] * (3 + extra), device, host_tail=host_tail)
    return values[3 + extra:]


def _loss_sum(losses: list[tuple[int, torch.Tensor, Count]], device: torch.device) -> torch.Tensor:
    """``sum_i c_i * loss_i`` in float64 (a zero count adds nothing, even a NaN mean); a few
    vectorized operations, no host-to-device copy."""
    parts = []
    on_device = [(loss, c) for _, loss, c in losses if isinstance(c, torch.Tensor)]
    on_host = [(loss, float(c)) for _, loss, c in losses if not isinstance(c, torch.Tensor) and c != 0]
    if on_device:
        values = torch.stack([loss for loss, _ in on_device]).to(torch.float64)
        counts = torch.stack([c for _, c in on_device])
        parts.append(torch.where(counts > 0, values * counts, torch.zeros_like(counts)).sum())
    if len(on_host) == 1:  # one micro-batch: two operations instead of four
        loss, c = on_host[0]
        parts.append(loss.to(torch.float64) * c)
    elif on_host:
        values = torch.stack([loss for loss, _ in on_host]).to(torch.float64)
        if device.type == "cpu":  # a host tensor of weights is no copy here
            parts.append(values @ torch.tensor([c for _, c in on_host], dtype=torch.float64))
        else:
            parts.append(torch.stack(torch._foreach_mul(values.unbind(), [c for _, c in on_host])).sum())
    return sum(parts[1:], parts[0]) if parts else torch.zeros((), dtype=torch.float64, device=device)


def _first_position(flags: torch.Tensor) -> torch.Tensor:
    """1 + the position of the first true flag of a 1-d tensor (0: none), on its device."""
    as_float = flags.to(torch.float64)
    return (as_float.argmax() + 1) * as_float.amax()  # argmax: the first of equal maxima
