"""mbs_ext.step equals one ordinary full-batch backward and optimizer step: uneven splits, the
balanced split rule, token counts and the normalize rules, one optimizer step per call, and a
hypothesis property test over batch structures.

Tests taking ``device`` run on the CPU and, where a GPU exists, on CUDA: the model moves
to the device, the batch stays on the host, and the reference is a full-batch step of a
float64 copy of the model on the host (common.reference_model).
"""

from __future__ import annotations

import math

import pytest
import torch
from common import (
    DEVICE_PARAMS,
    Boom,
    TinyLM,
    assert_bit_identical,
    assert_models_match,
    balanced_sizes,
    failing_at,
    full_batch_step,
    lm_loss,
    mlp,
    mse,
    pair,
    rel_err,
    snapshot,
    to_f64,
    token_count,
    twins,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import mbs_ext

TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


# --- exactness --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("opt_cls", [torch.optim.Adam, torch.optim.SGD])
def test_uneven_split_n10_m4(dtype, opt_cls, device):
    kw = {"lr": 1e-2} if opt_cls is torch.optim.Adam else {"lr": 0.1, "momentum": 0.9}
    model, opt, ref, ropt = twins(mlp(dtype), opt_cls, device=device, **kw)
    batch = pair(10, dtype)
    res = mbs_ext.step(model, opt, batch, mse, micro_batch_size=4)
    ref_loss, _ = full_batch_step(ref, ropt, to_f64(batch), mse)
    assert_models_match(model, ref, TOL[dtype])
    assert abs(res.loss - ref_loss) <= TOL[dtype] * abs(ref_loss)
    assert (res.num_micro_batches, res.micro_batch_size, res.num_samples) == (3, 4, 10)
    assert not res.skipped and res.grad_norm is None
    assert {"stage_s", "wait_s", "compute_s", "step_s"} <= res.timings.keys()


@pytest.mark.parametrize("seed", range(6))
def test_random_sizes(seed, device):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 40, (), generator=g))
    m = int(torch.randint(1, 45, (), generator=g))
    model, opt, ref, ropt = twins(mlp(seed=seed), device=device)
    batch = pair(n, seed=seed)
    res = mbs_ext.step(model, opt, batch, mse, micro_batch_size=m)
    full_batch_step(ref, ropt, batch, mse)
    assert_models_match(model, ref, 1e-12)
    assert res.num_micro_batches == math.ceil(n / min(m, n))


def test_nn_loss_module_with_pair_batch(device):
    model, opt, ref, ropt = twins(mlp(), device=device)
    batch = pair(9)
    mbs_ext.step(model, opt, batch, nn.MSELoss(), micro_batch_size=2)
    full_batch_step(ref, ropt, batch, mse)
    assert_models_match(model, ref, 1e-12)


def test_micro_batches_rule_equals_samples_on_even_split(device):
    model, opt, ref, ropt = twins(mlp(), device=device)
    batch = pair(12)
    mbs_ext.step(model, opt, batch, mse, micro_batch_size=4, normalize="micro_batches")
    full_batch_step(ref, ropt, batch, mse)
    assert_models_match(model, ref, 1e-12)


def test_micro_batches_rule_is_wrong_on_uneven_split(device):
    model, opt, ref, ropt = twins(mlp(), torch.optim.SGD, device=device, lr=0.1)
    batch = pair(10)  # micro-batches of 4, 3, 3 rows: 1/M weights are not n_i/N
    mbs_ext.step(model, opt, batch, mse, micro_batch_size=4, normalize="micro_batches")
    full_batch_step(ref, ropt, batch, mse)
    errs = [rel_err(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters(), strict=True)]
    assert max(errs) > 1e-3


