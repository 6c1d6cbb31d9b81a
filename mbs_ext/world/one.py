"""One process: the world every step runs in when nothing is shared with other ranks.

:class:`World` defines every hook the step, the pass and the normalizer call; a
subclass changes what differs across ranks (:class:`~mbs_ext.world.replicas.Replicas`
for DDP or ``process_group=``, :class:`~mbs_ext.world.shards.Shards` for FSDP2). In
one process the hooks do the least: no buffer sync, no agreement, no collective, and a
failure is this process's own.

The hooks, in the order a step calls them:

* before the pass: :meth:`pair` (whether BatchNorm layers take statistics across ranks),
  :meth:`check_options`, :meth:`buffer_dtype`, :meth:`start` (buffer
  sync, then the gradient sink), :attr:`counts_ahead` and :attr:`alone` (what the one place
  that chooses how to count, ``counts.normalize.for_step``, needs to know of the world),
  :meth:`agree` (how many micro-batches run);
* in the pass: :meth:`streaming`, :meth:`no_sync`, :meth:`micro_batch`, :meth:`weigh`,
  :attr:`runs_every_micro_batch`, :meth:`watch`, :meth:`zero_weight`, :meth:`catch_up`;
* after it: :meth:`collect` (the step's one collective, then the gradient sums);
* on failure and back-off: :meth:`share_failure`, :meth:`out_of_memory`,
  :meth:`backs_off`, :meth:`backoff`, :meth:`failure_note`.
"""

from __future__ import annotations

import contextlib
import enum
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from mbs_ext.counts.normalize import Normalizer
from mbs_ext.memory.backoff import is_out_of_memory
from mbs_ext.model.grads import AutogradSink, BufferPool, BufferSink, accumulation_dtype, make_sink
from mbs_ext.model.options import StepOptions
from mbs_ext.world.record import Record

if TYPE_CHECKING:  # pairing.py builds on this module's worlds' hooks: named for types only
    from mbs_ext.world.pairing import Pairing

Sink = AutogradSink | BufferSink


class Pass(Protocol):
    """What a world reads of the pass (:class:`~mbs_ext.step.forward_backward.ForwardBackward`) to run
    zero-weight micro-batches in it."""

    model: nn.Module
    loss_call: Callable[[nn.Module, Any], torch.Tensor]
    options: StepOptions
    sink: Sink
    device: torch.device
    watch: Any
    template: Any  # the latest micro-batch
    index: int  # the micro-batch in progress
    padded: int  # how many every rank runs

_NO_CONTEXT = contextlib.nullcontext()  # reusable: entered once per micro-batch
_ALONE = Record()  # one process's record: nothing shared, nothing to read (immutable, so made once)


class Phase(enum.IntEnum):
    """How far an attempt at a step got. Each phase is entered *before* its work begins, so a
    failure inside a collective is known to have been inside it (and is not joined twice)."""

    CHECKING = 0  # inputs checked, plans made: nothing shared with other ranks yet
    SYNCING_BUFFERS = 1  # the buffer broadcast (DDP) and the gradient sink
    AGREEING = 2  # the ranks agree on their micro-batches (FSDP2)
    STREAMING = 3  # the micro-batches
    COLLECTING = 4  # the step's one collective: from here on a failure is each rank's own


