"""Unit tests of the step's components, each on its own: options, the normalizer, the
batch and index validators, the split rule, the finish's skip decision and the back-off
policy. End-to-end behaviour is tested against full-batch references elsewhere."""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch
from common import balanced_sizes
from torch import nn

from mbs_ext import world
from mbs_ext.counts import normalize
from mbs_ext.counts import sources as counts
from mbs_ext.memory import backoff
from mbs_ext.model import members as model
from mbs_ext.model import options, wrappers
from mbs_ext.step import finish
from mbs_ext.streaming import batch, ring
from mbs_ext.world import record


class TestStepOptions:
    def test_validated_once_and_frozen(self):
        opts = options.StepOptions(micro_batch_size=4, max_grad_norm=1)
        assert opts.max_grad_norm == 1.0 and isinstance(opts.max_grad_norm, float)
        with pytest.raises(dataclasses.FrozenInstanceError):
            opts.micro_batch_size = 3

    @pytest.mark.parametrize(
        ("field", "value", "exc"),
        [("micro_batch_size", 0, ValueError), ("micro_batch_size", "big", ValueError),
         ("micro_batch_size", 2.0, TypeError), ("normalize", "tokens", ValueError), ("normalize", 3, TypeError),
         ("on_nonfinite", "ignore", ValueError), ("max_grad_norm", -1.0, ValueError),
         ("memory_budget", 0, ValueError), ("autocast_dtype", torch.int8, ValueError)],
    )
    def test_each_field_names_itself(self, field, value, exc):
        kw = {"micro_batch_size": 4, field: value}
        with pytest.raises(exc, match=field):
            options.StepOptions(**kw)

    def test_overrides(self):
        base = options.StepOptions(micro_batch_size=4, on_nonfinite="raise")
        assert options.make_options(base, {"micro_batch_size": 2}) == options.StepOptions(
            micro_batch_size=2, on_nonfinite="raise")
        assert options.make_options(None, {"micro_batch_size": 3}).micro_batch_size == 3
        with pytest.raises(TypeError, match="micro_batch_size is required"):
            options.make_options(None, {})
        with pytest.raises(ValueError, match="micro_batch_size"):
            options.make_options(base, {"micro_batch_size": -1})


def _normalizer(rule, sizes):
    """The normalizer of one process, its count source chosen as the step chooses it."""
    source = counts.choose(rule, None, None, sizes, torch.device("cpu"))
    return normalize.Normalizer(rule, source, num_micro_batches=len(sizes), device=torch.device("cpu"), alone=True)


def _ranges(sizes):
    out, start = [], 0
    for n in sizes:
        out.append((start, start + n))
        start += n
    return out