class PartlyUsed(nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(5, 5)
        self.frozen.requires_grad_(False)
        self.used = nn.Linear(5, 3)
        self.unused = nn.Linear(5, 3)

    def forward(self, x):
        return self.used(self.frozen(x))


@pytest.mark.parametrize("accumulate_dtype", [None, torch.float64])
def test_frozen_and_unused_parameters(accumulate_dtype, device):
    torch.manual_seed(0)
    base = PartlyUsed().float()
    model, opt, ref, ropt = twins(base, device=device)
    batch = pair(10, torch.float32)
    mbs_ext.step(model, opt, batch, mse, micro_batch_size=3, accumulate_dtype=accumulate_dtype)
    full_batch_step(ref, ropt, to_f64(batch), mse)
    assert_models_match(model, ref, 1e-5)
    assert model.unused.weight.grad is None and model.frozen.weight.grad is None


class SparseBag(nn.Module):
    """Token ids -> ``nn.Embedding(sparse=True)`` (autograd gives it sparse gradients) -> a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 6, sparse=True)
        self.head = nn.Linear(6, 7)

    def forward(self, ids):
        return self.head(self.emb(ids).mean(1))


@pytest.mark.parametrize("accumulate_dtype", [None, torch.float64], ids=["grad", "buffers"])
def test_sparse_embedding_gradients(accumulate_dtype):
    """The non-finite check reads a sparse gradient's stored values; buffers take it densely."""
    torch.manual_seed(0)
    model, opt, ref, ropt = twins(SparseBag().float(), torch.optim.SGD, lr=0.5)
    g = torch.Generator().manual_seed(2)
    batch = (torch.randint(0, 7, (10, 3), generator=g), torch.randint(0, 7, (10,), generator=g))
    res = mbs_ext.step(model, opt, batch, nn.CrossEntropyLoss(), micro_batch_size=3,
                       accumulate_dtype=accumulate_dtype)
    full_batch_step(ref, ropt, batch, lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]))
    assert not res.skipped
    assert_models_match(model, ref, 1e-6)
    assert model.emb.weight.grad.is_sparse == (accumulate_dtype is None)


def test_sparse_gradient_holding_inf_skips_the_step():
    torch.manual_seed(0)
    model = SparseBag()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    before = snapshot(model, opt)
    model.emb.weight.register_hook(
        lambda grad: torch.sparse_coo_tensor(grad._indices(), torch.full_like(grad._values(), math.inf), grad.shape,
                                             check_invariants=True))
    batch = (torch.randint(0, 7, (10, 3)), torch.randint(0, 7, (10,)))
    with pytest.warns(RuntimeWarning, match="non-finite gradient"):
        res = mbs_ext.step(model, opt, batch, nn.CrossEntropyLoss(), micro_batch_size=3)
    assert res.skipped and math.isfinite(res.loss)
    assert_bit_identical(snapshot(model, opt), before)


# --- the split --------------------------------------------------------------------------------


@pytest.mark.parametrize("n, m", [(10, 4), (11, 3), (9, 2), (13, 5), (7, 7), (5, 9), (17, 16)])
def test_micro_batches_are_balanced(n, m, device):
    """k = ceil(n/m) micro-batches whose sizes differ by at most one, larger ones first
    (no short tail); the result stays exact."""
    model, opt, ref, ropt = twins(mlp(), device=device)
    batch = pair(n)
    seen = []

    def loss_fn(model, b):
        seen.append(b[0].shape[0])
        return mse(model, b)

    # check_count=False: the first step's count check would call loss_fn three more times (no grad)
    res = mbs_ext.step(model, opt, batch, loss_fn, micro_batch_size=m, check_count=False)
    full_batch_step(ref, ropt, batch, mse)
    assert seen == balanced_sizes(n, m)
    assert res.num_micro_batches == len(seen)
    assert max(seen) <= res.micro_batch_size <= min(m, n)
    assert_models_match(model, ref, 1e-12)


def test_error_note_names_the_balanced_rows(device):
    model, opt, _, _ = twins(mlp(), device=device)
    with pytest.raises(Boom) as info:
        mbs_ext.step(model, opt, pair(10), failing_at(2, Boom, mse), micro_batch_size=4, check_count=False)
    assert any("micro-batch 2 of 3" in n and "[7, 10)" in n for n in info.value.__notes__)


# --- token-masked causal-LM-like model: counts ------------------------------------------------


def lm_batch(n, t=7, vocab=11, seed=0, empty_rows=()):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, t), generator=g)
    labels = torch.roll(ids, -1, dims=1)
    # Unequal token counts: each row keeps a random-length prefix of its labels.
    keep = torch.randint(1, t + 1, (n, 1), generator=g)
    labels = torch.where(torch.arange(t) < keep, labels, torch.full_like(labels, -100))
    for r in empty_rows:
        labels[r] = -100
    return {"ids": ids, "labels": labels}


