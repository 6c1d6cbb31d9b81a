"""mbs_ext inside an Accelerate training loop, float64 on the CPU.

The pattern (what Accelerate's docs loop becomes)::

    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    loader = accelerator.prepare_data_loader(loader, device_placement=False)  # batches stay on the host
    for batch in loader:
        res = mbs_ext.accumulate(model, batch, loss_fn, micro_batch_size=4, normalize=count,
                                 scaler=accelerator.scaler)  # replaces forward + accelerator.backward
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step(); scheduler.step(); optimizer.zero_grad()

``mbs_ext.accumulate`` (not ``mbs_ext.step``) with the prepared optimizer: the
AcceleratedOptimizer's ``step`` runs its own GradScaler (``scaler.step`` + ``scaler.update``)
and skips when Accelerate is accumulating; ``accumulate`` leaves scaled gradients for it.

Checked: 1 and 3 steps (AdamW, a linear schedule, clipping) over 23 rows at micro-batch 4
equal the same Accelerate loop on the whole batch to 1e-10, with the same losses; a GradScaler
stepped by the prepared optimizer is updated once per step; and two gloo ranks (10 and 7 rows,
token-count normalization) equal one process on all 17 rows. The two ranks run under
``tests/ddp_harness.py``: a hang or a crash fails with every rank's Python stacks.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

accelerate = pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

import mbs_ext  # noqa: E402

# A framework's own Trainer / loop: out of the quick suite, run by CI (docs/testing.md).
pytestmark = pytest.mark.integration

N, T, VOCAB, M = 23, 6, 13, 4
LR, MAX_NORM = 1e-2, 0.5


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.norm(self.emb(input_ids))))


def loss_fn(model: nn.Module, batch: dict) -> torch.Tensor:
    logits = model(batch["input_ids"])
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)


def tokens(batch: dict) -> torch.Tensor:
    return (batch["labels"] != -100).sum()


def data(n: int = N) -> dict:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (n, T), generator=g)
    keep = torch.randint(0, T + 1, (n, 1), generator=g)  # some rows have no target at all
    labels = torch.where(torch.arange(T) < keep, torch.roll(ids, -1, 1), torch.full_like(ids, -100))
    return {"input_ids": ids, "labels": labels}


class Rows(torch.utils.data.Dataset):
    def __init__(self, batch: dict) -> None:
        self.batch = batch

    def __len__(self) -> int:
        return len(self.batch["input_ids"])

    def __getitem__(self, i: int) -> dict:
        return {k: v[i] for k, v in self.batch.items()}


def make(accelerator: Accelerator | None, steps: int):
    torch.manual_seed(0)
    model = TinyLM().to(torch.float64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=steps)
    if accelerator is not None:
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    return model, optimizer, scheduler


def train(accelerator: Accelerator, batches, steps: int, streamed: bool, clip: bool = True):
    """The docs' loop over ``steps`` mini-batches: streamed (mbs_ext.accumulate) or whole."""
    model, optimizer, scheduler = make(accelerator, steps)
    losses, largest = [], [0]
    model.register_forward_pre_hook(lambda m, a: largest.__setitem__(0, max(largest[0], a[0].shape[0])))
    for _, batch in zip(range(steps), batches):
        if streamed:
            res = mbs_ext.accumulate(model, batch, loss_fn, micro_batch_size=M, normalize=tokens,
                                     scaler=accelerator.scaler)
            losses.append(res.loss)
        else:
            loss = loss_fn(model, batch)
            accelerator.backward(loss)
            losses.append(float(accelerator.gather(loss.detach()[None]).mean()))
        if clip:
            accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    params = [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]
    return params, losses, largest[0], optimizer


def assert_close(params, ref, tol=1e-10):
    for p, q in zip(params, ref):
        err = (p - q).abs().max().item() / max(q.abs().max().item(), 1e-30)
        assert err <= tol, err


