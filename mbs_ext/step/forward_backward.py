"""The pass: forward, loss and backward of every micro-batch the ring hands out.

It is handed everything it uses (the loss call, the options, a :class:`Normalizer`,
a gradient sink, the world) and knows nothing else: no optimizer, no rollback, no
ring internals, no distributed mode (what differs across ranks is a hook of the world:
:mod:`mbs_ext.world`). It records how far it got (``index``, ``rows``) so that the step
can say where an error happened.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from mbs_ext.counts import loss as _loss
from mbs_ext.counts.normalize import Normalizer
from mbs_ext.model import batchnorm_rows
from mbs_ext.model.grads import LOW_PRECISION, AutogradSink, BufferSink
from mbs_ext.model.options import StepOptions
from mbs_ext.world import World


class ForwardBackward:
    """Streams ``num_micro_batches`` micro-batches through ``model``; gradients go to ``sink``.
    ``padded``: how many the world has every rank run (the extra ones weigh 0). ``batchnorms``: the
    deferred BatchNorm layers, whose rows are compacted every few micro-batches so that they stay
    bounded (:func:`mbs_ext.model.batchnorm_rows.compact`)."""

    def __init__(
        self,
        model: nn.Module,
        loss_call: Callable[[nn.Module, Any], torch.Tensor],
        options: StepOptions,
        normalizer: Normalizer,
        sink: AutogradSink | BufferSink,
        world: World,
        device: torch.device,
        num_micro_batches: int,
        padded: int,
        batchnorms: list | tuple = (),
    ) -> None:
        self.model, self.loss_call, self.options = model, loss_call, options
        self.normalizer, self.sink, self.world, self.device = normalizer, sink, world, device
        self.num_mb, self.padded = num_micro_batches, padded
        self.batchnorms = batchnorms
        self.index = -1  # micro-batch in progress (>= num_mb: a zero-weight one); padded once all ran
        self.rows: tuple[int, int] | None = (0, 0)
        self.compute_s = 0.0
        # Whether the forward of the micro-batch in progress began (where the world needs to
        # know), and whether after a failure the world ran what the other ranks wait for.
        self.watch = world.watch(model)
        self.caught_up = False
        self.template: Any = None  # the latest micro-batch, for zero-weight ones
        # Device memory allocated at the start of micro-batch 1 and of the latest one, where the
        # device counts it (CUDA): what grew during the step, if it runs out of memory midway.
        self.allocated: Callable[[torch.device], int] | None = (
            torch.cuda.memory_allocated if device.type == "cuda" else None)
        self.allocated_at: tuple[int, int] | None = None

    def run(self, micro_batches: Iterator[Any]) -> None:
        """Consume ``micro_batches`` (a ring iterator: ``rows`` is each one's ``(start, stop)``)."""
        try:
            self._stream(micro_batches)
            for i in range(self.num_mb, self.padded):
                self.index = i
                self.world.zero_weight(self, last=i == self.padded - 1)
            self.index = self.padded
        except Exception:
            self.caught_up = self.world.catch_up(self)
            raise

    def _stream(self, micro_batches: Iterator[Any]) -> None:
        try:
            for i in range(self.num_mb):
                self.index = i
                if self.watch is not None:
                    self.watch.reset()
                self.rows = None  # not known until the ring hands the micro-batch out
                mb = next(micro_batches, _END)
                if mb is _END:
                    raise RuntimeError(f"the ring yielded {i} micro-batches, expected {self.num_mb}")
                self.template, self.rows = mb, tuple(micro_batches.rows)
                t0 = time.perf_counter()
                if self.allocated is not None and i:
                    now = self.allocated(self.device)
                    self.allocated_at = (now if i == 1 else self.allocated_at[0], now)
                if self.batchnorms and i and i % batchnorm_rows.FOLD_EVERY == 0:  # no graph holds them now
                    batchnorm_rows.compact(self.batchnorms)
                self._micro_batch(mb, last=i == self.padded - 1)
                self.compute_s += time.perf_counter() - t0
            self.index = self.num_mb
            if next(micro_batches, _END) is not _END:
                raise RuntimeError(f"the ring yielded more than the expected {self.num_mb} micro-batches")
        finally:
            close = getattr(micro_batches, "close", None)
            if close is not None and self.index < self.num_mb:
                close()

    def growth(self) -> tuple[int, int] | None:
        """Device memory allocated at the start of micro-batch 1 and of the one in progress (at
        least micro-batch 2), where the device counts it; None otherwise."""
        if self.allocated_at is None or self.index < 2:
            return None
        return self.allocated_at

    def _micro_batch(self, mb: Any, last: bool) -> None:
        norm, sink = self.normalizer, self.sink
        c = norm.count(mb, self.rows)
        # Unbuffered, with provisional weights, the last backward takes its exact weight:
        # settle the total now and rescale what came before. Otherwise the world settles
        # after the pass (mbs_ext.world: collect).
        settle_now = last and not sink.buffered and not norm.exact
        if not isinstance(c, torch.Tensor) and c == 0 and not self.world.runs_every_micro_batch:
            if settle_now:
                self._settle()
            return  # zero items: nothing to learn, skip the forward
        self.world.micro_batch(self.index, last, self.options)
        with self.world.no_sync():
            with _loss.autocast(self.device, self.options.autocast_dtype):
                loss = self.loss_call(self.model, mb)
            _loss.check_loss(loss, self.device)
            if loss.dtype in LOW_PRECISION:
                loss = loss.float()
            norm.add_loss(loss.detach(), c)
            if settle_now:
                self._settle()
                weight = norm.final_weight(c)
            else:
                weight = norm.weight(c)
            self.world.weigh(weight)
            sink.backward(loss, weight, self.options.scaler)

    def _settle(self) -> None:
        self.normalizer.settle()
        if self.index > 0:
            self.sink.rescale(self.normalizer.rescale_factor())


_END = object()
