"""BatchNorm whose running statistics are committed once per mini-batch.

During a micro-batch streamed step a plain ``nn.BatchNorm`` would update its running
statistics once per micro-batch, from micro-batch statistics, so they would differ from
a full-batch forward. The deferred twins here keep the running buffers untouched while
the mini-batch streams, keep each micro-batch's per-channel mean and variance (the
normalizing kernel writes them: :mod:`mbs_ext.model.batchnorm_rows`), and at the end merge
them into the mini-batch's (count, mean, M2) with the parallel-variance rule and commit once
-- with the unbiased n/(n-1) correction over the whole mini-batch -- so running_mean,
running_var and num_batches_tracked equal one full-batch ``nn.BatchNorm`` forward.

Limit: in training, each micro-batch is still *normalized* with its own batch
statistics (the full-batch statistics are not known until the whole mini-batch has
streamed), so activations and gradients equal the full-batch ones only when the
micro-batch is the whole mini-batch. Each micro-batch needs more than one value per
channel, like ``nn.BatchNorm``. A layer called more than once per micro-batch pools all
its calls into one mini-batch update.

Outside a streamed step the layers behave exactly like ``nn.BatchNorm``; their
parameters, buffers and state_dict keys are those of ``nn.BatchNorm``.

A step defers plain ``nn.BatchNorm1d/2d/3d`` layers by itself (:func:`deferring`: they
become their twins for the step and return to their own class after it), so
``convert_batchnorm`` only makes the deferral permanent. Across ranks,
``convert_batchnorm(model, across_ranks=True)`` makes each micro-batch's statistics span
every rank's rows of that micro-batch (:mod:`mbs_ext.model.global_batchnorm`; the world pairs
every rank's micro-batches: :mod:`mbs_ext.world.pairing`); an ``nn.SyncBatchNorm`` gets
the same for the step (its own forward is a collective that ranks with different numbers
of micro-batches would not all enter).

The limit above is silent in the numbers (gradients a few percent off, nothing
non-finite), and the README promises the full-batch step, so a step that streams more than
one micro-batch through a BatchNorm normalizing with batch statistics says so once per
model (:class:`BatchNormWarning`, :func:`warn_split_statistics`).
"""

from __future__ import annotations

import warnings
import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from mbs_ext.messages import caller_stacklevel
from mbs_ext.model import batchnorm_rows as rows
from mbs_ext.model.global_batchnorm import AcrossRanks


