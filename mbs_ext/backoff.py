"""Out-of-memory back-off: when a step may be redone smaller, and the largest size that fits.

Halving after an out-of-memory error throws away up to half the micro-batch size the
device could hold. Instead, single-micro-batch probes (:func:`mbs_ext.probe.fits`)
bisect between 0 and the size that failed; the step is redone once, at the largest
size found, and the caller remembers it.
"""

from __future__ import annotations

import traceback
import warnings
from collections.abc import Callable
from typing import TypeVar

from mbs_ext.messages import add_note, caller_stacklevel
from mbs_ext.probe import is_out_of_memory

R = TypeVar("R")


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
) -> R:
    """``attempt(size)``; on an out-of-memory error that ``retryable`` allows, probe for the
    largest size that fits and redo it there (``remember`` keeps that size for later).

    ``attempt`` must undo its own changes before raising. The failed attempt's frames
    (and the tensors they hold) are dropped before probing; their text is kept for the
    error raised when not even one row fits.
    """
    while True:
        try:
            return attempt(size)
        except BaseException as exc:
            if size == 1 or not is_out_of_memory(exc) or not retryable(exc):
                raise
            origin = "".join(traceback.format_list(traceback.extract_tb(exc.__traceback__)))
            exc.__traceback__ = None
            free()
            smaller = largest_fitting(fits_at, size)
            if smaller is None:
                add_note(exc, "mbs_ext.step: out-of-memory back-off found no micro-batch size that fits, not "
                              "even 1 row. Where the error was raised (its frames were freed for the probes):\n"
                              + origin.rstrip())
                raise exc from None
            del exc
            warnings.warn(
                f"mbs_ext.step: out of memory at micro_batch_size={size}; "
                f"redoing the step with micro_batch_size={smaller}",
                RuntimeWarning,
                stacklevel=caller_stacklevel(),
            )
            remember(smaller)
            size = smaller
