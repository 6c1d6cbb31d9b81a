"""StreamingTrainer against the plain transformers Trainer, single process, float64 on the CPU.

The model is a causal LM built from a tiny config, trained on right-padded rows whose
padding is labelled -100 (one row has a single real token, so after the causal shift it
scores nothing). One Trainer step over 23 rows streamed at micro_batch_size=4 must equal the
plain Trainer's full-batch step of the same configuration (AdamW, a linear schedule,
clipping, logging every step) to 1e-10, for 1 and 3 steps, with the same logged losses; and
the model must never see more than 4 rows at once.

The 1e-10 comparisons use ``GPT2LMHeadModel`` in float64 with transformers' causal LM loss
minus its ``logits.float()`` (which would round everything to float32); ``LlamaForCausalLM``
as built is checked to float32 precision. With ``loss_type="ForCausalLM"`` the reference is
the plain Trainer as is. Without it (``GPT2LMHeadModel``'s class name maps to no loss type,
though its loss does shift), the plain Trainer's ``num_items_in_batch`` counts *unshifted*
labels, so its full-batch loss is not the mean over the tokens scored; there the reference
is the plain Trainer with ``model_accepts_loss_kwargs = False``: the model's own full-batch
mean, which StreamingTrainer reproduces.
"""

from __future__ import annotations

import math
import os
import types
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
)
from transformers.loss.loss_utils import fixed_cross_entropy  # noqa: E402

import mbs_ext  # noqa: E402
from mbs_ext.integrations.transformers import StreamingTrainer, label_token_count, loss_shifts_labels  # noqa: E402

# A framework's own Trainer / loop: out of the quick suite, run by CI (docs/testing.md).
pytestmark = pytest.mark.integration

N, T, VOCAB, M = 23, 7, 31, 4


def causal_lm_loss_f64(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
                       **kwargs):
    """transformers' ForCausalLMLoss without its ``logits.float()``, which would round a float64
    model's logits to float32 (and any comparison to ~1e-7)."""
    if shift_labels is None:
        labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
    logits = logits.view(-1, vocab_size)
    return fixed_cross_entropy(logits, shift_labels.view(-1).to(logits.device), num_items_in_batch, ignore_index,
                               **kwargs)


def make_model(kind: str = "gpt2") -> torch.nn.Module:
    """A tiny causal LM in float64. "gpt2": GPT2LMHeadModel with the float64 causal LM loss and
    ``loss_type="ForCausalLM"`` (so the plain Trainer counts shifted labels too); "gpt2-untyped":
    the same without ``loss_type`` (as transformers builds it); "llama": LlamaForCausalLM as
    built, whose RMSNorm and loss compute in float32."""
    torch.manual_seed(0)
    if kind.startswith("gpt2"):
        config = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        model = GPT2LMHeadModel(config).to(torch.float64)
        model.loss_function = causal_lm_loss_f64
        if kind == "gpt2":
            model.loss_type = "ForCausalLM"
        return model
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(config).to(torch.float64)


