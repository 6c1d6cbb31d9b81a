"""CachedLoss: a loss that couples the rows (InfoNCE with in-batch negatives) streamed exactly.

The reference is one full-batch ``loss(model, encode(model, batch)).backward()`` step of an
identical float64 model; plain streaming of the same loss per micro-batch is shown to be
wrong, so the comparison can fail.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from common import assert_bit_identical, rel_err, snapshot
from torch import nn

import mbs_ext

N, D_IN, D = 21, 6, 5  # 21 rows: uneven splits for every micro-batch size below


class TwoTower(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.query = nn.Sequential(nn.Linear(D_IN, 12), nn.Tanh(), nn.Dropout(dropout), nn.Linear(12, D))
        self.doc = nn.Sequential(nn.Linear(D_IN, 12), nn.Tanh(), nn.Linear(12, D))
        self.log_temperature = nn.Parameter(torch.tensor(0.3))  # used by the loss only
        self.double()


def encode(model: TwoTower, mb: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return model.query(mb["q"]), model.doc(mb["d"])


def info_nce(model: TwoTower, encoded: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    q, d = (F.normalize(t, dim=1) for t in encoded)
    logits = q @ d.t() / model.log_temperature.exp()
    target = torch.arange(q.shape[0], device=q.device)
    return (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target)) / 2


LOSS = mbs_ext.CachedLoss(encode, info_nce)


def pairs(n: int = N, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, D_IN, generator=g, dtype=torch.float64)
    return {"q": q, "d": q + 0.3 * torch.randn(n, D_IN, generator=g, dtype=torch.float64)}


def full_batch_step(model: nn.Module, opt: torch.optim.Optimizer, batch: dict) -> float:
    opt.zero_grad(set_to_none=True)
    loss = info_nce(model, encode(model, batch))
    loss.backward()
    opt.step()
    return loss.item()


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def assert_same_grads_and_params(model: nn.Module, ref: nn.Module, tol: float = 1e-12) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad) <= tol, name
        assert rel_err(p, q) <= tol, name


@pytest.mark.parametrize("m", [1, 4, 8, N])
def test_step_equals_the_full_batch_step(m):
    model, ref = TwoTower(), TwoTower()
    opt, ropt = sgd(model), sgd(ref)
    for seed in (1, 2):  # twice: momentum carries the first step into the second
        batch = pairs(seed=seed)
        ref_loss = full_batch_step(ref, ropt, batch)
        res = mbs_ext.step(model, opt, batch, LOSS, micro_batch_size=m)
        assert res.loss == pytest.approx(ref_loss, rel=1e-12)
        assert res.num_micro_batches == -(-N // m) and not res.skipped
        assert_same_grads_and_params(model, ref)
    assert model.log_temperature.grad is not None  # the loss's own parameter, counted once


def test_auto_plans_the_micro_batch_from_the_memory_budget_and_stays_exact():
    """micro_batch_size="auto" plans pass 3 into memory_budget less the cached encodings and their
    gradients: a larger budget plans larger micro-batches, each step is the full batch's, and a
    budget the encodings alone exceed is refused naming memory_budget."""
    planned = {}
    for budget in (9_000, 12_000, 10**6):
        model, ref = TwoTower(), TwoTower()
        opt, ref_opt = sgd(model), sgd(ref)
        r = mbs_ext.step(model, opt, pairs(), LOSS, micro_batch_size="auto", memory_budget=budget)
        assert r.loss == pytest.approx(full_batch_step(ref, ref_opt, pairs()), rel=1e-12)
        assert_same_grads_and_params(model, ref)
        planned[budget] = r.micro_batch_size
    assert planned[9_000] < planned[12_000] < planned[10**6] == N
    model = TwoTower()
    with pytest.raises(ValueError, match="memory_budget=2000 bytes is too small for CachedLoss"):
        mbs_ext.step(model, sgd(model), pairs(), LOSS, micro_batch_size="auto", memory_budget=2_000)
    with pytest.raises(ValueError, match="is too small") as info:
        mbs_ext.step(model, sgd(model), pairs(), LOSS, micro_batch_size="auto", memory_budget=6_000)
    assert "memory_budget=6000 less about" in "\n".join(info.value.__notes__)


def test_out_of_memory_in_the_streamed_pass_backs_off_and_stays_exact():
    """Pass 3 (with grad) runs out of memory above 3 rows, pass 1 (no grad) does not: the step's
    back-off redoes pass 3 at the largest size that fits, and the step is the full batch's."""
    def tight_encode(model, mb):
        if torch.is_grad_enabled() and len(mb["q"]) > 3:
            raise torch.OutOfMemoryError(f"injected: {len(mb['q'])} rows with grad > 3")
        return encode(model, mb)

    model, ref = TwoTower(), TwoTower()
    opt, ref_opt = sgd(model), sgd(ref)
    with pytest.warns(RuntimeWarning, match="out of memory at micro_batch_size=8; redoing the step with "
                                            "micro_batch_size=3"):
        r = mbs_ext.step(model, opt, pairs(), mbs_ext.CachedLoss(tight_encode, info_nce), micro_batch_size=8)
    assert r.micro_batch_size == 3
    assert r.loss == pytest.approx(full_batch_step(ref, ref_opt, pairs()), rel=1e-12)
    assert_same_grads_and_params(model, ref)


