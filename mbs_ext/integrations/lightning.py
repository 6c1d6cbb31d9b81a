"""Micro-batch streaming inside PyTorch Lightning: ``Trainer(strategy=StreamingStrategy(micro_batch_size=32))``.

The user's ``LightningModule`` stays as it is. The strategy keeps each training batch on
the host (``batch_to_device``) and, when Lightning's automatic optimization calls its
``training_step``, streams the batch through the model in micro-batches with
:class:`mbs_ext.MicroBatchStreamer` (``accumulate``): the user's ``training_step`` runs
once per micro-batch, through DDP's forward under DDP (only the last micro-batch's
backward all-reduces; the normalization is global over ranks), and the exactly
normalized mini-batch gradient ends up in ``.grad``.

Lightning's closure runs ``training_step``, then ``optimizer_zero_grad``, then
``backward``. So that the zero-grad cannot wipe the streamed gradient, the strategy
takes the gradient out of ``.grad`` at the end of its ``training_step`` and puts it back
in its ``backward`` (which runs no backward of its own, only the precision plugin's
``on_before_backward``/``on_after_backward`` hooks, once per mini-batch). Everything after
the closure is Lightning's own: the precision plugin's unscale and optimizer step,
``gradient_clip_val`` (on the full mini-batch gradient), schedulers, checkpointing.

``self.log`` calls made inside ``training_step`` are collected per micro-batch and
logged once per mini-batch, combined as the loss is (a weighted mean by the
``normalize`` counts, a sum under ``normalize="sum"``; ``reduce_fx="max"/"min"/"sum"``
combine by that), so a logged loss is the full-batch loss of the rank, as without
streaming. The value returned by ``training_step`` (the loss, or the dict's ``"loss"``)
is combined the same way; the dict's other keys come from the last micro-batch.

Supported: the single-device and DDP strategies (``strategy="single_device"``/``"ddp"``,
``"ddp_spawn"``, or an instance of either), automatic optimization,
``accumulate_grad_batches=1`` (streaming is the accumulation), any precision plugin
(``16-mixed`` streams with its GradScaler). Refused with a reason: FSDP, DeepSpeed and
other sharded or model-parallel strategies, manual optimization, gradient accumulation
over batches. This module imports Lightning; ``import mbs_ext`` does not import it.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy, Strategy

from mbs_ext.model import members as _model
from mbs_ext.model.options import StepOptions, make_options
from mbs_ext.model.wrappers import find_ddp
from mbs_ext.step.streamer import MicroBatchStreamer, StepResult
from mbs_ext.step.streamer import accumulate as _accumulate
from mbs_ext.streaming import batch as _batch

__all__ = ["StreamingDDPStrategy", "StreamingSingleDeviceStrategy", "StreamingStrategy", "accumulate"]

_REFUSED = {
    "fsdp": "FSDP shards parameters and gradients across ranks and gathers them inside each forward/backward; "
            "mbs_ext streams micro-batches through a whole (replicated) model and accumulates whole gradients",
    "deepspeed": "DeepSpeed owns the backward, the gradient accumulation and the optimizer step",
    "xla": "XLA traces the step lazily; mbs_ext's stream and its host sync do not fit that model",
    "model_parallel": "tensor/model parallelism shards the model; mbs_ext streams through a replicated model",
}


def StreamingStrategy(  # noqa: N802 - a factory named as the strategy the user puts in Trainer(strategy=...)
    micro_batch_size: int | str | None = None,
    normalize: Any = None,
    *,
    strategy: str | Strategy = "single_device",
    options: StepOptions | None = None,
    **kwargs: Any,
) -> Strategy:
    """A Lightning strategy that streams each training batch in micro-batches.

    ``micro_batch_size`` and ``normalize`` are :class:`mbs_ext.StepOptions` fields, as are
    ``options=`` and keywords named like its fields (``accumulate_dtype``, ``memory_budget``,
    ``micro_batch_tokens``: then ``micro_batch_size`` may be left out, docs/tokens.md, ...);
    other keywords go to the wrapped strategy's constructor (``device=`` for
    ``"single_device"``, ``find_unused_parameters=`` for ``"ddp"``). ``strategy`` is
    ``"single_device"`` (the default; its device is the Trainer's, e.g. ``cuda:0`` with
    ``accelerator="gpu"``), ``"ddp"``, ``"ddp_spawn"``, or an instance of
    ``SingleDeviceStrategy``/``DDPStrategy`` (then no strategy keywords).
    """
    fields = {f for f in StepOptions.__dataclass_fields__}
    step_kw = {k: kwargs.pop(k) for k in list(kwargs) if k in fields}
    if micro_batch_size is not None or options is None:
        step_kw["micro_batch_size"] = micro_batch_size
    opts = make_options(options, {"normalize": normalize, **step_kw})
    if opts.max_grad_norm is not None:
        raise ValueError("max_grad_norm: use the Trainer's gradient_clip_val (Lightning clips the full mini-batch "
                         "gradient after the stream)")
    if isinstance(strategy, str):
        inst = _named(strategy, kwargs)
    elif isinstance(strategy, Strategy):
        if kwargs:
            raise TypeError(f"unexpected keywords {sorted(kwargs)} (the strategy instance is already made)")
        inst = _streaming_instance(strategy)
    else:
        raise TypeError(f"strategy must be a name or a lightning Strategy, got {type(strategy).__name__}")
    inst._mbs_init(opts)
    return inst


def _named(strategy: str, kwargs: dict[str, Any]) -> Strategy:
    """The streaming strategy called ``strategy``, made with the wrapped strategy's ``kwargs``."""
    name = strategy.lower()
    _refuse(name)
    if name in ("single_device", "auto"):
        return StreamingSingleDeviceStrategy(**kwargs)
    if name == "ddp":
        return StreamingDDPStrategy(**kwargs)
    if name == "ddp_spawn":
        return StreamingDDPStrategy(start_method="spawn", **kwargs)
    raise ValueError(f"strategy={strategy!r}: StreamingStrategy wraps 'single_device', 'ddp' or 'ddp_spawn' "
                     "(or an instance of SingleDeviceStrategy / DDPStrategy)")


