"""Inspection, validation and slicing of (nested) batches.

A batch is a pytree (Tensor, or nested tuple/list/dict) whose tensor leaves share
their dim-0 size; non-tensor leaves ride along unchanged. Everything here runs on the
host and never synchronizes with a device, so it is cheap to call once per step.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import torch
from torch.utils import _pytree as pytree

_CPU = torch.device("cpu")


def plain_kind(batch: Any) -> type | None:
    """``torch.Tensor`` for a bare tensor, ``tuple``/``list`` for a plain sequence of tensors (the
    usual ``(inputs, targets)``), else None: the batches whose leaves need no pytree walk."""
    kind = type(batch)
    if kind is torch.Tensor:
        return kind
    if (kind is tuple or kind is list) and all(type(b) is torch.Tensor for b in batch):
        return kind
    return None


def tensor_leaves(batch: Any) -> list[torch.Tensor]:
    """The tensor leaves of ``batch`` in pytree order (a plain batch without the pytree walk,
    which costs more than every other check of a step's batch together)."""
    kind = plain_kind(batch)
    if kind is torch.Tensor:
        return [batch]
    if kind is not None:
        return list(batch)
    return [x for x in pytree.tree_leaves(batch) if isinstance(x, torch.Tensor)]


def check_leaves(batch: Any, allowed: tuple[torch.device, ...], owner: str) -> tuple[list[torch.Tensor], int]:
    """The one batch validator (step, planner and ring): the tensor leaves and their shared row count.

    Leaves must be dense, have a batch dimension of the same size N >= 1, and sit on one
    device among ``allowed``: the CPU, or ``owner``'s device, the last one ("the model's",
    named in the message as "the CPU or on the model's device cuda:0").
    """
    if not isinstance(batch, (torch.Tensor, tuple, list, dict)) and isinstance(batch, Iterable):
        raise TypeError(
            f"batch is a {type(batch).__name__}: mbs_ext streams one mini-batch (a Tensor or a tuple/list/dict "
            "of tensors); iterate over it and pass each mini-batch it yields"
        )
    leaves = tensor_leaves(batch)
    if not leaves:
        raise ValueError(
            "batch must be a Tensor or a nested tuple/list/dict holding at least one tensor, "
            f"got {type(batch).__name__}"
        )
    first = leaves[0].device
    n = None
    for k, t in enumerate(leaves):
        device = t.device
        if device not in allowed:
            raise ValueError(f"batch tensors must be on the CPU or on {owner} device {allowed[-1]}, "
                             f"tensor {k} is on {device}")
        if device != first:
            raise ValueError(
                f"batch tensors must all be on one device: tensor 0 is on {first}, tensor {k} on {device}"
            )
        if t.layout != torch.strided or t.is_nested:
            what = "is a nested tensor (rows of different sizes; pad them)" if t.is_nested else f"has layout {t.layout}"
            raise ValueError(f"batch tensors must be dense (strided), tensor {k} {what}")
        if t.dim() == 0:
            raise ValueError(f"batch tensor {k} is 0-dim; every tensor needs a leading batch dimension")
        if n is None:
            n = t.shape[0]
        elif t.shape[0] != n:
            raise ValueError(f"batch tensors disagree on their dim-0 (batch) size: tensor 0 has {n} rows, "
                             f"tensor {k} has {t.shape[0]}")
    if n == 0:
        raise ValueError("batch is empty: 0 rows (its dim-0 size must be >= 1)")
    return leaves, n


class BatchInfo(NamedTuple):
    """What the step needs to know of a checked batch, so that it need not look again."""

    rows: int  # of the mini-batch: the batch's, or the number of indices
    indices: torch.Tensor | None  # CPU int64
    signature: tuple  # (trailing shape, dtype) per tensor leaf: what "auto" plans are cached by
    pair: bool  # an (inputs, targets) pair, as torch.nn loss modules need
    targets: torch.Tensor | None = None  # a pair's targets (all rows, before indices select)


def check(batch: Any, indices: Any, device: torch.device) -> BatchInfo:
    """A batch for a model on ``device`` (on the host or on that device), and its optional
    ``indices`` (into the batch as a dataset)."""
    allowed = (_CPU,) if device.type == "cpu" else (_CPU, device)
    leaves, n = check_leaves(batch, allowed, "the model's")
    if indices is not None:
        indices = check_indices(indices, n, allowed)
        n = int(indices.numel())
    signature = tuple((tuple(t.shape[1:]), t.dtype) for t in leaves)
    pair = is_pair(batch)
    targets = batch[1] if pair and isinstance(batch[1], torch.Tensor) else None
    return BatchInfo(n, indices, signature, pair, targets)


def check_indices(indices: Any, dataset_rows: int, allowed: tuple[torch.device, ...]) -> torch.Tensor:
    """The one index validator: ``indices`` into a dataset of ``dataset_rows`` rows, as CPU int64."""
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"indices must be a 1-d integer torch.Tensor, got {type(indices).__name__}")
    if indices.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"indices must be a 1-d int64 (or int32) tensor, got dtype {indices.dtype}")
    if indices.device not in allowed:
        raise ValueError(f"indices must be on {' or '.join(str(d) for d in allowed)}, got {indices.device}")
    if indices.dim() != 1:
        raise ValueError(f"indices must be 1-d, got shape {tuple(indices.shape)}")
    if indices.numel() == 0:
        raise ValueError("indices is empty: the mini-batch would have no rows")
    indices = indices.to(device="cpu", dtype=torch.int64).contiguous()
    lo, hi = int(indices.min()), int(indices.max())
    if lo < 0:
        raise ValueError(f"indices must lie in [0, {dataset_rows}) (the dataset's rows), found negative index {lo}")
    if hi >= dataset_rows:
        raise ValueError(f"indices must lie in [0, {dataset_rows}) (the dataset's rows), found index {hi}")
    return indices


def take(batch: Any, rows: torch.Tensor) -> Any:
    """Rows ``rows`` (1-d int64) of every tensor leaf, gathered into fresh tensors."""
    def pick(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.index_select(0, rows.to(x.device))
        return x

    return pytree.tree_map(pick, batch)


def to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move every tensor leaf to ``device``."""
    return pytree.tree_map(
        lambda x: x.to(device, non_blocking=non_blocking) if isinstance(x, torch.Tensor) else x, batch
    )


def row_slices(batch: Any, sizes: list[int], indices: torch.Tensor | None,
               needed: bool) -> Iterator[tuple[Any, tuple[int, int]]]:
    """``(micro_batch, (start, stop))`` for consecutive row ranges of ``sizes``: views of
    ``batch`` (or its rows at ``indices``), or None in place of each when not ``needed``."""
    start = 0
    for size in sizes:
        stop = start + size
        if not needed:
            yield None, (start, stop)
        elif indices is None:
            rows = slice(start, stop)
            yield pytree.tree_map(lambda x, r=rows: x[r] if isinstance(x, torch.Tensor) else x, batch), (start, stop)
        else:
            yield take(batch, indices[start:stop]), (start, stop)
        start = stop


def is_pair(batch: Any) -> bool:
    """Whether ``batch`` is an ``(inputs, targets)`` 2-sequence."""
    return isinstance(batch, (tuple, list)) and len(batch) == 2
