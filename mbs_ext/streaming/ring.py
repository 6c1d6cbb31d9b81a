"""Python face of the streaming ring: ``StreamRing(device).stream(batch, m)``.

The batch (a tensor, or a nested tuple/list/dict of tensors sharing dim-0 size N)
stays on the host; a background C++ worker thread stages micro-batch i+1 (a slice,
or a gather by ``indices``, copied by the ring's own ``staging_threads``) while the
caller computes on micro-batch i. Micro-batches are balanced: ``ceil(N / m)`` of
them, sizes differing by at most one (the first ``N % k`` get one row more).

Where nothing needs staging, nothing is staged: a pinned batch is copied straight
to the GPU by the native ring, and a batch already on the ring's device (or a CPU
batch with ``copy=False`` on a CPU ring) is sliced here into views (or gathered by
``index_select`` with ``indices``) -- the same iterator, no worker thread.
"""

from __future__ import annotations

import functools
import numbers
import os
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from mbs_ext._native import _C
from mbs_ext.streaming import batch as _batch

__all__ = ["StreamRing", "RingIterator", "split_sizes", "default_staging_threads"]


_INT64_MAX = 2**63 - 1  # what the native ring takes
_CPU = torch.device("cpu")


def _check_int(name: str, value: Any, minimum: int) -> int:
    if type(value) is int and minimum <= value <= _INT64_MAX:  # the usual case, without the ABC check
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= {minimum}, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value}")
    if value > _INT64_MAX:
        raise ValueError(f"{name} must be at most 2**63 - 1, got {value}")
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


def split_sizes(rows: int, micro_batch_size: int) -> list[int]:
    """Balanced micro-batch sizes, as the native ring cuts them.

    ``k = ceil(rows / m)`` micro-batches; the first ``rows % k`` have ``rows // k + 1``
    rows, the rest ``rows // k``: ``m`` is the largest, and there is no one-row tail that
    wastes a launch, gives the allocator an extra shape, or cannot train (BatchNorm on one
    row). The split rule of the whole package: the native ring cuts by it, and the step
    and planner read the sizes from here.
    """
    rows = _check_int("rows", rows, 0)
    m = _check_int("micro_batch_size", micro_batch_size, 1)
    # A training loop asks for the same few splits every step: short ones are kept.
    return list(_kept_split(rows, m) if rows <= _KEPT_SPLIT_LENGTH * m else _C.split_sizes(rows, m))


_KEPT_SPLIT_LENGTH = 4096  # micro-batches: at most 256 kept splits of 32 KiB each


@functools.lru_cache(maxsize=256)
def _kept_split(rows: int, m: int) -> tuple[int, ...]:
    return tuple(_C.split_sizes(rows, m))


