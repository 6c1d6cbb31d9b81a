"""The micro-batch streamed training step: ``MicroBatchStreamer`` and ``step``.

``step(model, optimizer, batch, loss_fn, micro_batch_size=m)`` equals
``optimizer.zero_grad(); loss_fn(model, batch).backward(); optimizer.step()`` on the
whole mini-batch, while only one micro-batch at a time lives on the model's device.

This module only coordinates; data flows one way through the others:
batch (:mod:`~mbs_ext.batch`: split into near-equal micro-batches) → ring
(:mod:`~mbs_ext.ring`: staged to the device while the previous one computes) → loss
(:mod:`~mbs_ext.loss`) weighted by counts (:mod:`~mbs_ext.normalize`) → gradients add
up (:mod:`~mbs_ext.accumulate`) → one host sync and the update (:mod:`~mbs_ext.update`).
What the step changes before the optimizer steps is snapshotted
(:mod:`~mbs_ext.snapshot`) and restored on any error, so a failed step leaves no
trace; on running out of memory the step is redone at the largest micro-batch size
a few probes find to fit.
"""

from __future__ import annotations

import time
import traceback
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mbs_ext import _checks
from mbs_ext import accumulate as _acc
from mbs_ext import backoff as _backoff
from mbs_ext import batch as _batch
from mbs_ext import loss as _loss
from mbs_ext import memory as _memory
from mbs_ext.attempt import Attempt
from mbs_ext.ring import StreamRing
from mbs_ext.update import StepResult

__all__ = ["MicroBatchStreamer", "StepResult", "step"]


@dataclass
class _StreamerState:
    """What a streamer keeps between steps (and ``step`` caches per model)."""

    ring: Any = None
    ring_device: torch.device | None = None
    plans: dict[tuple, _memory.MicroBatchPlan] = field(default_factory=dict)  # "auto", per signature
    size_cap: dict[tuple, int] = field(default_factory=dict)  # learned from out-of-memory back-off

    def ring_for(self, device: torch.device) -> Any:
        if self.ring is None or self.ring_device != device:
            self.ring = StreamRing(device)
            self.ring_device = device
        return self.ring


