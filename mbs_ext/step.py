"""The micro-batch streamed training step.

``step(model, optimizer, batch, loss_fn, micro_batch_size=m)`` equals
``optimizer.zero_grad(); loss_fn(model, batch).backward(); optimizer.step()`` on the
whole mini-batch, while only one micro-batch at a time lives on the model's device.

How the pieces fit:

* The batch streams through a :class:`~mbs_ext.ring.StreamRing` (one per streamer).
* Each micro-batch i has a count ``c_i`` (see :mod:`mbs_ext.normalize`); its mean loss
  is weighted by ``c_i / sum(c)`` (times the world size under DDP, which averages).
  When the total is only known at the end (count callables, DDP), earlier micro-batches
  use a provisional denominator and the accumulated gradient is rescaled once, before
  the last backward.
* Gradients accumulate either in ``.grad`` through autograd (weight folded into the
  loss) or, for low-precision parameters, in float32 buffers via the fused
  ``scale_accumulate_`` op; the sum is cast into ``.grad`` at the end.
* One host sync at the end reads the loss, the non-finite flag and the gradient norm.
* Everything that changes before the optimizer step (module buffers, deferred BatchNorm
  statistics, grads, GradScaler state) is restored if anything raises, so a failed
  step leaves no trace.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.loss import _Loss
from torch.nn.parallel import DistributedDataParallel

from mbs_ext import batch as _batch
from mbs_ext import memory as _memory
from mbs_ext import normalize as _norm
from mbs_ext.batchnorm import deferred_layers
from mbs_ext.ops import scale_accumulate_
from mbs_ext.ring import StreamRing

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_ON_NONFINITE = ("skip", "raise")


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


def _check_micro_batch_size(micro_batch_size: Any) -> None:
    if isinstance(micro_batch_size, str):
        if micro_batch_size != "auto":
            raise ValueError(f"micro_batch_size must be an int >= 1 or 'auto', got {micro_batch_size!r}")
        return
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, numbers.Integral):
        kind = type(micro_batch_size).__name__
        raise TypeError(f"micro_batch_size must be an int >= 1 or 'auto', got {kind}")
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be an int >= 1, got {micro_batch_size}")


def _check_dtype(value: Any, name: str) -> None:
    if value is None:
        return
    if not isinstance(value, torch.dtype):
        raise TypeError(f"{name} must be a floating torch.dtype or None, got {type(value).__name__}")
    if not value.is_floating_point:
        raise ValueError(f"{name} must be a floating dtype, got {value}")


def _check_options(
    loss_fn: Any,
    micro_batch_size: Any,
    normalize: Any,
    scaler: Any,
    autocast_dtype: Any,
    max_grad_norm: Any,
    accumulate_dtype: Any,
    on_nonfinite: Any,
) -> None:
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(model, batch), got {type(loss_fn).__name__}")
    _check_micro_batch_size(micro_batch_size)
    _norm.check_normalize(normalize)
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(f"scaler must be a torch.amp.GradScaler or None, got {type(scaler).__name__}")
    _check_dtype(autocast_dtype, "autocast_dtype")
    _check_dtype(accumulate_dtype, "accumulate_dtype")
    if max_grad_norm is not None:
        if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, numbers.Real):
            kind = type(max_grad_norm).__name__
            raise TypeError(f"max_grad_norm must be a positive number or None, got {kind}")
        if math.isnan(max_grad_norm) or max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be > 0, got {max_grad_norm}")
    if on_nonfinite not in _ON_NONFINITE:
        raise ValueError(f"on_nonfinite must be one of {_ON_NONFINITE}, got {on_nonfinite!r}")


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    seen: set[int] = set()
    params = []
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            params.append(p)
    if not params:
        raise ValueError("model has no trainable parameters (none with requires_grad=True)")
    return params


def _check_model_optimizer(model: Any, optimizer: Any) -> list[nn.Parameter]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    params = _trainable(model)
    owned = {id(p) for g in optimizer.param_groups for p in g["params"]}
    if not any(id(p) in owned for p in params):
        raise ValueError("optimizer owns none of the model's trainable parameters")
    return params


def _check_loss(loss: Any, device: torch.device) -> None:
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"loss_fn must return a 0-dim torch.Tensor, got {type(loss).__name__}")
    if loss.dim() != 0:
        raise ValueError(f"loss_fn must return a 0-dim (scalar) tensor, got shape {tuple(loss.shape)}")
    if not loss.requires_grad:
        raise ValueError("loss_fn returned a tensor that does not require grad (detached from the model?)")
    if loss.device != device:
        raise ValueError(f"loss_fn returned a tensor on {loss.device}, but the model is on {device}")


def _loss_caller(loss_fn: Callable, batch: Any) -> Callable[[nn.Module, Any], torch.Tensor]:
    if not isinstance(loss_fn, _Loss):
        return loss_fn
    if not _batch.is_pair(batch):
        raise TypeError("loss_fn is a torch.nn loss module, so batch must be an (inputs, targets) pair")

    def call(model: nn.Module, micro_batch: Any) -> torch.Tensor:
        return loss_fn(model(micro_batch[0]), micro_batch[1])

    return call


def _first_param_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _nonfinite_flag(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """A 0-dim float32 tensor on ``device``: 1.0 when any grad holds inf/nan (no host sync)."""
    found = torch.zeros((), dtype=torch.float32, device=device)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    for (dev, _), gs in groups.items():
        flag = torch.zeros(1, dtype=torch.float32, device=dev)
        one = torch.ones(1, dtype=torch.float32, device=dev)
        torch._amp_foreach_non_finite_check_and_unscale_(gs, flag, one)
        found = torch.maximum(found, flag.to(device).reshape(()))
    return found


class _Buffers:
    """Flat accumulation buffers (one per device) with a view per parameter."""

    def __init__(self, params: list[nn.Parameter], dtype: torch.dtype) -> None:
        self.views: list[torch.Tensor] = [None] * len(params)  # type: ignore[list-item]
        self.flats: list[torch.Tensor] = []
        self.got = [False] * len(params)
        groups: dict[torch.device, list[int]] = {}
        for j, p in enumerate(params):
            groups.setdefault(p.device, []).append(j)
        self.groups = list(groups.values())
        for js in self.groups:
            dev = params[js[0]].device
            flat = torch.zeros(sum(params[j].numel() for j in js), dtype=dtype, device=dev)
            offset = 0
            for j in js:
                n = params[j].numel()
                self.views[j] = flat.narrow(0, offset, n).view_as(params[j])
                offset += n
            self.flats.append(flat)

    def add_(self, params: list[nn.Parameter], scale: float) -> None:
        """``buffer += scale * p.grad`` for every parameter with a grad, then drop the grad."""
        for js in self.groups:
            have = [j for j in js if params[j].grad is not None]
            if not have:
                continue
            scale_accumulate_([self.views[j] for j in have], [params[j].grad for j in have], scale)
            for j in have:
                self.got[j] = True
                params[j].grad = None

    def mul_(self, factor: float) -> None:
        for flat in self.flats:
            flat.mul_(factor)


class MicroBatchStreamer:
    """A reusable streamed training step bound to one model, optimizer and loss.

    Options are validated once here; the ring that stages micro-batches is created on
    first use and kept, so repeated steps reuse its host/device buffers.

    Options (shared with :func:`step`):

    * ``micro_batch_size``: int >= 1 (>= the batch size means one micro-batch), or
      ``"auto"``: the largest size whose step fits ``memory_budget`` bytes, planned
      from a measurement of two probe micro-batches (:func:`mbs_ext.plan_micro_batch`)
      and cached per input signature. ``memory_budget`` defaults to the free device
      memory times 0.8 on CUDA and is required on CPU.
    * ``normalize``: ``"samples"`` (weight n_i/N, exact for any split),
      ``"micro_batches"`` (1/M, wrong when micro-batches differ in size; for comparison)
      or ``count(micro_batch) -> int | Tensor`` for losses that average over a variable
      number of items (e.g. tokens); a tensor count costs one host sync per micro-batch.
    * ``scaler``: a ``torch.amp.GradScaler``; the step is scaled per micro-batch and
      unscaled, checked, stepped and updated once. Non-finite gradients with a finite
      loss are treated as scaler overflow: skipped without a warning, whatever
      ``on_nonfinite`` says.
    * ``autocast_dtype``: runs forward and loss under ``torch.autocast``.
    * ``accumulate_dtype``: dtype of separate accumulation buffers; by default float32
      when any trainable parameter is bf16/fp16, otherwise autograd accumulates in
      ``.grad`` directly.
    * ``max_grad_norm``: clip the total norm of the final unscaled gradient.
    * ``on_nonfinite``: ``"skip"`` leaves parameters, optimizer state and module buffers
      unchanged (``.grad`` keeps the offending gradient for inspection, a GradScaler
      still updates once) and warns; ``"raise"`` raises FloatingPointError with nothing
      changed.

    Under DistributedDataParallel the normalization is global (one small all-reduce
    per step), so the step equals a single-process step on the concatenated batch.

    Limits: a failure inside ``optimizer.step`` itself is not undone (that would need
    a copy of the parameters and optimizer state every step); under DDP a failure on
    one rank leaves the others waiting in their collectives; GradScaler refuses to
    unscale fp16 parameters' gradients, as it does without streaming.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor],
        *,
        micro_batch_size: int | str,
        normalize: str | Callable[[Any], int | torch.Tensor] = "samples",
        scaler: torch.amp.GradScaler | None = None,
        autocast_dtype: torch.dtype | None = None,
        max_grad_norm: float | None = None,
        accumulate_dtype: torch.dtype | None = None,
        on_nonfinite: str = "skip",
        memory_budget: int | None = None,
    ) -> None:
        _check_model_optimizer(model, optimizer)
        _memory.check_memory_budget(memory_budget)
        _check_options(
            loss_fn, micro_batch_size, normalize, scaler, autocast_dtype, max_grad_norm, accumulate_dtype,
            on_nonfinite,
        )
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.micro_batch_size = micro_batch_size
        self.normalize = normalize
        self.scaler = scaler
        self.autocast_dtype = autocast_dtype
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.accumulate_dtype = accumulate_dtype
        self.on_nonfinite = on_nonfinite
        self.memory_budget = memory_budget
        self._ring: Any = None
        self._ring_device: torch.device | None = None
        self._plans: dict[tuple, _memory.MicroBatchPlan] = {}  # "auto" sizes per input signature
        self._size_cap: dict[tuple, int] = {}  # sizes learned from out-of-memory back-off

    def _ring_for(self, device: torch.device) -> Any:
        if self._ring is None or torch.device(self._ring_device) != device:
            self._ring = StreamRing(device)
            self._ring_device = device
        return self._ring

    def _micro_batch_size(self, batch: Any, indices: torch.Tensor | None, rows: int, loss_call: Callable) -> tuple:
        """The size to stream with, and the cache key that out-of-memory back-off updates."""
        leaves = tuple((tuple(t.shape[1:]), t.dtype) for t in _batch.tensor_leaves(batch))
        if self.micro_batch_size != "auto":
            key = ("fixed", leaves)
            m = int(self.micro_batch_size)
        else:
            # Keyed on the caller's budget, not on a measured free-memory figure that
            # moves from step to step, so plans and back-off sizes stay remembered.
            key = ("auto", leaves, self.memory_budget, self.autocast_dtype)
            plan = self._plans.get(key)
            # A plan is capped by the rows of the batch it was made for; a larger batch
            # with the same signature may afford a larger micro-batch, so re-plan then.
            if plan is None or (plan.micro_batch_size >= plan.num_rows and rows > plan.num_rows):
                budget = _memory.default_budget(_first_param_device(self.model), self.memory_budget)
                plan = _memory.plan(
                    self.model, batch, loss_call, budget, num_rows=rows, indices=indices,
                    accumulate_dtype=_accumulation_dtype(self.accumulate_dtype, _trainable(self.model)),
                    autocast_dtype=self.autocast_dtype,
                )
                self._plans[key] = plan
            m = plan.micro_batch_size
        m = min(m, self._size_cap.get(key, m), rows)
        return max(1, m), key

    def plan(self) -> dict[tuple, _memory.MicroBatchPlan]:
        """The micro-batch plans made for ``"auto"`` so far, by input signature."""
        return dict(self._plans)

    def step(self, batch: Any, indices: torch.Tensor | None = None) -> StepResult:
        """One optimizer step over the mini-batch ``batch`` (or its rows at ``indices``).

        If a micro-batch runs out of memory (``torch.OutOfMemoryError`` on a device, or a
        host allocation failure), the step is undone and redone from scratch with half
        the micro-batch size, down to 1; the smaller size is remembered for later steps.
        """
        t_begin = time.perf_counter()
        params = _check_model_optimizer(self.model, self.optimizer)
        rows = _batch.check_batch(batch)
        if indices is not None:
            indices = _batch.check_indices(indices, rows)
            rows = indices.numel()
        loss_call = _loss_caller(self.loss_fn, batch)
        device = _first_param_device(self.model)
        m, key = self._micro_batch_size(batch, indices, rows, loss_call)
        while True:
            num_mb = -(-rows // m)
            ring = self._ring_for(device)
            run = _Run(self, params, batch, indices, rows, m, num_mb, device, ring, loss_call)
            try:
                result = run.execute()
                break
            except BaseException as exc:
                run.rollback(clear_grads=True)
                # Back off only while nothing irreversible happened: not once the
                # optimizer started stepping, and never under DDP (ranks would diverge).
                if not _memory.is_out_of_memory(exc) or m == 1 or run.ddp or run.stepping:
                    if hasattr(exc, "add_note"):
                        exc.add_note(run.where())
                        if _memory.is_out_of_memory(exc) and run.ddp and m > 1:
                            exc.add_note("mbs_ext.step: no out-of-memory back-off under DDP (ranks would diverge)")
                    raise
                del exc, run
                _release_cached_memory(device)
                smaller = max(1, m // 2)
                warnings.warn(
                    f"mbs_ext.step: out of memory at micro_batch_size={m}; "
                    f"redoing the step with micro_batch_size={smaller}",
                    RuntimeWarning,
                    stacklevel=2,
                )
                self._size_cap[key] = smaller
                m = smaller
        result.timings["total_s"] = time.perf_counter() - t_begin
        return result


def _accumulation_dtype(requested: torch.dtype | None, params: list[nn.Parameter]) -> torch.dtype | None:
    """dtype of separate accumulation buffers, or None when autograd accumulates in .grad."""
    if requested is None:
        return torch.float32 if any(p.dtype in _LOW_PRECISION for p in params) else None
    return None if all(p.dtype == requested for p in params) else requested


def _release_cached_memory(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class _Run:
    """State of one streamed step; exists so that rollback knows what to undo."""

    def __init__(
        self,
        streamer: MicroBatchStreamer,
        params: list[nn.Parameter],
        batch: Any,
        indices: torch.Tensor | None,
        rows: int,
        m: int,
        num_mb: int,
        device: torch.device,
        ring: Any,
        loss_call: Callable,
    ) -> None:
        self.s = streamer
        self.model = streamer.model
        self.params = params
        self.batch = batch
        self.indices = indices
        self.rows = rows
        self.m = m
        self.num_mb = num_mb
        self.device = device
        self.ring = ring
        self.loss_call = loss_call
        self.index = -1  # micro-batch being processed; num_mb once all have streamed
        self.unscaled = False
        self.updated = False
        self.stepping = False  # the optimizer step began: no redo after this
        seen: set[int] = set()
        self.buffer_snapshot = []
        for b in self.model.buffers():
            if id(b) not in seen:
                seen.add(id(b))
                self.buffer_snapshot.append((b, b.detach().clone()))
        scaler = streamer.scaler
        self.scaler_state = scaler.state_dict() if scaler is not None else None
        self.bn = deferred_layers(self.model)
        self.ddp = isinstance(self.model, DistributedDataParallel)
        self.group = self.model.process_group if self.ddp else None
        self.world = dist.get_world_size(self.group) if self.ddp else 1
        self.acc_dtype = _accumulation_dtype(streamer.accumulate_dtype, params)

    def where(self) -> str:
        if self.index < 0:
            return "mbs_ext.step: failed before the first micro-batch"
        if self.index >= self.num_mb:
            return f"mbs_ext.step: failed after all {self.num_mb} micro-batches, while finishing the step"
        start = self.index * self.m
        stop = min(start + self.m, self.rows)
        of = "indices" if self.indices is not None else "the mini-batch"
        return (
            f"mbs_ext.step: failed at micro-batch {self.index} of {self.num_mb} "
            f"(rows [{start}, {stop}) of {of})"
        )

    def _clear_grads(self) -> None:
        for p in self.params:
            p.grad = None
        self.s.optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def rollback(self, clear_grads: bool, restore_scaler: bool = True) -> None:
        """Undo every change made before the optimizer step."""
        for layer in self.bn:
            layer.discard()
        for b, saved in self.buffer_snapshot:
            b.copy_(saved)
        if clear_grads:
            self._clear_grads()
        scaler = self.s.scaler
        if restore_scaler and scaler is not None and self.scaler_state is not None:
            if self.unscaled and not self.updated:
                with contextlib.suppress(Exception):
                    scaler.update()  # drops the per-optimizer unscale record
            scaler.load_state_dict(self.scaler_state)

    def _totals(self, local: list[float | torch.Tensor]) -> torch.Tensor:
        """Sum small per-rank totals over the DDP group in one collective (identity otherwise)."""
        t = torch.stack([torch.as_tensor(v, dtype=torch.float64).to(self.device).reshape(()) for v in local])
        if self.ddp:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    def _settle(self, local_total: float, loss_sum: torch.Tensor, denom: float, accumulated: bool) -> tuple:
        """Global totals, and the one rescale of the gradient accumulated so far."""
        if self.ddp:
            total, global_loss = self._totals([local_total, loss_sum]).tolist()
        else:  # no collective and no host sync needed
            total, global_loss = local_total, loss_sum
        _norm.check_total(total)
        factor = denom * self.world / total
        if factor != 1.0 and accumulated:
            grads = [p.grad for p in self.params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, factor)
        return total, global_loss

    def _backward(self, loss: torch.Tensor, weight: float) -> None:
        scaler = self.s.scaler
        if self.acc_dtype is None:
            loss = loss * weight
        if scaler is not None:
            loss = scaler.scale(loss)
        loss.backward()

    def execute(self) -> StepResult:
        s = self.s
        model = self.model
        normalize = s.normalize
        buffered = self.acc_dtype is not None
        for layer in self.bn:
            layer.begin_mini_batch()
        self._clear_grads()
        bufs = _Buffers(self.params, self.acc_dtype) if buffered else None
        autocast = (
            (lambda: torch.autocast(device_type=self.device.type, dtype=s.autocast_dtype))
            if s.autocast_dtype is not None
            else contextlib.nullcontext
        )
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        local_total = 0.0
        # Provisional denominator: exact when known ahead, else an estimate fixed by the
        # first non-zero count; the accumulated gradient is rescaled once it is known.
        denom = float(self.rows) if normalize == "samples" else float(self.num_mb)
        denom_fixed = not _norm.needs_count_pass(normalize)
        global_total: float | None = None
        compute_s = 0.0
        # A CPU model reads row ranges of the host batch in place: nothing to stage.
        stream = self.ring.stream(self.batch, self.m, indices=self.indices, copy=self.device.type != "cpu")
        it = iter(stream)
        try:
            for i in range(self.num_mb):
                self.index = i
                mb = next(it, _END)
                if mb is _END:
                    raise RuntimeError(f"the ring yielded {i} micro-batches, expected {self.num_mb}")
                t0 = time.perf_counter()
                rows_i = min(self.m, self.rows - i * self.m)
                c = _norm.count(normalize, mb, rows_i)
                local_total += c
                if not denom_fixed and c > 0:
                    denom, denom_fixed = c * self.num_mb, True
                last = i == self.num_mb - 1
                syncing = self.ddp and last and not buffered
                ctx = model.no_sync() if self.ddp and not syncing else contextlib.nullcontext()
                with ctx:
                    loss = None
                    if c != 0 or syncing:
                        with autocast():
                            loss = self.loss_call(model, mb)
                        _check_loss(loss, self.device)
                        if loss.dtype in _LOW_PRECISION:
                            loss = loss.float()
                        if c != 0:
                            loss_sum += loss.detach().to(torch.float64) * c
                    if last and not buffered:
                        # Exact normalization is needed now, before the (syncing) last backward.
                        global_total, global_loss = self._settle(local_total, loss_sum, denom, i > 0)
                        weight = c * self.world / global_total
                    else:
                        weight = c / denom
                    if loss is not None and c == 0:
                        # Zero items: nothing to learn, but DDP still needs its one
                        # syncing backward; zero gradients reach every parameter.
                        torch.autograd.backward([p.reshape(-1)[:1].sum() * 0.0 for p in self.params])
                    elif loss is not None:
                        self._backward(loss, weight)
                if buffered and loss is not None:
                    bufs.add_(self.params, weight)
                compute_s += time.perf_counter() - t0
            self.index = self.num_mb
            if next(it, _END) is not _END:
                raise RuntimeError(f"the ring yielded more than the expected {self.num_mb} micro-batches")
        finally:
            close = getattr(it, "close", None)
            if close is not None and self.index < self.num_mb:
                close()
        t_step = time.perf_counter()
        if buffered:
            global_loss, global_total = self._finish_buffers(bufs, local_total, loss_sum, denom)
        return self._finish(global_loss, global_total, compute_s, t_step)

    def _finish_buffers(
        self, bufs: _Buffers, local_total: float, loss_sum: torch.Tensor, denom: float
    ) -> tuple[float | torch.Tensor, float]:
        """Rescale, all-reduce (DDP) and cast the float buffers into ``.grad``."""
        if self.ddp:
            got = [float(g) for g in bufs.got]
            values = self._totals([local_total, loss_sum, *got]).tolist()
            total, global_loss, got_any = values[0], values[1], values[2:]
        else:
            total, global_loss, got_any = local_total, loss_sum, bufs.got
        _norm.check_total(total)
        bufs.mul_(denom / total)
        if self.ddp:
            for flat in bufs.flats:
                dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        for j, p in enumerate(self.params):
            p.grad = bufs.views[j].to(p.dtype) if got_any[j] > 0 else None
        return global_loss, total

    def _finish(
        self, global_loss: float | torch.Tensor, total: float, compute_s: float, t_step: float
    ) -> StepResult:
        s = self.s
        opt = s.optimizer
        scaler = s.scaler
        if scaler is not None:
            self.unscaled = True
            scaler.unscale_(opt)
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = None
        with_grad: list[nn.Parameter] = []
        if s.max_grad_norm is not None:
            with_grad = [p for p in self.params if p.grad is not None]
            if with_grad:
                # Norm now, clip only once the step is known to go ahead: a skipped
                # step leaves the offending gradient in .grad for inspection.
                norm = torch.nn.utils.get_total_norm([p.grad for p in with_grad])
            else:
                norm = torch.zeros((), device=self.device)
            found = (~torch.isfinite(norm)).to(torch.float32).to(self.device)
        else:
            found = _nonfinite_flag(grads, self.device)
        # The one host sync of the step.
        probe = [torch.as_tensor(global_loss, dtype=torch.float64).to(self.device), found.double()]
        if norm is not None:
            probe.append(norm.detach().double().to(self.device))
        values = torch.stack(probe).tolist()
        loss_value = values[0] / total
        grads_bad = values[1] != 0
        grad_norm = values[2] if norm is not None else None
        skipped = False
        if grads_bad or not math.isfinite(loss_value):
            skipped = True
            overflow = scaler is not None and math.isfinite(loss_value)
            if not overflow:
                what = "loss" if not math.isfinite(loss_value) else "gradient"
                msg = f"non-finite {what} (loss={loss_value})"
                if s.on_nonfinite == "raise":
                    raise FloatingPointError(f"mbs_ext.step: {msg}; nothing was changed")
                warnings.warn(
                    f"mbs_ext.step: {msg}; the optimizer step was skipped", RuntimeWarning, stacklevel=4
                )
            if scaler is not None:
                scaler.update()  # backs off when the gradients overflowed
                self.updated = True
            self.rollback(clear_grads=False, restore_scaler=False)
        else:
            for layer in self.bn:
                layer.commit()
            if norm is not None and with_grad:
                torch.nn.utils.clip_grads_with_norm_(with_grad, s.max_grad_norm, norm)
            self.stepping = True
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
                self.updated = True
            else:
                opt.step()
        stats = self.ring.stats()  # totals of this step's stream
        timings = {k: float(stats.get(k, 0.0)) for k in ("stage_s", "wait_s")}
        timings["compute_s"] = compute_s
        timings["step_s"] = time.perf_counter() - t_step
        return StepResult(
            loss=loss_value,
            num_micro_batches=self.num_mb,
            micro_batch_size=self.m,
            num_samples=self.rows,
            skipped=skipped,
            grad_norm=grad_norm,
            timings=timings,
        )


_END = object()


_RINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    *,
    micro_batch_size: int | str,
    normalize: str | Callable[[Any], int | torch.Tensor] = "samples",
    indices: torch.Tensor | None = None,
    scaler: torch.amp.GradScaler | None = None,
    autocast_dtype: torch.dtype | None = None,
    max_grad_norm: float | None = None,
    accumulate_dtype: torch.dtype | None = None,
    on_nonfinite: str = "skip",
    memory_budget: int | None = None,
) -> StepResult:
    """One optimizer step over ``batch``, streamed in micro-batches; see :class:`MicroBatchStreamer`.

    The ring, the "auto" plans and sizes learned from out-of-memory back-off are cached
    per model, so calling ``step`` in a loop reuses them.
    """
    streamer = MicroBatchStreamer(
        model,
        optimizer,
        loss_fn,
        micro_batch_size=micro_batch_size,
        normalize=normalize,
        scaler=scaler,
        autocast_dtype=autocast_dtype,
        max_grad_norm=max_grad_norm,
        accumulate_dtype=accumulate_dtype,
        on_nonfinite=on_nonfinite,
        memory_budget=memory_budget,
    )
    cached = _RINGS.get(model)
    if cached is not None:
        streamer._ring, streamer._ring_device, streamer._plans, streamer._size_cap = cached
    try:
        return streamer.step(batch, indices=indices)
    finally:
        _RINGS[model] = (streamer._ring, streamer._ring_device, streamer._plans, streamer._size_cap)
