"""FSDP2 (``fully_shard``) under the step: which modules, how they reduce, and the micro-batch count.

Every forward of a sharded module all-gathers its parameters and every backward
reduce-scatters its gradients, so every rank must run the same number of micro-batches.
Before the first one, one small all-reduce gives every rank the largest count and the
global total of the loss counts (each rank counts all its micro-batches ahead); a rank
with fewer micro-batches runs zero-weight ones (one row of its last, in eval mode so
that no statistics move). With the global total known, each micro-batch's weight is
exact from the start, and FSDP's reductions sum instead of averaging (divide factor 1,
sum-only collectives, as gloo has no pre-multiplied sum): what the ranks' shards add up
is the mini-batch gradient, whether they reduce-scatter every micro-batch
(``fsdp_accumulate="sharded"``, 1/world of the gradient memory) or once at the end
(``"unsharded"``: full gradients accumulate locally). FSDP's own settings are restored
after the step.

A rank that fails mid-stream can still fail together with the others only if FSDP has
not begun the failing micro-batch's collectives: a forward pre-hook ahead of FSDP's own
(:func:`forward_watch`) tells whether the model's forward was entered. If not, the
failing rank runs the rest of its micro-batches at zero weight, so that every
all-gather and reduce-scatter pairs up, and shares its failure in the step's collective
after the pass (:mod:`mbs_ext.world.shards`). A failure inside the forward or the backward
leaves FSDP half-way through collectives that the failing rank cannot replay.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from mbs_ext.ops import is_dtensor


def check_options(options: Any, buffer_dtype: torch.dtype | None) -> None:
    """What the step does not do under FSDP2 yet, refused before anything changes."""
    if options.micro_batch_size == "auto":
        raise ValueError("micro_batch_size='auto' under FSDP2: the planner's probe forwards would run FSDP's "
                         "collectives on one rank only; pass an int")
    if options.scaler is not None:
        raise ValueError("scaler: a GradScaler under FSDP2 is not supported by mbs_ext yet; use bf16 through "
                         "fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
                         "reduce_dtype=torch.float32)), which needs no loss scaling")
    if options.noise_scale:
        raise ValueError("noise_scale under FSDP2 is not supported by mbs_ext yet (FSDP reduces each micro-batch's "
                         "gradient shard by shard, so no rank sees a micro-batch's whole gradient): measure it with "
                         "DistributedDataParallel or one process, or leave noise_scale off")
    if buffer_dtype is not None:
        raise ValueError(f"accumulation buffers ({buffer_dtype}) under FSDP2: FSDP accumulates the sharded "
                         "gradients itself. Keep float32 parameters and compute in bf16 through "
                         "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)")


def dtensor_params(params: list[nn.Parameter]) -> list[nn.Parameter]:
    return [p for p in params if is_dtensor(p)]


def fully_sharded(root: nn.Module, params: list[nn.Parameter]) -> tuple[tuple[nn.Module, ...], Any]:
    """The FSDP modules under ``root`` and the process group they shard over; raises where the
    step cannot stream the model (tensor parallel, several mesh dimensions, some parameters
    left unsharded)."""
    fsdp_module = getattr(getattr(torch.distributed, "fsdp", None), "FSDPModule", None)
    modules = tuple(m for m in root.modules() if fsdp_module is not None and isinstance(m, fsdp_module))
    sharded = dtensor_params(params)
    if not modules:
        raise ValueError("model has DTensor parameters but no FSDP2 module (tensor parallel?), which mbs_ext does "
                         "not stream; FSDP2 (fully_shard) and DistributedDataParallel are supported")
    if len(sharded) != len(params):
        raise ValueError(f"{len(params) - len(sharded)} trainable parameters are not sharded by fully_shard: apply "
                         "fully_shard to the root module too (after its submodules), so every rank steps alike")
    meshes = {id(p.device_mesh): p.device_mesh for p in sharded}
    mesh = next(iter(meshes.values()))
    if len(meshes) > 1 or mesh.ndim != 1:
        raise ValueError("FSDP2 over a mesh of more than one dimension (HSDP, FSDP with tensor parallel) is not "
                         "streamed by mbs_ext; shard over a 1-d device mesh")
    return modules, mesh.get_group()


def summing(modules: tuple[nn.Module, ...]) -> contextlib.AbstractContextManager:
    """FSDP's reductions sum (divide factor 1, sum-only collectives) and every module reduces,
    for the step; each module's own settings come back after it. Nothing without FSDP2 modules."""
    return _summing(modules) if modules else contextlib.nullcontext()


@contextlib.contextmanager
def _summing(modules: tuple[nn.Module, ...]) -> Iterator[None]:
    saved = []
    for m in modules:
        # FSDP2 offers setters but no getters: the settings are read from its parameter groups.
        groups = _param_groups(m)
        saved.append([(g, g.gradient_divide_factor, g.force_sum_reduction_for_comms, g.reduce_grads,
                       g.all_reduce_grads) for g in groups])
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)
        m.set_requires_gradient_sync(True, recurse=False)
    try:
        yield
    finally:
        for group_settings in saved:
            for g, factor, force_sum, reduce_grads, all_reduce_grads in group_settings:
                g.gradient_divide_factor, g.force_sum_reduction_for_comms = factor, force_sum
                g.reduce_grads, g.all_reduce_grads = reduce_grads, all_reduce_grads


def _param_groups(module: nn.Module) -> list:
    """The FSDP parameter groups of one ``fully_shard`` module: a list in newer torch, one group
    or none (``_fsdp_param_group``) in torch 2.11."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def set_gradient_sync(modules: tuple[nn.Module, ...], on: bool) -> None:
    for m in modules:
        m.set_requires_gradient_sync(on, recurse=False)


class ForwardWatch:
    """A forward pre-hook that only records that the forward began (``entered``). Installed once
    per model, ahead of FSDP's pre-forward hook (which all-gathers), and kept: adding and
    removing hooks every step would make ``torch.compile`` recompile. A class, not a closure,
    so that a module carrying it still pickles."""

    def __init__(self) -> None:
        self.entered = False

    def __call__(self, module: nn.Module, args: Any) -> None:
        self.entered = True

    def reset(self) -> None:
        """Before a micro-batch: its forward has not begun."""
        self.entered = False


_WATCHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def forward_watch(root: nn.Module) -> ForwardWatch:
    """The :class:`ForwardWatch` on ``root`` (the module the loss function calls, under its
    wrappers), installed on first use."""
    watch = _WATCHES.get(root)
    if watch is None:
        watch = _WATCHES[root] = ForwardWatch()
        root.register_forward_pre_hook(watch, prepend=True)
    return watch
