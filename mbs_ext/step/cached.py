"""Losses that couple the rows of a mini-batch (contrastive, in-batch negatives): gradient caching.

A loss such as InfoNCE scores every row against every other row of the mini-batch, so it is
not a sum of per-micro-batch losses: streamed as one, each micro-batch would see only its own
negatives (on a two-tower InfoNCE model, a gradient 59% away from the full batch's). The
exact streamed form caches gradients at the encodings:

1. a no-grad forward of every micro-batch gives the per-row encodings, which are small
   (:func:`forward`);
2. the loss runs once on all of them, with the encodings as leaves: it gives the mini-batch
   loss, d loss / d encoding for every row, and the gradient of parameters the loss itself
   uses (a learned temperature);
3. each micro-batch is forwarded again with grad and back-propagated with its rows' slice of
   those encoding gradients.

Pass 3 is an ordinary streamed step (ring, rollback, scaler, clipping, non-finite policy) over
the batch plus one column of row positions, whose per-micro-batch loss is
``sum(encoding * its cached gradient)``: its gradient is the micro-batch's exact share, the
parameters of pass 2 enter once (on the micro-batch holding row 0), and the losses add up
(``normalize="sum"``). Passes 1 and 2 leave no trace (RNG, buffers, ``.grad`` restored);
pass 3 replays each micro-batch's RNG state of pass 1, so dropout draws the same numbers in
both forwards as long as the split is the same (not after an out-of-memory back-off).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils import _pytree as pytree

from mbs_ext.counts.loss import autocast
from mbs_ext.memory import planner
from mbs_ext.memory.backoff import is_out_of_memory
from mbs_ext.memory.probe import probe_batch, probing
from mbs_ext.messages import add_note
from mbs_ext.model.members import check_grad_mode, model_device, trainable
from mbs_ext.streaming import batch as _batch
from mbs_ext.streaming.ring import StreamRing
from mbs_ext.world import coupled, world_of
from mbs_ext.world.one import World
from mbs_ext.world.record import Failure, tell_others

__all__ = ["CachedLoss", "forward"]


@dataclasses.dataclass(frozen=True)
class CachedLoss:
    """A loss over the whole mini-batch's encodings, streamed exactly (gradient caching).

    ``encode(model, micro_batch)`` returns a tensor, or a tuple/list/dict of tensors, whose
    dim 0 is the micro-batch's rows. ``loss(model, encoded)`` gets the same structure with
    every micro-batch's rows concatenated in batch order and returns the 0-dim mini-batch
    loss. Pass it as ``loss_fn`` to :func:`mbs_ext.step`, :func:`mbs_ext.accumulate` or a
    :class:`mbs_ext.MicroBatchStreamer`; ``normalize`` does not apply (the loss sees the
    whole mini-batch). Under DDP (or ``process_group=``) ``loss`` gets every rank's rows, rank
    0's first, and the step equals one process's full-batch step on all of them
    (:mod:`mbs_ext.world.coupled`); FSDP2 is refused.
    """

    encode: Callable[[nn.Module, Any], Any]
    loss: Callable[[nn.Module, Any], torch.Tensor]

    def __post_init__(self) -> None:
        for name, second in (("encode", "micro_batch"), ("loss", "encodings")):
            fn = getattr(self, name)
            if not callable(fn):
                raise TypeError(f"CachedLoss: {name} must be callable as {name}(model, {second}), "
                                f"got {type(fn).__name__}")
            if not _takes_two(fn):
                raise TypeError(f"CachedLoss: {name} must take two arguments, {name}(model, {second}); "
                                f"{getattr(fn, '__name__', type(fn).__name__)} takes "
                                f"{inspect.signature(fn)}: write it as lambda model, {second}: ...")

    def __call__(self, model: nn.Module, micro_batch: Any) -> torch.Tensor:
        raise TypeError("CachedLoss is not a per-micro-batch loss: pass it as loss_fn to mbs_ext.step, "
                        "mbs_ext.accumulate or MicroBatchStreamer, which run its passes")


def _takes_two(fn: Callable) -> bool:
    """Whether ``fn(model, x)`` binds; True where no signature can be read (a builtin: its call says)."""
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        return False
    except ValueError:
        return True
    return True


def forward(model: nn.Module, batch: Any, fn: Callable[[nn.Module, Any], Any], *, micro_batch_size: int | str,
            indices: torch.Tensor | None = None, memory_budget: int | None = None,
            autocast_dtype: torch.dtype | None = None) -> Any:
    """``fn(model, micro_batch)`` for every micro-batch of ``batch`` (or of its rows at
    ``indices``), under ``torch.no_grad()``, concatenated in batch order: the structure ``fn``
    returns, each tensor with the mini-batch's rows. For evaluation and embedding at batch
    sizes beyond device memory; the outputs stay on the model's device.

    ``micro_batch_size="auto"`` takes the most rows whose forward fits ``memory_budget`` bytes
    (required on the CPU; on CUDA the room the device leaves) beside every row's output, as
    measured by :func:`mbs_ext.plan_forward`: a no-grad forward keeps no
    activations for backward, so it fits far more rows than a training step's plan."""
    auto = micro_batch_size == "auto"
    if not auto and (isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int)
                     or micro_batch_size < 1):
        raise ValueError(f"micro_batch_size must be an int >= 1 or 'auto' for mbs_ext.forward, "
                         f"got {micro_batch_size!r}")
    if memory_budget is not None and not auto:
        raise ValueError("memory_budget is what micro_batch_size='auto' plans for; with a fixed micro_batch_size "
                         "leave it out")
    device = model_device(model)
    info = _batch.check(batch, indices, device)
    if auto:
        micro_batch_size = planner.plan_forward(model, batch, fn, memory_budget, indices=indices,
                                                autocast_dtype=autocast_dtype)
    return _joined(_encode_all(model, batch, fn, micro_batch_size, info.indices, autocast_dtype, device))


