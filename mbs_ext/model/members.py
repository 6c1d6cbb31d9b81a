"""What the step trains: the model's trainable parameters, its device, and the checks on them.

Every check here runs before a step changes anything, so a refused call leaves the
model, the optimizer and the scaler as they were.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn


def check_model(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")


class Members(NamedTuple):
    """What a step reads of a model every time, from one walk over its modules."""

    modules: list[nn.Module]  # as ``model.modules()``
    params: list[nn.Parameter]  # the distinct ones with requires_grad, as ``parameters()`` orders them
    buffers: list[torch.Tensor]  # the distinct ones, as ``buffers()``
    # (module, name, tensor) of every buffer slot: a forward may replace a buffer rather than
    # update it in place (``self.seen = self.seen + n``), and a rollback must put it back.
    slots: list[tuple[nn.Module, str, torch.Tensor]]


def members(model: nn.Module) -> Members:
    """The model's modules, trainable parameters and buffers in one walk: ``parameters()``,
    ``buffers()`` and ``modules()`` each walk the module tree again (and ``modules()`` builds
    every module's dotted name on the way), which on a deep model costs more than the rest of a
    step's bookkeeping. Modules come depth-first as ``modules()`` orders them; shared modules
    and tensors are listed once, where they first appear, as torch's own iterators do."""
    modules: list[nn.Module] = []
    params: list[nn.Parameter] = []
    buffers: list[torch.Tensor] = []
    slots: list[tuple[nn.Module, str, torch.Tensor]] = []
    seen: set[int] = set()
    seen_params: set[int] = set()
    seen_buffers: set[int] = set()
    stack: list[nn.Module | None] = [model]
    while stack:
        m = stack.pop()
        if m is None or id(m) in seen:
            continue
        seen.add(id(m))
        modules.append(m)
        for p in m._parameters.values():
            if p is not None and id(p) not in seen_params:
                seen_params.add(id(p))
                if p.requires_grad:
                    params.append(p)
        if m._buffers:
            for name, b in m._buffers.items():
                if b is not None:
                    slots.append((m, name, b))
                    if id(b) not in seen_buffers:
                        seen_buffers.add(id(b))
                        buffers.append(b)
        if m._modules:
            stack.extend(reversed(m._modules.values()))
    return Members(modules, params, buffers, slots)


def trainable(model: nn.Module, found: Members | None = None) -> list[nn.Parameter]:
    """The distinct parameters with ``requires_grad`` (of ``found`` when the walk was made);
    raises when there are none."""
    params = (found or members(model)).params
    if not params:
        raise ValueError("model has no trainable parameters (none with requires_grad=True)")
    return params


def check_model_optimizer(model: Any, optimizer: Any, found: Members | None = None) -> list[nn.Parameter]:
    """The model's trainable parameters (of ``found`` when the walk was made), after checking that
    the optimizer (if any: None for :func:`mbs_ext.accumulate`) owns some of them."""
    check_model(model)
    if optimizer is None:
        return trainable(model, found)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    check_framework_optimizer(optimizer)
    params = trainable(model, found)
    mine = {id(p) for p in params}
    if not any(id(p) in mine for g in optimizer.param_groups for p in g["params"]):  # stops at the first
        raise ValueError("optimizer owns none of the model's trainable parameters")
    return params


def check_framework_optimizer(optimizer: Any) -> None:
    """An optimizer a framework wrapped (Accelerate's ``AcceleratedOptimizer``, read by duck
    typing) that steps its own GradScaler, or skips its step while gradients accumulate, cannot
    take the step's update: refuse before anything changes and say what works."""
    scaler = getattr(optimizer, "scaler", None)
    if isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled():
        raise ValueError(
            f"optimizer ({type(optimizer).__name__}) steps and updates its own GradScaler, which would "
            "double up with the step's: call mbs_ext.accumulate(model, batch, loss_fn, ..., "
            "scaler=accelerator.scaler), then optimizer.step()"
        )
    if getattr(getattr(optimizer, "gradient_state", None), "sync_gradients", True) is False:
        raise ValueError(
            f"optimizer ({type(optimizer).__name__}) skips its step while gradients accumulate "
            "(inside accelerator.accumulate()): mbs_ext.step already streams the whole mini-batch; "
            "call it outside accelerator.accumulate()"
        )


def check_grad_mode(caller: str = "mbs_ext.step") -> None:
    """A step (or a plan's probe) computes gradients: refuse a caller's ``torch.no_grad()`` /
    ``inference_mode()``."""
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        raise RuntimeError(
            f"{caller} was called with gradients disabled (inside torch.no_grad() or "
            "torch.inference_mode()); call it outside that block"
        )


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
