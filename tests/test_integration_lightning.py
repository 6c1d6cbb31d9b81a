"""mbs_ext.integrations.lightning: an unchanged LightningModule trained with
``Trainer(strategy=StreamingStrategy(micro_batch_size=m))`` takes the same steps as a plain
Trainer on the whole batch (float64, to 1e-10): one SGD step, three AdamW steps with a
scheduler and a logger, BatchNorm statistics, gradient clipping, and two gloo ranks with
unequal rows and token-count normalization (a real 2-process run under ``tests/ddp_harness.py``:
a hang or a crash fails with every rank's Python stacks).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from common import run_python
from torch import nn

pl = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.loggers import Logger  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import mbs_ext  # noqa: E402
from mbs_ext.integrations.lightning import StreamingStrategy  # noqa: E402

# A framework's own Trainer / loop: out of the quick suite, run by CI (docs/testing.md).
pytestmark = pytest.mark.integration

TOL = 1e-10


# -- a LightningModule as Lightning's docs write one ------------------------------------------
class Regressor(pl.LightningModule):
    """``training_step`` returns the loss and logs it; ``configure_optimizers`` as documented."""

    def __init__(self, batchnorm: bool = False, optimizer: str = "sgd"):
        super().__init__()
        torch.manual_seed(0)
        layers = [nn.Linear(5, 8)] + ([nn.BatchNorm1d(8)] if batchnorm else []) + [nn.Tanh(), nn.Linear(8, 1)]
        self.net = nn.Sequential(*layers)
        self.optimizer = optimizer

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1)
        opt = torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class TokenModel(pl.LightningModule):
    """A per-token regression whose loss averages over the valid tokens of the batch."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 1))

    def training_step(self, batch, batch_idx):
        x, mask, y = batch
        err = (self.net(x).squeeze(-1) - y) ** 2
        loss = (err * mask).sum() / mask.sum()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2)


def tokens(micro_batch):
    return micro_batch[1].sum()


class MemoryLogger(Logger):
    """Every logged metric, by step."""

    def __init__(self):
        super().__init__()
        self.rows: list[tuple[int, dict]] = []

    @property
    def name(self):
        return "memory"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))


def regression_data(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=g, dtype=torch.float64), torch.randn(n, 1, generator=g, dtype=torch.float64)


