"""Choosing the micro-batch size from a measurement of what one sample costs.

``plan_micro_batch`` runs the forward pass (and loss) on two small probe micro-batches
and records every tensor autograd saves for backward (``saved_tensors_hooks``). The
difference between the two probes gives the activation bytes per sample, the rest is
a fixed cost; add the input bytes each sample occupies in the ring's slots and the
gradient/accumulator memory, and the largest micro-batch that fits the budget follows.
Probes run with RNG state and module buffers restored afterwards, so planning never
changes what the training step computes.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mbs_ext import _checks
from mbs_ext import batch as _batch
from mbs_ext import loss as _loss
from mbs_ext.snapshot import Snapshot

CUDA_SAFETY_FACTOR = 0.8  # share of the free device memory "auto" plans for by default


@dataclass(frozen=True)
class MicroBatchPlan:
    """The chosen micro-batch size and the measurements behind it (bytes)."""

    micro_batch_size: int
    saved_bytes_per_sample: int
    input_bytes_per_sample: int
    per_sample_bytes: int
    fixed_bytes: int
    memory_budget: int
    num_rows: int

    def estimate(self, micro_batch_size: int) -> int:
        """Predicted peak bytes of one micro-batch of this size."""
        return self.fixed_bytes + micro_batch_size * self.per_sample_bytes

    def saved_bytes(self, micro_batch_size: int) -> int:
        """Predicted bytes saved for backward by a micro-batch of this size."""
        return self._saved_intercept + micro_batch_size * self.saved_bytes_per_sample

    _saved_intercept: int = 0


_HOST_OOM_MESSAGES = ("can't allocate memory", "not enough memory", "Cannot allocate memory", "bad_alloc")


def is_out_of_memory(exc: BaseException) -> bool:
    """torch.OutOfMemoryError, MemoryError, or torch's CPU allocator failing (a RuntimeError)."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(msg in str(exc) for msg in _HOST_OOM_MESSAGES)


def default_budget(device: torch.device, memory_budget: int | None) -> int:
    """The budget to plan for: the caller's, or on CUDA the free memory times a safety factor."""
    _checks.check_memory_budget(memory_budget)
    if memory_budget is not None:
        return int(memory_budget)
    if device.type == "cuda":
        # Memory the caching allocator holds but does not use is available too.
        free, _total = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int((free + cached) * CUDA_SAFETY_FACTOR)
    raise ValueError(
        f"micro_batch_size='auto' on {device.type} needs memory_budget (bytes available to the step); "
        "only CUDA devices report their free memory"
    )


@contextlib.contextmanager
def _probing(model: nn.Module, device: torch.device):
    """Restore RNG streams and module buffers after probe forwards (no trace left)."""
    snap = Snapshot(model, device)
    try:
        yield
    finally:
        snap.restore()


def measure_saved_bytes(
    model: nn.Module,
    micro_batch: Any,
    call: Callable[[nn.Module, Any], torch.Tensor],
    autocast_dtype: torch.dtype | None = None,
) -> int:
    """Bytes of distinct storages autograd saves for backward in one forward + loss.

    Parameters, buffers and the micro-batch's own tensors are not counted: they are
    resident anyway (the inputs are counted separately, per ring slot).
    """
    resident = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    resident |= {t.untyped_storage().data_ptr() for t in _batch.tensor_leaves(micro_batch)}
    seen: set[int] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key and key not in resident and key not in seen:
            seen.add(key)
            total += storage.nbytes()
        return t

    device = _checks.model_device(model)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _loss.autocast(device, autocast_dtype):
        loss = call(model, micro_batch)
    del loss
    return total


def _probe_batch(batch: Any, rows: int, indices: torch.Tensor | None, device: torch.device) -> Any:
    picked = torch.arange(rows) if indices is None else indices[:rows]
    return _batch.to_device(_batch.take(batch, picked), device)


def _row_bytes(batch: Any) -> int:
    return sum(t[:1].numel() * t.element_size() for t in _batch.tensor_leaves(batch))


def plan(
    model: nn.Module,
    batch: Any,
    call: Callable[[nn.Module, Any], torch.Tensor],
    memory_budget: int,
    *,
    num_rows: int,
    indices: torch.Tensor | None = None,
    slots: int = 2,
    accumulate_dtype: torch.dtype | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> MicroBatchPlan:
    """Measure two probes and pick the largest micro-batch within ``memory_budget``."""
    device = _checks.model_device(model)
    small = min(2, num_rows)
    large = min(8, num_rows)
    with _probing(model, device):
        saved_small = measure_saved_bytes(model, _probe_batch(batch, small, indices, device), call, autocast_dtype)
        saved_large = (
            measure_saved_bytes(model, _probe_batch(batch, large, indices, device), call, autocast_dtype)
            if large > small
            else saved_small
        )
    if large > small:
        per_sample_saved = max(0, math.ceil((saved_large - saved_small) / (large - small)))
    else:
        per_sample_saved = math.ceil(saved_small / small)
    intercept = max(0, saved_small - per_sample_saved * small)

    input_row = _row_bytes(batch)
    per_sample = per_sample_saved + input_row * (slots + 1)  # staged slots + the one in use
    trainable = [p for p in model.parameters() if p.requires_grad]
    grad_bytes = sum(p.numel() * p.element_size() for p in trainable)
    acc_bytes = 0
    if accumulate_dtype is not None:  # separate buffers, one per trainable parameter
        acc_size = torch.empty((), dtype=accumulate_dtype).element_size()
        acc_bytes = sum(p.numel() * acc_size for p in trainable)
    fixed = intercept + grad_bytes + acc_bytes
    room = memory_budget - fixed
    if room < per_sample:
        raise ValueError(
            f"memory_budget={memory_budget} bytes is too small: the fixed cost is {fixed} bytes "
            f"(gradients/accumulators {grad_bytes + acc_bytes}) and one sample needs {per_sample} bytes"
        )
    size = max(1, min(num_rows, room // max(per_sample, 1)))
    return MicroBatchPlan(
        micro_batch_size=int(size),
        saved_bytes_per_sample=per_sample_saved,
        input_bytes_per_sample=input_row,
        per_sample_bytes=per_sample,
        fixed_bytes=fixed,
        memory_budget=int(memory_budget),
        num_rows=int(num_rows),
        _saved_intercept=intercept,
    )


def plan_micro_batch(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable,
    memory_budget: int | None = None,
    *,
    indices: torch.Tensor | None = None,
    slots: int = 2,
    autocast_dtype: torch.dtype | None = None,
) -> MicroBatchPlan:
    """Estimate the largest micro-batch of ``batch`` whose step fits ``memory_budget`` bytes.

    ``loss_fn`` follows :func:`mbs_ext.step`'s convention. On CUDA the budget defaults to
    the free device memory times a safety factor; on CPU it is required.
    """
    _checks.check_model(model)
    _checks.trainable(model)  # raises when nothing is trainable
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    rows = _batch.check_batch(batch)
    if indices is not None:
        indices = _batch.check_indices(indices, rows)
        rows = int(indices.numel())
    device = _checks.model_device(model)
    budget = default_budget(device, memory_budget)
    return plan(
        model,
        batch,
        _loss.loss_caller(loss_fn, batch),
        budget,
        num_rows=rows,
        indices=indices,
        slots=slots,
        autocast_dtype=autocast_dtype,
    )
