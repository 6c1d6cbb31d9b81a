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
import torch.nn.functional as F
from common import graph_recorder
from torch import nn
from torch.func import functional_call, grad, vmap

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
    # Acting on every estimate (max_rel_stderr=None): 24 steps of this model's noise never bring
    # its standard error within the default half of it, and the size must change along the run.
    return mbs_ext.Autopilot(minimum=8, maximum=64, k=0.5, hysteresis=0.1, max_rel_stderr=None)


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


def _saved(**stateful) -> bytes:
    """The ``state_dict()`` of each of ``stateful`` (by name), saved as one checkpoint."""
    buf = io.BytesIO()
    torch.save({name: obj.state_dict() for name, obj in stateful.items()}, buf)
    return buf.getvalue()


def _restore(blob: bytes, **stateful) -> None:
    """Each of ``stateful`` loads its state from the checkpoint ``blob`` (:func:`_saved`)."""
    state = torch.load(io.BytesIO(blob), weights_only=True)
    for name, obj in stateful.items():
        obj.load_state_dict(state[name])


def _stateful(parts, schedule) -> dict:
    """What a scheduled run resumes from: model, optimizer, streamer, order, and the schedule
    where it has a state (the autopilot)."""
    model, opt, streamer, order = parts
    extra = {"schedule": schedule} if hasattr(schedule, "state_dict") else {}
    return {"model": model, "opt": opt, "streamer": streamer, "order": order, **extra}


def _state(parts, schedule) -> bytes:
    return _saved(**_stateful(parts, schedule))


def _resumed(blob: bytes, kind: str):
    parts, schedule = _parts(seed=99), _schedule(kind)  # other weights: everything must come from the state
    _restore(blob, **_stateful(parts, schedule))
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


def _lengths(seed: int = 2) -> torch.Tensor:
    """Each of the ROWS rows' tokens: 1 to 40, and 0 in every ninth row (empty texts)."""
    lengths = torch.randint(1, 41, (ROWS,), generator=torch.Generator().manual_seed(seed))
    lengths[::9] = 0
    return lengths


