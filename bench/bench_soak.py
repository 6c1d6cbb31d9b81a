"""Soak: 2,000 streamed steps; resident memory must stay flat and threads constant.

Reports the slope of resident memory after warm-up (bytes per step, least squares
over samples every 50 steps) and the thread count before and after. Run with
``pytest bench/bench_soak.py`` (about a minute).
"""

from __future__ import annotations

import os

import torch
from torch import nn

import mbs_ext
from mbs_ext.diagnostics import os_threads as threads

STEPS, WARMUP, EVERY = 2000, 200, 50


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def slope(xs: list[float], ys: list[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def test_soak():
    torch.manual_seed(0)
    model = mbs_ext.convert_batchnorm(
        nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 10))
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    dataset = (torch.randn(4096, 64), torch.randint(0, 10, (4096,)))
    streamer = mbs_ext.MicroBatchStreamer(model, opt, nn.CrossEntropyLoss(), micro_batch_size=48, max_grad_norm=5.0)
    gen = torch.Generator().manual_seed(1)
    steps, rss, thread_counts = [], [], []
    for i in range(STEPS):
        size = int(torch.randint(100, 300, (), generator=gen))
        size += size % 48 == 1  # BatchNorm in training cannot normalize a 1-row micro-batch
        rows = torch.randint(0, 4096, (size,), generator=gen)
        streamer.step(dataset, indices=rows)
        if i >= WARMUP and i % EVERY == 0:
            steps.append(i)
            rss.append(rss_bytes())
            thread_counts.append(threads())
    per_step = slope(steps, rss)
    growth = rss[-1] - rss[0]
    from _results import write

    write(
        "soak",
        {"steps": STEPS, "warmup": WARMUP, "rss_slope_bytes_per_step": per_step, "rss_growth_bytes": growth,
         "rss_first": rss[0], "rss_last": rss[-1], "threads": sorted(set(thread_counts))},
        [{"steps": STEPS, "RSS after warm-up MiB": rss[0] / 2**20, "RSS at end MiB": rss[-1] / 2**20,
          "slope bytes/step": per_step, "threads seen": ",".join(map(str, sorted(set(thread_counts))))}],
        note="Random mini-batches of 100-300 rows gathered by indices, micro-batch 48, deferred BatchNorm, "
        "clipping. A leak of one micro-batch per step would show as a slope of tens of KiB/step.",
    )
    assert len(set(thread_counts)) == 1, thread_counts
    assert per_step < 1024, f"resident memory grows {per_step:.0f} bytes/step"


def test_soak_ring_staging_threads():
    """1,000 streams through one ring with 2 staging threads (gathers and copies, some
    broken off early): resident memory flat, thread count constant, pool bounded."""
    ring = mbs_ext.StreamRing("cpu", staging_threads=2)
    data = (torch.randn(2048, 256), torch.randint(0, 10, (2048,)))
    gen = torch.Generator().manual_seed(2)
    steps, rss, thread_counts = [], [], []
    for i in range(1000):
        idx = torch.randint(0, 2048, (int(torch.randint(100, 600, (), generator=gen)),), generator=gen)
        it = ring.stream(data, 64, indices=idx if i % 2 else None)
        for j, _ in enumerate(it):
            if i % 5 == 0 and j == 2:
                break  # left for the next stream to close
        if i >= 100 and i % 50 == 0:
            steps.append(i)
            rss.append(rss_bytes())
            thread_counts.append(threads())
    per_step = slope(steps, rss)
    assert len(set(thread_counts)) == 1, thread_counts
    assert per_step < 1024, f"resident memory grows {per_step:.0f} bytes/stream"
