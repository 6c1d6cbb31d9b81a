"""Shards: a model sharded by FSDP2 (``fully_shard``), whose collectives run inside every
forward and backward (:mod:`mbs_ext.world.fsdp` holds the FSDP2 specifics).

Every rank must therefore run the same number of micro-batches. Before the first one,
each rank counts all its micro-batches ahead and one small all-reduce gives every rank
the largest number of micro-batches and the global total of the counts: each
micro-batch's weight is exact from the start, and a rank with fewer micro-batches runs
zero-weight ones. FSDP reduces the gradients itself (summing: :func:`fsdp.summing`);
after the pass the step's collective (:mod:`mbs_ext.world.record`, no presence slots)
settles the loss, the checks and the failure record.

A rank that fails mid-stream can fail together with the others only if FSDP has not
begun the failing micro-batch's collectives: then it runs the rest at zero weight
(:meth:`Shards.catch_up`) and shares its failure in the step's collective. A failure
inside a forward or backward leaves FSDP half-way through collectives that the failing
rank cannot replay: the others wait until the process group times out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mbs_ext.counts import sources as counts
from mbs_ext.counts.normalize import Normalizer
from mbs_ext.memory.backoff import is_out_of_memory
from mbs_ext.messages import add_note
from mbs_ext.model.grads import accumulation_dtype
from mbs_ext.model.options import StepOptions
from mbs_ext.model.wrappers import unwrap
from mbs_ext.world import fsdp, padding
from mbs_ext.world.one import Pass, Phase, Sink, World
from mbs_ext.world.pairing import Pairing
from mbs_ext.world.record import Failure, Layout, Record, agree, all_reduce_sum, raise_failures, tell_others


class Shards(World):
    """Ranks of ``group`` holding shards of the FSDP2 ``modules``."""

    runs_every_micro_batch = True

    def __init__(self, modules: tuple[nn.Module, ...], group: Any) -> None:
        self.modules, self.group = modules, group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def check_options(self, options: StepOptions, params: list[nn.Parameter]) -> None:
        fsdp.check_options(options, accumulation_dtype(options.accumulate_dtype, params))

    alone = False
    counts_ahead = True  # every micro-batch counted ahead: the agreement needs this rank's total

    def pair(self, modules: list[nn.Module]) -> None:
        self.pairing = Pairing.of(modules, self.group, self.size, self.rank, weighs_after=False)

    def agree(self, normalizer: Normalizer, sizes: list[int], device: torch.device) -> int:
        """One all-reduce: the most micro-batches of any rank, and the global total (weights exact)."""
        local_total = counts.local_total(normalizer.source.counts)
        if self.pairing is not None:  # the same all-reduce, with what the BatchNorm layers need
            padded, total = self.pairing.agree(local_total, sizes, device)
        else:
            padded, total = self._agree(local_total, len(sizes), device)
        normalizer.fix(total)
        return padded

    def _agree(self, local_total: counts.Count, num_micro_batches: int, device: torch.device,
               failure: Failure | None = None) -> tuple[int, torch.Tensor]:
        """Also tells every rank whether one failed before it (then every rank raises here). One
        host read: the pass needs its count."""
        agreed = agree(self.group, self.size, self.rank, device, head=[local_total], columns=[num_micro_batches],
                       failure=failure)
        return int(max(agreed.columns[0])), agreed.head[0]

    def streaming(self):
        if self.pairing is None:
            return fsdp.summing(self.modules)
        stack = contextlib.ExitStack()
        stack.enter_context(fsdp.summing(self.modules))
        stack.enter_context(self.pairing.streaming())
        return stack

    def micro_batch(self, index: int, last: bool, options: StepOptions) -> None:
        super().micro_batch(index, last, options)
        self._gradient_sync(last, options)

    def _gradient_sync(self, last: bool, options: StepOptions) -> None:
        """Accumulating unsharded gradients: reduce-scatter in the last backward only."""
        if options.fsdp_accumulate == "unsharded":
            fsdp.set_gradient_sync(self.modules, last)

    def watch(self, model: nn.Module) -> fsdp.ForwardWatch:
        return fsdp.forward_watch(unwrap(model))

    def zero_weight(self, pass_: Pass, last: bool, lenient: bool = False, index: int | None = None) -> None:
        """A padding micro-batch (:mod:`mbs_ext.world.padding`), so that FSDP's collectives pair
        up with the other ranks'; its forward is watched afresh."""
        if self.pairing is not None:  # the BatchNorm layers take part with zero rows
            self.pairing.enter(pass_.index if index is None else index, zero_rows=True)
        self._gradient_sync(last, pass_.options)
        pass_.watch.reset()
        pass_.sink.backward(padding.zero_weight_loss(pass_, lenient), 0.0, pass_.options.scaler)

    def catch_up(self, pass_: Pass) -> bool:
        """After a failure at micro-batch ``pass_.index``: if its forward had not begun, run it and
        every later one at zero weight (FSDP's collectives as on the other ranks). False where
        that cannot be done: the forward began, no micro-batch arrived yet, or a zero-weight one
        failed inside the model."""
        if pass_.watch.entered or pass_.template is None:
            return False
        return padding.catch_up(pass_, lambda i: self.zero_weight(pass_, last=i == pass_.padded - 1, lenient=True,
                                                                  index=i))

    def collect(self, normalizer: Normalizer, sink: Sink) -> Record:
        """FSDP reduced the gradients itself; the ranks agree on the rest."""
        layout = Layout(self.size, self.rank)
        total, loss_sum, invalid = normalizer.local_values()
        record = layout.read(all_reduce_sum(layout.pack(
            total=total, loss_sum=loss_sum, invalid_counts=invalid, nonfinite=sink.local_nonfinite(),
        ), normalizer.device, self.group))
        normalizer.settle((record.head("total"), record.head("loss_sum"), record.head("invalid_counts")))
        sink.found = (record.head("nonfinite") > 0).to(torch.float32)
        return record

    def share_failure(self, exc: Exception, micro_batch: int, phase: Phase, caught_up: bool,
                      params: list[nn.Parameter], device: torch.device, requested: torch.dtype | None) -> bool:
        """Before the ranks agreed on their micro-batches, the failure rides in that agreement;
        while streaming, in the step's collective, provided the pass caught up."""
        if phase >= Phase.AGREEING and not caught_up:
            add_note(exc, f"mbs_ext.step: rank {self.rank} failed while streaming under FSDP2 and could not run "
                          "the rest of FSDP's collectives (the failure came inside a forward or backward, or before "
                          "any micro-batch arrived): the other ranks wait in them until the process group times out")
            return False
        failure = Failure(micro_batch, is_out_of_memory(exc))
        tell_others(exc, self.rank, lambda: self._share(failure, phase, device))
        return False  # never backs off (backs_off)

    def _share(self, failure: Failure, phase: Phase, device: torch.device) -> bool:
        """``failure`` in the collective the other ranks are in at ``phase``: the step's own
        while streaming, the micro-batch agreement before it."""
        if phase >= Phase.AGREEING:
            layout = Layout(self.size, self.rank)
            record = layout.read(all_reduce_sum(layout.pack(failure=failure), device, self.group))
            raise_failures(record.failure_slots().tolist(), self.size, self.rank)
        elif self.pairing is not None:
            self.pairing.agree(0.0, [], device, failure)
        else:
            self._agree(0.0, 0, device, failure)
        return False

    def out_of_memory(self, exc: BaseException, together: bool) -> bool:
        return together

    def backs_off(self, streaming: bool, grew: bool = False) -> bool:
        """Never: the probes would run FSDP's collectives on one rank."""
        return False

    def backoff(self, model: nn.Module, device: torch.device) -> tuple[nn.Module, Callable | None]:
        return unwrap(model), None

    def failure_note(self, exc: BaseException, micro_batch_size: int) -> str:
        if micro_batch_size > 1 and is_out_of_memory(exc):
            return ("\nmbs_ext.step: no out-of-memory back-off under FSDP2 (its probes would run FSDP's "
                    "collectives on one rank); pass a smaller micro_batch_size")
        return ""
