"""The micro-batch streamed training step: ``MicroBatchStreamer``, ``step`` and ``accumulate``.

``step(model, optimizer, batch, loss_fn, micro_batch_size=m)`` equals
``optimizer.zero_grad(); loss_fn(model, batch).backward(); optimizer.step()`` on the
whole mini-batch, while only one micro-batch at a time lives on the model's device.
``accumulate(model, batch, loss_fn, ...)`` is the same without the optimizer step:
the mini-batch's gradients in ``.grad``, for code that owns the step (a Trainer, a
framework's optimizer loop). Both run one code path; only the finish differs.

This module only sequences; each component is handed what it needs and data flows one
way: options (:mod:`~mbs_ext.options`) → checks (:mod:`~mbs_ext.model`,
:mod:`~mbs_ext.batch`, :mod:`~mbs_ext.loss`) → micro-batch size (fixed, planned by
:mod:`~mbs_ext.planner`, or learned by :mod:`~mbs_ext.backoff`) → the ring
(:mod:`~mbs_ext.ring`) streams micro-batches into the pass
(:mod:`~mbs_ext.forward_backward`), which weights them (:mod:`~mbs_ext.normalize`) and
adds their gradients into a sink (:mod:`~mbs_ext.grads`) → the finish
(:mod:`~mbs_ext.finish`: one host sync, skip or step). Until the optimizer steps,
everything is undone on any error (:mod:`~mbs_ext.rollback`).
"""

from __future__ import annotations

import operator
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mbs_ext import backoff, gather, planner, probe, sharded
from mbs_ext import batch as _batch
from mbs_ext import cached as _cached_loss
from mbs_ext import loss as _loss
from mbs_ext import model as _model
from mbs_ext.batchnorm import deferring, warn_split_statistics
from mbs_ext.cached import CachedLoss
from mbs_ext.finish import StepResult, finish, finish_gradients
from mbs_ext.forward_backward import ForwardBackward
from mbs_ext.grads import make_sink, sink_dtype
from mbs_ext.messages import add_note
from mbs_ext.normalize import Normalizer, Rule, counts_ahead, on_trust
from mbs_ext.options import StepOptions, make_options
from mbs_ext.ranks import Failure, PeerFailed, Ranks, unwrap
from mbs_ext.ring import StreamRing, split_sizes
from mbs_ext.rollback import StepGuard

__all__ = ["MicroBatchStreamer", "StepOptions", "StepResult", "accumulate", "step"]


@dataclass
class _Cache:
    """What a streamer keeps between steps (and ``step`` keeps per model)."""

    ring: StreamRing | None = None
    plans: dict[tuple, planner.MicroBatchPlan] = field(default_factory=dict)  # "auto", per signature
    size_cap: dict[tuple, int] = field(default_factory=dict)  # learned from out-of-memory back-off
    bound: tuple | None = None  # (what it depends on, params, device, ranks) of the latest step

    def bind(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, process_group: Any,
             found: _model.Members) -> tuple[list[nn.Parameter], torch.device, Ranks]:
        """The model's trainable parameters (checked against the optimizer), its device and its ranks.

        The parameters are looked up every step (``found``: a user may freeze, thaw or add
        some between steps); the rest is redone when they, their device, the optimizer or
        the state of torch.distributed changed, so a steady loop skips the walks through the
        wrappers and the ownership check (what a framework's optimizer wrapper says is read
        every step: it changes inside its accumulation context).
        """
        params = _model.trainable(model, found)
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 0
        key = (optimizer, process_group, params[0].device, world)
        bound = self.bound
        if bound is not None and bound[0] == key and len(bound[1]) == len(params) \
                and all(map(operator.is_, bound[1], params)):
            if optimizer is not None:
                _model.check_framework_optimizer(optimizer)
            return bound[1], bound[2], bound[3]
        self.bound = None
        params = _model.check_model_optimizer(model, optimizer, found)
        device = _model.model_device(model)
        ranks = Ranks.of(model, params, process_group)
        self.bound = (key, params, device, ranks)
        return params, device, ranks

    def ring_for(self, device: torch.device) -> StreamRing:
        if self.ring is None or self.ring.device != device:
            self.ring = StreamRing(device)
        return self.ring

    def size_for(self, model: nn.Module, opts: StepOptions, call: _Call) -> tuple[int, tuple]:
        """The size to stream with, and the key under which out-of-memory back-off remembers one."""
        leaves = call.info.signature
        if opts.micro_batch_size != "auto":
            key: tuple = ("fixed", leaves)
            m = int(opts.micro_batch_size)
        else:
            # Keyed on the caller's budget, not on a measured free-memory figure that
            # moves from step to step, so plans and back-off sizes stay remembered.
            key = ("auto", leaves, opts.memory_budget, opts.autocast_dtype)
            plan = self.plans.get(key)
            # A plan is capped by the rows of the batch it was made for; a larger batch
            # with the same signature may afford a larger micro-batch, so re-plan then.
            if plan is None or (plan.micro_batch_size >= plan.num_rows and call.info.rows > plan.num_rows):
                plan = planner.plan(
                    model, call.batch, call.loss_call, planner.default_budget(call.device, opts.memory_budget),
                    num_rows=call.info.rows, indices=call.info.indices,
                    accumulate_dtype=sink_dtype(opts.accumulate_dtype, call.params, call.ranks.summing),
                    autocast_dtype=opts.autocast_dtype,
                )
                self.plans[key] = plan
            m = plan.micro_batch_size
        return max(1, min(m, self.size_cap.get(key, m), call.info.rows)), key


