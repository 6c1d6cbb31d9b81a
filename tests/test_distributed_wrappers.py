"""DDP off the paved path: wrapped, compiled, or missing, on two gloo processes.

Every case runs on two CPU processes (``tests/ddp_harness.py``, with its watchdog) with
10 rows on rank 0 and 7 on rank 1 at ``micro_batch_size=3`` (4 and 3 micro-batches),
in float64, and is checked against one single-process full-batch step on all 17 rows
to 1e-12: token counts (``normalize=callable``, a device count) and sample counts.

Wrappers: ``DDP(model)``, ``DDP(torch.compile(model))``, ``torch.compile(DDP(model))``
(once a hang: the compiled wrapper was not seen as DDP, so no rank synced), and Lightning
Fabric's ``_FabricModule`` from ``Fabric(strategy="ddp").setup`` (whose ``.module`` is
the *unwrapped* model; the DDP module is its ``_forward_module``), with and without
``torch.compile``; Fabric casts outputs to the default dtype, so its cases run with
float64 as the default. And a plain replica (no DDP) with ``process_group=``: the
override for a wrapper the step cannot recognise. Compiled models use inductor (C++ code generation on the CPU:
about 40 s for all the wrapper cases on 2 cores with a cold cache, 20 s warm);
``MBS_TEST_COMPILE_BACKEND=aot_eager`` traces the same graphs without generating code.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import (
    MLP,
    ScalarReads,
    TinyLM,
    assert_bit_identical,
    full_batch_step,
    lm_loss,
    rel_err,
    snapshot,
    token_count,
)
from ddp_harness import WORLD, WorldFailed, run_world
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import mbs_ext

# Several processes (gloo ranks): out of the quick suite, run by CI (docs/testing.md).
pytestmark = pytest.mark.multiprocess

ROWS = (10, 7)  # rows of rank 0 and rank 1
M = 3  # micro_batch_size: 4 micro-batches on rank 0, 3 on rank 1
STEPS = 2
TOL = 1e-12
COMPILE_BACKEND = os.environ.get("MBS_TEST_COMPILE_BACKEND", "inductor")

# "explicit_group": a plain replica, no DDP, with process_group= (a wrapper the step cannot see).
WRAPPERS = ["ddp", "ddp_of_compiled", "compiled_ddp", "fabric", "fabric_compiled", "explicit_group"]
DATA = ["tokens", "samples"]


TOTAL_ROWS = sum(ROWS)


def lm_data(n=TOTAL_ROWS, t=6, vocab=11):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (n, t), generator=g)
    keep = torch.randint(1, t + 1, (n, 1), generator=g)  # unequal token counts per row
    labels = torch.where(torch.arange(t) < keep, torch.roll(ids, -1, 1), torch.full_like(ids, -100))
    return {"ids": ids, "labels": labels}


def mlp_data(n=TOTAL_ROWS):
    g = torch.Generator().manual_seed(5)
    return torch.randn(n, 4, generator=g, dtype=torch.float64), torch.randn(n, 2, generator=g, dtype=torch.float64)


def mse(model, batch):
    return F.mse_loss(model(batch[0]), batch[1])


def case(data_kind):
    """(model, data, loss_fn, normalize) of a data kind; the model in float64, seeded."""
    torch.manual_seed(0)
    if data_kind == "tokens":
        return TinyLM().double(), lm_data(), lm_loss, token_count
    return MLP().double(), mlp_data(), mse, "samples"


def rows_of(data, rank):
    lo = sum(ROWS[:rank])
    hi = lo + ROWS[rank]
    if isinstance(data, dict):
        return {k: v[lo:hi] for k, v in data.items()}
    return tuple(v[lo:hi] for v in data)


def _fabric(rank):
    from lightning.fabric import Fabric

    # The process group exists already (the harness made it): Fabric sees the processes as
    # created externally (LOCAL_RANK is set) and skips its own launch and rendezvous.
    os.environ.update(WORLD_SIZE=str(WORLD), RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=WORLD, num_nodes=1, precision="64-true")
    fabric.launch()
    return fabric


def wrap(wrapper, model, rank):
    """(wrapped model, optimizer) for one of WRAPPERS."""
    if wrapper == "ddp":
        model = DDP(model)
    elif wrapper == "ddp_of_compiled":
        model = DDP(torch.compile(model, backend=COMPILE_BACKEND))
    elif wrapper == "compiled_ddp":
        model = torch.compile(DDP(model), backend=COMPILE_BACKEND)
    if not wrapper.startswith("fabric"):
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)
    fabric = _fabric(rank)
    if wrapper == "fabric_compiled":
        model = torch.compile(model, backend=COMPILE_BACKEND)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = fabric.setup(model, opt)
    return model, opt


def _wrapped_steps(rank):
    out = {}
    for wrapper in WRAPPERS:
        for data_kind in DATA:
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            torch.set_default_dtype(torch.float32)
            model, data, loss_fn, normalize = case(data_kind)  # the reference's initial values
            # Fabric casts a module's outputs to the default dtype (precision="64-true" too):
            # float64 outputs need a float64 default.
            torch.set_default_dtype(torch.float64 if wrapper.startswith("fabric") else torch.float32)
            plain = model
            model, opt = wrap(wrapper, model, rank)
            local = rows_of(data, rank)
            losses = []
            group = {"process_group": dist.group.WORLD} if wrapper == "explicit_group" else {}
            for _ in range(STEPS):
                res = mbs_ext.step(model, opt, local, loss_fn, micro_batch_size=M, normalize=normalize, **group)
                losses.append(res.loss)
            out[wrapper, data_kind] = {
                "type": type(model).__name__,
                "num_micro_batches": res.num_micro_batches,
                "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
                "losses": losses,
                "params": {k: v.detach().clone() for k, v in plain.named_parameters()},
                "grads": {k: v.grad.detach().clone() for k, v in plain.named_parameters()},
            }
    return out


@pytest.fixture(scope="module")
def wrapped_results(tmp_path_factory):
    return run_world(_wrapped_steps, timeout=300, out_dir=tmp_path_factory.mktemp("wrappers"))


def reference(data_kind):
    model, data, loss_fn, _ = case(data_kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = [full_batch_step(model, opt, data, loss_fn)[0] for _ in range(STEPS)]
    return model, losses


@pytest.mark.parametrize("data_kind", DATA)
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_wrapped_ddp_equals_single_process_full_batch(wrapped_results, wrapper, data_kind):
    ref, ref_losses = reference(data_kind)
    per_rank = [r[wrapper, data_kind] for r in wrapped_results]
    assert [r["num_micro_batches"] for r in per_rank] == [4, 3]  # uneven: a real test of the sync
    if "compiled" in wrapper:  # compiled for real, not silently run eagerly
        assert all(r["graphs"] > 0 for r in per_rank), [r["graphs"] for r in per_rank]
    for rank, res in enumerate(per_rank):
        for got, want in zip(res["losses"], ref_losses, strict=True):
            assert abs(got - want) <= TOL * abs(want), (rank, got, want)
        for k, q in ref.named_parameters():
            assert rel_err(res["grads"][k], q.grad) <= TOL, (rank, k, rel_err(res["grads"][k], q.grad))
            assert rel_err(res["params"][k], q) <= TOL, (rank, k, rel_err(res["params"][k], q))


# --- a plain model under a world of 2: refused on every rank, nothing changed ---------------


def _plain_model(rank):
    model, data, loss_fn, _ = case("samples")
    local = rows_of(data, rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_fn(model, local).backward()  # optimizer state and .grad exist before the refused calls
    opt.step()
    before = snapshot(model, opt)
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    errors = []
    for call in (
        lambda: mbs_ext.step(model, opt, local, loss_fn, micro_batch_size=M),
        lambda: mbs_ext.accumulate(model, local, loss_fn, micro_batch_size=M),
        lambda: mbs_ext.MicroBatchStreamer(model, opt, loss_fn, micro_batch_size=M).step(local),
    ):
        try:
            call()
            errors.append(None)
        except ValueError as exc:
            errors.append(str(exc))
    # Both ranks still talk: no rank was left inside a collective.
    t = torch.ones(1)
    dist.all_reduce(t)
    return {"errors": errors, "before": before, "after": snapshot(model, opt), "grads": grads,
            "grads_after": {k: p.grad.clone() for k, p in model.named_parameters()}, "world": t.item()}


def weighted_data(n=TOTAL_ROWS):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, 4, generator=g, dtype=torch.float64)
    y = torch.randn(n, 2, generator=g, dtype=torch.float64)
    w = torch.rand(n, generator=g, dtype=torch.float64) * torch.linspace(0.1, 3.0, n, dtype=torch.float64)
    return x, y, w  # non-negative float weights, larger on rank 1's rows


def weighted_mse(model, b):
    x, y, w = b
    return ((model(x) - y).pow(2).mean(1) * w).sum() / w.sum()


def _weighted_steps(rank):
    torch.manual_seed(0)
    model = DDP(MLP().double())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    local = rows_of(weighted_data(), rank)
    losses = [mbs_ext.step(model, opt, local, weighted_mse, micro_batch_size=M, normalize=lambda b: b[2].sum()).loss
              for _ in range(STEPS)]
    return {"losses": losses, "params": [p.detach().clone() for p in model.module.parameters()],
            "weight": float(local[2].sum())}


def test_weighted_float_counts_are_global_under_ddp(tmp_path):
    """A weighted mean (float counts, unequal total weight per rank) equals the single-process
    full-batch weighted mean over both ranks' rows."""
    results = run_world(_weighted_steps, timeout=120, out_dir=tmp_path)
    torch.manual_seed(0)
    ref = MLP().double()
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_losses = [full_batch_step(ref, ropt, weighted_data(), weighted_mse)[0] for _ in range(STEPS)]
    assert results[0]["weight"] != results[1]["weight"]
    for res in results:
        assert res["losses"] == pytest.approx(ref_losses, rel=TOL)
        for p, q in zip(res["params"], ref.parameters()):
            assert rel_err(p, q) <= TOL


