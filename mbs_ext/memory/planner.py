"""Choosing the micro-batch size from measured peaks of real probe steps.

``plan`` (behind ``micro_batch_size="auto"`` and ``plan_micro_batch``) runs forward,
loss and backward on small probe micro-batches after one warm-up (workspaces created
once are resident, not per-step cost) and measures the peak each adds: CUDA allocator
statistics on a GPU, a dispatch-level live-bytes tracker (``PeakTracker``) on the CPU.
A straight line through two probes gives fixed + per-row bytes; staged inputs and float
accumulation buffers are added by count; the size that suggests is then measured itself
and moved, down or up, by secant until its peak is in a window under the budget
(:func:`_search`). On the CPU that verification is judged by the process's own peak
resident set (``RssPeak``) for budgets from ``RSS_MIN_BUDGET``: the tracker sees op
outputs only, not what kernels allocate inside (convolution column buffers, oneDNN
scratchpads: a U-Net's real peak is ~1.17x the tracker's). Probes restore RNG state, module buffers and ``.grad``, so
planning never changes what the training step computes. ``default_budget`` and
``cuda_room`` know the device's real limit (the per-process memory fraction included).
The probes themselves live in :mod:`~mbs_ext.memory.probe`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from mbs_ext.counts import loss as _loss
from mbs_ext.memory.backoff import is_out_of_memory
from mbs_ext.memory.probe import (
    RssPeak,
    measure_forward_peak,
    measure_peak,
    measure_saved_bytes,
    probe_batch,
    probing,
    row_bytes,
)
from mbs_ext.model.grads import accumulation_dtype, buffer_layout
from mbs_ext.model.members import check_grad_mode, check_model, model_device, trainable
from mbs_ext.model.options import check_memory_budget
from mbs_ext.streaming import batch as _batch
from mbs_ext.streaming.tokens import longest_first

CUDA_SAFETY_FACTOR = 0.92  # share of the room on the device "auto" plans for by default
# On the CPU, budgets from this size up are judged by the process's peak resident set
# (RssPeak); below it its page/per-CPU-counter resolution is too coarse and the
# dispatch tracker judges (it sees op outputs only).
RSS_MIN_BUDGET = 8 << 20
# (lowest accepted, highest accepted, aimed at) share of the budget a verified size's
# peak may take, per meter. The RSS meter sees everything but is noisier, so it aims
# below the budget; a verified peak under "lowest" makes the search grow the size.
WINDOWS = {"rss": (0.88, 0.985, 0.95), "tracker": (0.85, 1.0, 1.0), "cuda": (0.85, 1.0, 1.0)}
FULL_PROBES = {"rss": 2, "tracker": 4, "cuda": 4}  # verifications at full size, at most


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
    meter: str = ""  # what judged the planned size: "rss", "tracker" or "cuda"
    probes: tuple[int, ...] = ()  # rows of each probe step run (warm-up, line fit, verifications)
    verified: tuple[tuple[int, int], ...] = ()  # (rows, measured peak bytes) of each verification


def cuda_room(*, total: int, fraction: float, allocated: int, reserved: int, free: int) -> int:
    """Bytes this process can still allocate on a CUDA device.

    The smaller of two limits: the per-process cap (``total * fraction`` as set by
    ``torch.cuda.set_per_process_memory_fraction``, minus what this process's tensors
    already occupy), and what the device itself can still give (its free memory plus
    what the caching allocator holds but does not use).
    """
    under_cap = int(total * fraction) - allocated
    on_device = free + (reserved - allocated)
    return max(0, min(under_cap, on_device))


def default_budget(device: torch.device, memory_budget: int | None) -> int:
    """The budget to plan for: the caller's, or on CUDA :func:`cuda_room` times a margin.

    The planner measures the real peak, so the margin only covers what it cannot see:
    allocator rounding and fragmentation, and cuBLAS/cuDNN workspaces created later.
    """
    check_memory_budget(memory_budget)
    if memory_budget is not None:
        return int(memory_budget)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        fraction = float(get_fraction(device)) if get_fraction is not None else 1.0
        room = cuda_room(
            total=total, fraction=fraction, allocated=torch.cuda.memory_allocated(device),
            reserved=torch.cuda.memory_reserved(device), free=free,
        )
        return int(room * CUDA_SAFETY_FACTOR)
    raise ValueError(
        f"'auto' (micro_batch_size or micro_batch_tokens) on {device.type} needs memory_budget (bytes available "
        "to the step); only CUDA devices report their free memory"
    )


def _fit(small: int, large: int, at_small: int, at_large: int) -> tuple[int, int]:
    """(per-row, fixed) bytes of a straight line through two measurements, never negative."""
    if large > small:
        per_row = max(0, math.ceil((at_large - at_small) / (large - small)))
    else:
        per_row = math.ceil(at_small / small)
    return per_row, max(0, at_small - per_row * small)


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
    """The largest micro-batch whose measured peak fits ``memory_budget``: a line through two
    small probes (:func:`_probe_line`) plus staged inputs and accumulation buffers by count
    suggests a size, which is then measured itself and moved, up or down, into the meter's
    window (:func:`_search`; by the OS on the CPU, see :func:`_meter`)."""
    device = model_device(model)
    input_row = row_bytes(batch)
    staged_row = input_row * (slots + 1) if _stages(batch, indices, device) else 0
    grad_bytes, acc_bytes = _gradient_bytes(model, accumulate_dtype)
    accumulating = accumulate_dtype is None  # autograd adds into .grad
    held = grad_bytes if accumulating else 0  # the sum in .grad stays resident
    with probing(model, device):
        small, large = min(4, num_rows), min(16, num_rows)
        per_sample_saved, intercept, per_row, fixed_peak = _probe_line(
            model, batch, indices, device, call, autocast_dtype, accumulating, held, (small, large))
        fixed = max(fixed_peak, intercept + grad_bytes) + acc_bytes
        per_sample = per_row + staged_row
        _check_fits(memory_budget, fixed, per_sample, grad_bytes + acc_bytes)
        meter = _meter(device, memory_budget)
        need = functools.partial(_step_need, model, batch, indices, device, call, autocast_dtype, accumulating,
                                 "rss" if meter == "rss" else "tracker", acc_bytes + held, staged_row)
        size, verified = _search(need, _first_guess(meter, memory_budget, fixed, per_sample, num_rows),
                                 num_rows=num_rows, budget=memory_budget, fixed=fixed,
                                 probed=0 if meter == "rss" else large, meter=meter)
        if meter == "rss" and size in verified:  # report the line the OS measured
            per_sample = max(per_sample, math.ceil((verified[size] - fixed) / size))
        probes = (small, small, large, *verified)
    return MicroBatchPlan(
        micro_batch_size=int(size), saved_bytes_per_sample=per_sample_saved, input_bytes_per_sample=input_row,
        per_sample_bytes=per_sample, fixed_bytes=fixed, memory_budget=int(memory_budget), num_rows=int(num_rows),
        _saved_intercept=intercept, meter=meter, probes=tuple(int(n) for n in probes),
        verified=tuple((int(n), int(b)) for n, b in verified.items()),
    )


def plan_token_budget(model: nn.Module, batch: Any, call: Callable[[nn.Module, Any], torch.Tensor],
                      memory_budget: int, *, info: _batch.BatchInfo, token_lengths: Any,
                      accumulate_dtype: torch.dtype | None = None,
                      autocast_dtype: torch.dtype | None = None) -> tuple[int, MicroBatchPlan]:
    """``micro_batch_tokens="auto"``: rows of the longest length, as many as :func:`plan` fits in
    ``memory_budget``, times that length; and the row plan behind it.

    Memory follows token positions (rows x width). The plan's widest micro-batch holds rows of
    the longest length; its others are narrower with more rows, which costs at most as much per
    position (attention costs less per position in shorter rows). The probes run the batch's
    longest rows, trimmed as the step streams them."""
    rows, longest = longest_first(batch, info, token_lengths)
    planned = plan(model, rows, call, memory_budget, num_rows=info.rows, accumulate_dtype=accumulate_dtype,
                   autocast_dtype=autocast_dtype)
    return planned.micro_batch_size * longest, planned


def plan_forward(model: nn.Module, batch: Any, fn: Callable[[nn.Module, Any], Any],
                 memory_budget: int | None = None, *, indices: torch.Tensor | None = None, slots: int = 2,
                 autocast_dtype: torch.dtype | None = None) -> int:
    """The micro-batch size :func:`mbs_ext.forward` takes for ``micro_batch_size="auto"``: the most
    rows whose no-grad ``fn(model, rows)`` fits ``memory_budget`` (required on the CPU; on CUDA
    the room the device leaves) less what the call keeps: every row's output, twice at the end
    (the micro-batches' outputs and their concatenation). Measured as :func:`plan` measures a
    step (a line through two probes, then the suggested size itself, on the same meters), with
    :func:`~mbs_ext.memory.probe.measure_forward_peak` in place of a forward and backward."""
    device = model_device(model)
    info = _batch.check(batch, indices, device)
    memory_budget, num_rows, indices = default_budget(device, memory_budget), info.rows, info.indices
    # Staged rows, as in plan; else the probes' own copy of their rows (the call itself uses views).
    staged_row = row_bytes(batch) * (slots + 1 if _stages(batch, indices, device) else 1)
    with probing(model, device):
        small, large = min(4, num_rows), min(16, num_rows)
        mbs = {n: probe_batch(batch, n, indices, device) for n in sorted({small, large})}
        kept = 2 * _output_row_bytes(model, mbs[small], small, fn, autocast_dtype) * num_rows
        measure_forward_peak(model, mbs[small], fn, autocast_dtype)  # warm-up, as in _probe_line
        peaks = {n: measure_forward_peak(model, mb, fn, autocast_dtype) for n, mb in mbs.items()}
        per_row, fixed = _fit(small, large, peaks[small], peaks[large])
        budget = memory_budget - kept
        if budget - fixed < per_row + staged_row:
            raise ValueError(
                f"memory_budget={memory_budget} bytes is too small for mbs_ext.forward: the outputs of the "
                f"{num_rows} rows and their concatenation take about {kept} bytes, and one row's forward "
                f"{fixed + per_row + staged_row}")
        meter = _meter(device, budget)

        def need(n: int) -> int:
            mb = probe_batch(batch, n, indices, device)
            peak = measure_forward_peak(model, mb, fn, autocast_dtype, "rss" if meter == "rss" else "tracker")
            return peak + n * staged_row

        size, _ = _search(need, _first_guess(meter, budget, fixed, per_row + staged_row, num_rows),
                          num_rows=num_rows, budget=budget, fixed=fixed, probed=0 if meter == "rss" else large,
                          meter=meter)
    return int(size)


def _output_row_bytes(model: nn.Module, micro_batch: Any, rows: int, fn: Callable,
                      autocast_dtype: torch.dtype | None) -> int:
    """Bytes of ``fn``'s output per row of ``micro_batch`` (its tensor leaves, dim 0 the rows)."""
    with torch.no_grad(), _loss.autocast(model_device(model), autocast_dtype):
        leaves = tree_leaves(fn(model, micro_batch))
    return math.ceil(sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor)) / rows)