def token_data(n: int = 17, t: int = 6):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(n, t, 3, generator=g, dtype=torch.float64)
    y = torch.randn(n, t, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(torch.float64)
    return x, mask, y


def fit(module, tensors, batch_size, strategy=None, steps=1, logger=None, ckpt_path=None, **trainer_kw):
    kw = dict(accelerator="cpu", devices=1, max_steps=steps, precision="64-true", logger=logger or False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              log_every_n_steps=1, **trainer_kw)
    if strategy is not None:
        kw["strategy"] = strategy
    trainer = pl.Trainer(**kw)
    trainer.fit(module, DataLoader(TensorDataset(*tensors), batch_size=batch_size, shuffle=False), ckpt_path=ckpt_path)
    return trainer


def max_diff(a: nn.Module, b: nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return max((sa[k].double() - sb[k].double()).abs().max().item() for k in sa)


# -- single process -----------------------------------------------------------------------------
def test_one_step_equals_full_batch_step():
    data = regression_data(23)
    ref, got = Regressor(), Regressor()
    t_ref = fit(ref, data, 23)
    t_got = fit(got, data, 23, StreamingStrategy(micro_batch_size=4))
    assert t_got.strategy.last_result.num_micro_batches == 6
    assert max_diff(ref, got) < TOL
    assert max_diff(ref, Regressor()) > 1e-3  # the step moved the parameters
    loss_ref, loss_got = t_ref.callback_metrics["train_loss"], t_got.callback_metrics["train_loss"]
    assert abs(loss_ref.item() - loss_got.item()) < TOL
    assert abs(t_got.strategy.last_result.loss - loss_ref.item()) < TOL


def test_noise_scale_is_logged_and_the_step_unchanged():
    """``noise_scale=True`` through the strategy: the same step, and ``b_simple`` logged at every
    step where the streamer's moving averages give one (none while their |G|^2 is not positive,
    as in this run's first steps: docs/noise-scale.md)."""
    data = regression_data(69)
    ref, got = Regressor(), Regressor()
    log, seen = MemoryLogger(), []

    class Seen(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            seen.append(trainer.strategy.last_result.noise)

    fit(ref, data, 23, steps=3)
    t_got = fit(got, data, 23, StreamingStrategy(micro_batch_size=4, noise_scale=True), steps=3, logger=log,
                callbacks=[Seen()])
    assert max_diff(ref, got) < TOL
    noise = t_got.strategy.last_result.noise
    assert noise.steps == 3 and noise.micro_batches == 6 and noise.b_simple is not None
    assert [m["noise_trace"] for _, m in log.rows] == pytest.approx([n.trace for n in seen], rel=1e-6)
    assert [m["noise_grad_sq"] for _, m in log.rows] == pytest.approx([n.grad_sq for n in seen], rel=1e-6)
    logged = [m["b_simple"] for _, m in log.rows if "b_simple" in m]
    assert logged == pytest.approx([n.b_simple for n in seen if n.b_simple is not None], rel=1e-6) and logged


def test_a_resumed_fit_resumes_the_noise_averages(tmp_path):
    """A checkpoint after 3 steps carries the streamer's state (the noise's moving averages):
    ``fit(ckpt_path=...)`` from it goes on from those averages (they equal the saved ones with
    the resumed steps' own noise folded in), and its weights are plain Lightning's resumed from
    the same checkpoint (Lightning's resume is the reference: it does not replay the 6-step run)."""
    data, seen = regression_data(69), []

    class Seen(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            seen.append(trainer.strategy.last_result.noise)

    first = Regressor()
    t_first = fit(first, data, 23, StreamingStrategy(micro_batch_size=4, noise_scale=True), steps=3)
    t_first.save_checkpoint(tmp_path / "three.ckpt")
    saved = t_first.strategy._streamer().noise.state_dict()
    resumed, plain = Regressor(), Regressor()
    t_resumed = fit(resumed, data, 23, StreamingStrategy(micro_batch_size=4, noise_scale=True), steps=6,
                    ckpt_path=str(tmp_path / "three.ckpt"), callbacks=[Seen()])
    fit(plain, data, 23, steps=6, ckpt_path=str(tmp_path / "three.ckpt"))
    want = dict(saved["moments"])  # the saved averages, each resumed step folded in (decay 0.95)
    for n in seen:
        for key, value in zip(("s", "g", "ss", "gg", "sg"), (n.trace, n.grad_sq, n.trace ** 2, n.grad_sq ** 2,
                                                             n.trace * n.grad_sq)):
            want[key] = 0.95 * want[key] + 0.05 * value
    got = t_resumed.strategy._streamer().noise
    assert seen and got.steps == saved["steps"] + len(seen) == 3 + len(seen)
    assert got.moments == pytest.approx(want, rel=1e-12)
    assert max_diff(resumed, plain) < TOL and max_diff(resumed, first) > 1e-3


def test_a_ramp_through_a_stateful_dataloader_sets_each_steps_size():
    """Lightning fed by torchdata's StatefulDataLoader over ``mbs_ext.MiniBatches`` (a ramp): each
    step streams the mini-batch the ramp sizes, and the samples are the order's (one mini-batch
    drawn ahead: Lightning's fetcher looks one batch ahead to know the last one)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    data, sizes = regression_data(69), []

    class Sizes(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            sizes.append(len(batch[0]))

    order = mbs_ext.SampleOrder(69, seed=4)
    ramp = mbs_ext.Ramp(start=8, end=40, over=120, multiple_of=8)
    loader = StatefulDataLoader(TensorDataset(*data), batch_sampler=mbs_ext.MiniBatches(order, ramp))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=6, precision="64-true", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         strategy=StreamingStrategy(micro_batch_size=4), callbacks=[Sizes()])
    trainer.fit(Regressor(), loader)
    want, seen = [], 0
    for _ in range(6):
        want.append(ramp.size(seen))
        seen += want[-1]
    assert sizes == want and len(set(want)) > 1
    assert order.samples_seen == seen + ramp.size(seen)  # Lightning's fetcher draws one mini-batch ahead
    assert trainer.strategy.last_result.num_micro_batches == -(-want[-1] // 4)


def test_token_micro_batches_equal_full_batch_step():
    """micro_batch_tokens through the strategy: rows grouped by length and trimmed, same step."""
    data = token_data()
    ref, got = TokenModel(), TokenModel()
    t_ref = fit(ref, data, 17)
    strategy = StreamingStrategy(micro_batch_tokens=12, token_lengths=lambda b: b[1].sum(1).long(),
                                 normalize=tokens)
    t_got = fit(got, data, 17, strategy)
    result = t_got.strategy.last_result
    assert result.num_micro_batches > 1
    assert max_diff(ref, got) < TOL
    assert max_diff(ref, TokenModel()) > 1e-3  # the step moved the parameters
    assert abs(result.loss - t_ref.callback_metrics["train_loss"].item()) < TOL


def test_three_adamw_steps_with_scheduler_and_logger():
    data = regression_data(69)
    ref, got = Regressor(optimizer="adamw"), Regressor(optimizer="adamw")
    log_ref, log_got = MemoryLogger(), MemoryLogger()
    t_ref = fit(ref, data, 23, steps=3, logger=log_ref)
    t_got = fit(got, data, 23, StreamingStrategy(micro_batch_size=4), steps=3, logger=log_got)
    assert max_diff(ref, got) < TOL
    losses_ref = [m["train_loss"] for _, m in log_ref.rows if "train_loss" in m]
    losses_got = [m["train_loss"] for _, m in log_got.rows if "train_loss" in m]
    assert len(losses_ref) == len(losses_got) == 3
    for a, b in zip(losses_ref, losses_got):
        assert abs(a - b) < TOL
    last_lr = [t.lr_scheduler_configs[0].scheduler.get_last_lr() for t in (t_ref, t_got)]
    assert last_lr[0] == last_lr[1]
    assert t_got.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05 * 0.5**3)


def test_batchnorm_statistics_committed_once_per_batch():
    data = regression_data(23)
    ref, got = Regressor(batchnorm=True), Regressor(batchnorm=True)
    fit(ref, data, 23)
    fit(got, data, 23, StreamingStrategy(micro_batch_size=4))
    bn_ref, bn_got = ref.net[1], got.net[1]
    assert type(bn_got) is nn.BatchNorm1d  # its own class back after the stream
    assert int(bn_got.num_batches_tracked) == 1
    assert (bn_ref.running_mean - bn_got.running_mean).abs().max() < TOL
    assert (bn_ref.running_var - bn_got.running_var).abs().max() < TOL
    # (Each micro-batch is still normalized with its own statistics, so the gradients, and the
    # parameters after the step, equal the full-batch ones only at micro_batch_size >= the batch.)


def test_gradient_clip_applies_to_full_batch_gradient():
    data = regression_data(23)
    clip = dict(gradient_clip_val=0.05)
    ref, got, unclipped = Regressor(), Regressor(), Regressor()
    fit(ref, data, 23, **clip)
    wrapped = pl.strategies.SingleDeviceStrategy("cpu")  # an instance is wrapped too
    fit(got, data, 23, StreamingStrategy(micro_batch_size=4, strategy=wrapped), **clip)
    fit(unclipped, data, 23)
    assert max_diff(ref, got) < TOL
    assert max_diff(unclipped, got) > 1e-4  # the clip was active


class DictRegressor(Regressor):
    """Returns a dict and logs with log_dict, an explicit batch_size and reduce_fx="max"."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log_dict({"mse": loss, "rows": float(len(x))}, batch_size=len(x))
        self.log("worst", loss, reduce_fx="max")
        return {"loss": loss, "note": 1}


def test_dict_output_log_dict_and_outputs():
    data = regression_data(23)
    ref, got = DictRegressor(), DictRegressor()
    t_ref = fit(ref, data, 23)
    t_got = fit(got, data, 23, StreamingStrategy(micro_batch_size=4))
    assert max_diff(ref, got) < TOL
    assert abs(t_ref.callback_metrics["mse"].item() - t_got.callback_metrics["mse"].item()) < TOL
    # "rows" is a per-micro-batch mean weighted by rows: sum(n_i^2)/N, not N (documented limit of
    # combining arbitrary values); "worst" is the largest micro-batch loss.
    assert t_got.callback_metrics["worst"].item() >= t_got.callback_metrics["mse"].item()


def test_accumulate_takes_a_lightning_module():
    from mbs_ext.integrations.lightning import accumulate

    x, y = regression_data(23)
    module = Regressor().double()
    result = accumulate(module, (x, y), lambda m, b: F.mse_loss(m.net(b[0]), b[1]), micro_batch_size=4)
    grads = [p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    F.mse_loss(module.net(x), y).backward()
    assert result.num_micro_batches == 6
    assert max((a - p.grad).abs().max().item() for a, p in zip(grads, module.parameters())) < TOL


def test_refusals():
    with pytest.raises(ValueError, match="FSDP"):
        StreamingStrategy(micro_batch_size=4, strategy="fsdp")
    with pytest.raises(ValueError, match="gradient_clip_val"):
        StreamingStrategy(micro_batch_size=4, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="accumulate_grad_batches"):
        fit(Regressor(), regression_data(8), 8, StreamingStrategy(micro_batch_size=4), accumulate_grad_batches=2)


def test_import_mbs_ext_does_not_import_lightning():
    code = "import sys, mbs_ext, mbs_ext.integrations; assert 'lightning' not in sys.modules, 'lightning imported'"
    run_python(code, timeout=60)


# -- two gloo ranks --------------------------------------------------------------------------------
RANK_ROWS = [(0, 10), (10, 17)]  # 10 and 7 rows: 3 and 2 micro-batches at size 4
WORLD_TIMEOUT_S = 120


def _ddp_rank(rank: int) -> dict:
    """One rank, as Lightning's DDP runs it when a launcher started the processes (LOCAL_RANK set):
    the harness has set up the gloo group, which Lightning finds initialised and keeps."""
    from ddp_harness import HOST

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(len(RANK_ROWS)), NODE_RANK="0",
                      MASTER_ADDR=HOST, MASTER_PORT="0")
    lo, hi = RANK_ROWS[rank]
    data = [t[lo:hi] for t in token_data()]
    module = TokenModel()
    strategy = StreamingStrategy(micro_batch_size=4, normalize=tokens, strategy="ddp", process_group_backend="gloo")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=1, precision="64-true",
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(module, DataLoader(TensorDataset(*data), batch_size=hi - lo, shuffle=False))
    result = trainer.strategy.last_result
    return {"state": module.state_dict(), "global_loss": result.loss, "num_micro_batches": result.num_micro_batches,
            "logged": trainer.callback_metrics["train_loss"].item(), "world": trainer.world_size}


@pytest.mark.multiprocess
def test_two_gloo_ranks_token_normalization_equals_single_process_full_batch(tmp_path):
    from ddp_harness import run_world

    ranks = run_world(_ddp_rank, world=len(RANK_ROWS), timeout=WORLD_TIMEOUT_S, out_dir=tmp_path / "world")
    data = token_data()
    ref = TokenModel()
    t_ref = fit(ref, data, 17)
    full_loss = t_ref.callback_metrics["train_loss"].item()
    for r, (lo, hi) in enumerate(RANK_ROWS):
        got = ranks[r]
        assert got["world"] == 2
        assert got["num_micro_batches"] == [3, 2][r]
        diff = max((got["state"][k] - v).abs().max().item() for k, v in ref.state_dict().items())
        assert diff < TOL, f"rank {r}: {diff}"
        assert abs(got["global_loss"] - full_loss) < TOL
        # The logged loss is the rank's own full-batch loss, as a plain DDP run would log it.
        x, mask, y = (t[lo:hi] for t in data)
        with torch.no_grad():
            own = ((TokenModel().double().net(x).squeeze(-1) - y) ** 2 * mask).sum() / mask.sum()
        assert abs(got["logged"] - own.item()) < TOL
