"""What a step (or a planner probe) may change before the optimizer steps, taken and restored.

A failed step, an out-of-memory retry and a memory probe must leave no trace: module
buffers (BatchNorm running statistics, counters) and the RNG streams that dropout
draws from are copied here first and put back afterwards. Restoring the RNG also
makes a redone step draw exactly the random numbers the first attempt drew.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from mbs_ext.model.batchnorm_rows import commit_all
from mbs_ext.model.members import Members


class Snapshot:
    """Copies of a model's distinct buffers and the ``(module, name, tensor)`` slots that hold
    them (both from the step's walk, :func:`mbs_ext.model.members.members`), and of the CPU and device
    RNG states."""

    def __init__(self, found: Members, device: torch.device) -> None:
        self.slots = found.slots
        live = [b.detach() for b in found.buffers]
        saved = [torch.empty_like(b) for b in live]
        if saved:
            # One multi-tensor launch where the device has one: a ResNet's 159 BatchNorm buffers
            # were 159 copies launched every step.
            torch._foreach_copy_(saved, live)
        self.buffers: list[tuple[torch.Tensor, torch.Tensor]] = list(zip(found.buffers, saved))
        self.device = device
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    @torch.no_grad()
    def restore_buffers(self) -> None:
        """The saved values into the original tensors, and those tensors back into any slot a
        forward pointed at a new one (``self.seen = self.seen + n`` replaces the buffer)."""
        for live, saved in self.buffers:
            live.copy_(saved)
        for module, name, b in self.slots:
            if module._buffers.get(name, b) is not b:
                module._buffers[name] = b

    def restore_rng(self) -> None:
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state(self.cuda_rng, self.device)

    def restore(self) -> None:
        self.restore_buffers()
        self.restore_rng()


class ScalerSnapshot:
    """A GradScaler's state, copied without a host sync where possible.

    ``GradScaler.state_dict()`` reads the scale and growth tracker with ``.item()``: two
    host syncs per step just to be able to roll back. Once the scaler has created its
    device tensors, cloning them on the device keeps the same information.
    """

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self.scaler = scaler
        scale = getattr(scaler, "_scale", None)
        tracker = getattr(scaler, "_growth_tracker", None)
        if isinstance(scale, torch.Tensor) and isinstance(tracker, torch.Tensor):
            self.tensors: tuple[torch.Tensor, torch.Tensor] | None = (scale.clone(), tracker.clone())
            self.state: dict | None = None
        else:
            self.tensors, self.state = None, scaler.state_dict()

    @torch.no_grad()
    def restore(self) -> None:
        scaler = self.scaler
        if self.tensors is not None:
            # update() may have replaced the tensors or left them in place: set both ways.
            scaler._scale = self.tensors[0].clone()
            scaler._growth_tracker = self.tensors[1].clone()
        else:
            scaler.load_state_dict(self.state)


class StepGuard:
    """Everything a step changes before the optimizer steps, and the way back.

    Taken before the first micro-batch: module buffers, RNG streams, the GradScaler's
    state; the deferred BatchNorm layers keep their pending statistics until
    :meth:`commit_statistics`. ``unscaled``/``updated`` record what the finish did to
    the scaler, so that a rollback undoes exactly that.
    """

    def __init__(self, found: Members, params: list[nn.Parameter],
                 optimizer: torch.optim.Optimizer | None, scaler: torch.amp.GradScaler | None,
                 device: torch.device, batchnorms: list) -> None:
        self.params, self.optimizer, self.scaler, self.batchnorms = params, optimizer, scaler, batchnorms
        # Without an optimizer (mbs_ext.accumulate) the caller owns .grad: a failure puts back
        # the gradients it had, rather than clearing them.
        self.old_grads = [p.grad for p in params] if optimizer is None else None
        self.snapshot = Snapshot(found, device)
        self.scaler_state = ScalerSnapshot(scaler) if scaler is not None else None
        self.unscaled = False
        self.updated = False
        self.stepping = False  # the optimizer step began: nothing can be undone after this

    def begin(self) -> None:
        for layer in self.batchnorms:
            layer.begin_mini_batch()
        self.clear_grads()

    def clear_grads(self) -> None:
        for p in self.params:
            p.grad = None
        if self.optimizer is not None:  # what zero_grad(set_to_none=True) does, without its profiler scope
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None

    def commit_statistics(self) -> None:
        commit_all(self.batchnorms)

    @torch.no_grad()
    def rollback(self, clear_grads: bool = True, restore_scaler: bool = True, restore_rng: bool = True) -> None:
        """Undo every change made before the optimizer step; the RNG too when the step may be
        redone or retried (a redo draws the same numbers), not for a skipped step, after which
        training goes on as after any step (the next one draws new random numbers)."""
        for layer in self.batchnorms:
            layer.discard()
        self.snapshot.restore_buffers()
        if restore_rng:
            self.snapshot.restore_rng()
        if clear_grads:
            self.clear_grads()
            if self.old_grads is not None:
                for p, g in zip(self.params, self.old_grads):
                    p.grad = g
        if restore_scaler and self.scaler_state is not None:
            if self.unscaled and not self.updated:
                with contextlib.suppress(Exception):
                    self.scaler.update()  # drops the per-optimizer unscale record
            self.scaler_state.restore()
