"""Python face of the streaming ring: ``StreamRing(device).stream(batch, m)``.

The batch (a tensor, or a nested tuple/list/dict of tensors sharing dim-0 size N)
stays on the host; a background C++ worker thread stages micro-batch i+1 (a slice,
or a gather by ``indices``) while the caller computes on micro-batch i.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from mbs_ext import batch as _batch
from mbs_ext._native import _C

__all__ = ["StreamRing", "RingIterator"]


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= {minimum}, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value}")
    return value


def _check_device(device: Any) -> torch.device:
    if isinstance(device, torch.device):
        dev = device
    elif isinstance(device, (str, int)) and not isinstance(device, bool):
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError, ValueError) as exc:
            raise ValueError(f"device must be a valid torch device, got {device!r}: {exc}") from None
    else:
        raise TypeError(f"device must be a torch.device or a str, got {type(device).__name__}")
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ValueError(f"device must be 'cpu' or a 'cuda' device, got {str(dev)!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"device is {str(dev)!r} but CUDA is not available in this process")
    if not _C.cuda_compiled:
        raise ValueError(f"device is {str(dev)!r} but mbs_ext was built without CUDA support")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if not 0 <= index < torch.cuda.device_count():
        raise ValueError(f"device {str(dev)!r} does not exist ({torch.cuda.device_count()} CUDA devices)")
    return torch.device("cuda", index)


def _check_indices(indices: Any, n: int) -> torch.Tensor:
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"indices must be a 1-d int64 tensor or None, got {type(indices).__name__}")
    if indices.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"indices must be a 1-d int64 (or int32) tensor, got dtype {indices.dtype}")
    if indices.device.type != "cpu":
        raise ValueError(f"indices must be on the CPU, got {indices.device}")
    return _batch.check_indices(indices, n)  # shape, emptiness, range: shared with mbs_ext.step


class RingIterator:
    """Iterator over the micro-batches of one stream.

    After each ``next()``, ``index`` is the micro-batch number and ``rows`` its
    ``(start, stop)`` range: rows of the batch, or positions in ``indices`` when
    streaming by indices. ``close()`` stops the worker; so does exhausting the
    iterator, an error, or dropping it.
    """

    __slots__ = ("_handle", "_ring", "_flat", "_tensor_pos", "_spec", "index", "rows", "__weakref__")

    def __init__(self, ring: StreamRing, handle, flat: list, tensor_pos: list[int], spec) -> None:
        self._ring = ring  # keeps the ring alive while iterating
        self._handle = handle
        self._flat = flat
        self._tensor_pos = tensor_pos
        self._spec = spec
        self.index: int = -1
        self.rows: tuple[int, int] = (0, 0)

    def __iter__(self) -> RingIterator:
        return self

    def __len__(self) -> int:
        return int(self._handle.num_micro_batches) if self._handle is not None else 0

    def __next__(self):
        handle = self._handle
        if handle is None:
            raise StopIteration
        try:
            out = handle.next()
        except BaseException:
            self.close()
            raise
        if out is None:
            self.close()
            raise StopIteration
        self.index = handle.index
        self.rows = handle.rows
        flat = list(self._flat)
        for pos, tensor in zip(self._tensor_pos, out, strict=True):
            flat[pos] = tensor
        return tree_unflatten(flat, self._spec)

    def close(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


class _ViewIterator:
    """Zero-copy micro-batches: row ranges of a CPU batch for a CPU consumer.

    Nothing needs staging when the batch already lives where the model runs, so a
    copy would only cost memory bandwidth; see ``StreamRing.stream(copy=False)``.
    """

    __slots__ = ("_leaves", "_flat", "_tensor_pos", "_spec", "_n", "_m", "_next_start", "_stats", "index", "rows")

    def __init__(self, leaves, flat, tensor_pos, spec, n: int, m: int, stats: dict) -> None:
        self._leaves, self._flat, self._tensor_pos, self._spec = leaves, flat, tensor_pos, spec
        self._n, self._m, self._next_start, self._stats = n, m, 0, stats
        self.index: int = -1
        self.rows: tuple[int, int] = (0, 0)

    def __iter__(self) -> _ViewIterator:
        return self

    def __len__(self) -> int:
        return -(-self._n // self._m)

    def __next__(self):
        start = self._next_start
        if start >= self._n:
            raise StopIteration
        stop = min(start + self._m, self._n)
        self._next_start = stop
        self.index += 1
        self.rows = (start, stop)
        flat = list(self._flat)
        for pos, leaf in zip(self._tensor_pos, self._leaves, strict=True):
            view = leaf.narrow(0, start, stop - start)
            flat[pos] = view
            self._stats["bytes"] += view.nbytes
        self._stats["micro_batches"] += 1
        return tree_unflatten(flat, self._spec)

    def close(self) -> None:
        self._next_start = self._n


class StreamRing:
    """Streams a host batch to ``device`` in micro-batches through ``slots`` staging slots.

    A background C++ worker thread stages micro-batch i+1 (copy of a row range, or a
    gather by ``indices``) while the caller computes on micro-batch i. Every
    micro-batch handed out is a freshly allocated tensor the ring never writes again.
    """

    def __init__(self, device: str | torch.device = "cpu", slots: int = 2) -> None:
        slots = _check_int("slots", slots, 2)
        self.device = _check_device(device)
        self.slots = slots
        self._ring = _C.StreamRing(str(self.device), slots)
        self._view_stats: dict | None = None

    def stream(
        self, batch: Any, micro_batch_size: int, *, indices: torch.Tensor | None = None, copy: bool = True
    ) -> RingIterator:
        """Iterate over ``batch`` in micro-batches of ``micro_batch_size`` rows, on ``device``.

        Each item has the structure of ``batch``; non-tensor leaves pass through
        unchanged. With ``indices``, ``batch`` is a host dataset and micro-batch j is
        ``batch[indices[j*m:(j+1)*m]]``, gathered by the worker. A stream still open
        on this ring is closed first.

        ``copy=False`` on a CPU ring without ``indices`` hands out views of ``batch``
        instead of fresh copies (there is nothing to stage): zero cost, but the views
        share memory with ``batch``. ``mbs_ext.step`` uses this, as a hand-written
        accumulation loop over ``batch.split(m)`` would.
        """
        m = _check_int("micro_batch_size", micro_batch_size, 1)
        flat, spec = tree_flatten(batch)
        tensor_pos = [i for i, leaf in enumerate(flat) if isinstance(leaf, torch.Tensor)]
        if not tensor_pos:
            raise ValueError("batch must contain at least one tensor")
        leaves = [flat[i] for i in tensor_pos]
        n = None
        for k, t in enumerate(leaves):
            if t.device.type != "cpu":
                raise ValueError(f"batch tensors must be on the CPU, tensor {k} is on {t.device}")
            if t.layout != torch.strided:
                raise ValueError(f"batch tensors must be dense (strided), tensor {k} has layout {t.layout}")
            if t.dim() == 0:
                raise ValueError(f"batch tensors need a batch dim 0, tensor {k} is 0-dim")
            if n is None:
                n = t.shape[0]
            elif t.shape[0] != n:
                raise ValueError(
                    f"batch tensors must share dim-0 size: tensor 0 has {n} rows, tensor {k} has {t.shape[0]}"
                )
        if n == 0:
            raise ValueError("batch has 0 rows (dim-0 size N must be >= 1)")
        if indices is not None:
            indices = _check_indices(indices, n)
        detached = [t.detach() for t in leaves]
        if not copy and indices is None and self.device.type == "cpu":
            self._ring.close()
            self._view_stats = {"stage_s": 0.0, "wait_s": 0.0, "micro_batches": 0, "bytes": 0,
                                "planned_micro_batches": -(-n // m)}
            return _ViewIterator(detached, flat, tensor_pos, spec, n, m, self._view_stats)
        self._view_stats = None
        handle = self._ring.open(detached, m, indices)
        for i in tensor_pos:
            flat[i] = None  # the template keeps only the non-tensor leaves
        return RingIterator(self, handle, flat, tensor_pos, spec)

    __call__ = stream

    def stats(self) -> dict:
        """Totals of the most recent stream: stage_s (worker staging time), wait_s
        (time the consumer waited for data), micro_batches, bytes (bytes staged)."""
        if self._view_stats is not None:
            return dict(self._view_stats)
        return dict(self._ring.stats())

    def close(self) -> None:
        """Close the stream in progress, if any."""
        self._ring.close()

    def __repr__(self) -> str:
        return f"StreamRing(device={str(self.device)!r}, slots={self.slots})"
