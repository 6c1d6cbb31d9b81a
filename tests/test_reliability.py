"""Injected faults: every failure point leaves parameters, optimizer, scaler and
BatchNorm state bit-identical, and leaves no worker thread behind.

Every test runs with the model on the CPU and, where a GPU exists, on CUDA (the batch
stays on the host and streams through the ring).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from common import assert_bit_identical, assert_states_match, balanced_ranges, scaler_for, snapshot
from torch import nn

import mbs_ext
from mbs_ext.diagnostics import RING_PRODUCER_THREAD, os_threads

N, M = 11, 3  # four micro-batches: 3, 3, 3, 2 rows
NUM_MB = 4
assert len(balanced_ranges(N, M)) == NUM_MB


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(5, 6)
        self.bn = nn.BatchNorm1d(6)
        self.l2 = nn.Linear(6, 3)

    def forward(self, x):
        return self.l2(torch.tanh(self.bn(self.l1(x))))


def batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, 5, generator=g), torch.randn(N, 3, generator=g)


def mse(model, mb):
    return F.mse_loss(model(mb[0]), mb[1])


def setup(device: str, deferred: bool = True):
    torch.manual_seed(0)
    model = Net()
    if deferred:
        model = mbs_ext.convert_batchnorm(model)
    model = model.to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = scaler_for(device, init_scale=2.0**6, growth_interval=1)
    mbs_ext.step(model, opt, batch(7), mse, micro_batch_size=M, scaler=scaler)  # non-trivial state
    return model, opt, scaler


class Injected(Exception):
    pass


def _assert_untouched_then_fresh_equivalent(model, opt, scaler, before, fresh):
    assert_bit_identical(snapshot(model, opt, scaler), before)
    assert all(p.grad is None for p in model.parameters())
    mbs_ext.step(model, opt, batch(), mse, micro_batch_size=M, scaler=scaler)
    f_model, f_opt, f_scaler = fresh
    mbs_ext.step(f_model, f_opt, batch(), mse, micro_batch_size=M, scaler=f_scaler)
    # Two runs of one step: bit-identical on the CPU; CUDA kernels promise less.
    tol = 0.0 if next(model.parameters()).device.type == "cpu" else 1e-6
    assert_states_match(snapshot(model, opt, scaler), snapshot(f_model, f_opt, f_scaler), tol)


@pytest.mark.parametrize("exc_type", [Injected, KeyboardInterrupt])
@pytest.mark.parametrize("fail_at", range(NUM_MB))
def test_exception_inside_the_model(fail_at, exc_type, device):
    model, opt, scaler = setup(device)
    fresh = copy.deepcopy((model, opt, scaler))
    before = snapshot(model, opt, scaler)
    calls = []

    def hook(module, args):
        calls.append(1)
        if len(calls) == fail_at + 1:
            raise exc_type("injected inside the model")

    handle = model.l2.register_forward_pre_hook(hook)
    start_threads = os_threads(RING_PRODUCER_THREAD)
    with pytest.raises(exc_type) as info:
        mbs_ext.step(model, opt, batch(), mse, micro_batch_size=M, scaler=scaler)
    handle.remove()
    assert any(f"micro-batch {fail_at} of {NUM_MB}" in note for note in info.value.__notes__)
    assert os_threads(RING_PRODUCER_THREAD) == start_threads, "a worker thread outlived the failed step"
    _assert_untouched_then_fresh_equivalent(model, opt, scaler, before, fresh)


@pytest.mark.parametrize("fail_at", range(NUM_MB))
def test_exception_in_backward(fail_at, device):
    model, opt, scaler = setup(device)
    fresh = copy.deepcopy((model, opt, scaler))
    before = snapshot(model, opt, scaler)
    calls = []

    def grad_hook(grad):
        calls.append(1)
        if len(calls) == fail_at + 1:
            raise Injected("injected in backward")
        return grad

    handle = model.l1.weight.register_hook(grad_hook)
    with pytest.raises(Injected):
        mbs_ext.step(model, opt, batch(), mse, micro_batch_size=M, scaler=scaler)
    handle.remove()
    _assert_untouched_then_fresh_equivalent(model, opt, scaler, before, fresh)


@pytest.mark.parametrize("deferred", [True, False])
@pytest.mark.parametrize("bad_at", range(NUM_MB))
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nonfinite_loss_at_every_micro_batch_skips(bad_at, value, deferred, device):
    model, opt, _ = setup(device, deferred)
    before = snapshot(model, opt)
    calls = []

    def loss_fn(m, mb):
        calls.append(1)
        loss = mse(m, mb)
        return loss * value if len(calls) == bad_at + 1 else loss

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = mbs_ext.step(model, opt, batch(), loss_fn, micro_batch_size=M)
    assert result.skipped
    assert any("non-finite" in str(w.message) for w in caught)
    after = snapshot(model, opt)
    assert_bit_identical(after, before)


@pytest.mark.parametrize("bad_at", range(NUM_MB))
@pytest.mark.parametrize("element", [0, -1])
def test_nonfinite_gradient_element_of_last_parameter_skips(bad_at, element, device):
    model, opt, _ = setup(device)
    before = snapshot(model, opt)
    last = list(model.parameters())[-1]
    calls = []

    def poison(grad):
        calls.append(1)
        if len(calls) == bad_at + 1:
            grad = grad.clone()
            grad.view(-1)[element] = float("inf")
        return grad

    handle = last.register_hook(poison)
    with pytest.warns(RuntimeWarning, match="non-finite gradient"):
        result = mbs_ext.step(model, opt, batch(), mse, micro_batch_size=M)
    handle.remove()
    assert result.skipped
    assert_bit_identical(snapshot(model, opt), before)
    with pytest.raises(FloatingPointError):
        handle = last.register_hook(poison)
        calls.clear()
        mbs_ext.step(model, opt, batch(), mse, micro_batch_size=M, on_nonfinite="raise")
    handle.remove()
    assert_bit_identical(snapshot(model, opt), before)


def test_interrupted_streams_leave_no_threads(device):
    model, opt, scaler = setup(device)
    start = os_threads(RING_PRODUCER_THREAD)
    for k in range(30):
        calls = []

        def loss_fn(m, mb, k=k, calls=calls):
            calls.append(1)
            if len(calls) == k % NUM_MB + 1:
                raise KeyboardInterrupt
            return mse(m, mb)

        with pytest.raises(KeyboardInterrupt):
            mbs_ext.step(model, opt, batch(), loss_fn, micro_batch_size=M)
    assert os_threads(RING_PRODUCER_THREAD) == start  # no stream's worker outlives it


def test_skipped_step_with_clipping_keeps_the_offending_gradient(device):
    model, opt, _ = setup(device)
    before = snapshot(model, opt)
    last = list(model.parameters())[-1]

    def poison(grad):
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad

    handle = last.register_hook(poison)
    with pytest.warns(RuntimeWarning, match="non-finite gradient"):
        result = mbs_ext.step(model, opt, batch(), mse, micro_batch_size=M, max_grad_norm=1.0)
    handle.remove()
    assert result.skipped
    assert torch.isinf(last.grad.view(-1)[0]) and torch.isfinite(last.grad.view(-1)[1:]).all()
    assert_bit_identical(snapshot(model, opt), before)
