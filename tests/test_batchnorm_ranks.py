"""BatchNorm statistics across ranks (``convert_batchnorm(model, across_ranks=True)``, and
``nn.SyncBatchNorm`` in a streamed step) on two gloo ranks, against a float64 single-process
reference.

The reference streams, for each micro-batch ``j``, every rank's rows of micro-batch ``j``
together through plain BatchNorm (or each rank's rows alone, where a micro-batch is local:
the adaptive threshold, the switch), weighs each by the global row count, and commits
running statistics from every row it saw, once. Rank 0 streams 10 rows, rank 1 7.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import requires_cuda
from ddp_harness import WORLD, run_world
from torch import nn

import mbs_ext

ROWS = (10, 7)


def data():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(sum(ROWS), 3, 5, 5, generator=g, dtype=torch.float64) * 2 + 0.5
    y = torch.randint(0, 3, (sum(ROWS),), generator=g)
    return x, y


def rank_rows(rank):
    start = sum(ROWS[:rank])
    return start, start + ROWS[rank]


def make_model(sync=False, track=True):
    torch.manual_seed(0)
    kw = {"track_running_stats": track}
    bn2, bn1 = ((nn.SyncBatchNorm(4, **kw), nn.SyncBatchNorm(6, **kw)) if sync else
                (nn.BatchNorm2d(4, **kw), nn.BatchNorm1d(6, **kw)))
    # No bias before a BatchNorm: its gradient is zero up to rounding, which AdamW would amplify.
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), bn2, nn.ReLU(), nn.Flatten(),
                         nn.Linear(100, 6, bias=False), bn1, nn.Tanh(), nn.Linear(6, 3)).double()


def ce(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1])


def optimizer(kind, model):
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    return torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5)


# name: (micro_batch_size, optimizer, local_from, switch per step, eval mode[, track_running_stats])
SCENARIOS = {
    "m2_sgd": (2, "sgd", None, (True, True), False),
    "m3_sgd": (3, "sgd", None, (True, True), False),
    "m4_adamw": (4, "adamw", None, (True, True), False),
    "m10_one_each": (10, "sgd", None, (True, True), False),
    "m3_local_from_5": (3, "sgd", 5, (True, True), False),
    "m3_switch_off_then_on": (3, "adamw", None, (False, True), False),
    "m3_eval": (3, "sgd", None, (True, True), True),
    "m3_no_running_stats": (3, "sgd", None, (True, True), False, False),
}


def _scenario(rank, name):
    m, opt_kind, local_from, switches, evaluating, *track = SCENARIOS[name]
    model = mbs_ext.convert_batchnorm(make_model(track=track == []), across_ranks=True, local_from=local_from)
    if evaluating:
        for layer in model.modules():
            if isinstance(layer, nn.modules.batchnorm._BatchNorm):
                layer.running_mean.uniform_(-0.5, 0.5)
                layer.eval()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = optimizer(opt_kind, ddp)
    x, y = data()
    a, b = rank_rows(rank)
    states = []
    for on in switches:
        mbs_ext.set_batchnorm_across_ranks(ddp, on)
        mbs_ext.step(ddp, opt, (x[a:b], y[a:b]), ce, micro_batch_size=m)
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    return states


def _sync_batchnorm(rank):
    """nn.SyncBatchNorm, replicated by hand (process_group=): the step gives it the same semantics."""
    model = make_model(sync=True)
    opt = optimizer("sgd", model)
    x, y = data()
    a, b = rank_rows(rank)
    mbs_ext.step(model, opt, (x[a:b], y[a:b]), ce, micro_batch_size=3, process_group=dist.group.WORLD)
    return [{k: v.clone() for k, v in model.state_dict().items()}, type(model[1]).__name__]


def _failing(rank, where):
    """Rank 1 fails at ``where``: every rank raises, nothing changes."""
    model = mbs_ext.convert_batchnorm(make_model(), across_ranks=True)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = optimizer("sgd", ddp)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = data()
    a, b = rank_rows(rank)
    calls = []

    def loss(mod, batch):
        calls.append(1)
        if rank == 1 and where == "streaming" and len(calls) == 2:
            raise RuntimeError("rank 1 fails at its second micro-batch")
        return ce(mod, batch)

    indices = torch.arange(b - a) if not (rank == 1 and where == "checking") else torch.tensor([0, 99])
    try:
        mbs_ext.step(ddp, opt, (x[a:b], y[a:b]), loss, micro_batch_size=3, indices=indices)
        raised = None
    except Exception as exc:
        raised = type(exc).__name__
    after = model.state_dict()
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    # The ranks still work together afterwards.
    mbs_ext.step(ddp, opt, (x[a:b], y[a:b]), ce, micro_batch_size=3)
    return raised, unchanged


def _switch_mismatch(rank):
    """Rank 1 switched the layers off, rank 0 not: every rank raises, nothing changes."""
    model = mbs_ext.convert_batchnorm(make_model(), across_ranks=True)
    ddp = nn.parallel.DistributedDataParallel(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    mbs_ext.set_batchnorm_across_ranks(ddp, rank == 0)
    x, y = data()
    a, b = rank_rows(rank)
    try:
        mbs_ext.step(ddp, optimizer("sgd", ddp), (x[a:b], y[a:b]), ce, micro_batch_size=3)
        raised = ""
    except ValueError as exc:
        raised = str(exc)
    return raised, all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def _fsdp(rank):
    """FSDP2: the ranks' micro-batches pair up in the agreement FSDP2 already has."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = mbs_ext.convert_batchnorm(make_model(), across_ranks=True)
    mesh = init_device_mesh("cpu", (WORLD,))
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = optimizer("sgd", model)
    x, y = data()
    a, b = rank_rows(rank)
    mbs_ext.step(model, opt, (x[a:b], y[a:b]), ce, micro_batch_size=3)
    state = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
             for n, p in model.named_parameters()}
    state.update({n: b.clone() for n, b in model.named_buffers()})
    return state