def _first_guess(meter: str, budget: int, fixed: int, per_sample: int, num_rows: int) -> int:
    """The size the probes' line suggests; on the OS meter aimed below the budget (the tracker's
    line misses kernels' internal buffers)."""
    goal = int(budget * WINDOWS["rss"][2]) if meter == "rss" else budget
    return max(1, min(num_rows, (goal - fixed) // max(per_sample, 1)))


def _probe_line(model: nn.Module, batch: Any, indices: torch.Tensor | None, device: torch.device,
                call: Callable, autocast_dtype: torch.dtype | None, accumulating: bool, held: int,
                sizes: tuple[int, int]) -> tuple[int, int, int, int]:
    """Two small probes: (saved bytes per row, saved-bytes intercept, peak bytes per row, fixed
    peak bytes) of straight lines through them, after one warm-up probe."""
    small, large = sizes
    mbs = {n: probe_batch(batch, n, indices, device) for n in sorted({small, large})}
    saved = {n: measure_saved_bytes(model, mb, call, autocast_dtype) for n, mb in mbs.items()}
    # Warm-up: what the first forward/backward of a process creates once and keeps
    # (cuBLAS/cuDNN workspaces, lazily built state) is resident, not a per-step cost.
    measure_peak(model, mbs[small], call, autocast_dtype, accumulating)
    peaks = {n: measure_peak(model, mb, call, autocast_dtype, accumulating) + held for n, mb in mbs.items()}
    per_sample_saved, intercept = _fit(small, large, saved[small], saved[large])
    per_row, fixed_peak = _fit(small, large, peaks[small], peaks[large])
    return per_sample_saved, intercept, max(per_row, per_sample_saved), fixed_peak


def _step_need(model: nn.Module, batch: Any, indices: torch.Tensor | None, device: torch.device, call: Callable,
               autocast_dtype: torch.dtype | None, accumulating: bool, meter: str, resident: int,
               staged_row: int, n: int) -> int:
    """Bytes a step of ``n`` rows needs, measured: its peak on ``meter``, what stays resident
    beside it (accumulation buffers, the sum in ``.grad``) and its ``n`` staged rows."""
    peak = measure_peak(model, probe_batch(batch, n, indices, device), call, autocast_dtype, accumulating,
                        meter=meter)
    return peak + resident + n * staged_row


def _stages(batch: Any, indices: torch.Tensor | None, device: torch.device) -> bool:
    """Whether the ring copies: to a device, or a gather by indices.

    A CPU step on a host batch (or any step on a batch already on the device) uses views.
    """
    on_device = all(t.device == device for t in _batch.tensor_leaves(batch))
    return indices is not None or (device.type != "cpu" and not on_device)


def _check_fits(budget: int, fixed: int, per_sample: int, gradient_bytes: int) -> None:
    if budget - fixed < per_sample:
        raise ValueError(
            f"memory_budget={budget} bytes is too small: the fixed cost is {fixed} bytes "
            f"(gradients/accumulators {gradient_bytes}) and one sample needs {per_sample} bytes"
        )


def _gradient_bytes(model: nn.Module, accumulate_dtype: torch.dtype | None) -> tuple[int, int]:
    """Bytes of the trainable parameters' gradients, and of float accumulation buffers (if any)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    grad_bytes = sum(p.numel() * p.element_size() for p in trainable)
    acc_bytes = 0
    if accumulate_dtype is not None:  # one flat buffer with a view per trainable parameter
        _, length = buffer_layout([p.numel() for p in trainable], accumulate_dtype.itemsize)
        acc_bytes = length * accumulate_dtype.itemsize
    return grad_bytes, acc_bytes


def _meter(device: torch.device, budget: int) -> str:
    """What judges a planned size: CUDA's allocator; on the CPU the OS (RssPeak) for budgets
    it resolves, else the dispatch tracker."""
    if device.type == "cuda":
        return "cuda"
    if device.type == "cpu" and budget >= RSS_MIN_BUDGET and RssPeak.available():
        return "rss"
    return "tracker"


def _search(need: Callable[[int], int], size: int, *, num_rows: int, budget: int, fixed: int, probed: int,
            meter: str) -> tuple[int, dict[int, int]]:
    """Measure the suggested size itself and move it, down or up, until its peak is in the window.

    At most ``FULL_PROBES[meter]`` measurements: the first new size comes from the line
    through ``fixed`` and the measured point, later ones from the line through the last
    two measured points (a secant), each aimed at the window's target. A measured peak
    under the window's floor grows the size (by 4x at most per move); over the budget
    shrinks it. When the measurements run out the largest measured size that fits is
    returned, or, if the last one did not fit, the secant's smaller size (unmeasured).
    Returns the size and the measured needs by size. Sizes up to ``probed`` rows were
    measured by the line fit already and are taken as they are.
    """
    low, high, aim = WINDOWS[meter]
    measured: dict[int, int] = {}
    order: list[int] = []
    for _ in range(FULL_PROBES[meter]):
        if size <= probed and not order:
            return size, measured
        try:
            got = need(size)
        except BaseException as exc:
            if not is_out_of_memory(exc):
                raise
            got = 2 * budget  # too large: shrink by half at least
        measured[size] = got
        order.append(size)
        if got <= high * budget and (got >= low * budget or size == num_rows):
            return size, measured
        nxt = _next_size(order, measured, fixed, int(aim * budget), num_rows)
        if nxt == size or nxt in measured:
            break
        size = nxt
    best = max((n for n in measured if measured[n] <= high * budget), default=0)
    if measured[order[-1]] > high * budget:  # the secant's smaller size, below every size measured too large
        cap = min(n for n in measured if measured[n] > high * budget) - 1
        best = max(best, min(size, cap))
    return max(1, best), measured


def _next_size(order: list[int], measured: dict[int, int], fixed: int, goal: int, num_rows: int) -> int:
    """The size a straight line through the last measurements puts at ``goal`` bytes."""
    n2 = order[-1]
    p2 = measured[n2]
    slope = 0.0
    if len(order) >= 2 and order[-2] != n2:
        n1 = order[-2]
        slope = (p2 - measured[n1]) / (n2 - n1)
    if slope > 0:
        target = n2 + (goal - p2) / slope
    else:
        target = n2 * (goal - fixed) / max(p2 - fixed, 1)
    target = int(min(target, 4 * n2))
    if p2 > goal:
        target = min(target, n2 - 1)
    else:
        target = max(target, n2 + 1)
    return max(1, min(num_rows, target))


def plan_micro_batch(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable,
    memory_budget: int | None = None,
    *,
    indices: torch.Tensor | None = None,
    slots: int = 2,
    autocast_dtype: torch.dtype | None = None,
    accumulate_dtype: torch.dtype | None = None,
) -> MicroBatchPlan:
    """Estimate the largest micro-batch of ``batch`` whose step fits ``memory_budget`` bytes.

    ``loss_fn`` follows :func:`mbs_ext.step`'s convention, and ``accumulate_dtype`` means
    what it means there (by default float32 buffers when some parameter is bf16/fp16, which
    the plan counts). On CUDA the budget defaults to the room the device and the process's
    memory fraction leave, times a safety factor; on CPU it is required.
    """
    check_model(model)
    check_grad_mode("mbs_ext.plan_micro_batch")  # its probes run backward
    params = trainable(model)  # raises when nothing is trainable
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    device = model_device(model)
    info = _batch.check(batch, indices, device)
    budget = default_budget(device, memory_budget)
    return plan(
        model,
        batch,
        _loss.loss_caller(loss_fn, info.pair),
        budget,
        num_rows=info.rows,
        indices=info.indices,
        slots=slots,
        accumulate_dtype=accumulation_dtype(accumulate_dtype, params),
        autocast_dtype=autocast_dtype,
    )