class TestNormalizer:
    @pytest.mark.parametrize("sizes", [[4, 3, 3], [1], [5, 5]])
    def test_samples_weights_are_shares_of_the_rows(self, sizes):
        norm = _normalizer(normalize.Rule("samples"), sizes)
        weights = [norm.weight(norm.count(None, r)) for r in _ranges(sizes)]
        assert weights == [n / sum(sizes) for n in sizes]
        norm.settle()
        assert norm.rescale_factor() == 1.0  # known ahead: nothing to rescale

    def test_count_rule_settles_to_the_exact_total(self):
        counts = iter([2.0, 6.0, 0.0, 4.5])
        norm = _normalizer(normalize.Rule("count", lambda mb: next(counts), "test"), [1, 1, 1, 1])
        provisional = [norm.weight(norm.count(None, r)) for r in _ranges([1, 1, 1, 1])]
        norm.settle()
        factor = norm.rescale_factor()
        exact = [w * factor for w in provisional]
        assert exact == pytest.approx([2 / 12.5, 6 / 12.5, 0.0, 4.5 / 12.5], rel=1e-15)

    def test_sum_rule_weights_one_and_total_one(self):
        norm = _normalizer(normalize.Rule("sum"), [3, 3])
        for r in _ranges([3, 3]):
            c = norm.count(None, r)
            norm.add_loss(torch.tensor(2.0, dtype=torch.float64), c)
            assert norm.weight(c) == 1.0
        norm.settle()
        assert norm.check(*[float(v) for v in norm.device_values()]) == 4.0

    def test_invalid_device_count_is_marked_and_named(self):
        values = iter([torch.tensor(3.0), torch.tensor(-1.0), torch.tensor(float("nan"))])
        norm = _normalizer(normalize.Rule("count", lambda mb: next(values), "the count"), [2, 2, 2])
        for r in _ranges([2, 2, 2]):
            norm.count(None, r)
        norm.settle()
        read = [float(v) for v in norm.device_values()]
        with pytest.raises(ValueError, match=r"returned an invalid count at micro-batch 1 of 3 \(rows \[2, 4\)"):
            norm.check(*read)

    def test_zero_total_is_an_error(self):
        norm = _normalizer(normalize.Rule("count", lambda mb: 0, "c"), [2])
        norm.count(None, (0, 2))
        norm.settle()
        with pytest.raises(ValueError, match="sum to 0"):
            norm.check(0.0, 0.0, 0.0, 0.0)  # loss sum, total, no invalid count here or elsewhere

    def test_zero_count_adds_no_nan_loss(self):
        counts = iter([torch.tensor(0.0), torch.tensor(2.0)])
        norm = _normalizer(normalize.Rule("count", lambda mb: next(counts), "c"), [2, 2])
        for r, loss in zip(_ranges([2, 2]), [float("nan"), 1.5]):
            norm.add_loss(torch.tensor(loss, dtype=torch.float64), norm.count(None, r))
        norm.settle()
        assert float(norm.loss_sum) == 3.0

    @staticmethod
    def _one_micro_batch(loss, count, on_device=False):
        """A class-target rule over one micro-batch of one process with this loss and count (a
        0-dim float64 tensor, as a count taken on the device is, where ``on_device``)."""
        calls = []
        taken = torch.tensor(count, dtype=torch.float64) if on_device else count
        rule = normalize.Rule("count", lambda mb: calls.append(mb) or taken, "targets", per_row=lambda t: 1)
        norm = _normalizer(rule, [4])
        weight = norm.weight(norm.count("mb", (0, 4)))
        norm.add_loss(torch.tensor(loss, dtype=torch.float64), 1.0)
        norm.settle()
        return norm, weight, [float(v) for v in norm.device_values()], calls

    @pytest.mark.parametrize("on_device", [False, True], ids=["host", "device"])
    def test_one_micro_batch_alone_takes_its_count_as_the_total(self, on_device):
        norm, weight, read, calls = self._one_micro_batch(1.5, 3.0, on_device)
        assert float(weight) == 1.0 and norm.exact and calls == ["mb"]  # exact from its own count: no rescale
        assert norm.check(*read) == 1.5
        several = _normalizer(norm.rule, [2, 2])
        several.count("mb", (0, 2))
        assert not several.exact  # several micro-batches: weighed provisionally until the total is known

    @pytest.mark.parametrize("on_device", [False, True], ids=["host", "device"])
    def test_one_micro_batch_with_no_items_fails_as_any_split_does(self, on_device):
        norm, weight, read, calls = self._one_micro_batch(float("nan"), 0.0, on_device)  # a mean over no items
        assert float(weight) == 0.0  # 0 over 1, not 0/0
        with pytest.raises(ValueError, match="sum to 0"):
            norm.check(*read)