class MeanLossTrainer(Trainer):
    """The plain Trainer taking the model's own full-batch mean loss (no num_items_in_batch)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.model_accepts_loss_kwargs = False


class Rows(torch.utils.data.Dataset):
    """Right-padded causal LM rows: labels = input_ids where attended, -100 on padding."""

    def __init__(self, n: int = N) -> None:
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, VOCAB, (n, T), generator=g)
        lengths = torch.randint(1, T + 1, (n,), generator=g)
        lengths[5] = 1  # one real token: nothing to predict after the shift
        self.mask = (torch.arange(T) < lengths[:, None]).long()
        self.labels = torch.where(self.mask.bool(), self.ids, torch.full_like(self.ids, -100))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


def training_args(tmp_path, steps: int, **kw) -> TrainingArguments:
    base = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=N, max_steps=steps, learning_rate=1e-2,
        lr_scheduler_type="linear", weight_decay=0.01, optim="adamw_torch", max_grad_norm=0.5,
        logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, dataloader_pin_memory=False,
        disable_tqdm=True, seed=0,
    )
    base.update(kw)
    return TrainingArguments(**base)


def largest_batch_seen(model: torch.nn.Module) -> list[int]:
    seen = [0]

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        seen[0] = max(seen[0], int(ids.shape[0]))

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def logged_losses(trainer: Trainer) -> list[float]:
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


def run(trainer_cls, tmp_path, steps, kind="gpt2", **kw):
    model = make_model(kind)
    seen = largest_batch_seen(model)
    trainer = trainer_cls(model=model, args=training_args(tmp_path, steps), train_dataset=Rows(), **kw)
    trainer.train()
    return trainer, seen[0]


def full_batch_loss(model, rows: Rows) -> float:
    with torch.no_grad():
        return float(model(input_ids=rows.ids, attention_mask=rows.mask, labels=rows.labels).loss)


@pytest.mark.parametrize(("kind", "steps"), [("gpt2", 1), ("gpt2", 3), ("gpt2-untyped", 1)])
def test_streamed_trainer_equals_full_batch_trainer(tmp_path, kind, steps):
    ref, ref_seen = run(Trainer if kind == "gpt2" else MeanLossTrainer, tmp_path / "ref", steps, kind)
    mbs, mbs_seen = run(StreamingTrainer, tmp_path / "mbs", steps, kind, micro_batch_size=M)
    assert [e["learning_rate"] for e in ref.state.log_history if "loss" in e][0] > 0
    assert ref_seen == N  # the plain Trainer runs the whole batch at once
    assert mbs_seen <= M  # the streamed one never does
    assert mbs.last_stream_result.num_micro_batches == math.ceil(N / M)
    assert mbs.state.global_step == ref.state.global_step == steps
    for (name, p), q in zip(mbs.model.named_parameters(), ref.model.parameters()):
        assert p.dtype == torch.float64
        err = (p - q).abs().max().item() / max(q.abs().max().item(), 1e-30)
        assert err <= 1e-10, (name, err)
    # The logged losses: the Trainer accumulates them in a float32 tensor, so both are rounded
    # to float32 from float64 values equal to 1e-10.
    ours, theirs = logged_losses(mbs), logged_losses(ref)
    assert len(ours) == len(theirs) == steps
    for a, b in zip(ours, theirs):
        assert a == pytest.approx(b, rel=1e-6)
    grad_norms = [e["grad_norm"] for e in mbs.state.log_history if "grad_norm" in e]
    ref_norms = [e["grad_norm"] for e in ref.state.log_history if "grad_norm" in e]
    assert grad_norms == pytest.approx(ref_norms, rel=1e-9)


def test_noise_scale_is_logged_beside_the_loss(tmp_path):
    """``options=StepOptions(noise_scale=True)``: the same steps, and every logged step carries that
    step's S and |G|^2 (``b_simple`` once the run's moving averages give one: on 51 tokens a step,
    far below this model's noise scale, they do not; docs/noise-scale.md)."""
    from transformers import TrainerCallback

    seen = []

    class Seen(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen.append(mbs.last_stream_result.noise)

    ref, _ = run(Trainer, tmp_path / "ref", 3)
    model = make_model()
    mbs = StreamingTrainer(model=model, args=training_args(tmp_path / "mbs", 3), train_dataset=Rows(),
                           options=mbs_ext.StepOptions(micro_batch_size=M, noise_scale=True), callbacks=[Seen()])
    mbs.train()
    for p, q in zip(mbs.model.parameters(), ref.model.parameters()):
        assert (p - q).abs().max().item() <= 1e-10 * max(q.abs().max().item(), 1e-30)
    assert [n.steps for n in seen] == [1, 2, 3] and seen[-1].micro_batches == math.ceil(N / M)
    logs = [e for e in mbs.state.log_history if "loss" in e]
    assert [e["noise_trace"] for e in logs] == pytest.approx([n.trace for n in seen], rel=1e-12)
    assert [e["noise_grad_sq"] for e in logs] == pytest.approx([n.grad_sq for n in seen], rel=1e-12)
    assert [e.get("b_simple") for e in logs] == [n.b_simple for n in seen]


def test_a_resumed_trainer_resumes_the_noise_averages(tmp_path):
    """A checkpoint at step 2 of 4 carries the noise's moving averages (``mbs_ext_state.pt`` beside
    the optimizer's state); ``train(resume_from_checkpoint=...)`` from it ends with the averages
    and the weights of the run that was not interrupted."""
    opts = mbs_ext.StepOptions(micro_batch_size=M, noise_scale=True)
    whole = StreamingTrainer(model=make_model(), args=training_args(tmp_path / "whole", 4), train_dataset=Rows(),
                             options=opts)
    whole.train()
    first = StreamingTrainer(model=make_model(), train_dataset=Rows(), options=opts,
                             args=training_args(tmp_path / "cut", 4, save_strategy="steps", save_steps=2))
    first.train()
    saved = tmp_path / "cut" / "checkpoint-2"
    assert (saved / "mbs_ext_state.pt").is_file()
    resumed = StreamingTrainer(model=make_model(), train_dataset=Rows(), options=opts,
                               args=training_args(tmp_path / "cut", 4))
    resumed.train(resume_from_checkpoint=str(saved))
    assert resumed.noise_scale.steps == whole.noise_scale.steps == 4
    assert resumed.noise_scale.moments == pytest.approx(whole.noise_scale.moments, rel=1e-9)
    for p, q in zip(resumed.model.parameters(), whole.model.parameters()):
        assert (p - q).abs().max().item() <= 1e-10 * max(q.abs().max().item(), 1e-30)


def test_stock_llama_float32_loss(tmp_path):
    """LlamaForCausalLM as built (RMSNorm and the loss round to float32): equal to float32 precision."""
    ref, _ = run(Trainer, tmp_path / "ref", 1, "llama")
    mbs, seen = run(StreamingTrainer, tmp_path / "mbs", 1, "llama", micro_batch_size=M)
    assert seen <= M
    for p, q in zip(mbs.model.parameters(), ref.model.parameters()):
        assert (p - q).abs().max().item() <= 1e-5 * q.abs().max().item()
    assert logged_losses(mbs)[0] == pytest.approx(logged_losses(ref)[0], rel=1e-6)


def test_first_logged_loss_is_the_full_batch_loss(tmp_path):
    rows = Rows()
    before = full_batch_loss(make_model(), rows)
    mbs, _ = run(StreamingTrainer, tmp_path, 1, micro_batch_size=M)
    assert mbs.last_stream_result.loss == pytest.approx(before, rel=1e-12)
    assert logged_losses(mbs)[0] == pytest.approx(before, rel=1e-6)


@pytest.mark.parametrize("kind", ["llama", "gpt2-untyped"])
def test_default_count_is_what_the_loss_averages_over(tmp_path, kind):
    """The model's mean loss times the default count is its summed loss (num_items_in_batch=1
    makes the causal LM loss a sum): the count is exactly what the loss divides by."""
    model = make_model(kind)
    trainer = StreamingTrainer(model=model, args=training_args(tmp_path, 1), train_dataset=Rows(),
                               micro_batch_size=M)
    rows = Rows()
    assert loss_shifts_labels(model)
    batch = {"input_ids": rows.ids, "attention_mask": rows.mask, "labels": rows.labels}
    count = trainer._normalize(batch)
    assert int(count(batch)) == int((rows.labels[:, 1:] != -100).sum())
    with torch.no_grad():
        mean = model(**batch).loss
        total = model(**batch, num_items_in_batch=1).loss
    assert float(mean * count(batch)) == pytest.approx(float(total), rel=1e-12)
    assert int(count({"labels": rows.labels, "shift_labels": rows.labels})) == int((rows.labels != -100).sum())
    assert int(label_token_count(False)(batch)) == int((rows.labels != -100).sum())


def stock_gpt2(loss_type: str | None = None) -> torch.nn.Module:
    """A tiny GPT2LMHeadModel as transformers builds it from a config (float32, its own loss):
    no ``loss_type``, though its loss shifts the labels."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    if loss_type is not None:
        model.loss_type = loss_type
    return model


def count_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "num_items_in_batch" in str(w.message)]


def test_warns_once_where_the_plain_trainer_counts_other_tokens(tmp_path):
    """GPT2LMHeadModel from a config has no loss_type: the plain Trainer counts the unshifted
    labels for num_items_in_batch, StreamingTrainer the shifted ones its loss scores. The first
    step warns once, naming loss_type and both counts, and the plain Trainer's first logged loss
    is the streamed one times their ratio, as the warning says."""
    rows = Rows()
    shifted, unshifted = int((rows.labels[:, 1:] != -100).sum()), int((rows.labels != -100).sum())
    assert shifted < unshifted
    model = stock_gpt2()
    assert model.loss_type is None
    mbs = StreamingTrainer(model=model, args=training_args(tmp_path / "mbs", 2), train_dataset=rows,
                           micro_batch_size=M)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mbs.train()
    (text,) = count_warnings(caught)  # two steps, one warning
    assert "GPT2LMHeadModel has loss_type=None" in text
    assert f"unshifted labels for num_items_in_batch ({unshifted} tokens in this batch)" in text
    assert f"shifted ones ({shifted} tokens), which StreamingTrainer counts" in text
    assert 'model.loss_type' in text and '"ForCausalLM"' in text and "docs/integrations.md" in text
    assert f"{shifted / unshifted:.4g} times these" in text
    plain = Trainer(model=stock_gpt2(), args=training_args(tmp_path / "plain", 1), train_dataset=Rows())
    plain.train()
    assert logged_losses(plain)[0] == pytest.approx(logged_losses(mbs)[0] * shifted / unshifted, rel=1e-5)


def test_no_count_warning_once_the_model_names_its_loss_type(tmp_path):
    """With model.loss_type = "ForCausalLM" both Trainers count the shifted labels: no warning,
    and the same first logged loss."""
    mbs = StreamingTrainer(model=stock_gpt2("ForCausalLM"), args=training_args(tmp_path / "mbs", 1),
                           train_dataset=Rows(), micro_batch_size=M)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mbs.train()
    assert count_warnings(caught) == []
    plain = Trainer(model=stock_gpt2("ForCausalLM"), args=training_args(tmp_path / "plain", 1), train_dataset=Rows())
    plain.train()
    assert logged_losses(plain)[0] == pytest.approx(logged_losses(mbs)[0], rel=1e-5)


def test_train_batches_stay_on_the_host(tmp_path):
    trainer = StreamingTrainer(model=make_model(), args=training_args(tmp_path, 1), train_dataset=Rows(),
                               micro_batch_size=M)
    loader = trainer.get_train_dataloader()
    assert getattr(loader, "device", None) is None  # no device placement: mbs_ext streams
    assert Trainer.get_train_dataloader(trainer).device is not None  # the plain Trainer's would move it
    batch = next(iter(loader))
    assert all(v.device.type == "cpu" for v in batch.values())
    assert len(batch["input_ids"]) == N


def test_gradient_accumulation_refused(tmp_path):
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2"):
        StreamingTrainer(model=make_model(), args=training_args(tmp_path, 1, gradient_accumulation_steps=2),
                         train_dataset=Rows(), micro_batch_size=M)


def test_compute_loss_func_needs_normalize(tmp_path):
    def loss_func(outputs, labels, num_items_in_batch=None):
        return outputs.logits.float().pow(2).mean()

    with pytest.raises(ValueError, match="compute_loss_func"):
        StreamingTrainer(model=make_model(), args=training_args(tmp_path, 1), train_dataset=Rows(),
                         compute_loss_func=loss_func, micro_batch_size=M)


def test_trainer_options_refused(tmp_path):
    with pytest.raises(ValueError, match="belong to the Trainer"):
        StreamingTrainer(model=make_model(), args=training_args(tmp_path, 1), train_dataset=Rows(),
                         micro_batch_size=M, options=mbs_ext.StepOptions(micro_batch_size=M, max_grad_norm=1.0))


def test_import_mbs_ext_does_not_import_transformers():
    from common import run_python

    code = "import sys, mbs_ext, mbs_ext.integrations; assert 'transformers' not in sys.modules, 'imported'"
    run_python(code, timeout=120)



# ---- two gloo ranks ----

RANK_ROWS = (10, 7)  # rows per rank: 3 and 2 micro-batches at M=4
DDP_STEPS = 3


def _rank_trainers(rank: int, out_dir: str) -> dict:
    """One rank of ``torchrun`` running two trainers in turn (one launch of the two-rank world
    for both, about a minute of spawning and imports): the plain streamed trainer
    (:func:`_rank_trainer`) and the scheduled one (:func:`_scheduled_rank`). The harness has set
    up the gloo group; Accelerate finds it through the launcher's variables."""
    from ddp_harness import HOST

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(len(RANK_ROWS)),
                      LOCAL_WORLD_SIZE=str(len(RANK_ROWS)), MASTER_ADDR=HOST, MASTER_PORT="0")
    return {"plain": _rank_trainer(rank, os.path.join(out_dir, "plain")),
            "scheduled": _scheduled_rank(os.path.join(out_dir, "scheduled"))}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    """Both trainers' results on each of two gloo ranks, from one launch of the world."""
    from ddp_harness import run_world

    tmp = tmp_path_factory.mktemp("two_ranks")
    return run_world(_rank_trainers, str(tmp / "ranks"), timeout=300, out_dir=tmp / "world")


