"""Deferred-statistics BatchNorm: running statistics equal one full-batch nn.BatchNorm forward.

Tests taking ``device`` stream to the CPU and, where a GPU exists, to CUDA; the reference
is a plain nn.BatchNorm in float64 on the host.
"""

from __future__ import annotations

import copy
import sys
import warnings

import pytest
import torch
from common import rel_err, to_f64
from torch import nn

import mbs_ext
from mbs_ext.model.batchnorm import DeferredBatchNorm1d, DeferredBatchNorm2d, DeferredBatchNorm3d


class BNFirst(nn.Module):
    """BatchNorm on the raw input, so its statistics depend on the data only."""

    def __init__(self, bn: nn.Module, features: int):
        super().__init__()
        self.bn = bn
        self.head = nn.Linear(features, 2)

    def forward(self, x):
        y = self.bn(x)
        if y.dim() > 2:
            y = y.flatten(2).mean(-1)
        return self.head(y)


def loss_fn(model, x):
    return model(x).pow(2).mean()


CASES = {
    "1d_NC": (lambda **kw: nn.BatchNorm1d(3, **kw), (3,)),
    "1d_NCL": (lambda **kw: nn.BatchNorm1d(3, **kw), (3, 4)),
    "2d": (lambda **kw: nn.BatchNorm2d(3, **kw), (3, 2, 2)),
    "3d": (lambda **kw: nn.BatchNorm3d(3, **kw), (3, 2, 1, 2)),
}


@pytest.mark.parametrize("momentum", [0.1, 0.7, None])
@pytest.mark.parametrize("case", sorted(CASES))
def test_running_stats_equal_full_batch_forward(case, momentum, device):
    make, shape = CASES[case]
    torch.manual_seed(0)
    model = BNFirst(make(momentum=momentum), 3).double()
    ref_bn = copy.deepcopy(model.bn)
    mbs_ext.convert_batchnorm(model).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for n, m in [(8, 3), (5, 3), (10, 4)]:  # small N: the n/(n-1) correction matters
        x = torch.randn(n, *shape, generator=g, dtype=torch.float64) * 3 + 1
        mbs_ext.step(model, opt, x, loss_fn, micro_batch_size=m)
        ref_bn(x)
        assert model.bn.num_batches_tracked.item() == ref_bn.num_batches_tracked.item()
        assert rel_err(model.bn.running_mean, ref_bn.running_mean) <= 1e-12
        assert rel_err(model.bn.running_var, ref_bn.running_var) <= 1e-12


def test_unbiased_correction_is_over_the_whole_mini_batch(device):
    # A micro-batch-wise correction would give a measurably different running_var.
    torch.manual_seed(0)
    model = mbs_ext.convert_batchnorm(BNFirst(nn.BatchNorm1d(3, momentum=1.0), 3).double()).to(device)
    x = torch.randn(6, 3, dtype=torch.float64)
    mbs_ext.step(model, torch.optim.SGD(model.parameters(), lr=0.0), x, loss_fn, micro_batch_size=2)
    assert rel_err(model.bn.running_var, x.var(0, unbiased=True)) <= 1e-12
    assert rel_err(model.bn.running_var, x.var(0, unbiased=False)) > 0.1


def test_float32_running_stats(device):
    torch.manual_seed(0)
    model = BNFirst(nn.BatchNorm2d(3), 3)
    ref_bn = copy.deepcopy(model.bn).double()
    mbs_ext.convert_batchnorm(model).to(device)
    x = torch.randn(10, 3, 4, 4) * 2 + 5
    mbs_ext.step(model, torch.optim.SGD(model.parameters(), lr=0.1), x, loss_fn, micro_batch_size=3)
    ref_bn(to_f64(x))
    assert rel_err(model.bn.running_mean, ref_bn.running_mean) <= 1e-5
    assert rel_err(model.bn.running_var, ref_bn.running_var) <= 1e-5