@dataclass
class _Call:
    """One ``step`` call's checked inputs."""

    params: list[nn.Parameter]
    batch: Any
    info: _batch.BatchInfo
    device: torch.device
    ranks: Ranks
    rule: Rule
    loss_call: Callable[[nn.Module, Any], torch.Tensor]
    batchnorms: list = field(default_factory=list)
    normalizing: list = field(default_factory=list)  # BatchNorms using batch statistics: warned of when split
    found: _model.Members | None = None  # the model's walk: its buffers, for the rollback snapshot


class MicroBatchStreamer:
    """A reusable streamed training step bound to one model, optimizer and loss.

    Options are a :class:`~mbs_ext.StepOptions` (``options=``) and/or its fields as
    keywords; they are validated once, here. The ring that stages micro-batches is made
    on first use and kept (or pass your own ``ring=``), so repeated steps reuse its
    host/device buffers.

    The batch may live on the host (pageable or pinned) or on the model's device. Under
    DistributedDataParallel (also behind ``torch.compile`` or Fabric) the step equals a
    single-process step on the ranks' rows together, and an error on one rank makes every
    rank undo the step and raise (:mod:`~mbs_ext.gather`). A failure inside
    ``optimizer.step`` itself is not undone (that would need a copy of the parameters and
    optimizer state every step).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor],
        *,
        options: StepOptions | None = None,
        ring: StreamRing | None = None,
        **overrides: Any,
    ) -> None:
        _model.check_model_optimizer(model, optimizer)
        _loss.check_loss_fn(loss_fn)
        self.options = make_options(options, overrides)
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.cache = _Cache(ring=ring)
        # The count rule and the loss call, by the loss's reduction (a caller may change it) and pair-ness.
        self._loss_calls: dict[tuple, tuple[Rule, Callable[[nn.Module, Any], torch.Tensor]]] = {}

    @property
    def ring(self) -> StreamRing | None:
        """The ring the steps stream through (None before the first step unless one was given)."""
        return self.cache.ring

    def plans(self) -> dict[tuple, planner.MicroBatchPlan]:
        """The micro-batch plans made for ``"auto"`` so far, by input signature."""
        return dict(self.cache.plans)

    def step(self, batch: Any, indices: torch.Tensor | None = None) -> StepResult:
        """One optimizer step over the mini-batch ``batch`` (or its rows at ``indices``).

        If a micro-batch runs out of memory (``torch.OutOfMemoryError`` on a device, or a
        host allocation failure), the step is undone, a few single-micro-batch probes find
        the largest size that fits, and the step is redone from scratch at that size,
        which is remembered for later steps.
        """
        if self.optimizer is None:
            raise TypeError("this streamer has no optimizer (optimizer=None): call accumulate(), or pass one")
        return self._run(batch, indices, stepping=True)

    def accumulate(self, batch: Any, indices: torch.Tensor | None = None) -> StepResult:
        """The gradients of the whole mini-batch in ``.grad`` (replacing what was there), exactly
        normalized, with no optimizer step: :meth:`step` without the update. Running statistics
        of BatchNorm layers are committed once. Gradients stay scaled when a ``scaler`` is given
        (for the caller's ``scaler.unscale_``/``step``). A non-finite loss or gradient is left in
        ``.grad`` for the caller's step to judge; with ``on_nonfinite="raise"`` it raises
        FloatingPointError instead. On any error ``.grad`` and the module buffers are as before."""
        if self.options.max_grad_norm is not None:
            raise ValueError("max_grad_norm: accumulate() takes no optimizer step, so it does not clip; "
                             "clip in your own step (torch.nn.utils.clip_grad_norm_)")
        return self._run(batch, indices, stepping=False)

    def _run(self, batch: Any, indices: Any, stepping: bool) -> StepResult:
        if isinstance(self.loss_fn, CachedLoss):  # three passes; its last is this method's own
            return _cached_loss.run(self, batch, indices, stepping)
        t_begin = time.perf_counter()
        _model.check_grad_mode()  # what every rank has alike (model, options) is checked alone, first
        found = _model.members(self.model)  # the one walk over the model's modules this step
        params, device, ranks = self.cache.bind(self.model, self.optimizer, self.options.process_group, found)
        progress = _Progress(ranks)
        try:
            call = self._check(batch, indices, params, device, ranks, found)
            with deferring(self.model, found.modules) as (call.batchnorms, call.normalizing):
                size, key = self.cache.size_for(self.model, self.options, call)
                result = backoff.with_backoff(
                    lambda m: self._attempt(call, m, progress, stepping), size,
                    remember=lambda smaller: self.cache.size_cap.__setitem__(key, smaller),
                    **_backoff_hooks(self.model, call, self.options, progress),
                )
        except Exception as exc:
            progress.share_failure(exc, params, device, self.options.accumulate_dtype)
            raise
        result.timings["total_s"] = time.perf_counter() - t_begin
        return result

    def _check(self, batch: Any, indices: Any, params: list[nn.Parameter], device: torch.device,
               ranks: Ranks, found: _model.Members) -> _Call:
        """Every check of a call's inputs, before anything changes."""
        info = _batch.check(batch, indices, device)
        _model.check_scaler_params(self.options.scaler, params, device)
        if ranks.fsdp:
            sharded.check_options(self.options, sink_dtype(self.options.accumulate_dtype, params, False))
        made = _rule_and_call(self._loss_calls, self.loss_fn, self.options.normalize, info.pair)
        return _Call(params, batch, info, device, ranks, *made, found=found)

    def _attempt(self, call: _Call, m: int, progress: _Progress, stepping: bool) -> StepResult:
        """Stream every micro-batch at size ``m`` and finish; on any error undo everything first."""
        sizes = _split(self.model, call, m)
        opts, device = self.options, call.device
        optimizer = self.optimizer if stepping else None
        ranks = call.ranks
        guard = StepGuard(call.found, call.params, optimizer, opts.scaler, device, call.batchnorms)
        progress.begin(guard)
        sink = None
        try:
            guard.begin()  # old gradients go before new buffers are allocated
            progress.buffers_synced = True  # (a failure inside this collective cannot be joined)
            ranks.sync_buffers()
            sink = make_sink(call.params, device, opts.accumulate_dtype, distributed=ranks.summing)
            ahead = None if on_trust(call.rule, len(sizes), ranks) else \
                counts_ahead(call.rule, call.info.targets, call.info.indices, sizes)
            normalizer = Normalizer(call.rule, rows=call.info.rows, num_micro_batches=len(sizes), device=device,
                                    ranks=ranks, ahead=ahead)
            padded = _agree_sharded(call, normalizer, sizes, progress) if ranks.fsdp else None
            progress.fb = ForwardBackward(self.model, call.loss_call, opts, normalizer, sink, ranks, device,
                                          len(sizes), padded)
            ring = self.cache.ring_for(device)
            with sharded.summing(ranks.fsdp):
                # A CPU model reads row ranges of the host batch in place: nothing to stage.
                progress.fb.run(ring.stream(call.batch, m, indices=call.info.indices, copy=device.type != "cpu"))
            progress.agreed = ranks.group is not None  # from here on, failures are not joined
            agreement = gather.gather(normalizer, sink, ranks)
            t_finish = time.perf_counter()
            if stepping:
                done = finish(call.params, sink, normalizer, opts, self.optimizer, guard, device, agreement)
            else:
                done = finish_gradients(sink, normalizer, opts, guard, device, agreement)
        except BaseException as exc:
            guard.rollback(clear_grads=True)
            if sink is not None:
                sink.release()
            if not isinstance(exc, PeerFailed):
                add_note(exc, progress.where(call, m, exc))
            if isinstance(exc, Exception):  # before back-off: every rank must decide alike
                progress.share_failure(exc, call.params, device, opts.accumulate_dtype)
            raise
        stats = ring.stats()  # totals of this step's stream
        timings = {k: float(stats.get(k, 0.0)) for k in ("stage_s", "wait_s")}
        timings.update(compute_s=progress.fb.compute_s, step_s=time.perf_counter() - t_finish)
        return StepResult(
            loss=done.loss, num_micro_batches=len(sizes), micro_batch_size=sizes[0], num_samples=call.info.rows,
            skipped=done.skipped, grad_norm=done.grad_norm, timings=timings,
        )


def _rule_and_call(made: dict, loss_fn: Callable, normalize: Any, pair: bool) -> tuple[Rule, Callable]:
    """The count rule and the loss call, made once per loss reduction (a caller may change it
    between steps) and batch kind: the checks behind them need not run every step."""
    key = (getattr(loss_fn, "reduction", None), pair)
    if key not in made:
        made[key] = (_loss.rule_for(loss_fn, normalize), _loss.loss_caller(loss_fn, pair))
    return made[key]


def _split(model: nn.Module, call: _Call, m: int) -> list[int]:
    """The micro-batch sizes of an attempt at size ``m``. Split through BatchNorm layers that use
    batch statistics, the step is no longer the full batch's: warned of once per model."""
    sizes = split_sizes(call.info.rows, m)
    warn_split_statistics(model, call.normalizing, len(sizes))
    return sizes


def _agree_sharded(call: _Call, normalizer: Normalizer, sizes: list[int], progress: _Progress) -> int:
    """FSDP2: count every micro-batch ahead, then agree with the other ranks on the number of
    micro-batches each runs and on the total (:mod:`mbs_ext.sharded`)."""
    slices = _batch.row_slices(call.batch, sizes, call.info.indices,
                               needed=normalizer.ahead is None and call.rule.kind == "count")
    local_total = normalizer.count_ahead(slices)
    progress.planned = True  # (a failure inside this collective cannot be joined)
    padded, total = call.ranks.agree_micro_batches(local_total, len(sizes), call.device)
    normalizer.agree(total)
    return padded


def _backoff_hooks(model: nn.Module, call: _Call, options: StepOptions, progress: _Progress) -> dict[str, Any]:
    """What out-of-memory back-off needs: which errors it may cure, the probe, and across ranks
    (DDP) the agreement on one size. Probes run on the module under DDP: no collectives."""
    ranks = call.ranks
    probed = unwrap(model) if ranks.group is not None else model
    return {
        "retryable": lambda exc: progress.retryable,
        "out_of_memory": progress.out_of_memory,
        "fits_at": lambda m: probe.fits(probed, call.batch, call.info.indices, m, call.device, call.loss_call,
                                        options.autocast_dtype),
        "free": lambda: probe.release_cached_memory(call.device),
        "agree": (lambda size: ranks.agree_size(size, call.device)) if ranks.group is not None else None,
    }


class _Progress:
    """How far the latest attempt got: what back-off, error notes and a failing rank need to know."""

    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks
        self.fb: ForwardBackward | None = None
        self.guard: StepGuard | None = None
        self.buffers_synced = False  # the step's buffer broadcast (DDP) began
        self.planned = False  # FSDP2: the ranks agreed on their micro-batches
        self.agreed = False  # the step's collective began: a failure is no longer joined
        self.shared = False  # this attempt's failure was shared with the other ranks
        self.oom_together = False  # ... and every rank that failed ran out of memory while streaming

    def begin(self, guard: StepGuard) -> None:
        self.fb, self.guard = None, guard
        self.buffers_synced = self.planned = self.agreed = self.shared = self.oom_together = False

    @property
    def streaming(self) -> bool:
        return self.fb is not None and 0 <= self.fb.index < self.fb.num_mb

    def share_failure(self, exc: Exception, params: list[nn.Parameter], device: torch.device,
                      accumulate_dtype: torch.dtype | None) -> None:
        """Across ranks, a failure before the step's collective: take part in it so that every rank
        raises (:func:`mbs_ext.gather.join`). Not for PeerFailed: the others know already."""
        if isinstance(exc, PeerFailed):
            self.oom_together = exc.out_of_memory
        if self.ranks.group is None or self.agreed or self.shared or isinstance(exc, PeerFailed):
            return
        self.shared = True
        self.oom_together = gather.join(exc, self.ranks, params, device, sink_dtype(accumulate_dtype, params, True),
                                        Failure(self.micro_batch, probe.is_out_of_memory(exc)), self)

    def out_of_memory(self, exc: BaseException) -> bool:
        """Whether a smaller micro-batch may cure ``exc``: across ranks, what the failure record
        they shared says (every rank reads the same), not this rank's own error."""
        return probe.is_out_of_memory(exc) if self.ranks.group is None else self.oom_together

    @property
    def micro_batch(self) -> int:
        """The micro-batch in progress (-1 before the first)."""
        return self.fb.index if self.fb is not None and self.fb.index < self.fb.padded else -1

    @property
    def retryable(self) -> bool:
        """Back off only where a smaller micro-batch helps (out of memory while streaming, not in
        the finish) and only while nothing irreversible happened. Across ranks (DDP), when every
        rank that failed ran out of memory while streaming (:meth:`out_of_memory`); not under
        FSDP2, whose probes would run its collectives on one rank."""
        if self.guard is None or self.guard.stepping:
            return False
        return self.streaming if self.ranks.group is None else not self.ranks.fsdp

    def where(self, call: _Call, m: int, exc: BaseException) -> str:
        fb = self.fb
        if fb is None or fb.index < 0:
            text = "mbs_ext.step: failed before the first micro-batch"
        elif fb.index >= fb.padded:
            text = f"mbs_ext.step: failed after all {fb.num_mb} micro-batches, while finishing the step"
        elif fb.index >= fb.num_mb:
            text = (f"mbs_ext.step: failed at micro-batch {fb.index}, one of zero weight that keeps FSDP's "
                    f"collectives paired with ranks that have more")
        elif fb.rows is None:
            text = f"mbs_ext.step: failed at micro-batch {fb.index} of {fb.num_mb}, while the ring made it"
        else:
            of = "indices" if call.info.indices is not None else "the mini-batch"
            text = (f"mbs_ext.step: failed at micro-batch {fb.index} of {fb.num_mb} "
                    f"(rows [{fb.rows[0]}, {fb.rows[1]}) of {of})")
        if self.ranks.fsdp and m > 1 and probe.is_out_of_memory(exc):
            text += ("\nmbs_ext.step: no out-of-memory back-off under FSDP2 (its probes would run FSDP's "
                     "collectives on one rank); pass a smaller micro_batch_size")
        return text


_CACHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    *,
    indices: torch.Tensor | None = None,
    options: StepOptions | None = None,
    **overrides: Any,
) -> StepResult:
    """One optimizer step over ``batch``, streamed in micro-batches; see :class:`MicroBatchStreamer`
    and :class:`StepOptions` (pass ``options=`` and/or its fields as keywords).

    The ring, the "auto" plans and sizes learned from out-of-memory back-off are cached
    per model, so calling ``step`` in a loop reuses them.
    """
    return _cached(MicroBatchStreamer(model, optimizer, loss_fn, options=options, **overrides)).step(batch, indices)


def accumulate(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    *,
    indices: torch.Tensor | None = None,
    options: StepOptions | None = None,
    **overrides: Any,
) -> StepResult:
    """The exactly normalized gradients of ``batch`` in ``.grad``, streamed in micro-batches, with
    no optimizer step; see :meth:`MicroBatchStreamer.accumulate`. ``step`` is this plus the update."""
    return _cached(MicroBatchStreamer(model, None, loss_fn, options=options, **overrides)).accumulate(batch, indices)


def _cached(streamer: MicroBatchStreamer) -> MicroBatchStreamer:
    """``streamer`` with the ring, plans and learned sizes kept for its model."""
    cache = _CACHES.get(streamer.model)
    if cache is None:
        _CACHES[streamer.model] = streamer.cache
    else:
        streamer.cache = cache
    return streamer
