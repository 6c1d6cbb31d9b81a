"""What out-of-memory back-off shrinks: the rows of a micro-batch, or under a token split its token budget.

Cut by rows, a micro-batch's memory follows its rows, and back-off bisects ``micro_batch_size``
with probes of that many rows. Under ``micro_batch_tokens=T`` memory follows token positions
(rows x trimmed width) and the rows of one micro-batch vary with their lengths: back-off
bisects ``T`` instead, and each probe runs the micro-batch of the most token positions that
the plan at that budget makes, trimmed as the step would stream it. A budget shorter than
the longest row fits nothing. Either size is remembered under its own key of the step cache.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

from torch import nn

from mbs_ext.memory import probe
from mbs_ext.model.options import StepOptions
from mbs_ext.streaming.tokens import Tokens


class Axis(NamedTuple):
    """One size for :func:`~mbs_ext.memory.backoff.with_backoff`: the option it names, where it
    starts, the step at a size, the probe at a size, what keeps the size found for later steps,
    and what frees the device's cached memory before the probes."""

    unit: str
    start: int
    attempt: Callable[[int], Any]
    fits_at: Callable[[int], bool]
    remember: Callable[[int], None]
    free: Callable[[], None]


def axis(probed: nn.Module, call: Any, options: StepOptions, m: int, key: tuple, learned: dict[tuple, int],
         run: Callable[[StepOptions, int], Any]) -> Axis:
    """The axis of this step (``call``: its checked inputs, ``m``: its rows per micro-batch, or
    their cap under tokens, ``key``: under which ``learned`` keeps the sizes back-off found
    (``m`` is capped by them already); ``run(options, m)``: the step itself)."""
    def free() -> None:
        probe.release_cached_memory(call.device)

    if options.micro_batch_tokens is None:
        return Axis("micro_batch_size", m, lambda size: run(options, size),
                    lambda size: probe.fits(probed, call.batch, call.info.indices, size, call.device,
                                            call.loss_call, options.autocast_dtype),
                    lambda size: learned.__setitem__(key, size), free)
    token_key = ("micro_batch_tokens", *key)

    def at(tokens: int) -> StepOptions:
        return dataclasses.replace(options, micro_batch_tokens=tokens)

    def fits_at(tokens: int) -> bool:
        try:
            cut = Tokens(call.batch, call.info, at(tokens), m)
        except ValueError:  # a row longer than the budget (the batch passed every other check)
            return False
        micro_batch, rows = cut.heaviest(call.batch, call.device)
        return probe.fits(probed, micro_batch, None, rows, call.device, call.loss_call, options.autocast_dtype)

    start = min(options.micro_batch_tokens, learned.get(token_key, options.micro_batch_tokens))
    return Axis("micro_batch_tokens", start, lambda tokens: run(at(tokens), m), fits_at,
                lambda tokens: learned.__setitem__(token_key, tokens), free)