def _encode_all(model: nn.Module, batch: Any, fn: Callable, m: int, indices: torch.Tensor | None,
                autocast_dtype: torch.dtype | None, device: torch.device) -> list[Any]:
    """Each run of :data:`JOIN_EVERY` micro-batches' ``fn`` outputs, detached and concatenated, in
    batch order (:func:`_concat` joins the runs).

    Not one output per micro-batch kept to the end: a micro-batch's encodings are a few rows, and
    each tensor of them carries about 0.4 KiB of host metadata beside its data (an encoding of
    2 rows x 8 floats is 64 bytes of data), so a list of every micro-batch's outputs grew by about
    0.85 KiB per micro-batch for two towers, allocated while that micro-batch's activations were
    live. Joined every few micro-batches, what the pass keeps is one tensor per leaf and run."""
    ring = StreamRing(device)
    runs: list[Any] = []
    outs: list[Any] = []
    spec = None
    try:
        for mb in ring.stream(batch, m, indices=indices, copy=device.type != "cpu"):
            with torch.no_grad(), autocast(device, autocast_dtype):
                out = pytree.tree_map(_detached, fn(own(model), mb))
            spec = _check_structure(out, spec, len(runs) * JOIN_EVERY + len(outs))
            outs.append(out)
            if len(outs) == JOIN_EVERY:
                runs.append(_concat(outs))
                outs = []
    finally:
        ring.close()
    return runs + [_concat(outs)] if outs else runs


JOIN_EVERY = 64  # micro-batches whose encodings are concatenated into one run


def _check_structure(out: Any, spec: Any, k: int) -> Any:
    """Micro-batch ``k``'s output has the structure of micro-batch 0's (``spec``; None for it)."""
    got = pytree.tree_flatten(out)[1]
    if spec is not None and got != spec:
        raise ValueError(f"micro-batch {k}'s encoding has another structure than micro-batch 0's: {got} vs {spec}")
    return got


