"""Ranks that fail together: an error on one DDP rank makes every rank undo the step and raise.

Two gloo processes (``tests/ddp_harness.py``, with its watchdog), 10 and 7 rows at
``micro_batch_size=3`` (4 and 3 micro-batches), float64, AdamW with state from one
good step first. Rank 1 fails at micro-batch 0, 1 or its last (2) with an exception,
before its first micro-batch (its batch is refused by the checks), or out of memory
while rank 0 raises an exception (no back-off then). Each case checks, on every rank:
the failing rank raises its own error, the other raises ``PeerFailed`` naming rank 1
and where; both within seconds (a hang would take the process group's timeout);
parameters, buffers, optimizer state and (for ``accumulate``) the caller's ``.grad``
bit-identical to before; and a step right after on both ranks equals a single-process
full-batch step on all 17 rows to 1e-12 (the process group and the step's state are
intact). Out of memory on rank 1 alone backs off on both ranks to one agreed size and
completes exactly; where not even one row fits on rank 1, both raise.
"""

from __future__ import annotations

import time

import pytest
import torch
from common import TinyLM, assert_bit_identical, full_batch_step, lm_loss, rel_err, snapshot, token_count
from ddp_harness import run_world
from torch.nn.parallel import DistributedDataParallel as DDP

import mbs_ext

# Several processes (gloo ranks): out of the quick suite, run by CI (docs/testing.md).
pytestmark = pytest.mark.multiprocess

ROWS = (10, 7)
M = 3
LAST = 2  # rank 1's last micro-batch (7 rows in 3)
# name: (micro-batch of the failure on rank 1, or -1 for a refused batch; the error raised)
CASES = {
    "raise_at_0": (0, ValueError),
    "raise_at_1": (1, ValueError),
    "raise_at_last": (LAST, ValueError),
    "oom_and_error": (1, torch.OutOfMemoryError),  # rank 0 raises a ValueError at its micro-batch 2
    "bad_batch": (-1, ValueError),
}


def data():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 11, (sum(ROWS), 6), generator=g)
    keep = torch.randint(1, 7, (sum(ROWS), 1), generator=g)
    return {"ids": ids, "labels": torch.where(torch.arange(6) < keep, torch.roll(ids, -1, 1), -100)}


def rows_of(batch, rank):
    lo = sum(ROWS[:rank])
    return {k: v[lo:lo + ROWS[rank]] for k, v in batch.items()}


def failing_loss(rank, at, exc_type, rank0_at=None):
    """``lm_loss``, raising ``exc_type`` on rank 1 at loss call ``at``, and a ValueError on rank 0
    at call ``rank0_at``."""
    calls = [0]

    def loss_fn(model, mb):
        i = calls[0]
        calls[0] += 1
        if rank == 1 and i == at:
            raise exc_type(f"injected on rank 1 at micro-batch {at}")
        if rank == 0 and i == rank0_at:
            raise ValueError(f"injected on rank 0 at micro-batch {rank0_at}")
        return lm_loss(model, mb)

    return loss_fn


def _faults(rank, accumulate):
    out = {}
    full = data()
    for name, (at, exc_type) in CASES.items():
        torch.manual_seed(0)
        net = TinyLM().double()
        # A buffer that differs by rank: each step begins with a broadcast of rank 0's buffers,
        # which a rank failing before its first micro-batch must still take part in.
        net.register_buffer("by_rank", torch.full((3,), float(rank), dtype=torch.float64))
        model = DDP(net)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        batch = rows_of(full, rank)
        mbs_ext.step(model, opt, batch, lm_loss, micro_batch_size=M, normalize=token_count)  # AdamW has state
        if accumulate:
            for p in model.parameters():
                p.grad = torch.full_like(p, 0.5)  # the caller's gradients, to be kept
        before = snapshot(model, opt)
        grads_before = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        bad = dict(batch, labels=batch["labels"][:-1]) if at < 0 and rank == 1 else batch
        loss_fn = failing_loss(rank, at, exc_type, rank0_at=LAST if name == "oom_and_error" else None)
        t0 = time.monotonic()
        try:
            if accumulate:
                mbs_ext.accumulate(model, bad, loss_fn, micro_batch_size=M, normalize=token_count)
            else:
                mbs_ext.step(model, opt, bad, loss_fn, micro_batch_size=M, normalize=token_count)
            raised = None
        except Exception as exc:  # noqa: BLE001 - the test records what each rank raised
            raised = (type(exc).__name__, str(exc), "\n".join(getattr(exc, "__notes__", [])))
        seconds = time.monotonic() - t0
        grads_kept = all(
            (g is None and p.grad is None) or (g is not None and p.grad is not None and torch.equal(g, p.grad))
            for p, g in zip(model.parameters(), grads_before)
        )
        unchanged = True
        try:
            assert_bit_identical(snapshot(model, opt), before)
        except AssertionError:
            unchanged = False
        # A step right after: the group and the step's state are intact.
        mbs_ext.step(model, opt, batch, lm_loss, micro_batch_size=M, normalize=token_count)
        out[name] = {"raised": raised, "seconds": seconds, "unchanged": unchanged, "grads_kept": grads_kept,
                     "params": [p.detach().clone() for p in model.parameters()],
                     "buffer": model.module.by_rank.clone()}
    return out


@pytest.fixture(scope="module", params=["step", "accumulate"])
def fault_results(request, tmp_path_factory):
    results = run_world(_faults, request.param == "accumulate", timeout=120,
                        out_dir=tmp_path_factory.mktemp(f"faults_{request.param}"))
    return request.param, results