class TestSplitAndValidators:
    def test_split_rule_matches_the_written_out_promise(self):
        for n in range(0, 50):
            for m in range(1, n + 2):
                assert ring.split_sizes(n, m) == (balanced_sizes(n, m) if n else [])

    @pytest.mark.parametrize(
        ("value", "exc", "match"),
        [({"a": 1}, ValueError, "at least one tensor"), ((torch.zeros(3), torch.zeros(4)), ValueError, "dim-0"),
         (torch.zeros(0, 2), ValueError, "empty"), (torch.tensor(1.0), ValueError, "0-dim"),
         (torch.zeros(3).to_sparse(), ValueError, "dense"), (range(3), TypeError, "batch is a range")],
    )
    def test_batch_validator(self, value, exc, match):
        with pytest.raises(exc, match=match):
            batch.check(value, None, torch.device("cpu"))

    def test_batch_and_indices(self):
        data = (torch.zeros(10, 2), torch.zeros(10))
        info = batch.check(data, None, torch.device("cpu"))
        assert (info.rows, info.indices, info.pair) == (10, None, True)
        assert info.signature == (((2,), torch.float32), ((), torch.float32))
        info = batch.check(data, torch.tensor([3, 1, 3], dtype=torch.int32), torch.device("cpu"))
        assert info.rows == 3 and info.indices.dtype == torch.int64 and info.indices.tolist() == [3, 1, 3]
        for bad, match in [(torch.tensor([10]), "index 10"), (torch.tensor([-1]), "negative index -1"),
                           (torch.tensor([[1]]), "1-d"), (torch.tensor([], dtype=torch.int64), "empty"),
                           ([1, 2], "torch.Tensor"), (torch.tensor([1.0]), "int64")]:
            with pytest.raises((TypeError, ValueError), match=match):
                batch.check(data, bad, torch.device("cpu"))


class TestFinishDecision:
    def _decide(self, loss, grads_bad, scaler=None, on_nonfinite="skip"):
        opts = options.StepOptions(micro_batch_size=2, scaler=scaler, on_nonfinite=on_nonfinite)
        norm = _normalizer(normalize.Rule("samples"), [2, 2])
        for r in _ranges([2, 2]):
            norm.add_loss(torch.tensor(loss if r[0] else 1.0), norm.count(None, r))
        return finish._should_skip(loss, grads_bad, norm, opts, torch.device("cpu"))

    def test_finite_steps(self):
        assert self._decide(1.0, False) is False

    def test_nonfinite_loss_warns_with_its_micro_batch(self):
        with pytest.warns(RuntimeWarning, match=r"non-finite loss at micro-batch 1 of 2 \(rows \[2, 4\)\)"):
            assert self._decide(math.nan, True) is True

    def test_raise(self):
        with pytest.raises(FloatingPointError, match="non-finite gradient"):
            self._decide(1.0, True, on_nonfinite="raise")

    def test_scaler_overflow_skips_silently(self):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert self._decide(1.0, True, scaler=torch.amp.GradScaler("cpu")) is True


