"""micro_batch_size="auto": the planner's measurements, budgets, and out-of-memory back-off."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from common import assert_models_match, full_batch_step, snapshot
from torch import nn
from torch.overrides import TorchFunctionMode

import mbs_ext
from mbs_ext.diagnostics import measure_saved_bytes


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5))


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, padding=1), nn.Sigmoid(), nn.Flatten(), nn.Linear(8 * 8 * 8, 5),
    )


MODELS = {"mlp": (mlp, (32,)), "cnn": (cnn, (3, 16, 16))}


def data(shape, n=200, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, *shape, generator=gen), torch.randint(0, 5, (n,), generator=gen)


def ce(model, mb):
    return nn.functional.cross_entropy(model(mb[0]), mb[1])


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("m", [16, 57, 128])
def test_planner_estimate_matches_measured_saved_bytes(name, m):
    make, shape = MODELS[name]
    model = make()
    batch = data(shape)
    plan = mbs_ext.plan_micro_batch(model, batch, ce, memory_budget=10**9)
    measured = measure_saved_bytes(model, (batch[0][:m].clone(), batch[1][:m].clone()), ce)
    assert measured > 0
    assert abs(plan.saved_bytes(m) - measured) <= 0.10 * measured, (plan, measured)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("budget_kib", [64, 256, 1024])
def test_auto_honours_budget(name, budget_kib):
    make, shape = MODELS[name]
    model = make()
    batch = data(shape)
    budget = budget_kib * 1024
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        result = mbs_ext.step(model, opt, batch, ce, micro_batch_size="auto", memory_budget=budget)
    except ValueError as exc:  # a budget below one sample is a clear error
        assert "memory_budget" in str(exc)
        return
    m = result.micro_batch_size
    assert 1 <= m <= 200
    chosen = measure_saved_bytes(model, (batch[0][:m].clone(), batch[1][:m].clone()), ce)
    assert chosen <= budget
    if m < 200:  # the largest that fits: one more sample's worth would not
        plan = mbs_ext.plan_micro_batch(model, batch, ce, memory_budget=budget)
        # The step streams balanced micro-batches no larger than the planned bound.
        k = -(-200 // plan.micro_batch_size)
        assert m == -(-200 // k)
        assert plan.estimate(plan.micro_batch_size + 1) > budget


def test_auto_is_exact_and_planning_leaves_no_trace():
    model = nn.Sequential(nn.Linear(32, 64), nn.Dropout(0.3), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 5))
    model = model.double()
    ref = copy.deepcopy(model)
    batch = tuple(t.double() if t.is_floating_point() else t for t in data((32,), n=90))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    rng = torch.get_rng_state()
    mbs_ext.plan_micro_batch(model, batch, ce, memory_budget=120_000)  # train mode: dropout draws
    assert torch.equal(torch.get_rng_state(), rng), "planning consumed random numbers"
    for k, v in model.named_buffers():
        assert torch.equal(v, buffers[k]), f"planning changed buffer {k}"
    # Exactness needs batch-independent layers: compare in eval mode.
    model.eval(), ref.eval()
    plan = mbs_ext.plan_micro_batch(model, batch, ce, memory_budget=120_000)
    assert 1 <= plan.micro_batch_size < 90
    torch.manual_seed(5)
    result = mbs_ext.step(model, opt, batch, ce, micro_batch_size="auto", memory_budget=120_000)
    torch.manual_seed(5)
    full_batch_step(ref, ref_opt, batch, ce)
    assert result.micro_batch_size == plan.micro_batch_size
    assert_models_match(model, ref, 1e-12)


def test_auto_plan_is_cached_per_signature():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    streamer = mbs_ext.MicroBatchStreamer(model, opt, ce, micro_batch_size="auto", memory_budget=300_000)
    streamer.step(data((32,)))
    streamer.step(data((32,), seed=2))
    assert len(streamer.plans()) == 1
    other = (torch.randn(50, 32).double(), torch.randint(0, 5, (50,)))
    model.double()
    streamer.step(other)
    assert len(streamer.plans()) == 2


def test_auto_needs_budget_on_cpu():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="memory_budget"):
        mbs_ext.step(model, opt, data((32,)), ce, micro_batch_size="auto")
    with pytest.raises(ValueError, match="memory_budget"):
        mbs_ext.step(model, opt, data((32,)), ce, micro_batch_size="auto", memory_budget=0)
    with pytest.raises(TypeError, match="memory_budget"):
        mbs_ext.step(model, opt, data((32,)), ce, micro_batch_size="auto", memory_budget="1GB")


def test_planning_under_no_grad_names_the_fix():
    model = mlp()
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"plan_micro_batch.*gradients disabled.*outside"):
        mbs_ext.plan_micro_batch(model, data((32,)), ce, memory_budget=10**9)


class OOMAbove(nn.Module):
    """Raises a real torch.OutOfMemoryError when a micro-batch is larger than `limit`,
    from micro-batch `at` on (the first `at` micro-batches succeed)."""

    def __init__(self, limit: int, at: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 5)).double()
        self.limit, self.at, self.calls = limit, at, 0

    def forward(self, x):
        self.calls += 1
        if x.shape[0] > self.limit and self.calls > self.at:
            raise torch.OutOfMemoryError(f"injected: {x.shape[0]} rows > {self.limit}")
        return self.net(x)


@pytest.mark.parametrize("at", [0, 1, 2])
def test_out_of_memory_backs_off_and_stays_exact(at):
    torch.manual_seed(0)
    model = OOMAbove(limit=13, at=at)  # halving 40 -> 20 -> 10 would waste 3 of 13 rows
    ref = copy.deepcopy(model)
    ref.limit = 10**9
    batch = (torch.randn(100, 32, dtype=torch.float64), torch.randint(0, 5, (100,)))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    streamer = mbs_ext.MicroBatchStreamer(model, opt, ce, micro_batch_size=40)
    before = snapshot(model.net, opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = streamer.step(batch)
    messages = [str(w.message) for w in caught if "out of memory" in str(w.message)]
    # Probes find the largest size that fits; the step is redone once, at that size.
    assert messages == [
        "mbs_ext.step: out of memory at micro_batch_size=40; redoing the step with micro_batch_size=13",
    ]
    assert result.micro_batch_size == 13 and result.num_micro_batches == 8
    full_batch_step(ref, ref_opt, batch, ce)
    assert_models_match(model.net, ref.net, 1e-12)
    assert opt.state_dict()["state"][0]["step"].item() == 1  # one optimizer step, not three
    assert before["params"].keys() == {k for k, _ in model.net.named_parameters()}
    # The smaller size is remembered: the next step starts at 13 without warnings.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert streamer.step(batch).micro_batch_size == 13


def test_out_of_memory_parameters_untouched_until_success():
    torch.manual_seed(0)
    model = OOMAbove(limit=0, at=0)  # even one row fails: back-off ends at 1 and re-raises
    batch = (torch.randn(8, 32, dtype=torch.float64), torch.randint(0, 5, (8,)))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    opt.step()  # create optimizer state so that it can be compared
    before = snapshot(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(torch.OutOfMemoryError) as info:
            mbs_ext.step(model, opt, batch, ce, micro_batch_size=8)
    assert "micro-batch 0" in "\n".join(getattr(info.value, "__notes__", []))
    after = snapshot(model, opt)
    for k in before["params"]:
        assert torch.equal(before["params"][k], after["params"][k])
    assert all(p.grad is None for p in model.parameters())


class HugeAllocAbove(nn.Module):
    """Asks torch's CPU allocator for an impossible buffer when a micro-batch is too big:
    a real allocation failure (a RuntimeError from DefaultCPUAllocator), no mock."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.net = nn.Linear(32, 5).double()
        self.limit = limit

    def forward(self, x):
        if x.shape[0] > self.limit:
            torch.empty(2**62, dtype=torch.uint8)
        return self.net(x)


