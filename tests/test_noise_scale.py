"""The gradient noise scale a step measures from its own micro-batches (``noise_scale=True``).

The reference is independent of the step: per-example gradients of a float64 model from
``torch.func`` (``vmap(grad)``) at the step's fixed weights. For one split they give every
micro-batch's mean gradient ``g_j`` and the mini-batch's ``G_B`` exactly, so the step's
``S = (sum_j b_j |g_j|^2 - B |G_B|^2) / (m - 1)`` and ``|G|^2 = |G_B|^2 - S / B`` must match to
1e-10; over random splits (rows drawn in a random order through ``indices=``), the mean of ``S``
must meet the trace of the per-example gradients' sample covariance (denominator ``B - 1``),
for which it is unbiased at any micro-batch sizes (docs/noise-scale.md), within four standard
errors of that mean (a seeded statistical test).
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils.checkpoint import checkpoint

import mbs_ext
from mbs_ext.diagnostics import split_sizes

CLASSES = 3


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, CLASSES)).double()


def _batch(n: int, seed: int = 1, ignored: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    if ignored:
        y[torch.rand(n, generator=g) < ignored] = -100
    return x, y


def _per_example(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each row's gradient of its own cross entropy, flattened (rows x parameters)."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(p: dict, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    grads = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
    return torch.cat([grads[k].reshape(len(x), -1) for k in params], 1)


def _expected(per: torch.Tensor, valid: torch.Tensor, sizes: list[int]) -> tuple[float, float]:
    """S and |G|^2 of one split of rows (``sizes``, in order), items = the valid rows; micro-batches
    with no valid row take no part (over random splits the estimate is unbiased over the others)."""
    per = per * valid[:, None]
    groups = [(part.sum(0), int(v.sum())) for part, v in zip(per.split(sizes), valid.split(sizes))]
    items = sum(c for _, c in groups)
    g_b = per.sum(0) / items
    micro = sum((s / c).square().sum() * c for s, c in groups if c)
    m = sum(1 for _, c in groups if c)  # a micro-batch of no items is not one of the split's groups
    trace = (micro - items * g_b.square().sum()) / (m - 1)
    return float(trace), float(g_b.square().sum() - trace / items)


@pytest.mark.parametrize("ignored", [0.0, 0.3], ids=["rows", "ignored_targets"])
@pytest.mark.parametrize("m", [5, 7, 23 // 2])
def test_one_split_matches_the_per_example_gradients(m, ignored):
    """Unequal micro-batches (23 rows), counted by rows or by the targets a loss does not ignore."""
    model = _model()
    x, y = _batch(23, ignored=ignored)
    valid = (y != -100).double()
    per = torch.where(valid.bool()[:, None], _per_example(model, x, y.clamp(min=0)), 0.0)
    result = mbs_ext.accumulate(model, (x, y), nn.CrossEntropyLoss(), micro_batch_size=m, noise_scale=True)
    sizes = split_sizes(23, m)
    trace, grad_sq = _expected(per, valid, sizes)
    noise = result.noise
    assert noise.micro_batches == len(sizes) and noise.items == valid.sum()
    assert math.isclose(noise.trace, trace, rel_tol=1e-10), (noise.trace, trace)
    assert math.isclose(noise.grad_sq, grad_sq, rel_tol=1e-10, abs_tol=1e-14), (noise.grad_sq, grad_sq)
    # The gradient the step left is the mini-batch's: G_B, whose squared norm the estimate used.
    got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert math.isclose(float(got.square().sum()), noise.batch_sq, rel_tol=1e-12)


def test_a_micro_batch_with_no_items_takes_no_part():
    """The first micro-batch's targets all ignored: it adds nothing to either sum and is not
    counted in m (counted, it would halve S here)."""
    model = _model()
    x, y = _batch(12)
    y[:4] = -100
    valid = (y != -100).double()
    per = torch.where(valid.bool()[:, None], _per_example(model, x, y.clamp(min=0)), 0.0)
    noise = mbs_ext.accumulate(model, (x, y), nn.CrossEntropyLoss(), micro_batch_size=4, noise_scale=True).noise
    trace, grad_sq = _expected(per, valid, [4, 4, 4])
    assert noise.micro_batches == 2 and math.isclose(noise.trace, trace, rel_tol=1e-10)


@pytest.mark.slow  # 800 steps: a seeded statistical test
@pytest.mark.parametrize("rows,m", [(24, 6), (23, 7)], ids=["equal", "unequal"])
def test_mean_over_random_splits_is_the_sample_covariance_trace(rows, m):
    model = _model()
    x, y = _batch(rows)
    per = _per_example(model, x, y)
    sample_trace = float(((per - per.mean(0)).square().sum(1)).sum() / (rows - 1))
    g = torch.Generator().manual_seed(7)
    streamer = mbs_ext.MicroBatchStreamer(model, None, nn.CrossEntropyLoss(), micro_batch_size=m, noise_scale=True)
    traces = torch.tensor([streamer.accumulate((x, y), indices=torch.randperm(rows, generator=g)).noise.trace
                           for _ in range(400)], dtype=torch.float64)
    stderr = float(traces.std() / math.sqrt(len(traces)))
    assert abs(float(traces.mean()) - sample_trace) <= 4 * stderr, (float(traces.mean()), sample_trace, stderr)


def test_the_step_measures_before_it_steps_and_the_averages_resume():
    """``step`` measures at the weights it started from; the moving averages are a ratio of
    averages, carried by ``state_dict``: a resumed streamer goes on exactly as the first would."""
    model, x, y = _model(), *_batch(40)
    frozen = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    streamer = mbs_ext.MicroBatchStreamer(model, opt, nn.CrossEntropyLoss(), micro_batch_size=8, noise_scale=True)
    first = streamer.step((x, y)).noise
    assert math.isclose(first.trace, _expected(_per_example(frozen, x, y), torch.ones(40), [8] * 5)[0],
                        rel_tol=1e-10)
    assert first.steps == 1 and math.isclose(first.b_simple, first.trace / first.grad_sq, rel_tol=1e-12)
    noises = [streamer.step((x, y)).noise for _ in range(3)]
    # Ratio of the bias-corrected averages (beta 0.95), not the average of ratios.
    b, samples = 0.95, [first, *noises]
    w = [b ** (len(samples) - 1 - i) for i in range(len(samples))]
    s = sum(wi * n.trace for wi, n in zip(w, samples))
    gsq = sum(wi * n.grad_sq for wi, n in zip(w, samples))
    assert math.isclose(noises[-1].b_simple, s / gsq, rel_tol=1e-12)
    assert noises[-1].b_simple_stderr is not None and noises[-1].b_simple_stderr >= 0

    state = streamer.state_dict()
    twin_model = copy.deepcopy(model)
    twin_opt = torch.optim.SGD(twin_model.parameters(), lr=0.05)
    twin_opt.load_state_dict(opt.state_dict())
    twin = mbs_ext.MicroBatchStreamer(twin_model, twin_opt, nn.CrossEntropyLoss(), micro_batch_size=8,
                                      noise_scale=True)
    twin.load_state_dict(state)
    a, c = streamer.step((x, y)).noise, twin.step((x, y)).noise
    assert (a.b_simple, a.b_simple_stderr, a.steps) == (c.b_simple, c.b_simple_stderr, c.steps)


@pytest.mark.slow  # 600 steps
def test_the_averages_stay_per_item_when_the_mini_batch_size_changes():
    """S and |G|^2 are per-item quantities: steps of 24 and of 48 rows at fixed weights estimate
    the same ones (their means over random splits agree within their standard errors)."""
    model = _model()
    x, y = _batch(48)
    g = torch.Generator().manual_seed(3)
    streamer = mbs_ext.MicroBatchStreamer(model, None, nn.CrossEntropyLoss(), micro_batch_size=6, noise_scale=True)
    est = {}
    for rows in (24, 48):
        traces = torch.tensor([streamer.accumulate((x, y), indices=torch.randperm(48, generator=g)[:rows]).noise.trace
                               for _ in range(300)])
        est[rows] = (float(traces.mean()), float(traces.std() / math.sqrt(len(traces))))
    (a, sa), (b, sb) = est[24], est[48]
    assert abs(a - b) <= 4 * math.hypot(sa, sb), est


def test_a_loss_scaler_is_divided_out():
    model = _model().float()
    x, y = _batch(20)
    x = x.float()
    plain = mbs_ext.accumulate(copy.deepcopy(model), (x, y), nn.CrossEntropyLoss(), micro_batch_size=5,
                               noise_scale=True).noise
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    scaled = mbs_ext.accumulate(model, (x, y), nn.CrossEntropyLoss(), micro_batch_size=5, noise_scale=True,
                                scaler=scaler).noise
    assert math.isclose(plain.trace, scaled.trace, rel_tol=1e-5) and math.isclose(plain.batch_sq, scaled.batch_sq,
                                                                                   rel_tol=1e-5)


def test_off_by_default_and_refused_where_it_has_no_meaning():
    model, batch = _model(), _batch(12)
    assert mbs_ext.accumulate(model, batch, nn.CrossEntropyLoss(), micro_batch_size=4).noise is None
    one = mbs_ext.accumulate(model, batch, nn.CrossEntropyLoss(), micro_batch_size=12, noise_scale=True).noise
    assert one.trace is None and one.b_simple is None  # one micro-batch: no spread to measure
    with pytest.raises(ValueError, match="noise_scale needs a loss that is a mean"):
        mbs_ext.accumulate(model, batch, lambda mod, mb: F.cross_entropy(mod(mb[0]), mb[1], reduction="sum"),
                           micro_batch_size=4, normalize="sum", noise_scale=True)
    with pytest.raises(TypeError, match="noise_scale must be a bool"):
        mbs_ext.StepOptions(micro_batch_size=4, noise_scale=1)
    cached = mbs_ext.CachedLoss(lambda mod, mb: mod(mb[0]), lambda mod, enc: enc.square().mean())
    with pytest.raises(ValueError, match="noise_scale does not apply to CachedLoss"):
        mbs_ext.accumulate(model, batch, cached, micro_batch_size=4, noise_scale=True)


def _ranked(rank: int, cuts: list[int], m: int) -> tuple[float, float, int, float]:
    """One DDP rank: its rows of the batch, its own micro-batches of the global step."""
    model = nn.parallel.DistributedDataParallel(_model())
    x, y = _batch(cuts[-1])
    mine = slice(cuts[rank], cuts[rank + 1])
    noise = mbs_ext.accumulate(model, (x[mine], y[mine]), nn.CrossEntropyLoss(), micro_batch_size=m,
                               noise_scale=True).noise
    return noise.trace, noise.grad_sq, noise.micro_batches, noise.items


@pytest.mark.multiprocess
def test_two_ranks_measure_one_global_step():
    """Under DDP every rank's micro-batches are micro-batches of one step: S and |G|^2 over the
    two ranks' rows (13 and 10, split 4+3+3+3 and 4+3+3) equal the per-example reference over all
    23 rows with those seven micro-batches, on both ranks."""
    from ddp_harness import run_world

    cuts, m = [0, 13, 23], 4
    got = run_world(_ranked, cuts, m, timeout=120)
    model = _model()
    x, y = _batch(23)
    sizes = split_sizes(13, m) + split_sizes(10, m)
    trace, grad_sq = _expected(_per_example(model, x, y), torch.ones(23, dtype=torch.float64), sizes)
    for rank_trace, rank_grad_sq, micro_batches, items in got:
        assert (micro_batches, items) == (len(sizes), 23)
        assert math.isclose(rank_trace, trace, rel_tol=1e-10) and math.isclose(rank_grad_sq, grad_sq, rel_tol=1e-9)


def test_clipping_and_token_counts_measure_the_unclipped_gradient_by_the_step_counts():
    """Clipping acts after the measurement (|G_B|^2 is the step's unclipped gradient), and a count
    given as ``normalize=`` (a callable, as a token count is) weighs the micro-batches as the
    targets the loss does not ignore do."""
    model, (x, y) = _model(), _batch(21, ignored=0.3)
    loss = nn.CrossEntropyLoss()
    frozen = copy.deepcopy(model)
    clipped = mbs_ext.step(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), loss, micro_batch_size=6,
                           max_grad_norm=1e-3, noise_scale=True).noise
    counted = mbs_ext.accumulate(copy.deepcopy(frozen), (x, y), lambda mod, mb: loss(mod(mb[0]), mb[1]),
                                 micro_batch_size=6, normalize=lambda mb: (mb[1] != -100).sum(), noise_scale=True).noise
    valid = (y != -100).double()
    per = torch.where(valid.bool()[:, None], _per_example(frozen, x, y.clamp(min=0)), 0.0)
    trace, grad_sq = _expected(per, valid, split_sizes(21, 6))
    for noise in (clipped, counted):
        assert math.isclose(noise.trace, trace, rel_tol=1e-10) and math.isclose(noise.grad_sq, grad_sq, rel_tol=1e-9)


def test_measuring_leaves_the_step_the_default_step_to_the_last_bit():
    """On the CPU each parameter's first gradient becomes its sum and later ones add into it with
    their weight on the loss, as autograd's .grad does: with the noise measured, two steps of a
    float32 model (a channels_last convolution, a linear layer; uneven micro-batches) leave every
    parameter and gradient bit for bit where the default step leaves them."""
    torch.manual_seed(3)
    base = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
    base = base.to(memory_format=torch.channels_last)
    x = torch.randn(22, 3, 6, 6).to(memory_format=torch.channels_last)
    y = torch.randint(0, 5, (22,))
    runs = []
    for noise in (False, True):
        model = copy.deepcopy(base)
        streamer = mbs_ext.MicroBatchStreamer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                              nn.CrossEntropyLoss(), micro_batch_size=5, noise_scale=noise)
        results = [streamer.step((x, y)) for _ in range(2)]
        runs.append((model, results[-1]))
    (plain, _), (measured, result) = runs
    assert result.noise.micro_batches == 5 and result.noise.trace is not None
    for p, q in zip(plain.parameters(), measured.parameters()):
        assert torch.equal(p, q) and torch.equal(p.grad, q.grad) and p.grad.stride() == q.grad.stride()


def _by_hand(reference: nn.Module, x: torch.Tensor, y: torch.Tensor, sizes: list[int]) -> tuple[float, torch.Tensor]:
    """``sum_j c_j |g_j|^2`` and ``G_B`` (flattened) of a split, each micro-batch's mean gradient
    ``g_j`` from a backward of its own (``c_j``: its rows whose target is not ignored)."""
    items = int((y != -100).sum())
    micro_sq, g_b = 0.0, 0.0
    for xs, ys in zip(x.split(sizes), y.split(sizes)):
        reference.zero_grad()
        F.cross_entropy(reference(xs), ys).backward()
        g = torch.cat([(p.grad.to_dense() if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                       for p in reference.parameters()])
        count = int((ys != -100).sum())
        micro_sq += count * float(g.square().sum())
        g_b = g_b + g * count / items
    return micro_sq, g_b


class _Gated(nn.Module):
    """``b`` reaches only rows whose first feature passes 10, ``c`` only those below -10: micro-
    batches that reach neither leave those parameters without a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, CLASSES), nn.Linear(4, CLASSES), nn.Linear(4, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.a(x)
        if bool((x[:, 0] > 10).any()):
            out = out + self.b(x) * (x[:, :1] > 10)
        if bool((x[:, 0] < -10).any()):
            out = out + self.c(x) * (x[:, :1] < -10)
        return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_parameters_first_reached_late_or_once_count_in_their_own_micro_batches(dtype):
    """A parameter whose first gradient comes in a later micro-batch (``b``: the second and fourth
    of four, counting unequal items), or in one only (``c``: the third), keeps that gradient as its
    sum; its squares count in that micro-batch (of its own weight), summed when it is next added to
    or at the end. Against each micro-batch's gradient computed by hand in float64."""
    torch.manual_seed(4)
    model = _Gated().to(dtype)
    x, y = _batch(20)
    x = x.to(dtype)
    x[8, 0], x[19, 0], x[14, 0] = 20.0, 30.0, -20.0  # micro-batches of 5 rows: b in 2 and 4, c in 3
    y[[0, 1, 2, 15, 16]] = -100  # their counts 2, 5, 5, 3 of 15 items: weights of their own
    sizes = split_sizes(20, 6)
    assert sizes == [5, 5, 5, 5]
    micro_sq, g_b = _by_hand(copy.deepcopy(model).double(), x.double(), y, sizes)
    noise = mbs_ext.accumulate(model, (x, y), nn.CrossEntropyLoss(), micro_batch_size=6, noise_scale=True).noise
    rel = 1e-10 if dtype == torch.float64 else 1e-5
    assert noise.micro_batches == 4 and noise.items == 15
    assert math.isclose(noise.micro_sq, micro_sq, rel_tol=rel), (noise.micro_sq, micro_sq)
    assert math.isclose(noise.batch_sq, float(g_b.square().sum()), rel_tol=rel)
    got = torch.cat([p.grad.reshape(-1).double() for p in model.parameters()])
    assert torch.allclose(got, g_b, rtol=rel, atol=1e-12)


class _Odd(nn.Module):
    """Parameters whose gradients reach autograd's accumulation in odd forms: ``shift`` through a
    sum (an expanded gradient, not laid out as its ``.grad``), an embedding's sparse gradient,
    and a linear weight's doubled by a hook of the user's (:func:`_hooked`)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, CLASSES)
        self.emb = nn.Embedding(7, CLASSES, sparse=True)
        self.shift = nn.Parameter(torch.randn(3, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = (x[:, 1].abs() * 3).long() % 7
        return self.lin(x) + self.emb(ids) + self.shift.sum() * x[:, :CLASSES]


def _hooked(model: _Odd) -> list[int]:
    """The user's hooks on ``model``: the linear weight's gradient doubled before it is
    accumulated, and a count of the bias's accumulations (returned)."""
    calls = [0]
    model.lin.weight.register_hook(lambda g: 2 * g)
    model.lin.bias.register_post_accumulate_grad_hook(lambda p: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_odd_gradients_and_the_users_hooks_count_as_autograd_accumulates_them():
    """Each micro-batch's gradient is read as autograd would accumulate it, whatever its form: an
    expanded one (added by autograd itself, its squares read apart), a sparse one, one a user's
    hook changed first; the user's hooks run as often as without the noise scale, and a backward
    after the step accumulates into ``.grad`` as autograd does. Against micro-batch gradients
    computed by hand in float64 with the same hooks."""
    torch.manual_seed(5)
    model = _Odd().double()
    reference = copy.deepcopy(model)
    calls, reference_calls = _hooked(model), _hooked(reference)
    x, y = _batch(20, seed=3)
    sizes = split_sizes(20, 6)
    micro_sq, g_b = _by_hand(reference, x, y, sizes)
    noise = mbs_ext.accumulate(model, (x, y), nn.CrossEntropyLoss(), micro_batch_size=6, noise_scale=True).noise
    assert calls[0] == reference_calls[0] == len(sizes)
    assert noise.micro_batches == len(sizes)
    assert math.isclose(noise.micro_sq, micro_sq, rel_tol=1e-10), (noise.micro_sq, micro_sq)
    assert math.isclose(noise.batch_sq, float(g_b.square().sum()), rel_tol=1e-10)
    got = torch.cat([p.grad.to_dense().reshape(-1) for p in model.parameters()])
    assert torch.allclose(got, g_b, rtol=1e-10, atol=1e-14)
    # After the step, autograd's own accumulation: into the step's .grad, as into the reference's.
    reference.zero_grad()
    for p, q in zip(model.parameters(), reference.parameters()):
        q.grad = p.grad.clone()
    for net in (model, reference):
        F.cross_entropy(net(x), y).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad.to_dense(), q.grad.to_dense())


def test_under_compiled_autograd_the_noise_is_measured_as_in_eager_mode():
    """Compiled autograd traces the backward's hooks: the step measures there through buffers
    (the gradients read after each backward) and gives the sums of the eager step."""
    compiled_autograd = pytest.importorskip("torch._dynamo.compiled_autograd")
    if not hasattr(compiled_autograd, "_enable"):
        pytest.skip("this torch has no compiled_autograd._enable")
    model = _model()
    eager = copy.deepcopy(model)
    x, y = _batch(16, ignored=0.2)
    with compiled_autograd._enable(torch.compile(backend="eager")):
        noise = mbs_ext.accumulate(model, (x, y), nn.CrossEntropyLoss(), micro_batch_size=4, noise_scale=True).noise
    expected = mbs_ext.accumulate(eager, (x, y), nn.CrossEntropyLoss(), micro_batch_size=4, noise_scale=True).noise
    assert noise.micro_batches == expected.micro_batches == 4
    assert math.isclose(noise.micro_sq, expected.micro_sq, rel_tol=1e-12)
    assert math.isclose(noise.batch_sq, expected.batch_sq, rel_tol=1e-12)
    for p, q in zip(model.parameters(), eager.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-12, atol=1e-15)


def test_a_streamers_steps_share_one_tap_that_lets_other_backwards_be():
    """A streamer's steps reuse one tap: each step measures afresh (the squares and the non-finite
    flag of the last step gone: a step after a skipped NaN one goes ahead), and its hooks are off
    between steps: backwards of the user's there accumulate into ``.grad`` as autograd's do, one
    under compiled autograd (which cannot trace the hooks) included, and a step under compiled
    autograd measures as the eager step does. Each step's sums against micro-batch gradients by
    hand (float64)."""
    compiled_autograd = pytest.importorskip("torch._dynamo.compiled_autograd")
    model = _model()
    reference = copy.deepcopy(model)
    x, y = _batch(20, seed=7)
    sizes = split_sizes(20, 6)
    streamer = mbs_ext.MicroBatchStreamer(model, torch.optim.SGD(model.parameters(), lr=0.0), nn.CrossEntropyLoss(),
                                          micro_batch_size=6, noise_scale=True)

    def measured() -> None:
        micro_sq, g_b = _by_hand(reference, x, y, sizes)
        result = streamer.step((x, y))
        noise = result.noise
        assert not result.skipped and noise.micro_batches == len(sizes)
        assert math.isclose(noise.micro_sq, micro_sq, rel_tol=1e-10), (noise.micro_sq, micro_sq)
        assert math.isclose(noise.batch_sq, float(g_b.square().sum()), rel_tol=1e-10)

    measured()
    measured()
    # Between steps: the user's own backwards accumulate as autograd's do.
    for net in (model, reference):
        net.zero_grad()
        F.cross_entropy(net(x), y).backward()
        F.cross_entropy(net(x), y).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)
    poisoned = x.clone()
    poisoned[13, 0] = math.nan  # the third micro-batch's gradients: NaN, after the first sums
    with pytest.warns(RuntimeWarning):
        assert streamer.step((poisoned, y)).skipped
    measured()
    if hasattr(compiled_autograd, "_enable"):
        for net in (model, reference):
            net.zero_grad()
            with compiled_autograd._enable(torch.compile(backend="eager")):
                F.cross_entropy(net(x), y).backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            assert torch.allclose(p.grad, q.grad, rtol=1e-12, atol=1e-15)
        with compiled_autograd._enable(torch.compile(backend="eager")):
            measured()
    measured()


