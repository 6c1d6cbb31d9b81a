"""What the ranks tell each other: the step's one collective, slot by slot, the agreements
before it, and failures.

Every rank that reaches the end of its pass, or fails before it, adds one float64
vector into the same all-reduce. Its layout is defined here once, for success and
failure alike: a failing rank packs zeros where the totals go and its own failure
record, so the others learn who failed and where without a second collective.
The agreements before or beside the pass (how many micro-batches each rank runs, the
rows of a coupled loss, whether every rank's checks passed) are one :func:`agree` each,
the same record with their own values in front of the failure slots.

    [total, loss_sum, invalid_counts, nonfinite, noise_sq, micro_batches | presence x params |
     failed x world | oom x world]

``noise_sq`` and ``micro_batches`` (``sum_j c_j |g_j|^2`` and the micro-batches run, for the
noise scale: zeros without it) make every rank's micro-batches micro-batches of one global
step. ``presence`` (which parameters got a gradient on some rank) rides only where the step
sums the gradients itself (replicas); ``failed[r]`` is 1 + the micro-batch rank ``r``
failed at + 1 (0: it did not fail), ``oom[r]`` 1.0 where that failure was out of memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mbs_ext.messages import add_note

Value = float | torch.Tensor  # a host number, or a one-element tensor on the device


class PeerFailed(RuntimeError):
    """Another rank failed in this step; this rank undid its part too (nothing changed).
    ``out_of_memory``: every rank that failed ran out of memory while streaming (the step then
    backs off on every rank, as one process does)."""

    def __init__(self, message: str, out_of_memory: bool = False) -> None:
        super().__init__(message)
        self.out_of_memory = out_of_memory


@dataclass(frozen=True)
class Failure:
    """Where this rank failed before the step's collective: ``micro_batch`` -1 means before the
    first one (checks, buffers)."""

    micro_batch: int
    out_of_memory: bool


def failure_slots(world: int, rank: int, failure: Failure | None) -> list[float]:
    """This rank's part of the failure record: ``failed x world`` then ``oom x world``."""
    slots = [0.0] * (2 * world)
    if failure is not None:
        slots[rank] = failure.micro_batch + 2.0
        slots[world + rank] = float(failure.out_of_memory)
    return slots


def out_of_memory_while_streaming(slots: list[float], world: int) -> bool:
    """From a failure record summed over the ranks: some rank failed, and every one that did
    ran out of memory at a micro-batch (a smaller one may help)."""
    failed = [r for r in range(world) if slots[r] > 0]
    return bool(failed) and all(slots[r] >= 2 and slots[world + r] > 0 for r in failed)


def raise_failures(slots: list[float], world: int, rank: int) -> None:
    """Raise :class:`PeerFailed` naming every other rank that failed (``slots``: a failure record
    summed over the ranks, read on the host); nothing when no other rank did."""
    others = [r for r in range(world) if slots[r] > 0 and r != rank]
    if not others:
        return
    where = "; ".join(
        f"rank {r} {'ran out of memory' if slots[world + r] > 0 else 'raised'} "
        + ("before its first micro-batch" if slots[r] < 2 else f"at micro-batch {int(slots[r]) - 2}")
        for r in others
    )
    raise PeerFailed(
        f"mbs_ext.step: {where}; every rank undid the step (parameters, buffers, optimizer state and "
        "gradients are as before it), and the failing rank raised its own error",
        out_of_memory=out_of_memory_while_streaming(slots, world),
    )


def tell_others(exc: BaseException, rank: int, share: Callable[[], bool]) -> bool:
    """A failed rank's part in the collectives it missed (``share``), with a note on ``exc`` saying
    what the others were told. Returns whether every rank that failed ran out of memory while
    streaming (``share``'s answer, or what the record said when another rank failed too)."""
    text = f"mbs_ext.step: rank {rank} failed; every rank undid the step (nothing changed)"
    together = False
    try:
        together = share()
    except PeerFailed as also:
        text += f"\n{also}"
        together = also.out_of_memory
    except Exception as join_exc:  # the process group itself failed: nothing more to do
        text = (f"mbs_ext.step: could not tell the other ranks ({join_exc!r}); they may wait in a collective "
                "until the process group times out")
    add_note(exc, text)
    return together