def _refuse(name: str) -> None:
    for key, why in _REFUSED.items():
        if key in name:
            raise ValueError(f"StreamingStrategy does not support strategy {name!r}: {why}. "
                             "Use strategy='ddp' (or 'single_device')")


def _streaming_instance(strategy: Strategy) -> Strategy:
    """A streaming strategy with ``strategy``'s state (its constructor's arguments included)."""
    if isinstance(strategy, _StreamingMixin):
        return strategy
    cls = type(strategy)
    if isinstance(strategy, DDPStrategy):
        new = StreamingDDPStrategy if cls is DDPStrategy else type(f"Streaming{cls.__name__}",
                                                                   (_StreamingMixin, cls), {})
    elif isinstance(strategy, SingleDeviceStrategy):
        if cls is SingleDeviceStrategy:
            new = StreamingSingleDeviceStrategy
        else:
            new = type(f"Streaming{cls.__name__}", (_StreamingSingleDevice, cls), {})
    else:
        _refuse(getattr(strategy, "strategy_name", cls.__name__).lower())
        raise ValueError(f"StreamingStrategy wraps SingleDeviceStrategy or DDPStrategy, got {cls.__name__}")
    streaming = new.__new__(new)  # the same state under the streaming class
    streaming.__dict__.update(strategy.__dict__)
    if isinstance(streaming, StreamingSingleDeviceStrategy):
        streaming._mbs_device_given = True  # the instance was made with its device
    return streaming