def test_plain_model_under_two_ranks_is_refused_on_every_rank(tmp_path):
    for rank, res in enumerate(run_world(_plain_model, timeout=60, out_dir=tmp_path)):
        assert res["world"] == WORLD
        for error in res["errors"]:
            assert error is not None, rank
            assert "plain MLP" in error and "2 ranks" in error, error
            assert "Wrap the model in DistributedDataParallel" in error, error  # the fix
            assert "pass process_group=" in error, error  # the override for wrappers it cannot see
        assert_bit_identical(res["before"], res["after"])
        for k, g in res["grads"].items():
            assert torch.equal(g, res["grads_after"][k]), (rank, k)


# --- host syncs and collectives per step under DDP -----------------------------------------


SYNC_ROWS = (16, 12)
SYNC_SIZES = (8, 2)  # micro_batch_size: 2 and 2, then 8 and 6 micro-batches per rank
# name: (parameter dtype, normalize, accumulate_dtype)
SYNC_CASES = {
    "tokens": (torch.float64, token_count, None),
    "samples": (torch.float64, "samples", None),
    "tokens_buffers": (torch.float32, token_count, torch.float64),
}


def _syncs(rank):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    calls = {"all_reduce": 0, "buckets": 0, "tolist": 0}
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(*args, **kwargs):
        calls["all_reduce"] += 1
        return real_all_reduce(*args, **kwargs)

    def counting_hook(state, bucket):
        calls["buckets"] += 1
        return allreduce_hook(None, bucket)  # DDP's own all-reduce of the bucket

    real_tolist = torch.Tensor.tolist

    def counting_tolist(self):
        calls["tolist"] += 1
        return real_tolist(self)

    dist.all_reduce = counting_all_reduce
    torch.Tensor.tolist = counting_tolist
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, 11, (SYNC_ROWS[rank], 7), generator=g)
    keep = torch.randint(1, 8, (SYNC_ROWS[rank], 1), generator=g)
    batch = {"ids": ids, "labels": torch.where(torch.arange(7) < keep, torch.roll(ids, -1, 1), -100)}
    out = {}
    try:
        for name, (dtype, normalize, acc) in SYNC_CASES.items():
            torch.manual_seed(0)
            # A tiny bucket cap: every parameter its own bucket once DDP rebuilt them, so more
            # than one DDP all-reduce per synced backward.
            model = DDP(TinyLM().to(dtype), bucket_cap_mb=1e-6)
            model.register_comm_hook(None, counting_hook)
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            for _ in range(2):  # DDP rebuilds its buckets after the first backward
                calls.update(all_reduce=0, buckets=0)
                lm_loss(model, batch).backward()
            own = {"all_reduce": calls["all_reduce"], "buckets": calls["buckets"]}
            model.zero_grad()
            for m in SYNC_SIZES:
                streamer = mbs_ext.MicroBatchStreamer(model, opt, lm_loss, micro_batch_size=m, normalize=normalize,
                                                      accumulate_dtype=acc)
                streamer.step(batch)  # warm: the ring exists
                calls.update(all_reduce=0, buckets=0, tolist=0)
                with ScalarReads() as reads:
                    res = streamer.step(batch)
                out[name, m] = {"reads": reads.count + calls["tolist"], "num_micro_batches": res.num_micro_batches,
                                "all_reduce": calls["all_reduce"], "buckets": calls["buckets"]}
            out[name, "own"] = own
    finally:
        dist.all_reduce = real_all_reduce
        torch.Tensor.tolist = real_tolist
    return out


