"""Planner accuracy: the measured peak of an ``"auto"`` step against the budget it was given.

For each model and budget, the planned micro-batch size, then the peak of a whole step at
that size (a batch of exactly 3 micro-batches, so the split does not shrink them): on CPU
live bytes at the dispatcher (``mbs_ext.diagnostics.PeakTracker``), on CUDA the caching
allocator's ``max_memory_allocated`` above what was allocated before the step. Also the
step's peak over a plain step of the same micro-batch (``zero_grad``; backward; ``step``
with no streaming), split in two: a hand-written accumulation loop over the same
micro-batches against the plain step (what accumulating costs by itself: from the second
micro-batch on, autograd computes each parameter's gradient into a temporary and adds it
into ``.grad``), and the step against that hand loop (what mbs_ext adds: its float32
accumulation buffers for low-precision parameters, the snapshot of module buffers, staged
inputs), with the first two components' sizes. Target: peak / budget in 0.85-1.0, no
out-of-memory back-off, step / hand loop 1.0 where mbs_ext holds nothing of its own.

    python -m pytest bench/bench_planner.py -q -s     # CPU rows; CUDA rows where a GPU exists

Writes ``planner.json``/``.md`` to ``$MBS_BENCH_OUT`` (default ``bench/results/``).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch
from torch import nn

import mbs_ext
from mbs_ext.diagnostics import PeakTracker

OUT = Path(os.environ.get("MBS_BENCH_OUT", Path(__file__).parent / "results"))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 512), nn.Tanh(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10),
    )


class UNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU())
        self.mid = nn.Sequential(
            nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.Upsample(scale_factor=2)
        )
        self.out = nn.Conv2d(48, 10, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.down(x)
        return self.out(torch.cat([a, self.mid(a)], 1)).mean((2, 3))


def cnn_bn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(64, 10),
    )


def mlp_bf16() -> nn.Module:
    return mlp().to(torch.bfloat16)


MODELS = {
    "mlp": (mlp, (64,)),
    "cnn": (cnn, (3, 32, 32)),
    "unet": (UNet, (3, 32, 32)),
    "cnn_bn": (cnn_bn, (3, 32, 32)),
    "mlp_bf16": (mlp_bf16, (64,)),
}


def ce(model: nn.Module, mb) -> torch.Tensor:
    x = mb[0].to(next(model.parameters()).dtype)
    return nn.functional.cross_entropy(model(x).float(), mb[1])


def data(shape, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *shape, generator=g), torch.randint(0, 10, (n,), generator=g)


def peak_of(fn, device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    with PeakTracker() as tracker:
        fn()
    return tracker.peak


def row(name: str, budget: int, device: torch.device) -> dict:
    make, shape = MODELS[name]
    torch.manual_seed(0)
    model = make().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = mbs_ext.step(model, opt, data(shape, 4096), ce, micro_batch_size="auto",
                         memory_budget=budget).micro_batch_size
        batch = data(shape, 3 * m, seed=1)
        step_peak = peak_of(lambda: mbs_ext.step(model, opt, batch, ce, micro_batch_size="auto",
                                                 memory_budget=budget), device)
    backoffs = sum("out of memory" in str(w.message) for w in caught)
    mb = [t[:m].to(device) for t in batch]
    opt.zero_grad(set_to_none=True)

    def plain() -> None:
        opt.zero_grad(set_to_none=True)
        ce(model, mb).backward()
        opt.step()

    # The accumulation loop a user would write, over the step's micro-batches (on the
    # device beforehand, like the plain step's one, so both count inputs alike).
    mbs = [[t[j * m : (j + 1) * m].to(device) for t in batch] for j in range(3)]

    def hand() -> None:
        opt.zero_grad(set_to_none=True)
        for mb_j in mbs:
            (ce(model, mb_j) / 3).backward()
        opt.step()

    plain()  # the same state as the step's: optimizer state exists
    plain_peak = peak_of(plain, device)
    hand_peak = peak_of(hand, device)
    low = (torch.float16, torch.bfloat16)
    buffers = sum(p.numel() * 4 for p in model.parameters() if p.dtype in low)
    snapshot = sum(b.nbytes for b in model.buffers())
    return {"device": device.type, "model": name, "budget_MiB": budget / 2**20, "micro_batch": m,
            "peak/budget": round(step_peak / budget, 3), "step/plain_peak": round(step_peak / max(plain_peak, 1), 3),
            "hand/plain_peak": round(hand_peak / max(plain_peak, 1), 3),
            "step/hand_peak": round(step_peak / max(hand_peak, 1), 3),
            "fp32_buffers_KiB": round(buffers / 1024, 1), "snapshot_KiB": round(snapshot / 1024, 1),
            "backoffs": backoffs}


def write(rows: list[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    (out / "planner.json").write_text(json.dumps({"study": "planner", **meta, "rows": rows}, indent=2) + "\n")
    cols = list(rows[0])
    lines = ["# planner", "", f"torch {meta['torch']}, GPU {meta['gpu']}", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    (out / "planner.md").write_text("\n".join(lines) + "\n")


def test_planner_accuracy() -> None:
    rows = [row(name, budget, torch.device("cpu")) for name in MODELS for budget in (4 << 20, 16 << 20)]
    if torch.cuda.is_available():
        rows += [row(name, budget, torch.device("cuda")) for name in MODELS for budget in (64 << 20, 512 << 20)]
    write(rows, OUT)
    for r in rows:
        print(r)
    assert all(r["backoffs"] == 0 for r in rows)


if __name__ == "__main__":
    test_planner_accuracy()