def test_plain_streaming_of_the_same_loss_is_what_cached_loss_fixes():
    """The per-micro-batch InfoNCE (each micro-batch its own negatives) is far from the
    full batch: the reason CachedLoss exists, and proof this comparison can fail."""
    model, ref = TwoTower(), TwoTower()
    full_batch_step(ref, sgd(ref), pairs())
    mbs_ext.accumulate(model, pairs(), lambda mod, mb: info_nce(mod, encode(mod, mb)), micro_batch_size=4)
    errors = [rel_err(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters())]
    assert max(errors) > 0.1


def test_accumulate_leaves_the_full_batch_gradient_in_grad():
    model, ref = TwoTower(), TwoTower()
    loss = info_nce(ref, encode(ref, pairs()))
    loss.backward()
    res = mbs_ext.accumulate(model, pairs(), LOSS, micro_batch_size=5)
    assert res.loss == pytest.approx(loss.item(), rel=1e-12)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad) <= 1e-12


def test_indices_gather_rows_and_repeated_rows_count_twice():
    dataset = pairs(n=30, seed=4)
    indices = torch.tensor([3, 7, 7, 29, 0, 12, 3, 18, 5, 21, 9, 26, 14])
    model, ref = TwoTower(), TwoTower()
    opt, ropt = sgd(model), sgd(ref)
    ref_loss = full_batch_step(ref, ropt, {k: v[indices] for k, v in dataset.items()})
    res = mbs_ext.step(model, opt, dataset, LOSS, micro_batch_size=4, indices=indices)
    assert res.loss == pytest.approx(ref_loss, rel=1e-12)
    assert_same_grads_and_params(model, ref)


def test_dropout_draws_the_same_numbers_in_both_forwards():
    """With dropout, the reference keeps one graph over the micro-batches' encodings drawn in
    order from the same generator state: pass 3 must replay pass 1's draws to match it."""
    model, ref = TwoTower(dropout=0.5), TwoTower(dropout=0.5)
    batch, m = pairs(), 6
    torch.manual_seed(123)
    bounds = [(0, 6), (6, 11), (11, 16), (16, 21)]  # the balanced split of 21 rows at 6
    parts = [encode(ref, {k: v[a:b] for k, v in batch.items()}) for a, b in bounds]
    info_nce(ref, tuple(torch.cat(t) for t in zip(*parts))).backward()
    torch.manual_seed(123)
    mbs_ext.accumulate(model, batch, LOSS, micro_batch_size=m)
    assert mbs_ext.diagnostics.split_sizes(N, m) == [6, 5, 5, 5]
    for p, q in zip(model.parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad) <= 1e-12