# Micro-batch sizes as a token plan cuts them (no row split gives 4, 1, 5), by rank.
UNEVEN = ([4, 1, 5], [2, 2])


def _agreement(rank):
    """The agreement alone (mbs_ext.world.pairing): the global rows of micro-batch j are the
    rows each rank's micro-batch j really holds; only rank 0's layers set ``local_from``."""
    from mbs_ext.world.pairing import Pairing

    out = {}
    for name, local_from in (("threshold", 100 if rank == 0 else None), ("none", None)):
        model = mbs_ext.convert_batchnorm(make_model(), across_ranks=True, local_from=local_from)
        pairing = Pairing.of(list(model.modules()), dist.group.WORLD, WORLD, rank, weighs_after=True)
        padded, total = pairing.agree(float(rank + 1), UNEVEN[rank], torch.device("cpu"))
        out[name] = (padded, float(total), pairing.global_rows)
    return out


def _worker(rank):
    warnings.simplefilter("ignore", mbs_ext.BatchNormWarning)
    out = {name: _scenario(rank, name) for name in SCENARIOS}
    out["mismatch"] = _switch_mismatch(rank)
    out["fsdp"] = _fsdp(rank)
    out["sync"] = _sync_batchnorm(rank)
    out["fail_streaming"] = _failing(rank, "streaming")
    out["fail_checking"] = _failing(rank, "checking")
    out["agreement"] = _agreement(rank)
    return out


@pytest.fixture(scope="module")
def results():
    return run_world(_worker, timeout=240)


# ---- the single-process reference