def test_real_host_allocation_failure_backs_off():
    torch.manual_seed(0)
    model = HugeAllocAbove(limit=16)
    ref = copy.deepcopy(model)
    ref.limit = 10**9
    batch = (torch.randn(64, 32, dtype=torch.float64), torch.randint(0, 5, (64,)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    with pytest.warns(RuntimeWarning, match="out of memory at micro_batch_size=32"):
        result = mbs_ext.step(model, opt, batch, ce, micro_batch_size=32)
    assert result.micro_batch_size == 16
    full_batch_step(ref, ref_opt, batch, ce)
    assert_models_match(model.net, ref.net, 1e-12)


def test_back_off_that_finds_nothing_says_where_the_error_was_raised():
    # Not even one row fits: the original error is raised, and although its frames were
    # freed to give the probes memory, the note still says where it came from.
    model = HugeAllocAbove(limit=0)
    before = [p.detach().clone() for p in model.parameters()]
    batch = (torch.randn(8, 32, dtype=torch.float64), torch.randint(0, 5, (8,)))
    with pytest.raises(RuntimeError) as info:
        mbs_ext.step(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, ce, micro_batch_size=4)
    assert mbs_ext.diagnostics.is_out_of_memory(info.value)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "not even 1 row" in notes
    assert "in forward" in notes and "torch.empty(2**62" in notes
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


class OOMInStep(torch.optim.SGD):
    def step(self, closure=None):
        raise torch.OutOfMemoryError("injected inside optimizer.step")


def test_no_redo_once_the_optimizer_started_stepping():
    model = mlp()
    opt = OOMInStep(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a back-off would warn
        with pytest.raises(torch.OutOfMemoryError) as info:
            mbs_ext.step(model, opt, data((32,)), ce, micro_batch_size=50)
    assert any("while finishing the step" in n for n in info.value.__notes__)


def test_auto_counts_float32_buffers_of_low_precision_parameters():
    model = mlp().to(torch.bfloat16)
    batch = (data((32,))[0].to(torch.bfloat16), data((32,))[1])
    numel = sum(p.numel() for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    streamer = mbs_ext.MicroBatchStreamer(model, opt, ce, micro_batch_size="auto", memory_budget=400_000)
    streamer.step(batch)
    (plan,) = streamer.plans().values()
    assert plan.fixed_bytes >= numel * 2 + numel * 4  # bf16 grads + float32 buffers


def test_is_out_of_memory():
    from mbs_ext.diagnostics import is_out_of_memory

    assert is_out_of_memory(MemoryError())
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8"))
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("can't allocate memory"))


# --- the measured-peak planner ----------------------------------------------------------------------


def test_peak_tracker_counts_live_storages_once():
    from mbs_ext.diagnostics import PeakTracker

    with PeakTracker() as t:
        a = torch.empty(1000)  # 4000 bytes
        b = torch.empty(500, dtype=torch.float64)  # 4000 bytes
        view = a[:10]  # no new storage
        a.add_(1.0)  # in place: no new storage
        assert t.live == 8000 and t.peak == 8000
        del a  # the view keeps the storage alive
        assert t.live == 8000
        del view
        assert t.live == 4000
        c = torch.empty(250)  # 1000 bytes
        assert t.live == 5000 and t.peak == 8000
    del b, c


class TinyUNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.down = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.mid = nn.Sequential(
            nn.MaxPool2d(2), nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.Upsample(scale_factor=2)
        )
        self.out = nn.Conv2d(24, 5, 1)

    def forward(self, x):
        a = self.down(x)
        return self.out(torch.cat([a, self.mid(a)], 1)).mean((2, 3))


def wide_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 5))


@pytest.mark.parametrize(
    "make, shape, budget",
    [(wide_mlp, (32,), 1 << 20), (cnn, (3, 16, 16), 1 << 20), (cnn, (3, 16, 16), 4 << 20),
     (TinyUNet, (3, 16, 16), 1 << 20), (TinyUNet, (3, 16, 16), 4 << 20)],
    ids=["mlp-1M", "cnn-1M", "cnn-4M", "unet-1M", "unet-4M"],
)
def test_auto_peak_is_within_budget_and_uses_it(make, shape, budget):
    """The measured peak of a whole "auto" step (CPU, live bytes at the dispatcher) lands in
    0.85-1.0 x the budget, with no out-of-memory back-off."""
    from mbs_ext.diagnostics import PeakTracker

    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = data(shape, n=400)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a back-off would warn
        streamer = mbs_ext.MicroBatchStreamer(model, opt, ce, micro_batch_size="auto", memory_budget=budget)
        streamer.step(batch)
        (plan,) = streamer.plans().values()
        m = plan.micro_batch_size
        # The plan is cached per signature; a batch of exactly 3m rows streams micro-batches of m
        # (400 rows would be split evenly into smaller ones).
        again = data(shape, n=3 * m, seed=2)
        with PeakTracker() as tracker:
            second = streamer.step(again)
    assert m == second.micro_batch_size < 400 and second.num_micro_batches == 3
    assert 0.85 * budget <= tracker.peak <= budget, (second.micro_batch_size, tracker.peak / budget)


def test_cuda_room_honours_the_process_cap():
    from mbs_ext.diagnostics import cuda_room

    gib = 1 << 30
    # An 80 GiB device capped at 4 GiB with 1 GiB of live tensors: 3 GiB, not the free 70.
    assert cuda_room(total=80 * gib, fraction=0.05, allocated=gib, reserved=2 * gib, free=70 * gib) == 3 * gib
    # Uncapped: the device's free memory plus the allocator's unused cache.
    assert cuda_room(total=80 * gib, fraction=1.0, allocated=gib, reserved=2 * gib, free=10 * gib) == 11 * gib
    assert cuda_room(total=8 * gib, fraction=0.1, allocated=2 * gib, reserved=2 * gib, free=6 * gib) == 0


class _OOMInNorm(TorchFunctionMode):
    """Fails the gradient-norm computation of the step's finish with a real OutOfMemoryError
    (the micro-batches all succeed)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.linalg.vector_norm, torch._foreach_norm):
            raise torch.OutOfMemoryError("injected: out of memory in the gradient norm")
        return func(*args, **(kwargs or {}))


def test_out_of_memory_after_streaming_is_not_retried():
    # A smaller micro-batch cannot help the finish (casts, norms): raise at once, lose nothing.
    torch.manual_seed(0)
    model = OOMAbove(limit=10**9, at=0)
    batch = (torch.randn(40, 32, dtype=torch.float64), torch.randint(0, 5, (40,)))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    before = snapshot(model, opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(torch.OutOfMemoryError) as info, _OOMInNorm():
            mbs_ext.step(model, opt, batch, ce, micro_batch_size=10, max_grad_norm=1.0, check_count=False)
    assert not [w for w in caught if "redoing the step" in str(w.message)]
    assert model.calls == 4  # four micro-batches, streamed once: no redo, no probes (no count check either)
    assert "while finishing the step" in "\n".join(getattr(info.value, "__notes__", []))
    after = snapshot(model, opt)
    for k in before["params"]:
        assert torch.equal(before["params"][k], after["params"][k])


def test_plan_micro_batch_counts_the_float32_buffers_of_a_bf16_model():
    # The step accumulates a bf16 model's gradients in float32 buffers; the public planner
    # must plan the same step, so it picks what micro_batch_size="auto" picks.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 4)).bfloat16()
    batch = (torch.randn(256, 64).bfloat16(), torch.randint(0, 4, (256,)))
    budget = 3 * 2**20
    plan = mbs_ext.plan_micro_batch(model, batch, ce, memory_budget=budget)
    as_fp32_buffers = mbs_ext.plan_micro_batch(model, batch, ce, memory_budget=budget, accumulate_dtype=torch.float32)
    without = mbs_ext.plan_micro_batch(model, batch, ce, memory_budget=budget, accumulate_dtype=torch.bfloat16)
    assert plan.fixed_bytes == as_fp32_buffers.fixed_bytes > without.fixed_bytes
    streamer = mbs_ext.MicroBatchStreamer(model, torch.optim.SGD(model.parameters(), lr=0.0), ce,
                                          micro_batch_size="auto", memory_budget=budget)
    assert streamer.step(batch).micro_batch_size == plan.micro_batch_size


def test_planning_judged_by_the_os_leaves_no_trace():
    """A budget the OS meter judges (CPU, from 8 MiB): RNG, buffers, grads, optimizer state unchanged."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.Dropout(0.3), nn.BatchNorm1d(512), nn.ReLU(), nn.Linear(512, 5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batch = (torch.randn(4096, 256), torch.randint(0, 5, (4096,)))
    nn.functional.cross_entropy(model(batch[0][:8]), batch[1][:8]).backward()
    opt.step()  # momentum buffers and .grad exist
    grads = [p.grad.clone() for p in model.parameters()]
    state = {k: v["momentum_buffer"].clone() for k, v in enumerate(opt.state.values())}
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    rng = torch.get_rng_state()
    plan = mbs_ext.plan_micro_batch(model, batch, ce, memory_budget=16 << 20)
    assert plan.meter == "rss" and 1 <= plan.micro_batch_size < 4096 and plan.verified
    assert torch.equal(torch.get_rng_state(), rng), "planning consumed random numbers"
    for k, v in model.named_buffers():
        assert torch.equal(v, buffers[k]), f"planning changed buffer {k}"
    for p, g in zip(model.parameters(), grads):
        assert torch.equal(p.grad, g), "planning changed .grad"
    for k, v in enumerate(opt.state.values()):
        assert torch.equal(v["momentum_buffer"], state[k]), "planning changed optimizer state"


class Leaky(nn.Module):
    """A device of ``budget`` units where a forward needs 100 per row and keeps 10 per row from one
    forward to the next (as a loss function filling a list would): it raises a real
    torch.OutOfMemoryError when they do not fit. Memory grows along the step, which no micro-batch
    size cures."""

    def __init__(self, budget: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 5)).double()
        self.budget, self.kept = budget, 0

    def forward(self, x):
        rows = x.shape[0]
        if self.kept + 100 * rows > self.budget:
            raise torch.OutOfMemoryError(f"injected: {self.kept} kept + {100 * rows} needed > {self.budget}")
        self.kept += 10 * rows
        return self.net(x)


