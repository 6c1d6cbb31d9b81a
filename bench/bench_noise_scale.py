"""What measuring the gradient noise costs a step: ``noise_scale=True`` vs off, side by side.

Run: ``python bench/bench_noise_scale.py`` (``--help``). The CPU step studies' MLP and CNN
(bench/bench_step.py: B=512, SGD, float32) at k = 2 and 8 micro-batches, three variants
interleaved round by round on copies of one model: the step as it runs by default (autograd adds
into ``.grad``), the step with float64 accumulation buffers (``accumulate_dtype``: what turning
the noise on costs in itself, the buffers the op's pass needs), and the step with
``noise_scale=True`` (float32 buffers, the op's ``sq_norm``, one pass over the final sums, two
more values in the one read). Ratios are the median over rounds of each round's ratio (the
variants ran back to back there). Written as ``noise_scale.{json,md}`` where bench/_results.py
says studies write (``MBS_BENCH_UPDATE=1``: bench/results/).

Two settings hold still what is not the variants' to vary (``--as-is`` leaves both alone): the
process runs on one core (one torch thread, no migration), and glibc's malloc keeps freed memory
rather than giving it back to the system at once (``mallopt``: trim and mmap thresholds of 1 GiB
and 64 MiB). By default it returns the top of its heap as soon as a free leaves 128 KiB there,
and faults it back in on the next allocation: which of a step's gradient-sized frees land on top
depends on the order of allocations, so two runs of one unchanged step read up to 2% apart on
the 20 ms MLP step (an A/A control) while neither computes anything more.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import ctypes.util
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import interleaved, write  # noqa: E402
from bench_step import MODELS, B, _data  # noqa: E402

import mbs_ext  # noqa: E402

VARIANTS = {"off": {}, "float64 buffers": {"accumulate_dtype": torch.float64}, "noise_scale": {"noise_scale": True}}


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
    row = {"model": model_name, "k": k, "off_ms": statistics.median(times["off"]) * 1e3}
    for name in ("float64 buffers", "noise_scale"):
        row[f"{name} / off"] = statistics.median(a / b for a, b in zip(times[name], times["off"]))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--ks", default="2,8")
    parser.add_argument("--as-is", action="store_true", help="leave the core and malloc's thresholds as they are")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one thread: the step's own work, not the pool's scheduling
    held = {} if args.as_is else hold_still()
    table = [study(name, int(k), args.rounds) for name in MODELS for k in args.ks.split(",")]
    write("noise_scale", {"rounds": args.rounds, "threads": 1, "held": held, "rows": table}, table,
          note="Step time with noise_scale=True over the default step, paired medians of interleaved rounds "
               f"(python bench/bench_noise_scale.py). One torch thread; held still: {held or 'nothing (--as-is)'}.")


if __name__ == "__main__":
    main()
