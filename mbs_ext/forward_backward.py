"""The pass: forward, loss and backward of every micro-batch the ring hands out.

It is handed everything it uses (the loss call, the options, a :class:`Normalizer`,
a gradient sink, the ranks) and knows nothing else: no optimizer, no rollback, no
ring internals. It records how far it got (``index``, ``rows``) so that the step can
say where an error happened.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from mbs_ext import loss as _loss
from mbs_ext import sharded
from mbs_ext.grads import LOW_PRECISION, AutogradSink, BufferSink
from mbs_ext.normalize import Normalizer
from mbs_ext.options import StepOptions
from mbs_ext.ranks import Ranks


class ForwardBackward:
    """Streams ``num_micro_batches`` micro-batches through ``model``; gradients go to ``sink``."""

    def __init__(
        self,
        model: nn.Module,
        loss_call: Callable[[nn.Module, Any], torch.Tensor],
        options: StepOptions,
        normalizer: Normalizer,
        sink: AutogradSink | BufferSink,
        ranks: Ranks,
        device: torch.device,
        num_micro_batches: int,
        padded: int | None = None,
    ) -> None:
        self.model, self.loss_call, self.options = model, loss_call, options
        self.normalizer, self.sink, self.ranks, self.device = normalizer, sink, ranks, device
        self.num_mb = num_micro_batches
        # FSDP2: every rank runs as many micro-batches; the extra ones weigh 0 (mbs_ext.sharded).
        self.padded = num_micro_batches if padded is None else padded
        self.index = -1  # micro-batch in progress; num_mb once all have streamed
        self.rows = (0, 0)
        self.compute_s = 0.0

    def run(self, micro_batches: Iterator[Any]) -> None:
        """Consume ``micro_batches`` (a ring iterator: ``rows`` is each one's ``(start, stop)``)."""
        try:
            for i in range(self.num_mb):
                self.index = i
                mb = next(micro_batches, _END)
                if mb is _END:
                    raise RuntimeError(f"the ring yielded {i} micro-batches, expected {self.num_mb}")
                self.rows = tuple(micro_batches.rows)
                t0 = time.perf_counter()
                self._micro_batch(mb, last=i == self.padded - 1)
                self.compute_s += time.perf_counter() - t0
            self.index = self.num_mb
            if next(micro_batches, _END) is not _END:
                raise RuntimeError(f"the ring yielded more than the expected {self.num_mb} micro-batches")
        finally:
            close = getattr(micro_batches, "close", None)
            if close is not None and self.index < self.num_mb:
                close()
        for i in range(self.num_mb, self.padded):
            self._pad(mb, last=i == self.padded - 1)

    def _pad(self, mb: Any, last: bool) -> None:
        """A zero-weight micro-batch (one row of the last real one) for FSDP's collectives."""
        self._gradient_sync(last)
        with sharded.padding(self.model), _loss.autocast(self.device, self.options.autocast_dtype):
            loss = self.loss_call(self.model, sharded.one_row(mb))
        self.sink.backward(loss.float() if loss.dtype in LOW_PRECISION else loss, 0.0, self.options.scaler)

    def _gradient_sync(self, last: bool) -> None:
        """FSDP2 accumulating unsharded gradients: reduce-scatter in the last backward only."""
        if self.ranks.fsdp and self.options.fsdp_accumulate == "unsharded":
            sharded.set_gradient_sync(self.ranks.fsdp, last)

    def _micro_batch(self, mb: Any, last: bool) -> None:
        norm, sink = self.normalizer, self.sink
        c = norm.count(mb, self.rows)
        # Unbuffered (one process), the last backward takes its exact weight: settle the
        # total now and rescale what came before. Buffered sinks and FSDP2 settle after the pass.
        settle_now = last and not sink.buffered and not self.ranks.fsdp
        if not isinstance(c, torch.Tensor) and c == 0 and not self.ranks.fsdp:
            if settle_now:
                self._settle()
            return  # zero items: nothing to learn, skip the forward (not under FSDP: collectives)
        self._gradient_sync(last)
        with self.ranks.no_sync():
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
            sink.backward(loss, weight, self.options.scaler)

    def _settle(self) -> None:
        self.normalizer.settle()
        if self.index > 0:
            self.sink.rescale(self.normalizer.rescale_factor())


_END = object()