class MicroBatchStreamer:
    """A reusable streamed training step bound to one model, optimizer and loss.

    Options are validated once here; the ring that stages micro-batches is created on
    first use and kept, so repeated steps reuse its host/device buffers.

    Options (shared with :func:`step`):

    * ``micro_batch_size``: int >= 1, the largest micro-batch (N rows are split into
      ``ceil(N / m)`` micro-batches whose sizes differ by at most one), or ``"auto"``:
      the largest size whose step fits ``memory_budget`` bytes, planned from probe
      micro-batches (:func:`mbs_ext.plan_micro_batch`) and cached per input signature.
      ``memory_budget`` defaults to what the device can still give on CUDA and is
      required on CPU.
    * ``normalize``: ``"samples"`` (weight n_i/N, exact for any split),
      ``"micro_batches"`` (1/M, wrong when micro-batches differ in size; for comparison)
      or ``count(micro_batch) -> int | Tensor`` for losses that average over a variable
      number of items (e.g. tokens). A count returned as a device tensor stays on the
      device: no host sync per micro-batch.
    * ``scaler``: a ``torch.amp.GradScaler``; the step is scaled per micro-batch and
      unscaled, checked, stepped and updated once. Non-finite gradients with a finite
      loss are treated as scaler overflow: skipped without a warning, whatever
      ``on_nonfinite`` says.
    * ``autocast_dtype``: runs forward and loss under ``torch.autocast``.
    * ``accumulate_dtype``: dtype of separate accumulation buffers; by default float32
      when any trainable parameter is bf16/fp16, otherwise autograd accumulates in
      ``.grad`` directly.
    * ``max_grad_norm``: clip the total norm of the final unscaled gradient.
    * ``on_nonfinite``: ``"skip"`` leaves parameters, optimizer state and module buffers
      unchanged (``.grad`` keeps the offending gradient for inspection, a GradScaler
      still updates once) and warns; ``"raise"`` raises FloatingPointError with nothing
      changed.
    * ``ring``: the :class:`~mbs_ext.StreamRing` to stream through (one is made for the
      model's device otherwise).

    The batch may live on the host (pageable or pinned) or already on the model's
    device; micro-batches on the model's device are views of it.

    Under DistributedDataParallel the normalization is global (one small all-reduce
    per step), so the step equals a single-process step on the concatenated batch.

    Limits: a failure inside ``optimizer.step`` itself is not undone (that would need
    a copy of the parameters and optimizer state every step); under DDP a failure on
    one rank leaves the others waiting in their collectives; GradScaler refuses to
    unscale fp16 parameters' gradients, as it does without streaming.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor],
        *,
        micro_batch_size: int | str,
        normalize: str | Callable[[Any], int | torch.Tensor] = "samples",
        scaler: torch.amp.GradScaler | None = None,
        autocast_dtype: torch.dtype | None = None,
        max_grad_norm: float | None = None,
        accumulate_dtype: torch.dtype | None = None,
        on_nonfinite: str = "skip",
        memory_budget: int | None = None,
        ring: StreamRing | None = None,
    ) -> None:
        _checks.check_model_optimizer(model, optimizer)
        _checks.check_options(
            loss_fn, micro_batch_size, normalize, scaler, autocast_dtype, max_grad_norm, accumulate_dtype,
            on_nonfinite, memory_budget,
        )
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.micro_batch_size = micro_batch_size
        self.normalize = normalize
        self.scaler = scaler
        self.autocast_dtype = autocast_dtype
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.accumulate_dtype = accumulate_dtype
        self.on_nonfinite = on_nonfinite
        self.memory_budget = memory_budget
        self.state = _StreamerState()
        if ring is not None:
            self.state.ring, self.state.ring_device = ring, ring.device

    @property
    def _ring(self) -> Any:
        return self.state.ring

    @_ring.setter
    def _ring(self, ring: Any) -> None:
        self.state.ring = ring

    def plans(self) -> dict[tuple, _memory.MicroBatchPlan]:
        """The micro-batch plans made for ``"auto"`` so far, by input signature."""
        return dict(self.state.plans)

    plan = plans  # the name of earlier releases

    def _micro_batch_size(self, batch: Any, indices: torch.Tensor | None, rows: int, loss_call: Callable) -> tuple:
        """The size to stream with, and the cache key that out-of-memory back-off updates."""
        leaves = tuple((tuple(t.shape[1:]), t.dtype) for t in _batch.tensor_leaves(batch))
        if self.micro_batch_size != "auto":
            key = ("fixed", leaves)
            m = int(self.micro_batch_size)
        else:
            # Keyed on the caller's budget, not on a measured free-memory figure that
            # moves from step to step, so plans and back-off sizes stay remembered.
            key = ("auto", leaves, self.memory_budget, self.autocast_dtype)
            plan = self.state.plans.get(key)
            # A plan is capped by the rows of the batch it was made for; a larger batch
            # with the same signature may afford a larger micro-batch, so re-plan then.
            if plan is None or (plan.micro_batch_size >= plan.num_rows and rows > plan.num_rows):
                device = _checks.model_device(self.model)
                plan = _memory.plan(
                    self.model, batch, loss_call, _memory.default_budget(device, self.memory_budget),
                    num_rows=rows, indices=indices,
                    accumulate_dtype=_acc.accumulation_dtype(self.accumulate_dtype, _checks.trainable(self.model)),
                    autocast_dtype=self.autocast_dtype,
                )
                self.state.plans[key] = plan
            m = plan.micro_batch_size
        m = min(m, self.state.size_cap.get(key, m), rows)
        return max(1, m), key

    def step(self, batch: Any, indices: torch.Tensor | None = None) -> StepResult:
        """One optimizer step over the mini-batch ``batch`` (or its rows at ``indices``).

        If a micro-batch runs out of memory (``torch.OutOfMemoryError`` on a device, or a
        host allocation failure), the step is undone, a few single-micro-batch probes
        find the largest size that fits, and the step is redone from scratch at that
        size, which is remembered for later steps.
        """
        t_begin = time.perf_counter()
        params = _checks.check_model_optimizer(self.model, self.optimizer)
        rows = _batch.check_batch(batch)
        if indices is not None:
            indices = _batch.check_indices(indices, rows)
            rows = indices.numel()
        device = _checks.model_device(self.model)
        _check_batch_device(batch, device)
        _checks.check_scaler_params(self.scaler, params, device)
        loss_call = _loss.loss_caller(self.loss_fn, batch)
        m, key = self._micro_batch_size(batch, indices, rows, loss_call)
        while True:
            attempt = Attempt(self, params, batch, indices, rows, m, device, loss_call)
            try:
                result = attempt.run()
                break
            except BaseException as exc:
                attempt.rollback(clear_grads=True)
                # Back off only where a smaller micro-batch helps (out of memory while
                # streaming: not in the finish, whose casts and norms do not depend on it),
                # and only while nothing irreversible happened: not once the optimizer
                # started stepping, and never under DDP (ranks would diverge).
                streaming = 0 <= attempt.index < attempt.num_mb
                if not _memory.is_out_of_memory(exc) or m == 1 or attempt.ddp or attempt.stepping or not streaming:
                    _annotate(exc, attempt, m)
                    raise
                _annotate(exc, attempt, m)
                # Drop the failed attempt's frames (and the tensors they hold) before probing;
                # keep their text, for the error raised if no smaller size fits.
                origin = "".join(traceback.format_list(traceback.extract_tb(exc.__traceback__)))
                exc.__traceback__ = None
                del attempt
                _backoff.release_cached_memory(device)
                smaller = _backoff.largest_fitting(
                    lambda size: _backoff.fits(self.model, params, batch, indices, size, device, loss_call,
                                               self.autocast_dtype),
                    m,
                )
                if smaller is None:
                    if hasattr(exc, "add_note"):
                        exc.add_note(
                            "mbs_ext.step: out-of-memory back-off found no micro-batch size that fits, not "
                            "even 1 row. Where the error was raised (its frames were freed for the probes):\n"
                            + origin.rstrip()
                        )
                    raise exc from None
                del exc
                warnings.warn(
                    f"mbs_ext.step: out of memory at micro_batch_size={m}; "
                    f"redoing the step with micro_batch_size={smaller}",
                    RuntimeWarning,
                    stacklevel=2,
                )
                self.state.size_cap[key] = smaller
                m = smaller
        result.timings["total_s"] = time.perf_counter() - t_begin
        return result


def _check_batch_device(batch: Any, device: torch.device) -> None:
    """Batch tensors live on the host or already on the model's device."""
    for i, t in enumerate(_batch.tensor_leaves(batch)):
        if t.device.type != "cpu" and t.device != device:
            raise ValueError(
                f"batch tensors must be on the CPU or on the model's device {device}, tensor {i} is on {t.device}"
            )


