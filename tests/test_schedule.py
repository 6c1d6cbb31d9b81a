"""Any batch size at any step: a data order counted in samples, batch-size schedules, resume.

A run whose mini-batch size changes from step to step (a ramp, a step schedule, the noise-scale
autopilot) and whose learning rate follows it, interrupted anywhere and resumed from its
states (model, optimizer, :class:`mbs_ext.SampleOrder`, the schedule, the streamer), must end
bit-identical to the run that was not interrupted; the order must hand every epoch's rows out
exactly once whatever the sizes, and the same rows to one rank as to two ranks together.
"""

from __future__ import annotations

import io
import math
import random

import pytest
import torch
from torch import nn

import mbs_ext

ROWS = 97


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    """Labels a linear rule gives: a gradient with signal, so the noise scale is finite early on."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, 5, generator=g, dtype=torch.float64)
    return x, (x @ torch.randn(5, 3, generator=g, dtype=torch.float64)).argmax(1)


def _parts(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    streamer = mbs_ext.MicroBatchStreamer(model, opt, nn.CrossEntropyLoss(), micro_batch_size=6, noise_scale=True)
    return model, opt, streamer, mbs_ext.SampleOrder(ROWS, seed=3)


def _schedule(kind: str):
    if kind == "ramp":
        return mbs_ext.Ramp(start=8, end=40, over=300, multiple_of=4)
    if kind == "steps":
        return mbs_ext.Steps(((0, 12), (150, 30), (400, 17)))
    return mbs_ext.Autopilot(minimum=8, maximum=64, k=0.5, hysteresis=0.1)


def _train(parts, schedule, data, steps: int, sizes: list | None = None) -> None:
    """``steps`` scheduled steps; the learning rate follows the size (sqrt, Adam). The autopilot
    reads the streamer's moving averages of the noise (restored with the streamer's state)."""
    model, opt, streamer, order = parts
    for _ in range(steps):
        size = schedule.size(order.samples_seen, streamer.noise)
        if sizes is not None:
            sizes.append(size)
        for group in opt.param_groups:
            group["lr"] = mbs_ext.scaled_lr(1e-2, 16, size, "sqrt")
        streamer.step(data, indices=order.next(size))


def _state(parts, schedule) -> bytes:
    model, opt, streamer, order = parts
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "streamer": streamer.state_dict(),
                "order": order.state_dict(), "schedule": getattr(schedule, "state_dict", dict)()}, buf)
    return buf.getvalue()


def _resumed(blob: bytes, kind: str):
    state = torch.load(io.BytesIO(blob), weights_only=True)
    parts, schedule = _parts(seed=99), _schedule(kind)  # other weights: everything must come from the state
    model, opt, streamer, order = parts
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    streamer.load_state_dict(state["streamer"])
    order.load_state_dict(state["order"])
    if hasattr(schedule, "load_state_dict"):
        schedule.load_state_dict(state["schedule"])
    return parts, schedule


@pytest.mark.slow  # 102 interrupted runs
@pytest.mark.parametrize("kind", ["ramp", "steps", "autopilot"])
def test_interrupted_anywhere_and_resumed_it_ends_bit_identical(kind):
    """34 interruptions per schedule (102 in all), at seeded random steps of a 24-step run whose size
    changes: the resumed run's parameters equal the uninterrupted run's bit for bit."""
    data, steps = _data(), 24
    parts, schedule, sizes = _parts(), _schedule(kind), []
    _train(parts, schedule, data, steps, sizes=sizes)
    assert len(set(sizes)) > 1, sizes  # the size does change along the run
    want = [p.detach().clone() for p in parts[0].parameters()]
    rng = random.Random(kind)
    for _ in range(34):
        at = rng.randrange(1, steps)
        first, sched = _parts(), _schedule(kind)
        _train(first, sched, data, at)
        parts2, sched2 = _resumed(_state(first, sched), kind)  # nothing else crosses the interruption
        _train(parts2, sched2, data, steps - at)
        for p, q in zip(parts2[0].parameters(), want):
            assert torch.equal(p, q), (kind, at)


def test_a_scheduled_run_is_the_step_fed_the_same_rows_and_learning_rates():
    """What the schedule and the order hand out is all they do: a plain loop of mbs_ext.step over the
    same rows and learning rates (written out by hand) ends bit-identical."""
    data = _data()
    parts, schedule = _parts(), _schedule("ramp")
    _train(parts, schedule, data, 12)
    model, opt, streamer, _ = _parts()
    perm = [torch.randperm(ROWS, generator=torch.Generator().manual_seed(3 * 1_000_003 + e)) for e in range(6)]
    flat, seen = torch.cat(perm), 0
    for _ in range(12):
        size = max(8, int(8 + 32 * seen / 300) // 4 * 4) if seen < 300 else 40
        for group in opt.param_groups:
            group["lr"] = 1e-2 * math.sqrt(size / 16)
        streamer.step(data, indices=flat[seen:seen + size])
        seen += size
    for p, q in zip(model.parameters(), parts[0].parameters()):
        assert torch.equal(p, q)


def test_every_epoch_is_taken_exactly_once_at_any_sizes_and_the_ranks_share_one_order():
    order, one, two = mbs_ext.SampleOrder(ROWS, seed=5), mbs_ext.SampleOrder(ROWS, seed=5), []
    rng, taken = random.Random(1), []
    while len(taken) < 3 * ROWS:
        size = rng.randrange(2, 60)
        taken += order.next(size).tolist()
        both = [mbs_ext.SampleOrder(ROWS, seed=5) for _ in range(2)]
        for o in both:
            o.load_state_dict(one.state_dict())
        two = torch.cat([o.next(size, rank=r, world=2) for r, o in enumerate(both)])
        assert torch.equal(two, one.next(size))  # two ranks' shares, in rank order, are one rank's batch
    for e in range(3):
        assert sorted(taken[e * ROWS:(e + 1) * ROWS]) == list(range(ROWS))
    assert order.samples_seen == len(taken) and order.epoch == len(taken) // ROWS


def test_the_autopilot_follows_the_noise_up_only_and_refusals_name_the_argument():
    pilot = mbs_ext.Autopilot(minimum=16, maximum=256, k=2.0, hysteresis=0.25, multiple_of=8)

    class N:  # what the autopilot reads: b_simple (a NoiseScale's, or a step's Noise)
        def __init__(self, b):
            self.b_simple = b

    assert pilot.size(0, None) == 16 and pilot.size(0, N(9.0)) == 16  # 18 rounds down to 16: unchanged
    assert pilot.size(0, N(40.0)) == 80  # 2 x 40, a multiple of 8, past 16 x 1.25
    assert pilot.size(0, N(42.0)) == 80  # 84 -> 80: within the hysteresis, unchanged
    assert pilot.size(0, N(10.0)) == 80  # never down
    assert pilot.size(0, N(1e9)) == 256  # clipped to the maximum
    assert mbs_ext.Autopilot(minimum=8, maximum=100, multiple_of=16).size(0, N(1e9)) == 96  # maximum rounded down
    with pytest.raises(ValueError, match="batch_size must be an int"):
        mbs_ext.SampleOrder(10).next(0)
    with pytest.raises(ValueError, match="milestones must start at 0"):
        mbs_ext.Steps(((5, 10),))
    with pytest.raises(ValueError, match="rule must be 'linear' or 'sqrt'"):
        mbs_ext.scaled_lr(1.0, 1, 2, "cube")
    with pytest.raises(ValueError, match="this order's has"):
        mbs_ext.SampleOrder(10).load_state_dict(mbs_ext.SampleOrder(11).state_dict())
