"""GPU study of the streaming ring against the host link, all in one run.

Measured on one CUDA device, medians over rounds after a warm-up, with CUDA
synchronization before every clock read:

  pinned H2D            copy of a pinned host tensor to the device (the limit)
  memcpy -> pinned      pageable -> pinned ``copy_`` with torch at 1 / 4 / N threads
  gather -> pinned      ``index_select`` of random rows into pinned memory, 1 / 4 / N threads
                        (both read micro-batch after micro-batch of the whole batch and
                        write two pinned buffers in turn, as the ring does, so no round is
                        served from the CPU's last-level cache)
  naive .to()           ``x[j:j+m].to(device)`` from a pageable batch
  ring staging          ``StreamRing(device).stream(batch, m)`` with no compute, from a
                        pageable batch with staging_threads 1 / 4 / default / N, and from a
                        pinned batch
  overlap study         compute per micro-batch calibrated to the ring's staging time
                        (128 x 3 x 224 x 224 fp32 per micro-batch, 16 micro-batches):
                        compute alone, ring, serial (copy, compute, synchronize), naive
                        loop (copy then compute, no synchronize) -- once in a fresh
                        state and once after ``torch.set_num_threads(N)``.

Results: JSON, Markdown and a plot where ``bench/_results.py:results_dir("gpu")`` says ($MBS_BENCH_OUT;
bench/results/gpu/ with MBS_BENCH_UPDATE=1; else a scratch folder),
with the GPU name and torch version. Skipped without a GPU.

Run:  python -m pytest bench/bench_ring_gpu.py -q -s    or    python bench/bench_ring_gpu.py
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from mbs_ext import StreamRing
from mbs_ext.diagnostics import default_staging_threads
from mbs_ext.diagnostics import native as _C

MB_SHAPE = (128, 3, 224, 224)  # one micro-batch, fp32: 77 MB
MICRO_BATCHES = 16
ROUNDS = 5
CUDA = torch.cuda.is_available() and bool(_C.cuda_compiled)


def out_dir() -> Path:
    from _results import results_dir

    return results_dir("gpu")


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def timed(fn: Callable[[], object], rounds: int = ROUNDS, warmup: int = 1) -> float:
    """Median seconds of fn(), with the device idle before and after each clock read."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def with_threads(n: int, fn: Callable[[], float]) -> float:
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(old)


class Compute:
    """A GPU load per micro-batch whose time is tuned to match the staging time."""

    def __init__(self, device: torch.device) -> None:
        self.a = torch.randn(2048, 2048, device=device)
        self.repeats = 1

    def __call__(self, mb: torch.Tensor) -> torch.Tensor:
        acc = mb.float().mean()
        y = self.a
        for _ in range(self.repeats):
            y = torch.tanh(y @ self.a * 1e-3)
        return acc + y[0, 0]

    def calibrate(self, target_s: float, sample: torch.Tensor) -> None:
        self.repeats = 4
        per = timed(lambda: self(sample), rounds=3) / self.repeats
        self.repeats = max(1, round(target_s / per))


