"""BatchNorm across ranks: what its collectives cost, and how far each BatchNorm behaviour is
from the full batch.

Cost: two gloo ranks on the CPU (tests/ddp_harness.py), a small CNN with two BatchNorm
layers, 64 rows of 3x16x16 per rank in micro-batches of 16 (4 per rank). The same step with
the layers normalizing each rank's micro-batch (``local``: deferred statistics, no collective
of theirs), across ranks (``across``), and across ranks switched off by the threshold
(``local_from``: only the step's agreement remains). Every ``all_reduce`` of a step is
counted (torch.distributed's function, wrapped in the ranks for this measurement) and the
step timed: medians of interleaved rounds, on rank 0.

Distance: the gradient of one mini-batch of 64 rows, relative L2 distance to the full batch
(one process, every row through BatchNorm at once), for: per micro-batch statistics in one
process (the default), statistics across two ranks of 32 rows each (each micro-batch's
statistics span both ranks' micro-batch: twice the rows), and whole-mini-batch statistics in
one process, which only a micro-batch of the whole mini-batch gives (no streaming).
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _results import write
from torch import nn

import mbs_ext

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from ddp_harness import run_world  # noqa: E402

ROWS, M, ROUNDS = 64, 16, 21
MS = (4, 8, 16, 32)


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1, stride=2, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


def data(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 3, 16, 16, generator=g) * 1.5 + 0.3, torch.randint(0, 10, (rows,), generator=g)


def ce(model: nn.Module, batch: tuple) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


class Counted:
    """torch.distributed.all_reduce, counting its calls."""

    def __init__(self) -> None:
        self.calls, self.inner = 0, dist.all_reduce

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)


def _cost(rank: int) -> dict:
    warnings.simplefilter("ignore", mbs_ext.BatchNormWarning)
    counted = Counted()
    dist.all_reduce = counted
    batch = data(ROWS, seed=rank)
    steps = {}
    for name, kw in {"local": {}, "across": {"across_ranks": True},
                     "local_from": {"across_ranks": True, "local_from": 1}}.items():
        ddp = nn.parallel.DistributedDataParallel(mbs_ext.convert_batchnorm(cnn(), **kw))
        streamer = mbs_ext.MicroBatchStreamer(ddp, torch.optim.SGD(ddp.parameters(), lr=0.01), ce, micro_batch_size=M)
        steps[name] = streamer
    times: dict[str, list[float]] = {k: [] for k in steps}
    calls = {}
    for r in range(ROUNDS + 1):
        order = list(steps)[r % 3:] + list(steps)[: r % 3]
        for name in order:
            dist.barrier()
            before = counted.calls
            t0 = time.perf_counter()
            steps[name].step(batch)
            if r:
                times[name].append(time.perf_counter() - t0)
            calls[name] = counted.calls - before
    return {"median_s": {k: statistics.median(v) for k, v in times.items()}, "all_reduce_per_step": calls}


def _grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _distance(rank: int) -> dict:
    """Gradients of the mini-batch (64 rows: this rank's 32) with statistics across the two ranks."""
    warnings.simplefilter("ignore", mbs_ext.BatchNormWarning)
    x, y = data(ROWS, seed=99)
    half = slice(rank * ROWS // 2, (rank + 1) * ROWS // 2)
    out = {}
    for m in MS:
        model = mbs_ext.convert_batchnorm(cnn().double(), across_ranks=True)
        ddp = nn.parallel.DistributedDataParallel(model)
        mbs_ext.accumulate(ddp, (x[half].double(), y[half]), ce, micro_batch_size=m)
        out[m] = _grads(model)
    return out


def _world(rank: int) -> dict:
    return {"cost": _cost(rank), "distance": _distance(rank)}


def distances(across: dict) -> list[dict]:
    x, y = data(ROWS, seed=99)
    x = x.double()
    full = cnn().double()
    ce(full, (x, y)).backward()
    g_full = _grads(full)
    rows = []
    for m in (*MS, ROWS):
        model = cnn().double()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", mbs_ext.BatchNormWarning)
            mbs_ext.accumulate(model, (x, y), ce, micro_batch_size=m)
        row = {"micro_batch_size": m, "per micro-batch, one process": _rel(_grads(model), g_full)}
        row["across 2 ranks (m rows each)"] = _rel(across[m], g_full) if m in across else float("nan")
        rows.append(row)
    return rows


def _rel(g: torch.Tensor, ref: torch.Tensor) -> float:
    return float((g - ref).norm() / ref.norm())


def test_batchnorm_ranks_study(benchmark) -> None:
    got = {}
    benchmark.pedantic(lambda: got.update(r0=run_world(_world, timeout=600)[0]), rounds=1, iterations=1)
    cost = got["r0"]["cost"]
    med, calls = cost["median_s"], cost["all_reduce_per_step"]
    rows = [{"BatchNorm": k, "median_ms": med[k] * 1e3, "time / local": med[k] / med["local"],
             "all_reduce per step": calls[k]} for k in med]
    dist_rows = distances(got["r0"]["distance"])
    for k, v in med.items():
        benchmark.extra_info[f"{k}_median_s"] = v
    write("batchnorm_ranks", {"rows_per_rank": ROWS, "micro_batch_size": M, "rounds": ROUNDS, "cost": cost,
                              "distance": dist_rows}, rows,
          note=f"Two gloo ranks (CPU), a CNN with 2 BatchNorm2d layers, {ROWS} rows of 3x16x16 per rank, "
               f"micro-batches of {M} ({ROWS // M} per rank); step medians of {ROUNDS} interleaved rounds on rank 0; "
               "every torch.distributed.all_reduce of a step counted.\n\nDistance of the gradient from the full batch "
               f"(relative L2), {ROWS} rows, float64:\n\n"
               + "\n".join(f"- m={r['micro_batch_size']}: per micro-batch {r['per micro-batch, one process']:.3g}; "
                           f"across 2 ranks {r['across 2 ranks (m rows each)']:.3g}" for r in dist_rows))
    layers, per_rank = 2, ROWS // M
    assert calls["across"] - calls["local"] == 2 * layers * per_rank + 1  # + the agreement
    assert calls["local_from"] - calls["local"] == 1