class TestBackoffPolicy:
    @pytest.mark.parametrize("limit", [1, 5, 13, 39, 64])
    def test_largest_fitting_is_within_a_sixteenth(self, limit):
        probed = []

        def fits(m):
            probed.append(m)
            return m <= limit

        found = backoff.largest_fitting(fits, 64)
        assert found <= limit and found >= limit - max(1, 64 // 16)
        assert len(probed) <= 6

    def test_nothing_fits(self):
        assert backoff.largest_fitting(lambda m: False, 40) is None

    def test_with_backoff_redoes_at_the_size_found(self):
        tried, remembered = [], []

        def attempt(m):
            tried.append(m)
            if m > 10:
                raise torch.OutOfMemoryError("injected")
            return m

        with pytest.warns(RuntimeWarning, match="redoing the step with micro_batch_size=10"):
            out = backoff.with_backoff(attempt, 40, retryable=lambda e: True, fits_at=lambda m: m <= 10,
                                       free=lambda: None, remember=remembered.append)
        assert out == 10 and tried == [40, 10] and remembered == [10]

    def test_a_probe_failing_otherwise_does_not_fit(self):
        """A probe raising another error (a BatchNorm refusing one row) counts as not fitting: a
        smaller size that fits is still found, and when none does, the out-of-memory error is
        raised with what the probe hit."""

        def attempt(m):
            if m > 3:
                raise torch.OutOfMemoryError("injected")
            return m

        def fits(m):
            if m in (1, 5):
                raise ValueError("one row")
            return m <= 3

        with pytest.warns(RuntimeWarning, match="micro_batch_size=3"):
            assert backoff.with_backoff(attempt, 10, retryable=lambda e: True, fits_at=fits, free=lambda: None,
                                        remember=lambda m: None) == 3
        with pytest.raises(torch.OutOfMemoryError, match="injected") as info:
            backoff.with_backoff(attempt, 10, retryable=lambda e: True, fits_at=lambda m: fits(1),
                                 free=lambda: None, remember=lambda m: None)
        assert any("no micro-batch size that fits" in n and "micro_batch_size=5 failed with ValueError: one row"
                   in n for n in info.value.__notes__)

    def test_other_errors_and_unretryable_ones_propagate(self):
        def boom(m):
            raise ValueError("not memory")

        with pytest.raises(ValueError):
            backoff.with_backoff(boom, 8, retryable=lambda e: True, fits_at=lambda m: True, free=lambda: None,
                                 remember=lambda m: None)

        def oom(m):
            raise torch.OutOfMemoryError("injected")

        with pytest.raises(torch.OutOfMemoryError):
            backoff.with_backoff(oom, 8, retryable=lambda e: False, fits_at=lambda m: True, free=lambda: None,
                                 remember=lambda m: None)


class TestModelWalk:
    """The step's one walk over a model agrees with torch's own iterators."""

    def test_members_match_modules_parameters_and_buffers(self):
        shared = nn.Linear(3, 3)
        frozen = nn.Linear(3, 3).requires_grad_(False)
        inner = nn.Sequential(shared, nn.BatchNorm1d(3), nn.Sequential(shared, frozen))
        net = nn.ModuleDict({"a": inner, "b": nn.Sequential(nn.Identity(), inner), "c": shared})
        net.add_module("gone", None)
        net.b[0].register_buffer("tied", net.a[1].running_mean)  # one buffer under two names
        found = model.members(net)
        assert [id(m) for m in found.modules] == [id(m) for m in net.modules()]
        assert [id(p) for p in found.params] == [id(p) for p in net.parameters() if p.requires_grad]
        assert [id(b) for b in found.buffers] == [id(b) for b in net.buffers()]
        # Every slot, the tied one under both names: a rollback puts back whatever a forward replaced.
        expected = {(id(m), name, id(b)) for m in net.modules()
                    for name, b in m.named_buffers(recurse=False, remove_duplicate=False)}
        assert {(id(m), name, id(b)) for m, name, b in found.slots} == expected


class TestWorld:
    def test_plain_model_without_distributed_is_one_rank(self):
        r = world.world_of(lin := nn.Linear(2, 2), list(lin.parameters()))
        assert (type(r), r.group, r.size) == (world.World, None, 1)

    def test_unwrap_sees_through_wrappers_only(self):
        class Net(nn.Module):  # a user's model with a submodule called "module"
            def __init__(self):
                super().__init__()
                self.module, self.head = nn.Linear(2, 2), nn.Linear(2, 1)

            def forward(self, x):
                return self.head(self.module(x))

        net = Net()
        assert wrappers.unwrap(net) is net
        assert wrappers.unwrap(torch.compile(net)) is net
        assert wrappers.find_ddp(torch.compile(net)) is None

    def test_all_reduce_sum_keeps_order_of_host_and_device_values(self):
        out = record.all_reduce_sum([1.0, torch.tensor(2.0), 3.0, 4.0, 5.0], torch.device("cpu"), None)
        assert out.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]


class TestFailureRecord:
    """The failure record that rides in the step's collective (summed over ranks)."""

    def test_slots_say_which_rank_failed_where_and_how(self):
        one = record.failure_slots(3, 1, record.Failure(2, out_of_memory=True))
        two = record.failure_slots(3, 2, record.Failure(-1, out_of_memory=False))
        assert one == [0.0, 4.0, 0.0, 0.0, 1.0, 0.0]
        assert record.failure_slots(3, 0, None) == [0.0] * 6
        summed = [a + b for a, b in zip(one, two)]
        with pytest.raises(record.PeerFailed, match=r"rank 1 ran out of memory at micro-batch 2; "
                                                    r"rank 2 raised before its first micro-batch; every rank undid"):
            record.raise_failures(summed, 3, 0)

    def test_a_rank_is_not_told_of_its_own_failure(self):
        record.raise_failures([0.0, 3.0, 0.0, 0.0, 0.0, 0.0], 3, 1)  # nothing raised