def measure() -> dict:
    dev = torch.device("cuda", torch.cuda.current_device())
    n_threads = cores()
    rows = MB_SHAPE[0] * MICRO_BATCHES
    m = MB_SHAPE[0]
    gen = torch.Generator().manual_seed(0)
    pageable = torch.randn((rows, *MB_SHAPE[1:]), generator=gen)
    pinned = pageable.pin_memory()
    mb_bytes = pageable[:m].nbytes
    total = pageable.nbytes
    gb = lambda nbytes, s: nbytes / s / 1e9  # noqa: E731
    res: dict = {"GB/s": {}, "ms": {}}
    rate = res["GB/s"]

    dst_dev = torch.empty((m, *MB_SHAPE[1:]), device=dev)
    src_pin = pinned[:m]
    rate["pinned H2D"] = gb(mb_bytes, timed(lambda: dst_dev.copy_(src_pin, non_blocking=True), rounds=20))
    dst_pins = [torch.empty((m, *MB_SHAPE[1:])).pin_memory() for _ in range(2)]
    gathers = [torch.randint(0, rows, (m,), generator=gen) for _ in range(MICRO_BATCHES)]
    turn = iter(range(1 << 62))  # call count: rotates sources and destinations

    def memcpy_next() -> None:
        j = next(turn)
        k = j % MICRO_BATCHES
        dst_pins[j % 2].copy_(pageable[k * m : (k + 1) * m])

    def gather_next() -> None:
        j = next(turn)
        torch.index_select(pageable, 0, gathers[j % MICRO_BATCHES], out=dst_pins[j % 2])

    for t in sorted({1, 4, n_threads}):
        rate[f"memcpy pageable->pinned, {t} threads"] = gb(
            mb_bytes, with_threads(t, lambda: timed(memcpy_next, rounds=2 * MICRO_BATCHES, warmup=2))
        )
        rate[f"gather into pinned, {t} threads"] = gb(
            mb_bytes, with_threads(t, lambda: timed(gather_next, rounds=2 * MICRO_BATCHES, warmup=2))
        )

    def naive() -> None:
        for j in range(0, rows, m):
            pageable[j : j + m].to(dev)

    rate["naive x[j:j+m].to(device)"] = gb(total, timed(naive))

    def ring_alone(ring: StreamRing, batch: torch.Tensor) -> Callable[[], None]:
        def run() -> None:
            for _ in ring.stream(batch, m):
                pass

        return run

    threads = default_staging_threads(dev)
    ring = StreamRing(dev)
    for t in sorted({1, 4, threads, n_threads}):
        staged = ring if t == threads else StreamRing(dev, staging_threads=t)
        rate[f"ring staging from pageable, {t} staging threads"] = gb(total, timed(ring_alone(staged, pageable)))
        del staged
    rate["ring from pinned (direct copy)"] = gb(total, timed(ring_alone(ring, pinned)))
    stage_s = total / (rate[f"ring staging from pageable, {threads} staging threads"] * 1e9)

    compute = Compute(dev)
    device_mbs = [pageable[j : j + m].to(dev) for j in range(0, rows, m)]
    compute.calibrate(stage_s / MICRO_BATCHES, device_mbs[0])

    def compute_alone() -> None:
        for mb in device_mbs:
            compute(mb)

    def ring_run() -> None:
        for mb in ring.stream(pageable, m):
            compute(mb)

    def serial() -> None:
        for j in range(0, rows, m):
            compute(pageable[j : j + m].to(dev))
            torch.cuda.synchronize()

    def naive_loop() -> None:
        for j in range(0, rows, m):
            compute(pageable[j : j + m].to(dev))

    def overlap() -> dict:
        ms = {
            "compute alone": timed(compute_alone) * 1e3,
            "ring staging alone": timed(ring_alone(ring, pageable)) * 1e3,
            "ring": timed(ring_run) * 1e3,
            "serial": timed(serial) * 1e3,
            "naive loop": timed(naive_loop) * 1e3,
        }
        ratios = {
            "ring / max(stage, compute)": ms["ring"] / max(ms["ring staging alone"], ms["compute alone"]),
            "ring / serial": ms["ring"] / ms["serial"],
            "ring / naive loop": ms["ring"] / ms["naive loop"],
        }
        return {"ms": ms, "ratios": ratios}

    res["overlap, fresh"] = overlap()
    res[f"overlap, after torch.set_num_threads({n_threads})"] = with_threads(n_threads, overlap)
    res["ratios to pinned H2D"] = {
        "ring from pageable": rate[f"ring staging from pageable, {threads} staging threads"] / rate["pinned H2D"],
        "ring from pinned": rate["ring from pinned (direct copy)"] / rate["pinned H2D"],
    }
    res["setup"] = {
        "gpu": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cores": n_threads,
        "staging_threads_default": threads,
        "micro_batch": list(MB_SHAPE),
        "micro_batches": MICRO_BATCHES,
        "rounds": ROUNDS,
        "compute_repeats": compute.repeats,
        "platform": platform.platform(),
    }
    return res


def write(res: dict) -> Path:
    out = out_dir()
    out.mkdir(parents=True, exist_ok=True)
    (out / "ring_gpu.json").write_text(json.dumps(res, indent=2) + "\n")
    s = res["setup"]
    lines = [
        "# Streaming ring on a GPU",
        "",
        f"{s['gpu']}, torch {s['torch']} (CUDA {s['cuda']}), {s['cores']} cores, ring default "
        f"{s['staging_threads_default']} staging threads; micro-batch {'x'.join(map(str, s['micro_batch']))} fp32, "
        f"{s['micro_batches']} micro-batches, median of {s['rounds']} rounds.",
        "",
        "| what | GB/s |",
        "|---|---:|",
        *[f"| {k} | {v:.1f} |" for k, v in res["GB/s"].items()],
        "",
        "| ratio to pinned H2D | value |",
        "|---|---:|",
        *[f"| {k} | {v:.2f} |" for k, v in res["ratios to pinned H2D"].items()],
    ]
    for key in [k for k in res if k.startswith("overlap")]:
        lines += ["", f"## {key}", "", "| run | ms |", "|---|---:|"]
        lines += [f"| {k} | {v:.1f} |" for k, v in res[key]["ms"].items()]
        lines += ["", "| ratio | value |", "|---|---:|"]
        lines += [f"| {k} | {v:.2f} |" for k, v in res[key]["ratios"].items()]
    (out / "ring_gpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        from mbs_ext.diagnostics import pyplot

        plt = pyplot()

        fig, ax = plt.subplots(figsize=(8, 5))
        names = list(res["GB/s"])
        ax.barh(names, [res["GB/s"][k] for k in names])
        ax.set_xlabel("GB/s")
        ax.set_title(f"Host -> device staging, {s['gpu']}")
        fig.tight_layout()
        fig.savefig(out / "ring_gpu.png", dpi=120)
        plt.close(fig)
    except ImportError:  # the plot is optional; the numbers are not
        pass
    return out / "ring_gpu.json"


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device and a CUDA build of mbs_ext")
def test_bench_ring_gpu() -> None:
    res = measure()
    write(res)
    assert res["GB/s"]["pinned H2D"] > 0


if __name__ == "__main__":
    if not CUDA:
        raise SystemExit("bench_ring_gpu: no CUDA device (or a CPU-only build); nothing measured")
    write(measure())
