"""mbs_ext.step in reduced and mixed precision and with non-finite values: GradScaler, bf16 and
fp16 parameters, float32 accumulation, autocast, clipping, the non-finite policy.

Tests taking ``device`` run on the CPU and, where a GPU exists, on CUDA: the model moves
to the device, the batch stays on the host, and the reference is a full-batch step of a
float64 copy of the model on the host (common.reference_model).
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from common import (
    PoisonGrad,
    assert_bit_identical,
    assert_models_match,
    full_batch_step,
    mlp,
    mse,
    pair,
    reference_model,
    rel_err,
    scaler_for,
    snapshot,
    to_f64,
    twins,
)
from torch import nn

import mbs_ext

# --- clipping ---------------------------------------------------------------------------------


def test_clipping_matches_clip_grad_norm(device):
    model, opt, ref, ropt = twins(mlp(), device=device)
    batch = pair(10)
    res = mbs_ext.step(model, opt, batch, mse, micro_batch_size=4, max_grad_norm=0.05)
    _, ref_norm = full_batch_step(ref, ropt, batch, mse, max_grad_norm=0.05)
    assert ref_norm.item() > 0.05  # clipping is active
    assert abs(res.grad_norm - ref_norm.item()) <= 1e-12 * ref_norm.item()
    assert_models_match(model, ref, 1e-12)


# --- mixed precision --------------------------------------------------------------------------


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


# --- non-finite policy ------------------------------------------------------------------------


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


@pytest.mark.parametrize("bad", ["loss", "gradient"])
def test_accumulate_raise_on_nonfinite_keeps_the_callers_gradients(bad, device):
    """accumulate takes the step's non-finite policy: by default it skips (the caller's gradients
    as they were, ``skipped=True``, a warning); asked to raise, it raises, the gradients as they were."""
    model, _, _, _ = twins(mlp(), device=device)
    mbs_ext.accumulate(model, pair(10), mse, micro_batch_size=4)
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    x, y = pair(10, seed=3)
    if bad == "loss":
        y[9, 0] = float("nan")
        loss_fn = mse
    else:
        def loss_fn(m, b):
            return ((PoisonGrad.apply(m(b[0]), math.inf) - b[1].to(device)) ** 2).mean()
    with pytest.raises(FloatingPointError, match=f"non-finite {bad}"):
        mbs_ext.accumulate(model, (x, y), loss_fn, micro_batch_size=4, on_nonfinite="raise")
    assert all(torch.equal(p.grad, before[n]) for n, p in model.named_parameters())
    with pytest.warns(RuntimeWarning, match=f"non-finite {bad}"):
        res = mbs_ext.accumulate(model, (x, y), loss_fn, micro_batch_size=4)  # "skip"
    assert res.skipped and all(torch.equal(p.grad, before[n]) for n, p in model.named_parameters())


def _overflowing_sum(dtype: torch.dtype, device) -> tuple[nn.Module, torch.Tensor]:
    """A weight of 0 and rows of 2e38: every micro-batch's loss (0) and gradient (2e38) are
    finite, their float32 sum (4e38) is not."""
    model = nn.Linear(1, 1, bias=False).to(device=device, dtype=dtype)
    with torch.no_grad():
        model.weight.zero_()
    return model, torch.full((3, 1), 2e38, dtype=dtype)


def _sum_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x.to(model.weight.device)).float().sum()


@pytest.mark.parametrize("on_nonfinite", ["skip", "raise"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_an_overflowing_sum_of_finite_gradients_is_not_stepped(dtype, on_nonfinite, device):
    """bf16 parameters accumulate in float32 buffers: a sum that overflows there is skipped or
    raised exactly as float32 parameters' own .grad sum is (the reference), never stepped."""
    model, x = _overflowing_sum(dtype, device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = snapshot(model, opt)
    kwargs = dict(micro_batch_size=1, normalize="sum", on_nonfinite=on_nonfinite)
    if on_nonfinite == "raise":
        with pytest.raises(FloatingPointError, match="non-finite"):
            mbs_ext.step(model, opt, x, _sum_loss, **kwargs)
    else:
        with pytest.warns(RuntimeWarning, match="skipped"):
            res = mbs_ext.step(model, opt, x, _sum_loss, **kwargs)
        assert res.skipped and res.loss == 0.0
    assert_bit_identical(snapshot(model, opt), before)


def test_nonfinite_raise(device):
    model, opt, _, _ = twins(mlp(), device=device)
    before = snapshot(model, opt)
    x, y = pair(10)
    x[2, 0] = float("inf")
    with pytest.raises(FloatingPointError):
        mbs_ext.step(model, opt, (x, y), mse, micro_batch_size=4, on_nonfinite="raise", max_grad_norm=1.0)
    assert_bit_identical(snapshot(model, opt), before)
    assert all(p.grad is None for p in model.parameters())
