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
from mbs_ext.ranks import Ranks, unwrap


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
        self.index = -1  # micro-batch in progress (>= num_mb: a zero-weight one); padded once all ran
        self.rows: tuple[int, int] | None = (0, 0)
        self.compute_s = 0.0
        # FSDP2: whether the forward of the micro-batch in progress began (FSDP's collectives with
        # it), and whether a failing rank ran the rest at zero weight so that the others' collectives
        # pair up (then its failure is shared after the pass: mbs_ext.gather.join).
        self.watch = sharded.forward_watch(unwrap(model)) if ranks.fsdp else None
        self.caught_up = False
        self._template: Any = None  # the latest micro-batch, for zero-weight ones

    def run(self, micro_batches: Iterator[Any]) -> None:
        """Consume ``micro_batches`` (a ring iterator: ``rows`` is each one's ``(start, stop)``)."""
        try:
            self._stream(micro_batches)
            for i in range(self.num_mb, self.padded):
                self.index = i
                self._pad(last=i == self.padded - 1)
            self.index = self.padded
        except Exception:
            if self.watch is not None:
                self.caught_up = self._catch_up()
            raise

    def _stream(self, micro_batches: Iterator[Any]) -> None:
        try:
            for i in range(self.num_mb):
                self.index = i
                if self.watch is not None:
                    self.watch.entered = False
                self.rows = None  # not known until the ring hands the micro-batch out
                mb = next(micro_batches, _END)
                if mb is _END:
                    raise RuntimeError(f"the ring yielded {i} micro-batches, expected {self.num_mb}")
                self._template, self.rows = mb, tuple(micro_batches.rows)
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

    def _catch_up(self) -> bool:
        """FSDP2, after a failure at micro-batch ``index``: if its forward had not begun, run it and
        every later one at zero weight (FSDP's collectives as on the other ranks). False where
        that cannot be done: the forward began, no micro-batch arrived yet, or a zero-weight one
        failed inside the model."""
        if self.watch.entered or self._template is None:
            return False
        try:
            for i in range(self.index, self.padded):
                self._pad(last=i == self.padded - 1, lenient=True)
        except Exception:
            return False
        return True

    def _pad(self, last: bool, lenient: bool = False) -> None:
        """A zero-weight micro-batch (one row of the latest real one) for FSDP's collectives.
        ``lenient`` (catching up after a failure): should the loss function fail once the model's
        forward has run, the backward goes through the model's outputs instead."""
        self._gradient_sync(last)
        self.watch.entered = False
        with sharded.padding(self.model), _loss.autocast(self.device, self.options.autocast_dtype):
            with sharded.outputs(unwrap(self.model), keep=lenient) as seen:
                try:
                    loss = self.loss_call(self.model, sharded.one_row(self._template))
                except Exception:
                    if not seen:
                        raise
                    loss = sharded.zero_through(seen[-1])
        self.sink.backward(loss.float() if loss.dtype in LOW_PRECISION else loss, 0.0, self.options.scaler)

    def _gradient_sync(self, last: bool) -> None:
        """FSDP2 accumulating unsharded gradients: reduce-scatter in the last backward only."""
        if self.ranks.fsdp and self.options.fsdp_accumulate == "unsharded":
            sharded.set_gradient_sync(self.ranks.fsdp, last)

    def _micro_batch(self, mb: Any, last: bool) -> None:
        norm, sink = self.normalizer, self.sink
        c = norm.count(mb, self.rows)
        # Unbuffered (one process), the last backward takes its exact weight: settle the
        # total now and rescale what came before. Buffered sinks, FSDP2 and weights exact from
        # the first micro-batch on settle after the pass (mbs_ext.gather).
        settle_now = last and not sink.buffered and not self.ranks.fsdp and not norm.exact_ahead
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