def split(rows, m):
    k = math.ceil(rows / m)
    return [rows // k + (j < rows % k) for j in range(k)]


def chunks(m, local_from=None, across=True):
    """Per micro-batch j, the row ranges forwarded together (into the global rows)."""
    parts = []
    for r, rows in enumerate(ROWS):
        start = sum(ROWS[:r])
        for j, s in enumerate(split(rows, m)):
            while len(parts) <= j:
                parts.append([])
            parts[j].append((start, start + s))
            start += s
    out = []
    for p in parts:
        together = sum(b - a for a, b in p)
        if across and (local_from is None or together < local_from):
            out.append(p)
        else:
            out.extend([[q] for q in p])
    return out


def reference_step(model, opt, groups):
    """One step over the mini-batch, each group of row ranges forwarded together; running
    statistics committed once from every row each BatchNorm saw."""
    x, y = data()
    seen = {}
    hooks = [bn.register_forward_pre_hook(lambda mod, args: seen.setdefault(mod, []).append(args[0].detach()))
             for bn in model.modules() if isinstance(bn, nn.modules.batchnorm._BatchNorm)]
    saved = {bn: (bn.running_mean.clone(), bn.running_var.clone()) for bn in model.modules()
             if isinstance(bn, nn.modules.batchnorm._BatchNorm) and bn.track_running_stats}
    opt.zero_grad()
    for group in groups:
        idx = torch.cat([torch.arange(a, b) for a, b in group])
        F.cross_entropy(model(x[idx]), y[idx], reduction="sum").div(sum(ROWS)).backward()
    opt.step()
    for h in hooks:
        h.remove()
    with torch.no_grad():
        for bn, inputs in seen.items():
            if not bn.training or not bn.track_running_stats:
                continue
            t = torch.cat(inputs).transpose(0, 1).reshape(bn.num_features, -1)
            rm, rv = saved[bn]
            bn.running_mean.copy_(rm * 0.9 + t.mean(1) * 0.1)
            bn.running_var.copy_(rv * 0.9 + t.var(1, unbiased=True) * 0.1)
            bn.num_batches_tracked.copy_(bn.num_batches_tracked - len(inputs) + 1)


def reference_state(groups):
    """The state of the model after one SGD reference step over ``groups``."""
    model = make_model()
    reference_step(model, optimizer("sgd", model), groups)
    return model.state_dict()


def reference(name):
    m, opt_kind, local_from, switches, evaluating, *track = SCENARIOS[name]
    model = make_model(track=track == [])
    if evaluating:
        for layer in model.modules():
            if isinstance(layer, nn.modules.batchnorm._BatchNorm):
                layer.running_mean.uniform_(-0.5, 0.5)
                layer.eval()
    opt = optimizer(opt_kind, model)
    states = []
    for on in switches:
        reference_step(model, opt, chunks(m, local_from, across=on))
        states.append(copy.deepcopy(model.state_dict()))
    return states


def assert_close(got, want, tol=1e-12):
    for k in want:
        if want[k].is_floating_point():
            err = (got[k] - want[k]).abs().max().item() / max(want[k].abs().max().item(), 1.0)
            assert err <= tol, (k, err)
        else:
            assert torch.equal(got[k], want[k]), k


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_across_ranks_equals_the_reference(results, name):
    want = reference(name)
    for rank in range(WORLD):
        for got, ref in zip(results[rank][name], want):
            if SCENARIOS[name][2] is not None or not SCENARIOS[name][3][0]:
                # Local micro-batches: running statistics are each rank's own (parameters compared).
                ref = {k: v for k, v in ref.items() if "running" not in k and "num_batches" not in k}
            assert_close(got, ref)


@pytest.mark.multiprocess
def test_running_statistics_are_the_same_on_every_rank(results):
    for name in ("m2_sgd", "m3_sgd", "m4_adamw"):
        for k, v in results[0][name][-1].items():
            assert torch.equal(v, results[1][name][-1][k]), (name, k)


@pytest.mark.multiprocess
def test_one_micro_batch_per_rank_is_the_full_batch_step(results):
    assert_close(results[0]["m10_one_each"][0], reference_state([[(0, sum(ROWS))]]))


@pytest.mark.multiprocess
def test_sync_batchnorm_gets_the_same_semantics(results):
    want = reference_state(chunks(3))
    for rank in range(WORLD):
        state, cls = results[rank]["sync"]
        assert cls == "SyncBatchNorm"  # its own class again after the step
        assert_close(state, want)


@pytest.mark.multiprocess
@pytest.mark.parametrize("where", ["streaming", "checking"])
def test_a_failing_rank_makes_every_rank_raise(results, where):
    own = {"streaming": "RuntimeError", "checking": "IndexError"}[where]
    assert results[1][f"fail_{where}"][0] in (own, "ValueError")
    assert results[0][f"fail_{where}"][0] == "PeerFailed"
    assert results[0][f"fail_{where}"][1] and results[1][f"fail_{where}"][1]


@pytest.mark.multiprocess
def test_ranks_whose_switches_differ_all_raise(results):
    for rank in range(WORLD):
        message, unchanged = results[rank]["mismatch"]
        assert "set_batchnorm_across_ranks" in message and "[2, 0]" in message
        assert unchanged


@pytest.mark.multiprocess
def test_fully_sharded_equals_the_reference(results):
    want = reference_state(chunks(3))
    for rank in range(WORLD):
        assert_close(results[rank]["fsdp"], want)


@pytest.mark.multiprocess
def test_the_agreement_sums_the_rows_each_micro_batch_holds(results):
    padded = max(len(s) for s in UNEVEN)
    global_rows = [sum(s[j] for s in UNEVEN if j < len(s)) for j in range(padded)]
    for rank in range(WORLD):
        # One rank's threshold makes every rank sum the rows (none waits alone).
        assert results[rank]["agreement"]["threshold"] == (padded, 3.0, global_rows)
        assert results[rank]["agreement"]["none"] == (padded, 3.0, [])  # no threshold: not summed


def test_one_process_runs_no_collective():
    """No process group: the layers normalize the micro-batch's rows, as the deferred BatchNorm."""
    x, y = data()
    a = mbs_ext.convert_batchnorm(make_model(), across_ranks=True)
    b = mbs_ext.convert_batchnorm(make_model())
    for model in (a, b):
        with pytest.warns(mbs_ext.BatchNormWarning):
            mbs_ext.step(model, optimizer("sgd", model), (x, y), ce, micro_batch_size=6)
    assert_close(a.state_dict(), b.state_dict(), tol=0.0)


def test_convert_batchnorm_checks_local_from():
    with pytest.raises(ValueError, match="local_from"):
        mbs_ext.convert_batchnorm(make_model(), local_from=4)
    with pytest.raises(ValueError, match="local_from"):
        mbs_ext.convert_batchnorm(make_model(), across_ranks=True, local_from=0)
    with pytest.raises(TypeError, match="enabled"):
        mbs_ext.set_batchnorm_across_ranks(make_model(), 1)


def _cuda_sync_batchnorm(rank):
    torch.cuda.set_device(0)
    model = make_model(sync=True).cuda()
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[0])
    opt = optimizer("sgd", ddp)
    x, y = data()
    a, b = rank_rows(rank)
    mbs_ext.step(ddp, opt, (x[a:b], y[a:b]), ce, micro_batch_size=3)
    return {k: v.cpu() for k, v in model.state_dict().items()}


@requires_cuda
@pytest.mark.cuda
@pytest.mark.multiprocess
def test_cuda_ddp_sync_batchnorm_equals_the_reference():
    """Both ranks on one GPU (gloo all-reduces CUDA tensors): DDP wraps nn.SyncBatchNorm there."""
    got = run_world(_cuda_sync_batchnorm, timeout=240)
    model = make_model()
    opt = optimizer("sgd", model)
    reference_step(model, opt, chunks(3))
    for state in got:
        assert_close(state, model.state_dict(), tol=1e-10)