def test_a_host_batch_streams_to_the_models_device_with_dropout_and_repeated_rows(device):
    """The model on ``device`` (CUDA where there is one), the mini-batch on the host: the ring
    stages both passes' micro-batches, rows gathered by ``indices=`` (repeats included), and
    pass 3 replays pass 1's draws of the device's generator. The reference is one graph over the
    micro-batches' encodings drawn in order on the device from the same seed."""
    model, ref = TwoTower(dropout=0.5).to(device), TwoTower(dropout=0.5).to(device)
    batch, m = pairs(), 6
    indices = torch.tensor([3, 3, 20, 0, 7, 7, 7, 12, 1, 19, 5, 5, 16, 2, 9, 11, 4])
    rows = {k: v[indices].to(device) for k, v in batch.items()}
    torch.manual_seed(321)
    bounds = [(0, 6), (6, 12), (12, 17)]  # the balanced split of 17 rows at 6
    parts = [encode(ref, {k: v[a:b] for k, v in rows.items()}) for a, b in bounds]
    ref_loss = info_nce(ref, tuple(torch.cat(t) for t in zip(*parts)))
    ref_loss.backward()
    torch.manual_seed(321)
    res = mbs_ext.accumulate(model, batch, LOSS, micro_batch_size=m, indices=indices)
    assert mbs_ext.diagnostics.split_sizes(len(indices), m) == [6, 6, 5]
    assert res.loss == pytest.approx(ref_loss.item(), rel=1e-12)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.grad.device.type == torch.device(device).type and rel_err(p.grad, q.grad) <= 1e-12


@pytest.mark.parametrize("where", ["encode", "loss", "second_pass"])
def test_an_error_in_any_pass_changes_nothing(where):
    model = TwoTower(dropout=0.2)
    opt = sgd(model)
    mbs_ext.step(model, opt, pairs(), LOSS, micro_batch_size=4)  # momentum state exists
    calls = [0]

    def bad_encode(mod, mb):
        calls[0] += 1
        if (where == "encode" and calls[0] == 3) or (where == "second_pass" and calls[0] == 6 + 4):
            raise RuntimeError(f"injected in {where}")
        return encode(mod, mb)

    def bad_loss(mod, enc):
        if where == "loss":
            raise RuntimeError("injected in loss")
        return info_nce(mod, enc)

    before, rng = snapshot(model, opt), torch.get_rng_state()
    with pytest.raises(RuntimeError, match=f"injected in {where}"):
        mbs_ext.step(model, opt, pairs(seed=5), mbs_ext.CachedLoss(bad_encode, bad_loss), micro_batch_size=4)
    assert_bit_identical(snapshot(model, opt), before)
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_non_finite_mini_batch_loss_follows_the_non_finite_policy():
    model = TwoTower()
    opt = sgd(model)
    before = snapshot(model, opt)
    nan_loss = mbs_ext.CachedLoss(encode, lambda mod, enc: info_nce(mod, enc) * float("nan"))
    with pytest.warns(RuntimeWarning, match="skipped"):
        res = mbs_ext.step(model, opt, pairs(), nan_loss, micro_batch_size=4)
    assert res.skipped
    assert_bit_identical(snapshot(model, opt), before)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"micro_batch_tokens": 64}, "micro_batch_tokens is not supported by CachedLoss"),
    ({"micro_batch_size": 4, "normalize": "samples"}, "normalize does not apply to CachedLoss"),
])
def test_what_cached_loss_does_not_do_is_refused_before_anything_runs(kwargs, match):
    model = TwoTower()
    opt = sgd(model)
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match=match):
        mbs_ext.step(model, opt, pairs(), LOSS, **kwargs)
    assert_bit_identical(snapshot(model, opt), before)


def test_cached_loss_is_not_a_per_micro_batch_loss():
    with pytest.raises(TypeError, match="pass it as loss_fn"):
        LOSS(TwoTower(), pairs())
    with pytest.raises(TypeError, match="encode must be callable"):
        mbs_ext.CachedLoss(None, info_nce)


def test_cached_loss_names_the_signature_its_callables_need():
    """A one-argument encode or loss (the per-batch habit) is named at construction, with the fix."""
    with pytest.raises(TypeError, match=r"encode must take two arguments, encode\(model, micro_batch\); "
                                        r"<lambda> takes \(mb\): write it as lambda model, micro_batch"):
        mbs_ext.CachedLoss(lambda mb: mb, info_nce)
    with pytest.raises(TypeError, match=r"loss must take two arguments, loss\(model, encodings\)"):
        mbs_ext.CachedLoss(lambda model, mb: model(mb), lambda enc: enc.sum())
    assert mbs_ext.CachedLoss(lambda model, mb, *rest: mb, lambda *args: args[1]) is not None  # binds: accepted


