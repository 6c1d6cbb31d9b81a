"""2-process gloo DDP: a streamed step equals one single-process step on the global batch.

The ranks run under ``tests/ddp_harness.py`` (a hang or crash fails with every rank's
Python stacks, never a stuck job).

Runs with the models on the CPU and, where a GPU exists, on CUDA (both ranks on one GPU
share it through gloo, which all-reduces CUDA tensors; NCCL refuses two ranks on one
device). The batch stays on the host; the reference is a float64 full-batch step.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from common import DEVICE_PARAMS, PoisonGrad, TinyLM, full_batch_step, lm_loss, rel_err, to_f64, token_count
from ddp_harness import WORLD, run_world
from torch import nn

import mbs_ext


def mse(model, batch):
    return F.mse_loss(model(batch[0]), batch[1])


def lm_data(n=11, t=6, vocab=11, empty_rows=()):
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, vocab, (n, t), generator=g)
    keep = torch.randint(1, t + 1, (n, 1), generator=g)
    labels = torch.where(torch.arange(t) < keep, torch.roll(ids, -1, 1), torch.full_like(ids, -100))
    for r in empty_rows:
        labels[r] = -100
    return {"ids": ids, "labels": labels}


def mlp_data(n=14):
    g = torch.Generator().manual_seed(9)
    x = torch.randn(n, 4, generator=g, dtype=torch.float64)
    return x, torch.randn(n, 2, generator=g, dtype=torch.float64)


def make_model(kind, dtype):
    torch.manual_seed(0)
    if kind == "lm":
        return TinyLM().to(dtype)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)).to(dtype)


# name: (model kind, dtype, data, rows of rank 0, micro_batch_size, normalize, accumulate_dtype)
SCENARIOS = {
    "tokens": ("lm", torch.float64, lambda: lm_data(), 7, 3, token_count, None),
    "tokens_empty_last": ("lm", torch.float64, lambda: lm_data(empty_rows=(9, 10)), 7, 2, token_count, None),
    "tokens_fp64_buffers": ("lm", torch.float32, lambda: lm_data(), 4, 3, token_count, torch.float64),
    "samples": ("mlp", torch.float64, lambda: mlp_data(), 5, 4, "samples", None),
    "samples_buffers": ("mlp", torch.float32, lambda: mlp_data(), 9, 4, "samples", torch.float64),
}


def _loss_for(kind):
    return lm_loss if kind == "lm" else mse


def _rows(data, lo, hi):
    if isinstance(data, dict):
        return {k: v[lo:hi] for k, v in data.items()}
    return tuple(v[lo:hi] for v in data)


def _n(data):
    return len(data["ids"]) if isinstance(data, dict) else len(data[0])


# name: (fault on rank 0, accumulate_dtype). Every rank must take the same decision.
AGREEMENT = {
    "nonfinite_grads": ("nan", None),
    "nonfinite_buffers": ("nan", torch.float64),
    "bad_count_grads": ("count", None),
    "bad_count_buffers": ("count", torch.float64),
}


def _agreement(rank, device, out_dir):
    data = tuple(v.float() for v in mlp_data())
    local = _rows(data, 0, 6) if rank == 0 else _rows(data, 6, _n(data))
    for name, (fault, acc) in AGREEMENT.items():
        model = nn.parallel.DistributedDataParallel(make_model("mlp", torch.float32).to(device))
        before = {k: v.detach().cpu().clone() for k, v in model.module.named_parameters()}
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def loss_fn(m, b, fault=fault):
            out = m(b[0])
            if fault == "nan" and rank == 0:
                out = PoisonGrad.apply(out, float("nan"))  # a fault on one rank only
            return F.mse_loss(out, b[1])

        def count(b, fault=fault):
            rows = torch.tensor(float(len(b[0])), dtype=torch.float64, device=device)
            return -rows if fault == "count" and rank == 0 else rows

        outcome = {}
        try:
            res = mbs_ext.step(model, opt, local, loss_fn, micro_batch_size=4, normalize=count,
                               accumulate_dtype=acc, on_nonfinite="skip")
            outcome["skipped"] = res.skipped
        except ValueError as exc:
            outcome["error"] = str(exc)
        outcome["unchanged"] = all(
            torch.equal(v.detach().cpu(), before[k]) for k, v in model.module.named_parameters()
        )
        torch.save(outcome, os.path.join(out_dir, f"agree_{name}_{rank}.pt"))
    # "auto" plans on each rank's own rows, so ranks probe different numbers of times: the
    # probes must not run DDP's collectives.
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
    )
    x = torch.randn((8, 4000)[rank], 32, generator=torch.Generator().manual_seed(rank))
    res = mbs_ext.step(model, torch.optim.SGD(model.parameters(), lr=0.1), x, lambda m, b: m(b).pow(2).mean(),
                       micro_batch_size="auto", memory_budget=2_000_000)
    torch.save({"loss": res.loss, "m": res.micro_batch_size,
                "params": [p.detach().cpu().clone() for p in model.parameters()]},
               os.path.join(out_dir, f"agree_auto_{rank}.pt"))


def _scenarios(rank, device, out_dir):
    for name, (kind, dtype, data_fn, split, m, normalize, acc) in SCENARIOS.items():
        data = data_fn()
        if dtype == torch.float32 and kind == "mlp":
            data = tuple(v.float() for v in data)
        local = _rows(data, 0, split) if rank == 0 else _rows(data, split, _n(data))
        model = nn.parallel.DistributedDataParallel(make_model(kind, dtype).to(device))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        res = mbs_ext.step(model, opt, local, _loss_for(kind), micro_batch_size=m, normalize=normalize,
                           accumulate_dtype=acc)
        torch.save(
            {
                "params": {k: v.detach().cpu().clone() for k, v in model.module.named_parameters()},
                "grads": {k: v.grad.cpu().clone() for k, v in model.module.named_parameters()},
                "loss": res.loss,
                "num_micro_batches": res.num_micro_batches,
            },
            os.path.join(out_dir, f"{name}_{rank}.pt"),
        )


def _worker(rank, out_dir, device):
    # Process group, watchdog (stacks of every rank on a hang or crash) and teardown (through
    # os._exit, after destroy_process_group) are the harness's.
    if device == "cuda":
        device = f"cuda:{rank % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
    _scenarios(rank, device, out_dir)
    _agreement(rank, device, out_dir)


@pytest.fixture(scope="module", params=DEVICE_PARAMS)
def ddp_results(request, tmp_path_factory):
    device = request.param
    out = tmp_path_factory.mktemp(f"ddp_{device}")
    run_world(_worker, str(out), device, timeout=240, out_dir=out)
    results = {name: [torch.load(out / f"{name}_{r}.pt") for r in range(WORLD)] for name in SCENARIOS}
    for name in AGREEMENT:
        results[f"agree_{name}"] = [torch.load(out / f"agree_{name}_{r}.pt") for r in range(WORLD)]
    results["agree_auto"] = [torch.load(out / f"agree_auto_{r}.pt") for r in range(WORLD)]
    return results


@pytest.mark.multiprocess
def test_ddp_auto_plans_per_rank_without_collectives(ddp_results):
    r0, r1 = ddp_results["agree_auto"]
    assert r0["m"] != r1["m"]  # each rank planned on its own rows (8 and 4,000)
    assert r0["loss"] == r1["loss"]
    for a, b in zip(r0["params"], r1["params"]):
        assert torch.equal(a, b)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(AGREEMENT))
def test_ddp_fault_on_one_rank_stops_every_rank(ddp_results, name):
    # A NaN gradient or an invalid count on rank 0 alone: every rank skips (or raises) and no
    # replica changes; a rank that stepped would silently diverge from the others.
    ranks = ddp_results[f"agree_{name}"]
    for rank, outcome in enumerate(ranks):
        if AGREEMENT[name][0] == "nan":
            assert outcome.get("skipped") is True, (rank, outcome)
        else:
            error = outcome.get("error", "")
            # Rank 0 (6 rows, 2 micro-batches) names its own bad micro-batch; rank 1 points at it.
            where = "at micro-batch 0 of 2 (rows [0, 3) of the mini-batch)" if rank == 0 else "on another DDP rank"
            assert "non-negative finite number" in error and where in error, (rank, outcome)
        assert outcome["unchanged"], (rank, outcome)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_ddp_equals_single_process_global_step(ddp_results, name):
    kind, dtype, data_fn, split, m, normalize, acc = SCENARIOS[name]
    data = data_fn()
    if dtype == torch.float32 and kind == "mlp":
        data = tuple(v.float() for v in data)
    ref = make_model(kind, dtype).double()  # the same initial values, in float64
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_loss, _ = full_batch_step(ref, ropt, to_f64(data), _loss_for(kind))
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    r0, r1 = ddp_results[name]
    # Ranks streamed different numbers of micro-batches for this to be a real test.
    assert r0["num_micro_batches"] != r1["num_micro_batches"]
    for res in (r0, r1):
        assert abs(res["loss"] - ref_loss) <= tol * abs(ref_loss)
        for k, q in ref.named_parameters():
            assert rel_err(res["grads"][k], q.grad) <= tol, (k, rel_err(res["grads"][k], q.grad))
            assert rel_err(res["params"][k], q) <= tol, k


def test_ddp_unequal_token_counts_make_naive_rules_wrong():
    # Control: averaging per-rank token means (what plain DDP does) differs from the global mean.
    data = lm_data()
    model = make_model("lm", torch.float64)
    per_rank = [lm_loss(model, _rows(data, 0, 7)), lm_loss(model, _rows(data, 7, 11))]
    glob = lm_loss(copy.deepcopy(model), data)
    assert abs((per_rank[0] + per_rank[1]).item() / 2 - glob.item()) > 1e-3
