"""A mini-batch's BatchNorm statistics: gathered by the normalizing kernel, folded once.

During a streamed step, call ``i`` of a deferred BatchNorm (:mod:`mbs_ext.model.batchnorm`)
gives ``F.batch_norm`` row ``i`` of a zeroed (2, R, C) buffer as its running mean and
variance, with momentum 1: the kernel writes the call's mean and unbiased variance there
while it normalizes, so gathering costs no kernel launch. At commit the rows fold into the
mini-batch's (count, mean, M2).

Folding one layer at a time launched about sixteen small kernels per layer, and merging call by
call eight more per layer and micro-batch: on a GPU a ResNet-50 step (53 BatchNorm layers) was
bound by the host launching them. :func:`commit_all` folds every layer whose calls split the
rows in the same proportions (each call sees the same rows in every layer and a fixed number of
values per row: the usual case) in one go: their rows side by side, a dozen kernels for the
whole model, the running buffers updated by multi-tensor operations. With ``w_i`` the share
of call ``i`` in the mini-batch's ``N`` values per channel, ``M_i``/``V_i`` its mean and
unbiased variance and ``M`` the mini-batch mean, the parallel-variance rule reads
``M2 = sum((n_i - 1) V_i + n_i (M_i - M)^2) = N (sum w_i V_i + sum w_i (M_i - M)^2) - sum V_i``.

A step of any length keeps a bounded number of rows: every :data:`FOLD_EVERY` micro-batches,
between two of them (no autograd graph then holds a view of a buffer: zeroing rows the graph
saved would fail its backward), :func:`compact` folds each layer's rows into its row 0 - the
calls so far as one call of their summed count, with their pooled mean and unbiased variance,
by the same rule and the same grouping - and the calls go on from row 1. The commit's rule
reads any rows of any counts alike, so this changes nothing but the memory: a deferred
BatchNorm holds ``2 x (1 + FOLD_EVERY x calls per micro-batch)`` rows of its channels (rounded
up to a power of two), never one per micro-batch of the mini-batch.

The buffers live in a weak map from layer to buffer (not on the layer: a plain
``nn.BatchNorm`` gets its own class back after each step, without new attributes), zeroed
again after each fold or discard: momentum 1 still multiplies the old value by zero, and
a NaN left there would stay.
"""

from __future__ import annotations

import math
import weakref

import torch

_ROWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layer -> (rows, [(mean_i, var_i)])

FOLD_EVERY = 16  # micro-batches between two compactions of the rows


