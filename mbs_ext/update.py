"""The end of a step: the one host sync, skip-or-step, clipping, the optimizer and scaler step.

Everything the step needs to decide on (the mini-batch loss, the total count, whether
a gradient or a count went bad, the gradient norm) is computed on the device first and
read back in one ``tolist()``: the only host synchronization of a step, whatever the
number of micro-batches.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from mbs_ext import normalize as _norm


@dataclass
class StepResult:
    """What one streamed step did.

    ``loss`` is the full mini-batch loss (the global one under DDP); ``grad_norm`` is
    the total norm of the unscaled gradient before clipping, or None when not clipping.
    ``timings`` are host wall-clock seconds: ``stage_s`` and ``wait_s`` come from the
    ring, ``compute_s`` covers forward/backward launches, ``step_s`` the finishing work
    and the optimizer step.
    """

    loss: float
    num_micro_batches: int
    micro_batch_size: int
    num_samples: int
    skipped: bool = False
    grad_norm: float | None = None
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class Outcome:
    """The host values read in the step's one sync."""

    loss: float
    total: float
    grads_bad: bool
    grad_norm: float | None


def probe(
    params: list[nn.Parameter],
    device: torch.device,
    loss_sum: torch.Tensor,
    total: float | torch.Tensor,
    found: torch.Tensor,
    bad_count: torch.Tensor | None,
    max_grad_norm: float | None,
    name_bad_count: Callable[[float], str] = lambda mark: "",
) -> tuple[Outcome, torch.Tensor | None]:
    """Read loss, total, flags and norm in one host sync; raise on a bad count or total.

    ``bad_count`` is nonzero when a device count was invalid; ``name_bad_count`` turns its
    value into where that was, for the error. Returns the outcome and the device norm
    (for clipping), None when not clipping.
    """
    norm = None
    if max_grad_norm is not None:
        grads = [p.grad for p in params if p.grad is not None]
        # Norm now, clip only once the step is known to go ahead: a skipped step leaves
        # the offending gradient in .grad for inspection.
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=device)
        found = torch.maximum(found, (~torch.isfinite(norm)).to(torch.float32).to(device))
    values = [loss_sum, total, found, bad_count if bad_count is not None else 0.0]
    if norm is not None:
        values.append(norm.detach())
    read = _read(values, device)
    if read[3] != 0:
        where = name_bad_count(read[3])
        raise ValueError(
            f"{_norm.INVALID_COUNT_MESSAGE}; the normalize callable returned one that is not"
            + (f" {where}" if where else "")
        )
    _norm.check_total(read[1])
    outcome = Outcome(
        loss=read[0] / read[1], total=read[1], grads_bad=read[2] != 0,
        grad_norm=read[4] if norm is not None else None,
    )
    return outcome, norm


def _read(values: list, device: torch.device) -> list[float]:
    """Host numbers of ``values`` with one device-to-host copy for all the device tensors.

    Host numbers stay on the host: copying them to the device first would be a
    (synchronous) host-to-device copy each.
    """
    on_device = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
    read = [float(v) if not isinstance(v, torch.Tensor) else 0.0 for v in values]
    if on_device:
        stacked = torch.stack([values[i].detach().to(device, torch.float64).reshape(()) for i in on_device])
        for i, v in zip(on_device, stacked.tolist()):
            read[i] = v
    return read


def nonfinite_message(outcome: Outcome) -> str:
    what = "loss" if not math.isfinite(outcome.loss) else "gradient"
    return f"non-finite {what} (loss={outcome.loss})"


def should_skip(outcome: Outcome, scaler: torch.amp.GradScaler | None, on_nonfinite: str) -> bool:
    """Whether to skip the optimizer step; raises or warns as ``on_nonfinite`` says.

    Non-finite gradients with a finite loss under a GradScaler are scaler overflow: a
    normal event that skips silently, as ``GradScaler.step`` does.
    """
    if not outcome.grads_bad and math.isfinite(outcome.loss):
        return False
    overflow = scaler is not None and math.isfinite(outcome.loss)
    if not overflow:
        msg = nonfinite_message(outcome)
        if on_nonfinite == "raise":
            raise FloatingPointError(f"mbs_ext.step: {msg}; nothing was changed")
        warnings.warn(f"mbs_ext.step: {msg}; the optimizer step was skipped", RuntimeWarning, stacklevel=5)
    return True


def apply(
    params: list[nn.Parameter],
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    max_grad_norm: float | None,
    norm: torch.Tensor | None,
) -> None:
    """Clip (with the norm already computed) and take the optimizer / scaler step."""
    if norm is not None:
        with_grad = [p for p in params if p.grad is not None]
        if with_grad:
            torch.nn.utils.clip_grads_with_norm_(with_grad, max_grad_norm, norm)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
