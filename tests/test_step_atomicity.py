"""A failed mbs_ext.step changes nothing: an exception at every micro-batch, a ring that fails
while staging, and the random-number state after a skipped or a failed step.

Tests taking ``device`` run on the CPU and, where a GPU exists, on CUDA: the model moves
to the device, the batch stays on the host, and the reference is a full-batch step of a
float64 copy of the model on the host (common.reference_model).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from common import (
    Boom,
    assert_bit_identical,
    assert_states_match,
    balanced_ranges,
    failing_at,
    mse,
    pair,
    scaler_for,
    snapshot,
)
from torch import nn

import mbs_ext


def rerun_tol(device):
    """Two runs of the same step: bit-identical on the CPU; CUDA kernels promise less."""
    return 0.0 if device == "cpu" else 1e-6


# --- atomicity --------------------------------------------------------------------------------


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(5, 6)
        self.bn = nn.BatchNorm1d(6)
        self.l2 = nn.Linear(6, 3)

    def forward(self, x):
        return self.l2(self.bn(self.l1(x)))


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


class Replacing(nn.Module):
    """Buffers a forward replaces instead of updating in place (``self.seen = self.seen + n``)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 3)
        self.register_buffer("seen", torch.zeros(()))
        self.register_buffer("ema", torch.zeros(5))

    def forward(self, x):
        self.seen = self.seen + len(x)
        self.ema = 0.9 * self.ema + 0.1 * x.detach().mean(0)
        return self.lin(x)


@pytest.mark.parametrize("outcome", ["failed", "skipped", "planned"])
def test_buffers_a_forward_replaces_are_put_back(outcome):
    """After a failed step, a skipped step and the planner's probes the model holds its own
    buffer tensors again, with their values."""
    torch.manual_seed(0)
    model = Replacing().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    originals = dict(model.named_buffers())
    before = snapshot(model, opt)
    x, y = pair(12)
    if outcome == "failed":
        with pytest.raises(Boom):
            mbs_ext.step(model, opt, (x, y), failing_at(2, Boom, mse), micro_batch_size=4)
    elif outcome == "skipped":
        y[11, 0] = float("nan")
        with pytest.warns(RuntimeWarning, match="skipped"):
            assert mbs_ext.step(model, opt, (x, y), mse, micro_batch_size=4).skipped
    else:
        mbs_ext.plan_micro_batch(model, (x, y), mse, memory_budget=2**30)
    assert all(b is originals[name] for name, b in model.named_buffers())
    assert_bit_identical(snapshot(model, opt), before)
    # A step that goes through keeps what its forwards made: 12 rows seen.
    mbs_ext.step(model, opt, (x, pair(12)[1]), mse, micro_batch_size=4)
    assert model.seen.item() == 12


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
    # Its rows are not known (the ring never handed it out): no stale rows of micro-batch 1.
    assert any("micro-batch 2 of 5, while the ring made it" in n for n in info.value.__notes__)
    assert not any("rows [" in n for n in info.value.__notes__)
    assert_bit_identical(snapshot(model, opt), before)


# --- random numbers ---------------------------------------------------------------------------


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