class World:
    """One process (the base of every world: each hook does what one process needs)."""

    group: Any = None
    size = 1
    rank = 0
    # Whether every micro-batch must run its forward and backward, even one that counts no
    # items (FSDP2: collectives run inside them).
    runs_every_micro_batch = False
    # The across-rank BatchNorm layers of the step and their turns (mbs_ext.world.pairing); one
    # process has none: such layers normalize its rows, with no collective.
    pairing: Pairing | None = None

    # ---- before the pass
    def pair(self, modules: list[nn.Module]) -> None:
        """Before anything of a step can fail: whether its micro-batches must pair up across ranks
        (BatchNorm layers whose statistics span the ranks; ``modules``: the model's)."""

    # Whether this step measures its gradient noise (``noise_scale``): it then accumulates in
    # buffers, whose op sums each micro-batch's squared gradient norm on the way in. Set by
    # check_options, which every step calls before anything else of the world's.
    noise = False

    def check_options(self, options: StepOptions, params: list[nn.Parameter]) -> None:
        """What this world refuses, before anything changes."""
        self.noise = options.noise_scale

    def buffer_dtype(self, requested: torch.dtype | None, params: list[nn.Parameter]) -> torch.dtype | None:
        """dtype of the step's accumulation buffers (None: autograd accumulates in ``.grad``)."""
        return accumulation_dtype(requested, params, buffered=self.noise)

    # The accumulation buffers of the last step, which the next one reuses (made by the first step
    # that accumulates in buffers: a world's steps share them, one at a time).
    pool: BufferPool | None = None
    # Whether the noise scale may take its squares inside the backward (mbs_ext.ops.noise_tap):
    # not after a step whose gradients came in parts within a micro-batch (collect says so).
    tap_ok = True

    def start(self, params: list[nn.Parameter], device: torch.device, requested: torch.dtype | None) -> Sink:
        """Buffers as every rank has them, then the sink the micro-batches' gradients go to."""
        dtype = self.buffer_dtype(requested, params)
        if dtype is not None and self.pool is None:
            self.pool = BufferPool()
        return make_sink(params, device, dtype, noise=self.noise, pool=self.pool, alone=self.alone and self.tap_ok)

    # How the step counts (mbs_ext.counts.normalize.for_step): no other rank weighs this one's
    # counts; :meth:`agree` needs no total before the first micro-batch.
    alone = True
    counts_ahead = False

    def agree(self, normalizer: Normalizer, sizes: list[int], device: torch.device) -> int:
        """How many micro-batches this rank runs (more than its own ``sizes`` where others have more)."""
        return len(sizes)

    # ---- the pass
    def streaming(self) -> contextlib.AbstractContextManager:
        """Around the whole pass."""
        return _NO_CONTEXT

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Around each micro-batch's forward and backward."""
        return _NO_CONTEXT

    def micro_batch(self, index: int, last: bool, options: StepOptions) -> None:
        """Before the forward of this rank's micro-batch ``index`` (``last``: the step's last one on
        this rank). The pass's one hook before each forward it runs (a micro-batch that counts no
        items is skipped before it, where the world allows that)."""
        if self.pairing is not None:
            self.pairing.enter(index)

    def weigh(self, weight: Any) -> None:
        """Before a micro-batch's backward: the ``weight`` the sink gives it."""
        if self.pairing is not None:
            self.pairing.weigh(weight)

    def watch(self, model: nn.Module) -> Any:
        """Something that tells whether a failing micro-batch's forward began (None: not needed)."""
        return None

    def zero_weight(self, pass_: Pass, last: bool, lenient: bool = False, index: int | None = None) -> None:
        """A micro-batch that weighs nothing, run only to pair collectives with other ranks
        (``index``: which one, where not ``pass_.index``)."""
        raise RuntimeError("zero-weight micro-batches run only where ranks must pair their collectives")

    def catch_up(self, pass_: Pass) -> bool:
        """After a failure mid-pass: run what the other ranks still wait for; whether that worked."""
        return False

    # ---- after the pass
    def collect(self, normalizer: Normalizer, sink: Sink) -> Record:
        """The totals settled, the gradient sums rescaled (and across ranks summed) into ``.grad``."""
        if not normalizer.settled:
            normalizer.settle()
        if sink.buffered:
            sink.finish(normalizer.rescale_factor())  # alone: its own gradients are all there are
            if sink.bufs.split:
                self.tap_ok = False
                warnings.warn("mbs_ext: noise_scale could not measure this step (its noise is NaN): a parameter's "
                              "gradient came in parts within one micro-batch (reentrant checkpointing, "
                              "use_reentrant=True, or a second backward), and the squares of the parts are not "
                              "the square of their sum. The gradients are exact; from the next step on each "
                              "micro-batch's gradient is read after its backward (exact, a little slower)",
                              RuntimeWarning, stacklevel=2)
        return _ALONE

    # ---- failures and back-off
    def share_failure(self, exc: Exception, micro_batch: int, phase: Phase, caught_up: bool,
                      params: list[nn.Parameter], device: torch.device, requested: torch.dtype | None) -> bool:
        """A failure at ``micro_batch`` (-1: before the first) before the step's collective, told to
        the other ranks so that every rank raises; returns whether every rank that failed ran out
        of memory while streaming."""
        return False

    def out_of_memory(self, exc: BaseException, together: bool) -> bool:
        """Whether a smaller micro-batch may cure ``exc`` (``together``: what the ranks shared)."""
        return is_out_of_memory(exc)

    def backs_off(self, streaming: bool, grew: bool = False) -> bool:
        """Whether out-of-memory back-off may redo the step: only where a smaller micro-batch helps,
        not where what the step holds ``grew`` from micro-batch to micro-batch (:mod:`mbs_ext.step.attempt`)."""
        return streaming and not grew

    def backoff(self, model: nn.Module, device: torch.device) -> tuple[nn.Module, Callable | None]:
        """The module probes run on, and the agreement on one size across ranks (None: alone)."""
        return model, None

    def failure_note(self, exc: BaseException, micro_batch_size: int) -> str:
        """What to add to the message of a failed step."""
        return ""