def test_a_kept_tap_follows_parameters_whose_data_is_set_anew_and_refuses_calls_outside_a_step():
    """``model.double()`` keeps the parameters but gives each a new accumulation node: the tap
    kept from the float32 step puts its hooks on the new ones (against micro-batch gradients by
    hand, float64). Calls into a tap outside a step are refused, not run on no state."""
    model = _model().float()
    x, y = _batch(20, seed=8)
    sizes = split_sizes(20, 6)
    streamer = mbs_ext.MicroBatchStreamer(model, torch.optim.SGD(model.parameters(), lr=0.0), nn.CrossEntropyLoss(),
                                          micro_batch_size=6, noise_scale=True)
    assert streamer.step((x.float(), y)).noise.micro_batches == len(sizes)
    model.double()
    micro_sq, g_b = _by_hand(copy.deepcopy(model), x, y, sizes)
    noise = streamer.step((x, y)).noise
    assert math.isclose(noise.micro_sq, micro_sq, rel_tol=1e-10), (noise.micro_sq, micro_sq)
    assert math.isclose(noise.batch_sq, float(g_b.square().sum()), rel_tol=1e-10)
    tap = mbs_ext.ops.noise_tap(list(model.parameters()), torch.zeros(()))
    for call in (tap.finish, tap.read_pending, lambda: tap.weigh(torch.ones(()), 1.0)):
        with pytest.raises(RuntimeError, match="outside begin"):
            call()
    tap.detach()
    with pytest.raises(RuntimeError, match="after detach"):
        tap.begin()


