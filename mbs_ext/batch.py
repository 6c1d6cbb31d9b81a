"""Inspection, validation and slicing of (nested) batches.

A batch is a pytree (Tensor, or nested tuple/list/dict) whose tensor leaves share
their dim-0 size; non-tensor leaves ride along unchanged. Everything here runs on the
host and never synchronizes with a device, so it is cheap to call once per step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree


def tensor_leaves(batch: Any) -> list[torch.Tensor]:
    """The tensor leaves of ``batch`` in pytree order."""
    return [x for x in pytree.tree_leaves(batch) if isinstance(x, torch.Tensor)]


def num_rows(batch: Any, name: str = "batch") -> int:
    """Shared dim-0 size of the tensor leaves of ``batch``.

    Raises TypeError when there is no tensor, ValueError on a 0-dim tensor or mismatched
    dim-0 sizes; the messages name ``name`` so the caller's argument is obvious.
    """
    leaves = tensor_leaves(batch)
    if not leaves:
        raise TypeError(f"{name} must be a Tensor or a nested tuple/list/dict holding at least one Tensor")
    sizes = set()
    for t in leaves:
        if t.dim() == 0:
            raise ValueError(f"{name} holds a 0-dim tensor; every tensor needs a leading batch dimension")
        sizes.add(t.shape[0])
    if len(sizes) != 1:
        raise ValueError(f"{name} tensors disagree on their dim-0 (batch) size: {sorted(sizes)}")
    return sizes.pop()


def check_batch(batch: Any, name: str = "batch") -> int:
    """Like :func:`num_rows` but also rejects an empty batch."""
    n = num_rows(batch, name)
    if n == 0:
        raise ValueError(f"{name} is empty (dim-0 size 0)")
    return n


def check_indices(indices: Any, dataset_rows: int) -> torch.Tensor:
    """Validate ``indices`` into a dataset of ``dataset_rows`` rows; return them as CPU int64."""
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"indices must be a 1-d integer torch.Tensor, got {type(indices).__name__}")
    if indices.dim() != 1:
        raise ValueError(f"indices must be 1-d, got shape {tuple(indices.shape)}")
    if indices.dtype == torch.bool or indices.is_floating_point() or indices.is_complex():
        raise TypeError(f"indices must have an integer dtype (int64), got {indices.dtype}")
    if indices.numel() == 0:
        raise ValueError("indices is empty: the mini-batch would have no rows")
    indices = indices.to(device="cpu", dtype=torch.int64).contiguous()
    lo, hi = int(indices.min()), int(indices.max())
    if lo < 0:
        raise ValueError(f"indices must lie in [0, {dataset_rows}) (the dataset's rows), found negative index {lo}")
    if hi >= dataset_rows:
        raise ValueError(f"indices must lie in [0, {dataset_rows}) (the dataset's rows), found index {hi}")
    return indices


def split_sizes(rows: int, micro_batch_size: int) -> list[int]:
    """Sizes of the ``ceil(rows / micro_batch_size)`` micro-batches of ``rows`` rows.

    Sizes differ by at most one (the first ``rows % k`` hold one row more), so
    ``micro_batch_size`` is the largest: no one-row tail that wastes a launch, gives
    the allocator and kernels an extra shape, or cannot train (BatchNorm on one row).
    The streaming ring splits by the same rule.
    """
    k = -(-rows // micro_batch_size)
    base, extra = divmod(rows, k)
    return [base + 1] * extra + [base] * (k - extra)


def split_offsets(rows: int, micro_batch_size: int) -> list[tuple[int, int]]:
    """``(start, stop)`` row ranges of the micro-batches of :func:`split_sizes`."""
    ranges, start = [], 0
    for size in split_sizes(rows, micro_batch_size):
        ranges.append((start, start + size))
        start += size
    return ranges



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


def is_pair(batch: Any) -> bool:
    """Whether ``batch`` is an ``(inputs, targets)`` 2-sequence."""
    return isinstance(batch, (tuple, list)) and len(batch) == 2