class TestCountsAhead:
    """An nn loss's class-target counts taken for every micro-batch at once, from host targets."""

    @pytest.mark.parametrize("weighted", [False, True])
    def test_equal_the_per_micro_batch_counts(self, weighted):
        from mbs_ext.counts import loss

        g = torch.Generator().manual_seed(0)
        weight = torch.rand(5, generator=g, dtype=torch.float64) if weighted else None
        rule = loss.rule_for(nn.CrossEntropyLoss(weight=weight, ignore_index=2), None)
        targets = torch.randint(0, 5, (23, 3), generator=g)
        for indices in (None, torch.randperm(23, generator=g)[:17]):
            rows = targets if indices is None else targets[indices]
            sizes = ring.split_sizes(len(rows), 4)
            ahead = counts.counts_ahead(rule, targets, indices, sizes)
            per_micro_batch = [rule.count((None, rows[a:b])) for a, b in _ranges(sizes)]
            assert ahead == pytest.approx(per_micro_batch, rel=1e-15, abs=0)
            assert sum(ahead) == pytest.approx(float(((rows != 2) * (1.0 if weight is None else weight[rows])).sum()))

    def test_none_where_counts_are_taken_per_micro_batch(self):
        from mbs_ext.counts import loss

        ce = loss.rule_for(nn.CrossEntropyLoss(), None)
        assert counts.counts_ahead(ce, None, None, [2]) is None  # no (inputs, targets) pair
        assert counts.counts_ahead(ce, torch.rand(4, 3), None, [4]) is not None  # probability targets
        assert counts.counts_ahead(normalize.rule_of(lambda mb: 1.0), torch.zeros(4, dtype=torch.long), None,
                                      [4]) is None  # a user's callable sees each micro-batch
        assert counts.counts_ahead(normalize.rule_of("samples"), torch.zeros(4), None, [4]) is None

    def test_a_negative_class_weight_is_refused(self):
        from mbs_ext.counts import loss

        rule = loss.rule_for(nn.CrossEntropyLoss(weight=torch.tensor([1.0, -1.0])), None)
        with pytest.raises(ValueError, match="non-negative"):
            counts.counts_ahead(rule, torch.tensor([0, 1, 1]), None, [2, 1])


class TestCountSources:
    """Where counts come from is chosen once per step (counts.choose); each source on its own."""

    CPU = torch.device("cpu")

    def _choose(self, rule, sizes, targets=None):
        return counts.choose(rule, targets, None, sizes, self.CPU)

    def test_choice_follows_the_rule_the_targets_and_the_world(self):
        from mbs_ext.counts import loss

        ce = loss.rule_for(nn.CrossEntropyLoss(ignore_index=0), None)
        targets = torch.tensor([0, 1, 2, 0, 1])
        assert isinstance(self._choose(normalize.rule_of("samples"), [3, 2]), counts.Fixed)
        assert isinstance(self._choose(ce, [5], targets), counts.Ahead)  # one micro-batch too: its count is taken
        assert isinstance(self._choose(ce, [3, 2], targets), counts.Ahead)
        assert isinstance(self._choose(ce, [3, 2]), counts.Called)  # no host targets
        assert isinstance(self._choose(normalize.rule_of(lambda mb: 1.0), [3, 2], targets), counts.Called)

    def test_fixed_counts_and_totals(self):
        rows = [(0, 3), (3, 5)]
        for kind, expected, total in [("samples", [3.0, 2.0], 5.0), ("micro_batches", [1.0, 1.0], 2.0),
                                      ("sum", [1.0, 1.0], 1.0)]:
            source = self._choose(normalize.rule_of(kind), [3, 2])
            assert [source.take(None, r) for r in rows] == expected and source.total() == total

    def test_ahead_hands_out_its_counts_in_order(self):
        from mbs_ext.counts import loss

        source = self._choose(loss.rule_for(nn.CrossEntropyLoss(ignore_index=0), None), [3, 2],
                              torch.tensor([0, 1, 2, 0, 0]))
        assert [source.take(None, r) for r in [(0, 3), (3, 5)]] == [2.0, 0.0] and source.total() == 2.0

    def test_called_checks_host_counts_at_once_and_keeps_device_counts(self):
        values = iter([2, -1.0, True, torch.tensor(3.0), torch.ones(2)])
        source = self._choose(normalize.rule_of(lambda mb: next(values)), [1] * 5)
        assert source.take(None, (0, 1)) == 2.0 and source.total() is None
        with pytest.raises(ValueError, match="non-negative finite"):
            source.take(None, (1, 2))
        with pytest.raises(TypeError, match="non-negative finite"):
            source.take(None, (2, 3))
        kept = source.take(None, (3, 4))
        assert isinstance(kept, torch.Tensor) and kept.dtype == torch.float64 and float(kept) == 3.0
        with pytest.raises(ValueError, match="shape"):
            source.take(None, (4, 5))


