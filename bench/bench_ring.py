"""Benchmark of the streaming ring on a staging-heavy CPU workload.

Workload: a uint8 image dataset (20000 x 3 x 64 x 64, 245 MB) stays on the host;
each micro-batch is a gather of random rows by ``indices`` (staging). Compute takes
a 4x4 subsampled view of the images, converts it to float and runs a small CNN
forward + backward -- small on purpose, so that staging and compute cost about
the same and the overlap shows (with a big CNN staging would vanish in the noise). Measured in one run,
all with ``torch.set_num_threads(1)`` (compute on one core; the ring's worker
thread stages on the other core, the machine has 2):

  S       staging alone       (index_select of every micro-batch, main thread)
  C       compute alone       (on pre-gathered micro-batches)
  serial  stage, then compute (one thread, no overlap)
  ring    StreamRing('cpu').stream(dataset, m, indices=idx) feeding compute

Target: ring <= 1.1 * max(S, C) per micro-batch (serial is about S + C).

Also: the ring's staging alone (no compute) in GB/s with ``staging_threads`` 1 and 2,
for a gather by indices and a contiguous copy -- the ring's own pool, measured here
after ``torch.set_num_threads(1)`` to show it does not follow torch's thread count.
Results go to ring.json and ring.md where bench/_results.py says (bench/results/ with
MBS_BENCH_UPDATE=1, else a scratch folder).

Run:  python -m pytest bench/bench_ring.py -q    (pytest-benchmark)
  or  python bench/bench_ring.py
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time

import torch
from torch import nn

from mbs_ext import StreamRing

N_IMAGES = 20000
IMAGE = 64
SUBSAMPLE = 16
MICRO_BATCH = 512
MICRO_BATCHES = 24
ROUNDS = 7
THREADS = 1


def make_model() -> nn.Module:
    torch.manual_seed(0)
    side = IMAGE // SUBSAMPLE
    return nn.Sequential(  # on side x side inputs
        nn.Conv2d(3, 4, 3, padding=1),
        nn.ReLU(),
        nn.AvgPool2d(2),
        nn.Flatten(),
        nn.Linear(4 * (side // 2) ** 2, 10),
    )


class Workload:
    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.dataset = torch.randint(0, 256, (N_IMAGES, 3, IMAGE, IMAGE), dtype=torch.uint8, generator=gen)
        self.labels = torch.randint(0, 10, (N_IMAGES,), generator=gen)
        self.indices = torch.randint(0, N_IMAGES, (MICRO_BATCH * MICRO_BATCHES,), generator=gen)
        self.model = make_model()
        self.loss = nn.CrossEntropyLoss()

    def slices(self):
        m = MICRO_BATCH
        return [self.indices[j * m : (j + 1) * m] for j in range(MICRO_BATCHES)]

    def stage(self, idx):
        return self.dataset.index_select(0, idx), self.labels.index_select(0, idx)

    def compute(self, mb) -> None:
        images, labels = mb
        x = images[:, :, ::SUBSAMPLE, ::SUBSAMPLE].float().div_(255.0)
        loss = self.loss(self.model(x), labels)
        loss.backward()

    # --- the four measurements, each returns seconds for all micro-batches ---
    def run_stage(self) -> float:
        t0 = time.perf_counter()
        for idx in self.slices():
            self.stage(idx)
        return time.perf_counter() - t0

    def run_compute(self) -> float:
        staged = [self.stage(idx) for idx in self.slices()]
        t0 = time.perf_counter()
        for mb in staged:
            self.compute(mb)
        return time.perf_counter() - t0

    def run_serial(self) -> float:
        t0 = time.perf_counter()
        for idx in self.slices():
            self.compute(self.stage(idx))
        return time.perf_counter() - t0

    def run_ring(self, ring: StreamRing) -> float:
        t0 = time.perf_counter()
        for mb in ring.stream((self.dataset, self.labels), MICRO_BATCH, indices=self.indices):
            self.compute(mb)
        return time.perf_counter() - t0


def measure(rounds: int = ROUNDS) -> dict:
    load_before = os.getloadavg()
    old_threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        w = Workload()
        ring = StreamRing("cpu", slots=2)
        w.run_compute()  # warm-up
        w.run_ring(ring)
        samples: dict[str, list[float]] = {"stage": [], "compute": [], "serial": [], "ring": []}
        ring_stats = []
        for _ in range(rounds):  # interleaved, so drifts hit every measurement alike
            samples["stage"].append(w.run_stage())
            samples["compute"].append(w.run_compute())
            samples["serial"].append(w.run_serial())
            samples["ring"].append(w.run_ring(ring))
            ring_stats.append(ring.stats())
    finally:
        torch.set_num_threads(old_threads)
    per_mb = {k: statistics.median(v) / MICRO_BATCHES * 1e3 for k, v in samples.items()}
    best = {k: min(v) / MICRO_BATCHES * 1e3 for k, v in samples.items()}
    s, c, serial, r = per_mb["stage"], per_mb["compute"], per_mb["serial"], per_mb["ring"]
    return {
        "workload": {
            "dataset": [N_IMAGES, 3, IMAGE, IMAGE],
            "compute_input": f"images[:, :, ::{SUBSAMPLE}, ::{SUBSAMPLE}] as float",
            "dataset_dtype": "uint8",
            "micro_batch_size": MICRO_BATCH,
            "micro_batches": MICRO_BATCHES,
            "rounds": rounds,
            "torch_num_threads": THREADS,
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "machine": platform.machine(),
            "loadavg_1min_before": load_before[0],
            "loadavg_1min_after": os.getloadavg()[0],
        },
        "ms_per_micro_batch": {"S": s, "C": c, "serial": serial, "ring": r},
        "ratios": {
            "ring/max(S,C)": r / max(s, c),
            "ring/serial": r / serial,
            "serial/(S+C)": serial / (s + c),
        },
        "target_met": r <= 1.1 * max(s, c),
        "ms_per_micro_batch_best_round": {
            "S": best["stage"],
            "C": best["compute"],
            "serial": best["serial"],
            "ring": best["ring"],
        },
        "ring_stats_last_round": ring_stats[-1],
        "samples_s": samples,
    }


def staging_scaling(rounds: int = 5, threads: tuple[int, ...] = (1, 2)) -> dict:
    """GB/s of the ring's staging alone vs staging_threads (median of rounds)."""
    gen = torch.Generator().manual_seed(1)
    dataset = torch.randint(0, 256, (N_IMAGES, 3, IMAGE, IMAGE), dtype=torch.uint8, generator=gen)
    indices = torch.randint(0, N_IMAGES, (MICRO_BATCH * MICRO_BATCHES,), generator=gen)
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    out: dict = {}
    try:
        for t in threads:
            ring = StreamRing("cpu", staging_threads=t)
            for name, kwargs in (("gather", {"indices": indices}), ("copy", {})):
                samples = []
                for _ in range(rounds + 1):  # the first is a warm-up
                    t0 = time.perf_counter()
                    nbytes = sum(mb.nbytes for mb in ring.stream(dataset, MICRO_BATCH, **kwargs))
                    samples.append(nbytes / (time.perf_counter() - t0) / 1e9)
                out[f"{name}, {t} staging threads"] = statistics.median(samples[1:])
    finally:
        torch.set_num_threads(old)
    return out


