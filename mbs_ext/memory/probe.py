"""Measuring one micro-batch: its peak memory, what autograd saves, whether it fits at all.

The planner (:mod:`~mbs_ext.memory.planner`) and the out-of-memory back-off
(:mod:`~mbs_ext.memory.backoff`) both reason from these probes. A probe runs forward, loss and
backward of a few rows taken from the batch and leaves no trace: RNG streams, module
buffers, deferred BatchNorm statistics and ``.grad`` are as before.

Peaks: on CUDA the caching allocator's own statistics (workspaces included). On the
CPU two meters: a dispatch-level tracker of live tensor storages (:class:`PeakTracker`:
op outputs only, exact to the byte, blind to what a kernel allocates inside itself such
as convolution column buffers and oneDNN scratchpads), and the process's own peak
resident set (:class:`RssPeak`: everything the step touches, at page resolution).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mbs_ext.counts import loss as _loss
from mbs_ext.memory.backoff import is_out_of_memory
from mbs_ext.model.batchnorm import deferred_layers
from mbs_ext.model.members import members, model_device
from mbs_ext.model.rollback import Snapshot
from mbs_ext.model.wrappers import unwrap
from mbs_ext.streaming import batch as _batch


@contextlib.contextmanager
def probing(model: nn.Module, device: torch.device) -> Iterator[None]:
    """Restore RNG streams, module buffers and ``.grad`` after probe forwards (no trace left)."""
    snap = Snapshot(members(model), device)
    grads = {p: p.grad for p in model.parameters()}
    try:
        yield
    finally:
        snap.restore()
        for p, g in grads.items():
            p.grad = g


def measure_saved_bytes(
    model: nn.Module,
    micro_batch: Any,
    call: Callable[[nn.Module, Any], torch.Tensor],
    autocast_dtype: torch.dtype | None = None,
) -> int:
    """Bytes of distinct storages autograd saves for backward in one forward + loss.

    Parameters, buffers and the micro-batch's own tensors are not counted: they are
    resident anyway (the inputs are counted separately, per ring slot).
    """
    resident = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    resident |= {t.untyped_storage().data_ptr() for t in _batch.tensor_leaves(micro_batch)}
    seen: set[int] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key and key not in resident and key not in seen:
            seen.add(key)
            total += storage.nbytes()
        # Not ``t`` itself: an output saved by its own node (ReLU saves its result) would then hold
        # that node, a cycle through C++ that Python's collector cannot see - the probe's graph,
        # its activations and, through AccumulateGrad, the parameters would outlive the model.
        return t.detach()

    device = model_device(model)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _loss.autocast(device, autocast_dtype):
        loss = call(model, micro_batch)
    del loss
    return total


def probe_batch(batch: Any, rows: int, indices: torch.Tensor | None, device: torch.device) -> Any:
    """The first ``rows`` rows of ``batch`` (or of its ``indices``), gathered onto ``device``."""
    picked = torch.arange(rows) if indices is None else indices[:rows]
    return _batch.to_device(_batch.take(batch, picked), device)


def row_bytes(batch: Any) -> int:
    """Bytes of one row of every tensor leaf."""
    return sum(t[:1].numel() * t.element_size() for t in _batch.tensor_leaves(batch))



class PeakTracker(TorchDispatchMode):
    """Live bytes of the tensors created under it, and their peak (a CPU allocator's view).

    Every op output whose storage is new (not shared with an input: not a view, not in
    place) is counted until the last tensor holding that storage dies. On CUDA the
    caching allocator's own statistics are used instead (:func:`measure_peak`).
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, list[int]] = {}  # storage pointer -> [tensors alive, bytes]

    def _release(self, key: int) -> None:
        entry = self._refs.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._refs[key]

    def _hold(self, t: torch.Tensor, key: int) -> None:
        self._refs[key][0] += 1
        weakref.finalize(t, self._release, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            x.untyped_storage().data_ptr()
            for x in tree_flatten((args, kwargs))[0]
            if isinstance(x, torch.Tensor) and x.layout == torch.strided
        }
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
                continue
            key = t.untyped_storage().data_ptr()
            if key == 0:
                continue
            if key in self._refs:
                self._hold(t, key)
            elif key not in inputs:
                self._refs[key] = [0, t.untyped_storage().nbytes()]
                self.live += self._refs[key][1]
                self.peak = max(self.peak, self.live)
                self._hold(t, key)
        return out