def all_reduce_sum(values: list[Value], device: torch.device, group: Any) -> torch.Tensor:
    """``values`` summed over ``group`` in one collective, as a float64 vector on ``device``
    (only stacked without a group). No host sync: the host numbers are gathered into one
    tensor and copied once (from pinned memory on CUDA); device values are stacked where they are."""
    host = [float(v) for v in values if not isinstance(v, torch.Tensor)]
    on_host = torch.tensor(host, dtype=torch.float64)
    on_host = on_host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else on_host.to(device)
    parts: list[torch.Tensor] = []
    k = 0
    for v in values:
        if isinstance(v, torch.Tensor):
            parts.append(v.detach().to(device, torch.float64).reshape(1))
        else:
            parts.append(on_host[k : k + 1])
            k += 1
    t = torch.cat(parts)
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


@dataclass(frozen=True)
class Agreed:
    """What :func:`agree` read: ``head`` (summed, left on the device: a count may be a device
    tensor) and each column's value by rank (host numbers)."""

    head: torch.Tensor
    columns: list[list[float]]


def agree(group: Any, size: int, rank: int, device: torch.device, *, head: list[Value] = (),
          columns: list[float] = (), failure: Failure | None = None) -> Agreed:
    """One all-reduce among the ranks of ``group`` that every rank takes at the same point: the
    ``head`` values summed over the ranks, each of ``columns`` gathered by rank (this rank's value
    at its own slot, the others' at theirs), and the failure record. One host read. Every rank
    raises :class:`PeerFailed` here where another rank failed (``failure``: this rank's, which
    then sends zeros in its head and columns)."""
    mine = [0.0] * (len(columns) * size)
    if failure is None:
        for i, value in enumerate(columns):
            mine[i * size + rank] = float(value)
    values = all_reduce_sum([*head, *mine, *failure_slots(size, rank, failure)], device, group)
    tail = values[len(head):].tolist()
    raise_failures(tail[len(mine):], size, rank)
    return Agreed(values[: len(head)], [tail[i * size : (i + 1) * size] for i in range(len(columns))])


@dataclass(frozen=True)
class Layout:
    """Where each value sits in the step's collective (see the module docstring)."""

    world: int
    rank: int
    presence: int = 0  # parameters whose presence rides along (replicas only)

    HEAD = ("total", "loss_sum", "invalid_counts", "nonfinite", "noise_sq", "micro_batches")

    def pack(self, *, total: Value = 0.0, loss_sum: Value = 0.0, invalid_counts: Value = 0.0,
             nonfinite: Value = 0.0, noise_sq: Value = 0.0, micro_batches: Value = 0.0,
             presence: list[bool] | None = None, failure: Failure | None = None) -> list[Value]:
        """One rank's vector: a failing rank leaves the head and the presence at zero."""
        got = [float(g) for g in presence] if presence is not None else [0.0] * self.presence
        assert len(got) == self.presence, (len(got), self.presence)
        return [total, loss_sum, invalid_counts, nonfinite, noise_sq, micro_batches, *got,
                *failure_slots(self.world, self.rank, failure)]

    def read(self, summed: torch.Tensor) -> Record:
        return Record(self, summed)


@dataclass(frozen=True)
class Record:
    """The step's collective summed over the ranks (None on one process: nothing to read)."""

    layout: Layout | None = None
    summed: torch.Tensor | None = None

    def head(self, name: str) -> torch.Tensor:
        return self.summed[Layout.HEAD.index(name)]

    def presence(self) -> torch.Tensor:
        start = len(Layout.HEAD)
        return self.summed[start : start + self.layout.presence]

    def failure_slots(self) -> torch.Tensor:
        return self.summed[len(Layout.HEAD) + self.layout.presence :]

    def noise(self, local_sq: Value, local_micro_batches: Value) -> tuple[Value, Value]:
        """``sum_j c_j |g_j|^2`` and the micro-batches over every rank (this rank's alone on one process)."""
        if self.summed is None:
            return local_sq, local_micro_batches
        return self.head("noise_sq"), self.head("micro_batches")

    def failed(self) -> Value:
        """How many ranks failed, for the finish's one read (0.0 on one process)."""
        if self.summed is None:
            return 0.0
        return (self.failure_slots()[: self.layout.world] > 0).sum()

    def raise_if_failed(self, failed: float) -> None:
        """After the read: raise naming the ranks that failed (a second read, on this path only)."""
        if failed and self.summed is not None:
            raise_failures(self.failure_slots().tolist(), self.layout.world, self.layout.rank)
