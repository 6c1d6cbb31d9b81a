"""The ring's overlap at balanced compute, alone in a fresh process: one JSON line.

``bench_ring_gpu.py`` measures the overlap after a dozen bandwidth studies in the same process
(its thread pools, pinned pools and page tables already warm), and two runs of that study on one
H200 disagreed (ring / max(stage, compute) 0.74 in the study, 1.56 in an independent script).
This script measures only the overlap, the first thing a fresh process does after building its
batch: staging alone (the ring with no compute), compute alone (calibrated to the staging
time), and the ring with compute, in interleaved rounds so that drift hits all three alike;
medians. Run it several times, each a new process:

    for i in 1 2 3; do python bench/ring_overlap_gpu.py; done

A ratio near 1.0 means the ring hides the smaller of staging and compute behind the larger;
the serial bound (copy, then compute) is ``(stage + compute) / max(stage, compute)``, 2.0 at
balance.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ring_gpu import MB_SHAPE, MICRO_BATCHES, Compute, timed  # noqa: E402

from mbs_ext import StreamRing  # noqa: E402
from mbs_ext.diagnostics import default_staging_threads  # noqa: E402

ROUNDS = 7


def main() -> dict:
    t_start = time.perf_counter()
    dev = torch.device("cuda", torch.cuda.current_device())
    m = MB_SHAPE[0]
    pageable = torch.randn((m * MICRO_BATCHES, *MB_SHAPE[1:]), generator=torch.Generator().manual_seed(0))
    ring = StreamRing(dev)

    def stage() -> None:
        for _ in ring.stream(pageable, m):
            pass

    first_stage_s = timed(stage, rounds=1, warmup=0)  # the very first pass, cold
    stage_s = timed(stage, rounds=3)
    compute = Compute(dev)
    device_mbs = [pageable[j : j + m].to(dev) for j in range(0, len(pageable), m)]
    compute.calibrate(stage_s / MICRO_BATCHES, device_mbs[0])

    def compute_alone() -> None:
        for mb in device_mbs:
            compute(mb)

    def ring_run() -> None:
        for mb in ring.stream(pageable, m):
            compute(mb)

    runs = {"stage": stage, "compute": compute_alone, "ring": ring_run}
    samples: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(ROUNDS):
        for name, fn in runs.items():
            samples[name].append(timed(fn, rounds=1, warmup=0) * 1e3)
    ms = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
        "staging_threads": default_staging_threads(dev), "compute_repeats": compute.repeats,
        "first_stage_ms": round(first_stage_s * 1e3, 2), "median_ms": {k: round(v, 2) for k, v in ms.items()},
        "ms": {k: [round(x, 2) for x in v] for k, v in samples.items()},
        "ring_over_max": round(ms["ring"] / max(ms["stage"], ms["compute"]), 3),
        "serial_bound_over_max": round((ms["stage"] + ms["compute"]) / max(ms["stage"], ms["compute"]), 3),
        "wall_s": round(time.perf_counter() - t_start, 1),
    }


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("ring_overlap_gpu: no CUDA device; nothing measured")
    print(json.dumps(main()), flush=True)