def proc_status() -> dict[str, int]:
    """``Vm*`` fields of /proc/self/status, in bytes (Linux)."""
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Vm"):
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[key] = int(parts[0]) * 1024
    return out


def malloc_trim() -> None:
    """Hand freed heap memory back to the OS (glibc), so the resident set tracks live memory."""
    try:
        _libc().malloc_trim(0)
    except (OSError, AttributeError):
        pass


_LIBC: list = []
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
_GLIBC_DEFAULT = 128 * 1024  # both thresholds' initial values
_MALLOC_ENV = {_M_MMAP_THRESHOLD: "MALLOC_MMAP_THRESHOLD_", _M_TRIM_THRESHOLD: "MALLOC_TRIM_THRESHOLD_"}


def _mallopt(param: int, value: int) -> bool:
    try:
        return bool(_libc().mallopt(param, value))
    except (OSError, AttributeError):
        return False


def _mmap_freed_blocks() -> list[int]:
    """Make glibc serve blocks from 64 KiB up by mmap and hand freed memory back at once.

    Without it glibc's dynamic thresholds serve a freed size from the heap next time and
    keep freed pages: the probe would read the heap's history (fragmentation), not what
    the step needs. A threshold the user set (``MALLOC_*_THRESHOLD_``) is left as set.
    Returns the parameters changed (restored to glibc's initial 128 KiB afterwards;
    glibc's dynamic adjustment stays off from the first mallopt on).
    """
    changed = []
    for param, value in ((_M_MMAP_THRESHOLD, 65536), (_M_TRIM_THRESHOLD, 0)):
        if _MALLOC_ENV[param] not in os.environ and _mallopt(param, value):
            changed.append(param)
    return changed


def _libc() -> ctypes.CDLL:
    if not _LIBC:
        _LIBC.append(ctypes.CDLL("libc.so.6"))
    return _LIBC[0]


class RssPeak:
    """The rise of this process's peak resident set over a block (Linux; the OS as the meter).

    On entry: young unreachable objects collected (and collection paused inside), glibc
    told to serve blocks from 64 KiB up by mmap and return freed memory at once
    (:func:`_mmap_freed_blocks`), freed heap pages handed back to the OS
    (``malloc_trim``), the resident set read (``VmRSS``) and its high-water mark reset
    to it (``5`` into ``/proc/self/clear_refs``). On exit ``peak`` is ``VmHWM``
    minus that base: every page the block touched at its peak, whoever allocated it
    (op outputs, kernels' internal buffers and workspaces, allocator slack). Resolution
    is a page plus the kernel's per-CPU counter batching (well under 1 MiB); other
    threads' allocations in the same process count too (measured: a 4 or 64 MiB tensor
    reads 80 KiB under its size, every time). Side effects: the process's ``VmHWM``
    afterwards reports the peak since this block, not since the process began; and
    glibc's thresholds stay static at 128 KiB (as under ``MALLOC_MMAP_THRESHOLD_=131072``)
    unless the user set them, which keeps later steps' footprint near what was measured.
    """

    def __init__(self) -> None:
        self.base = 0
        self.peak = 0
        self._gc = True
        self._mallopt: list[int] = []

    @staticmethod
    def available() -> bool:
        """Whether /proc/self reports VmHWM and lets this process reset it."""
        if not _RSS_OK:
            try:
                proc_status()["VmHWM"]
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
                _RSS_OK.append(True)
            except (OSError, ValueError, KeyError):
                _RSS_OK.append(False)
        return _RSS_OK[0]

    def __enter__(self) -> RssPeak:
        # Young cyclic garbage goes now, and no collection runs inside the block (one
        # freeing earlier garbage there would lower the resident set under the base).
        # A full collection costs ~0.2 s in a process with torch loaded: too dear per probe.
        gc.collect(1)
        self._gc = gc.isenabled()
        gc.disable()
        self._mallopt = _mmap_freed_blocks()
        malloc_trim()
        self.base = proc_status()["VmRSS"]
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return self

    def __exit__(self, *exc: object) -> None:
        self.peak = max(0, proc_status()["VmHWM"] - self.base)
        for param in self._mallopt:
            _mallopt(param, _GLIBC_DEFAULT)
        if self._gc:
            gc.enable()


