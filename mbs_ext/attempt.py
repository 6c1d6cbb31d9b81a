"""One attempt of a streamed step: stream every micro-batch, accumulate, update once.

The attempt records how far it got, so that rollback knows what to undo and an error
can say where it happened. The streamer (:mod:`~mbs_ext.step`) owns the options and
the retry loop; nothing here outlives one attempt.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mbs_ext import accumulate as _acc
from mbs_ext import batch as _batch
from mbs_ext import loss as _loss
from mbs_ext import normalize as _norm
from mbs_ext import update as _update
from mbs_ext.batchnorm import deferred_layers
from mbs_ext.snapshot import ScalerSnapshot, Snapshot
from mbs_ext.update import StepResult


class Attempt:
    """One attempt of the back-off loop: streams every micro-batch, then updates once.

    It records how far it got, so that rollback knows what to undo and an error can
    say where it happened.
    """

    def __init__(
        self,
        streamer: Any,  # the MicroBatchStreamer whose options apply
        params: list[nn.Parameter],
        batch: Any,
        indices: torch.Tensor | None,
        rows: int,
        m: int,
        device: torch.device,
        loss_call: Callable,
    ) -> None:
        self.s = streamer
        self.model = streamer.model
        self.params = params
        self.batch = batch
        self.indices = indices
        self.rows = rows
        self.m = m
        self.ranges = _batch.split_offsets(rows, m)
        self.num_mb = len(self.ranges)
        self.device = device
        self.loss_call = loss_call
        self.index = -1  # micro-batch being processed; num_mb once all have streamed
        self.unscaled = False
        self.updated = False
        self.stepping = False  # the optimizer step began: no redo after this
        self.snapshot = Snapshot(self.model, device)
        scaler = streamer.scaler
        self.scaler_state = ScalerSnapshot(scaler) if scaler is not None else None
        self.bn = deferred_layers(self.model)
        self.ddp = isinstance(self.model, DistributedDataParallel)
        self.group = self.model.process_group if self.ddp else None
        self.world = torch.distributed.get_world_size(self.group) if self.ddp else 1
        self.acc_dtype = _acc.accumulation_dtype(streamer.accumulate_dtype, params)
        self.bufs = _acc.GradBuffers(params, self.acc_dtype) if self.acc_dtype is not None else None
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.local_total: _norm.Count = 0.0
        # Device counts are validated on the device: 1 + the first micro-batch whose count is
        # invalid (0: none; after DDP's collective, -1: only another rank's), read in the probe.
        self.bad_count: torch.Tensor | None = None
        self.found: torch.Tensor | None = None  # non-finite flag over all DDP ranks (buffered grads)
        self.compute_s = 0.0

    def where(self) -> str:
        if self.index < 0:
            return "mbs_ext.step: failed before the first micro-batch"
        if self.index >= self.num_mb:
            return f"mbs_ext.step: failed after all {self.num_mb} micro-batches, while finishing the step"
        start, stop = self.ranges[self.index]
        of = "indices" if self.indices is not None else "the mini-batch"
        return (
            f"mbs_ext.step: failed at micro-batch {self.index} of {self.num_mb} "
            f"(rows [{start}, {stop}) of {of})"
        )

    def _clear_grads(self) -> None:
        for p in self.params:
            p.grad = None
        self.s.optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def rollback(self, clear_grads: bool, restore_scaler: bool = True, restore_rng: bool = True) -> None:
        """Undo every change made before the optimizer step; the RNG too when the step may be
        redone or retried (a redo draws the same), not for a skipped step, after which
        training goes on as after any step (the next one draws new random numbers)."""
        for layer in self.bn:
            layer.discard()
        self.snapshot.restore_buffers()
        if restore_rng:
            self.snapshot.restore_rng()
        if clear_grads:
            self._clear_grads()
        scaler = self.s.scaler
        if restore_scaler and scaler is not None and self.scaler_state is not None:
            if self.unscaled and not self.updated:
                with contextlib.suppress(Exception):
                    scaler.update()  # drops the per-optimizer unscale record
            self.scaler_state.restore()

    def run(self) -> StepResult:
        for layer in self.bn:
            layer.begin_mini_batch()
        self._clear_grads()
        ring = self.s.state.ring_for(self.device)
        # A CPU model reads row ranges of the host batch in place: nothing to stage.
        it = iter(ring.stream(self.batch, self.m, indices=self.indices, copy=self.device.type != "cpu"))
        # Provisional denominator: exact when known ahead, otherwise fixed by the first
        # count; the gradient accumulated so far is rescaled once the total is known.
        denom: _norm.Count | None = None
        if not _norm.needs_count_pass(self.s.normalize):
            denom = float(self.rows) if self.s.normalize == "samples" else float(self.num_mb)
        try:
            for i in range(self.num_mb):
                self.index = i
                mb = next(it, _END)
                if mb is _END:
                    raise RuntimeError(f"the ring yielded {i} micro-batches, expected {self.num_mb}")
                t0 = time.perf_counter()
                c = self._count(mb)
                if denom is None:
                    denom = _provisional(c, self.num_mb)
                self._micro_batch(mb, c, denom, last=i == self.num_mb - 1)
                self.compute_s += time.perf_counter() - t0
            self.index = self.num_mb
            if next(it, _END) is not _END:
                raise RuntimeError(f"the ring yielded more than the expected {self.num_mb} micro-batches")
        finally:
            close = getattr(it, "close", None)
            if close is not None and self.index < self.num_mb:
                close()
        return self._finish(denom, ring)

    def _count(self, mb: Any) -> _norm.Count:
        rows_i = _batch.tensor_leaves(mb)[0].shape[0]
        c = _norm.count(self.s.normalize, mb, rows_i)
        if isinstance(c, torch.Tensor) and c.device.type == "cpu" and self.device.type != "cpu":
            c = _norm.check_count(c)  # read on the host: a copy to the device would block per micro-batch
        if isinstance(c, torch.Tensor):
            c = c.to(self.device)
            mark = _norm.invalid_count(c).to(torch.float64) * float(self.index + 1)
            self.bad_count = mark if self.bad_count is None else torch.where(self.bad_count > 0, self.bad_count, mark)
        self.local_total = self.local_total + c
        return c

    def _micro_batch(self, mb: Any, c: _norm.Count, denom: _norm.Count, last: bool) -> None:
        """Forward, loss and backward of one micro-batch of count ``c``."""
        buffered = self.bufs is not None
        syncing = self.ddp and last and not buffered
        host_zero = not isinstance(c, torch.Tensor) and c == 0
        if host_zero and not syncing:  # zero items: nothing to learn, skip the forward
            if last and not buffered:
                self._settle(denom)
            return
        with self.model.no_sync() if self.ddp and not syncing else contextlib.nullcontext():
            with _loss.autocast(self.device, self.s.autocast_dtype):
                loss = self.loss_call(self.model, mb)
            _loss.check_loss(loss, self.device)
            if loss.dtype in _acc.LOW_PRECISION:
                loss = loss.float()
            self._add_loss(loss.detach(), c)
            if last and not buffered:
                # Exact normalization is needed now, before the (syncing) last backward.
                weight = c * self.world / self._settle(denom)
            else:
                weight = c / denom
            if host_zero:
                # Zero items: DDP still needs its one syncing backward; zero gradients
                # reach every parameter.
                torch.autograd.backward([p.reshape(-1)[:1].sum() * 0.0 for p in self.params])
                return
            self._backward(loss, weight, buffered)
        if buffered:
            self.bufs.add_(weight)

    def _add_loss(self, loss: torch.Tensor, c: _norm.Count) -> None:
        if isinstance(c, torch.Tensor):
            # A zero-count micro-batch's mean loss may be NaN (0/0): select, don't multiply.
            self.loss_sum += torch.where(c > 0, loss.double() * c, torch.zeros_like(c))
        elif c != 0:
            self.loss_sum += loss.double() * c

    def _backward(self, loss: torch.Tensor, weight: _norm.Count, buffered: bool) -> None:
        if not buffered:
            loss = loss * (weight.to(loss.dtype) if isinstance(weight, torch.Tensor) else weight)
        if self.s.scaler is not None:
            loss = self.s.scaler.scale(loss)
        loss.backward()

    def _settle(self, denom: _norm.Count) -> _norm.Count:
        """The global total; rescales the gradient accumulated so far to it (no host sync)."""
        total: _norm.Count = self.local_total
        if self.ddp:
            # A bad count on one rank is already in the total: every rank must learn of it and fail.
            values = _norm.all_reduce_sum([total, self.loss_sum, self._bad_flag()], self.device, self.group)
            total, self.loss_sum = values[0], values[1]
            self._merge_bad(values[2])
        if self.index > 0:
            _acc.rescale_grads(self.params, _norm.ratio(denom * self.world, total))
        self.global_total = total
        return total

    def _finish_buffers(self, denom: _norm.Count) -> None:
        """Global totals, then the float buffers rescaled, summed over ranks and cast into ``.grad``."""
        total: _norm.Count = self.local_total
        got_any: list = self.bufs.got
        if self.ddp:
            # One collective: the totals, any rank's bad count and non-finite flag (the summed
            # buffers carry every rank's inf/NaN, so every rank must skip alike), and which
            # parameters got a gradient on some rank.
            head = [total, self.loss_sum, self._bad_flag(), self.bufs.nonfinite(self.device)]
            values = _norm.all_reduce_sum(head, self.device, self.group, host_tail=[float(g) for g in got_any])
            total, self.loss_sum = values[0], values[1]
            self._merge_bad(values[2])
            self.found = (values[3] > 0).to(torch.float32)
            if not all(got_any):
                # Which .grad exist must be known on the host (a host sync, only when this
                # rank's micro-batches left some parameter without a gradient).
                got_any = [v > 0 for v in values[len(head) :].tolist()]
        # The buffers are summed over ranks, so no world-size factor here.
        self.bufs.finish(_norm.ratio(denom, total), got_any, self.group)
        self.global_total = total

    def _finish(self, denom: _norm.Count, ring: Any) -> StepResult:
        t_step = time.perf_counter()
        s = self.s
        if self.bufs is not None:
            self._finish_buffers(denom)
        if s.scaler is not None:
            self.unscaled = True
            s.scaler.unscale_(s.optimizer)
        outcome, norm = _update.probe(
            self.params, self.device, self.loss_sum, self.global_total, self._nonfinite(), self.bad_count,
            s.max_grad_norm, self._name_bad_count,
        )
        skipped = _update.should_skip(outcome, s.scaler, s.on_nonfinite)
        if skipped:
            if s.scaler is not None:
                s.scaler.update()  # backs off when the gradients overflowed
                self.updated = True
            self.rollback(clear_grads=False, restore_scaler=False, restore_rng=False)
        else:
            for layer in self.bn:
                layer.commit()
            self.stepping = True
            _update.apply(self.params, s.optimizer, s.scaler, s.max_grad_norm, norm)
            self.updated = s.scaler is not None
        stats = ring.stats()  # totals of this step's stream
        timings = {k: float(stats.get(k, 0.0)) for k in ("stage_s", "wait_s")}
        timings.update(compute_s=self.compute_s, step_s=time.perf_counter() - t_step)
        return StepResult(
            loss=outcome.loss, num_micro_batches=self.num_mb, micro_batch_size=self.m, num_samples=self.rows,
            skipped=skipped, grad_norm=outcome.grad_norm, timings=timings,
        )

    def _bad_flag(self) -> torch.Tensor | float:
        return (self.bad_count > 0).to(torch.float64) if self.bad_count is not None else 0.0

    def _merge_bad(self, ranks_with_bad: torch.Tensor) -> None:
        """After the collective: keep this rank's first bad micro-batch, or -1 if only another rank had one."""
        local = self.bad_count if self.bad_count is not None else torch.zeros_like(ranks_with_bad)
        self.bad_count = torch.where(ranks_with_bad > 0, torch.where(local > 0, local, -1.0), 0.0)

    def _name_bad_count(self, mark: float) -> str:
        """Where the first invalid device count came from, for the error."""
        if mark < 0:
            return "on another DDP rank"
        k = int(mark) - 1
        start, stop = self.ranges[k]
        of = "indices" if self.indices is not None else "the mini-batch"
        return f"at micro-batch {k} of {self.num_mb} (rows [{start}, {stop}) of {of})"

    def _nonfinite(self) -> torch.Tensor:
        """Device flag for non-finite gradients, from the cheapest source at hand."""
        if self.bufs is not None:
            # Flagged by the fused op while accumulating (summed over the DDP ranks when
            # there are several), or by the cast of the sums into fp16 grads (the same on
            # every rank: the sums are).
            found = self.found if self.found is not None else self.bufs.nonfinite(self.device)
            return torch.maximum(found, _acc.overflow_on_cast(self.params, self.device))
        if self.s.max_grad_norm is not None:  # the norm computed for clipping covers it
            return torch.zeros((), dtype=torch.float32, device=self.device)
        return _acc.nonfinite_flag([p.grad for p in self.params if p.grad is not None], self.device)


def _provisional(c: _norm.Count, num_mb: int) -> _norm.Count:
    """A denominator of the right magnitude before the total is known: first count times M."""
    if isinstance(c, torch.Tensor):
        return c.clamp(min=1.0) * num_mb
    return max(c, 1.0) * num_mb


_END = object()
