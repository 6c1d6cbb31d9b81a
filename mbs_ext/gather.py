"""After the pass: the step's one collective, then the gradients summed over the ranks.

One all-reduce carries everything the ranks must agree on: the total count and loss,
whether a count or a gradient went bad, which parameters got a gradient, and which
ranks failed and where. Then each rank's accumulation buffers are summed. A rank that
failed before this point (in its checks, the plan, or any micro-batch) takes part in
both with zeros of the same layout and raises its own error; the others read the
failure record in the finish's one host sync and raise :class:`~mbs_ext.ranks.PeerFailed`.
Every rank undoes the step, and no rank is left waiting in a collective.

Under FSDP2, whose collectives run inside every forward and backward, a rank failing
mid-stream first runs its remaining micro-batches at zero weight (:mod:`mbs_ext.sharded`).

What this cannot cover: a rank dying outright (its peers wait until the process group
times out, as in any collective), a failure after this collective (casting the sums
into ``.grad``, the optimizer step), which each rank meets alone, and under FSDP2 a failure
inside a forward or backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mbs_ext import normalize
from mbs_ext.grads import AutogradSink, BufferSink, GradBuffers
from mbs_ext.messages import add_note
from mbs_ext.normalize import Normalizer
from mbs_ext.ranks import Failure, PeerFailed, Ranks, out_of_memory_while_streaming


@dataclass(frozen=True)
class Agreement:
    """The failure record summed over the ranks (a device vector; None on one process)."""

    ranks: Ranks
    slots: torch.Tensor | None = None

    def failed(self) -> torch.Tensor | float:
        """How many ranks failed, for the finish's one read (0.0 on one process)."""
        return 0.0 if self.slots is None else (self.slots[: self.ranks.world] > 0).sum()

    def raise_if_failed(self, failed: float) -> None:
        """After the read: raise naming the ranks that failed (a second read, on this path only)."""
        if failed and self.slots is not None:
            self.ranks.raise_failures(self.slots.tolist())


def gather(normalizer: Normalizer, sink: AutogradSink | BufferSink, ranks: Ranks) -> Agreement:
    """Settle the totals (over the ranks, with the failure record), then sum and cast the buffers."""
    if ranks.fsdp:  # FSDP2 reduced the gradients itself; the ranks agree on the rest
        reduced = normalizer.settle(extra=[sink.local_nonfinite()], host_tail=ranks.failure_slots(None))
        sink.found = (reduced[0] > 0).to(torch.float32)
        return Agreement(ranks, reduced[1:])
    if not sink.buffered:  # one process: settled before the last backward (see the pass), or now
        if normalizer.total is None:
            normalizer.settle()
        return Agreement(ranks)
    got = sink.presence()
    slots = ranks.failure_slots(None) if ranks.group is not None else []
    reduced = normalizer.settle(extra=[sink.local_nonfinite()], host_tail=[float(g) for g in got] + slots)
    if reduced is None:
        sink.finish(normalizer.rescale_factor(), got)
        return Agreement(ranks)
    n = len(got)
    if not all(got):
        # Which .grad exist must be known on the host (a host sync, only when this rank's
        # micro-batches left some parameter without a gradient).
        got = [v > 0 for v in reduced[1 : 1 + n].tolist()]
    sink.finish(normalizer.rescale_factor(), got, ranks.group, found=(reduced[0] > 0).to(torch.float32))
    return Agreement(ranks, reduced[1 + n :])


def join(exc: Exception, ranks: Ranks, params: list[nn.Parameter], device: torch.device, dtype: torch.dtype,
         failure: Failure, progress: Any) -> bool:
    """A failed rank's part in the step's collectives, after its own rollback: the buffer
    broadcast unless it got that far, zeros in :func:`gather`'s collective with its failure
    record, zero buffers of the same size in the sum. Notes on ``exc`` what the others were told.
    Returns whether every rank that failed ran out of memory while streaming (as the others
    learn from the record: then every rank backs off alike).

    Under FSDP2 a failure before the ranks agreed on their micro-batches rides in that
    agreement, and one while streaming in :func:`gather`'s collective, provided the pass
    caught up (ran the rest at zero weight: :meth:`ForwardBackward.run`). A rank that failed
    inside a forward or backward cannot: FSDP's collectives there are half done, and the
    others wait in them."""
    fb = progress.fb
    if ranks.fsdp and progress.planned and not (fb is not None and fb.caught_up):
        add_note(exc, f"mbs_ext.step: rank {ranks.rank} failed while streaming under FSDP2 and could not run the "
                      "rest of FSDP's collectives (the failure came inside a forward or backward, or before any "
                      "micro-batch arrived): the other ranks wait in them until the process group times out")
        return False
    text = f"mbs_ext.step: rank {ranks.rank} failed; every rank undid the step (nothing changed)"
    together = False
    try:
        if ranks.fsdp and progress.planned:  # gather's collective: 1 extra value (the non-finite flag)
            ranks.raise_failures(normalize.join(ranks, device, 1, ranks.failure_slots(failure)).tolist())
        elif ranks.fsdp:  # the agreement on the micro-batches, with this rank's record; raises PeerFailed
            ranks.agree_micro_batches(0.0, 0, device, failure)
        else:  # DDP: where every failure was out of memory while streaming, every rank backs off
            slots = _join_replicated(ranks, params, device, dtype, failure, progress.buffers_synced)
            together = out_of_memory_while_streaming(slots, ranks.world)
            ranks.raise_failures(slots)
    except PeerFailed as also:
        text += f"\n{also}"
    except Exception as join_exc:  # the process group itself failed: nothing more to do
        text = (f"mbs_ext.step: could not tell the other ranks ({join_exc!r}); they may wait in a collective "
                "until the process group times out")
    add_note(exc, text)
    return together


def _join_replicated(ranks: Ranks, params: list[nn.Parameter], device: torch.device, dtype: torch.dtype,
                     failure: Failure, buffers_synced: bool) -> list[float]:
    """DDP (or an explicit group): the buffer broadcast unless this rank got that far, zeros in
    :func:`gather`'s collective, zero buffers in the sum; the failure record of every rank."""
    if not buffers_synced:
        ranks.sync_buffers()
    # 1 extra value, as gather's (the non-finite flag); then presence per parameter, then the record.
    tail = normalize.join(ranks, device, 1, [0.0] * len(params) + ranks.failure_slots(failure))
    bufs = GradBuffers(params, dtype)
    bufs.all_reduce(ranks.group)
    bufs.release()
    return tail[len(params):].tolist()