class _Reentrant(nn.Module):
    """``shared`` runs in two segments of reentrant checkpointing: autograd hands it its gradient
    in two parts within each micro-batch's backward, one per segment."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.shared, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.shared, torch.tanh(self.inp(x)), use_reentrant=True)
        h = checkpoint(self.shared, torch.tanh(h), use_reentrant=True)
        return self.head(h)


def test_a_gradient_in_parts_is_said_then_measured_after_each_backward():
    """Reentrant checkpointing hands a parameter its micro-batch's gradient in parts: the squares
    of the parts are not the micro-batch's. The step says so (a warning, NaN noise, the averages
    untouched) with its gradients exact, and the next steps measure exactly (against micro-batch
    gradients by hand, float64)."""
    torch.manual_seed(6)
    model = _Reentrant().double()
    reference = copy.deepcopy(model)
    x, y = _batch(20, seed=4)
    sizes = split_sizes(20, 6)
    micro_sq, g_b = _by_hand(reference, x, y, sizes)
    streamer = mbs_ext.MicroBatchStreamer(model, torch.optim.SGD(model.parameters(), lr=0.0), nn.CrossEntropyLoss(),
                                          micro_batch_size=6, noise_scale=True)
    with pytest.warns(RuntimeWarning, match="in parts within one micro-batch"):
        first = streamer.step((x, y)).noise
    assert math.isnan(first.micro_sq) and math.isnan(first.trace) and first.steps == 0
    got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert torch.allclose(got, g_b, rtol=1e-10, atol=1e-14)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        second = streamer.step((x, y)).noise
    assert second.steps == 1 and second.micro_batches == len(sizes)
    assert math.isclose(second.micro_sq, micro_sq, rel_tol=1e-10), (second.micro_sq, micro_sq)
    assert math.isclose(second.batch_sq, float(g_b.square().sum()), rel_tol=1e-10)
