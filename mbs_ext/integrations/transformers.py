"""Micro-batch streaming inside the Hugging Face ``transformers.Trainer``.

``StreamingTrainer`` is a ``Trainer`` whose ``training_step`` streams each mini-batch
through the model with :func:`mbs_ext.accumulate`, ``micro_batch_size`` rows at a time,
and leaves everything else to the Trainer: clipping (``max_grad_norm``), the optimizer,
the scheduler, mixed precision's GradScaler step, logging, checkpoints, evaluation::

    from mbs_ext.integrations.transformers import StreamingTrainer

    args = TrainingArguments("out", per_device_train_batch_size=512)  # the mini-batch
    trainer = StreamingTrainer(model=model, args=args, train_dataset=ds, micro_batch_size=16)
    trainer.train()

One optimizer step equals the Trainer's step on the whole ``per_device_train_batch_size``
batch (times the number of processes under DDP): the micro-batch losses are weighted by
what the model's loss averages over. By default that is the number of label tokens the
loss really scores: ``labels != -100``, and for causal LMs (whose loss shifts the labels
by one) ``labels[..., 1:] != -100``, or ``shift_labels`` when the collator provides them.
That is the count the Trainer's own ``num_items_in_batch`` uses when it knows the loss
shifts (``model.loss_type`` maps to the causal LM loss); the Trainer's count is not passed
to the model (each micro-batch's loss is its own mean, and mbs_ext weights it), so nothing
is normalized twice. Where the plain Trainer would count otherwise (a ``GPT2LMHeadModel``
built from a config has no ``loss_type``, so it counts the unshifted labels: one token more
for every row whose first label counts), the two Trainers' losses differ by that ratio: the first
training step warns, naming ``loss_type`` and both counts (:func:`_warn_if_counts_differ`).

The training DataLoader keeps batches on the host (pinned when
``dataloader_pin_memory``): the Trainer's prepared DataLoader would otherwise move each
whole batch to the device, which is exactly what streaming avoids. With ``mini_batches=``
(a :class:`mbs_ext.MiniBatches`) it draws the rows of a sample order at a schedule's sizes,
and checkpoints resume that order (docs/batch-schedules.md).

Refused, when the Trainer is made: ``gradient_accumulation_steps > 1`` (a larger
``per_device_train_batch_size`` does the same exactly, with ``micro_batch_size`` bounding
memory), DataParallel over several GPUs in one process (``n_gpu > 1``: launch one process
per GPU), DeepSpeed, FSDP, and a ``compute_loss_func`` without an explicit ``normalize``
(what a custom loss averages over cannot be guessed).

This module imports ``transformers``; ``import mbs_ext`` does not import it.
"""

from __future__ import annotations

import importlib
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from transformers import Trainer
from transformers.utils import is_datasets_available

import mbs_ext
from mbs_ext import Autopilot, MiniBatches, StepOptions
from mbs_ext.counts.noise import NoiseSample, NoiseScale
from mbs_ext.messages import caller_stacklevel

__all__ = ["StreamingTrainer", "label_token_count", "loss_shifts_labels"]

IGNORE_INDEX = -100
STATE_NAME = "mbs_ext_state.pt"  # this trainer's state, in each checkpoint folder beside the optimizer's


def label_token_count(shifted: bool, ignore_index: int = IGNORE_INDEX) -> Callable[[Any], torch.Tensor]:
    """A ``normalize`` count: the label tokens a micro-batch's loss averages over.

    ``shift_labels`` when the micro-batch has them (already shifted by the collator),
    else ``labels[..., 1:]`` when ``shifted`` (causal LM losses drop the first position),
    else ``labels``; tokens equal to ``ignore_index`` do not count. The count stays on the
    micro-batch's device (no host sync).
    """

    def count(micro_batch: Any) -> torch.Tensor:
        if not isinstance(micro_batch, Mapping) or ("labels" not in micro_batch and "shift_labels" not in micro_batch):
            raise ValueError(
                "StreamingTrainer: the batch has no 'labels', so the default normalize (the label tokens the "
                "model's loss averages over) does not apply; pass normalize= (e.g. 'samples' or a "
                "count(micro_batch) callable)"
            )
        if "shift_labels" in micro_batch:
            labels = micro_batch["shift_labels"]
        else:
            labels = micro_batch["labels"]
            if shifted:
                labels = labels[..., 1:]
        return (labels != ignore_index).sum()

    return count