def test_forward_concatenates_micro_batch_outputs_in_batch_order():
    model = TwoTower(dropout=0.0)
    batch = pairs(n=30)
    indices = torch.tensor([4, 4, 29, 0, 17, 8, 22])
    with torch.no_grad():
        want = encode(model, batch)
        want_idx = encode(model, {k: v[indices] for k, v in batch.items()})
    got = mbs_ext.forward(model, batch, encode, micro_batch_size=7)
    got_idx = mbs_ext.forward(model, batch, encode, micro_batch_size=3, indices=indices)
    for a, b in zip(got + got_idx, want + want_idx):
        assert rel_err(a, b) <= 1e-13 and not a.requires_grad  # sub-batch matmuls round alike, not bit-alike
    with pytest.raises(ValueError, match="micro_batch_size must be an int >= 1 or 'auto'"):
        mbs_ext.forward(model, batch, encode, micro_batch_size=0)
    with pytest.raises(ValueError, match="needs memory_budget"):  # "auto" on the CPU: no free memory to read
        mbs_ext.forward(model, batch, encode, micro_batch_size="auto")
    with pytest.raises(ValueError, match="memory_budget is what micro_batch_size='auto' plans for"):
        mbs_ext.forward(model, batch, encode, micro_batch_size=7, memory_budget=10**6)


def test_forward_auto_fits_the_memory_budget_and_plans_more_rows_than_a_training_step():
    """micro_batch_size="auto" for the no-grad forward: the outputs equal one full forward, the
    whole call's peak of live tensor bytes (PeakTracker around it, the outputs and their
    concatenation included) stays within the budget, a larger budget plans more rows, and the
    training step's planner at the same budget fits fewer (it keeps activations for backward)."""
    from mbs_ext.diagnostics import PeakTracker

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4)).double()
    x = torch.randn(600, 32, dtype=torch.float64)
    fn = lambda m, mb: m(mb)  # noqa: E731
    with torch.no_grad():
        want = model(x)
    planned = {}
    for budget in (120_000, 400_000, 1_500_000):
        with PeakTracker() as tracker:
            got = mbs_ext.forward(model, x, fn, micro_batch_size="auto", memory_budget=budget)
        assert rel_err(got, want) <= 1e-13 and not got.requires_grad
        assert tracker.peak <= budget
        planned[budget] = mbs_ext.plan_forward(model, x, fn, budget)
    assert planned[120_000] < planned[400_000] < planned[1_500_000]
    rows = torch.tensor([5, 5, 599, 0, 42] * 40)  # gathered rows, repeats included
    got = mbs_ext.forward(model, x, fn, micro_batch_size="auto", memory_budget=400_000, indices=rows)
    assert rel_err(got, want[rows]) <= 1e-13
    step_plan = mbs_ext.plan_micro_batch(model, (x, torch.zeros(600, 4, dtype=torch.float64)), nn.MSELoss(),
                                         1_500_000)
    assert step_plan.micro_batch_size < planned[1_500_000]
    with pytest.raises(ValueError, match="memory_budget=20000 bytes is too small for mbs_ext.forward"):
        mbs_ext.forward(model, x, fn, micro_batch_size="auto", memory_budget=20_000)


def test_the_model_is_unchanged_by_the_first_two_passes_when_the_step_is_refused_later():
    """A copy stepped by CachedLoss and one stepped by the full batch stay equal over three
    steps with Adam (state, bias corrections): nothing of passes 1 and 2 leaks into the step."""
    model, ref = TwoTower(), copy.deepcopy(TwoTower())
    opt, ropt = torch.optim.Adam(model.parameters(), lr=1e-2), torch.optim.Adam(ref.parameters(), lr=1e-2)
    for seed in (1, 2, 3):
        full_batch_step(ref, ropt, pairs(seed=seed))
        mbs_ext.step(model, opt, pairs(seed=seed), LOSS, micro_batch_size=6)
    assert_same_grads_and_params(model, ref, tol=1e-10)


# --- check_streamable -------------------------------------------------------------------------


def test_check_streamable_flags_in_batch_negatives_and_names_cached_loss():
    model = TwoTower()
    before, rng = snapshot(model), torch.get_rng_state()
    with pytest.raises(ValueError, match="couples the rows.*CachedLoss"):
        mbs_ext.check_streamable(model, pairs(), lambda mod, mb: info_nce(mod, encode(mod, mb)), micro_batch_size=4)
    assert_bit_identical(snapshot(model), before)
    assert torch.equal(torch.get_rng_state(), rng) and all(p.grad is None for p in model.parameters())
    mbs_ext.check_streamable(model, pairs(), LOSS, micro_batch_size=4)  # the fix passes


