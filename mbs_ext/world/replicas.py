"""Replicas: DistributedDataParallel, or a replicated model with ``process_group=``.

Every rank holds the whole model and streams its own rows. The step sums the gradients
itself: every micro-batch runs under DDP's ``no_sync``, gradients add up in float
buffers, and after the pass one collective (:mod:`mbs_ext.world.record`) settles the
global count and loss, whether a count or a gradient went bad anywhere, which
parameters got a gradient on some rank, and which ranks failed; then one all-reduce per
device sums the buffers. Buffers, not ``.grad``: a rank that failed can take part in
that sum with zeros of the same size, which it could not do in DDP's bucketed backward
without a forward of its own, so no rank is left waiting.

A rank that fails before the collective takes part in each collective it missed (the
buffer broadcast, the step's collective, the buffer sum) with zeros and its failure
record, and raises its own error; the others raise
:class:`~mbs_ext.world.record.PeerFailed`. What this cannot cover: a rank dying outright
(its peers wait until the process group times out), and a failure after the collective
(the cast into ``.grad``, the optimizer step), which each rank meets alone.

With BatchNorm layers whose statistics span the ranks, micro-batches pair up across ranks
(:mod:`mbs_ext.world.pairing`): the ranks agree on them first, a rank with fewer runs padding
ones, and a rank failing mid-stream runs the rest as padding before it shares its failure,
provided no layer's collective of the failing micro-batch had run (else the others wait
until the process group times out).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mbs_ext.counts import sources as counts
from mbs_ext.counts.normalize import Normalizer
from mbs_ext.memory.backoff import is_out_of_memory
from mbs_ext.messages import add_note
from mbs_ext.model.grads import GradBuffers
from mbs_ext.model.wrappers import unwrap
from mbs_ext.world.one import _NO_CONTEXT, Pass, Phase, Sink, World
from mbs_ext.world.pairing import Pairing
from mbs_ext.world.record import (
    Failure,
    Layout,
    Record,
    all_reduce_sum,
    out_of_memory_while_streaming,
    raise_failures,
    tell_others,
)


class Replicas(World):
    """Ranks of ``group`` that each hold the whole model (``ddp``: its DDP module, if any)."""

    def __init__(self, ddp: DistributedDataParallel | None, group: Any) -> None:
        self.ddp, self.group = ddp, group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def buffer_dtype(self, requested: torch.dtype | None, params: list[nn.Parameter]) -> torch.dtype | None:
        """Always buffers (see the module docstring), float64 where some parameter is."""
        dtype = super().buffer_dtype(requested, params)
        if dtype is None:
            dtype = torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32
        return dtype

    def start(self, params: list[nn.Parameter], device: torch.device, requested: torch.dtype | None) -> Sink:
        self.sync_buffers()
        return super().start(params, device, requested)

    def pair(self, modules: list[nn.Module]) -> None:
        self.pairing = Pairing.of(modules, self.group, self.size, self.rank, weighs_after=True)
        self.runs_every_micro_batch = self.pairing is not None and bool(self.pairing.active)

    alone = False

    @property
    def counts_ahead(self) -> bool:
        """Counts weigh this rank against the others: the total is known after the pass, unless
        micro-batches pair up (then counted ahead: the agreement fixes the total)."""
        return self.pairing is not None

    def agree(self, normalizer: Normalizer, sizes: list[int], device: torch.device) -> int:
        if self.pairing is None:
            return len(sizes)
        padded, total = self.pairing.agree(counts.local_total(normalizer.source.counts), sizes, device)
        normalizer.fix(total)
        return padded if self.pairing.active else len(sizes)

    def streaming(self):
        return self.pairing.streaming() if self.pairing is not None else _NO_CONTEXT

    def zero_weight(self, pass_: Pass, last: bool, lenient: bool = False, index: int | None = None) -> None:
        self.pairing.pad(pass_, pass_.index if index is None else index, self.no_sync)

    def catch_up(self, pass_: Pass) -> bool:
        return self.pairing is not None and self.pairing.catch_up(pass_, self.no_sync)

    def no_sync(self):
        """DDP's ``no_sync`` for every micro-batch: the step sums the gradients itself."""
        return self.ddp.no_sync() if self.ddp is not None else _NO_CONTEXT

    def sync_buffers(self) -> None:
        """Rank 0's module buffers to every rank, once per step before the first micro-batch, as
        DDP's forward does each iteration (``broadcast_buffers``). DDP's own broadcast is switched
        off for the step's forwards: it would run in whichever forward comes first, which a rank
        that fails before it never reaches, leaving the others waiting."""
        ddp = self.ddp
        if ddp is None:
            return
        ddp.require_forward_param_sync = False  # DDP's own broadcast: off for the step's forwards
        if getattr(ddp, "broadcast_buffers", False):
            _broadcast_buffers(ddp, self.group)

    def collect(self, normalizer: Normalizer, sink: Sink) -> Record:
        """The step's collective, then the buffers summed over the ranks and cast into ``.grad``."""
        got = sink.presence()
        layout = Layout(self.size, self.rank, presence=len(got))
        total, loss_sum, invalid = normalizer.local_values()
        record = layout.read(all_reduce_sum(layout.pack(
            total=total, loss_sum=loss_sum, invalid_counts=invalid, nonfinite=sink.local_nonfinite(), presence=got,
            noise_sq=sink.micro_sq(normalizer.denom), micro_batches=sink.micro_batches(),
        ), normalizer.device, self.group))
        normalizer.settle((record.head("total"), record.head("loss_sum"), record.head("invalid_counts")))
        if not all(got):
            # Which .grad exist must be known on the host (a host sync, only when this rank's
            # micro-batches left some parameter without a gradient).
            got = [v > 0 for v in record.presence().tolist()]
        sink.finish(normalizer.rescale_factor(), got, self.group,
                    found=(record.head("nonfinite") > 0).to(torch.float32))
        return record

    def share_failure(self, exc: Exception, micro_batch: int, phase: Phase, caught_up: bool,
                      params: list[nn.Parameter], device: torch.device, requested: torch.dtype | None) -> bool:
        """The buffer broadcast unless this rank got that far, then the agreement (paired micro-batches)
        or the step's collective and the buffer sum, with this rank's failure record. Notes on ``exc``
        what the others were told; where every failure was out of memory while streaming, every rank
        backs off."""
        failure = Failure(micro_batch, is_out_of_memory(exc))
        if self.pairing is not None and phase >= Phase.AGREEING and not caught_up:
            if phase == Phase.AGREEING:  # every rank raised in the agreement alike
                return False
            if self.pairing.active:
                add_note(exc, f"mbs_ext.step: rank {self.rank} failed inside a micro-batch whose BatchNorm "
                              "collectives across ranks had begun: the other ranks wait in them until the process "
                              "group times out")
                return False

        def share() -> bool:
            if phase < Phase.SYNCING_BUFFERS:
                self.sync_buffers()
            if self.pairing is not None and phase < Phase.AGREEING:
                self.pairing.agree(0.0, [], device, failure)  # the others wait in the agreement
                return False
            return _join_collect(self, failure, params, device, requested)

        return tell_others(exc, self.rank, share)

    def out_of_memory(self, exc: BaseException, together: bool) -> bool:
        """What the ranks shared (every rank reads the same), not this rank's own error."""
        return together

    def backs_off(self, streaming: bool, grew: bool = False) -> bool:
        """Every rank decides alike, from the shared record (:meth:`out_of_memory`)."""
        return True

    def backoff(self, model: nn.Module, device: torch.device) -> tuple[nn.Module, Callable | None]:
        """Probes run on the module under DDP (no collectives); the ranks take the smallest size found."""
        return unwrap(model), lambda size: self.agree_size(size, device)

    def agree_size(self, size: int | None, device: torch.device) -> int | None:
        """The smallest micro-batch size any rank found (None where some rank found none). One
        all-reduce and one host read, on the back-off path only."""
        t = torch.tensor([float(size or 0)], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item()) or None


