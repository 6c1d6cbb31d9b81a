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
count matters least. A count misses where its prediction is off by 2% of ``|L(A) - L(B)|``, or,
above the forwards' rounding (1e-5 of ``L`` in float32, 1e-3 under TF32, 1e-12 in float64), where
one of the usual counts predicts ``L(A+B)`` ten times closer: a count one token a row off (the
unshifted labels of a causal LM) moves the prediction by well under 2% of the difference, but
the shifted count meets it to the rounding.
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
BETTER = 10  # ... or where the rounding allows, when another count's prediction is this many times closer


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
    (whole, la, lb), exact64 = losses
    if abs(la - lb) < SPREAD * abs(whole):
        return None
    counts = _candidates(rule, halves, (half, rows - half))
    given = counts.pop("given")
    if given is None:
        return None
    floor = _rounding(model, exact64) * abs(whole)
    loose = max(floor, MISS * abs(la - lb))
    off = _residual(given, whole, la, lb)
    if off <= floor:
        return None
    residuals = {name: _residual(c, whole, la, lb) for name, c in counts.items()}
    fitting = [name for name in sorted(residuals, key=residuals.get) if residuals[name] <= loose
               and (off > loose or residuals[name] * BETTER < off)]  # near misses: only a far better fit says
    if off <= loose and not fitting:
        return None
    named = "the rows" if rule.kind == "samples" else ("a sum" if rule.kind == "sum" else rule.source)
    fix = (f"the count that fits: normalize={fitting[0]}" if fitting else
           "none of the usual counts fits: the loss may couple the rows (mbs_ext.check_streamable tells, and "
           "mbs_ext.CachedLoss(encode, loss) streams such a loss exactly), or pass normalize=count(micro_batch) "
           "returning the items it averages over")
    return (f"the loss does not average over the count the step weighs micro-batches by ({named}): on two halves of "
            f"the first micro-batch L(A)={la:.6g}, L(B)={lb:.6g}, but L(A+B)={whole:.6g}, which that count does not "
            f"give; the step's gradient is not the full batch's. {fix[0].upper() + fix[1:]}")


def _losses(model: nn.Module, loss_call: Callable, parts: list[Any]) -> tuple[list[float], bool] | None:
    """The loss of each part, dropout off, with no graph, and whether all three are float64; None where
    one is not finite."""
    dropouts = [m for m in model.modules() if isinstance(m, nn.modules.dropout._DropoutNd) and m.training]
    for m in dropouts:
        m.training = False
    try:
        # Eager: three forwards of other shapes with no graph would cost a compiled model
        # recompilations (a no-grad graph, a half's size) for nothing it keeps. torch.compile's
        # module runs its own module eagerly; compiled functions the loss calls are skipped.
        own = model._orig_mod if isinstance(model, torch._dynamo.eval_frame.OptimizedModule) else model
        eager = torch.compiler.disable(loss_call, recursive=True)
        with torch.no_grad():
            losses = [eager(own, part) for part in parts]
            values = [_value(loss) for loss in losses]
    except Exception:  # noqa: BLE001 - the step runs the same call next and reports it with its notes
        return None
    finally:
        for m in dropouts:
            m.training = True
    if not all(v is not None and math.isfinite(v) for v in values):
        return None
    return values, all(loss.dtype == torch.float64 for loss in losses)


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


def _residual(counts: tuple[float, float] | None, whole: float, la: float, lb: float) -> float:
    """How far ``whole`` is from the halves' mean weighed by ``counts`` (``inf``: their sum)."""
    if counts is None:
        return math.inf
    ca, cb = counts
    if math.isinf(ca):
        return abs(whole - (la + lb))
    if ca + cb <= 0:
        return math.inf
    return abs(whole - (ca * la + cb * lb) / (ca + cb))


def _rounding(model: nn.Module, exact64: bool) -> float:
    """What the three forwards' rounding can move a loss by, as a fraction of it: float64 throughout
    (model and loss), float32 arithmetic (about 1e-6, with a margin), or TF32 matrix products on a
    GPU (about 3e-4)."""
    param = next(model.parameters(), None)
    if exact64 and param is not None and param.dtype == torch.float64:
        return 1e-12
    if param is not None and param.is_cuda and (torch.backends.cuda.matmul.allow_tf32
                                                  or torch.get_float32_matmul_precision() != "highest"
                                                  or torch.backends.cudnn.allow_tf32):
        return 1e-3
    return 1e-5