@pytest.mark.parametrize("loss", [nn.CrossEntropyLoss(), nn.MSELoss()], ids=["cross_entropy", "mse"])
def test_check_streamable_passes_losses_that_add_up_over_rows(loss):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D_IN, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 4))
    g = torch.Generator().manual_seed(2)
    x = torch.randn(40, D_IN, generator=g)
    classes = isinstance(loss, nn.CrossEntropyLoss)
    y = torch.randint(0, 4, (40,), generator=g) if classes else torch.randn(40, 4, generator=g)
    before = snapshot(model)
    mbs_ext.check_streamable(model, (x, y), loss, micro_batch_size=8)
    assert_bit_identical(snapshot(model), before)


def test_check_streamable_names_batchnorm_when_it_is_the_cause():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D_IN, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    g = torch.Generator().manual_seed(3)
    before = snapshot(model)
    with pytest.raises(ValueError, match="BatchNorm"):
        mbs_ext.check_streamable(model, (torch.randn(32, D_IN, generator=g), torch.randn(32, 1, generator=g)),
                                 nn.MSELoss(), micro_batch_size=8)
    assert_bit_identical(snapshot(model), before)  # running statistics included


# ---- across ranks: two gloo ranks vs one process on all their rows

RANK_ROWS = (13, 8)  # rank 0 streams rows 0..12 of pairs(), rank 1 rows 13..20


