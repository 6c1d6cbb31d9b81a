"""The ``loss_fn(model, batch)`` convention: adapt ``torch.nn`` losses, check what comes back.

Also the autocast context the forward runs in, shared by the step and the planner's
probes so both measure the same computation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.modules.loss import _Loss

from mbs_ext import batch as _batch

LossCall = Callable[[nn.Module, Any], torch.Tensor]


def loss_caller(loss_fn: Callable, batch: Any) -> LossCall:
    """``loss_fn`` itself, or for an ``nn`` loss module ``loss_fn(model(inputs), targets)``."""
    if not isinstance(loss_fn, _Loss):
        return loss_fn
    if not _batch.is_pair(batch):
        raise TypeError("loss_fn is a torch.nn loss module, so batch must be an (inputs, targets) pair")

    def call(model: nn.Module, micro_batch: Any) -> torch.Tensor:
        return loss_fn(model(micro_batch[0]), micro_batch[1])

    return call


def check_loss(loss: Any, device: torch.device) -> None:
    """A 0-dim tensor on the model's device that requires grad."""
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"loss_fn must return a 0-dim torch.Tensor, got {type(loss).__name__}")
    if loss.dim() != 0:
        raise ValueError(f"loss_fn must return a 0-dim (scalar) tensor, got shape {tuple(loss.shape)}")
    if not loss.requires_grad:
        raise ValueError("loss_fn returned a tensor that does not require grad (detached from the model?)")
    if loss.device != device:
        raise ValueError(f"loss_fn returned a tensor on {loss.device}, but the model is on {device}")


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """``torch.autocast`` for ``dtype`` on ``device``'s type, or a no-op when dtype is None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
