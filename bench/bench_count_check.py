"""What the first-step count check costs: the first step of a signature with and without it.

The check (``StepOptions.check_count``, :mod:`mbs_ext.counts.agreement`) runs three forwards with
no backward - the first micro-batch and its two halves - on the first step of each input
signature that streams more than one micro-batch with a loss given as a callable. This times
that first step (a fresh streamer each time, so each one is a first step) with the check on and
off, side by side in rotating order, medians over ``ROUNDS``, for a small CNN and an MLP at
``k`` = 2 and 8 micro-batches, and reports their ratio and the check's own seconds; later steps
do not run it. Run with ``pytest bench/bench_count_check.py`` (about a minute).
"""

from __future__ import annotations

import statistics

import torch
from _results import interleaved, write
from torch import nn

import mbs_ext

ROUNDS = 15
ROWS = 256


def _models() -> dict:
    torch.manual_seed(0)
    cnn = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                        nn.Flatten(), nn.Linear(16 * 16 * 16, 10))
    mlp = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    g = torch.Generator().manual_seed(1)
    return {"cnn": (cnn, torch.randn(ROWS, 3, 16, 16, generator=g)),
            "mlp": (mlp, torch.randn(ROWS, 256, generator=g))}


def _loss(model, mb):
    return nn.functional.cross_entropy(model(mb[0]), mb[1])


def test_count_check_cost():
    torch.set_num_threads(1)
    rows = []
    y = torch.randint(0, 10, (ROWS,), generator=torch.Generator().manual_seed(2))
    for name, (model, x) in _models().items():
        for k in (2, 8):
            opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: every round steps the same model

            def first_step(check: bool, k=k, model=model, x=x, opt=opt) -> None:
                mbs_ext.MicroBatchStreamer(model, opt, _loss, micro_batch_size=ROWS // k,
                                           check_count=check).step((x, y))

            times: dict[str, list[float]] = {"on": [], "off": []}
            round_robin = interleaved({"on": lambda f=first_step: f(True), "off": lambda f=first_step: f(False)},
                                      times)
            for _ in range(ROUNDS + 2):
                round_robin()
            on, off = (statistics.median(times[v][2:]) for v in ("on", "off"))
            rows.append({"model": name, "k": k, "first step, check on (ms)": 1e3 * on,
                         "check off (ms)": 1e3 * off, "on / off": on / off, "check (ms)": 1e3 * (on - off)})
    write("count_check", {"rounds": ROUNDS, "rows": ROWS, "results": rows}, rows,
          note=f"First step of a signature ({ROWS} rows, cross-entropy as a callable), a fresh streamer each "
          f"round, check on and off in rotating order, medians of {ROUNDS}; one torch thread. Later steps of the "
          "signature do not run the check.")
    assert all(r["on / off"] > 0 for r in rows)
