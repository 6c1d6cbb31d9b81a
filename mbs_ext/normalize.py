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


def count(normalize: Normalize, micro_batch: Any, rows: int) -> float:
    """The count ``c_i`` of one micro-batch of ``rows`` rows.

    A count callable returning a tensor costs one host sync (``.item()``): its value is
    needed as a Python number to validate it and to weight the loss.
    """
    if normalize == "samples":
        return float(rows)
    if normalize == "micro_batches":
        return 1.0
    value = normalize(micro_batch)
    return check_count(value)


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