@pytest.fixture(scope="module")
def sync_results(tmp_path_factory):
    return run_world(_syncs, timeout=120, out_dir=tmp_path_factory.mktemp("syncs"))


@pytest.mark.parametrize("name", sorted(SYNC_CASES))
def test_ddp_host_reads_do_not_grow_with_micro_batches(sync_results, name):
    for rank, res in enumerate(sync_results):
        few, many = res[name, SYNC_SIZES[0]], res[name, SYNC_SIZES[1]]
        assert (few["num_micro_batches"], many["num_micro_batches"]) == ((2, 8), (2, 6))[rank]
        # One batched read per step (the finish's), whatever the number of micro-batches.
        assert few["reads"] == many["reads"] == 1, (rank, few, many)


@pytest.mark.parametrize("name", sorted(SYNC_CASES))
def test_ddp_collectives_per_step(sync_results, name):
    """Every micro-batch runs under no_sync (DDP's buckets never all-reduce); the step adds one
    small collective (totals, flags, the failure record) and sums its one buffer itself: two
    all-reduces per step, whatever the number of micro-batches, where DDP's own backward makes three."""
    for rank, res in enumerate(sync_results):
        own = res[name, "own"]
        assert own["buckets"] == 3 and own["all_reduce"] == 3, own  # TinyLM's 3 parameters, one bucket each
        for m in SYNC_SIZES:
            got = res[name, m]
            assert got["buckets"] == 0 and got["all_reduce"] == 1 + 1, (rank, m, got)