def own(model: nn.Module) -> nn.Module:
    """The module ``encode`` and ``loss`` are handed: the user's own under DistributedDataParallel,
    so that ``model.query(...)`` written for one process works across ranks too. The step sums the
    gradients over the ranks itself (its micro-batches run outside DDP's gradient sync), so a
    forward that bypasses DDP's loses nothing."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def _detached(x: Any) -> Any:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"CachedLoss.encode / forward's fn must return tensors (dim 0: the micro-batch's rows), "
                        f"got {type(x).__name__}")
    return x.detach()


def _joined(runs: list[Any]) -> Any:
    """The runs of :func:`_encode_all` as one: a single run is already a concatenation (a copy)."""
    return runs[0] if len(runs) == 1 else _concat(runs)


def _concat(parts: list[Any]) -> Any:
    leaves = [pytree.tree_flatten(p) for p in parts]
    spec = leaves[0][1]
    for k, (_, s) in enumerate(leaves):
        if s != spec:
            raise ValueError(f"micro-batch {k}'s encoding has another structure than micro-batch 0's: {s} vs {spec}")
    return pytree.tree_unflatten([torch.cat(col) for col in zip(*(lv for lv, _ in leaves))], spec)


@dataclasses.dataclass
class _Surrogate:
    """Pass 3's per-micro-batch loss: ``sum(encode(model, rows) * cached gradient of rows)``, plus
    the loss's own parameters' gradient on the micro-batch holding row 0 (and a NaN there when
    the mini-batch loss is not finite, so the step's non-finite policy applies to it)."""

    encode: Callable[[nn.Module, Any], Any]
    grads: list[torch.Tensor | None]  # per encoding leaf: d loss / d encoding, all rows
    spec: Any
    direct: list[tuple[nn.Parameter, torch.Tensor]]  # parameters the loss uses itself, and their gradient
    guard: torch.Tensor  # 0-dim: 0.0, or NaN when the mini-batch loss is not finite
    device: torch.device

    def __call__(self, model: nn.Module, micro_batch: Any) -> torch.Tensor:
        rows, positions = micro_batch
        out = self.encode(own(model), rows)
        leaves, spec = pytree.tree_flatten(out)
        if spec != self.spec:
            raise ValueError(f"CachedLoss.encode returned another structure in the second pass: {spec} vs {self.spec}")
        terms = []
        for leaf, grad in zip(leaves, self.grads):
            if grad is not None:  # in at least float32, in float64 for float64 encodings
                dtype = torch.promote_types(torch.promote_types(leaf.dtype, grad.dtype), torch.float32)
                terms.append((leaf.to(dtype) * grad.index_select(0, positions).to(dtype)).sum())
        once = [(p * g).sum() for p, g in self.direct] + [self.guard]
        dtype = torch.float64 if any(t.dtype == torch.float64 for t in terms + once) else torch.float32
        first = (positions == 0).any().to(dtype)  # 1 on the micro-batch holding row 0, read on the device
        return sum((t.to(dtype) for t in terms), first * sum(t.to(dtype) for t in once))


def check_supported(world: World, options: Any) -> None:
    """Refuse, before anything runs, what CachedLoss does not do yet."""
    coupled.check(world)
    if options.micro_batch_tokens is not None:
        raise ValueError("micro_batch_tokens is not supported by CachedLoss yet (its loss couples rows across "
                         "micro-batches of one width): pass micro_batch_size")
    if options.normalize is not None:
        raise ValueError("normalize does not apply to CachedLoss (its loss sees the whole mini-batch): leave it unset")
    if options.noise_scale:
        raise ValueError("noise_scale does not apply to CachedLoss (its loss couples the rows: per-row gradients "
                         "are not defined for it): leave it off")


def _shared(world: World, exc: BaseException, device: torch.device, step: Callable) -> None:
    """A failed rank's part in the collective the others wait in (``step``), with a note."""
    if world.group is None:
        return
    failure = Failure(-1, is_out_of_memory(exc))

    def share() -> bool:
        step(world, failure, device)
        return False  # no back-off for CachedLoss's own passes

    tell_others(exc, world.rank, share)


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What passes 1 and 2 hand the step's ordinary streamed pass (pass 3): the per-micro-batch
    ``loss_fn`` whose gradient is each row's share of the full loss's (a sum over rows, counted
    so), the batch with each row's position in the gathered rows, the options that go with them
    (the planned size, ``normalize="sum"``, no count check), and the full loss's value."""

    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    batch: Any
    options: Any
    value: torch.Tensor


def prepare(cached: CachedLoss, model: nn.Module, options: Any, batch: Any, indices: Any, plans: dict) -> Prepared:
    """Passes 1 and 2 of a CachedLoss step: the encodings of every row with no graph, the loss on
    all of them and its gradient with respect to each encoding. The step then streams pass 3 as
    it streams any loss (:meth:`mbs_ext.step.streamer.MicroBatchStreamer.step`)."""
    params = trainable(model)
    world = world_of(model, params, options.process_group)
    check_supported(world, options)
    check_grad_mode()
    device = model_device(model)
    try:
        info = _batch.check(batch, indices, device)
        if info.indices is not None:  # pass 3 takes the gathered rows and their positions together
            batch = _batch.take(batch, info.indices)
        if options.micro_batch_size == "auto":
            options = dataclasses.replace(options, micro_batch_size=_planned(cached, model, batch, options, info,
                                                                              world, params, plans))
    except Exception as exc:
        _shared(world, exc, device, coupled.begin)
        raise
    surrogate, value, offset = _cache_gradients(cached, model, batch, options, params, world, device)
    # Positions in the gathered rows: only the rank holding row 0 (rank 0) adds the loss's own
    # parameters' gradient, so it enters the sum over ranks once.
    positions = torch.arange(info.rows) + offset
    return Prepared(surrogate, (batch, positions),
                    dataclasses.replace(options, normalize="sum", check_count=False), value)


def _planned(cached: CachedLoss, model: nn.Module, batch: Any, options: Any, info: _batch.BatchInfo,
             world: World, params: list[nn.Parameter], plans: dict) -> int:
    """``micro_batch_size="auto"``: the rows whose pass 3 (``encode`` forward and backward, as in
    pass 1 plus autograd's share) fits ``memory_budget`` less what stays resident through it: the
    encodings of every row (of every rank) and their gradients. Cached per input signature and
    budget. What the loss itself needs on all the encodings (pass 2) does not shrink with the
    micro-batch and is not planned."""
    key = ("CachedLoss", info.signature, options.memory_budget, options.autocast_dtype, world.size)
    plan = plans.get(key)
    if plan is None:
        device = model_device(model)
        budget = planner.default_budget(device, options.memory_budget)
        with probing(model, device), torch.no_grad(), autocast(device, options.autocast_dtype):
            one = pytree.tree_leaves(cached.encode(own(model), probe_batch(batch, 1, None, device)))
        resident = 2 * sum(t.numel() * t.element_size() for t in one) * info.rows * max(world.size, 1)
        if resident >= budget:
            raise ValueError(f"memory_budget={budget} bytes is too small for CachedLoss: the encodings of the "
                             f"mini-batch and their gradients alone take about {resident} bytes")

        def encode_and_back(mod: nn.Module, mb: Any) -> torch.Tensor:
            leaves = pytree.tree_leaves(cached.encode(own(mod), mb))
            return sum(t.float().sum() for t in leaves if t.is_floating_point())

        try:
            plan = plans[key] = planner.plan(
                model, batch, encode_and_back, budget - resident, num_rows=info.rows,
                accumulate_dtype=world.buffer_dtype(options.accumulate_dtype, params),
                autocast_dtype=options.autocast_dtype,
            )
        except ValueError as exc:
            add_note(exc, f"CachedLoss: that is memory_budget={budget} less about {resident} bytes for the "
                          "encodings of the mini-batch and their gradients")
            raise
    return plan.micro_batch_size


def _cache_gradients(cached: CachedLoss, model: nn.Module, batch: Any, options: Any, params: list[nn.Parameter],
                     world: World, device: torch.device) -> tuple[_Surrogate, torch.Tensor, int]:
    """Passes 1 and 2, leaving no trace: pass 3's loss, the mini-batch loss, and where this
    rank's rows start in the rows every rank encoded."""
    with probing(model, device):
        coupled.begin(world, None, device)
        try:
            m = int(options.micro_batch_size)
            encoded = _joined(_encode_all(model, batch, cached.encode, m, None, options.autocast_dtype, device))
        except Exception as exc:
            _shared(world, exc, device, lambda w, f, d: coupled.gather(w, [], f, d))
            raise
        leaves, spec = pytree.tree_flatten(encoded)
        leaves, offset = coupled.gather(world, leaves, None, device)
        try:
            leaves = [t.requires_grad_(True) if t.is_floating_point() else t for t in leaves]
            with autocast(device, options.autocast_dtype):
                loss = cached.loss(own(model), pytree.tree_unflatten(leaves, spec))
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                got_shape = getattr(loss, "shape", type(loss))
                raise ValueError(f"CachedLoss.loss must return a 0-dim tensor, got {got_shape}")
            wrt = [t for t in leaves if t.requires_grad] + params
            got = torch.autograd.grad(loss, wrt, allow_unused=True) if loss.requires_grad else [None] * len(wrt)
        except Exception as exc:
            _shared(world, exc, device, coupled.confirm)
            raise
        coupled.confirm(world, None, device)
    enc_grads = iter(got[: len(wrt) - len(params)])
    grads = [next(enc_grads) if t.requires_grad else None for t in leaves]
    direct = [(p, g) for p, g in zip(params, got[len(wrt) - len(params):]) if g is not None]
    value = loss.detach()
    return _Surrogate(cached.encode, grads, spec, direct, value - value, device), value, offset
