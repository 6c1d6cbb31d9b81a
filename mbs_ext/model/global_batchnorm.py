"""BatchNorm whose statistics span every rank's rows of a micro-batch (AGBN, Liu et al. 2018).

Under data parallelism each rank normalizes its own rows; with micro-batch streaming the
rows a BatchNorm sees shrink again, to one micro-batch of one rank. Across ranks, the
statistics of micro-batch ``j`` can span every rank's rows of micro-batch ``j`` at the
cost of two small all-reduces per layer and micro-batch, as AGBN computes them:

* forward: each rank's per-channel count, sum and sum of squares, summed (one all-reduce),
  give the global mean and (biased) variance every rank normalizes with;
* backward: each rank's per-channel sums of ``dy`` and ``dy * x_hat``, summed (one
  all-reduce), give the global terms of BatchNorm's input gradient.

Counts weigh each rank, so ranks with unequal rows (or zero rows: a rank that ran out of
micro-batches takes part with nothing) combine exactly. The step weighs a micro-batch's
gradient after its backward (:class:`~mbs_ext.model.grads.BufferSink`), so the backward sums are
weighted here by each rank's weight of that micro-batch and the result divided by this
rank's own: the input gradient is that of the step's global loss.

Which layers run this way, and for which micro-batch, is the world's decision
(:mod:`mbs_ext.world.pairing` hands each layer a :class:`Turn`, or none: then the layer is
the deferred-statistics BatchNorm of :mod:`mbs_ext.model.batchnorm`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class Turn:
    """What the world tells the across-rank layers for one micro-batch: the ``group`` to sum over,
    whether this rank brings ``zero_rows`` (a padding micro-batch), the ``weight`` the step applies
    to this micro-batch's gradients after its backward (1.0 where the loss carries it), and how
    many collectives the layers ran in it (a failing rank can replay none half-way)."""

    def __init__(self, group: Any, zero_rows: bool) -> None:
        self.group, self.zero_rows = group, zero_rows
        self.weight: float | torch.Tensor = 1.0
        self.collectives = 0


def _dims_shape(x: torch.Tensor) -> tuple[list[int], list[int]]:
    return [0, *range(2, x.dim())], [1, x.shape[1]] + [1] * (x.dim() - 2)


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class GlobalNorm(torch.autograd.Function):
    """BatchNorm in training over the rows of every rank (``turn``); ``stats`` receives the
    global ``(count, mean, M2)`` of the micro-batch, for the deferred running statistics."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                eps: float, turn: Turn, stats: list) -> torch.Tensor:
        dims, shape = _dims_shape(x)
        c, acc = x.shape[1], _acc_dtype(x)
        xa = x.detach().to(acc)
        packed = torch.zeros(2 * c + 1, dtype=torch.float64, device=x.device)
        if not turn.zero_rows:
            packed[:c] = xa.sum(dims).to(torch.float64)
            packed[c : 2 * c] = xa.square().sum(dims).to(torch.float64)
            packed[2 * c] = x.numel() // c
        dist.all_reduce(packed, group=turn.group)
        turn.collectives += 1
        n = packed[2 * c]
        mean = packed[:c] / n
        var = (packed[c : 2 * c] / n - mean.square()).clamp(min=0.0)
        invstd = (var + eps).rsqrt()
        xhat = (xa - mean.to(acc).view(shape)) * invstd.to(acc).view(shape)
        y = xhat
        if weight is not None:
            y = y * weight.detach().to(acc).view(shape) + bias.detach().to(acc).view(shape)
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.turn, ctx.n = turn, n
        stats.append((n, mean, var * n))
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple:
        xhat, invstd, weight = ctx.saved_tensors
        turn, n = ctx.turn, ctx.n
        dims, shape = _dims_shape(gy)
        c, acc = gy.shape[1], xhat.dtype
        ga = gy.to(acc)
        sum_dy, sum_dy_xhat = ga.sum(dims), (ga * xhat).sum(dims)
        w = turn.weight
        packed = torch.zeros(2 * c, dtype=torch.float64, device=gy.device)
        if not turn.zero_rows:
            packed[:c], packed[c:] = sum_dy.to(torch.float64), sum_dy_xhat.to(torch.float64)
            packed.mul_(w)
        dist.all_reduce(packed, group=turn.group)
        turn.collectives += 1
        # This rank's gradients are multiplied by w after the backward: divide the global terms by it.
        if isinstance(w, torch.Tensor):
            inv_w = torch.where(w > 0, 1.0 / w.to(torch.float64), torch.zeros((), dtype=torch.float64, device=w.device))
        else:
            inv_w = 1.0 / w if w > 0 else 0.0
        packed = packed * inv_w / n
        scale = invstd if weight is None else invstd * weight.detach().to(torch.float64)
        gx = (ga - packed[:c].to(acc).view(shape) - xhat * packed[c:].to(acc).view(shape)) * scale.to(acc).view(shape)
        if turn.zero_rows:
            gx = torch.zeros_like(gx)
        gw = gb = None
        if weight is not None:
            gw, gb = sum_dy_xhat.to(weight.dtype), sum_dy.to(weight.dtype)
        return gx.to(gy.dtype), gw, gb, None, None, None


class AcrossRanks:
    """Mixin put ahead of the deferred-statistics BatchNorm: while the world has handed the layer a
    :class:`Turn`, its forward normalizes over every rank's rows of the micro-batch. ``across_ranks``
    is the switch (:func:`mbs_ext.set_batchnorm_across_ranks`), ``local_from`` the global row count
    of a micro-batch from which the layer normalizes locally (no collective)."""

    across_ranks = True
    local_from: int | None = None

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.BatchNorm's name
        turn = self.__dict__.get("_turn")
        if turn is None:
            return super().forward(input)
        self._check_input_dim(input)
        stats: list = []
        out = GlobalNorm.apply(input, self.weight, self.bias, self.eps, turn, stats)
        if self.track_running_stats and getattr(self, "_collecting", False):
            self._merge(*stats[0])
        return out