def default_staging_threads(device: torch.device) -> int:
    """Staging threads a ring uses unless told: 1 on CPU (compute needs the cores),
    ``min(8, cores // 2)`` for a GPU (the consumer mostly launches kernels there)."""
    if device.type != "cuda":
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    return max(1, min(8, cores // 2))


def _flatten(batch: Any) -> tuple[list, Any, list[int], list[torch.Tensor], type | None]:
    """The template of ``batch`` (its non-tensor leaves, None where tensors go), its pytree spec,
    the tensors' positions, the tensors (detached: no micro-batch carries the batch's autograd
    history), and ``plain``: a bare tensor or a plain tuple/list of tensors (the usual
    ``(inputs, targets)``), rebuilt without pytree, a few microseconds per micro-batch."""
    plain = _batch.plain_kind(batch)
    if plain is not None:
        flat, spec = [batch] if plain is torch.Tensor else list(batch), None
    else:
        flat, spec = tree_flatten(batch)
    tensor_pos = [i for i, leaf in enumerate(flat) if isinstance(leaf, torch.Tensor)]
    leaves = [flat[i].detach() if flat[i].requires_grad else flat[i] for i in tensor_pos]
    for i in tensor_pos:
        flat[i] = None
    return flat, spec, tensor_pos, leaves, plain


class RingIterator:
    """Iterator over the micro-batches of one stream.

    After each ``next()``, ``index`` is the micro-batch number and ``rows`` its
    ``(start, stop)`` range: rows of the batch, or positions in ``indices`` when
    streaming by indices. ``close()`` stops the worker; so does exhausting the
    iterator, an error, or dropping it.

    Two sources behind one interface: the native ring (``handle``), or slicing of a
    batch that already sits where the consumer computes (``leaves``: views from
    one ``split`` per leaf, or ``index_select`` by ``indices``).
    """

    __slots__ = (
        "_handle",
        "_ring",
        "_flat",
        "_tensor_pos",
        "_spec",
        "_plain",
        "_leaves",
        "_indices",
        "_sizes",
        "_next",
        "_stats",
        "_row_bytes",
        "_ranges",
        "index",
        "rows",
        "__weakref__",
    )

    def __init__(
        self,
        ring: StreamRing,
        flat: list,
        tensor_pos: list[int],
        spec,
        *,
        handle=None,
        leaves: list[torch.Tensor] | None = None,
        indices: torch.Tensor | None = None,
        sizes: list[int] | None = None,
        stats: dict | None = None,
        plain: type | None = None,
    ) -> None:
        self._ring = ring  # keeps the ring alive while iterating
        self._handle = handle
        self._flat = flat
        self._tensor_pos = tensor_pos
        self._spec = spec
        self._plain = plain
        self._leaves, self._indices, self._sizes, self._stats = leaves, indices, sizes, stats
        # Bytes per row of all leaves together, for the stats (a slice's nbytes is its rows times this).
        self._row_bytes = sum(t.numel() // t.shape[0] * t.element_size() for t in leaves) if leaves else 0
        # Row ranges (no indices): each micro-batch's views are made as it is handed out
        # (``narrow``, its own tensor per leaf: a loss that calls requires_grad_() on its inputs
        # does not change the caller's batch). Not all at once by one ``split`` per leaf: that
        # kept every micro-batch's views (about 0.5 KiB of host memory per leaf and micro-batch,
        # 1 MiB at 1,024 micro-batches of two leaves) alive for the whole stream.
        self._ranges = leaves is not None and indices is None and sizes is not None
        self._next = (0, 0)  # sliced mode: (next index, next start)
        self.index: int = -1
        self.rows: tuple[int, int] = (0, 0)

    def __iter__(self) -> RingIterator:
        return self

    def __len__(self) -> int:
        if self._handle is not None:
            return int(self._handle.num_micro_batches)
        return len(self._sizes) if self._sizes is not None else 0

    def _slice(self) -> list[torch.Tensor] | tuple[torch.Tensor, ...] | None:
        j, start = self._next
        if self._sizes is None or j >= len(self._sizes):
            return None
        stop = start + self._sizes[j]
        self._next = (j + 1, stop)
        self.index, self.rows = j, (start, stop)
        if self._ranges:
            out = tuple(leaf.narrow(0, start, stop - start) for leaf in self._leaves)
        else:
            idx = self._indices[start:stop]
            out = [leaf.index_select(0, idx) for leaf in self._leaves]
        self._stats["micro_batches"] += 1
        self._stats["bytes"] += (stop - start) * self._row_bytes
        return out

    def __next__(self):
        handle = self._handle
        if handle is None:
            out = self._slice()
            if out is None:
                self.close()
                raise StopIteration
        else:
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
        if self._plain is not None:  # no pytree machinery (see StreamRing.stream)
            return out[0] if self._plain is torch.Tensor else self._plain(out)
        flat = list(self._flat)
        for pos, tensor in zip(self._tensor_pos, out, strict=True):
            flat[pos] = tensor
        return tree_unflatten(flat, self._spec)

    def close(self) -> None:
        handle, self._handle = self._handle, None
        self._sizes = None
        if handle is not None:
            handle.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


class StreamRing:
    """Streams a batch to ``device`` in balanced micro-batches through ``slots`` staging slots.

    A background C++ worker thread stages micro-batch i+1 (copy of a row range, or a
    gather by ``indices``, split over ``staging_threads`` threads of the ring's own
    pool) while the caller computes on micro-batch i. Every micro-batch handed out
    by the worker is a freshly allocated tensor the ring never writes again.

    ``staging_threads=None`` picks :func:`default_staging_threads`: 1 for a CPU ring,
    ``min(8, cores // 2)`` for a CUDA ring. The count is the ring's own and does not
    follow ``torch.set_num_threads``.
    """

    def __init__(self, device: str | torch.device = "cpu", slots: int = 2, staging_threads: int | None = None) -> None:
        slots = _check_int("slots", slots, 2)
        self.device = _check_device(device)
        if staging_threads is None:
            staging_threads = default_staging_threads(self.device)
        staging_threads = _check_int("staging_threads", staging_threads, 1)
        if staging_threads > 256:
            raise ValueError(f"staging_threads must be <= 256, got {staging_threads}")
        self.slots = slots
        self.staging_threads = staging_threads
        self._ring = _C.StreamRing(str(self.device), slots, staging_threads)
        self._sliced_stats: dict | None = None
        # Whether the native ring may have a stream open: a sliced stream closes it first, and
        # skips the call into C++ (which releases and takes back the GIL) when it has none.
        self._native_open = False

    def stream(
        self, batch: Any, micro_batch_size: int, *, indices: torch.Tensor | None = None, copy: bool = True
    ) -> RingIterator:
        """Iterate over ``batch`` in balanced micro-batches of at most ``micro_batch_size`` rows, on ``device``.

        Each item has the structure of ``batch``; non-tensor leaves pass through
        unchanged. With ``indices``, ``batch`` is a dataset and the micro-batches are
        ``batch[indices[start:stop]]`` for each ``rows`` range, gathered by the worker.
        A stream still open on this ring is closed first.

        Lifetime: a micro-batch the worker staged is a fresh tensor the ring never
        writes again. No staging happens, and micro-batches are views of ``batch``
        (or ``index_select`` gathers with ``indices``), when the batch already sits
        on the ring's device, or with ``copy=False`` on a CPU ring without
        ``indices``; views share memory with ``batch``, as ``batch.split(m)`` would.
        A pinned batch on a CUDA ring is copied straight from its memory on a side stream,
        also after ``next()`` has handed a micro-batch out: leave it unchanged until the
        stream has ended and the device has caught up (docs/ring.md).
        """
        m = _check_int("micro_batch_size", micro_batch_size, 1)
        checked, n = _batch.check_leaves(batch, (_CPU, self.device), "the ring's")
        if indices is not None:
            indices = _batch.check_indices(indices, n, (_CPU, checked[0].device))
        flat, spec, tensor_pos, leaves, plain = _flatten(batch)
        where = leaves[0].device
        on_device = where.type != "cpu"
        if on_device or (not copy and indices is None and self.device.type == "cpu"):
            self.close()
            rows = n if indices is None else int(indices.numel())
            sizes = split_sizes(rows, m)
            self._sliced_stats = {
                "stage_s": 0.0,
                "wait_s": 0.0,
                "micro_batches": 0,
                "bytes": 0,
                "staged_bytes": 0,
                "planned_micro_batches": len(sizes),
            }
            if indices is not None:
                indices = indices.to(where, non_blocking=True)
            return RingIterator(self, flat, tensor_pos, spec, leaves=leaves, indices=indices, sizes=sizes,
                                stats=self._sliced_stats, plain=plain)
        self._sliced_stats = None
        self._native_open = True  # before: a failed open is closed again, as any other
        handle = self._ring.open(leaves, m, indices)
        return RingIterator(self, flat, tensor_pos, spec, handle=handle, plain=plain)

    def stats(self) -> dict:
        """Totals of the most recent stream: stage_s (worker staging time), wait_s
        (time the consumer waited for data), micro_batches, bytes (bytes handed out),
        staged_bytes (bytes the worker copied), planned_micro_batches."""
        if self._sliced_stats is not None:
            return dict(self._sliced_stats)
        return dict(self._ring.stats())

    def close(self) -> None:
        """Close the stream in progress, if any."""
        if self._native_open:
            self._ring.close()
            self._native_open = False

    def __repr__(self) -> str:
        return f"StreamRing(device={str(self.device)!r}, slots={self.slots}, staging_threads={self.staging_threads})"
