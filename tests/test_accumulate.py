"""mbs_ext.accumulate: the step without the update, for code that owns the optimizer step."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from common import assert_bit_identical, failing_at, rel_err, snapshot, token_count
from torch import nn

import mbs_ext


def model_and_data(device, n=23, seed=0, bn=False):
    """A classifier; with ``bn`` its BatchNorm sees the same inputs streamed or not (it follows
    the first layer), so its running statistics can be compared with one full-batch forward."""
    torch.manual_seed(seed)
    norm = nn.BatchNorm1d(8) if bn else nn.Identity()
    model = nn.Sequential(nn.Linear(5, 8), norm, nn.Tanh(), nn.Linear(8, 3)).double().to(device)
    g = torch.Generator().manual_seed(seed + 1)
    return model, (torch.randn(n, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g))


def ce(model, b):
    return F.cross_entropy(model(b[0]), b[1])


@pytest.mark.parametrize("m", [4, 7])
def test_gradients_equal_one_full_batch_backward(m, device):
    model, batch = model_and_data(device)
    ref = copy.deepcopy(model).cpu()
    r = mbs_ext.accumulate(model, batch, ce, micro_batch_size=m)
    loss = ce(ref, batch)
    loss.backward()
    assert abs(r.loss - loss.item()) <= 1e-12 * abs(loss.item())
    for p, q in zip(model.parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad) <= 1e-12


def test_running_statistics_committed_once(device):
    model, batch = model_and_data(device, bn=True)
    ref = copy.deepcopy(model).cpu()
    mbs_ext.accumulate(model, batch, ce, micro_batch_size=4)
    ref(batch[0])
    assert model[1].num_batches_tracked.item() == ref[1].num_batches_tracked.item() == 1
    assert rel_err(model[1].running_mean, ref[1].running_mean) <= 1e-12
    assert rel_err(model[1].running_var, ref[1].running_var) <= 1e-12


def test_accumulate_then_optimizer_step_equals_step(device):
    model, batch = model_and_data(device, bn=True)
    twin = copy.deepcopy(model)
    opt, topt = torch.optim.AdamW(model.parameters()), torch.optim.AdamW(twin.parameters())
    for _ in range(3):
        mbs_ext.accumulate(model, batch, ce, micro_batch_size=5)
        opt.step()
        mbs_ext.step(twin, topt, batch, ce, micro_batch_size=5)
    assert_bit_identical(snapshot(model, opt), snapshot(twin, topt))


def test_token_counts_and_replacing_old_grads(device):
    from common import TinyLM, lm_loss

    torch.manual_seed(0)
    model = TinyLM().double().to(device)
    ref = copy.deepcopy(model).cpu()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 11, (9, 6), generator=g)
    labels = torch.where(torch.rand(9, 6, generator=g) < 0.4, -100, torch.roll(ids, -1, 1))
    batch = {"ids": ids, "labels": labels}
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)  # replaced, not added to
    mbs_ext.accumulate(model, batch, lm_loss, micro_batch_size=2, normalize=token_count)
    lm_loss(ref, batch).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad) <= 1e-12


@pytest.mark.parametrize("fail_at", [0, 2, 4])
def test_failure_leaves_grads_and_buffers_as_before(fail_at, device):
    model, batch = model_and_data(device, bn=True)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    grads = [p.grad.clone() for p in model.parameters()]
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="injected") as info:
        mbs_ext.accumulate(model, batch, failing_at(fail_at, RuntimeError, ce), micro_batch_size=5)
    assert any(f"micro-batch {fail_at} of 5" in n for n in getattr(info.value, "__notes__", []))
    assert_bit_identical(snapshot(model), before)
    for p, g in zip(model.parameters(), grads):
        assert torch.equal(p.grad, g)


def test_clipping_is_the_callers_and_scaled_grads_stay_scaled(device):
    model, batch = model_and_data(device)
    with pytest.raises(ValueError, match="max_grad_norm.*clip in your own step"):
        mbs_ext.accumulate(model, batch, ce, micro_batch_size=5, max_grad_norm=1.0)
    ref = copy.deepcopy(model)
    scaler = torch.amp.GradScaler(torch.device(device).type, init_scale=8.0)
    mbs_ext.accumulate(model, batch, ce, micro_batch_size=5, scaler=scaler)
    mbs_ext.accumulate(ref, batch, ce, micro_batch_size=5)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert rel_err(p.grad, 8.0 * q.grad) <= 1e-12


def test_non_finite_loss_is_skipped_and_said_not_left_silently_in_grad():
    """A NaN in the data: ``accumulate`` takes the step's policy - by default the micro-batches'
    gradients are not added (``.grad`` stays as the caller had it), ``skipped=True``, and a warning
    names the micro-batch; ``on_nonfinite="raise"`` raises, leaving ``.grad`` as it was too."""
    import warnings

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1).double()
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64)
    model.weight.grad = torch.full_like(model.weight, 0.5)  # the caller's gradients so far
    x[5, 1] = float("nan")
    with pytest.warns(RuntimeWarning, match=r"non-finite loss at micro-batch 2 of 4 \(rows \[4, 6\)"):
        result = mbs_ext.accumulate(model, (x, y), torch.nn.MSELoss(), micro_batch_size=2)
    assert math.isnan(result.loss) and result.skipped
    assert torch.equal(model.weight.grad, torch.full_like(model.weight, 0.5)) and model.bias.grad is None
    with pytest.raises(FloatingPointError, match="non-finite loss"):
        mbs_ext.accumulate(model, (x, y), torch.nn.MSELoss(), micro_batch_size=2, on_nonfinite="raise")
    assert torch.equal(model.weight.grad, torch.full_like(model.weight, 0.5)) and model.bias.grad is None
    x[5, 1] = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a finite mini-batch says nothing
        assert not mbs_ext.accumulate(model, (x, y), torch.nn.MSELoss(), micro_batch_size=2).skipped