def _reset_accelerate() -> None:
    """Accelerate keeps process-wide singletons; the gradient state (whether the optimizer steps,
    the accumulation count) outlives AcceleratorState's reset, so reset both."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture
def fresh_state():
    _reset_accelerate()
    yield
    _reset_accelerate()


def host_loader(accelerator: Accelerator, batch: dict):
    loader = torch.utils.data.DataLoader(Rows(batch), batch_size=N, shuffle=False)
    return accelerator.prepare_data_loader(loader, device_placement=False)


@pytest.mark.parametrize("steps", [1, 3])
def test_accelerate_loop_equals_full_batch(fresh_state, steps):
    acc = Accelerator(cpu=True)
    loader = host_loader(acc, data())
    assert all(v.device.type == "cpu" for v in next(iter(loader)).values())
    ref, ref_losses, ref_seen, _ = train(acc, [data()] * steps, steps, streamed=False)
    _reset_accelerate()
    acc = Accelerator(cpu=True)
    loader = host_loader(acc, data())
    epochs = (b for _ in range(steps) for b in loader)
    params, losses, seen, _ = train(acc, epochs, steps, streamed=True)
    assert ref_seen == N and seen <= M
    assert_close(params, ref)
    assert losses == pytest.approx(ref_losses, rel=1e-12)


def test_prepared_optimizer_owns_the_grad_scaler(fresh_state):
    """Under fp16 the prepared optimizer's step is ``scaler.step`` + ``scaler.update``. With
    ``accumulate(..., scaler=accelerator.scaler)`` the gradients reach it scaled once and the
    scale is updated once per step. (Accelerate makes that scaler only for fp16 on a GPU; here
    a CPU GradScaler stands in, given to the Accelerator before ``prepare``.)"""
    results = []
    for streamed in (False, True):
        _reset_accelerate()
        acc = Accelerator(cpu=True)
        acc.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
        params, losses, _, optimizer = train(acc, [data()] * 3, 3, streamed=streamed, clip=False)
        assert optimizer.scaler is acc.scaler
        results.append((params, losses, acc.scaler.get_scale(), acc.scaler._get_growth_tracker()))
    (ref, ref_losses, ref_scale, ref_tracker), (params, losses, scale, tracker) = results
    assert scale == ref_scale == 2.0**11  # grew once: 3 updates at growth_interval 2
    assert tracker == ref_tracker == 1
    assert_close(params, ref)
    assert losses == pytest.approx(ref_losses, rel=1e-12)


def test_step_with_a_prepared_optimizer_without_scaler(fresh_state):
    """Without a GradScaler (fp32, bf16) the prepared optimizer's step is the wrapped one's, so
    ``mbs_ext.step(model, optimizer, ...)`` works too (with ``max_grad_norm`` for clipping)."""
    acc = Accelerator(cpu=True)
    ref, ref_losses, _, _ = train(acc, [data()] * 2, 2, streamed=False)
    _reset_accelerate()
    acc = Accelerator(cpu=True)
    model, optimizer, scheduler = make(acc, 2)
    assert acc.scaler is None and type(optimizer).__name__ == "AcceleratedOptimizer"
    losses = []
    for _ in range(2):
        res = mbs_ext.step(model, optimizer, data(), loss_fn, micro_batch_size=M, normalize=tokens,
                           max_grad_norm=MAX_NORM)
        scheduler.step()
        losses.append(res.loss)
    assert_close([p.detach() for p in model.parameters()], ref)
    assert losses == pytest.approx(ref_losses, rel=1e-12)


def test_step_refuses_a_prepared_optimizer_that_owns_a_grad_scaler(fresh_state):
    """mbs_ext.step would unscale, step and update once and the prepared optimizer's own
    GradScaler again: refused before anything changes, naming the pattern that works."""
    acc = Accelerator(cpu=True)
    acc.scaler = torch.amp.GradScaler("cpu")
    model, optimizer, _ = make(acc, 1)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"own GradScaler.*mbs_ext.accumulate\(.*scaler=accelerator.scaler"):
        mbs_ext.step(model, optimizer, data(), loss_fn, micro_batch_size=M, normalize=tokens)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters())


def test_step_refuses_to_run_inside_accelerator_accumulate(fresh_state):
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model, optimizer, _ = make(acc, 1)
    with acc.accumulate(model):
        assert not acc.sync_gradients
        with pytest.raises(ValueError, match=r"outside accelerator.accumulate\(\)"):
            mbs_ext.step(model, optimizer, data(), loss_fn, micro_batch_size=M, normalize=tokens)


# ---- two gloo ranks ----

RANK_ROWS = (10, 7)
DDP_STEPS = 3
TIMEOUT_S = 150


def _rank_loop(rank: int) -> dict:
    """One rank: the docs' loop under DDP on the rank's own rows (10 or 7 of 17). The harness has
    set up the gloo group; Accelerate finds it through the launcher's variables."""
    from ddp_harness import HOST

    # Both ranks on the CPU (cpu=True) with the GPUs hidden: on a one-GPU machine Accelerate's
    # barrier would otherwise name device `rank` (CUDA is initialized lazily, after this line).
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(len(RANK_ROWS)),
                      LOCAL_WORLD_SIZE=str(len(RANK_ROWS)), MASTER_ADDR=HOST, MASTER_PORT="0",
                      CUDA_VISIBLE_DEVICES="")
    # The scheduler steps once per optimizer step, as in one process (by default Accelerate
    # steps it once per process, assuming the global batch grew with the processes).
    acc = Accelerator(cpu=True, step_scheduler_with_optimizer=False)
    assert acc.num_processes == 2 and isinstance(acc.prepare_model(TinyLM()), nn.parallel.DistributedDataParallel)
    full = data(sum(RANK_ROWS))
    lo = sum(RANK_ROWS[:rank])
    local = {k: v[lo:lo + RANK_ROWS[rank]] for k, v in full.items()}
    params, losses, seen, _ = train(acc, [local] * DDP_STEPS, DDP_STEPS, streamed=True)
    assert seen <= M
    logged = [float(acc.gather(torch.tensor([x], dtype=torch.float64)).mean()) for x in losses]
    acc.wait_for_everyone()
    return {"params": params, "losses": losses, "logged": logged}


@pytest.mark.multiprocess
def test_two_gloo_ranks_equal_one_process(fresh_state, tmp_path):
    from ddp_harness import run_world

    ranks = run_world(_rank_loop, world=len(RANK_ROWS), timeout=TIMEOUT_S, out_dir=tmp_path / "world")

    # The reference: one process, no DDP, the 17 rows as one batch.
    _reset_accelerate()
    acc = Accelerator(cpu=True)
    ref, ref_losses, _, _ = train(acc, [data(sum(RANK_ROWS))] * DDP_STEPS, DDP_STEPS, streamed=False)
    for r in ranks:
        assert_close(r["params"], ref)
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-12)  # the global loss on every rank
        assert r["logged"] == pytest.approx(ref_losses, rel=1e-12)  # and its mean over ranks