@pytest.mark.parametrize("momentum", [0.1, None])
def test_outside_step_behaves_like_nn_batchnorm(momentum, device):
    torch.manual_seed(0)
    ref = nn.BatchNorm2d(4, momentum=momentum).to(device)
    with torch.no_grad():
        ref.weight.uniform_()
        ref.bias.uniform_()
    bn = mbs_ext.convert_batchnorm(copy.deepcopy(ref))
    assert isinstance(bn, DeferredBatchNorm2d)
    for _ in range(3):
        x = torch.randn(5, 4, 3, 3, device=device)
        assert torch.equal(bn(x), ref(x))
    bn.eval()
    ref.eval()
    x = torch.randn(2, 4, 3, 3, device=device)
    assert torch.equal(bn(x), ref(x))
    for a, b in zip(bn.buffers(), ref.buffers(), strict=True):
        assert torch.equal(a, b)


def test_state_dict_compatible_both_ways():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Conv2d(1, 2, 1), nn.BatchNorm2d(2))
    plain[1](torch.randn(6, 4))
    converted = mbs_ext.convert_batchnorm(copy.deepcopy(plain))
    assert list(converted.state_dict()) == list(plain.state_dict())
    fresh_plain = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Conv2d(1, 2, 1), nn.BatchNorm2d(2))
    fresh_plain.load_state_dict(converted.state_dict(), strict=True)
    fresh_conv = mbs_ext.convert_batchnorm(
        nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Conv2d(1, 2, 1), nn.BatchNorm2d(2))
    )
    fresh_conv.load_state_dict(plain.state_dict(), strict=True)
    for sd in (fresh_plain.state_dict(), fresh_conv.state_dict()):
        for k, v in plain.state_dict().items():
            assert torch.equal(sd[k], v), k