def loss_shifts_labels(model: nn.Module) -> bool:
    """Whether ``model``'s loss is the causal LM loss, which shifts labels by one (position 0
    is never a target).

    Read from the loss the model's forward really calls: ``model.loss_type`` mapped through
    transformers' ``LOSS_MAPPING``, or, where the class name maps to no loss type (e.g.
    ``GPT2LMHeadModel``, whose ``loss_function`` then falls back to ``ForCausalLMLoss``), the
    causal LM classes of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``. Encoder-decoder models score
    unshifted labels. (The Trainer's own ``_loss_shifts_labels`` misses the second case, so
    its ``num_items_in_batch`` for ``GPT2LMHeadModel`` counts unshifted labels.)
    """
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    while hasattr(model, "module") and isinstance(model.module, nn.Module):  # DDP and other wrappers
        model = model.module
    if type(model).__name__.startswith("Peft") and isinstance(getattr(model.base_model, "model", None), nn.Module):
        model = model.base_model.model  # a PEFT model: the transformers model under its tuner
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False
    loss_type = getattr(model, "loss_type", None)
    if loss_type is not None:
        return LOSS_MAPPING.get(loss_type) is ForCausalLMLoss
    return type(model).__name__ in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


class _StreamState(Trainer):
    """What the streaming trainer keeps from step to step: the gradient noise's moving averages
    (``noise_scale``, logged beside the loss) and, where a schedule sizes the batches, the sample
    order and schedule of ``mini_batches`` with the loader drawing from them. Both are saved
    beside the optimizer's state in each checkpoint folder and loaded where the Trainer loads
    that, so ``train(resume_from_checkpoint=...)`` resumes them with everything else. The order
    is global (every rank's is the same), so the main process's copy is all ranks'."""

    noise_scale: NoiseScale
    mini_batches: MiniBatches | None
    last_stream_result: mbs_ext.StepResult | None

    def _check_mini_batches(self, mini_batches: MiniBatches, noise_scale: bool) -> None:
        """A schedule's mini-batches come from ``mini_batches``, and the run resumes from its state.

        The Trainer resumes its own loader by skipping as many batches as steps were taken, which
        lands elsewhere once sizes change; the order resumes itself from the checkpoint (counted in
        samples), so the skip is turned off (``ignore_data_skip``). A batch count is unknown ahead,
        so ``max_steps`` ends the run (or the order's ``total_samples``, earlier). The loader draws in
        this process (``dataloader_num_workers=0``): workers would draw mini-batches ahead of the
        steps, and a checkpoint would then resume past rows never trained on. Under DDP each rank
        takes its share of one global order: ``rank``/``world`` must be the process's. An
        :class:`mbs_ext.Autopilot` without ``noise`` reads this trainer's moving averages
        (``noise_scale``, restored from a checkpoint with the order, so a resumed run sizes its
        next batch as the first run did), so it needs ``noise_scale=True``.
        Checkpoints must hold the order: ``save_only_model`` is refused."""
        args = self.args
        if not isinstance(mini_batches, MiniBatches):
            raise TypeError(f"mini_batches must be a mbs_ext.MiniBatches, got {type(mini_batches).__name__}")
        if args.max_steps <= 0:
            raise ValueError("StreamingTrainer: with mini_batches=, set TrainingArguments(max_steps=...): a schedule's "
                             "number of batches per epoch is not known ahead")
        if args.save_only_model:
            raise ValueError("StreamingTrainer: mini_batches= needs save_only_model=False: a checkpoint must hold "
                             "the sample order (mbs_ext_state.pt) for a resumed run to land on the same sample")
        if args.dataloader_num_workers:
            raise ValueError(
                f"StreamingTrainer: mini_batches= needs dataloader_num_workers=0 (got {args.dataloader_num_workers}): "
                "workers draw mini-batches ahead of the steps, so a checkpoint's order would be ahead of the "
                "training and a resumed run would skip rows"
            )
        if (mini_batches.rank, mini_batches.world) != (args.process_index, args.world_size):
            raise ValueError(
                f"mini_batches: rank={mini_batches.rank}, world={mini_batches.world}, but this process is rank "
                f"{args.process_index} of {args.world_size}: build it with rank=args.process_index, "
                "world=args.world_size (each rank takes its share of one global order)"
            )
        rows = len(self.train_dataset) if hasattr(self.train_dataset, "__len__") else None
        if rows is not None and rows != mini_batches.order.rows:
            raise ValueError(f"mini_batches: its SampleOrder has {mini_batches.order.rows} rows, train_dataset "
                             f"{rows}: build it with SampleOrder(len(train_dataset))")
        if mini_batches.noise is None:
            if isinstance(mini_batches.size, Autopilot) and not noise_scale:
                raise ValueError("StreamingTrainer: the Autopilot in mini_batches follows the gradient noise, which "
                                 "is not measured: pass options=mbs_ext.StepOptions(..., noise_scale=True), or give "
                                 "MiniBatches its own noise=")
            mini_batches.noise = lambda: self.noise_scale if self.noise_scale.steps else None
        args.ignore_data_skip = True

    def _mini_batch_loader(self) -> torch.utils.data.DataLoader:
        """``train_dataset``'s rows in ``mini_batches``' order and sizes, collated as the Trainer
        collates (columns the model does not take removed)."""
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        dataset, collate = self.train_dataset, self.data_collator
        if is_datasets_available() and isinstance(dataset, importlib.import_module("datasets").Dataset):
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collate = self._get_collator_with_removed_columns(collate, description="training")
        return torch.utils.data.DataLoader(dataset, batch_sampler=self.mini_batches, collate_fn=collate,
                                           pin_memory=self.args.dataloader_pin_memory)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's log, with the gradient noise beside the training loss: the latest step's
        ``noise_trace`` (S) and ``noise_grad_sq`` (|G|^2), and ``b_simple`` (with
        ``b_simple_stderr``) once the run's moving averages give one."""
        noise = self.last_stream_result.noise if self.last_stream_result is not None else None
        if noise is not None and "loss" in logs and noise.trace is not None:
            logs = {**logs, "noise_trace": noise.trace, "noise_grad_sq": noise.grad_sq}
            if noise.b_simple is not None:
                logs["b_simple"] = noise.b_simple
            if noise.b_simple_stderr is not None:
                logs["b_simple_stderr"] = noise.b_simple_stderr
        super().log(logs, *args, **kwargs)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        if self.args.should_save:
            order = self.mini_batches.state_dict() if self.mini_batches is not None else None
            torch.save({"noise": self.noise_scale.state_dict(), "mini_batches": order},
                       os.path.join(output_dir, STATE_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, STATE_NAME)
        state = torch.load(path, weights_only=True) if os.path.isfile(path) else {}  # a plain Trainer's: none
        if "noise" in state:
            self.noise_scale.load_state_dict(state["noise"])
        if self.mini_batches is not None:
            if state.get("mini_batches") is None:
                raise ValueError(
                    f"resume_from_checkpoint: {checkpoint} holds no sample order ({STATE_NAME} with it: a checkpoint "
                    "of a plain Trainer, or of one made without mini_batches=), so this run's data would start "
                    "again from its first sample; resume from a checkpoint this trainer saved with mini_batches=, "
                    "or resume without mini_batches="
                )
            self.mini_batches.load_state_dict(state["mini_batches"])


class StreamingTrainer(_StreamState):
    """A ``transformers.Trainer`` that streams each training batch in micro-batches.

    ``micro_batch_size``: rows per micro-batch (an int, or ``"auto"`` with
    ``options=StepOptions(..., memory_budget=...)``), or a cap on rows beside
    ``micro_batch_tokens`` (rows grouped by length and trimmed, at most that many tokens counting
    padding per micro-batch, or ``"auto"`` from ``memory_budget``: docs/tokens.md), which may
    stand alone. ``normalize``: what each micro-batch's loss averages over; ``None`` (default)
    counts the label tokens the model's loss scores (see :func:`label_token_count`); otherwise any
    :class:`mbs_ext.StepOptions` ``normalize``.
    ``options``: further :class:`mbs_ext.StepOptions` fields (``accumulate_dtype``,
    ``autocast_dtype``...). ``max_grad_norm`` and ``scaler`` belong to the Trainer
    (``TrainingArguments.max_grad_norm``; the Accelerator's GradScaler under fp16).
    ``mini_batches``: a :class:`mbs_ext.MiniBatches` over ``train_dataset``'s rows, for a batch
    size that changes from step to step (a ramp, steps, the noise autopilot: docs/batch-schedules.md)
    in place of ``per_device_train_batch_size``; see :meth:`_check_mini_batches`.
    Every other argument is the Trainer's.
    """

    def __init__(
        self,
        *args: Any,
        micro_batch_size: int | str | None = None,
        normalize: Any = None,
        options: StepOptions | None = None,
        micro_batch_tokens: int | str | None = None,
        mini_batches: MiniBatches | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        sizes = {"micro_batch_size": micro_batch_size} if micro_batch_size is not None or options is None else {}
        if micro_batch_tokens is not None:  # rows grouped by length, trimmed (docs/tokens.md)
            sizes["micro_batch_tokens"] = micro_batch_tokens
        base = options if options is not None else StepOptions(**sizes)
        if not isinstance(base, StepOptions):
            raise TypeError(f"options must be a mbs_ext.StepOptions, got {type(base).__name__}")
        if base.max_grad_norm is not None or base.scaler is not None:
            raise ValueError(
                "options: max_grad_norm and scaler belong to the Trainer (TrainingArguments.max_grad_norm; "
                "the Accelerator's GradScaler under fp16); leave them unset here"
            )
        self._check_setup(normalize)
        # No first-step count check: its forwards would run compute_loss, which the Trainer
        # accounts for; the Trainer's count is compared with the model's instead (_warn_if_counts_differ).
        self.stream_options = base.replace(**sizes, normalize=normalize, check_count=False)
        self.mini_batches = mini_batches
        if mini_batches is not None:
            self._check_mini_batches(mini_batches, self.stream_options.noise_scale)
        self.last_stream_result: mbs_ext.StepResult | None = None
        # With options.noise_scale: the gradient noise's moving averages over the training steps
        # (docs/noise-scale.md), logged beside the loss as "b_simple" and "b_simple_stderr".
        self.noise_scale = NoiseScale()
        self._counts_compared = False  # whether the plain Trainer's count was compared with ours (once)

    def _check_setup(self, normalize: Any) -> None:
        args = self.args
        if args.gradient_accumulation_steps != 1:
            raise ValueError(
                f"StreamingTrainer: gradient_accumulation_steps={args.gradient_accumulation_steps} is not supported. "
                "Streaming already is exact gradient accumulation: set per_device_train_batch_size to the whole "
                "mini-batch (per_device_train_batch_size * gradient_accumulation_steps) and "
                "gradient_accumulation_steps=1; micro_batch_size bounds the memory"
            )
        if args.n_gpu > 1:
            raise ValueError(
                f"StreamingTrainer: {args.n_gpu} GPUs in one process (torch.nn.DataParallel) are not supported; "
                "launch one process per GPU (torchrun / accelerate launch): DistributedDataParallel is"
            )
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError("StreamingTrainer: DeepSpeed and FSDP are not supported (DistributedDataParallel is)")
        if self.compute_loss_func is not None and normalize is None:
            raise ValueError(
                "StreamingTrainer: with a compute_loss_func, pass normalize= (what your loss averages over: "
                "'samples', 'sum', or a count(micro_batch) callable); it is called without num_items_in_batch"
            )

    # ---- data: batches stay on the host ----

    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        """The Trainer's training DataLoader, prepared by Accelerate (sharding, seeding) but without
        device placement: each batch stays on the host and is streamed by mbs_ext. With
        ``mini_batches``, a loader over it, not prepared by Accelerate (each rank's share is the
        order's, and Accelerate would shard the batches again)."""
        if self.mini_batches is not None:
            return self._mini_batch_loader()
        accelerator = self.accelerator
        placement = accelerator.device_placement
        accelerator.device_placement = False
        try:
            loader = super().get_train_dataloader()
        finally:
            accelerator.device_placement = placement
        if type(loader).__name__ == "DataLoaderDispatcher":
            raise ValueError(
                "StreamingTrainer: Accelerate's dispatch_batches moves every batch to the device; "
                "set accelerator_config={'dispatch_batches': False}"
            )
        if getattr(loader, "device", None) is not None:
            loader.device = None
        return loader

    # ---- the step ----

    def _normalize(self, batch: Any) -> Any:
        normalize = self.stream_options.normalize
        if normalize is not None:
            return normalize
        return label_token_count(loss_shifts_labels(self.model))

    def training_step(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """Stream ``inputs`` (the whole per-device batch, on the host) through ``model`` in
        micro-batches; the exact mini-batch gradients are left in ``.grad`` (replacing what was
        there) for the Trainer's clipping and optimizer step. Returns the mini-batch loss (the
        global one under DDP), detached, for logging.

        ``num_items_in_batch`` is not used: each micro-batch's loss is its own mean and mbs_ext
        weights it by its share of the (global) count, which is the same count.
        """
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        batch = dict(inputs) if isinstance(inputs, Mapping) else inputs  # BatchEncoding is no dict
        if not self._counts_compared:
            self._counts_compared = _warn_if_counts_differ(self, batch)

        def loss_fn(m: nn.Module, micro_batch: Any) -> torch.Tensor:
            mb = dict(micro_batch) if isinstance(micro_batch, Mapping) else micro_batch  # compute_loss may pop
            with self.compute_loss_context_manager():
                return self.compute_loss(m, mb)

        result = mbs_ext.accumulate(
            model, batch, loss_fn, options=self.stream_options, normalize=self._normalize(batch),
            scaler=self.accelerator.scaler,
        )
        if result.noise is not None:  # one step's sums into the run's averages
            noise = result.noise
            result.noise = self.noise_scale.update(NoiseSample(noise.micro_batches, noise.items, noise.micro_sq,
                                                               noise.batch_sq))
        self.last_stream_result = result
        dtype = self._tr_loss.dtype if isinstance(getattr(self, "_tr_loss", None), torch.Tensor) else torch.float32
        return torch.tensor(result.loss, dtype=dtype, device=self.args.device)


def _warn_if_counts_differ(trainer: StreamingTrainer, batch: Any) -> bool:
    """Warn when the plain Trainer would normalize this model's loss over another count; True
    once nothing is left to compare (warned, or the two rules agree).

    The plain Trainer divides the summed loss by ``num_items_in_batch``, counted over
    ``labels[..., 1:]`` only when ``model.loss_type`` maps to the causal LM loss; a model whose
    loss shifts without saying so (``GPT2LMHeadModel`` built from a config) gets the unshifted
    count there (one token more for every row whose first label counts), while StreamingTrainer
    counts the tokens the loss scores. A user comparing the two sees only that they differ, so
    say why, once, on the first batch whose two counts differ. Nothing to compare under an
    explicit ``normalize``, with ``shift_labels`` (both use them), or when the plain Trainer
    passes no count at all (``model_accepts_loss_kwargs`` false: the model's own mean, as here).
    """
    if (trainer.stream_options.normalize is not None or not isinstance(batch, Mapping) or "labels" not in batch
            or "shift_labels" in batch or not trainer.model_accepts_loss_kwargs):
        return True
    model = trainer.model
    ours, theirs = loss_shifts_labels(model), bool(getattr(trainer, "_loss_shifts_labels", False))
    if ours == theirs:
        return True
    ours_n, theirs_n = (int(label_token_count(shift)(batch)) for shift in (ours, theirs))
    if ours_n == theirs_n:  # this batch has no token the two rules count apart: look again next step
        return False
    factor = f" (the plain Trainer's are {ours_n / theirs_n:.4g} times these)" if theirs_n else ""
    warnings.warn(
        f"StreamingTrainer: {type(model).__name__} has loss_type={getattr(model, 'loss_type', None)!r}, so the "
        f"plain transformers Trainer would count the {'shifted' if theirs else 'unshifted'} labels for "
        f"num_items_in_batch ({theirs_n} tokens in this batch), while the model's loss scores the "
        f"{'shifted' if ours else 'unshifted'} ones ({ours_n} tokens), which StreamingTrainer counts: its loss and "
        f"gradients are the model's exact mean and differ from the plain Trainer's{factor}. "
        "To make both agree, set model.loss_type to the loss the model computes "
        "(\"ForCausalLM\" for a causal LM); see docs/integrations.md",
        UserWarning,
        stacklevel=caller_stacklevel(),
    )
    return True
