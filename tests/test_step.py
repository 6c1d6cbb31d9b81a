"""mbs_ext.step against one ordinary full-batch backward and optimizer step.

Tests taking ``device`` run on the CPU and, where a GPU exists, on CUDA: the model moves
to the device, the batch stays on the host, and the reference is a full-batch step of a
float64 copy of the model on the host (helpers.reference_model).
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    DEVICE_PARAMS,
    PoisonGrad,
    TinyLM,
    assert_bit_identical,
    assert_models_match,
    assert_states_match,
    balanced_ranges,
    balanced_sizes,
    failing_at,
    full_batch_step,
    lm_loss,
    reference_model,
    rel_err,
    scaler_for,
    snapshot,
    to_f64,
    token_count,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import mbs_ext

TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


def mlp(dtype=torch.float64, seed=0, d_in=5, d_out=3):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, 8), nn.Tanh(), nn.Linear(8, d_out)).to(dtype)


def mse(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def pair(n, dtype=torch.float64, seed=1, d_in=5, d_out=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d_in, generator=g, dtype=dtype), torch.randn(n, d_out, generator=g, dtype=dtype)


def twins(model, opt_cls=torch.optim.Adam, *, device="cpu", **opt_kw):
    """The model moved to ``device`` with its optimizer, and a float64 host reference with its own."""
    ref = reference_model(model)
    model = model.to(device)
    opt_kw = opt_kw or {"lr": 1e-2}
    return model, opt_cls(model.parameters(), **opt_kw), ref, opt_cls(ref.parameters(), **opt_kw)


def rerun_tol(device):
    """Two runs of the same step: bit-identical on the CPU; CUDA kernels promise less."""
    return 0.0 if device == "cpu" else 1e-6


# --- exactness -------------------------------------------------------------------------------


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


# --- token-masked causal-LM-like model ---------------------------------------------------------



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


# --- batch structures ---------------------------------------------------------------------------


class DictModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(2, 3)

    def forward(self, batch):
        assert batch["tag"] == "keep-me"
        x1, x2 = batch["inputs"]["pair"]
        return self.a(x1) * batch["inputs"]["scale"][:, None] + self.b(x2)


def dict_loss(model, batch):
    return F.mse_loss(model(batch), batch["target"])


def test_nested_dict_batch(device):
    torch.manual_seed(0)
    model, opt, ref, ropt = twins(DictModel().double(), device=device)
    g = torch.Generator().manual_seed(3)
    n = 11
    batch = {
        "inputs": {
            "pair": (torch.randn(n, 4, generator=g, dtype=torch.float64),
                     torch.randn(n, 2, generator=g, dtype=torch.float64)),
            "scale": torch.rand(n, generator=g, dtype=torch.float64),
        },
        "target": torch.randn(n, 3, generator=g, dtype=torch.float64),
        "tag": "keep-me",
    }
    mbs_ext.step(model, opt, batch, dict_loss, micro_batch_size=3)
    full_batch_step(ref, ropt, batch, dict_loss)
    assert_models_match(model, ref, 1e-12)


def test_indices_select_rows_of_a_dataset(device):
    model, opt, ref, ropt = twins(mlp(), device=device)
    dataset = pair(30)
    idx = torch.tensor([29, 3, 3, 17, 0, 8, 21, 5, 12, 12, 1], dtype=torch.int64)
    res = mbs_ext.step(model, opt, dataset, mse, micro_batch_size=4, indices=idx)
    full_batch_step(ref, ropt, (dataset[0][idx], dataset[1][idx]), mse)
    assert_models_match(model, ref, 1e-12)
    assert res.num_samples == 11


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


# --- optimizer semantics -------------------------------------------------------------------------


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


def test_clipping_matches_clip_grad_norm(device):
    model, opt, ref, ropt = twins(mlp(), device=device)
    batch = pair(10)
    res = mbs_ext.step(model, opt, batch, mse, micro_batch_size=4, max_grad_norm=0.05)
    _, ref_norm = full_batch_step(ref, ropt, batch, mse, max_grad_norm=0.05)
    assert ref_norm.item() > 0.05  # clipping is active
    assert abs(res.grad_norm - ref_norm.item()) <= 1e-12 * ref_norm.item()
    assert_models_match(model, ref, 1e-12)


# --- mixed precision ------------------------------------------------------------------------------


def test_grad_scaler_matches_and_updates_once_per_step(device):
    model, opt, ref, ropt = twins(mlp(torch.float32), device=device)
    scaler = scaler_for(device, init_scale=2.0**10, growth_interval=1)
    rscaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    for k in range(2):
        batch = pair(10, torch.float32, seed=k)
        res = mbs_ext.step(model, opt, batch, mse, micro_batch_size=3, scaler=scaler)
        full_batch_step(ref, ropt, to_f64(batch), mse, scaler=rscaler)
        assert not res.skipped
        assert scaler.get_scale() == 2.0 ** (11 + k)  # grew exactly once per step
    assert_models_match(model, ref, 1e-5)


def test_grad_scaler_injected_inf_skips_and_backs_off_once(device):
    model, opt, _, _ = twins(mlp(torch.float32), device=device)
    scaler = scaler_for(device, init_scale=2.0**10, growth_interval=1)
    mbs_ext.step(model, opt, pair(6, torch.float32), mse, micro_batch_size=3, scaler=scaler)
    before = snapshot(model, opt)
    x, y = pair(10, torch.float32, seed=5)
    y[7, 1] = float("inf")
    with pytest.warns(RuntimeWarning, match="non-finite"):
        res = mbs_ext.step(model, opt, (x, y), mse, micro_batch_size=3, scaler=scaler)
    assert res.skipped
    assert scaler.get_scale() == 2.0**10  # 2**11 after the good step, backed off once
    assert_bit_identical(snapshot(model, opt), before)


def test_grad_scaler_overflow_in_gradient_only_is_silent(device):
    model, opt, _, _ = twins(mlp(torch.float32), device=device)
    scaler = scaler_for(device, init_scale=2.0**10)
    before = snapshot(model, opt)

    def loss_fn(model, batch):
        x, y = batch
        return F.mse_loss(PoisonGrad.apply(model(x), float("inf")), y)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = mbs_ext.step(model, opt, pair(8, torch.float32), loss_fn, micro_batch_size=3, scaler=scaler)
    assert math.isfinite(res.loss) and res.skipped
    assert scaler.get_scale() == 2.0**9
    assert_bit_identical(snapshot(model, opt), before)


def test_bf16_fp32_accumulation_beats_bf16_accumulation(device):
    torch.manual_seed(0)
    model = nn.Linear(16, 4).bfloat16()
    # Integer inputs and pairs summing to 256 make every micro-batch gradient and the exact
    # mini-batch gradient representable in bf16: what remains is accumulation error only.
    g = torch.Generator().manual_seed(0)
    half = torch.randint(1, 256, (32, 16), generator=g).float()
    x = torch.cat([half, 256 - half])[torch.randperm(64, generator=g)].bfloat16()
    y = torch.ones(64, 4, dtype=torch.bfloat16)

    def loss_fn(m, b):
        return (m(b[0]) * b[1]).float().sum(-1).mean()

    exact = reference_model(model)
    loss_fn(exact, (x.double(), y.double())).backward()
    errs = {}
    for acc in (None, torch.bfloat16):
        mm = copy.deepcopy(model).to(device)
        mbs_ext.step(mm, torch.optim.SGD(mm.parameters(), lr=0.0), (x, y), loss_fn, micro_batch_size=1,
                     accumulate_dtype=acc)
        assert mm.weight.grad.dtype == torch.bfloat16
        pairs = zip(mm.parameters(), exact.parameters(), strict=True)
        errs[acc] = max(rel_err(p.grad, q.grad) for p, q in pairs)
    assert errs[torch.bfloat16] > 0
    assert errs[None] * 10 <= errs[torch.bfloat16]


def test_autocast_bf16_runs_forward_in_bf16(device):
    model, opt, ref, ropt = twins(mlp(torch.float32), device=device)
    seen = []
    def loss_fn(m, b):
        out = m(b[0])
        seen.append(out.dtype)
        return F.mse_loss(out.to(b[1].dtype), b[1])
    batch = pair(10, torch.float32)
    mbs_ext.step(model, opt, batch, loss_fn, micro_batch_size=4, autocast_dtype=torch.bfloat16)
    assert seen == [torch.bfloat16] * 3
    full_batch_step(ref, ropt, to_f64(batch), loss_fn)  # float64, no autocast: bf16 error shows
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert rel_err(p.grad, q.grad) < 5e-2


# --- non-finite policy ------------------------------------------------------------------------------


def test_nonfinite_skip_changes_nothing_and_warns(device):
    model, opt, _, _ = twins(mlp(), device=device)
    mbs_ext.step(model, opt, pair(6), mse, micro_batch_size=4)
    before = snapshot(model, opt)
    x, y = pair(10)
    y[9, 0] = float("nan")
    with pytest.warns(RuntimeWarning, match="skipped"):
        res = mbs_ext.step(model, opt, (x, y), mse, micro_batch_size=4)
    assert res.skipped and math.isnan(res.loss)
    assert_bit_identical(snapshot(model, opt), before)


def _rng_states(device):
    states = [torch.get_rng_state()]
    if device == "cuda":
        states.append(torch.cuda.get_rng_state())
    return states


@pytest.mark.parametrize("outcome", ["skipped", "failed"])
def test_random_numbers_after_a_skipped_or_failed_step(outcome, device):
    # A skipped step happened, like a plain training step that drew its dropout masks: the
    # next step draws new ones. A failed step (an exception) is undone, random state included,
    # so that running it again computes what it would have.
    torch.manual_seed(0)
    x, y = pair(10)
    model = nn.Sequential(nn.Linear(x.shape[1], 8), nn.Dropout(0.5), nn.Linear(8, y.shape[1]))
    model = model.to(device=device, dtype=x.dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if outcome == "skipped":
        y[9, 0] = float("nan")
        loss_fn = mse
    else:
        def loss_fn(m, b, calls=[]):  # noqa: B006 - counts calls across micro-batches
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("injected")
            return mse(m, b)
    before = _rng_states(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if outcome == "skipped":
            assert mbs_ext.step(model, opt, (x, y), loss_fn, micro_batch_size=4).skipped
        else:
            with pytest.raises(RuntimeError, match="injected"):
                mbs_ext.step(model, opt, (x, y), loss_fn, micro_batch_size=4)
    same = all(torch.equal(a, b) for a, b in zip(_rng_states(device), before, strict=True))
    assert same == (outcome == "failed")


def test_nonfinite_raise(device):
    model, opt, _, _ = twins(mlp(), device=device)
    before = snapshot(model, opt)
    x, y = pair(10)
    x[2, 0] = float("inf")
    with pytest.raises(FloatingPointError):
        mbs_ext.step(model, opt, (x, y), mse, micro_batch_size=4, on_nonfinite="raise", max_grad_norm=1.0)
    assert_bit_identical(snapshot(model, opt), before)
    assert all(p.grad is None for p in model.parameters())


# --- atomicity ----------------------------------------------------------------------------------------


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(5, 6)
        self.bn = nn.BatchNorm1d(6)
        self.l2 = nn.Linear(6, 3)

    def forward(self, x):
        return self.l2(self.bn(self.l1(x)))


class Boom(Exception):
    pass


@pytest.mark.parametrize("deferred_bn", [True, False])
@pytest.mark.parametrize("exc_type", [Boom, KeyboardInterrupt])
@pytest.mark.parametrize("fail_at", [0, 1, 2, 3])
def test_atomic_on_error_at_every_micro_batch(fail_at, exc_type, deferred_bn, device):
    torch.manual_seed(0)
    model = BNNet().float()
    if deferred_bn:
        model = mbs_ext.convert_batchnorm(model)  # else plain BatchNorm: buffers change per micro-batch
    model = model.to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = scaler_for(device, init_scale=2.0**8, growth_interval=1)
    mbs_ext.step(model, opt, pair(8, torch.float32, seed=3), mse, micro_batch_size=3, scaler=scaler)
    fresh = copy.deepcopy((model, opt, scaler))
    before = snapshot(model, opt, scaler)
    batch = pair(11, torch.float32, seed=4)  # 4 micro-batches of 3, 3, 3, 2
    failing = failing_at(fail_at, exc_type, mse)
    with pytest.raises(exc_type) as info:
        mbs_ext.step(model, opt, batch, failing, micro_batch_size=3, scaler=scaler)
    start, stop = balanced_ranges(11, 3)[fail_at]
    rows = f"[{start}, {stop})"
    assert any(f"micro-batch {fail_at} of 4" in n and rows in n for n in info.value.__notes__)
    assert_bit_identical(snapshot(model, opt, scaler), before)
    assert all(p.grad is None for p in model.parameters())
    # A following good step equals the same step from the untouched state.
    mbs_ext.step(model, opt, batch, mse, micro_batch_size=3, scaler=scaler)
    f_model, f_opt, f_scaler = fresh
    mbs_ext.step(f_model, f_opt, batch, mse, micro_batch_size=3, scaler=f_scaler)
    assert_states_match(snapshot(model, opt, scaler), snapshot(f_model, f_opt, f_scaler), rerun_tol(device))


class FailingRing(mbs_ext.StreamRing):
    """A ring that fails while staging micro-batch ``fail_at``."""

    def __init__(self, device, fail_at):
        super().__init__(device)
        self.fail_at = fail_at

    def stream(self, batch, m, *, indices=None, copy=True):
        return _FailingIterator(super().stream(batch, m, indices=indices, copy=copy), self.fail_at)


class _FailingIterator:
    def __init__(self, inner, fail_at):
        self.inner, self.fail_at = inner, fail_at

    def __iter__(self):
        return self

    def __next__(self):
        if self.inner.index + 1 == self.fail_at:
            raise OSError("staging failed")
        return next(self.inner)

    @property
    def rows(self):
        return self.inner.rows

    def close(self):
        self.inner.close()


def test_atomic_on_ring_error(device):
    model = mbs_ext.convert_batchnorm(BNNet().double()).to(device)
    opt = torch.optim.Adam(model.parameters())
    streamer = mbs_ext.MicroBatchStreamer(model, opt, mse, micro_batch_size=2)
    streamer.step(pair(6))
    before = snapshot(model, opt)
    failing = mbs_ext.MicroBatchStreamer(model, opt, mse, micro_batch_size=2, ring=FailingRing(device, 2))
    with pytest.raises(OSError) as info:
        failing.step(pair(9))
    assert any("micro-batch 2 of 5" in n for n in info.value.__notes__)
    assert_bit_identical(snapshot(model, opt), before)


# --- bad input ---------------------------------------------------------------------------------------


def _bad(kind, device):
    model = mlp().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = pair(6)
    kw = {"micro_batch_size": 2}
    loss_fn = mse
    if kind == "model":
        model = "not a module"
    elif kind == "optimizer":
        opt = object()
    elif kind == "foreign_optimizer":
        opt = torch.optim.SGD(mlp().to(device).parameters(), lr=0.1)
    elif kind == "no_trainable":
        model.requires_grad_(False)
    elif kind == "empty_batch":
        batch = pair(0)
    elif kind == "mismatched":
        batch = (torch.randn(6, 5, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64))
    elif kind == "no_tensor":
        batch = {"a": [1, 2], "b": "x"}
    elif kind.startswith("mbs_"):
        kw["micro_batch_size"] = {"mbs_0": 0, "mbs_neg": -2, "mbs_float": 2.0, "mbs_bool": True,
                                  "mbs_str": "big", "mbs_auto": "auto"}[kind]
    elif kind == "loss_not_callable":
        loss_fn = 3
    elif kind == "loss_non_tensor":
        loss_fn = lambda m, b: 1.0  # noqa: E731
    elif kind == "loss_non_scalar":
        loss_fn = lambda m, b: (m(b[0]) - b[1]).pow(2).mean(0)  # noqa: E731
    elif kind == "loss_no_grad":
        loss_fn = lambda m, b: mse(m, b).detach()  # noqa: E731
    elif kind == "loss_other_device":
        loss_fn = lambda m, b: mse(m, b).to("meta")  # noqa: E731
    elif kind == "nn_loss_non_pair":
        loss_fn = nn.MSELoss()
        batch = {"x": batch[0]}
    elif kind == "normalize":
        kw["normalize"] = "tokens"
    elif kind == "indices_float":
        kw["indices"] = torch.tensor([0.0, 1.0])
    elif kind == "indices_2d":
        kw["indices"] = torch.zeros(2, 2, dtype=torch.int64)
    elif kind == "indices_range":
        kw["indices"] = torch.tensor([0, 6])
    elif kind == "indices_empty":
        kw["indices"] = torch.zeros(0, dtype=torch.int64)
    elif kind == "scaler":
        kw["scaler"] = "fp16"
    elif kind == "autocast_dtype":
        kw["autocast_dtype"] = torch.int32
    elif kind == "accumulate_dtype":
        kw["accumulate_dtype"] = torch.int64
    elif kind == "max_grad_norm_zero":
        kw["max_grad_norm"] = 0.0
    elif kind == "max_grad_norm_nan":
        kw["max_grad_norm"] = float("nan")
    elif kind == "on_nonfinite":
        kw["on_nonfinite"] = "ignore"
    return model, opt, batch, loss_fn, kw


BAD = {
    "model": "model", "optimizer": "optimizer", "foreign_optimizer": "optimizer",
    "no_trainable": "trainable", "empty_batch": "empty", "mismatched": "dim-0", "no_tensor": "batch",
    "mbs_0": "micro_batch_size", "mbs_neg": "micro_batch_size", "mbs_float": "micro_batch_size",
    "mbs_bool": "micro_batch_size", "mbs_str": "micro_batch_size", "mbs_auto": "memory_budget",
    "loss_not_callable": "loss_fn", "loss_non_tensor": "loss_fn", "loss_non_scalar": "loss_fn",
    "loss_no_grad": "loss_fn", "loss_other_device": "loss_fn", "nn_loss_non_pair": "loss_fn",
    "normalize": "normalize", "indices_float": "indices", "indices_2d": "indices",
    "indices_range": "indices", "indices_empty": "indices", "scaler": "scaler",
    "autocast_dtype": "autocast_dtype", "accumulate_dtype": "accumulate_dtype",
    "max_grad_norm_zero": "max_grad_norm", "max_grad_norm_nan": "max_grad_norm",
    "on_nonfinite": "on_nonfinite",
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_bad_input(kind, device):
    if kind == "mbs_auto" and device != "cpu":
        pytest.skip("'auto' needs no memory_budget on CUDA (tested in test_step_cuda.py)")
    model, opt, batch, loss_fn, kw = _bad(kind, device)
    valid = isinstance(model, nn.Module) and isinstance(opt, torch.optim.Optimizer)
    before = snapshot(model, opt) if valid else None
    with pytest.raises((TypeError, ValueError), match=BAD[kind]):
        mbs_ext.step(model, opt, batch, loss_fn, **kw)
    if before is not None:
        assert_bit_identical(snapshot(model, opt), before)
        assert all(p.grad is None for p in model.parameters())


def _torch_scaler_unscales(dtype, device):
    """Whether torch's own GradScaler can unscale gradients of ``dtype`` on ``device``
    (its CUDA kernel has no bf16 case in the torch versions tested)."""
    p = nn.Parameter(torch.ones(2, dtype=dtype, device=device))
    p.grad = torch.ones_like(p)
    scaler = scaler_for(device)
    scaler.scale(torch.ones((), device=device))  # creates the scale, as a step would
    try:
        scaler.unscale_(torch.optim.SGD([p], lr=0.0))
    except (NotImplementedError, RuntimeError, ValueError):  # fp16: "Attempting to unscale FP16 gradients"
        return False
    return True


def test_bf16_model_with_scaler_and_fp32_buffers(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).bfloat16()
    exact = reference_model(model)
    model = model.to(device)
    scaler = scaler_for(device, init_scale=2.0**12)
    x, y = pair(21, torch.float32)
    x, y = x.bfloat16(), y.bfloat16()

    def loss_fn(m, b):
        return F.mse_loss(m(b[0]).float(), b[1].float())

    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    before = snapshot(model, opt, scaler)
    if not _torch_scaler_unscales(torch.bfloat16, device):
        # torch's own GradScaler cannot unscale bf16 gradients here (its CUDA kernel): refused
        # before the first micro-batch, with the scaler named, and nothing changed.
        calls = []
        model.register_forward_pre_hook(lambda *_: calls.append(1))
        with pytest.raises(ValueError, match="scaler"):
            mbs_ext.step(model, opt, (x, y), loss_fn, micro_batch_size=4, scaler=scaler)
        assert calls == []
        assert_bit_identical(snapshot(model, opt, scaler), before)
        return
    res = mbs_ext.step(model, opt, (x, y), loss_fn, micro_batch_size=4, scaler=scaler)
    loss_fn(exact, (x.double(), y.double())).backward()
    assert not res.skipped and scaler.get_scale() == 2.0**12
    for p, q in zip(model.parameters(), exact.parameters(), strict=True):
        assert p.grad.dtype == torch.bfloat16
        assert rel_err(p.grad, q.grad) < 3e-2


def test_fp16_model_with_scaler_is_refused_before_any_micro_batch(device):
    # torch's GradScaler refuses to unscale fp16 gradients; that must be said up front, not
    # after every micro-batch has run.
    torch.manual_seed(0)
    calls = []
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).half().to(device)
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    scaler = scaler_for(device, init_scale=2.0**12)
    x, y = pair(21, torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = snapshot(model, opt, scaler)
    assert not _torch_scaler_unscales(torch.float16, device)  # the premise: torch's own refusal
    with pytest.raises(ValueError, match="scaler: .*fp16"):
        mbs_ext.step(model, opt, (x.half(), y.half()), lambda m, b: F.mse_loss(m(b[0]).float(), b[1].float()),
                     micro_batch_size=4, scaler=scaler)
    assert calls == []
    assert_bit_identical(snapshot(model, opt, scaler), before)


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


# --- the split ----------------------------------------------------------------------------------------


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

    res = mbs_ext.step(model, opt, batch, loss_fn, micro_batch_size=m)
    full_batch_step(ref, ropt, batch, mse)
    assert seen == balanced_sizes(n, m)
    assert res.num_micro_batches == len(seen)
    assert max(seen) <= res.micro_batch_size <= min(m, n)
    assert_models_match(model, ref, 1e-12)


def test_error_note_names_the_balanced_rows(device):
    model, opt, _, _ = twins(mlp(), device=device)
    with pytest.raises(Boom) as info:
        mbs_ext.step(model, opt, pair(10), failing_at(2, Boom, mse), micro_batch_size=4)
    assert any("micro-batch 2 of 3" in n and "[7, 10)" in n for n in info.value.__notes__)