class _StreamingMixin:
    """The streaming hooks shared by the single-device and DDP strategies."""

    def _mbs_init(self, options: StepOptions) -> None:
        self.mbs_options = options
        self.last_result: StepResult | None = None  # the latest mini-batch's mbs_ext result
        self._mbs_streamer: MicroBatchStreamer | None = None
        self._mbs_stash: list | None = None  # gradients kept away from Lightning's zero_grad
        self._mbs_step: _Step | None = None
        self._mbs_loaded: dict | None = None  # a checkpoint's streamer state, for the streamer to come

    # -- the batch stays on the host while training -------------------------------------
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        if self._mbs_training():
            return batch  # streamed to the device micro-batch by micro-batch
        return super().batch_to_device(batch, device, dataloader_idx)

    def _mbs_training(self) -> bool:
        lm = self.lightning_module
        trainer = getattr(lm, "_trainer", None) if lm is not None else None
        return trainer is not None and trainer.training and not trainer.sanity_checking

    def on_train_start(self) -> None:
        super().on_train_start()
        lm = self.lightning_module
        if not lm.automatic_optimization:
            raise ValueError(
                "StreamingStrategy streams Lightning's automatic optimization (training_step returning the loss); "
                "with automatic_optimization=False the training_step owns the backward and cannot be streamed "
                "from outside. Use automatic optimization, or stream it yourself with mbs_ext.accumulate")
        if lm.trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"accumulate_grad_batches={lm.trainer.accumulate_grad_batches}: StreamingStrategy already "
                "accumulates micro-batches exactly within a batch; use a larger batch (micro_batch_size bounds "
                "the memory) and accumulate_grad_batches=1")

    # -- training_step: stream the batch ----------------------------------------------
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self._mbs_training():
            return super().training_step(*args, **kwargs)
        if self._mbs_stash is not None:  # a previous closure never reached backward
            self._mbs_restore()
        lm = self.lightning_module
        batch, rest = args[0], args[1:]
        step = self._mbs_step = _Step(self, lm, rest, kwargs)
        streamer = self._streamer()
        try:
            with _CaptureLogs(lm, step):
                self.last_result = streamer.accumulate(batch)
        finally:
            self._mbs_step = None
        # Lightning zero-grads between training_step and backward: keep the gradient out of its reach.
        self._mbs_stash = [(p, p.grad) for p in _model.trainable(lm)]
        for p, _ in self._mbs_stash:
            p.grad = None
        step.replay_logs()
        noise = self.last_result.noise
        if noise is not None and noise.trace is not None:  # with noise_scale (docs/noise-scale.md)
            lm.log("noise_trace", noise.trace, on_step=True)
            lm.log("noise_grad_sq", noise.grad_sq, on_step=True)
            if noise.b_simple is not None:  # once the moving averages give one
                lm.log("b_simple", noise.b_simple, on_step=True, prog_bar=True)
        return step.output()

    def _streamer(self) -> MicroBatchStreamer:
        s = self._mbs_streamer
        if s is None or s.model is not self.model:
            opts = self.mbs_options
            plugin = self.precision_plugin
            if opts.scaler is None and isinstance(plugin, MixedPrecision) and plugin.scaler is not None:
                opts = opts.replace(scaler=plugin.scaler)
            # No first-step count check: its three forwards would call training_step, whose logs
            # this strategy gathers into the step's own.
            s = self._mbs_streamer = MicroBatchStreamer(self.model, None, self._mbs_loss,
                                                        options=opts.replace(check_count=False))
            if self._mbs_loaded is not None:  # resumed from a checkpoint (load_checkpoint)
                s.load_state_dict(self._mbs_loaded)
                self._mbs_loaded = None
        return s

    # -- checkpoints: the streamer's state (the noise's moving averages) rides along --------
    def save_checkpoint(self, checkpoint: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        state = self._mbs_streamer.state_dict() if self._mbs_streamer is not None else self._mbs_loaded
        if state is not None:
            checkpoint = {**checkpoint, "mbs_ext": state}
        super().save_checkpoint(checkpoint, *args, **kwargs)

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(*args, **kwargs)
        state = checkpoint.get("mbs_ext")
        if state is not None:  # a plain strategy's checkpoint has none
            self._mbs_loaded = state
            if self._mbs_streamer is not None:
                self._streamer().load_state_dict(state)
                self._mbs_loaded = None
        return checkpoint

    def _mbs_loss(self, model: torch.nn.Module, micro_batch: Any) -> torch.Tensor:
        """``loss_fn(model, micro_batch)`` for mbs_ext: the user's training_step on one micro-batch."""
        step = self._mbs_step
        lm = self.lightning_module
        step.begin(micro_batch)
        micro_batch = lm._apply_batch_transfer_handler(micro_batch, device=self.root_device)
        with self.precision_plugin.train_step_context():
            if model is not lm:  # DDP: through its forward, so that its reducer sees the micro-batch
                out = self._forward_redirection(model, lm, "training_step", micro_batch, *step.args, **step.kwargs)
            else:
                out = lm.training_step(micro_batch, *step.args, **step.kwargs)
        return step.end(out)

    # -- backward: give the streamed gradient back ------------------------------------
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self._mbs_stash is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        lm = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, lm)  # on_before_backward hooks
        self._mbs_restore()
        return self.precision_plugin.post_backward(closure_loss, lm)  # on_after_backward hooks

    def _mbs_restore(self) -> None:
        stash, self._mbs_stash = self._mbs_stash, None
        for p, g in stash:
            p.grad = g


