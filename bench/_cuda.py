"""How the GPU studies time a step and read its memory: one rule for all of them."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn`` takes, the device's queue drained before and after."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def rotating_medians(runs: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median seconds of each run over ``rounds`` rounds, every run once a round in an order that
    rotates each round (no run always follows the same one)."""
    names = list(runs)
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            times[k].append(timed(runs[k]))
    return {k: statistics.median(v) for k, v in times.items()}


def peak_above_start(fn: Callable[[], object]) -> int:
    """``torch.cuda.max_memory_allocated`` during ``fn`` above what was allocated when it began."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start