def write_results(result: dict) -> None:
    from _results import results_dir

    out = results_dir()
    (out / "ring.json").write_text(json.dumps(result, indent=2) + "\n")
    ms, ratios, wl = result["ms_per_micro_batch"], result["ratios"], result["workload"]
    lines = [
        "# StreamRing benchmark (CPU, staging-heavy)",
        "",
        f"Gather of {wl['micro_batch_size']} random rows of a uint8 {'x'.join(map(str, wl['dataset']))} "
        f"dataset per micro-batch (staging); compute: {wl['compute_input']} + small CNN forward/backward; "
        f"`torch.set_num_threads({wl['torch_num_threads']})` on a {wl['cpu_count']}-core machine, "
        f"the ring's worker stages on the other core. Median of {wl['rounds']} rounds "
        f"x {wl['micro_batches']} micro-batches, torch {wl['torch']}. "
        f"1-min load average before the run: {wl['loadavg_1min_before']:.2f} "
        "(anything else running steals the core the overlap needs).",
        "",
        "| measurement | ms / micro-batch |",
        "|---|---:|",
        f"| S (staging alone) | {ms['S']:.3f} |",
        f"| C (compute alone) | {ms['C']:.3f} |",
        f"| serial (stage then compute) | {ms['serial']:.3f} |",
        f"| ring | {ms['ring']:.3f} |",
        "",
        "| ratio | value |",
        "|---|---:|",
        f"| ring / max(S, C) | {ratios['ring/max(S,C)']:.3f} |",
        f"| ring / serial | {ratios['ring/serial']:.3f} |",
        "",
        f"Target ring <= 1.1 x max(S, C): {'met' if result['target_met'] else 'NOT met'}.",
        "",
    ]
    if "staging_GBps" in result:
        lines += [
            "## Staging threads (the ring's staging alone, `torch.set_num_threads(1)`)",
            "",
            "| staging | GB/s |",
            "|---|---:|",
            *[f"| {k} | {v:.2f} |" for k, v in result["staging_GBps"].items()],
            "",
        ]
    (out / "ring.md").write_text("\n".join(lines))
    print(f"wrote {out / 'ring'}.json and .md")


def test_bench_ring(benchmark) -> None:
    result = benchmark.pedantic(measure, rounds=1, iterations=1)
    result["staging_GBps"] = staging_scaling()
    write_results(result)
    benchmark.extra_info.update(result["ms_per_micro_batch"])
    benchmark.extra_info.update(result["ratios"])
    # The overlap needs a free core; the 1.1 x max(S, C) target is reported, and
    # asserted only when the machine was otherwise idle.
    ms = result["ms_per_micro_batch"]
    if result["workload"]["loadavg_1min_before"] < 0.5:
        assert ms["ring"] < ms["serial"], ms
        assert result["target_met"], ms


if __name__ == "__main__":
    res = measure()
    res["staging_GBps"] = staging_scaling()
    write_results(res)
    print(json.dumps({k: res[k] for k in ("ms_per_micro_batch", "ratios")}, indent=2))
