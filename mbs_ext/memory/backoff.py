"""Out-of-memory back-off: when a step may be redone smaller, and the largest size that fits.

Halving after an out-of-memory error throws away up to half the micro-batch size the
device could hold. Instead, single-micro-batch probes (:func:`mbs_ext.memory.probe.fits`)
bisect between 0 and the size that failed; the step is redone once, at the largest
size found, and the caller remembers it. Across ranks, every rank probes on its own and
one small all-reduce agrees on the smallest size any rank found.
"""

from __future__ import annotations

import traceback
import warnings
from collections.abc import Callable
from typing import TypeVar

import torch

from mbs_ext.messages import add_note, caller_stacklevel

R = TypeVar("R")

_HOST_OOM_MESSAGES = ("can't allocate memory", "not enough memory", "Cannot allocate memory", "bad_alloc")


def is_out_of_memory(exc: BaseException) -> bool:
    """torch.OutOfMemoryError, MemoryError, or torch's CPU allocator failing (a RuntimeError)."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(msg in str(exc) for msg in _HOST_OOM_MESSAGES)


def largest_fitting(fits_at: Callable[[int], bool], failed: int) -> int | None:
    """Bisect (0, failed) to within 1/16 of ``failed``; None when not even one row fits."""
    lo, hi = 0, failed
    tolerance = max(1, failed // 16)
    while hi - lo > tolerance:
        mid = (lo + hi) // 2
        if fits_at(mid):
            lo = mid
        else:
            hi = mid
    if lo == 0 and hi > 1 and fits_at(1):
        lo = 1
    return lo or None


def with_backoff(
    attempt: Callable[[int], R],
    size: int,
    *,
    retryable: Callable[[BaseException], bool],
    fits_at: Callable[[int], bool],
    free: Callable[[], None],
    remember: Callable[[int], None],
    out_of_memory: Callable[[BaseException], bool] = is_out_of_memory,
    agree: Callable[[int | None], int | None] | None = None,
    unit: str = "micro_batch_size",
) -> R:
    """``attempt(size)``; on an error that ``out_of_memory`` says a smaller size may cure and
    ``retryable`` allows, probe for the largest size that fits and redo it there (``remember``
    keeps that size for later). ``unit`` names the size in messages (:mod:`mbs_ext.memory.axis`).

    ``agree`` (several ranks) turns this rank's finding into the one size every rank uses (None:
    every rank raises). Every rank must take the same path, so with it ``out_of_memory`` and
    ``retryable`` must answer alike on every rank, and it is called even where this rank found
    nothing or its probes failed.

    ``attempt`` must undo its own changes before raising. The failed attempt's frames
    (and the tensors they hold) are dropped before probing; their text is kept for the
    error raised when not even one row fits.
    """
    while True:
        try:
            return attempt(size)
        except BaseException as exc:
            if not out_of_memory(exc) or not retryable(exc) or (size == 1 and agree is None):
                raise
            smaller = _smaller(exc, size, fits_at, free, agree, unit)
            del exc
            warnings.warn(
                f"mbs_ext.step: out of memory at {unit}={size}; "
                f"redoing the step with {unit}={smaller}{' on every rank' if agree else ''}",
                RuntimeWarning,
                stacklevel=caller_stacklevel(),
            )
            remember(smaller)
            size = smaller


def _smaller(exc: BaseException, size: int, fits_at: Callable[[int], bool], free: Callable[[], None],
             agree: Callable[[int | None], int | None] | None, unit: str) -> int:
    """The size to redo at after ``exc`` at ``size``; raises ``exc`` (noted) where none fits. The
    failed attempt's frames are dropped first: the probes need the memory they hold."""
    origin = "".join(traceback.format_list(traceback.extract_tb(exc.__traceback__)))
    exc.__traceback__ = None
    free()
    probe = _Probe(fits_at)
    smaller = _found(probe, size, agree)
    if smaller is None:
        rows = unit == "micro_batch_size"
        what, least = ("micro-batch size", "1 row") if rows else ("token budget", "one that holds the longest row")
        add_note(exc, f"mbs_ext.step: out-of-memory back-off found no {what} that fits, not even "
                      f"{least}{' on some rank' if agree else ''}.{probe.failure} Where the error was "
                      "raised (its frames were freed for the probes):\n" + origin.rstrip())
        raise exc from None
    return smaller


class _Probe:
    """``fits_at``, where a probe failing with another error (a BatchNorm refusing one row in
    training) means that size does not fit: the out-of-memory error stays the one raised, and
    ``failure`` says what the first such probe hit."""

    def __init__(self, fits_at: Callable[[int], bool]) -> None:
        self.fits_at = fits_at
        self.failure = ""

    def __call__(self, size: int) -> bool:
        try:
            return self.fits_at(size)
        except Exception as exc:
            if not self.failure:
                self.failure = f" A probe at micro_batch_size={size} failed with {type(exc).__name__}: {exc}."
            return False


def _found(fits_at: Callable[[int], bool], size: int, agree: Callable[[int | None], int | None] | None) -> int | None:
    """The size to redo at: this rank's largest that fits, or with ``agree`` the one all ranks agree on."""
    if agree is None:
        return largest_fitting(fits_at, size)
    try:
        mine = largest_fitting(fits_at, size) if size > 1 else None
    except BaseException:
        agree(None)  # the others must not wait for this rank
        raise
    return agree(mine)
