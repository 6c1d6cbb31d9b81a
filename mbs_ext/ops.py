"""Python face of the fused ``mbs_ext::scale_accumulate_`` op.

Every argument is validated before the dispatcher sees it, and errors name the argument
(``grads[3]``). The checks are C++ (csrc/ops/arguments.h), written once for the kernels
and for the scan that ``_C`` runs for this module: with thousands of small tensors a
Python loop would cost more than the op itself. Here the arguments are converted (lists,
a number as scale, a missing found_inf) and the fault the scan reports is raised.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from mbs_ext._native import _C  # also loads the op registrations

_OP = torch.ops.mbs_ext.scale_accumulate_
_FLOATS = frozenset({torch.float32, torch.float64, torch.bfloat16, torch.float16})
_DEVICE_TYPES = ("cpu", "cuda")


@torch.library.register_fake("mbs_ext::scale_accumulate_")
def _scale_accumulate_fake(accumulators, grads, scale, found_inf) -> None:
    # In-place op with no outputs: nothing to describe for fake tensors.
    return None


def _as_list(name: str, seq: object) -> list:
    if isinstance(seq, list):
        return seq
    if isinstance(seq, torch.Tensor) or isinstance(seq, (str, bytes)) or not isinstance(seq, Sequence):
        raise TypeError(f"{name} must be a list or tuple of tensors, got {type(seq).__name__}")
    return list(seq)


def _check_tensor(name: str, i: int, t: object, device: torch.device | None, grad_mode: bool) -> torch.Tensor:
    """One list element: a dense float tensor on `device` (when known) that autograd does not track."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{name}[{i}] must be a dense (strided) tensor, got layout {t.layout}")
    if t.dtype not in _FLOATS:
        raise TypeError(f"{name}[{i}] must be float32, float64, bfloat16 or float16, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}[{i}] is on {t.device} but accumulators[0] is on {device}")
    if grad_mode and t.requires_grad:
        # The op is not differentiable and writes in place outside autograd.
        raise ValueError(
            f"{name}[{i}] requires grad; scale_accumulate_ is not differentiable: pass .grad tensors or "
            "detached buffers, or call it under torch.no_grad()"
        )
    return t


def _check_pair(i: int, acc: object, grad: object, device: torch.device, grad_mode: bool) -> None:
    _check_tensor("accumulators", i, acc, device, grad_mode)
    _check_tensor("grads", i, grad, device, grad_mode)
    if acc.shape != grad.shape:
        raise ValueError(f"accumulators[{i}] has shape {tuple(acc.shape)} but grads[{i}] has shape {tuple(grad.shape)}")
    if not acc.is_contiguous() and any(st == 0 and sz > 1 for st, sz in zip(acc.stride(), acc.shape)):
        raise ValueError(
            f"accumulators[{i}] has elements that share memory (an expanded tensor) and cannot be written in place"
        )


def _check_traced_pairs(accumulators: list, grads: list, grad_mode: bool) -> None:
    """The pair checks while torch.compile traces, or on fake tensors: dynamo cannot trace
    into the C++ scan (checked here, the checks become guards) and fake tensors have no
    addresses (the overlap check is left to the kernels, which see real ones)."""
    if len(accumulators) != len(grads):
        raise ValueError(
            f"accumulators and grads must have the same length, got {len(accumulators)} accumulators "
            f"and {len(grads)} grads"
        )
    for i, (acc, grad) in enumerate(zip(accumulators, grads)):
        _check_pair(i, acc, grad, accumulators[0].device if i else None, grad_mode)


def _raise(fault: tuple[str, str] | None) -> None:
    """Raises a fault the C++ scan reports as ``("type" | "value", message)``.

    The scan returns faults rather than raising them, so the error is raised here, in
    Python, as the Python class the message names.
    """
    if fault is not None:
        kind, message = fault
        raise (TypeError if kind == "type" else ValueError)(message)