def test_back_off_does_not_cascade_on_growth():
    """Memory that grows from micro-batch to micro-batch: back-off redoes the step once (a first
    failure may be a costlier micro-batch), and when the redo also fails after micro-batches of its
    size fitted, the step raises saying why instead of shrinking again (before, it went on down to
    one-row micro-batches). Nothing changed."""
    torch.manual_seed(0)
    model = Leaky(budget=3000)
    batch = (torch.randn(400, 32, dtype=torch.float64), torch.randint(0, 5, (400,)))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    before = snapshot(model.net, opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(torch.OutOfMemoryError) as info:
            mbs_ext.step(model, opt, batch, ce, micro_batch_size=20)
    backoffs = [str(w.message) for w in caught if "out of memory at" in str(w.message)]
    assert len(backoffs) == 1, backoffs  # one redo, not a cascade
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "not redone again" in notes and "memory grows from micro-batch to micro-batch" in notes, notes
    assert ".detach()" in notes
    after = snapshot(model.net, opt)
    for k in before["params"]:
        assert torch.equal(before["params"][k], after["params"][k])


@pytest.mark.parametrize("mode", ["auto", "back_off"])
def test_planning_and_back_off_leave_nothing_behind(mode):
    """After steps that planned (``"auto"``: the saved-bytes probe, the measuring probes) or backed
    off, nothing of theirs outlives the model: its parameters are freed with it, and no tensor of a
    probe's graph is left (the CPU reproduction of CUDA memory left allocated after such steps: a
    probe's saved-tensor hook that kept its own outputs made cycles the collector cannot see)."""
    import gc
    import weakref

    torch.manual_seed(0)
    if mode == "auto":
        model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 1)).double()
        kw = {"micro_batch_size": "auto", "memory_budget": 8 << 20}
    else:
        model = OOMAbove(limit=13, at=1)
        kw = {"micro_batch_size": 40}
    x = torch.randn(400, 64 if mode == "auto" else 32, dtype=torch.float64)
    batch = (x, torch.randn(400, 1, dtype=torch.float64)) if mode == "auto" else (x, torch.randint(0, 5, (400,)))
    loss = (lambda m, b: (m(b[0]) - b[1]).pow(2).mean()) if mode == "auto" else ce
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gc.collect()
    before = {id(t) for t in gc.get_objects() if isinstance(t, torch.Tensor)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            mbs_ext.step(model, opt, batch, loss, **kw)
    params = [weakref.ref(p) for p in model.parameters()]
    del model, opt
    gc.collect()
    assert all(p() is None for p in params), "a parameter outlived its model"
    left = [t for t in gc.get_objects() if isinstance(t, torch.Tensor) and id(t) not in before
            and (t.grad_fn is not None or t.requires_grad)]
    assert not left, [(tuple(t.shape), t.grad_fn) for t in left]
