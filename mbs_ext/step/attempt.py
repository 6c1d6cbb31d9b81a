"""One attempt at a step at one micro-batch size, and how far it got.

An attempt splits the rows, guards everything the step may change
(:mod:`~mbs_ext.model.rollback`), then calls the world's hooks in order - buffers and sink,
the normalizer with its count source, the agreement on micro-batches - streams the
micro-batches through the pass (:mod:`~mbs_ext.step.forward_backward`), settles in the
world's collective and finishes (:mod:`~mbs_ext.step.finish`). On any error it undoes
everything, notes where it failed, and shares the failure with the other ranks through
the world before out-of-memory back-off (:mod:`~mbs_ext.memory.backoff`) decides to redo it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mbs_ext.counts.noise import Noise, NoiseSample, NoiseScale
from mbs_ext.counts.normalize import Rule, for_step
from mbs_ext.messages import add_note
from mbs_ext.model.batchnorm import warn_split_statistics
from mbs_ext.model.options import StepOptions
from mbs_ext.model.rollback import StepGuard
from mbs_ext.step.finish import Finished, StepResult, finish, finish_gradients
from mbs_ext.step.forward_backward import ForwardBackward
from mbs_ext.streaming.batch import BatchInfo
from mbs_ext.streaming.ring import StreamRing
from mbs_ext.streaming.tokens import Rows, Tokens, split
from mbs_ext.world import PeerFailed, Phase, World

_KEPT = ("Look for what is kept from one micro-batch to the next: outputs or losses kept without .detach() (a "
         "list filled by the loss function, a hook or a logger), or tensors cached on the model.")


@dataclass
class Call:
    """One ``step`` call's checked inputs."""

    params: list[nn.Parameter]
    batch: Any
    info: BatchInfo
    device: torch.device
    world: World
    rule: Rule
    loss_call: Callable[[nn.Module, Any], torch.Tensor]
    batchnorms: list = field(default_factory=list)
    normalizing: list = field(default_factory=list)  # BatchNorms using batch statistics: warned of when split
    found: Any = None  # the model's walk (mbs_ext.model.members.Members): its buffers, for the rollback snapshot


def noise_of(read: tuple[float, ...], averages: NoiseScale | None) -> Noise:
    """The step's :func:`noise_values` as read, its loss scale squared out, folded into ``averages``
    (a fresh one for a single call of ``step`` or ``accumulate``)."""
    m, items, micro_sq, batch_sq, scale = read
    sample = NoiseSample(int(m), items, micro_sq / (scale * scale), batch_sq / (scale * scale))
    return (averages or NoiseScale()).update(sample)


