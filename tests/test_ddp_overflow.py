"""Across DDP ranks, a gradient sum that overflows only in the sum over ranks is not stepped.

Each rank's float32 sum is finite (one row of 2e38 each, a weight of 0: every loss is 0);
the all-reduced sum (4e38) is not. The reference is one process stepping both rows, whose
float32 ``.grad`` overflows and is skipped or raised; every rank must do the same.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from ddp_harness import run_world
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import mbs_ext

pytestmark = pytest.mark.multiprocess  # gloo ranks: out of the quick suite, run by CI

ROW = 2e38


def _model() -> nn.Module:
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    return model


def _sum_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).sum()


def _step(model: nn.Module, rows: int, on_nonfinite: str) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    out: dict = {"raised": None, "skipped": None}
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        try:
            res = mbs_ext.step(model, opt, torch.full((rows, 1), ROW), _sum_loss, micro_batch_size=1,
                               normalize="sum", on_nonfinite=on_nonfinite)
            out["skipped"] = res.skipped
        except FloatingPointError as exc:
            out["raised"] = str(exc)
    out["unchanged"] = all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    return out


def _rank(rank: int, on_nonfinite: str) -> dict:
    return _step(DDP(_model()), 1, on_nonfinite)


@pytest.mark.parametrize("on_nonfinite", ["skip", "raise"])
def test_a_sum_that_overflows_across_ranks_is_skipped_or_raised_like_one_process(on_nonfinite, tmp_path):
    reference = _step(_model(), 2, on_nonfinite)  # one process, both rows
    assert reference["unchanged"]
    assert (reference["raised"] is not None) if on_nonfinite == "raise" else reference["skipped"]
    ranks = run_world(_rank, on_nonfinite, world=2, timeout=120, out_dir=tmp_path / "world")
    for r in ranks:
        assert r["unchanged"], r
        assert (r["raised"] is not None) == (reference["raised"] is not None), r
        assert r["skipped"] == reference["skipped"], r