class Towers(TwoTower):
    """TwoTower with a forward, so that DDP's own forward runs in both streamed passes."""

    def forward(self, q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.query(q), self.doc(d)


def encode_forward(model: nn.Module, mb: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return model(mb["q"], mb["d"])


def info_nce_wrapped(model: nn.Module, encoded: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return info_nce(getattr(model, "module", model), encoded)


RANKS_LOSS = mbs_ext.CachedLoss(encode_forward, info_nce_wrapped)


def _rank_batch(rank: int, seed: int = 1) -> dict:
    start = sum(RANK_ROWS[:rank])
    return {k: v[start : start + RANK_ROWS[rank]] for k, v in pairs(seed=seed).items()}


def _ranks_steps(rank: int, wrapper: str) -> dict:
    """``ddp_own_encode``: the one-process ``LOSS`` (``model.query(...)``) under DDP, as the docs write it."""
    import torch.distributed as dist

    model = Towers(dropout=0.0)
    stepped = nn.parallel.DistributedDataParallel(model) if wrapper.startswith("ddp") else model
    group = dist.group.WORLD if wrapper == "process_group" else None
    opt = sgd(stepped)
    loss = LOSS if wrapper == "ddp_own_encode" else RANKS_LOSS
    losses = [mbs_ext.step(stepped, opt, _rank_batch(rank, seed), loss, micro_batch_size=3,
                           process_group=group).loss for seed in (1, 2)]
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _ranks_failure(rank: int, where: str) -> dict:
    """Rank 1 fails in ``where``; then a step the ranks take together again."""
    model = Towers()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = sgd(ddp)
    mbs_ext.step(ddp, opt, _rank_batch(rank), RANKS_LOSS, micro_batch_size=3)  # momentum state exists
    before = snapshot(model, opt)
    calls = [0]

    def bad_encode(mod, mb):
        calls[0] += 1
        if rank == 1 and where == "encode" and calls[0] == 2:
            raise RuntimeError("injected in encode")
        return encode_forward(mod, mb)

    def bad_loss(mod, enc):
        if rank == 1 and where == "loss":
            raise RuntimeError("injected in loss")
        return info_nce_wrapped(mod, enc)

    bad_rows = torch.tensor([0, 99]) if rank == 1 and where == "check" else None  # row 99: out of range
    try:
        mbs_ext.step(ddp, opt, _rank_batch(rank, 5), mbs_ext.CachedLoss(bad_encode, bad_loss), micro_batch_size=3,
                     indices=bad_rows)
        raised = None
    except Exception as exc:
        raised = (type(exc).__name__, str(exc))
    unchanged = snapshot(model, opt)
    try:
        assert_bit_identical(unchanged, before)
        same = True
    except AssertionError:
        same = False
    mbs_ext.step(ddp, opt, _rank_batch(rank, 2), RANKS_LOSS, micro_batch_size=3)  # together again
    return {"raised": raised, "unchanged": same}


def _ranks_fsdp(rank: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = Towers()
    model.log_temperature = nn.Parameter(model.log_temperature.detach().reshape(1))  # FSDP2 takes no 0-dim one
    mesh = init_device_mesh("cpu", (len(RANK_ROWS),))
    fully_shard(model.query, mesh=mesh)
    fully_shard(model, mesh=mesh)
    try:
        mbs_ext.step(model, sgd(model), _rank_batch(rank), RANKS_LOSS, micro_batch_size=3)
    except ValueError as exc:
        return str(exc)
    return ""


def _ranks_mismatch(rank: int, kind: str) -> dict:
    """Rank 1's encodings differ from rank 0's beyond their rows in ``kind``; then a step together."""
    model = Towers()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = sgd(ddp)
    before = snapshot(model, opt)

    def odd_encode(mod, mb):
        q, d = encode_forward(mod, mb)
        if rank == 1:  # the same elements per row as rank 0's, so only the exact shapes tell them apart
            d = d[:, :, None] if kind == "shape" else d.float()
        return q, d

    try:
        mbs_ext.step(ddp, opt, _rank_batch(rank), mbs_ext.CachedLoss(odd_encode, info_nce_wrapped),
                     micro_batch_size=3)
        raised = None
    except Exception as exc:
        raised = (type(exc).__name__, str(exc))
    unchanged = snapshot(model, opt)
    assert_bit_identical(unchanged, before)
    mbs_ext.step(ddp, opt, _rank_batch(rank, 2), RANKS_LOSS, micro_batch_size=3)  # together again
    return {"raised": raised}


def _ranks_worker(rank: int) -> dict:
    return {"ddp": _ranks_steps(rank, "ddp"), "process_group": _ranks_steps(rank, "process_group"),
            "ddp_own_encode": _ranks_steps(rank, "ddp_own_encode"),
            **{f"fail_{where}": _ranks_failure(rank, where) for where in ("check", "encode", "loss")},
            **{f"mismatch_{kind}": _ranks_mismatch(rank, kind) for kind in ("shape", "dtype")},
            "fsdp": _ranks_fsdp(rank)}


@pytest.fixture(scope="module")
def ranks():
    from ddp_harness import run_world

    return run_world(_ranks_worker, timeout=180)


@pytest.mark.multiprocess
@pytest.mark.parametrize("wrapper", ["ddp", "process_group", "ddp_own_encode"])
def test_across_ranks_equals_one_process_on_all_rows(ranks, wrapper):
    ref = Towers()
    opt = sgd(ref)
    want = [full_batch_step(ref, opt, pairs(seed=seed)) for seed in (1, 2)]
    for rank in range(len(RANK_ROWS)):
        got = ranks[rank][wrapper]
        assert got["losses"] == pytest.approx(want, rel=1e-12)  # the negatives are every rank's rows
        for name, p in ref.named_parameters():
            assert rel_err(got["params"][name], p) <= 1e-12, (wrapper, rank, name)


@pytest.mark.multiprocess
@pytest.mark.parametrize("where", ["check", "encode", "loss"])
def test_a_rank_failing_anywhere_before_the_streamed_pass_makes_every_rank_raise_and_change_nothing(ranks, where):
    own, peer = ranks[1][f"fail_{where}"], ranks[0][f"fail_{where}"]
    if where == "check":
        assert own["raised"][0] == "ValueError" and "found index 99" in own["raised"][1]
    else:
        assert own["raised"][0] == "RuntimeError" and f"injected in {where}" in own["raised"][1]
    assert peer["raised"][0] == "PeerFailed" and "rank 1 raised" in peer["raised"][1]
    assert own["unchanged"] and peer["unchanged"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["shape", "dtype"])
def test_encodings_that_differ_between_ranks_beyond_their_rows_are_refused_on_every_rank(ranks, kind):
    for rank in range(len(RANK_ROWS)):
        name, message = ranks[rank][f"mismatch_{kind}"]["raised"]
        assert name == "ValueError" and "differ in structure, dtype or shape beyond their rows" in message
        assert ("(5, 1)" in message) if kind == "shape" else ("torch.float32" in message)


@pytest.mark.multiprocess
def test_fully_sharded_is_refused_before_anything_runs(ranks):
    for rank in range(len(RANK_ROWS)):
        assert "FSDP2" in ranks[rank]["fsdp"] and "DistributedDataParallel" in ranks[rank]["fsdp"]


@pytest.mark.slow
def test_the_clip_example_takes_the_full_batch_step_and_plain_streaming_does_not(tmp_path):
    """examples/clip_example.py runs as a user would run it: CachedLoss reports the full batch's
    loss and stays on its weights; plain streaming reports a smaller loss and drifts."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "examples" / "clip_example.py"), "--steps", "3", "--out",
                          str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=root, check=True,
                         env=mbs_ext.diagnostics.child_env(threads=2)).stdout
    reported = {name: float(v) for name, v in re.findall(r"^(\w[\w ]*?)\s+loss the last step reported: (\S+)$", out,
                                                           re.MULTILINE)}
    assert reported["CachedLoss"] == pytest.approx(reported["full batch"], rel=1e-12), out
    assert reported["plain streaming"] < 0.8 * reported["full batch"], out
    gaps = re.search(r"CachedLoss (\S+), plain streaming (\S+)$", out, re.MULTILINE).groups()
    cached, plain = (float(v) for v in gaps)
    assert cached < 1e-12 and plain > 1e-4, out
    assert (tmp_path / "clip_example.png").stat().st_size > 10_000


class _TokenModel(nn.Module):
    def __init__(self, vocab: int = 7, dim: int = 5) -> None:
        super().__init__()
        self.emb, self.out = nn.Embedding(vocab, dim), nn.Linear(dim, vocab)

    def forward(self, ids):
        return self.out(self.emb(ids))


def _token_batch(rows: int = 24, width: int = 6, seed: int = 4) -> dict:
    """Rows padded to one width with -100 labels, each row's length its own (so counts differ)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 7, (rows, width), generator=g)
    lengths = torch.randint(2, width + 1, (rows,), generator=g)
    labels = ids.clone()
    labels[torch.arange(width)[None, :] >= lengths[:, None]] = -100
    return {"input_ids": ids, "labels": labels}


def _token_mean(shifted: bool):
    """A token-mean LM loss, as a causal LM computes it (``shifted``: next-token labels) or not."""
    def loss(model, mb):
        logits, labels = model(mb["input_ids"]), mb["labels"]
        if shifted:
            logits, labels = logits[:, :-1], labels[:, 1:]
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                           ignore_index=-100)
    return loss


@pytest.mark.parametrize("shifted", [True, False], ids=["shifted", "unshifted"])
def test_check_streamable_names_the_count_a_token_mean_loss_needs_not_coupling(shifted):
    """A token-mean loss streamed with the default count (rows) is off, and the cause is the count,
    not coupling: the message names normalize= with the count that fits (the shifted one for a
    causal LM's loss), never CachedLoss; with that count the check passes."""
    torch.manual_seed(0)
    model, batch = _TokenModel(), _token_batch()
    right = "[..., 1:]" if shifted else '(mb["labels"] != -100)'
    with pytest.raises(ValueError, match="normalize=") as info:
        mbs_ext.check_streamable(model, batch, _token_mean(shifted), micro_batch_size=4)
    text = str(info.value)
    assert "count that fits: normalize=lambda mb: " in text and right in text.split("count that fits")[1], text
    assert "CachedLoss" not in text and "couples" not in text, text
    count = ((lambda mb: (mb["labels"][..., 1:] != -100).sum()) if shifted
             else (lambda mb: (mb["labels"] != -100).sum()))
    mbs_ext.check_streamable(model, batch, _token_mean(shifted), micro_batch_size=4, normalize=count)
    if shifted:  # the unshifted count is close but not the loss's: still named as off
        with pytest.raises(ValueError, match=r"\[\.\.\., 1:\]"):
            mbs_ext.check_streamable(model, batch, _token_mean(True), micro_batch_size=4,
                                     normalize=lambda mb: (mb["labels"] != -100).sum())


def test_step_says_when_the_count_does_not_fit_a_token_mean_loss():
    """The paved path: a token-mean loss streamed with the default count (rows) warns once per
    signature, naming the count that fits; the right count, or check_count=False, says nothing;
    and the check leaves no trace (the step's result equals an unchecked one's, bit for bit)."""
    import warnings

    torch.manual_seed(0)
    model, batch = _TokenModel(), _token_batch()
    unchecked = copy.deepcopy(model)
    opt, uopt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(unchecked.parameters(), lr=0.1)
    fits = r'count that fits: normalize=lambda mb: \(mb\["labels"\]\[\.\.\., 1:\]'
    with pytest.warns(mbs_ext.CountWarning, match=fits):
        mbs_ext.step(model, opt, batch, _token_mean(True), micro_batch_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mbs_ext.step(unchecked, uopt, batch, _token_mean(True), micro_batch_size=4, check_count=False)
        assert_bit_identical(snapshot(model, opt), snapshot(unchecked, uopt))
        mbs_ext.step(model, opt, batch, _token_mean(True), micro_batch_size=4)  # said once per signature
        fresh = _TokenModel()
        mbs_ext.step(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), batch, _token_mean(True),
                     micro_batch_size=4, normalize=lambda mb: (mb["labels"][..., 1:] != -100).sum())


def test_step_says_when_the_count_given_is_one_token_a_row_off():
    """normalize= given but not what the loss averages over: the unshifted label count for a causal
    LM's shifted loss (the README's count before 2026-11-28, 5e-4 off on GPT-2) is a near miss the
    first step names, with the shifted count as the fix; the step with that count is the full
    batch's to float64 rounding, and says nothing; check_count=False turns the check off."""
    import warnings

    torch.manual_seed(0)
    model, batch = _TokenModel().double(), _token_batch()
    ref, exact = copy.deepcopy(model), copy.deepcopy(model)
    unshifted = lambda mb: (mb["labels"] != -100).sum()  # noqa: E731
    shifted = lambda mb: (mb["labels"][..., 1:] != -100).sum()  # noqa: E731
    with pytest.warns(mbs_ext.CountWarning, match=r"\(the normalize callable\).*count that fits: normalize="
                                                  r"lambda mb: \(mb\[\"labels\"\]\[\.\.\., 1:\]"):
        mbs_ext.step(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, _token_mean(True),
                     micro_batch_size=4, normalize=unshifted)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ropt.zero_grad()
    _token_mean(True)(ref, batch).backward()
    ropt.step()
    off = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    assert off > 1e-6  # the warning is about a real difference
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mbs_ext.step(exact, torch.optim.SGD(exact.parameters(), lr=0.1), batch, _token_mean(True),
                     micro_batch_size=4, normalize=shifted)
        again = _TokenModel().double()
        mbs_ext.step(again, torch.optim.SGD(again.parameters(), lr=0.1), batch, _token_mean(True),
                     micro_batch_size=4, normalize=unshifted, check_count=False)
    assert max(rel_err(a, b) for a, b in zip(exact.parameters(), ref.parameters())) <= 1e-12


@pytest.mark.parametrize("path", ["token_budget", "accumulate", "accumulate_coupled"])
def test_token_budgets_and_accumulate_say_it_too(path):
    """The check is the step's, so the other ways in say it as well: a token budget with no
    normalize= (3.8e-2 off on GPT-2 in the issue that asked for this) and accumulate, for a count
    that does not fit (names the shifted count) and a coupled loss (names CachedLoss)."""
    torch.manual_seed(0)
    batch = _token_batch()
    batch["attention_mask"] = (batch["labels"] != -100).long()
    shifted = r'count that fits: normalize=lambda mb: \(mb\["labels"\]\[\.\.\., 1:\]'
    said = "couple the rows.*CachedLoss" if path.endswith("coupled") else shifted
    with pytest.warns(mbs_ext.CountWarning, match=said):
        if path == "token_budget":
            model = _TokenModel()
            mbs_ext.step(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, _token_mean(True),
                         micro_batch_tokens=24)
        elif path == "accumulate":
            mbs_ext.accumulate(_TokenModel(), batch, _token_mean(True), micro_batch_size=4)
        else:
            mbs_ext.accumulate(TwoTower(), pairs(), lambda mod, mb: info_nce(mod, encode(mod, mb)), micro_batch_size=4)


def test_step_says_when_a_loss_couples_the_rows():
    """A contrastive loss on the plain step: the check finds no count that fits and names coupling
    and CachedLoss, at run time (before, the step was 35% off and silent)."""
    model = TwoTower()
    with pytest.warns(mbs_ext.CountWarning, match="couple the rows.*CachedLoss"):
        mbs_ext.step(model, torch.optim.SGD(model.parameters(), lr=0.1), pairs(),
                     lambda mod, mb: info_nce(mod, encode(mod, mb)), micro_batch_size=4)