def _annotate(exc: BaseException, attempt: Attempt, m: int) -> None:
    if hasattr(exc, "add_note"):
        exc.add_note(attempt.where())
        if _memory.is_out_of_memory(exc) and attempt.ddp and m > 1:
            exc.add_note("mbs_ext.step: no out-of-memory back-off under DDP (ranks would diverge)")


_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    *,
    micro_batch_size: int | str,
    normalize: str | Callable[[Any], int | torch.Tensor] = "samples",
    indices: torch.Tensor | None = None,
    scaler: torch.amp.GradScaler | None = None,
    autocast_dtype: torch.dtype | None = None,
    max_grad_norm: float | None = None,
    accumulate_dtype: torch.dtype | None = None,
    on_nonfinite: str = "skip",
    memory_budget: int | None = None,
) -> StepResult:
    """One optimizer step over ``batch``, streamed in micro-batches; see :class:`MicroBatchStreamer`.

    The ring, the "auto" plans and sizes learned from out-of-memory back-off are cached
    per model, so calling ``step`` in a loop reuses them.
    """
    streamer = MicroBatchStreamer(
        model, optimizer, loss_fn, micro_batch_size=micro_batch_size, normalize=normalize, scaler=scaler,
        autocast_dtype=autocast_dtype, max_grad_norm=max_grad_norm, accumulate_dtype=accumulate_dtype,
        on_nonfinite=on_nonfinite, memory_budget=memory_budget,
    )
    state = _STATES.get(model)
    if state is not None:
        streamer.state = state
    else:
        _STATES[model] = streamer.state
    return streamer.step(batch, indices=indices)