class StreamingSingleDeviceStrategy(_StreamingMixin, SingleDeviceStrategy):
    """Streaming on one device; without ``device=`` it takes the Trainer's device."""

    strategy_name = "mbs_streaming"

    def __init__(self, device: Any = None, **kwargs: Any) -> None:
        super().__init__(device="cpu" if device is None else device, **kwargs)
        self._mbs_device_given = device is not None

    # The Trainer hands a strategy with ``parallel_devices`` its devices: take the first.
    @property
    def parallel_devices(self) -> list[torch.device]:
        return [self._root_device] if self._mbs_device_given else []

    @parallel_devices.setter
    def parallel_devices(self, devices: list) -> None:
        if len(devices) > 1:
            raise ValueError(f"StreamingStrategy got {len(devices)} devices; pass strategy='ddp' for several")
        if devices:
            self._root_device = torch.device(devices[0])
            self._mbs_device_given = True


_StreamingSingleDevice = StreamingSingleDeviceStrategy


class StreamingDDPStrategy(_StreamingMixin, DDPStrategy):
    """Streaming under DistributedDataParallel: only the last micro-batch's backward all-reduces."""

    strategy_name = "mbs_streaming_ddp"


# ------------------------------------------------------------------------------------------
class _Step:
    """One mini-batch: the per-micro-batch outputs, counts and captured ``self.log`` calls."""

    def __init__(self, strategy: _StreamingMixin, lm: LightningModule, args: tuple, kwargs: dict) -> None:
        self.args, self.kwargs = args, kwargs
        opts = strategy.mbs_options
        self.rule = opts.normalize if opts.normalize is not None else "samples"
        self.losses: list[torch.Tensor] = []
        self.weights: list[Any] = []
        self.extra: dict | None = None
        self.logs: dict[str, list] = {}  # name -> [(micro-batch index, bound arguments)]
        self.index = -1
        self.lm = lm

    def begin(self, micro_batch: Any) -> None:
        self.index += 1
        if callable(self.rule):
            w = self.rule(micro_batch)
            w = w.detach().to(torch.float64) if isinstance(w, torch.Tensor) else float(w)
        elif self.rule == "samples":
            w = float(_batch.tensor_leaves(micro_batch)[0].shape[0])
        else:
            w = 1.0
        self.weights.append(w)

    def end(self, out: Any) -> torch.Tensor:
        if isinstance(out, dict):
            if "loss" not in out:
                raise ValueError("training_step returned a dict without a 'loss' key")
            loss, self.extra = out["loss"], {k: v for k, v in out.items() if k != "loss"}
        elif isinstance(out, torch.Tensor):
            loss = out
        else:
            raise TypeError(f"StreamingStrategy needs training_step to return the loss (a tensor or a dict with "
                            f"'loss'); it returned {type(out).__name__} (returning None to skip a batch is not "
                            "supported while streaming)")
        self.losses.append(loss.detach())
        return loss

    def combine(self, values: list, indices: list[int], reduce_fx: Any = "mean") -> Any:
        """The mini-batch value of per-micro-batch ``values`` (taken at micro-batches ``indices``)."""
        vals = [v.detach() if isinstance(v, torch.Tensor) else v for v in values]
        if reduce_fx in ("max", torch.max):
            return torch.stack([torch.as_tensor(v) for v in vals]).max()
        if reduce_fx in ("min", torch.min):
            return torch.stack([torch.as_tensor(v) for v in vals]).min()
        if reduce_fx in ("sum", torch.sum) or self.rule == "sum":
            return sum(vals[1:], vals[0])
        if self.rule == "micro_batches":
            return sum(vals[1:], vals[0]) / len(vals)
        ws = [self.weights[i] for i in indices]
        total = sum(ws[1:], ws[0])
        num = sum((w * v for w, v in zip(ws[1:], vals[1:])), ws[0] * vals[0])
        return num / total

    def output(self) -> Any:
        loss = self.combine(self.losses, list(range(len(self.losses))))
        loss = loss.to(self.losses[0].dtype) if isinstance(loss, torch.Tensor) else loss
        return loss if self.extra is None else {**self.extra, "loss": loss}

    def replay_logs(self) -> None:
        """Log each name once, its micro-batch values combined (a Metric object: its last call as is)."""
        for calls in self.logs.values():
            last = dict(calls[-1][1])
            values = [a["value"] for _, a in calls]
            if all(isinstance(v, (torch.Tensor, int, float)) and not isinstance(v, bool) for v in values):
                value = self.combine(values, [i for i, _ in calls], last.get("reduce_fx", "mean"))
                if isinstance(value, torch.Tensor) and isinstance(values[-1], torch.Tensor):
                    value = value.to(values[-1].dtype)
                last["value"] = value
                sizes = [a.get("batch_size") for _, a in calls]
                if all(s is not None for s in sizes):
                    last["batch_size"] = sum(sizes)
            self.lm.log(**last)


