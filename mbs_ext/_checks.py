"""Every user-facing argument check of the step, in one place, with the messages users see.

Checks run once, at the edge (``MicroBatchStreamer`` / ``step`` / ``plan_micro_batch``);
the modules behind them trust their inputs.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
from torch import nn

from mbs_ext import normalize as _norm

ON_NONFINITE = ("skip", "raise")


def check_micro_batch_size(micro_batch_size: Any) -> None:
    """An int >= 1, or the string ``"auto"``."""
    if isinstance(micro_batch_size, str):
        if micro_batch_size != "auto":
            raise ValueError(f"micro_batch_size must be an int >= 1 or 'auto', got {micro_batch_size!r}")
        return
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, numbers.Integral):
        kind = type(micro_batch_size).__name__
        raise TypeError(f"micro_batch_size must be an int >= 1 or 'auto', got {kind}")
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be an int >= 1, got {micro_batch_size}")


def check_dtype(value: Any, name: str) -> None:
    """None or a floating ``torch.dtype``."""
    if value is None:
        return
    if not isinstance(value, torch.dtype):
        raise TypeError(f"{name} must be a floating torch.dtype or None, got {type(value).__name__}")
    if not value.is_floating_point:
        raise ValueError(f"{name} must be a floating dtype, got {value}")


def check_memory_budget(memory_budget: Any) -> None:
    """None or a positive, finite number of bytes."""
    if memory_budget is None:
        return
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float)):
        raise TypeError(f"memory_budget must be a number of bytes (int), got {type(memory_budget).__name__}")
    if not math.isfinite(memory_budget) or memory_budget <= 0:
        raise ValueError(f"memory_budget must be a positive number of bytes, got {memory_budget!r}")


def check_options(
    loss_fn: Any,
    micro_batch_size: Any,
    normalize: Any,
    scaler: Any,
    autocast_dtype: Any,
    max_grad_norm: Any,
    accumulate_dtype: Any,
    on_nonfinite: Any,
    memory_budget: Any,
) -> None:
    """The options shared by :class:`~mbs_ext.MicroBatchStreamer` and :func:`~mbs_ext.step`."""
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(model, batch), got {type(loss_fn).__name__}")
    check_micro_batch_size(micro_batch_size)
    _norm.check_normalize(normalize)
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(f"scaler must be a torch.amp.GradScaler or None, got {type(scaler).__name__}")
    check_dtype(autocast_dtype, "autocast_dtype")
    check_dtype(accumulate_dtype, "accumulate_dtype")
    if max_grad_norm is not None:
        if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, numbers.Real):
            kind = type(max_grad_norm).__name__
            raise TypeError(f"max_grad_norm must be a positive number or None, got {kind}")
        if math.isnan(max_grad_norm) or max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be > 0, got {max_grad_norm}")
    if on_nonfinite not in ON_NONFINITE:
        raise ValueError(f"on_nonfinite must be one of {ON_NONFINITE}, got {on_nonfinite!r}")
    check_memory_budget(memory_budget)


def check_model(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """The distinct parameters with ``requires_grad``; raises when there are none."""
    seen: set[int] = set()
    params = []
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            params.append(p)
    if not params:
        raise ValueError("model has no trainable parameters (none with requires_grad=True)")
    return params


def check_model_optimizer(model: Any, optimizer: Any) -> list[nn.Parameter]:
    """The model's trainable parameters, after checking that the optimizer owns some of them."""
    check_model(model)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    params = trainable(model)
    owned = {id(p) for g in optimizer.param_groups for p in g["params"]}
    if not any(id(p) in owned for p in params):
        raise ValueError("optimizer owns none of the model's trainable parameters")
    return params


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter: where micro-batches must go."""
    for p in model.parameters():
        return p.device
    raise ValueError("model has no parameters, so it has no device to stream micro-batches to")


_SCALER_UNSCALES: dict[tuple[str, torch.dtype], bool] = {}


def _scaler_unscales(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's own GradScaler unscales ``dtype`` gradients on ``device`` (asked once)."""
    key = (device.type, dtype)
    if key not in _SCALER_UNSCALES:
        p = nn.Parameter(torch.zeros(1, dtype=dtype, device=device))
        p.grad = torch.zeros_like(p)
        probe = torch.amp.GradScaler(device.type)
        probe.scale(torch.ones((), device=device))
        try:
            probe.unscale_(torch.optim.SGD([p], lr=0.0))
            _SCALER_UNSCALES[key] = True
        except (RuntimeError, ValueError):  # NotImplementedError is a RuntimeError
            _SCALER_UNSCALES[key] = False
    return _SCALER_UNSCALES[key]


def check_scaler_params(scaler: Any, params: list[nn.Parameter], device: torch.device) -> None:
    """Refuse, before the step starts, the parameter dtypes whose gradients torch's
    GradScaler will not unscale (fp16 everywhere, bf16 on CUDA): it would fail only
    after every micro-batch had run."""
    if scaler is None or not scaler.is_enabled():
        return
    for dtype in sorted({p.dtype for p in params} & {torch.float16, torch.bfloat16}, key=str):
        if _scaler_unscales(device, dtype):
            continue
        if dtype == torch.bfloat16:
            raise ValueError(
                f"scaler: torch.amp.GradScaler cannot unscale bf16 gradients on {device.type}, and bf16 "
                "parameters need no loss scaling (bf16 has float32's exponent range); pass scaler=None"
            )
        raise ValueError(
            "scaler: torch.amp.GradScaler refuses to unscale fp16 gradients (the model has fp16 parameters); "
            "keep float32 parameters and pass autocast_dtype=torch.float16, or pass scaler=None"
        )
