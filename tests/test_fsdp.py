"""FSDP2 (``fully_shard``) streamed on two gloo processes, against one single-process full-batch step.

Rank 0 holds 10 rows and rank 1 holds 7, at ``micro_batch_size=3`` (4 and 3 micro-batches:
rank 1 runs one zero-weight micro-batch so that FSDP's all-gathers and reduce-scatters
pair up). Two AdamW steps in float64 equal two single-process steps on all 17 rows to
1e-12, with token counts and with sample counts, reduce-scattering every micro-batch
(``fsdp_accumulate="sharded"``) or once at the end (``"unsharded"``), eagerly and under
``torch.compile``; float32 to 1e-6; bf16 compute with float32 reduction (FSDP's
``MixedPrecisionPolicy``) to bf16 precision; clipping by the global norm; a non-finite loss on one
rank skips the step on both; a batch refused on one rank makes both raise; FSDP's own
reduction settings come back after each step. Every case runs under the harness's watchdog.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from common import MLP, TinyLM, lm_loss, rel_err, token_count
from ddp_harness import WORLD, run_world

import mbs_ext

# Several processes (gloo ranks): out of the quick suite, run by CI (docs/testing.md).
pytestmark = pytest.mark.multiprocess

ROWS = (10, 7)
M = 3
STEPS = 2
COMPILE_BACKEND = os.environ.get("MBS_TEST_COMPILE_BACKEND", "inductor")


def mse(model, batch):
    return F.mse_loss(model(batch[0]), batch[1])


def data(kind, dtype=torch.float64):
    g = torch.Generator().manual_seed(3)
    n = sum(ROWS)
    if kind == "tokens":
        ids = torch.randint(0, 11, (n, 6), generator=g)
        keep = torch.randint(1, 7, (n, 1), generator=g)
        return {"ids": ids, "labels": torch.where(torch.arange(6) < keep, torch.roll(ids, -1, 1), -100)}
    return torch.randn(n, 4, generator=g, dtype=dtype), torch.randn(n, 2, generator=g, dtype=dtype)


def rows_of(batch, rank):
    lo = sum(ROWS[:rank])
    if isinstance(batch, dict):
        return {k: v[lo:lo + ROWS[rank]] for k, v in batch.items()}
    return tuple(v[lo:lo + ROWS[rank]] for v in batch)


def case(kind, dtype=torch.float64):
    torch.manual_seed(0)
    if kind == "tokens":
        return TinyLM().to(dtype), lm_loss, token_count
    return MLP().to(dtype), mse, "samples"


def shard(model, bf16=False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    kw = {"mp_policy": mp} if mp is not None else {}
    for child in model.children():
        fully_shard(child, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def full(p):
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def _settings(model):
    return [(g.gradient_divide_factor, g.force_sum_reduction_for_comms, g.reduce_grads)
            for m in model.modules() if hasattr(m, "_get_fsdp_state")
            for g in m._get_fsdp_state()._fsdp_param_groups]


def _train(rank, kind, mode, compiled, dtype=torch.float64, max_grad_norm=None, bf16=False):
    model, loss_fn, normalize = case(kind, dtype)
    shard(model, bf16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stepped = torch.compile(model, backend=COMPILE_BACKEND) if compiled else model
    before = _settings(model)
    batch = rows_of(data(kind, dtype), rank)
    results = []
    for _ in range(STEPS):
        results.append(mbs_ext.step(stepped, opt, batch, loss_fn, micro_batch_size=M, normalize=normalize,
                                    fsdp_accumulate=mode, max_grad_norm=max_grad_norm))
    return {"params": [full(p).detach().clone() for p in model.parameters()],
            "losses": [r.loss for r in results], "num_micro_batches": results[0].num_micro_batches,
            "norms": [r.grad_norm for r in results], "settings_kept": _settings(model) == before}


EXACT = [(kind, mode, compiled) for kind in ("tokens", "samples") for mode in ("sharded", "unsharded")
         for compiled in (False, True) if not (compiled and mode == "unsharded")]


def _exact_cases(rank):
    out = {c: _train(rank, *c) for c in EXACT}
    out["float32"] = _train(rank, "samples", "sharded", False, dtype=torch.float32)
    out["clipped"] = _train(rank, "tokens", "sharded", False, max_grad_norm=0.05)
    out["bf16"] = _train(rank, "samples", "sharded", False, dtype=torch.float32, bf16=True)
    return out


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory):
    return run_world(_exact_cases, timeout=300, out_dir=tmp_path_factory.mktemp("fsdp"))


def reference(kind, dtype=torch.float64, max_grad_norm=None):
    model, loss_fn, _ = case(kind, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = data(kind, dtype)
    losses, norms = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        if max_grad_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)))
        opt.step()
        losses.append(float(loss))
    return [p.detach() for p in model.parameters()], losses, norms


@pytest.mark.parametrize(("kind", "mode", "compiled"), EXACT)
def test_fully_sharded_equals_one_full_batch_step(fsdp_results, kind, mode, compiled):
    ref, ref_losses, _ = reference(kind)
    for rank, res in enumerate(fsdp_results):
        got = res[kind, mode, compiled]
        assert got["num_micro_batches"] == (4, 3)[rank]
        assert got["settings_kept"]
        for p, q in zip(got["params"], ref):
            assert rel_err(p, q) <= 1e-12, (rank, rel_err(p, q))
        assert got["losses"] == pytest.approx(ref_losses, rel=1e-12)  # the global loss on every rank


def test_fully_sharded_float32(fsdp_results):
    ref, _, _ = reference("samples", torch.float32)
    for res in fsdp_results:
        for p, q in zip(res["float32"]["params"], ref):
            assert rel_err(p, q) <= 1e-6


def test_fully_sharded_bf16_compute_with_float32_reduction(fsdp_results):
    """MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32): the forward and backward in
    bf16, gradients reduced and kept in float32; the step equals the float32 one to bf16 precision."""
    ref, ref_losses, _ = reference("samples", torch.float32)
    for res in fsdp_results:
        assert res["bf16"]["losses"] == pytest.approx(ref_losses, rel=2e-2)
        for p, q in zip(res["bf16"]["params"], ref):
            assert p.dtype == torch.float32 and rel_err(p, q) <= 1e-2


def test_fully_sharded_clips_by_the_global_norm(fsdp_results):
    ref, _, ref_norms = reference("tokens", max_grad_norm=0.05)
    assert ref_norms[0] > 0.05  # the clip bites
    for res in fsdp_results:
        assert res["clipped"]["norms"] == pytest.approx(ref_norms, rel=1e-12)
        for p, q in zip(res["clipped"]["params"], ref):
            assert rel_err(p, q) <= 1e-12


def _faults(rank):
    import warnings

    out = {}
    model, loss_fn, normalize = case("tokens")
    shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = rows_of(data("tokens"), rank)
    before = [full(p).detach().clone() for p in model.parameters()]

    def nan_on_rank_1(m, mb):
        loss = loss_fn(m, mb)
        return loss * float("nan") if rank == 1 else loss

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = mbs_ext.step(model, opt, batch, nan_on_rank_1, micro_batch_size=M, normalize=normalize)
    out["skipped"] = res.skipped
    out["warned"] = any("non-finite" in str(w.message) for w in caught)
    out["unchanged_after_skip"] = all(torch.equal(full(p), b) for p, b in zip(model.parameters(), before))
    opt.zero_grad()
    bad = dict(batch, labels=batch["labels"][:-1]) if rank == 1 else batch
    try:
        mbs_ext.step(model, opt, bad, loss_fn, micro_batch_size=M, normalize=normalize)
        out["raised"] = None
    except Exception as exc:  # noqa: BLE001 - the test records what each rank raised
        out["raised"] = (type(exc).__name__, str(exc))
    out["unchanged_after_error"] = all(torch.equal(full(p), b) for p, b in zip(model.parameters(), before))
    out["no_grads"] = all(p.grad is None for p in model.parameters())
    return out


def test_fully_sharded_ranks_skip_and_fail_together(tmp_path):
    results = run_world(_faults, timeout=120, out_dir=tmp_path)
    for rank, res in enumerate(results):
        assert res["skipped"] and res["warned"] and res["unchanged_after_skip"], (rank, res)
        assert res["unchanged_after_error"] and res["no_grads"], (rank, res)
    assert results[1]["raised"][0] == "ValueError"
    assert results[0]["raised"][0] == "PeerFailed" and "rank 1 raised before its first micro-batch" in \
        results[0]["raised"][1]


# name: (failing rank, the loss call that raises on it before calling the model, the error,
# fsdp_accumulate, compiled, a later loss call that raises after the model's forward or None).
# Rank 1 has 3 micro-batches and runs a 4th of zero weight (call 3); rank 0 has 4.
IN_STREAM = {
    "raise_at_0": (1, 0, ValueError, "sharded", False, None),
    "raise_at_1": (1, 1, ValueError, "sharded", False, None),
    "raise_at_last": (1, 2, ValueError, "sharded", False, None),
    "raise_at_padding": (1, 3, ValueError, "sharded", False, None),
    "oom_at_1": (1, 1, torch.OutOfMemoryError, "sharded", False, None),
    "rank0_raise_at_last": (0, 3, ValueError, "sharded", False, None),
    "unsharded_raise_at_1": (1, 1, ValueError, "unsharded", False, None),
    "unsharded_raise_at_last": (1, 2, ValueError, "unsharded", False, None),
    "compiled_raise_at_1": (1, 1, ValueError, "sharded", True, None),
    # catching up, the zero-weight rerun of micro-batch 1 fails after the forward: its backward
    # then runs through the model's outputs
    "raise_at_1_and_in_catch_up": (1, 1, ValueError, "sharded", False, 2),
}


def _local_state(model, opt):
    """Bit-exact copies of this rank's shards: parameters and optimizer state (a step replaces
    ``.grad``, failed or not)."""
    def local(t):
        return t.to_local().clone() if hasattr(t, "to_local") else t.clone()
    return ([local(p.detach()) for p in model.parameters()],
            [{k: local(v) if isinstance(v, torch.Tensor) else v for k, v in st.items()}
             for st in opt.state.values()])


def _same(a, b):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _in_stream_faults(rank):
    import time

    out = {}
    batch = rows_of(data("tokens"), rank)
    for name, (bad_rank, at, exc_type, mode, compiled, again) in IN_STREAM.items():
        model, loss_fn, normalize = case("tokens")
        shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        stepped = torch.compile(model, backend=COMPILE_BACKEND) if compiled else model
        kw = {"micro_batch_size": M, "normalize": normalize, "fsdp_accumulate": mode}
        mbs_ext.step(stepped, opt, batch, loss_fn, **kw)  # AdamW has state
        calls = [0]

        def failing(m, mb, calls=calls, bad_rank=bad_rank, at=at, exc_type=exc_type, again=again, loss_fn=loss_fn):
            calls[0] += 1
            if rank == bad_rank and calls[0] - 1 == at:
                raise exc_type(f"injected on rank {bad_rank} at loss call {at}")
            loss = loss_fn(m, mb)
            if rank == bad_rank and calls[0] - 1 == again:
                raise ValueError(f"injected on rank {bad_rank} after the forward of loss call {again}")
            return loss

        before = _local_state(model, opt)
        t0 = time.monotonic()
        try:
            mbs_ext.step(stepped, opt, batch, failing, **kw)
            raised = None
        except Exception as exc:  # noqa: BLE001 - the test records what each rank raised
            raised = (type(exc).__name__, str(exc), "\n".join(getattr(exc, "__notes__", [])))
        seconds = time.monotonic() - t0
        unchanged = _same(_local_state(model, opt), before)
        mbs_ext.step(stepped, opt, batch, loss_fn, **kw)  # the group and FSDP's state are intact
        out[name] = {"raised": raised, "seconds": seconds, "unchanged": unchanged,
                     "params": [full(p).detach().clone() for p in model.parameters()]}
    return out


@pytest.fixture(scope="module")
def in_stream_results(tmp_path_factory):
    return run_world(_in_stream_faults, timeout=300, out_dir=tmp_path_factory.mktemp("fsdp_faults"))


@pytest.mark.parametrize("name", list(IN_STREAM))
def test_fully_sharded_ranks_fail_together_mid_stream(in_stream_results, name):
    """A rank failing at any micro-batch before its forward (or at a zero-weight one) runs the
    rest at zero weight, so that FSDP's collectives pair up, and shares its failure after the
    pass: every rank raises within seconds, nothing changed, and the next step is exact."""
    bad_rank, at, exc_type, *_ = IN_STREAM[name]
    own, peer = in_stream_results[bad_rank][name], in_stream_results[1 - bad_rank][name]
    assert own["raised"] is not None and peer["raised"] is not None, (own, peer)
    assert own["raised"][0] == exc_type.__name__, own["raised"]
    assert "every rank undid the step" in own["raised"][2], own["raised"]
    assert peer["raised"][0] == "PeerFailed", peer["raised"]
    what = "ran out of memory" if exc_type is torch.OutOfMemoryError else "raised"
    assert f"rank {bad_rank} {what} at micro-batch {at}" in peer["raised"][1], peer["raised"]
    ref, _, _ = reference("tokens")  # two good steps on all 17 rows: the failed one in between did nothing
    for res in (own, peer):
        assert res["seconds"] < 30 and res["unchanged"], (name, res["seconds"])
        for p, q in zip(res["params"], ref):
            assert rel_err(p, q) <= 1e-12, (name, rel_err(p, q))


def _refusals(rank):
    model, loss_fn, normalize = case("tokens")
    shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = rows_of(data("tokens"), rank)
    out = {}
    for name, kw in {"auto": {"micro_batch_size": "auto", "memory_budget": 2**30},
                     "scaler": {"micro_batch_size": M, "scaler": torch.amp.GradScaler("cpu")}}.items():
        try:
            mbs_ext.step(model, opt, batch, loss_fn, normalize=normalize, **kw)
            out[name] = None
        except ValueError as exc:
            out[name] = str(exc)
    return out


def test_fully_sharded_refusals_name_what_works(tmp_path):
    for res in run_world(_refusals, timeout=90, out_dir=tmp_path):
        assert "pass an int" in res["auto"], res
        assert "MixedPrecisionPolicy" in res["scaler"], res


def _fused_op_on_shards(rank):
    model, loss_fn, normalize = case("samples")
    shard(model)
    mse(model, rows_of(data("samples"), rank)).backward()
    grads = [p.grad for p in model.parameters()]
    accs = [torch.zeros_like(g.to_local()) for g in grads]
    try:
        mbs_ext.scale_accumulate_([torch.zeros_like(g) for g in grads], grads, 2.0)
        refused = None
    except TypeError as exc:
        refused = str(exc)
    mbs_ext.scale_accumulate_(accs, [g.to_local() for g in grads], 2.0)  # what the message says works
    return {"refused": refused, "added": all(torch.equal(a, 2.0 * g.to_local()) for a, g in zip(accs, grads))}


def test_fused_op_refuses_dtensors_and_takes_their_shards(tmp_path):
    for res in run_world(_fused_op_on_shards, timeout=60, out_dir=tmp_path):
        assert res["refused"] and "to_local()" in res["refused"] and res["added"], res


def _collectives(rank):
    """dist.all_reduce calls and host reads (Tensor.tolist) of one warm step, at two sizes."""
    import torch.distributed as dist

    calls = {"all_reduce": 0, "tolist": 0}
    real_all_reduce, real_tolist = dist.all_reduce, torch.Tensor.tolist

    def counting_all_reduce(*args, **kwargs):
        calls["all_reduce"] += 1
        return real_all_reduce(*args, **kwargs)

    def counting_tolist(self):
        calls["tolist"] += 1
        return real_tolist(self)

    model, loss_fn, normalize = case("tokens")
    shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    batch = rows_of(data("tokens"), rank)
    out = {}
    dist.all_reduce, torch.Tensor.tolist = counting_all_reduce, counting_tolist
    try:
        for m in (5, 1):  # 2 and 10 micro-batches on rank 0, 2 and 7 on rank 1
            mbs_ext.step(model, opt, batch, loss_fn, micro_batch_size=m, normalize=normalize)  # warm
            calls.update(all_reduce=0, tolist=0)
            res = mbs_ext.step(model, opt, batch, loss_fn, micro_batch_size=m, normalize=normalize)
            out[m] = dict(calls, num_micro_batches=res.num_micro_batches)
    finally:
        dist.all_reduce, torch.Tensor.tolist = real_all_reduce, real_tolist
    return out


def test_fully_sharded_step_adds_two_small_all_reduces_and_two_reads(tmp_path):
    """Besides FSDP's own all-gathers and reduce-scatters, a step makes two small all-reduces
    (before the first micro-batch: the count and the total; after the last: loss, flags,
    failures) and two host reads (the agreed count, the finish), whatever the micro-batches."""
    for rank, res in enumerate(run_world(_collectives, timeout=90, out_dir=tmp_path)):
        assert [res[m]["num_micro_batches"] for m in (5, 1)] == [2, (10, 7)[rank]]
        for m in (5, 1):
            assert res[m]["all_reduce"] == 2 and res[m]["tolist"] == 2, (rank, m, res[m])
