"""The ring and the step on a GPU over time: a 1,000-step soak, and the ring's CPU time while it waits.

* Soak: 1,000 streamed steps of a small CNN with deferred BatchNorm, random mini-batches of
  300-900 rows gathered by ``indices=`` from a pageable host dataset, micro-batch 96. After 100
  warm-up steps, every 50 steps: resident host memory, ``torch.cuda.memory_allocated`` and
  ``memory_reserved``, the thread count. Reported: least-squares slopes per step; flat means no
  leak of a micro-batch or an event per step.
* Waiting: one stream of 48 micro-batches (4 MiB each, pageable) whose consumer keeps the GPU
  busy for about 10 ms per micro-batch (``torch.cuda._sleep``), so the ring spends the stream
  waiting for free slots. Reported: the CPU time of the ring's own threads (named
  ``RING_PRODUCER_THREAD`` / ``RING_STAGING_THREAD``, read from ``/proc/self/task``) over the
  stream's wall time; near zero means the waits block instead of spinning.

Results where ``bench/_results.py:results_dir("gpu")`` says. Skipped without a GPU.

    python -m pytest bench/bench_soak_gpu.py -q -s
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from _results import write
from bench_soak import rss_bytes, slope
from torch import nn

import mbs_ext
from mbs_ext.diagnostics import RING_PRODUCER_THREAD, RING_STAGING_THREAD
from mbs_ext.diagnostics import os_threads as threads

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

STEPS, WARMUP, EVERY = 1000, 100, 50
TICK = os.sysconf("SC_CLK_TCK")


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return mbs_ext.convert_batchnorm(nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(64, 10))).cuda()


def test_soak_gpu() -> None:
    model = cnn()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    dataset = (torch.randn(8192, 3, 32, 32), torch.randint(0, 10, (8192,)))
    streamer = mbs_ext.MicroBatchStreamer(model, opt, nn.CrossEntropyLoss(), micro_batch_size=96, max_grad_norm=5.0)
    gen = torch.Generator().manual_seed(1)
    steps, rss, allocated, reserved, thread_counts = [], [], [], [], []
    t0 = time.perf_counter()
    for i in range(STEPS):
        size = int(torch.randint(300, 900, (), generator=gen))
        size += size % 96 == 1  # BatchNorm in training cannot normalize a 1-row micro-batch
        streamer.step(dataset, indices=torch.randint(0, 8192, (size,), generator=gen))
        if i >= WARMUP and i % EVERY == 0:
            torch.cuda.synchronize()
            steps.append(i)
            rss.append(rss_bytes())
            allocated.append(torch.cuda.memory_allocated())
            reserved.append(torch.cuda.memory_reserved())
            thread_counts.append(threads())
    seconds = time.perf_counter() - t0
    result = {"steps": STEPS, "seconds": seconds, "rss_slope_bytes_per_step": slope(steps, rss),
              "allocated_slope_bytes_per_step": slope(steps, allocated),
              "reserved_slope_bytes_per_step": slope(steps, reserved), "rss_first": rss[0], "rss_last": rss[-1],
              "allocated_first": allocated[0], "allocated_last": allocated[-1], "reserved_first": reserved[0],
              "reserved_last": reserved[-1], "threads": sorted(set(thread_counts))}
    write("soak_gpu", result, [{
        "steps": STEPS, "RSS MiB (first, last)": f"{rss[0] / 2**20:.1f}, {rss[-1] / 2**20:.1f}",
        "RSS slope B/step": result["rss_slope_bytes_per_step"],
        "allocated MiB (first, last)": f"{allocated[0] / 2**20:.2f}, {allocated[-1] / 2**20:.2f}",
        "allocated slope B/step": result["allocated_slope_bytes_per_step"],
        "reserved MiB (first, last)": f"{reserved[0] / 2**20:.1f}, {reserved[-1] / 2**20:.1f}",
        "threads seen": ",".join(map(str, sorted(set(thread_counts)))), "seconds": seconds}],
        note=f"{torch.cuda.get_device_name()}, torch {torch.__version__}; a small CNN with deferred BatchNorm, "
             "Adam, clipping; random mini-batches of 300-900 rows gathered by indices from a pageable dataset, "
             f"micro-batch 96; samples every {EVERY} steps after {WARMUP}.")
    assert len(set(thread_counts)) == 1, thread_counts
    assert result["rss_slope_bytes_per_step"] < 1024, result
    assert allocated[-1] == allocated[0], result


def ring_thread_ticks() -> dict[str, int]:
    """CPU ticks (user + system) of each live ring thread, by thread id."""
    ticks = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            if (task / "comm").read_text().strip() not in (RING_PRODUCER_THREAD, RING_STAGING_THREAD):
                continue
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended between the listing and the read
            continue
        ticks[task.name] = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return ticks


def test_ring_waits_without_cpu() -> None:
    ring = mbs_ext.StreamRing("cuda")
    data = torch.randn(48 * 64, 16384)  # 48 micro-batches of 64 rows x 64 KiB: 4 MiB each
    for _ in ring.stream(data, 64):  # warm: staging buffers and device memory exist
        pass
    torch.cuda.synchronize()
    busy_cycles = 20_000_000  # about 10 ms at a Hopper's 1.98 GHz
    seen: dict[str, int] = {}
    before = ring_thread_ticks()
    process_before = os.times()
    t0 = time.perf_counter()
    for mb in ring.stream(data, 64):
        torch.cuda._sleep(busy_cycles)  # ~10 ms of GPU time per micro-batch: the ring waits for slots
        mb.sum()
        seen.update(ring_thread_ticks())
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    process = os.times()
    ring_cpu = sum(t - before.get(tid, 0) for tid, t in seen.items()) / TICK
    process_cpu = (process.user - process_before.user) + (process.system - process_before.system)
    write("ring_wait_gpu", {"micro_batches": 48, "wall_s": wall, "ring_threads_cpu_s": ring_cpu,
                            "process_cpu_s": process_cpu, "ring_threads": len(seen)}, [{
        "micro-batches": 48, "wall s": wall, "ring threads CPU s": ring_cpu, "ring CPU / wall": ring_cpu / wall,
        "whole process CPU / wall": process_cpu / wall}],
        note=f"{torch.cuda.get_device_name()}, torch {torch.__version__}; one stream of 48 pageable 4 MiB "
             "micro-batches, each followed by about 10 ms of GPU work; CPU time of the ring's threads from "
             f"/proc/self/task (resolution 1/{TICK} s).")
    assert ring_cpu / wall < 0.1, (ring_cpu, wall)