# --- the watchdog itself ---------------------------------------------------------------------


def _hang_on_rank_1(rank):
    if rank == 1:
        time.sleep(600)  # never joins the collective below
    dist.all_reduce(torch.ones(1))


def _abort_on_rank_1(rank):
    if rank == 1:
        os.abort()  # a native crash: no Python exception, no result
    dist.all_reduce(torch.ones(1))


def test_watchdog_fails_a_hang_with_every_ranks_stacks(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(WorldFailed) as info:
        # 30 s from spawning: a rank of the CUDA build of torch can take over 6 s to import on a loaded
        # 2-core machine (20 s was too short once beside other two-rank runs), and one killed before
        # it reached the hang has no stacks to show.
        run_world(_hang_on_rank_1, timeout=30, grace=3, out_dir=tmp_path)
    text = str(info.value)
    assert time.monotonic() - t0 < 75
    assert "rank 0 stacks" in text and "rank 1 stacks" in text, text
    assert text.count("_hang_on_rank_1") >= 2, text  # where each rank was stuck
    assert "all_reduce" in text, text


def test_watchdog_reports_a_native_crash(tmp_path):
    with pytest.raises(WorldFailed) as info:
        run_world(_abort_on_rank_1, timeout=30, grace=3, out_dir=tmp_path)
    text = str(info.value)
    assert "Fatal Python error: Aborted" in text and "_abort_on_rank_1" in text, text


# --- module buffers: rank 0's at the start of every step, as DDP's forward does -----------------


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.bn, self.b = nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.bn(self.a(x))))


def _buffers(rank):
    """Two steps (lr=0: only the running statistics move) streamed and as plain DDP steps on
    the rank's whole rows; the buffers after each step."""
    x, y = rows_of(mlp_data(), rank)
    out = {}
    for kind in ("streamed", "plain"):
        torch.manual_seed(0)
        model = DDP(BNNet().double())
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        out[kind] = []
        for _ in range(2):
            if kind == "streamed":
                mbs_ext.step(model, opt, (x, y), mse, micro_batch_size=M)
            else:
                opt.zero_grad()
                mse(model, (x, y)).backward()
                opt.step()
            out[kind].append({k: v.clone() for k, v in model.module.named_buffers()})
    return out


def test_ddp_buffers_come_from_rank_0_at_each_step(tmp_path):
    """Each rank commits the statistics of its own rows once per step; the next step starts from
    rank 0's, as plain DDP's forward broadcasts them (the step does that broadcast itself, before
    its first micro-batch, so that a rank failing earlier cannot leave the others waiting in it)."""
    results = run_world(_buffers, timeout=90, out_dir=tmp_path)
    for rank, res in enumerate(results):
        for streamed, plain in zip(res["streamed"], res["plain"]):
            for k in plain:
                assert rel_err(streamed[k], plain[k]) <= 1e-12, (rank, k)
    first = [res["streamed"][0]["bn.running_mean"] for res in results]
    assert rel_err(first[0], first[1]) > 1e-3  # each rank's own rows after the first step