class Attempt:
    """How far the latest attempt got: what back-off, error notes and a failing rank need to know."""

    def __init__(self, world: World, noise: NoiseScale | None = None) -> None:
        self.world = world
        self.noise = noise  # the streamer's moving averages of the gradient noise
        self.cut: Rows | Tokens | None = None  # how this attempt's rows are split
        self.fb: ForwardBackward | None = None
        self.guard: StepGuard | None = None
        self.phase = Phase.CHECKING
        self.shared = False  # this attempt's failure was shared with the other ranks
        self.oom_together = False  # ... and every rank that failed ran out of memory while streaming
        self.runs = 0  # attempts so far in this step (more than one: redone after out-of-memory back-off)

    def run(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, options: StepOptions,
            ring: StreamRing, call: Call, m: int) -> StepResult:
        """Stream every micro-batch at size ``m`` and finish (step where ``optimizer`` is given);
        on any error undo everything first."""
        self.runs += 1
        self.cut = cut = split(call.batch, call.info, options, m)  # by rows or tokens: checked before any change
        sizes = cut.sizes
        warn_split_statistics(model, call.normalizing, len(sizes))
        device, world = call.device, call.world
        guard = StepGuard(call.found, call.params, optimizer, options.scaler, device, call.batchnorms)
        self.fb, self.guard, self.phase, self.shared, self.oom_together = None, guard, Phase.CHECKING, False, False
        sink = None
        try:
            guard.begin()  # old gradients go before new buffers are allocated
            self.phase = Phase.SYNCING_BUFFERS
            sink = world.start(call.params, device, options.accumulate_dtype)
            normalizer = for_step(call.rule, call.batch, cut.info, sizes, device, ahead=world.counts_ahead,
                                  alone=world.alone)
            normalizer.describe_rows = cut.describe
            self.phase = Phase.AGREEING
            padded = world.agree(normalizer, sizes, device)
            self.phase = Phase.STREAMING
            self.fb = ForwardBackward(model, call.loss_call, options, normalizer, sink, world, device, len(sizes),
                                      padded, call.batchnorms)
            with world.streaming():
                self.fb.run(cut.stream(ring, call.batch, device))
            self.phase = Phase.COLLECTING
            record = world.collect(normalizer, sink)
            t_finish = time.perf_counter()
            if optimizer is not None:
                done = finish(call.params, sink, normalizer, options, optimizer, guard, device, record, world.noise)
            else:
                done = finish_gradients(sink, normalizer, options, guard, device, record, world.noise)
        except BaseException as exc:
            guard.rollback(clear_grads=True)
            if sink is not None:
                sink.release()
            if not isinstance(exc, PeerFailed):
                add_note(exc, self.where(m, exc))
            if isinstance(exc, Exception):  # before back-off: every rank must decide alike
                self.share_failure(exc, call.params, device, options.accumulate_dtype)
            raise
        return self.result(call, options, ring, done, t_finish)

    def result(self, call: Call, options: StepOptions, ring: StreamRing, done: Finished,
               t_finish: float) -> StepResult:
        """What this attempt did, with the seconds it spent staging and waiting (the ring's
        totals), computing and finishing."""
        sizes = self.cut.sizes
        stats = self.cut.stats(ring)  # totals of this step's stream
        timings = {"stage_s": float(stats.get("stage_s", 0.0)), "wait_s": float(stats.get("wait_s", 0.0)),
                   "compute_s": self.fb.compute_s, "step_s": time.perf_counter() - t_finish}
        return StepResult(
            loss=done.loss, num_micro_batches=len(sizes), micro_batch_size=max(sizes), num_samples=call.info.rows,
            skipped=done.skipped, grad_norm=done.grad_norm, timings=timings,
            micro_batch_tokens=options.micro_batch_tokens,
            noise=noise_of(done.extra, self.noise) if done.extra else None,
        )

    def share_failure(self, exc: Exception, params: list[nn.Parameter], device: torch.device,
                      accumulate_dtype: torch.dtype | None) -> None:
        """A failure before the step's collective, told to the other ranks once (the world's
        :meth:`~mbs_ext.world.World.share_failure`). Not for PeerFailed: the others know already."""
        if isinstance(exc, PeerFailed):
            self.oom_together = exc.out_of_memory
            return
        if self.phase >= Phase.COLLECTING or self.shared:
            return
        self.shared = True
        caught_up = self.fb is not None and self.fb.caught_up
        self.oom_together = self.world.share_failure(exc, self.micro_batch, self.phase, caught_up, params, device,
                                                     accumulate_dtype)

    def out_of_memory(self, exc: BaseException) -> bool:
        """Whether a smaller micro-batch may cure ``exc`` (across ranks: as the shared record says)."""
        return self.world.out_of_memory(exc, self.oom_together)

    @property
    def micro_batch(self) -> int:
        """The micro-batch in progress (-1 before the first)."""
        return self.fb.index if self.fb is not None and self.fb.index < self.fb.padded else -1

    def retryable(self, exc: BaseException) -> bool:
        """Back off only while nothing irreversible happened, where the world allows it."""
        if self.guard is None or self.guard.stepping:
            return False
        streaming = self.fb is not None and 0 <= self.fb.index < self.fb.num_mb
        grew = streaming and self._grew(exc)
        return self.world.backs_off(streaming, grew)

    def _grew(self, exc: BaseException) -> bool:
        """Whether running out of memory at this micro-batch is growth, not size, and say so on ``exc``.

        Micro-batches of a row split never grow along the step (each is at most the first one's
        size), so an out-of-memory error after some of them fitted is memory the step kept from
        one micro-batch to the next - a smaller micro-batch only makes more of them, and back-off
        would shrink it again and again. It is growth where the device counts its allocated
        memory and that rose from micro-batch 1 on, or where this attempt is already a redo after
        back-off. A first failure with no such count (the CPU) may be the data's (a micro-batch
        whose rows cost more): back-off redoes it once.
        """
        fb = self.fb
        if fb.index < 1 or not isinstance(self.cut, Rows):
            return False
        at = fb.growth()
        mib = 1 << 20
        if at is not None and at[1] - at[0] > mib:
            per = (at[1] - at[0]) / (fb.index - 1)
            add_note(exc, f"mbs_ext.step: not redone at a smaller micro-batch size: {fb.index} micro-batches of this "
                          f"size fitted before, and the device memory allocated grew while they ran, from "
                          f"{at[0] / mib:.1f} MiB at the start of micro-batch 1 to {at[1] / mib:.1f} MiB at "
                          f"micro-batch {fb.index} ({per / mib:.2f} MiB per micro-batch). {_KEPT}")
            return True
        if self.runs > 1:
            add_note(exc, f"mbs_ext.step: not redone again: this was already a redo at a smaller micro-batch size "
                          f"after running out of memory, and it ran out after {fb.index} micro-batches of its size "
                          f"fitted: memory grows from micro-batch to micro-batch, which no micro-batch size cures. "
                          f"{_KEPT}")
            return True
        return False

    def where(self, m: int, exc: BaseException) -> str:
        fb = self.fb
        if fb is None or fb.index < 0:
            text = "mbs_ext.step: failed before the first micro-batch"
        elif fb.index >= fb.padded:
            text = f"mbs_ext.step: failed after all {fb.num_mb} micro-batches, while finishing the step"
        elif fb.index >= fb.num_mb:
            text = (f"mbs_ext.step: failed at micro-batch {fb.index}, one of zero weight that keeps FSDP's "
                    f"collectives paired with ranks that have more")
        elif fb.rows is None:
            text = f"mbs_ext.step: failed at micro-batch {fb.index} of {fb.num_mb}, while the ring made it"
        else:
            rows = self.cut.describe(fb.rows[0], fb.rows[1])
            text = f"mbs_ext.step: failed at micro-batch {fb.index} of {fb.num_mb} ({rows})"
        return text + self.world.failure_note(exc, m)