_RSS_OK: list[bool] = []


def measure_peak(
    model: nn.Module,
    micro_batch: Any,
    call: Callable[[nn.Module, Any], torch.Tensor],
    autocast_dtype: torch.dtype | None = None,
    accumulating: bool = False,
    meter: str = "tracker",
) -> int:
    """Peak bytes that one micro-batch's forward, loss and backward add to what is resident.

    Includes the activations saved for backward and every transient of the backward
    pass (activation gradients, weight-gradient temporaries, workspaces on CUDA). With
    ``accumulating``, ``.grad`` already holds earlier micro-batches' sum (as from the
    second micro-batch of a step on): each new gradient is then a temporary added into
    it, and the resident sum itself is not counted; otherwise the probe starts without
    ``.grad`` and the gradients count. The micro-batch's own tensors are resident
    already and not counted.

    ``meter`` picks the CPU meter: ``"tracker"`` (:class:`PeakTracker`) or ``"rss"``
    (:class:`RssPeak`); CUDA always reads the caching allocator.

    A DDP model is probed through its wrapped module: DDP's forward and backward run
    collectives, and ranks plan on their own data, so they may probe different numbers
    of times; a collective that only some ranks enter would hang or mismatch.
    """
    model = unwrap(model)
    device = model_device(model)
    for p in model.parameters():
        p.grad = torch.zeros_like(p) if accumulating and p.requires_grad else None
    def forward_backward() -> None:  # the loss and its graph are freed on return
        with _loss.autocast(device, autocast_dtype):
            loss = call(model, micro_batch)
        loss.float().backward()

    peak = _peak_of(forward_backward, device, meter)
    for p in model.parameters():
        p.grad = None
    return peak


def measure_forward_peak(model: nn.Module, micro_batch: Any, fn: Callable[[nn.Module, Any], Any],
                         autocast_dtype: torch.dtype | None = None, meter: str = "tracker") -> int:
    """Peak bytes that ``fn(model, micro_batch)`` adds under ``torch.no_grad()``: what
    :func:`mbs_ext.forward` holds for one micro-batch (its output included, freed on return)."""
    model = unwrap(model)
    device = model_device(model)

    def no_grad_forward() -> None:
        with torch.no_grad(), _loss.autocast(device, autocast_dtype):
            fn(model, micro_batch)

    return _peak_of(no_grad_forward, device, meter)


def _peak_of(work: Callable[[], None], device: torch.device, meter: str) -> int:
    """Peak bytes ``work()`` adds to what is resident: CUDA's allocator on a GPU, else ``meter``
    (``"tracker"``: :class:`PeakTracker`, ``"rss"``: :class:`RssPeak`)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        work()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - base)
    with (RssPeak() if meter == "rss" else PeakTracker()) as tracker:
        work()
    return int(tracker.peak)


def release_cached_memory(device: torch.device) -> None:
    """Free what a failed attempt left: unreachable tensors and the allocator's cached blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def fits(model: nn.Module, batch: Any, indices: torch.Tensor | None, size: int, device: torch.device,
         loss_call: Callable, autocast_dtype: torch.dtype | None) -> bool:
    """Whether one micro-batch of ``size`` rows runs forward and backward; leaves no trace."""
    layers = deferred_layers(model)
    for layer in layers:
        layer.begin_mini_batch()
    try:
        with probing(model, device):
            with _loss.autocast(device, autocast_dtype):
                loss = loss_call(model, probe_batch(batch, size, indices, device))
            loss.float().backward()
        return True
    except BaseException as exc:
        if not is_out_of_memory(exc):
            raise
        return False
    finally:
        for layer in layers:
            layer.discard()
        release_cached_memory(device)