def lm_models(seed=0, dtype=torch.float64, device="cpu"):
    torch.manual_seed(seed)
    return twins(TinyLM().to(dtype), torch.optim.AdamW, device=device, lr=1e-2)


@pytest.mark.parametrize("m", [1, 3, 4, 16])
def test_token_masked_lm_count_callable(m, device):
    # On CUDA the count is a device tensor (the micro-batch lives there).
    model, opt, ref, ropt = lm_models(device=device)
    batch = lm_batch(13)
    res = mbs_ext.step(model, opt, batch, lm_loss, micro_batch_size=m, normalize=token_count)
    ref_loss, _ = full_batch_step(ref, ropt, batch, lm_loss)
    assert_models_match(model, ref, 1e-12)
    assert abs(res.loss - ref_loss) <= 1e-12 * ref_loss


def test_token_masked_lm_with_empty_micro_batches(device):
    model, opt, ref, ropt = lm_models(device=device)
    batch = lm_batch(12, empty_rows=(0, 1, 2, 9, 10, 11))  # micro-batches 0 and 3 have no tokens
    mbs_ext.step(model, opt, batch, lm_loss, micro_batch_size=3, normalize=token_count)
    full_batch_step(ref, ropt, batch, lm_loss)
    assert_models_match(model, ref, 1e-12)


def test_token_masked_lm_micro_batches_rule_is_wrong(device):
    model, opt, ref, ropt = lm_models(device=device)
    batch = lm_batch(12)
    mbs_ext.step(model, opt, batch, lm_loss, micro_batch_size=3, normalize="micro_batches")
    full_batch_step(ref, ropt, batch, lm_loss)
    errs = [rel_err(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters(), strict=True)]
    assert max(errs) > 1e-3


def test_count_callable_returning_int_in_float32(device):
    model, opt, ref, ropt = lm_models(dtype=torch.float32, device=device)
    batch = lm_batch(10)
    mbs_ext.step(model, opt, batch, lm_loss, micro_batch_size=4, normalize=lambda b: int(token_count(b)))
    full_batch_step(ref, ropt, batch, lm_loss)
    assert_models_match(model, ref, 1e-5)


@pytest.mark.parametrize(
    ("bad", "exc", "match"),
    [
        (-1, ValueError, "non-negative finite number.* returned -1"),
        (float("nan"), ValueError, "non-negative finite number.* returned nan"),
        (float("inf"), ValueError, "non-negative finite number.* returned inf"),
        (torch.tensor(-1.5), ValueError, "non-negative finite number"),
        ("3", TypeError, "non-negative finite number.*returned str '3'"),
        ([3], TypeError, "returned list"),
    ],
    ids=["negative", "nan", "inf", "negative_tensor", "str", "list"],
)
def test_bad_counts_raise_and_change_nothing(bad, exc, match, device):
    model, opt, _, _ = lm_models(device=device)
    before = snapshot(model, opt)
    # A tensor count lives where the micro-batch does: on CUDA it is checked on the device.
    value = bad.to(device) if isinstance(bad, torch.Tensor) else bad
    with pytest.raises(exc, match=match):
        mbs_ext.step(model, opt, lm_batch(8), lm_loss, micro_batch_size=3, normalize=lambda b: value)
    assert_bit_identical(snapshot(model, opt), before)
    assert all(p.grad is None for p in model.parameters())


def test_bad_device_count_names_its_micro_batch(device):
    # A tensor count is checked on its device and read once, at the end of the step; the
    # error still names the first micro-batch whose count was bad, not the finish.
    model, opt, _, _ = lm_models(device=device)
    before = snapshot(model, opt)
    seen = []

    def count(b):
        seen.append(len(seen))
        bad = len(seen) in (3, 4)  # micro-batches 2 and 3 of 4
        return torch.tensor(-2.0 if bad else float(token_count(b)), device=device)

    with pytest.raises(ValueError, match=r"non-negative finite number.*at micro-batch 2 of 4 \(rows \[6, 8\)"):
        mbs_ext.step(model, opt, lm_batch(10), lm_loss, micro_batch_size=3, normalize=count)
    assert len(seen) == 4
    assert_bit_identical(snapshot(model, opt), before)


