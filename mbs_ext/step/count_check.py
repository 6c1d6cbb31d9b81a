"""The step's one check that the loss averages over the count it weighs by, once per input signature.

What is checked and how: :mod:`mbs_ext.counts.agreement`. Here: when it runs - the first step of
a signature that streams more than one micro-batch (one micro-batch weighs 1 whatever its count),
with a loss given as a callable and no ``normalize=`` (the step then guesses a mean over rows), or
with a ``normalize=`` given (a count one token a row off, the unshifted labels of a causal LM, is
the most common way to be a little off; a count the loss matches to its rounding passes) - not an
``nn`` loss with no ``normalize=``, whose count is read from it, exact by construction -
in one process or across replicas (under FSDP2 a forward is a collective only some ranks would
run), with no BatchNorm normalizing by batch statistics (its halves would be normalized apart:
:class:`~mbs_ext.model.batchnorm.BatchNormWarning` says that already) and parameters of at least
float32, not under a bf16/fp16 autocast (its rounding would hide what the halves tell); after the
step, at the size that streamed (no-grad forwards of one micro-batch need less than the step did,
and run before it they left glibc's heap a step's planned peak 1.3-1.6% over its budget,
``tests/test_planner_os.py``) - and that it leaves no trace (RNG, buffers and ``.grad`` put back by
the probes' own guard).
"""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn

from mbs_ext.counts import agreement
from mbs_ext.memory.probe import probe_batch, probing
from mbs_ext.messages import caller_stacklevel
from mbs_ext.model.grads import LOW_PRECISION


def check_once(checked: set, key: tuple, model: nn.Module, call: Any, options: Any, size: int,
               loss_fn: Any) -> None:
    """Warn (:class:`~mbs_ext.counts.agreement.CountWarning`) where the count does not fit; ``checked``
    holds the signatures already checked (the streamer's cache)."""
    if not options.check_count or key in checked:
        return
    checked.add(key)
    if (size >= call.info.rows or (options.normalize is None and isinstance(loss_fn, nn.modules.loss._Loss))
            or call.normalizing or call.world.runs_every_micro_batch or options.autocast_dtype in LOW_PRECISION
            or any(p.dtype in LOW_PRECISION for p in call.params)):
        return
    with probing(model, call.device):
        first = probe_batch(call.batch, size, call.info.indices, call.device)
        said = agreement.mismatch(model, call.loss_call, call.rule, first, size)
    if said:
        warnings.warn(f"mbs_ext: {said}. Said once per input signature; check_count=False turns this check off",
                      agreement.CountWarning, stacklevel=caller_stacklevel())