def reference_params():
    """One process, no DDP: the good step twice on all 17 rows (the failed step in between did nothing)."""
    torch.manual_seed(0)
    model = TinyLM().double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        full_batch_step(model, opt, data(), lm_loss)
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("name", list(CASES))
def test_every_rank_raises_and_nothing_changes(fault_results, name):
    kind, results = fault_results
    at, exc_type = CASES[name]
    own, peer = results[1][name], results[0][name]
    assert own["raised"] is not None and peer["raised"] is not None, (own, peer)
    assert own["raised"][0] == exc_type.__name__, own["raised"]
    assert "every rank undid the step" in own["raised"][2], own["raised"]
    what = "ran out of memory" if exc_type is torch.OutOfMemoryError else "raised"
    where = "before its first micro-batch" if at < 0 else f"at micro-batch {at}"
    if name == "oom_and_error":  # rank 0 failed too, with an error a smaller size cannot cure: no back-off
        assert peer["raised"][0] == "ValueError", peer["raised"]
        assert f"rank 1 {what} {where}" in peer["raised"][2], peer["raised"]
        assert f"rank 0 raised at micro-batch {LAST}" in own["raised"][2], own["raised"]
    else:
        assert peer["raised"][0] == mbs_ext.PeerFailed.__name__, peer["raised"]
        assert f"rank 1 {what} {where}" in peer["raised"][1], peer["raised"]
    for res in (own, peer):
        assert res["seconds"] < 30, res["seconds"]
        assert res["unchanged"], name
        if kind == "accumulate":
            assert res["grads_kept"], name


@pytest.mark.parametrize("name", list(CASES))
def test_the_next_step_is_exact(fault_results, name):
    _, results = fault_results
    ref = reference_params()
    for rank in range(2):
        for p, q in zip(results[rank][name]["params"], ref):
            assert rel_err(p, q) <= 1e-12, (rank, name)
        assert torch.equal(results[rank][name]["buffer"], torch.zeros(3, dtype=torch.float64))  # rank 0's


class AllocFailsAbove(TinyLM):
    """TinyLM whose forward asks torch's CPU allocator for an impossible buffer on a micro-batch
    of more than ``limit`` rows: a real allocation failure (a RuntimeError), no mock."""

    def __init__(self, limit):
        super().__init__()
        self.limit = limit

    def forward(self, ids):
        if ids.shape[0] > self.limit:
            torch.empty(2**62, dtype=torch.uint8)
        return super().forward(ids)


def _backoff(rank):
    """Rank 1 alone runs out of memory above 2 rows: both ranks back off to one size and complete
    the step; where not even one row fits on rank 1 (limit 0), both raise."""
    import warnings

    batch = rows_of(data(), rank)
    out = {}
    for name, limit in (("backs_off", 2), ("nothing_fits", 0)):
        torch.manual_seed(0)
        net = AllocFailsAbove(10**9).double()
        model = DDP(net)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        streamer = mbs_ext.MicroBatchStreamer(model, opt, lm_loss, micro_batch_size=M, normalize=token_count)
        streamer.step(batch)  # AdamW has state
        before = snapshot(model, opt)
        net.limit = limit if rank == 1 else 10**9
        t0 = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                res = streamer.step(batch)
                raised, sizes = None, [res.micro_batch_size, streamer.step(batch).micro_batch_size]
            except Exception as exc:  # noqa: BLE001 - the test records what each rank raised
                raised, sizes = (type(exc).__name__, str(exc), "\n".join(getattr(exc, "__notes__", []))), []
        unchanged = True
        try:
            assert_bit_identical(snapshot(model, opt), before)
        except AssertionError:
            unchanged = False
        out[name] = {"raised": raised, "sizes": sizes, "seconds": time.monotonic() - t0, "unchanged": unchanged,
                     "warnings": [str(w.message) for w in caught if w.category is RuntimeWarning],
                     "params": [p.detach().clone() for p in model.parameters()]}
    return out


@pytest.fixture(scope="module")
def backoff_results(tmp_path_factory):
    return run_world(_backoff, timeout=120, out_dir=tmp_path_factory.mktemp("backoff"))


def test_out_of_memory_on_one_rank_backs_off_on_every_rank(backoff_results):
    """Rank 1 runs out of host memory at its first micro-batch of 3 rows: every rank undoes the
    step, probes on its own module, and one all-reduce agrees on the size (2); the step is redone
    on both, exactly, and the size is remembered for the next step."""
    torch.manual_seed(0)
    model = TinyLM().double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):  # the good step, the backed-off one, the next one
        full_batch_step(model, opt, data(), lm_loss)
    for rank, res in enumerate(backoff_results):
        got = res["backs_off"]
        assert got["raised"] is None and got["sizes"] == [2, 2], (rank, got["raised"], got["sizes"])
        assert any(f"out of memory at micro_batch_size={M}; redoing the step with micro_batch_size=2 on every "
                   "rank" in w for w in got["warnings"]), (rank, got["warnings"])
        for p, q in zip(got["params"], model.parameters()):
            assert rel_err(p, q.detach()) <= 1e-12, rank


def test_when_nothing_fits_on_one_rank_every_rank_raises(backoff_results):
    own, peer = backoff_results[1]["nothing_fits"], backoff_results[0]["nothing_fits"]
    assert own["raised"][0] == "RuntimeError" and "DefaultCPUAllocator" in own["raised"][1], own["raised"]
    assert peer["raised"][0] == "PeerFailed" and "rank 1 ran out of memory at micro-batch 0" in peer["raised"][1]
    for res in (own, peer):
        assert "found no micro-batch size that fits, not even 1 row on some rank" in res["raised"][2], res["raised"]
        assert res["unchanged"] and res["seconds"] < 30, res