class _DeferredStats:
    """Mixin holding the pending per-channel (count, mean, M2) of one mini-batch: the rows the
    normalizing kernel writes (:mod:`mbs_ext.model.batchnorm_rows`, one per call), and what
    ``_merge`` adds from elsewhere (running buffers narrower than float32, the across-ranks
    layers)."""

    def _deferred_init(self) -> None:
        self._collecting = False
        self._pending: tuple[int, torch.Tensor, torch.Tensor] | None = None
        self._counts: list[int] = []  # values per channel of each call that wrote a row

    def begin_mini_batch(self) -> None:
        """Start collecting: running statistics stay untouched until ``commit``."""
        self._collecting = True
        self._pending = None
        self._counts = []

    def discard(self) -> None:
        """Drop the pending statistics and go back to plain BatchNorm behaviour."""
        rows.clear(self, len(self.__dict__.get("_counts") or ()))
        self._collecting = False
        self._pending = None
        self._counts = []

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.BatchNorm's name
        if not (getattr(self, "_collecting", False) and self.training and self.track_running_stats):
            return super().forward(input)
        self._check_input_dim(input)
        if torch.promote_types(input.dtype, torch.float32) != self.running_mean.dtype:
            out = F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)
            self._collect(input.detach())
            return out
        # The kernel computes the call's mean and unbiased variance anyway and, with momentum 1,
        # writes them into the call's row (a separate reduction read the activation three more
        # times). The rows take the running buffers' dtype: float32 or wider here.
        mean, var = rows.row(self, len(self._counts))
        out = F.batch_norm(input, mean, var, self.weight, self.bias, True, 1.0, self.eps)
        self._counts.append(input.numel() // input.shape[1])
        return out

    @torch.no_grad()
    def _collect(self, x: torch.Tensor) -> None:
        """The same statistics by a separate reduction, for running buffers narrower than float32."""
        stat_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        x = x.to(stat_dtype)
        dims = [0, *range(2, x.dim())]
        n = x.numel() // x.shape[1]
        mean = x.mean(dims)
        shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
        self._merge(n, mean, (x - mean.view(shape)).square().sum(dims))

    @torch.no_grad()
    def _merge(self, n: int | torch.Tensor, mean: torch.Tensor, m2: torch.Tensor) -> None:
        """One micro-batch's per-channel (count, mean, M2) into the pending ones (parallel variance)."""
        if self._pending is None:
            self._pending = (n, mean, m2)
            return
        na, mean_a, m2_a = self._pending
        total = na + n
        delta = mean - mean_a
        self._pending = (total, mean_a + delta * (n / total), m2_a + m2 + delta.square() * (na * n / total))

    @torch.no_grad()
    def commit(self) -> None:
        """Fold the mini-batch statistics into the running buffers, as one forward would."""
        counts, self._counts = self.__dict__.get("_counts") or [], []
        if counts:
            self._merge(*rows.fold(self, counts))
        pending, self._pending = self._pending, None
        self._collecting = False
        if pending is None or not self.track_running_stats:
            return
        n, mean, m2 = pending
        self.num_batches_tracked.add_(1)
        var = m2 / (n - 1) if n > 1 else torch.full_like(m2, float("nan"))
        rm, rv = self.running_mean, self.running_var
        if self.momentum is None:
            # Cumulative average: the factor stays on the device (reading it would sync), in
            # float64, and the update runs in at least float32 (as nn.BatchNorm's kernels do):
            # in bf16, 1 - 1/n rounds to 1 once n passes a few hundred.
            factor = 1.0 / self.num_batches_tracked.to(torch.float64)
            for buf, new in ((rm, mean), (rv, var)):
                acc = torch.promote_types(buf.dtype, torch.float32)
                f = factor.to(acc)
                buf.copy_(buf.to(acc) * (1 - f) + new.to(acc) * f)
            return
        factor = self.momentum
        rm.mul_(1 - factor).add_(mean.to(rm.dtype), alpha=factor)
        rv.mul_(1 - factor).add_(var.to(rv.dtype), alpha=factor)


class DeferredBatchNorm1d(_DeferredStats, nn.BatchNorm1d):
    """``nn.BatchNorm1d`` with running statistics committed once per mini-batch."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._deferred_init()


class DeferredBatchNorm2d(_DeferredStats, nn.BatchNorm2d):
    """``nn.BatchNorm2d`` with running statistics committed once per mini-batch."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._deferred_init()


class DeferredBatchNorm3d(_DeferredStats, nn.BatchNorm3d):
    """``nn.BatchNorm3d`` with running statistics committed once per mini-batch."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._deferred_init()


_TWINS: dict[type, type] = {
    nn.BatchNorm1d: DeferredBatchNorm1d,
    nn.BatchNorm2d: DeferredBatchNorm2d,
    nn.BatchNorm3d: DeferredBatchNorm3d,
}


def _twin(bn: nn.Module, cls: type, local_from: int | None = None) -> nn.Module:
    new = cls(
        bn.num_features,
        eps=bn.eps,
        momentum=bn.momentum,
        affine=bn.affine,
        track_running_stats=bn.track_running_stats,
        device="meta",
    )
    # Share the very Parameter and buffer objects: an optimizer built before the
    # conversion keeps working, and device/dtype are preserved.
    new.weight = bn.weight
    new.bias = bn.bias
    new.running_mean = bn.running_mean
    new.running_var = bn.running_var
    new.num_batches_tracked = bn.num_batches_tracked
    new.train(bn.training)
    if local_from is not None:
        new.local_from = local_from
    return new


class AcrossRanksBatchNorm1d(AcrossRanks, DeferredBatchNorm1d):
    """``nn.BatchNorm1d`` whose statistics, in a streamed step across ranks, span every rank's rows
    of each micro-batch (:mod:`mbs_ext.model.global_batchnorm`)."""


class AcrossRanksBatchNorm2d(AcrossRanks, DeferredBatchNorm2d):
    """``nn.BatchNorm2d`` whose statistics, in a streamed step across ranks, span every rank's rows
    of each micro-batch (:mod:`mbs_ext.model.global_batchnorm`)."""


class AcrossRanksBatchNorm3d(AcrossRanks, DeferredBatchNorm3d):
    """``nn.BatchNorm3d`` whose statistics, in a streamed step across ranks, span every rank's rows
    of each micro-batch (:mod:`mbs_ext.model.global_batchnorm`)."""


class _AcrossRanksSync(AcrossRanks, _DeferredStats, nn.SyncBatchNorm):
    """The class an ``nn.SyncBatchNorm`` wears during a streamed step: the same semantics (statistics
    over every rank's rows), per micro-batch, with collectives every rank pairs up."""


_ACROSS: dict[type, type] = {
    nn.BatchNorm1d: AcrossRanksBatchNorm1d, DeferredBatchNorm1d: AcrossRanksBatchNorm1d,
    nn.BatchNorm2d: AcrossRanksBatchNorm2d, DeferredBatchNorm2d: AcrossRanksBatchNorm2d,
    nn.BatchNorm3d: AcrossRanksBatchNorm3d, DeferredBatchNorm3d: AcrossRanksBatchNorm3d,
}


def convert_batchnorm(module: nn.Module, across_ranks: bool = False, local_from: int | None = None) -> nn.Module:
    """Swap every BatchNorm1d/2d/3d in ``module`` for its deferred-statistics twin.

    In place (children are replaced on their parents) and returns ``module``; when
    ``module`` itself is such a BatchNorm, its twin is returned.

    ``across_ranks=True``: the twins' statistics, in a streamed step under DDP or
    ``process_group=``, span every rank's rows of each micro-batch, forward and backward
    (two all-reduces per layer and micro-batch; see docs/batchnorm.md). ``local_from``: from
    this global row count of a micro-batch on, the layers normalize each rank's rows alone
    (no collective). ``nn.SyncBatchNorm`` layers keep their class (a step gives them this
    behaviour by itself) and take ``local_from``. Without ``across_ranks``, SyncBatchNorm and
    already converted layers are left alone.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if local_from is not None and (not across_ranks or isinstance(local_from, bool) or not isinstance(local_from, int)
                                   or local_from < 1):
        raise ValueError(f"local_from must be a positive int with across_ranks=True, got {local_from!r}")
    twins = _ACROSS if across_ranks else _TWINS
    if type(module) in twins:
        return _twin(module, twins[type(module)], local_from)
    for name, child in list(module.named_children()):
        if type(child) in twins:
            setattr(module, name, _twin(child, twins[type(child)], local_from))
        elif across_ranks and isinstance(child, nn.SyncBatchNorm):
            child.local_from = local_from
        else:
            convert_batchnorm(child, across_ranks, local_from)
    return module


def set_batchnorm_across_ranks(module: nn.Module, enabled: bool) -> int:
    """The switch of AGBN: ``enabled=False`` makes the across-rank BatchNorm layers of ``module``
    (from ``convert_batchnorm(across_ranks=True)``, and ``nn.SyncBatchNorm``) normalize each rank's
    rows alone, with no collective, until switched back. Flip it on every rank alike, between
    steps: a step whose ranks disagree raises on every rank. Returns how many layers it set."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    layers = [m for m in module.modules() if isinstance(m, (AcrossRanks, nn.SyncBatchNorm))]
    for m in layers:
        m.across_ranks = enabled
    return len(layers)


def across_rank_layers(modules: list[nn.Module]) -> list[nn.Module]:
    """The BatchNorm layers among ``modules`` whose statistics a step takes over every rank: converted
    with ``across_ranks=True`` or ``nn.SyncBatchNorm``, normalizing with batch statistics."""
    return [m for m in modules if isinstance(m, (AcrossRanks, nn.SyncBatchNorm))
            and (m.training or not m.track_running_stats)]


def deferred_layers(module: nn.Module) -> list[_DeferredStats]:
    """The deferred-statistics BatchNorm layers inside ``module``."""
    return [m for m in module.modules() if isinstance(m, _DeferredStats)]


def deferring(model: nn.Module, modules: list[nn.Module]) -> _Deferring:
    """A context in which every BatchNorm of ``model`` defers its statistics; it yields the deferred
    layers and the BatchNorm layers normalizing with batch statistics (for :func:`warn_split_statistics`).

    ``modules`` is ``list(model.modules())``, which the step has from its one walk over the
    model. Plain ``nn.BatchNorm1d/2d/3d`` layers take their twin's class for the block (same
    object, parameters and buffers) and get their own class back afterwards, whatever happens
    in the block.
    """
    plain, layers, normalizing = [], [], []
    for m in modules:
        if not isinstance(m, _BatchNorm):  # the one test most modules meet: every step walks them all
            continue
        if m.training or m.running_mean is None:  # normalizes with the statistics of what it is given
            normalizing.append(m)
        if type(m) in _TWINS or type(m) is nn.SyncBatchNorm:
            plain.append(m)
        if isinstance(m, _DeferredStats) or type(m) in _TWINS or type(m) is nn.SyncBatchNorm:
            layers.append(m)
    return _Deferring(plain, layers, normalizing)


class _Deferring:
    """The block of :func:`deferring` (a class: entered every step, cheaper than a generator's).
    ``normalizing``: the BatchNorm layers that normalize with batch statistics (training mode,
    or no running statistics), for :func:`warn_split_statistics`."""

    def __init__(self, plain: list[nn.Module], layers: list[_DeferredStats], normalizing: list[nn.Module]) -> None:
        self.plain, self.layers, self.normalizing = plain, layers, normalizing
        self.swapped: list[tuple[nn.Module, type]] = []

    def __enter__(self) -> tuple[list[_DeferredStats], list[nn.Module]]:
        try:
            for m in self.plain:
                original = type(m)
                self.swapped.append((m, original))  # first: a failing swap is put back too
                m.__class__ = _TWINS.get(original, _AcrossRanksSync)
                m._deferred_init()
        except BaseException:
            self.__exit__()
            raise
        return self.layers, self.normalizing

    def __exit__(self, *exc: object) -> None:
        for m, original in self.swapped:
            m.__class__ = original
            for attr in ("_collecting", "_pending", "_turn", "_counts"):
                m.__dict__.pop(attr, None)
        self.swapped = []


class BatchNormWarning(UserWarning):
    """A step streamed several micro-batches through BatchNorm layers that normalize with batch
    statistics: each micro-batch was normalized with its own, so the gradients differ from the
    full batch's. Silence it with ``warnings.filterwarnings("ignore", category=mbs_ext.BatchNormWarning)``."""


_WARNED: weakref.WeakSet = weakref.WeakSet()  # the models told already: once per model, not per step


def warn_split_statistics(model: nn.Module, normalizing: list[nn.Module], num_micro_batches: int) -> None:
    """Warn, once per ``model``, when ``num_micro_batches`` > 1 micro-batches pass through the
    BatchNorm layers in ``normalizing`` (those using batch statistics, from :func:`deferring`).

    The running statistics are exact (deferred), but normalization is not: the full-batch
    statistics exist only once the whole mini-batch has streamed. The numbers do not show it, so
    the step says it, naming the layers, what differs, the ways to the full-batch gradient and
    how to silence it. One micro-batch (the whole mini-batch) is exact: no warning.
    """
    if num_micro_batches < 2 or not normalizing or model in _WARNED:
        return
    _WARNED.add(model)
    wanted = {id(m) for m in normalizing}
    plain = {twin: cls for cls, twin in _TWINS.items()}  # during the step a layer wears its twin's class
    plain[_AcrossRanksSync] = nn.SyncBatchNorm
    names = [f"{name or 'the model'} ({plain.get(type(m), type(m)).__name__})"
             for name, m in model.named_modules() if id(m) in wanted]
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    warnings.warn(
        f"mbs_ext: the step streams {num_micro_batches} micro-batches through BatchNorm layers that normalize "
        f"with batch statistics, {shown}: each micro-batch is normalized with its own statistics, so "
        "activations and gradients differ from one full-batch step (running statistics are still committed "
        "once, over the whole mini-batch). For the full-batch gradient put those layers in eval mode, use a "
        "normalization over each row (nn.GroupNorm, nn.LayerNorm), or a micro_batch_size that holds the whole "
        "mini-batch; see docs/known-issues.md. Said once per model; to silence it: "
        'warnings.filterwarnings("ignore", category=mbs_ext.BatchNormWarning)',
        BatchNormWarning,
        stacklevel=caller_stacklevel(),
    )