def _rank_trainer(rank: int, out_dir: str) -> dict:
    """A StreamingTrainer on the rank's own rows (10 or 7 of 17)."""
    rows = Rows(sum(RANK_ROWS))
    # Per-device batch 10 and no even_batches: rank 0 gets 10 of each epoch's 17 rows, rank 1
    # the other 7 (a fresh seeded shuffle each epoch; one epoch per step).
    args = training_args(out_dir, DDP_STEPS, per_device_train_batch_size=RANK_ROWS[0],
                         accelerator_config={"even_batches": False}, ddp_backend="gloo")
    model = make_model()
    seen = largest_batch_seen(model)
    trainer = StreamingTrainer(model=model, args=args, train_dataset=rows, micro_batch_size=M)
    assert trainer.args.world_size == 2 and trainer.args.process_index == rank
    trainer.train()
    res = trainer.last_stream_result
    return {
        "params": [p.detach().clone() for p in trainer.model.parameters()],
        "logged": logged_losses(trainer),
        "grad_norms": [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e],
        "seen": seen[0], "rows": res.num_samples, "micro_batches": res.num_micro_batches,
        "ddp": type(trainer.model_wrapped).__name__,
    }


@pytest.mark.multiprocess
def test_two_gloo_ranks_equal_the_full_batch_trainer(tmp_path, two_ranks):
    """Two ranks with 10 and 7 rows (token counts normalized over both) for 3 AdamW steps equal
    the plain Trainer's full-batch steps on all 17 rows in one process, to 1e-10."""
    ranks = [r["plain"] for r in two_ranks]
    ref_args = training_args(tmp_path / "ref", DDP_STEPS, per_device_train_batch_size=sum(RANK_ROWS))
    ref = Trainer(model=make_model(), args=ref_args, train_dataset=Rows(sum(RANK_ROWS)))
    ref.train()
    assert [r["rows"] for r in ranks] == list(RANK_ROWS)
    assert [r["micro_batches"] for r in ranks] == [math.ceil(n / M) for n in RANK_ROWS]
    for r in ranks:
        assert r["ddp"] == "DistributedDataParallel" and r["seen"] <= M
        for p, q in zip(r["params"], ref.model.parameters()):
            err = (p - q).abs().max().item() / max(q.abs().max().item(), 1e-30)
            assert err <= 1e-10, err
        assert r["logged"] == pytest.approx(logged_losses(ref), rel=1e-6)  # float32 logging, as above
        ref_norms = [e["grad_norm"] for e in ref.state.log_history if "grad_norm" in e]
        assert r["grad_norms"] == pytest.approx(ref_norms, rel=1e-9)