def _join_collect(world: Replicas, failure: Failure, params: list[nn.Parameter], device: torch.device,
                  requested: torch.dtype | None) -> bool:
    """Zeros and this rank's failure in the step's collective, zero buffers in the sum."""
    layout = Layout(world.size, world.rank, presence=len(params))
    record = layout.read(all_reduce_sum(layout.pack(failure=failure), device, world.group))
    bufs = GradBuffers(params, world.buffer_dtype(requested, params))
    bufs.all_reduce(world.group)
    bufs.release()
    slots = record.failure_slots().tolist()
    together = out_of_memory_while_streaming(slots, world.size)
    raise_failures(slots, world.size, world.rank)
    return together


@torch.no_grad()
def _broadcast_buffers(ddp: DistributedDataParallel, group: Any) -> None:
    """Rank 0's module buffers (those DDP does not ignore) to every rank of ``group``: one
    broadcast per device and dtype."""
    ignore = getattr(ddp, "parameters_to_ignore", set())
    groups: dict[tuple, list[torch.Tensor]] = {}
    for name, b in ddp.module.named_buffers():
        if name not in ignore:
            groups.setdefault((b.device, b.dtype), []).append(b)
    src = dist.get_global_rank(group, 0)
    for bufs in groups.values():
        flat = torch._utils._flatten_dense_tensors(bufs)
        dist.broadcast(flat, src=src, group=group)
        for b, v in zip(bufs, torch._utils._unflatten_dense_tensors(flat, bufs)):
            b.copy_(v)