def row(layer: torch.nn.Module, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of row ``i`` (mean, variance) of the layer's buffer, made or doubled as needed,
    in the running buffers' dtype and device."""
    like = layer.running_mean
    entry = _ROWS.get(layer)
    if entry is None or len(entry[1]) <= i or entry[0].dtype != like.dtype or entry[0].device != like.device:
        rows = like.new_zeros((2, max(8, 2 * i), like.numel()))
        if entry is not None and i > 0 and entry[0].dtype == like.dtype and entry[0].device == like.device:
            rows[:, :i].copy_(entry[0][:, :i])
        entry = (rows, list(zip(rows[0].unbind(0), rows[1].unbind(0))))
        _ROWS[layer] = entry
    return entry[1][i]


def held_rows(layer: torch.nn.Module) -> int:
    """How many rows the layer's buffer holds (0: none): what a step keeps for it."""
    entry = _ROWS.get(layer)
    return 0 if entry is None else entry[0].shape[1]


def clear(layer: torch.nn.Module, used: int) -> None:
    """Zero the rows a discarded mini-batch wrote."""
    entry = _ROWS.get(layer)
    if used and entry is not None:
        entry[0][:, :used].zero_()


def _moments(rows: torch.Tensor, counts: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the (2, k, channels) rows of calls that hold ``counts[i] / sum(counts)`` of the values
    in every channel: the mean ``sum w_i M_i``, the spread ``sum w_i V_i + sum w_i (M_i - M)^2`` and
    ``sum V_i``, so that ``M2 = N * spread - sum V_i`` for a channel of ``N`` values."""
    means, variances = rows[0], rows[1]
    total = sum(counts)
    # The weights in one host-to-device copy (non-blocking: no sync).
    weight = torch.tensor([c / total for c in counts], dtype=means.dtype).to(means.device, non_blocking=True)[:, None]
    mean = (means * weight).sum(0)
    spread = (variances * weight).sum(0).add_(((means - mean).square_() * weight).sum(0))
    return mean, spread, variances.sum(0)


@torch.no_grad()
def fold(layer: torch.nn.Module, counts: list[int]) -> tuple[int, torch.Tensor, torch.Tensor]:
    """One layer's calls, ``counts[i]`` values per channel each, into (count, mean, M2)."""
    rows = _ROWS[layer][0]
    k, total = len(counts), sum(counts)
    mean, spread, variance_sum = _moments(rows[:, :k], counts)
    m2 = spread.mul_(total).sub_(variance_sum)
    rows[:, :k].zero_()
    return total, mean, m2


def _shares(layer: torch.nn.Module) -> tuple | None:
    """What groups layers that fold together: device, dtype, momentum and the calls' shares of
    the mini-batch (reduced counts); None for a layer committed on its own."""
    counts = layer.__dict__.get("_counts")
    if not counts or layer._pending is not None or layer.momentum is None or not layer.track_running_stats:
        return None
    if sum(counts) < 2:  # the unbiased variance of one value: nn.BatchNorm's NaN, by the layer's commit
        return None
    g = math.gcd(*counts)
    rm = layer.running_mean
    return rm.device, rm.dtype, layer.momentum, tuple(c // g for c in counts)


@torch.no_grad()
def commit_all(layers: list) -> None:
    """``layer.commit()`` for every layer, the layers that share a :func:`_shares` key together."""
    groups: dict[tuple, list] = {}
    for layer in layers:
        key = _shares(layer)
        if key is None:
            layer.commit()
        else:
            groups.setdefault(key, []).append(layer)
    for (_, _, momentum, _), group in groups.items():
        _commit_group(group, momentum)


def _pooled(group: list) -> tuple[list[torch.Tensor], list[int], torch.Tensor, list[torch.Tensor], list[int]]:
    """The rows of a group of layers whose calls split alike, pooled: per layer its buffer, its
    channels, and (as one tensor split by channels, and a list) the mean and unbiased variance of
    all its calls so far, with its total count ``N``: ``var = M2 / (N - 1)``."""
    counts = group[0]._counts
    k, sizes = len(counts), [layer.running_mean.numel() for layer in group]
    buffers = [_ROWS[layer][0] for layer in group]
    mean, spread, variance_sum = _moments(torch.cat([b[:, :k] for b in buffers], dim=2), counts)
    totals = [sum(layer._counts) for layer in group]
    var = torch._foreach_mul(spread.split(sizes), [n / (n - 1) for n in totals])
    torch._foreach_sub_(var, torch._foreach_mul(variance_sum.split(sizes), [1 / (n - 1) for n in totals]))
    return buffers, sizes, mean, var, totals


@torch.no_grad()
def compact(layers: list) -> None:
    """Fold each deferred layer's rows into its row 0 (between micro-batches: no graph holds them),
    the layers whose calls split alike together; a layer's calls go on from row 1."""
    groups: dict[tuple, list] = {}
    for layer in layers:
        counts = layer.__dict__.get("_counts")
        if not counts or len(counts) < 2 or layer not in _ROWS:
            continue
        g = math.gcd(*counts)
        rm = layer.running_mean
        groups.setdefault((rm.device, rm.dtype, tuple(c // g for c in counts)), []).append(layer)
    for group in groups.values():
        buffers, sizes, mean, var, totals = _pooled(group)
        k = len(group[0]._counts)
        torch._foreach_zero_([b[:, 1:k] for b in buffers])
        torch._foreach_copy_([b[0, 0] for b in buffers], list(mean.split(sizes)))
        torch._foreach_copy_([b[1, 0] for b in buffers], var)
        for layer, n in zip(group, totals):
            layer._counts = [n]


def _commit_group(group: list, momentum: float) -> None:
    buffers, sizes, mean, var, totals = _pooled(group)
    torch._foreach_add_([layer.num_batches_tracked for layer in group], 1)
    for running, new in (([layer.running_mean for layer in group], mean.split(sizes)),
                         ([layer.running_var for layer in group], var)):
        torch._foreach_mul_(running, 1 - momentum)
        torch._foreach_add_(running, new, alpha=momentum)
    torch._foreach_zero_(buffers)
    for layer in group:
        layer._counts, layer._pending, layer._collecting = [], None, False
