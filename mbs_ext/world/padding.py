"""Padding micro-batches: what a rank runs at weight 0 so that its collectives pair up with the
other ranks'.

Where ranks must run the same number of micro-batches (FSDP2's all-gathers and reduce-scatters,
BatchNorm layers that take statistics across ranks under DDP), a rank with fewer runs
zero-weight ones: one row of its latest real micro-batch, in eval mode (no statistics move),
its loss back-propagated at weight 0. A rank that failed before a micro-batch's collectives
began runs the rest of its micro-batches so (:func:`catch_up`) and then shares its failure.
One helper for every world that pads: the worlds say only what else a padding micro-batch
needs (a BatchNorm turn, FSDP's gradient sync).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from mbs_ext.counts.loss import autocast
from mbs_ext.model.grads import LOW_PRECISION
from mbs_ext.model.wrappers import unwrap


@contextlib.contextmanager
def padding(model: nn.Module) -> Iterator[None]:
    """Eval mode for a zero-weight micro-batch: its forward moves no BatchNorm statistics; every
    module's own mode comes back after it."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def one_row(micro_batch: Any) -> Any:
    """The first row of every tensor leaf (what a zero-weight micro-batch runs on)."""
    return tree_map(lambda t: t[:1] if isinstance(t, torch.Tensor) and t.dim() > 0 else t, micro_batch)


@contextlib.contextmanager
def outputs(root: nn.Module, keep: bool) -> Iterator[list[Any]]:
    """With ``keep``, the outputs of ``root``'s forwards inside the block (a hook for the block
    only: used on the rare path of a rank catching up after a failure)."""
    seen: list[Any] = []
    handle = root.register_forward_hook(lambda module, args, out: seen.append(out)) if keep else None
    try:
        yield seen
    finally:
        if handle is not None:
            handle.remove()


def zero_weight_loss(pass_: Any, lenient: bool) -> torch.Tensor:
    """The loss of one row of ``pass_``'s latest real micro-batch, in eval mode (:func:`padding`),
    for a backward at weight 0 (the pass: :class:`mbs_ext.world.one.Pass`). ``lenient`` (a rank
    catching up after a failure): should the loss function fail once the model's forward has
    run, the loss goes through the model's outputs instead (:func:`zero_through`), so that the
    backward still runs FSDP's collectives."""
    with padding(pass_.model), autocast(pass_.device, pass_.options.autocast_dtype):
        with outputs(unwrap(pass_.model), keep=lenient) as seen:
            try:
                loss = pass_.loss_call(pass_.model, one_row(pass_.template))
            except Exception:
                if not seen:
                    raise
                loss = zero_through(seen[-1])
    return loss.float() if loss.dtype in LOW_PRECISION else loss


def zero_through(output: Any) -> torch.Tensor:
    """A zero that depends on every floating-point leaf of ``output`` that needs a gradient, so
    that its backward runs through the whole forward (and FSDP's collectives in it)."""
    leaves = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not leaves:
        raise RuntimeError("the model's output has no tensor that needs a gradient")
    return sum((t.float().sum() * 0.0 for t in leaves[1:]), leaves[0].float().sum() * 0.0)


def catch_up(pass_: Any, pad: Callable[[int], None]) -> bool:
    """After a failure at micro-batch ``pass_.index``: ``pad(i)`` for it and every later one, so
    the other ranks' collectives pair up. False where a padding micro-batch failed (the caller
    has already refused where the failing micro-batch's collectives began)."""
    try:
        for i in range(pass_.index, pass_.padded):
            pad(i)
    except Exception:
        return False
    return True