class RecordingTrainer(StreamingTrainer):
    """A StreamingTrainer that keeps each step's input ids, to check which rows it trained on."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.seen: list[torch.Tensor] = []

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.seen.append(inputs["input_ids"].clone())
        return super().training_step(model, inputs, num_items_in_batch)


def scheduled(tmp_path, steps: int, **kw) -> RecordingTrainer:
    """A trainer whose sizes are 5, 5, 5, 9, 9, 13... rows (Steps, on the samples clock): the
    order crosses the 23-row epoch at step 4. This process's share of each under DDP."""
    args = training_args(tmp_path, steps, **kw)
    batches = mbs_ext.MiniBatches(mbs_ext.SampleOrder(N, seed=7), mbs_ext.Steps(((0, 5), (12, 9), (30, 13))),
                                  rank=args.process_index, world=args.world_size)
    return RecordingTrainer(model=make_model(), train_dataset=Rows(), mini_batches=batches,
                            options=mbs_ext.StepOptions(micro_batch_size=M), args=args)


def test_a_scheduled_trainer_trains_on_the_orders_rows_and_resumes_on_them(tmp_path):
    """``mini_batches=``: each step's batch is the next rows of the seeded order at the size the
    schedule gives (replayed here with a fresh order), and a run stopped at a step-3 checkpoint
    and resumed from it trains on the same rows as the run that was not stopped and ends with its
    weights, where the Trainer's own resume would skip three batches of its own size."""
    whole = scheduled(tmp_path / "whole", 6)
    whole.train()
    order, sizes = mbs_ext.SampleOrder(N, seed=7), [5, 5, 5, 9, 9, 13]
    assert [int(ids.shape[0]) for ids in whole.seen] == sizes
    for ids, size in zip(whole.seen, sizes):
        assert torch.equal(ids, Rows().ids[order.next(size)])
    first = scheduled(tmp_path / "cut", 6, save_strategy="steps", save_steps=3)
    first.train()
    resumed = scheduled(tmp_path / "cut", 6)
    resumed.train(resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-3"))
    assert len(resumed.seen) == 3 and resumed.mini_batches.order.samples_seen == sum(sizes)
    for ids, want in zip(resumed.seen, whole.seen[3:]):
        assert torch.equal(ids, want)
    for p, q in zip(resumed.model.parameters(), whole.model.parameters()):
        assert torch.equal(p, q)


PILOT = {"minimum": 4, "maximum": 64, "k": 1.0, "hysteresis": 0.0, "max_rel_stderr": None}


def piloted(tmp_path, steps: int, **kw) -> RecordingTrainer:
    """A trainer whose sizes an Autopilot chooses from the trainer's own noise (4 to 64 rows: here
    it grows at every step, as this model's B_simple does)."""
    pilot = mbs_ext.Autopilot(**PILOT)
    return RecordingTrainer(model=make_model(), train_dataset=Rows(),
                            mini_batches=mbs_ext.MiniBatches(mbs_ext.SampleOrder(N, seed=1), pilot),
                            options=mbs_ext.StepOptions(micro_batch_size=2, noise_scale=True),
                            args=training_args(tmp_path, steps, **kw))


def test_the_autopilot_reads_the_trainers_noise_and_resumes_with_it(tmp_path):
    """An Autopilot handed in without ``noise`` reads the trainer's moving averages: each step's
    size is the one a second Autopilot chooses from the ``B_simple`` the trainer logged a step
    before. Stopped at a step-2 checkpoint and resumed, the run chooses the same sizes (the
    averages come back with the order: without them the third step would keep the second's size)
    and ends with the same weights."""
    whole = piloted(tmp_path / "whole", 5)
    whole.train()
    logged = [types.SimpleNamespace(b_simple=e.get("b_simple")) for e in whole.state.log_history if "loss" in e]
    replay, seen, want = mbs_ext.Autopilot(**PILOT), 0, []
    for noise in [None, *logged[:-1]]:
        want.append(replay.size(seen, noise))
        seen += want[-1]
    sizes = [int(ids.shape[0]) for ids in whole.seen]
    assert sizes == want and sizes[2] > sizes[1], (sizes, [n.b_simple for n in logged])
    piloted(tmp_path / "cut", 5, save_strategy="steps", save_steps=2).train()
    resumed = piloted(tmp_path / "cut", 5)
    resumed.train(resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-2"))
    assert [int(ids.shape[0]) for ids in resumed.seen] == sizes[2:]
    for p, q in zip(resumed.model.parameters(), whole.model.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize(("change", "match"), [
    ({"dataloader_num_workers": 2}, "dataloader_num_workers=0"),
    ({"max_steps": -1}, "max_steps"),
    ({"save_only_model": True}, "save_only_model=False"),
])
def test_a_schedule_refuses_what_would_lose_its_place(tmp_path, change, match):
    with pytest.raises(ValueError, match=match):
        scheduled(tmp_path, 3, **change)


def test_a_schedule_does_not_resume_from_a_checkpoint_without_its_order(tmp_path):
    """A checkpoint saved without ``mini_batches=`` (or a plain Trainer's, without mbs_ext's
    state) cannot say where the order was: resuming a scheduled run from it is refused."""
    StreamingTrainer(model=make_model(), train_dataset=Rows(), micro_batch_size=M,
                     args=training_args(tmp_path / "plain", 2, save_strategy="steps", save_steps=2)).train()
    saved = tmp_path / "plain" / "checkpoint-2"
    with pytest.raises(ValueError, match="holds no sample order"):  # mbs_ext's state, without an order
        scheduled(tmp_path / "again", 4).train(resume_from_checkpoint=str(saved))
    (saved / "mbs_ext_state.pt").unlink()
    with pytest.raises(ValueError, match="holds no sample order"):  # no mbs_ext state at all
        scheduled(tmp_path / "again", 4).train(resume_from_checkpoint=str(saved))


def test_an_autopilot_on_the_trainers_noise_needs_the_noise_measured(tmp_path):
    pilot = mbs_ext.Autopilot(minimum=4, maximum=16)
    with pytest.raises(ValueError, match="noise_scale=True"):
        StreamingTrainer(model=make_model(), train_dataset=Rows(), micro_batch_size=M,
                         mini_batches=mbs_ext.MiniBatches(mbs_ext.SampleOrder(N), pilot),
                         args=training_args(tmp_path, 3))


def test_a_schedule_refuses_another_ranks_share_or_another_dataset(tmp_path):
    for batches, match in [
        (mbs_ext.MiniBatches(mbs_ext.SampleOrder(N), 4, rank=1, world=2), "rank=args.process_index"),
        (mbs_ext.MiniBatches(mbs_ext.SampleOrder(N + 1), 4), "SampleOrder\\(len\\(train_dataset\\)\\)"),
    ]:
        with pytest.raises(ValueError, match=match):
            StreamingTrainer(model=make_model(), train_dataset=Rows(), mini_batches=batches, micro_batch_size=M,
                             args=training_args(tmp_path, 3))


def _scheduled_rank(out_dir: str) -> dict:
    """One rank of a scheduled run on two gloo ranks: each takes its share of the one order."""
    trainer = scheduled(out_dir, 6, ddp_backend="gloo")
    trainer.train()
    return {"params": [p.detach().clone() for p in trainer.model.parameters()], "seen": trainer.seen}


@pytest.mark.multiprocess
def test_a_scheduled_trainer_on_two_gloo_ranks_equals_it_on_one(tmp_path, two_ranks):
    """Each rank trains on its share of every mini-batch of the one order (rank 0 the first half),
    and the two ranks' steps equal the one-process scheduled run's to 1e-10."""
    ranks = [r["scheduled"] for r in two_ranks]
    one = scheduled(tmp_path / "one", 6)
    one.train()
    for step, ids in enumerate(one.seen):
        halves = [r["seen"][step] for r in ranks]
        assert [int(h.shape[0]) for h in halves] == [(len(ids) + 1) // 2, len(ids) // 2]
        assert torch.equal(torch.cat(halves), ids)
    for r in ranks:
        for p, q in zip(r["params"], one.model.parameters()):
            err = (p - q).abs().max().item() / max(q.abs().max().item(), 1e-30)
            assert err <= 1e-10, err