def test_convert_shares_parameters_and_keeps_dtype_and_flags():
    bn = nn.BatchNorm1d(4, eps=1e-3, momentum=0.3).double()
    bn.eval()
    model = nn.Sequential(nn.Linear(2, 4).double(), bn, nn.SyncBatchNorm(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    weight = bn.weight
    out = mbs_ext.convert_batchnorm(model)
    assert out is model
    assert isinstance(model[1], DeferredBatchNorm1d) and type(model[2]) is nn.SyncBatchNorm
    assert model[1].weight is weight and model[1].weight.dtype == torch.float64
    assert model[1].running_mean.dtype == torch.float64
    assert (model[1].eps, model[1].momentum, model[1].training) == (1e-3, 0.3, False)
    assert any(p is weight for g in opt.param_groups for p in g["params"])
    assert isinstance(mbs_ext.convert_batchnorm(nn.BatchNorm3d(2)), DeferredBatchNorm3d)


def test_no_affine_and_no_running_stats(device):
    model = mbs_ext.convert_batchnorm(
        nn.Sequential(
            nn.Linear(3, 4), nn.BatchNorm1d(4, affine=False), nn.BatchNorm1d(4, track_running_stats=False)
        )
    )
    model.double()
    x = torch.randn(8, 3, dtype=torch.float64)
    ref = copy.deepcopy(model)
    model.to(device)
    mbs_ext.step(model, torch.optim.SGD(model.parameters(), lr=0.1), x, loss_fn_seq, micro_batch_size=8)
    ref(x)
    assert rel_err(model[1].running_var, ref[1].running_var) <= 1e-12
    assert model[2].running_mean is None


def loss_fn_seq(model, x):
    return model(x).pow(2).mean()


def test_convert_rejects_non_module():
    with pytest.raises(TypeError, match="module"):
        mbs_ext.convert_batchnorm("bn")


def test_cumulative_average_in_bf16_keeps_counting(device):
    # momentum=None averages every mini-batch with weight 1/n; in bf16 arithmetic 1 - 1/n
    # rounds to 1 once n passes a few hundred and later batches would stop counting.
    layer = mbs_ext.convert_batchnorm(nn.BatchNorm1d(2, momentum=None)).to(device=device, dtype=torch.bfloat16)
    means = []
    for k in range(600):
        shift = 0.0 if k < 300 else 4.0  # the second half moves the true average
        x = (torch.randn(16, 2, generator=torch.Generator().manual_seed(k)) + shift).to(device, torch.bfloat16)
        layer.begin_mini_batch()
        layer(x)
        layer.commit()
        means.append(x.double().mean(0).cpu())
    expected = torch.stack(means).mean(0)
    assert torch.allclose(layer.running_mean.double().cpu(), expected, rtol=2e-2, atol=2e-2), (
        layer.running_mean, expected,
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_plain_batchnorm_is_deferred_by_default(case, device):
    """Without convert_batchnorm a step still commits running statistics once per mini-batch,
    exactly as the converted layer does, and the layer keeps its own class."""
    make, shape = CASES[case]
    torch.manual_seed(0)
    plain = BNFirst(make(momentum=0.1), 3).double()
    converted = mbs_ext.convert_batchnorm(copy.deepcopy(plain))
    ref_bn = copy.deepcopy(plain.bn)
    plain.to(device)
    converted.to(device)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, converted)]
    g = torch.Generator().manual_seed(1)
    for n, m in [(8, 3), (10, 4)]:
        x = torch.randn(n, *shape, generator=g, dtype=torch.float64) * 3 + 1
        for model, opt in zip((plain, converted), opts):
            mbs_ext.step(model, opt, x, loss_fn, micro_batch_size=m)
        ref_bn(x)
    assert type(plain.bn) is type(ref_bn)  # still a plain nn.BatchNorm after the steps
    assert plain.bn.num_batches_tracked.item() == 2  # once per mini-batch, not per micro-batch
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        a, b = getattr(plain.bn, name), getattr(converted.bn, name)
        assert torch.equal(a, b), name
        assert rel_err(a, getattr(ref_bn, name)) < 1e-12, name
    # Outside a step it is an ordinary BatchNorm again: one forward, one update.
    plain.bn(torch.randn(4, *shape, dtype=torch.float64, device=device))
    assert plain.bn.num_batches_tracked.item() == 3


def test_batchnorm_class_restored_when_a_step_fails():
    model = BNFirst(nn.BatchNorm1d(3), 3).double()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def failing(m, x):
        raise RuntimeError("injected")

    with pytest.raises(RuntimeError, match="injected"):
        mbs_ext.step(model, opt, torch.randn(6, 3, dtype=torch.float64), failing, micro_batch_size=2)
    assert type(model.bn) is nn.BatchNorm1d
    assert not hasattr(model.bn, "_pending")
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_batchnorm_classes_restored_when_a_deferral_fails_midway(monkeypatch):
    """The second layer's deferral fails: the first and the failing one get their own class back."""
    from mbs_ext.model.batchnorm import deferring

    model = nn.Sequential(nn.BatchNorm1d(3), nn.Linear(3, 3), nn.BatchNorm1d(3), nn.BatchNorm1d(3))
    calls = []

    def init(self):
        calls.append(self)
        if len(calls) == 2:
            raise KeyboardInterrupt("injected")

    monkeypatch.setattr(DeferredBatchNorm1d, "_deferred_init", init)
    with pytest.raises(KeyboardInterrupt, match="injected"):
        with deferring(model, list(model.modules())):
            pass
    assert [type(m) for m in model] == [nn.BatchNorm1d, nn.Linear, nn.BatchNorm1d, nn.BatchNorm1d]


def test_sync_batchnorm_in_one_process_steps_as_batchnorm():
    """nn.SyncBatchNorm in a streamed step: statistics across ranks where there are ranks
    (tests/test_batchnorm_ranks.py); in one process, those of each micro-batch, running
    statistics deferred, as nn.BatchNorm; its own class again afterwards."""
    x = torch.randn(6, 3, dtype=torch.float64)
    got = BNFirst(nn.SyncBatchNorm(3), 3).double()
    want = BNFirst(nn.BatchNorm1d(3), 3).double()
    want.load_state_dict(got.state_dict())
    for model in (got, want):
        with pytest.warns(mbs_ext.BatchNormWarning, match=r"bn \((Sync)?BatchNorm"):
            mbs_ext.step(model, torch.optim.SGD(model.parameters(), lr=0.1), x, loss_fn, micro_batch_size=2)
    assert type(got.bn) is nn.SyncBatchNorm
    for k, v in want.state_dict().items():
        assert torch.equal(got.state_dict()[k], v), k


# ---- the warning: a split through BatchNorm in training is not the full batch ----


def _bn_gradients(model, x, micro_batch_size):
    """The gradients of one ``mbs_ext.accumulate`` over ``x`` (BatchNorm warnings recorded)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mbs_ext.accumulate(model, x, loss_fn, micro_batch_size=micro_batch_size)
    return [p.grad.clone() for p in model.parameters()], [w for w in caught if w.category is mbs_ext.BatchNormWarning]


def test_split_through_batchnorm_in_training_warns_once_per_model_naming_the_fix():
    """Streamed in several micro-batches, a real nn.BatchNorm1d in training normalizes each with
    its own statistics, so the gradient is not the full batch's: the step says so once per model,
    at the caller's line, naming the layer, what differs and how to silence it."""
    torch.manual_seed(0)
    model = BNFirst(nn.BatchNorm1d(3), 3).double()
    x = torch.randn(12, 3, dtype=torch.float64) * 3 + 1
    full, none = _bn_gradients(copy.deepcopy(model), x, micro_batch_size=12)  # one micro-batch: exact
    assert none == []
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with pytest.warns(mbs_ext.BatchNormWarning) as caught:
        line = sys._getframe().f_lineno + 1
        mbs_ext.step(model, opt, x, loss_fn, micro_batch_size=4)
    (w,) = [c for c in caught if c.category is mbs_ext.BatchNormWarning]
    assert (w.filename, w.lineno) == (__file__, line)
    text = str(w.message)
    assert "3 micro-batches" in text and "batch statistics, bn (BatchNorm1d):" in text and "its own statistics" in text
    assert "gradients differ from one full-batch step" in text
    assert 'warnings.filterwarnings("ignore", category=mbs_ext.BatchNormWarning)' in text
    assert "eval mode" in text and "docs/known-issues.md" in text
    streamed = [p.grad for p in model.parameters()]
    assert any(rel_err(a, b) > 1e-3 for a, b in zip(streamed, full))  # what the warning says
    _, later = _bn_gradients(model, x, micro_batch_size=4)
    assert later == []  # once per model
    assert _bn_gradients(copy.deepcopy(model), x, micro_batch_size=4)[1] != []  # another model is told


def test_no_batchnorm_warning_where_the_step_is_the_full_batchs():
    """No warning where nothing differs: one micro-batch, BatchNorm in eval mode (running
    statistics), or no BatchNorm. A BatchNorm without running statistics normalizes with batch
    statistics even in eval mode, and warns. ``warnings.filterwarnings`` silences it."""
    torch.manual_seed(0)
    x = torch.randn(12, 3, dtype=torch.float64)
    assert _bn_gradients(BNFirst(nn.BatchNorm1d(3), 3).double(), x, micro_batch_size=12)[1] == []
    assert _bn_gradients(BNFirst(nn.BatchNorm1d(3), 3).double().eval(), x, micro_batch_size=4)[1] == []
    assert _bn_gradients(BNFirst(nn.Identity(), 3).double(), x, micro_batch_size=4)[1] == []
    eval_bn = BNFirst(nn.BatchNorm1d(3, track_running_stats=False), 3).double().eval()  # no running statistics
    assert len(_bn_gradients(eval_bn, x, micro_batch_size=4)[1]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=mbs_ext.BatchNormWarning)
        mbs_ext.accumulate(BNFirst(nn.BatchNorm1d(3), 3).double(), x, loss_fn, micro_batch_size=4)


def _calls(layers: list[nn.Module], device: str) -> None:
    """Micro-batches of 5, 5 and 3 rows; layer 2 is called twice per micro-batch, on all
    positions and on the first one only (its calls' shares differ from the others')."""
    g = torch.Generator().manual_seed(3)
    for rows in (5, 5, 3):
        x = (torch.randn(rows, 4, 6, generator=g) * 3 + 1).to(device)
        for i, layer in enumerate(layers):
            y = x.to(layer.running_mean.dtype)
            layer(y)
            if i == 2:
                layer(y[:, :, :1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_layers_committed_together_equal_each_committed_alone(dtype, device):
    """commit_all groups layers whose calls split the mini-batch alike and updates their running
    statistics with multi-tensor operations; each layer's own commit() is the reference."""
    from mbs_ext.model.batchnorm_rows import commit_all

    def layers():
        torch.manual_seed(0)
        made = [nn.BatchNorm1d(4, momentum=0.1), nn.BatchNorm1d(4, momentum=0.1), nn.BatchNorm1d(4, momentum=0.1),
                nn.BatchNorm1d(4, momentum=0.5), nn.BatchNorm1d(4, momentum=None), nn.BatchNorm1d(4)]
        made = [mbs_ext.convert_batchnorm(m).to(device, dtype) for m in made]
        made[-1].to(torch.bfloat16)  # narrower running buffers: statistics merged call by call
        for m in made:
            m.running_mean.uniform_(-1, 1)
            m.begin_mini_batch()
        return made

    together, alone = layers(), layers()
    for group in (together, alone):
        with torch.no_grad():
            _calls(group, device)
    commit_all(together)
    for layer in alone:
        layer.commit()
    for a, b in zip(together, alone):
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            tol = 1e-2 if a.running_mean.dtype == torch.bfloat16 else 1e-6 if dtype == torch.float32 else 1e-12
            assert rel_err(getattr(a, name).double(), getattr(b, name).double()) <= tol, name
        assert not a._collecting and a._pending is None and not a._counts


def test_rows_are_zeroed_after_a_discarded_mini_batch(device):
    """A discarded mini-batch (rollback, probe) leaves no statistics in the rows: the next
    mini-batch's running statistics equal a fresh layer's."""
    torch.manual_seed(0)
    used, fresh = (mbs_ext.convert_batchnorm(nn.BatchNorm1d(4)).to(device) for _ in range(2))
    used.begin_mini_batch()
    used(torch.full((3, 4), float("nan"), device=device))
    used.discard()
    x = torch.randn(6, 4, device=device)
    for layer in (used, fresh):
        layer.begin_mini_batch()
        layer(x[:3])
        layer(x[3:])
        layer.commit()
    torch.testing.assert_close(used.running_var, fresh.running_var)
    torch.testing.assert_close(used.running_mean, fresh.running_mean)


class _Twice(nn.Module):
    """Three BatchNorm layers on the raw input (their statistics depend on the data only), the
    second called twice per forward (on all positions, then on the first only), the third with a
    cumulative average: compaction must pool each alike."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.BatchNorm1d(3), nn.BatchNorm1d(3, momentum=0.3), nn.BatchNorm1d(3, momentum=None)
        self.head = nn.Linear(3, 1)

    def forward(self, x):
        y = self.a(x) + self.b(x) + self.b(x[:, :, :1]) + self.c(x)
        return self.head(y.mean(-1))


@pytest.mark.parametrize(("rows", "m"), [(203, 3), (70, 2)])
def test_running_stats_stay_exact_and_rows_stay_bounded_over_many_micro_batches(rows, m, device):
    """Steps of more micro-batches than the rows fold every (68 and 35 micro-batches, uneven
    ones among them): the running statistics still equal one full-batch forward (for the layer
    called twice: its running buffers updated once from both calls' values pooled), and each
    layer's rows hold at most ``1 + FOLD_EVERY x calls per micro-batch`` (rounded up to a power of
    two), however many micro-batches the step streams."""
    from mbs_ext.diagnostics import BATCHNORM_FOLD_EVERY, batchnorm_held_rows

    torch.manual_seed(0)
    model = _Twice().double()
    ref = copy.deepcopy(model)
    model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    g = torch.Generator().manual_seed(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mbs_ext.BatchNormWarning)
        for _ in range(2):
            x = torch.randn(rows, 3, 4, generator=g, dtype=torch.float64) * 2 + 1
            mbs_ext.step(model, opt, x, lambda mdl, mb: mdl(mb).pow(2).mean(), micro_batch_size=m)
            ref.a(x)
            ref.c(x)
            pooled = torch.cat([x, x[:, :, :1]], dim=2).transpose(0, 1).reshape(3, -1)
            with torch.no_grad():
                ref.b.running_mean.mul_(0.7).add_(0.3 * pooled.mean(1))
                ref.b.running_var.mul_(0.7).add_(0.3 * pooled.var(1))
                ref.b.num_batches_tracked.add_(1)
            for name in ("a", "b", "c"):
                got, want = getattr(model, name), getattr(ref, name)
                assert got.num_batches_tracked.item() == want.num_batches_tracked.item()
                assert rel_err(got.running_mean.cpu(), want.running_mean) <= 1e-12, name
                assert rel_err(got.running_var.cpu(), want.running_var) <= 1e-12, name
            for layer, calls in ((model.a, 1), (model.b, 2), (model.c, 1)):
                bound = 1 << (1 + BATCHNORM_FOLD_EVERY * calls - 1).bit_length()
                assert 0 < batchnorm_held_rows(layer) <= max(8, bound), (calls, batchnorm_held_rows(layer))