def test_token_sized_mini_batches_take_the_fewest_rows_reaching_the_size_and_the_ranks_share_them():
    """``next_tokens``: against the order written out (each epoch's permutation, concatenated),
    every mini-batch is the shortest run of next rows whose tokens reach the size (one row per
    rank at least), the ranks' shares are one rank's mini-batch, ``tokens_seen`` counts what was
    taken, and a state saved anywhere resumes on the same rows."""
    lengths, rng = _lengths(), random.Random(4)
    written = torch.cat([mbs_ext.SampleOrder(ROWS, seed=5).permutation(e) for e in range(40)]).tolist()
    one, at, seen = mbs_ext.SampleOrder(ROWS, seed=5), 0, 0
    for step in range(60):
        size = rng.choice([1, 7, rng.randrange(1, 3000)])  # up to about 1.5 epochs of tokens
        want = 1
        while sum(lengths[written[at:at + want]].tolist()) < size:
            want += 1
        want = max(want, 2)  # two ranks: one row each at least
        both = [mbs_ext.SampleOrder(ROWS, seed=5) for _ in range(2)]
        for o in both:
            o.load_state_dict(one.state_dict())
        two = torch.cat([o.next_tokens(size, lengths, rank=r, world=2) for r, o in enumerate(both)])
        assert two.tolist() == written[at:at + want], step
        assert torch.equal(one.next_tokens(size, lengths, world=2, rank=0), two[:(want + 1) // 2])
        at, seen = at + want, seen + int(lengths[written[at:at + want]].sum())
        assert (one.samples_seen, one.tokens_seen) == (at, seen) == (both[1].samples_seen, both[1].tokens_seen)


def test_token_sizes_over_many_windows_and_epochs_match_one_running_sum():
    """3,000 rows (the order reads lengths in windows from 1,024 rows, doubling) and sizes up to
    about four epochs of tokens: each mini-batch ends where one running sum over the order written
    out first reaches the tokens taken so far plus the size. An order that had made other
    permutations, given this one's state, goes on alike."""
    rows, rng = 3000, random.Random(7)
    lengths = torch.randint(0, 10, (rows,), generator=torch.Generator().manual_seed(3))
    written = torch.cat([mbs_ext.SampleOrder(rows, seed=11).permutation(e) for e in range(60)])
    running = lengths[written].cumsum(0)
    order, at = mbs_ext.SampleOrder(rows, seed=11), 0
    for step in range(40):
        size = rng.choice([1, rng.randrange(1, 60_000)])
        before = int(running[at - 1]) if at else 0
        end = int(torch.searchsorted(running, before + size)) + 1
        assert torch.equal(order.next_tokens(size, lengths), written[at:end]), step
        at = end
        assert order.tokens_seen == int(running[at - 1])
    used = mbs_ext.SampleOrder(rows, seed=5)
    used.next(2000)  # its own permutations made, of another seed
    used.load_state_dict(order.state_dict())
    assert torch.equal(used.next_tokens(5000, lengths), order.next_tokens(5000, lengths))


def test_a_schedule_in_tokens_runs_on_the_tokens_clock_and_resumes():
    """``MiniBatches(..., lengths=)``: a ramp in tokens reads ``tokens_seen``; a sampler restored
    from another's ``state_dict`` goes on with the same rows; bad lengths are refused by name."""
    lengths, ramp = _lengths(), mbs_ext.Ramp(start=100, end=900, over=5000, multiple_of=50)
    batches = mbs_ext.MiniBatches(mbs_ext.SampleOrder(ROWS, seed=1), ramp, lengths=lengths)
    replay = mbs_ext.SampleOrder(ROWS, seed=1)
    for _ in range(12):
        size = ramp.size(replay.tokens_seen)
        assert next(batches) == replay.next_tokens(size, lengths).tolist()
    later = mbs_ext.MiniBatches(mbs_ext.SampleOrder(ROWS), ramp, lengths=lengths)
    later.load_state_dict(batches.state_dict())
    assert [next(later) for _ in range(5)] == [next(batches) for _ in range(5)]
    for bad in (lengths[:-1], lengths.double(), -lengths, torch.zeros(ROWS, dtype=torch.long)):
        with pytest.raises(ValueError, match="lengths must be"):
            mbs_ext.MiniBatches(mbs_ext.SampleOrder(ROWS), 10, lengths=bad)
    with pytest.raises(ValueError, match="tokens must be an int >= 1"):
        mbs_ext.SampleOrder(ROWS).next_tokens(0, lengths)
    with pytest.raises(ValueError, match="every row has 0 tokens"):  # not checked ahead on this path: found
        mbs_ext.SampleOrder(ROWS).next_tokens(5, torch.zeros(ROWS, dtype=torch.long))
    with pytest.raises(ValueError, match="negative"):  # nor this: found in the lengths read
        mbs_ext.SampleOrder(ROWS).next_tokens(10**6, torch.cat([lengths[:-1], torch.tensor([-1])]))


def test_the_autopilot_follows_the_noise_up_only_and_refusals_name_the_argument():
    pilot = mbs_ext.Autopilot(minimum=16, maximum=256, k=2.0, hysteresis=0.25, multiple_of=8)

    class N:  # what the autopilot reads: b_simple and its standard error (a NoiseScale's, or a step's Noise)
        def __init__(self, b, stderr=0.0):
            self.b_simple, self.b_simple_stderr = b, stderr

    assert pilot.size(0, None) == 16 and pilot.size(0, N(9.0)) == 16  # 18 rounds down to 16: unchanged
    assert pilot.size(0, N(40.0)) == 80  # 2 x 40, a multiple of 8, past 16 x 1.25
    assert pilot.size(0, N(42.0)) == 80  # 84 -> 80: within the hysteresis, unchanged
    assert pilot.size(0, N(10.0)) == 80  # never down
    assert pilot.size(0, N(1e9)) == 256  # clipped to the maximum
    assert mbs_ext.Autopilot(minimum=8, maximum=100, multiple_of=16).size(0, N(1e9)) == 96  # maximum rounded down
    careful = mbs_ext.Autopilot(minimum=8, maximum=512, max_rel_stderr=0.2)
    assert careful.size(0, N(300.0, stderr=None)) == 8  # one step: no standard error yet, no move
    assert careful.size(0, N(300.0, stderr=90.0)) == 8  # 30%: too uncertain to act on
    assert careful.size(0, N(300.0, stderr=45.0)) == 300  # 15%: acted on
    assert mbs_ext.Autopilot(minimum=8, maximum=512, max_rel_stderr=None).size(0, N(300.0, stderr=None)) == 300
    with pytest.raises(ValueError, match="max_rel_stderr must be a positive number"):
        mbs_ext.Autopilot(minimum=8, maximum=16, max_rel_stderr=0)
    with pytest.raises(ValueError, match="batch_size must be an int"):
        mbs_ext.SampleOrder(10).next(0)
    with pytest.raises(ValueError, match="milestones must start at 0"):
        mbs_ext.Steps(((5, 10),))
    with pytest.raises(ValueError, match="rule must be 'linear', 'sqrt' or 'adascale'"):
        mbs_ext.scaled_lr(1.0, 1, 2, "cube")
    with pytest.raises(ValueError, match="this order's has"):
        mbs_ext.SampleOrder(10).load_state_dict(mbs_ext.SampleOrder(11).state_dict())


def _per_example_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Every row's gradient, flattened (N x P), by torch.func at the model's weights."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(p, xi, yi):
        return F.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    grads = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
    return torch.cat([g.reshape(len(x), -1) for g in grads.values()], dim=1)


def test_adascale_gain_is_the_ratio_of_expected_squared_gradient_norms():
    """AdaScale's gain is ``E|g_base|^2 / E|g_size|^2`` (the squared norm of a mean gradient over
    ``base_size`` rows, against ``size`` rows). Drawn here from per-example gradients (torch.func)
    by Monte Carlo, 20,000 draws of rows with replacement per size; :func:`mbs_ext.adascale_gain`
    from the exact ``B_simple = tr(Sigma) / |G|^2`` of the same gradients matches it to 3%."""
    x, y = _data()
    model = _parts()[0]
    per = _per_example_grads(model, x, y)
    mean = per.mean(0)
    trace = ((per - mean) ** 2).sum(1).mean().item()  # tr(Sigma), per row (the population covariance)
    b_simple = trace / mean.square().sum().item()
    gen = torch.Generator().manual_seed(0)

    def expected_sq(b: int) -> float:
        draws = torch.randint(0, ROWS, (20_000, b), generator=gen)
        return per[draws].mean(1).square().sum(1).mean().item()

    for base, size in ((2, 8), (4, 64), (8, 8)):
        got = mbs_ext.adascale_gain(b_simple, base, size)
        assert got == pytest.approx(expected_sq(base) / expected_sq(size), rel=0.03), (base, size, b_simple)
        assert 1.0 <= got <= size / base
    assert mbs_ext.adascale_gain(None, 4, 64) == 1.0  # no estimate yet: the base rate
    assert mbs_ext.adascale_gain(-3.0, 4, 64) == 1.0  # a negative estimate reads as no noise


def test_adascale_learning_rate_follows_the_streamers_noise():
    """``scaled_lr(rule="adascale")`` reads ``B_simple`` from the streamer's moving averages."""
    x, y = _data()
    model, opt, streamer, order = _parts()
    with pytest.raises(ValueError, match="needs noise="):
        mbs_ext.scaled_lr(0.1, 8, 32, "adascale")
    assert mbs_ext.scaled_lr(0.1, 8, 32, "adascale", noise=streamer.noise) == 0.1  # no step yet
    for _ in range(3):
        streamer.step((x, y), indices=order.next(36))
    b = streamer.noise.b_simple
    assert b is not None
    assert mbs_ext.scaled_lr(0.1, 8, 32, "adascale", noise=streamer.noise) == pytest.approx(
        0.1 * (b / 8 + 1) / (b / 32 + 1), rel=1e-12)


def test_a_learning_rate_schedule_on_samples_lands_where_it_was_at_any_size_and_on_resume():
    """SampleLR sets base x ``lr_at(samples seen)`` x the size's coupling; two runs that reach the
    same samples in different step sizes set the same warm-up factor, and a resumed schedule (other
    base rates in the new optimizer: they must come from the state) sets what the first would."""
    warm = 100

    def lr_at(seen):
        return min(1.0, (seen + 1) / warm)

    def run(sizes, rule=None):
        model = nn.Linear(3, 2)
        opt = torch.optim.SGD([{"params": [model.weight], "lr": 0.2}, {"params": [model.bias], "lr": 0.05}])
        sched, seen, got = mbs_ext.SampleLR(opt, lr_at, base_size=8 if rule else None, rule=rule), 0, []
        for size in sizes:
            got.append((seen, sched.step(seen, size)))
            seen += size
        return opt, sched, got

    _, _, small = run([4] * 30)
    _, _, large = run([12] * 10)
    at_small = dict(small)
    for seen, lrs in large:  # the same samples seen, the same rates, whatever the step size
        assert lrs == at_small[seen] == [0.2 * lr_at(seen), 0.05 * lr_at(seen)]
    _, _, sqrt = run([8, 16, 32], rule="sqrt")
    assert [lrs[0] for _, lrs in sqrt] == pytest.approx([0.2 * lr_at(s) * math.sqrt(b / 8) for s, b in
                                                         zip((0, 8, 24), (8, 16, 32))], rel=1e-15)
    opt, sched, _ = run([8, 8, 8])
    fresh = torch.optim.SGD(nn.Linear(3, 2).parameters(), lr=9.0)
    fresh.add_param_group({"params": [nn.Parameter(torch.zeros(1))], "lr": 9.0})
    resumed = mbs_ext.SampleLR(fresh, lr_at)
    resumed.load_state_dict(sched.state_dict())
    assert resumed.step(24) == sched.step(24) == [0.2 * lr_at(24), 0.05 * lr_at(24)]
    with pytest.raises(ValueError, match="lr_at must be a function"):
        mbs_ext.SampleLR(opt, 0.5)
    with pytest.raises(ValueError, match="needs base_size="):
        mbs_ext.SampleLR(opt, lr_at, rule="sqrt")
    with pytest.raises(ValueError, match="size= is needed"):
        mbs_ext.SampleLR(opt, lr_at, base_size=8, rule="linear").step(0)


# --- a world-size change: one rank, then two, then one again ------------------------------------

WORLD_SIZES = [(1, 6), (2, 6), (1, 6)]  # (ranks, steps) of the three legs


def _leg_parts(blob: bytes | None, world: int):
    """The run's parts on a world of ``world`` ranks (DDP over two), from ``blob`` (None: a fresh start)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    model = nn.parallel.DistributedDataParallel(net) if world > 1 else net
    streamer = mbs_ext.MicroBatchStreamer(model, opt, nn.CrossEntropyLoss(), micro_batch_size=6)
    order = mbs_ext.SampleOrder(ROWS, seed=3)
    if blob is not None:
        _restore(blob, model=net, opt=opt, streamer=streamer, order=order)
    return net, opt, streamer, order


def _leg(rank: int, blob: bytes | None, sizes: list[int], world: int) -> tuple[bytes, list[list[int]]]:
    """Steps of ``sizes`` on rank ``rank`` of ``world``: the state after them and the rows this rank took."""
    net, opt, streamer, order = _leg_parts(blob, world)
    data, took = _data(), []
    for size in sizes:
        rows = order.next(size, rank=rank, world=world)
        took.append(rows.tolist())
        streamer.step(data, indices=rows)
    return _saved(model=net, opt=opt, streamer=streamer, order=order), took


@pytest.mark.multiprocess
def test_a_run_resumed_on_two_ranks_then_one_equals_the_run_on_one():
    """Six steps on one rank, six on two gloo ranks (DDP), six on one again, resumed from the saved
    states at each change, with the mini-batch size changing at every step: the parameters equal
    one rank's uninterrupted run to 1e-12 (the two ranks add their shares in another order), and
    every epoch's rows were taken exactly once over the three legs."""
    from ddp_harness import run_world

    rng = random.Random(7)
    sizes = [rng.randrange(8, 41) for _ in range(sum(n for _, n in WORLD_SIZES))]
    want_blob, want_rows = _leg(0, None, sizes, 1)
    want = _leg_parts(want_blob, 1)[0]
    blob, taken, at = None, [], 0
    for world, steps in WORLD_SIZES:
        leg = sizes[at:at + steps]
        ranks = run_world(_leg, blob, leg, world, world=world, timeout=120) if world > 1 else [_leg(0, blob, leg, 1)]
        blob = ranks[0][0]
        taken += [sum((r[1][i] for r in ranks), []) for i in range(steps)]  # rank 0's share, then rank 1's
        at += steps
    assert taken == want_rows  # the same global order, step by step
    flat = sum(taken, [])
    for e in range(len(flat) // ROWS):
        assert sorted(flat[e * ROWS:(e + 1) * ROWS]) == list(range(ROWS)), e
    got = _leg_parts(blob, 1)[0]
    for p, q in zip(got.parameters(), want.parameters()):
        torch.testing.assert_close(p, q, rtol=0.0, atol=1e-12)
    assert not all(torch.equal(p, q) for p, q in zip(got.parameters(), _leg_parts(None, 1)[0].parameters()))


def _loader_run(steps: int, blob: bytes | None = None, seed: int = 0):
    """``steps`` steps fed by torchdata's StatefulDataLoader over :class:`mbs_ext.MiniBatches` (a
    ramp), the learning rate following the size; from ``blob`` (model, optimizer, streamer and
    loader states) where given. Returns the parts and the saved states after the last step."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    model, opt, streamer, order = parts = _parts(seed)
    loader = StatefulDataLoader(torch.utils.data.TensorDataset(*_data()),
                                batch_sampler=mbs_ext.MiniBatches(order, _schedule("ramp")))
    if blob is not None:
        _restore(blob, model=model, opt=opt, streamer=streamer, loader=loader)
    batches = iter(loader)
    for _ in range(steps):
        x, y = next(batches)
        for group in opt.param_groups:
            group["lr"] = mbs_ext.scaled_lr(1e-2, 16, len(x), "sqrt")
        streamer.step((x, y))
    return parts, _saved(model=model, opt=opt, streamer=streamer, loader=loader)


def test_a_stateful_dataloader_over_the_order_resumes_bit_identical():
    """torchdata's StatefulDataLoader gathering the rows :class:`mbs_ext.MiniBatches` picks (a ramp):
    the run equals the scheduled run on ``indices=`` to 1e-15 (the same rows, taken from the
    dataset by another path: after 12 steps the last bits differ), and, interrupted at every step
    and resumed from the loader's own ``state_dict()`` (with the model's, optimizer's and
    streamer's), ends bit-identical to the run that was not interrupted."""
    steps = 12
    want, _ = _loader_run(steps)
    by_indices = _parts()
    _train(by_indices, _schedule("ramp"), _data(), steps)
    for p, q in zip(want[0].parameters(), by_indices[0].parameters()):
        torch.testing.assert_close(p, q, rtol=0.0, atol=1e-15)
    for at in range(1, steps):
        _, blob = _loader_run(at)
        got, _ = _loader_run(steps - at, blob, seed=99)  # other weights: everything comes from the states
        for p, q in zip(got[0].parameters(), want[0].parameters()):
            assert torch.equal(p, q), at
    with pytest.raises(ValueError, match="size must be an int >= 1 or a schedule"):
        mbs_ext.MiniBatches(mbs_ext.SampleOrder(10), 0)
    assert list(mbs_ext.MiniBatches(mbs_ext.SampleOrder(10, seed=1), 4, total_samples=10)) == [
        r.tolist() for r in (lambda o: [o.next(4), o.next(4), o.next(4)])(mbs_ext.SampleOrder(10, seed=1))]


@pytest.mark.slow  # dynamo traces the model
@pytest.mark.parametrize("multiple_of", [6, 1])
def test_a_changing_batch_size_compiles_no_more_graphs(multiple_of):
    """A compiled model under a ramp whose size changes at every step: the graphs compiled are those
    of its micro-batches' shapes, never one per mini-batch size. Sizes in multiples of the
    micro-batch (6 rows): every micro-batch has 6 rows, one graph. Any size: the last micro-batch
    of a step is smaller, and dynamo traces the rows as a symbol from the second shape on: at most
    one graph more (and one for a single row, which dynamo specializes)."""
    counting, graphs = graph_recorder()
    torch._dynamo.reset()
    data = _data()
    model, opt, _, order = _parts()
    compiled = torch.compile(model, backend=counting)
    streamer = mbs_ext.MicroBatchStreamer(compiled, opt, nn.CrossEntropyLoss(), micro_batch_size=6)
    schedule, sizes = mbs_ext.Ramp(start=6, end=60, over=400, multiple_of=multiple_of), set()
    while order.samples_seen < 500:
        size = schedule.size(order.samples_seen)
        sizes.add(size)
        streamer.step(data, indices=order.next(size))
    assert len(sizes) >= 8, sorted(sizes)
    assert len(graphs) <= (1 if multiple_of == 6 else 3), (len(graphs), sorted(sizes))
