"""Placeholder StreamRing: a synchronous stand-in, replaced by the native ring on merge.

It implements exactly the public interface the training step relies on --
``StreamRing(device, slots=2)``, ``ring.stream(batch, micro_batch_size, *, indices=None)``
and ``ring.stats()`` -- without any overlap of copy and compute, so the step can be
developed and tested before the native, double-buffered ring lands.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch

from mbs_ext import batch as _batch


class StreamRing:
    """Streams micro-batches of a host batch to ``device`` (synchronous placeholder)."""

    def __init__(self, device: torch.device | str, slots: int = 2) -> None:
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be an int >= 1, got {slots!r}")
        self.device = torch.device(device)
        self.slots = slots
        self._stats = {"stage_s": 0.0, "wait_s": 0.0, "micro_batches": 0, "bytes": 0}

    def stream(
        self, batch: Any, micro_batch_size: int, *, indices: torch.Tensor | None = None
    ) -> Iterator[Any]:
        """Yield micro-batches on ``device``, covering the rows once, in order."""
        m = micro_batch_size
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"micro_batch_size must be an int >= 1, got {micro_batch_size!r}")
        rows = _batch.check_batch(batch)
        if indices is not None:
            indices = _batch.check_indices(indices, rows)
            rows = indices.numel()
        return self._generate(batch, micro_batch_size, indices, rows)

    def _generate(self, batch: Any, m: int, indices: torch.Tensor | None, rows: int) -> Iterator[Any]:
        for start in range(0, rows, m):
            length = min(m, rows - start)
            t0 = time.perf_counter()
            if indices is None:
                part = _batch.narrow(batch, start, length)
            else:
                part = _batch.take(batch, indices.narrow(0, start, length))
            # A fresh tensor per micro-batch, never a view of the caller's batch.
            moved = _batch.to_device(part, self.device)
            moved = _fresh(moved, part)
            dt = time.perf_counter() - t0
            self._stats["stage_s"] += dt
            self._stats["wait_s"] += dt
            self._stats["micro_batches"] += 1
            self._stats["bytes"] += sum(t.numel() * t.element_size() for t in _batch.tensor_leaves(moved))
            yield moved

    def stats(self) -> dict:
        """Cumulative counters since construction."""
        return dict(self._stats)


def _fresh(moved: Any, source: Any) -> Any:
    from torch.utils import _pytree as pytree

    src = pytree.tree_leaves(source)
    out = pytree.tree_leaves(moved)
    spec = pytree.tree_structure(moved)
    fixed = [
        o.clone() if isinstance(o, torch.Tensor) and isinstance(s, torch.Tensor) and _shares(o, s) else o
        for o, s in zip(out, src, strict=True)
    ]
    return pytree.tree_unflatten(fixed, spec)


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