_LOG_SIGNATURE = inspect.signature(LightningModule.log)


class _CaptureLogs:
    """Within the block ``lm.log`` (and so ``log_dict``) records its calls into ``step.logs``."""

    def __init__(self, lm: LightningModule, step: _Step) -> None:
        self.lm, self.step = lm, step

    def __enter__(self) -> None:
        step = self.step

        def log(*args: Any, **kwargs: Any) -> None:
            bound = _LOG_SIGNATURE.bind(self.lm, *args, **kwargs)
            arguments = {k: v for k, v in bound.arguments.items() if k != "self"}
            step.logs.setdefault(arguments["name"], []).append((step.index, arguments))

        object.__setattr__(self.lm, "log", log)

    def __exit__(self, *exc: Any) -> None:
        self.lm.__dict__.pop("log", None)


# ------------------------------------------------------------------------------------------
def accumulate(model: torch.nn.Module, batch: Any, loss_fn: Any, **kwargs: Any) -> StepResult:
    """:func:`mbs_ext.accumulate` for what Lightning hands you: a ``LightningModule`` (under DDP its
    DistributedDataParallel wrapper is used, so gradients sync once and normalization is global) or
    the wrapper itself. ``loss_fn(model, micro_batch)`` receives the module to call (the wrapper under
    DDP). Not from inside ``training_step`` under DDP: Lightning runs it inside DDP's forward, where
    the micro-batches' gradients would silently not all-reduce; that is refused (use StreamingStrategy)."""
    if isinstance(model, LightningModule):
        trainer = getattr(model, "_trainer", None)
        wrapper = trainer.strategy.model if trainer is not None else None
        if wrapper is not None and wrapper is not model and find_ddp(wrapper) is not None:
            if model._current_fx_name == "training_step":
                raise RuntimeError(
                    "mbs_ext accumulate was called inside training_step, which Lightning runs inside DDP's forward: "
                    "the micro-batches' gradients would not all-reduce. Use "
                    "Trainer(strategy=mbs_ext.integrations.lightning.StreamingStrategy(...)) with an unchanged "
                    "training_step instead")
            model = wrapper
    return _accumulate(model, batch, loss_fn, **kwargs)
