"""Finishing a step: the one host sync, the non-finite check, then skip or step.

Everything the decision needs (the mini-batch loss, the total count, whether a count
or a gradient went bad, the gradient norm) is computed on the device first and read
back in one copy: the only host synchronization of a step, whatever the number of
micro-batches. Only a step that goes wrong reads once more, to say where.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

from mbs_ext.counts.noise import Noise
from mbs_ext.counts.normalize import Normalizer, first_nonfinite, nonfinite_at
from mbs_ext.messages import caller_stacklevel
from mbs_ext.model.grads import AutogradSink, BufferSink
from mbs_ext.model.options import StepOptions
from mbs_ext.model.rollback import StepGuard
from mbs_ext.world.record import Record


@dataclass
class StepResult:
    """What one streamed step did.

    ``loss`` is the full mini-batch loss (the global one under DDP); ``grad_norm`` is
    the total norm of the unscaled gradient before clipping, or None when not clipping;
    ``micro_batch_size`` is the largest micro-batch actually streamed, ``micro_batch_tokens``
    the token budget it was cut by (planned, or lowered by back-off; None: cut by rows). ``timings`` are
    host wall-clock seconds: ``stage_s`` and ``wait_s`` from the ring, ``compute_s``
    the micro-batches' forward/backward launches, ``step_s`` the finish and the
    optimizer step, ``total_s`` the whole call (out-of-memory back-off included).
    """

    loss: float
    num_micro_batches: int
    micro_batch_size: int
    num_samples: int
    skipped: bool = False
    grad_norm: float | None = None
    timings: dict[str, float] = field(default_factory=dict)
    micro_batch_tokens: int | None = None
    noise: Noise | None = None  # with noise_scale: the gradient noise (mbs_ext.counts.noise.Noise)


class Finished(NamedTuple):
    """What the finish decided: the mini-batch loss, whether the step was skipped, the norm, and
    the gradient noise's sums as read (``extra``; empty without the noise scale)."""

    loss: float
    skipped: bool
    grad_norm: float | None
    extra: tuple[float, ...] = ()


def finish(
    params: list[nn.Parameter],
    sink: AutogradSink | BufferSink,
    normalizer: Normalizer,
    options: StepOptions,
    optimizer: torch.optim.Optimizer,
    guard: StepGuard,
    device: torch.device,
    record: Record,
    noise: bool = False,
) -> Finished:
    """Read, decide, and step (or roll back a skipped step); with ``noise``, the gradient noise's
    sums ride the one read (:func:`noise_values`)."""
    scaler = options.scaler
    if scaler is not None:
        if getattr(scaler, "_scale", None) is None:
            # No loss was scaled (every micro-batch counted 0 items, on a new scaler): unscale_
            # needs the scale made, and the step must fail with what is wrong (the counts).
            scaler.scale(torch.zeros((), device=device))
        guard.unscaled = True
        scaler.unscale_(optimizer)
    norm = None
    found = sink.nonfinite(options.clipping)
    if options.clipping:
        grads = [p.grad for p in params if p.grad is not None]
        # Norm now, clip only once the step is known to go ahead: a skipped step leaves
        # the offending gradient in .grad for inspection.
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=device)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a replicated DTensor
        found = torch.maximum(found, (~torch.isfinite(norm)).to(torch.float32).to(device))
    values = [found, record.failed(), 0.0 if norm is None else norm.detach(), *normalizer.device_values()]
    read = _read([*values, *(noise_values(sink, normalizer, record, options) if noise else ())], device)
    read, more = read[: len(values)], tuple(read[len(values):])
    record.raise_if_failed(read[1])
    loss = normalizer.check(*read[3:])
    grad_norm = read[2] if norm is not None else None
    skipped = _should_skip(loss, read[0] != 0, normalizer, options, device)
    if skipped:
        if scaler is not None:
            scaler.update()  # backs off when the gradients overflowed
            guard.updated = True
        guard.rollback(clear_grads=False, restore_scaler=False, restore_rng=False)
    else:
        guard.commit_statistics()
        guard.stepping = True
        _apply(params, optimizer, options, norm)
        guard.updated = scaler is not None
    return Finished(loss, skipped, grad_norm, more)