def test_zero_total_count_is_an_error(device):
    model, opt, _, _ = lm_models(device=device)
    before = snapshot(model, opt)
    batch = lm_batch(6, empty_rows=range(6))
    with pytest.raises(ValueError, match="sum to 0"):
        mbs_ext.step(model, opt, batch, lm_loss, micro_batch_size=4, normalize=token_count)
    assert_bit_identical(snapshot(model, opt), before)


def test_streamer_count_callable_over_several_steps(device):
    model, opt, ref, ropt = lm_models(device=device)
    streamer = mbs_ext.MicroBatchStreamer(model, opt, lm_loss, micro_batch_size=3, normalize=token_count)
    for k in range(3):
        batch = lm_batch(7 + 2 * k, seed=k)
        res = streamer.step(batch)
        ref_loss, _ = full_batch_step(ref, ropt, batch, lm_loss)
        assert abs(res.loss - ref_loss) <= 1e-12 * ref_loss
    assert_models_match(model, ref, 1e-12)
    assert all(int(s["step"]) == 3 for s in opt.state.values())


# --- optimizer semantics ----------------------------------------------------------------------


def test_one_optimizer_step_and_unchanged_schedule(device):
    model = mlp().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    calls = []
    opt.register_step_post_hook(lambda *a: calls.append(1))
    mbs_ext.step(model, opt, pair(10), mse, micro_batch_size=3)
    assert len(calls) == 1
    assert all(int(s["step"]) == 1 for s in opt.state.values())
    assert opt.param_groups[0]["lr"] == 0.05 and sched.last_epoch == 0


def test_streamer_reuses_its_ring_over_several_steps(device):
    model, opt, ref, ropt = twins(mlp(), device=device)
    streamer = mbs_ext.MicroBatchStreamer(model, opt, mse, micro_batch_size=3)
    rings = []
    for k in range(3):
        batch = pair(8 + k, seed=k)
        streamer.step(batch)
        rings.append(streamer.ring)
        full_batch_step(ref, ropt, batch, mse)
    assert rings[0] is rings[1] is rings[2]
    assert_models_match(model, ref, 1e-12)
    assert rings[0].stats()["micro_batches"] == 4  # per-stream totals: the last step's stream


# --- property test ----------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 17),
    m=st.integers(1, 20),
    structure=st.sampled_from(["tensor", "tuple", "list", "dict", "nested"]),
    extra=st.booleans(),
)
def test_property_random_structures(n, m, structure, extra, device):
    g = torch.Generator().manual_seed(n * 31 + m)
    x = torch.randn(n, 4, generator=g, dtype=torch.float64)
    y = torch.randn(n, 2, generator=g, dtype=torch.float64)
    w = torch.rand(n, generator=g, dtype=torch.float64)
    if structure == "tensor":
        batch = torch.cat([x, y], dim=1)
        def unpack(b):
            return b[:, :4], b[:, 4:], None
    elif structure in ("tuple", "list"):
        batch = (x, y, w) if structure == "tuple" else [x, y, w]
        def unpack(b):
            return b[0], b[1], b[2]
    elif structure == "dict":
        batch = {"x": x, "y": y, "w": w}
        def unpack(b):
            return b["x"], b["y"], b["w"]
    else:
        batch = {"io": (x, [y]), "w": {"w": w}}
        def unpack(b):
            return b["io"][0], b["io"][1][0], b["w"]["w"]
    if extra and isinstance(batch, dict):
        batch["note"] = 7

    def loss_fn(model, b):
        xx, yy, ww = unpack(b)
        per_row = ((model(xx) - yy) ** 2).mean(dim=1)
        if ww is not None:
            per_row = per_row * ww
        return per_row.mean()

    model, opt, ref, ropt = twins(mlp(d_in=4, d_out=2, seed=n), device=device)
    mbs_ext.step(model, opt, batch, loss_fn, micro_batch_size=m)
    full_batch_step(ref, ropt, batch, loss_fn)
    assert_models_match(model, ref, 1e-12)