def _as_scale(scale: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A 0-dim float32/float64 tensor on `device` or on the CPU (then read by value, no copy)."""
    if isinstance(scale, torch.Tensor):
        if scale.layout != torch.strided:
            raise TypeError(f"scale must be a dense tensor, got layout {scale.layout}")
        if scale.dim() != 0:
            raise ValueError(f"scale must be a Python number or a 0-dim tensor, got shape {tuple(scale.shape)}")
        if not scale.is_floating_point():
            raise TypeError(f"scale must be a floating-point tensor, got {scale.dtype}")
        if scale.device != device and scale.device.type != "cpu":
            raise ValueError(f"scale is on {scale.device} but must be on {device} or be a CPU scalar")
        if scale.dtype not in (torch.float32, torch.float64):
            scale = scale.to(torch.float32)  # on its own device: no host sync
        return scale.detach()
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a Python number or a 0-dim tensor, got {type(scale).__name__}")
    try:
        value = float(scale)
    except OverflowError:  # an int beyond any float (10**400)
        raise ValueError("scale must be finite, got an int too large for a float") from None
    if not math.isfinite(value):
        raise ValueError(f"scale must be finite, got {value}")
    # A CPU scalar: the CUDA kernel takes its value as a kernel argument, no copy.
    return torch.tensor(value, dtype=torch.float64)


def _as_found_inf(found_inf: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    if found_inf is None:
        return torch.zeros((), dtype=torch.float32, device=device)
    if not isinstance(found_inf, torch.Tensor):
        raise TypeError(f"found_inf must be a 0-dim float32 tensor or None, got {type(found_inf).__name__}")
    if found_inf.layout != torch.strided or found_inf.dim() != 0 or found_inf.dtype != torch.float32:
        raise ValueError(
            f"found_inf must be a dense 0-dim float32 tensor, got {found_inf.dtype} of shape "
            f"{tuple(found_inf.shape)} ({found_inf.layout})"
        )
    if found_inf.device != device:
        raise ValueError(f"found_inf is on {found_inf.device} but the tensors are on {device}")
    if found_inf.requires_grad and torch.is_grad_enabled():
        raise ValueError("found_inf requires grad; it is written in place: pass a plain float32 tensor")
    return found_inf


def is_dtensor(t: Any) -> bool:
    """A ``torch.distributed.tensor.DTensor`` (FSDP2's parameters and gradients)."""
    dtensor = getattr(getattr(torch.distributed, "tensor", None), "DTensor", None)
    return dtensor is not None and isinstance(t, dtensor)


def _refuse_dtensors(*groups: Any) -> None:
    """DTensors (FSDP2's sharded gradients) have no sharding rule for the op: refused with the
    fix, instead of the dispatcher's error about shared memory."""
    for name, group in zip(("accumulators", "grads", "found_inf"), groups):
        items = group if isinstance(group, list) else [group]
        if any(is_dtensor(t) for t in items):
            raise TypeError(f"{name} holds DTensors (sharded, e.g. FSDP2 gradients), which scale_accumulate_ does "
                            "not take: pass their local shards ([t.to_local() for t in ...]), which it adds "
                            "shard by shard")


def scale_accumulate_(
    accumulators: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    scale: float | torch.Tensor,
    found_inf: torch.Tensor | None = None,
) -> torch.Tensor:
    """``accumulators[i] += scale * grads[i]`` for every i, in one fused pass.

    Math runs in float32 (float64 for float64 accumulators), so bf16/fp16 gradients
    can accumulate into float32 buffers without a cast copy. ``found_inf`` (a 0-dim
    float32 tensor on the tensors' device) is set to 1.0 when any grad holds inf or
    NaN and is never reset here; it is created when not given and returned. Nothing
    here synchronizes with the GPU: ``scale`` may be a device tensor and is not checked (a
    non-finite one makes the accumulators non-finite without setting ``found_inf``).

    Raises TypeError/ValueError naming the argument for: lists of different lengths,
    non-tensors, non-float or sparse tensors, shape or device mismatches, devices
    other than cpu/cuda, tensors that require grad while grad mode is on (the op is
    not differentiable), expanded accumulators, and accumulators or a found_inf that
    share memory with another argument.
    """
    accumulators = _as_list("accumulators", accumulators)
    grads = _as_list("grads", grads)
    _refuse_dtensors(accumulators, grads, found_inf)
    grad_mode = torch.is_grad_enabled()
    traced = torch.compiler.is_compiling() or any(
        isinstance(t, FakeTensor) for t in (found_inf, *accumulators[:1], *grads[:1])
    )
    if traced:
        _check_traced_pairs(accumulators, grads, grad_mode)
    else:
        _raise(_C._pair_fault(accumulators, grads, grad_mode))  # lengths, devices, every pair
    if accumulators:
        device = accumulators[0].device
    else:  # no pairs: the flag's (or scale's) device, else the CPU
        if isinstance(found_inf, torch.Tensor):
            device = found_inf.device
        elif isinstance(scale, torch.Tensor):
            device = scale.device
        else:
            device = torch.device("cpu")
    if device.type not in _DEVICE_TYPES:
        raise ValueError(f"the tensors are on {device}; scale_accumulate_ runs on cpu and cuda tensors")
    scale_t = _as_scale(scale, device)
    found_inf = _as_found_inf(found_inf, device)
    if accumulators:
        if not traced:
            _raise(_C._overlap_fault(accumulators, grads, scale_t, found_inf))
        _OP(accumulators, grads, scale_t, found_inf)
    return found_inf