def finish_gradients(sink: AutogradSink | BufferSink, normalizer: Normalizer, options: StepOptions,
                     guard: StepGuard, device: torch.device, record: Record, noise: bool = False) -> Finished:
    """The end of :func:`mbs_ext.accumulate`: the one host sync and the checks, the deferred
    statistics committed; the (possibly scaled) gradients stay in ``.grad`` for the caller's own
    optimizer step. A non-finite loss or gradient gets the step's policy (``on_nonfinite``): by
    default skipped - ``.grad`` and the buffers put back as they were, ``skipped=True`` and a
    warning naming the micro-batch - or raised. Not a gradient under a GradScaler: its overflow is
    the caller's scaler's to handle."""
    found = sink.nonfinite(False) if options.scaler is None else 0.0
    values = [found, record.failed(), *normalizer.device_values()]
    read = _read([*values, *(noise_values(sink, normalizer, record, options) if noise else ())], device)
    read, more = read[: len(values)], tuple(read[len(values):])
    record.raise_if_failed(read[1])
    loss = normalizer.check(*read[2:])
    if read[0] != 0 or not math.isfinite(loss):
        if math.isfinite(loss):
            msg = f"non-finite gradient (loss={loss})"
        else:
            mark = _read([first_nonfinite(normalizer)], device)[0]
            msg = f"non-finite loss {nonfinite_at(normalizer, mark)} (loss={loss})"
        if options.on_nonfinite == "raise":
            raise FloatingPointError(f"mbs_ext.accumulate: {msg} with on_nonfinite='raise'; the gradients were "
                                     "left as they were")
        guard.rollback(clear_grads=True, restore_scaler=False, restore_rng=False)
        warnings.warn(f"mbs_ext.accumulate: {msg}; its gradients were not added: .grad is as it was "
                      "(on_nonfinite='raise' raises instead)", RuntimeWarning, stacklevel=caller_stacklevel())
        return Finished(loss, True, None, more)
    guard.commit_statistics()
    return Finished(loss, False, None, more)


def noise_values(sink: BufferSink, normalizer: Normalizer, record: Record, options: StepOptions) -> list:
    """What the noise scale reads with the step's one host read: the micro-batches (of a count
    other than 0) and items of the global step, ``sum_j c_j |g_j|^2`` over every rank,
    ``|G_B|^2`` of the final sums, and the loss scale both carry (squared out by the caller)."""
    micro_sq, m = record.noise(sink.micro_sq(normalizer.denom), sink.micro_batches())
    scaler = options.scaler
    scale = scaler._scale if scaler is not None and getattr(scaler, "_scale", None) is not None else 1.0
    return [m, normalizer.total, micro_sq, sink.bufs.batch_sq, scale]


def _read(values: list, device: torch.device) -> list[float]:
    """Host numbers of ``values`` with one device-to-host copy for all the device tensors."""
    read: list[float] = []
    at, parts = [], []
    for v in values:
        if not isinstance(v, torch.Tensor):
            read.append(float(v))
            continue
        # Every value is one element; most are 0-dim on ``device`` already, and each operation
        # saved here is saved on every step. Stacking promotes exactly: the values are float32
        # or float64 (widened, never rounded) or small integer counts.
        if v.requires_grad:
            v = v.detach()
        if v.dim() != 0 or v.device != device:
            v = v.to(device).reshape(())
        at.append(len(read))
        parts.append(v)
        read.append(0.0)
    if parts:
        for i, v in zip(at, torch.stack(parts).tolist()):
            read[i] = v
    return read


def _should_skip(loss: float, grads_bad: bool, normalizer: Normalizer, options: StepOptions,
                 device: torch.device) -> bool:
    """Whether to skip the optimizer step; raises or warns as ``on_nonfinite`` says.

    Non-finite gradients with a finite loss under a GradScaler are scaler overflow: a
    normal event that skips silently, as ``GradScaler.step`` does.
    """
    if not grads_bad and math.isfinite(loss):
        return False
    if options.scaler is not None and math.isfinite(loss):
        return True
    if not math.isfinite(loss):
        # Which micro-batch: a second read, only on this failure path (not every step).
        mark = _read([first_nonfinite(normalizer)], device)[0]
        msg = f"non-finite loss {nonfinite_at(normalizer, mark)} (loss={loss})"
    else:
        msg = f"non-finite gradient (loss={loss})"
    if options.on_nonfinite == "raise":
        raise FloatingPointError(f"mbs_ext.step: {msg}; nothing was changed")
    warnings.warn(f"mbs_ext.step: {msg}; the optimizer step was skipped", RuntimeWarning,
                  stacklevel=caller_stacklevel())
    return True


def _apply(params: list[nn.Parameter], optimizer: torch.optim.Optimizer, options: StepOptions,
           norm: torch.Tensor | None) -> None:
    """Clip (with the norm already computed) and take the optimizer / scaler step."""
    if norm is not None:
        with_grad = [p for p in params if p.grad is not None]
        if with_grad:
            torch.nn.utils.clip_grads_with_norm_(with_grad, options.max_grad_norm, norm)
    if options.scaler is not None:
        options.scaler.step(optimizer)
        options.scaler.update()
    else:
        optimizer.step()
