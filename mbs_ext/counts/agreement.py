"""Whether the loss averages over the count the step weighs micro-batches by: checked once per signature.

The step is exact when ``normalize=`` names what the loss averages over; left out, or naming
another count (rows where the loss averages over tokens, unshifted labels where a causal LM
shifts them), it takes another step than the full batch's, and nothing in the numbers shows it.
A loss that averages over items obeys, on two halves ``A`` and ``B`` of a micro-batch,
``L(A+B) = (n_A L(A) + n_B L(B)) / (n_A + n_B)`` (a sum: ``L(A) + L(B)``), with ``n`` the items of each
half. So after the first step of a signature three forwards with no backward (the first micro-batch
and its halves, dropout off, in the parameters' own precision) tell whether the count given fits,
and which of the usual counts does; a loss that fits none may couple the rows. The caller warns
(:class:`CountWarning`), once per signature; ``StepOptions(check_count=False)`` turns it off.

The halves must differ in their losses for this to tell anything (``|L(A) - L(B)|`` at least 1e-3
of ``L``); where they are alike any count fits and nothing is said, which is also where a wrong
count matters least. Float32 rounding of the three forwards is about 1e-6 of ``L``, far under the
2% of ``|L(A) - L(B)|`` a count must miss by to be said to miss.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mbs_ext.counts.normalize import Rule
from mbs_ext.streaming import batch as _batch

SPREAD = 1e-3  # the halves' losses must differ by this much of the loss to tell counts apart
MISS = 0.02  # a count misses when its prediction is off by this much of the halves' difference


class CountWarning(UserWarning):
    """The loss does not average over the count the step weighs micro-batches by: the step is not
    the full batch's. Pass the count that fits as ``normalize=``; turn the check off with
    ``check_count=False``."""


def mismatch(model: nn.Module, loss_call: Callable[[nn.Module, Any], torch.Tensor], rule: Rule,
             micro_batch: Any, rows: int) -> str | None:
    """What is wrong with ``rule`` for this loss, from ``micro_batch`` (its ``rows`` first rows on the
    model's device) and its halves; None where it fits or the halves cannot tell. Reads three losses."""
    if rule.kind == "micro_batches" or rows < 2:
        return None
    half = rows // 2
    halves = [_batch.take(micro_batch, torch.arange(a, b)) for a, b in ((0, half), (half, rows))]
    losses = _losses(model, loss_call, [micro_batch, *halves])
    if losses is None:
        return None
    whole, la, lb = losses
    if abs(la - lb) < SPREAD * abs(whole):
        return None
    counts = _candidates(rule, halves, (half, rows - half))
    given = counts.pop("given")
    if given is None or _fits(given, whole, la, lb):
        return None
    fitting = [name for name, c in counts.items() if _fits(c, whole, la, lb)]
    named = "the rows" if rule.kind == "samples" else ("a sum" if rule.kind == "sum" else rule.source)
    fix = (f"the count that fits: normalize={fitting[0]}" if fitting else
           "none of the usual counts fits: the loss may couple the rows (mbs_ext.check_streamable tells, and "
           "mbs_ext.CachedLoss(encode, loss) streams such a loss exactly), or pass normalize=count(micro_batch) "
           "returning the items it averages over")
    return (f"the loss does not average over the count the step weighs micro-batches by ({named}): on two halves of "
            f"the first micro-batch L(A)={la:.6g}, L(B)={lb:.6g}, but L(A+B)={whole:.6g}, which that count does not "
            f"give; the step's gradient is not the full batch's. {fix[0].upper() + fix[1:]}")


def _losses(model: nn.Module, loss_call: Callable, parts: list[Any]) -> list[float] | None:
    """The loss of each part, dropout off, with no graph; None where one is not finite."""
    dropouts = [m for m in model.modules() if isinstance(m, nn.modules.dropout._DropoutNd) and m.training]
    for m in dropouts:
        m.training = False
    try:
        with torch.no_grad():
            values = [_value(loss_call(model, part)) for part in parts]
    except Exception:  # noqa: BLE001 - the step runs the same call next and reports it with its notes
        return None
    finally:
        for m in dropouts:
            m.training = True
    return values if all(v is not None and math.isfinite(v) for v in values) else None


def _value(loss: Any) -> float | None:
    """A loss as a host number; None for what the step's own check of the loss refuses."""
    if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point()) or loss.is_meta:
        return None
    return float(loss.detach().float())


def _candidates(rule: Rule, halves: list[Any], rows: tuple[int, int]) -> dict[str, tuple[float, float] | None]:
    """Each half's count by the rule given (``"given"``; None where it cannot be taken here) and by
    the usual counts, as ``normalize=`` would name them (``(1, 1)`` and a sum for ``"sum"``)."""
    out: dict[str, tuple[float, float] | None] = {}
    if rule.kind == "samples":
        out["given"] = (float(rows[0]), float(rows[1]))
    elif rule.kind == "sum":
        out["given"] = (math.inf, math.inf)
    else:
        try:
            out["given"] = tuple(float(rule.count(h)) for h in halves)  # type: ignore[assignment]
        except Exception:  # noqa: BLE001 - a count that fails on a half is checked by the step itself
            out["given"] = None
    if all(isinstance(h, dict) and isinstance(h.get("labels"), torch.Tensor) for h in halves):
        out['lambda mb: (mb["labels"][..., 1:] != -100).sum() (a causal LM\'s shifted labels)'] = tuple(
            float((h["labels"][..., 1:] != -100).sum()) for h in halves)
        out['lambda mb: (mb["labels"] != -100).sum()'] = tuple(float((h["labels"] != -100).sum()) for h in halves)
    out['"samples" (the rows: the default)'] = (float(rows[0]), float(rows[1]))
    out['"sum"'] = (math.inf, math.inf)
    return out


def _fits(counts: tuple[float, float], whole: float, la: float, lb: float) -> bool:
    """Whether ``whole`` is the halves' mean weighed by ``counts`` (``inf``: their sum)."""
    ca, cb = counts
    if math.isinf(ca):
        predicted = la + lb
    elif ca + cb <= 0:
        return False
    else:
        predicted = (ca * la + cb * lb) / (ca + cb)
    return abs(whole - predicted) <= MISS * abs(la - lb)
