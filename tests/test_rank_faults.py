"""Ranks that fail together: an error on one DDP rank makes every rank undo the step and raise.

Two gloo processes (``tests/ddp_harness.py``, with its watchdog), 10 and 7 rows at
``micro_batch_size=3`` (4 and 3 micro-batches), float64, AdamW with state from one
good step first. Rank 1 fails at micro-batch 0, 1 or its last (2), with an exception or
an out-of-memory error, or before its first micro-batch (its batch is refused by the
checks). Each case checks, on every rank: the failing rank raises its own error, the
other raises ``PeerFailed`` naming rank 1 and where; both within seconds (a hang would
take the process group's timeout); parameters, buffers, optimizer state and (for
``accumulate``) the caller's ``.grad`` bit-identical to before; and a step right after
on both ranks equals a single-process full-batch step on all 17 rows to 1e-12 (the
process group and the step's state are intact).
"""

from __future__ import annotations

import time

import pytest
import torch
from common import TinyLM, assert_bit_identical, full_batch_step, lm_loss, rel_err, snapshot, token_count
from ddp_harness import run_world
from torch.nn.parallel import DistributedDataParallel as DDP

import mbs_ext

ROWS = (10, 7)
M = 3
LAST = 2  # rank 1's last micro-batch (7 rows in 3)
# name: (micro-batch of the failure on rank 1, or -1 for a refused batch; the error raised)
CASES = {
    "raise_at_0": (0, ValueError),
    "raise_at_1": (1, ValueError),
    "raise_at_last": (LAST, ValueError),
    "oom_at_1": (1, torch.OutOfMemoryError),
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


def failing_loss(rank, at, exc_type):
    calls = [0]

    def loss_fn(model, mb):
        i = calls[0]
        calls[0] += 1
        if rank == 1 and i == at:
            raise exc_type(f"injected on rank 1 at micro-batch {at}")
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
        t0 = time.monotonic()
        try:
            if accumulate:
                mbs_ext.accumulate(model, bad, failing_loss(rank, at, exc_type), micro_batch_size=M,
                                   normalize=token_count)
            else:
                mbs_ext.step(model, opt, bad, failing_loss(rank, at, exc_type), micro_batch_size=M,
                             normalize=token_count)
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
    assert peer["raised"][0] == mbs_ext.PeerFailed.__name__, peer["raised"]
    what = "ran out of memory" if exc_type is torch.OutOfMemoryError else "raised"
    where = "before its first micro-batch" if at < 0 else f"at micro-batch {at}"
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
