"""The micro-batch streamed training step: ``MicroBatchStreamer``, ``step`` and ``accumulate``.

``step(model, optimizer, batch, loss_fn, micro_batch_size=m)`` equals
``optimizer.zero_grad(); loss_fn(model, batch).backward(); optimizer.step()`` on the
whole mini-batch, while only one micro-batch at a time lives on the model's device.
``accumulate(model, batch, loss_fn, ...)`` is the same without the optimizer step:
the mini-batch's gradients in ``.grad``, for code that owns the step (a Trainer, a
framework's optimizer loop). Both run one code path; only the finish differs.

This module only sequences; each component is handed what it needs and data flows one
way: options (:mod:`~mbs_ext.model.options`) → checks (:mod:`~mbs_ext.model.members`,
:mod:`~mbs_ext.streaming.batch`, :mod:`~mbs_ext.counts.loss`) → micro-batch size (fixed, planned by
:mod:`~mbs_ext.memory.planner`, or learned by :mod:`~mbs_ext.memory.backoff`) → the ring
(:mod:`~mbs_ext.streaming.ring`) streams micro-batches into the pass
(:mod:`~mbs_ext.step.forward_backward`), which weights them (:mod:`~mbs_ext.counts.normalize`,
counts from :mod:`~mbs_ext.counts.sources`) and adds their gradients into a sink
(:mod:`~mbs_ext.model.grads`) → the world's collective (:mod:`~mbs_ext.world`) → the finish
(:mod:`~mbs_ext.step.finish`: one host sync, skip or step). Until the optimizer steps,
everything is undone on any error (:mod:`~mbs_ext.model.rollback`). What differs between one
process, DDP replicas and FSDP2 shards is the world's, called through its hooks; this
module does not ask which world it runs in.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mbs_ext.counts import loss as _loss
from mbs_ext.counts.noise import NoiseScale
from mbs_ext.memory import backoff
from mbs_ext.memory.axis import axis
from mbs_ext.model import members as _model
from mbs_ext.model.batchnorm import deferring
from mbs_ext.model.options import StepOptions, make_options
from mbs_ext.step import cached as _cached_loss
from mbs_ext.step.attempt import Attempt, Call
from mbs_ext.step.cache import Binding, Plans, StepCache
from mbs_ext.step.finish import StepResult
from mbs_ext.streaming import batch as _batch
from mbs_ext.streaming.ring import StreamRing

__all__ = ["MicroBatchStreamer", "StepOptions", "StepResult", "accumulate", "step"]


class MicroBatchStreamer:
    """A reusable streamed training step bound to one model, optimizer and loss.

    Options are a :class:`~mbs_ext.StepOptions` (``options=``) and/or its fields as
    keywords; they are validated once, here. The ring that stages micro-batches is made
    on first use and kept (or pass your own ``ring=``), so repeated steps reuse its
    host/device buffers.

    The batch may live on the host (pageable or pinned) or on the model's device. Under
    DistributedDataParallel (also behind ``torch.compile`` or Fabric) the step equals a
    single-process step on the ranks' rows together, and an error on one rank makes every
    rank undo the step and raise (:mod:`~mbs_ext.world`). A failure inside
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
        self.cache = StepCache(ring=ring)
        self.noise = NoiseScale()  # the gradient noise's moving averages, with noise_scale (docs/noise-scale.md)
        # The count rule and the loss call, by the loss's reduction (a caller may change it) and pair-ness.
        self._loss_calls: dict[tuple, tuple] = {}  # (rule, call) per loss reduction and batch kind

    @property
    def ring(self) -> StreamRing | None:
        """The ring the steps stream through (None before the first step unless one was given)."""
        return self.cache.ring

    def state_dict(self) -> dict:
        """What a resumed run needs of this streamer: the gradient noise's moving averages."""
        return {"noise": self.noise.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.noise.load_state_dict(state["noise"])

    def plans(self) -> Plans:
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
        (for the caller's ``scaler.unscale_``/``step``). A non-finite loss or gradient (not a
        scaler's overflow, which is the caller's scaler's to handle) takes the step's policy: by
        default ``.grad`` and the buffers stay as before, ``skipped=True`` and a RuntimeWarning
        names the micro-batch; with ``on_nonfinite="raise"`` it raises FloatingPointError instead.
        On any error ``.grad`` and the module buffers are as before."""
        if self.options.max_grad_norm is not None:
            raise ValueError("max_grad_norm: accumulate() takes no optimizer step, so it does not clip; "
                             "clip in your own step (torch.nn.utils.clip_grad_norm_)")
        return self._run(batch, indices, stepping=False)

    def _run(self, batch: Any, indices: Any, stepping: bool) -> StepResult:
        """The one way in for every loss: a ``CachedLoss`` first prepares (its passes 1 and 2), then
        its pass 3 streams here as any loss does."""
        t_begin = time.perf_counter()
        loss_fn, options, loss_calls, prepared = self.loss_fn, self.options, self._loss_calls, None
        if isinstance(loss_fn, _cached_loss.CachedLoss):
            prepared = _cached_loss.prepare(loss_fn, self.model, options, batch, indices, self.cache.plans)
            # Its per-micro-batch loss is made anew each step: no rule or call is kept for it.
            loss_fn, options, batch, indices, loss_calls = prepared.loss_fn, prepared.options, prepared.batch, None, {}
        result = self._stream(batch, indices, stepping, loss_fn, options, loss_calls)
        if prepared is not None:
            result = dataclasses.replace(result, loss=float(prepared.value))
        result.timings["total_s"] = time.perf_counter() - t_begin
        return result

    def _stream(self, batch: Any, indices: Any, stepping: bool, loss_fn: Callable, options: StepOptions,
                loss_calls: dict) -> StepResult:
        """Check, size and run one step of ``loss_fn`` under ``options``, with back-off."""
        _model.check_grad_mode()  # what every rank has alike (model, options) is checked alone, first
        found = _model.members(self.model)  # the one walk over the model's modules this step
        binding = self.cache.bind(self.model, self.optimizer, options.process_group, found)
        binding.world.pair(found.modules)  # before anything can fail: a failure must reach every rank alike
        attempt = Attempt(binding.world, self.noise)
        optimizer = self.optimizer if stepping else None
        try:
            call = self._check(batch, indices, binding, found, loss_fn, options, loss_calls)
            with deferring(self.model, found.modules) as (call.batchnorms, call.normalizing):
                size, key = self.cache.size_for(self.model, options, batch, call.info, binding, call.loss_call)
                # Probes run on the module the world names (under DDP: no collectives).
                probed, agree = binding.world.backoff(self.model, binding.device)
                planned = self.cache.tokens_for(self.model, options, batch, call.info, binding, call.loss_call)
                shrunk = axis(probed, call, planned, size, key, self.cache.size_cap,
                              lambda options, m: attempt.run(self.model, optimizer, options,
                                                             self.cache.ring_for(binding.device), call, m))
                result = backoff.with_backoff(
                    shrunk.attempt, shrunk.start, unit=shrunk.unit, remember=shrunk.remember,
                    retryable=attempt.retryable, out_of_memory=attempt.out_of_memory, fits_at=shrunk.fits_at,
                    free=shrunk.free, agree=agree,
                )
                # After the step: its forwards must not move the step's own peak.
                self.cache.check_count(key, probed, call, options, result.micro_batch_size, loss_fn)
        except Exception as exc:
            attempt.share_failure(exc, binding.params, binding.device, options.accumulate_dtype)
            raise
        return result

    def _check(self, batch: Any, indices: Any, binding: Binding, found: _model.Members, loss_fn: Callable,
               options: StepOptions, loss_calls: dict) -> Call:
        """Every check of a call's inputs, before anything changes."""
        # The world first: it also takes this step's noise_scale, which decides the buffers a rank
        # failing in the checks below joins the others' collective with.
        binding.world.check_options(options, binding.params)
        info = _batch.check(batch, indices, binding.device)
        _model.check_scaler_params(options.scaler, binding.params, binding.device)
        made = _loss.rule_and_call(loss_calls, loss_fn, options.normalize, info.pair)
        if options.noise_scale and made[0].kind not in ("samples", "count"):
            raise ValueError(f"noise_scale needs a loss that is a mean over its items (normalize='samples' or a "
                             f"count), and this step's is normalize={made[0].kind!r}: per-item gradients are not "
                             "defined for it (CachedLoss's loss couples the rows); leave noise_scale off")
        return Call(binding.params, batch, info, binding.device, binding.world, *made, found=found)


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
