"""Loss-weight rules: how much each micro-batch's mean loss counts in the mini-batch loss.

Every rule is expressed as a per-micro-batch *count* ``c_i``; the mini-batch loss is
``sum_i c_i * loss_i / sum_i c_i``. With ``loss_i`` the mean over the micro-batch's
items, that is exactly the mean over all items of the mini-batch when ``c_i`` is the
number of items ("samples" or a count callable). "micro_batches" gives every
micro-batch the count 1 (weight 1/M; under DDP 1/M over all ranks' micro-batches), the
rule of the micro-batch streaming papers; it is kept for comparison and is wrong
whenever micro-batches hold different numbers of items.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import torch

Normalize = str | Callable[[Any], "int | torch.Tensor"]

RULES = ("samples", "micro_batches")


def check_normalize(normalize: Any) -> None:
    """Reject anything but a known rule name or a callable."""
    if isinstance(normalize, str):
        if normalize not in RULES:
            raise ValueError(f"normalize must be one of {RULES} or a callable, got {normalize!r}")
    elif not callable(normalize):
        raise TypeError(
            f"normalize must be one of {RULES} or a callable count(batch), got {type(normalize).__name__}"
        )


def needs_count_pass(normalize: Normalize) -> bool:
    """Whether the count of a micro-batch comes from user code (and so is unknown ahead)."""
    return callable(normalize) and not isinstance(normalize, str)


Count = float | torch.Tensor  # a host number, or a 0-dim float64 tensor on a device


def count(normalize: Normalize, micro_batch: Any, rows: int) -> Count:
    """The count ``c_i`` of one micro-batch of ``rows`` rows.

    A count callable returning a tensor keeps it a tensor: on an accelerator, turning
    it into a Python number would stall the host once per micro-batch. Tensor counts
    are validated later, on their device (:func:`invalid_count`), and read in the
    step's one host sync; CPU tensors take the same path, so it is tested everywhere.
    Python numbers are validated at once.
    """
    if normalize == "samples":
        return float(rows)
    if normalize == "micro_batches":
        return 1.0
    value = normalize(micro_batch)
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"normalize count must be a scalar, got a tensor of shape {tuple(value.shape)}")
        if value.is_complex():
            raise ValueError(f"normalize count must be a non-negative integer, got dtype {value.dtype}")
        return value.detach().reshape(()).to(torch.float64)
    return check_count(value)


def invalid_count(c: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool tensor: whether a device count is not a non-negative integer (no host sync)."""
    return ~torch.isfinite(c) | (c < 0) | (c != torch.floor(c))


INVALID_COUNT_MESSAGE = "normalize count must be a non-negative integer"


def check_count(value: Any) -> float:
    """Validate a count returned by a count callable: a non-negative integer."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"normalize count must be a scalar, got a tensor of shape {tuple(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"normalize count must be a non-negative integer, got {type(value).__name__}")
    v = float(value)
    if math.isnan(v) or math.isinf(v) or v < 0 or v != math.floor(v):
        raise ValueError(f"normalize count must be a non-negative integer, got {value!r}")
    return v


def check_total(total: float) -> None:
    """A zero total count leaves the mean loss undefined."""
    if total == 0:
        raise ValueError(
            "normalize: the counts of the whole mini-batch sum to 0 (no loss items); "
            "the mean loss is undefined"
        )


def all_reduce_sum(
    values: list[Count], device: torch.device, group: Any = None, host_tail: list[float] | None = None
) -> torch.Tensor:
    """Per-rank totals summed over the DDP ``group`` in one collective, as a float64 vector.

    Stays on ``device`` (no host sync): the caller reads it in the step's one probe.
    Without a process group it just stacks the values. ``host_tail`` (host numbers, e.g.
    one flag per parameter) is appended with a single copy from pinned memory rather
    than one blocking host-to-device copy per number.
    """
    import torch.distributed as dist

    parts = [torch.as_tensor(v, dtype=torch.float64, device=device).reshape(()) for v in values]
    t = torch.stack(parts)
    if host_tail:
        tail = torch.tensor(host_tail, dtype=torch.float64)
        if device.type == "cuda":
            tail = tail.pin_memory().to(device, non_blocking=True)
        t = torch.cat([t, tail.to(device)])
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def ratio(numerator: Count, total: Count) -> Count:
    """``numerator / total`` for rescaling; 1.0 for a zero host total (that step fails later)."""
    if isinstance(total, torch.Tensor) or isinstance(numerator, torch.Tensor) or total != 0:
        return numerator / total
    return 1.0
