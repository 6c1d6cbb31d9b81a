"""What measuring the gradient noise costs a step: ``noise_scale=True`` vs off, side by side.

Run: ``python bench/bench_noise_scale.py`` (``--help``). The CPU step studies' MLP and CNN
(bench/bench_step.py: B=512, SGD, float32) at k = 2 and 8 micro-batches, four variants
interleaved round by round on copies of one model: the step as it runs by default (autograd adds
into ``.grad``), the same step again (an A/A control: what two runs of one unchanged step read
apart here), the step with float64 accumulation buffers (``accumulate_dtype``: the buffers'
path, which reads each micro-batch's gradient after its backward), and the step with
``noise_scale=True`` (on one process on the CPU: the noise tap, mbs_ext.ops.noise_tap, which adds
each later gradient into ``.grad`` with its squares inside the backward, and one read of the final
sums with their non-finite check). Ratios are the median over rounds of each round's ratio (the
variants ran back to back there), with a distribution-free 95% interval for that median (order
statistics of the rounds' ratios). Written as ``noise_scale.{json,md}`` where bench/_results.py
says studies write (``MBS_BENCH_UPDATE=1``: bench/results/).

The MLP's step is short (14-25 ms) and the rounds' ratios spread several percent on a shared
machine (interquartile range about +-4% here): it runs :data:`ROUNDS` rounds, enough to put its
median within a few tenths of a percent; the CNN's 200 ms step spreads less.

Two settings hold still what is not the variants' to vary (``--as-is`` leaves both alone): the
process runs on one core (one torch thread, no migration), and glibc's malloc keeps freed memory
rather than giving it back to the system at once (``mallopt``: trim and mmap thresholds of 1 GiB
and 64 MiB). By default it returns the top of its heap as soon as a free leaves 128 KiB there,
and faults it back in on the next allocation: which of a step's gradient-sized frees land on top
depends on the order of allocations, so two runs of one unchanged step read up to 2% apart on
the MLP step while neither computes anything more.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import ctypes.util
import math
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import interleaved, write  # noqa: E402
from bench_step import MODELS, B, _data  # noqa: E402

import mbs_ext  # noqa: E402

VARIANTS = {"off": {}, "off again": {}, "float64 buffers": {"accumulate_dtype": torch.float64},
            "noise_scale": {"noise_scale": True}}
ROUNDS = {"mlp": 1001, "cnn": 101}  # by model (the module's docstring says why)


def median_interval(ratios: list[float], z: float = 1.96) -> tuple[float, float]:
    """A distribution-free interval for the median of ``ratios`` (about 95% at ``z`` = 1.96): the
    order statistics ``n/2 -+ z sqrt(n)/2`` (the count of rounds below the median is binomial)."""
    ordered = sorted(ratios)
    n = len(ordered)
    half = z * math.sqrt(n) / 2
    return ordered[max(0, math.floor(n / 2 - half))], ordered[min(n - 1, math.ceil(n / 2 + half))]


def study(model_name: str, k: int, rounds: int) -> dict:
    x, y = _data(model_name)
    base = MODELS[model_name][0]()
    runs = {}
    for name, extra in VARIANTS.items():
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        streamer = mbs_ext.MicroBatchStreamer(model, opt, torch.nn.CrossEntropyLoss(), micro_batch_size=B // k,
                                              **extra)
        runs[name] = (lambda s: lambda: s.step((x, y)))(streamer)
    times: dict[str, list[float]] = {name: [] for name in runs}
    round_robin = interleaved(runs, times)
    for _ in range(3):
        round_robin()
    for samples in times.values():
        samples.clear()
    for _ in range(rounds):
        round_robin()
    row = {"model": model_name, "k": k, "rounds": rounds, "off_ms": statistics.median(times["off"]) * 1e3}
    for name in ("off again", "float64 buffers", "noise_scale"):
        ratios = [a / b for a, b in zip(times[name], times["off"])]
        row[f"{name} / off"] = statistics.median(ratios)
        if name == "noise_scale":
            row["noise_scale 95% interval"] = "{:.4f}-{:.4f}".format(*median_interval(ratios))
    return row


def hold_still() -> dict:
    """One core and a malloc that keeps what is freed (the module's docstring says why); what was set."""
    held = {}
    if hasattr(os, "sched_setaffinity"):
        core = max(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {core})
        held["core"] = core
    libc = ctypes.util.find_library("c")
    mallopt = getattr(ctypes.CDLL(libc), "mallopt", None) if libc else None
    if mallopt is not None:  # glibc: M_TRIM_THRESHOLD (-1), M_MMAP_THRESHOLD (-3)
        held["malloc"] = bool(mallopt(-1, 1 << 30) and mallopt(-3, 64 << 20))
    return held


def shown(table: list[dict]) -> list[dict]:
    """The rows with ratios to four decimals (the table's default three digits would show a 0.6%
    cost as 1.01)."""
    return [{k: f"{v:.4f}" if k.endswith(" / off") else v for k, v in row.items()} for row in table]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=None, help=f"rounds per cell (default by model: {ROUNDS})")
    parser.add_argument("--ks", default="2,8")
    parser.add_argument("--as-is", action="store_true", help="leave the core and malloc's thresholds as they are")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one thread: the step's own work, not the pool's scheduling
    held = {} if args.as_is else hold_still()
    table = [study(name, int(k), args.rounds or ROUNDS[name]) for name in MODELS for k in args.ks.split(",")]
    write("noise_scale", {"threads": 1, "held": held, "rows": table}, shown(table),
          note="Step time with noise_scale=True over the default step, paired medians of interleaved rounds, with "
               "the median's 95% interval and the A/A control (off again / off) "
               f"(python bench/bench_noise_scale.py). One torch thread; held still: {held or 'nothing (--as-is)'}.")


if __name__ == "__main__":
    main()