class TestOneProcessWorld:
    """The hooks of one process (the base every world builds on), and the collective's record."""

    CPU = torch.device("cpu")

    def test_buffers_only_for_low_precision_or_when_asked(self):
        one = world.World()
        assert one.buffer_dtype(None, [nn.Parameter(torch.zeros(2))]) is None
        assert one.buffer_dtype(None, [nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))]) == torch.float32
        assert one.buffer_dtype(torch.float64, [nn.Parameter(torch.zeros(2))]) == torch.float64

    def test_normalizer_is_exact_where_the_total_is_known_ahead(self):
        info = batch.check((torch.zeros(5, 2), torch.zeros(5)), None, self.CPU)
        one = world.World()
        exact = normalize.for_step(normalize.rule_of("samples"), None, info, [3, 2], self.CPU,
                                   ahead=one.counts_ahead, alone=one.alone)
        assert exact.exact and exact.denom == 5.0
        called = normalize.for_step(normalize.rule_of(lambda mb: 1.0), None, info, [3, 2], self.CPU,
                                    ahead=one.counts_ahead, alone=one.alone)
        assert not called.exact and called.denom is None

    def test_alone_nothing_is_agreed_or_shared(self):
        one = world.World()
        assert one.agree(None, [2, 2, 1], self.CPU) == 3
        assert one.share_failure(RuntimeError("x"), 1, world.Phase.STREAMING, False, [], self.CPU, None) is False
        assert one.backs_off(True) and not one.backs_off(False)
        phases = [world.Phase.CHECKING, world.Phase.SYNCING_BUFFERS, world.Phase.AGREEING, world.Phase.STREAMING,
                  world.Phase.COLLECTING]
        assert phases == sorted(phases) == list(world.Phase)

    def test_record_layout_is_the_same_for_success_and_failure(self):
        layout = record.Layout(world=2, rank=1, presence=3)
        ok = layout.pack(total=4.0, loss_sum=2.0, invalid_counts=0.0, nonfinite=1.0, noise_sq=5.0, micro_batches=3.0,
                         presence=[True, False, True])
        failed = record.Layout(world=2, rank=0, presence=3).pack(failure=record.Failure(1, out_of_memory=True))
        assert len(ok) == len(failed) == 6 + 3 + 2 * 2
        summed = layout.read(record.all_reduce_sum([a + b for a, b in zip(ok, failed)], self.CPU, None))
        assert [float(summed.head(n)) for n in record.Layout.HEAD] == [4.0, 2.0, 0.0, 1.0, 5.0, 3.0]
        assert [float(v) for v in summed.noise(0.0, 0.0)] == [5.0, 3.0]
        assert summed.presence().tolist() == [1.0, 0.0, 1.0]
        assert float(summed.failed()) == 1.0
        with pytest.raises(record.PeerFailed, match="rank 0 ran out of memory at micro-batch 1"):
            summed.raise_if_failed(1.0)
        assert record.Record().failed() == 0.0  # one process: nothing to read
