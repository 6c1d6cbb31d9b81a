"""Paired micro-batches for BatchNorm layers whose statistics span every rank's rows.

An across-rank BatchNorm (``convert_batchnorm(model, across_ranks=True)``, or an
``nn.SyncBatchNorm``) runs one all-reduce in its forward and one in its backward for every
micro-batch (:mod:`mbs_ext.model.global_batchnorm`), so every rank must run the same number of
micro-batches, and micro-batch ``j`` of one rank must meet micro-batch ``j`` of the others.
Where a model has such layers in training, the ranks agree before the first micro-batch,
in one all-reduce, on:

* how many micro-batches each runs (and, where some rank's layers set ``local_from``, a second
  all-reduce of the rows each micro-batch holds, by rows or by tokens alike, so every rank knows
  the global row count of micro-batch ``j`` that the threshold compares with);
* the global total of the counts (so each micro-batch's weight is exact from the start:
  the backward sums weigh the ranks by it);
* whether each rank has the same layers switched on (a mismatch raises on every rank);
* whether some rank failed before it (then every rank raises there).

A rank with fewer micro-batches runs padding ones: one row of its latest micro-batch, the
model in eval mode, at weight 0, through which the across-rank layers still enter their
collectives with zero rows (count, sums and gradient sums of zero), and merge the other
ranks' statistics into their running ones, so those stay the same on every rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from mbs_ext.counts import sources as counts
from mbs_ext.model.batchnorm import across_rank_layers
from mbs_ext.model.global_batchnorm import Turn
from mbs_ext.world import padding
from mbs_ext.world.record import Failure, agree, all_reduce_sum


class Pairing:
    """The across-rank BatchNorm layers of a step on rank ``rank`` of ``size`` in ``group``, and
    the turn each micro-batch gives them."""

    def __init__(self, layers: list[nn.Module], group: Any, size: int, rank: int, weighs_after: bool) -> None:
        self.active = [m for m in layers if getattr(m, "across_ranks", True)]
        self.group, self.size, self.rank = group, size, rank
        self.weighs_after = weighs_after  # the sink weighs each micro-batch after its backward
        self.global_rows: list[int] = []
        self.turn: Turn | None = None

    @classmethod
    def of(cls, modules: list[nn.Module], group: Any, size: int, rank: int, weighs_after: bool) -> Pairing | None:
        """None where no layer of ``modules`` takes statistics across ranks (nothing to pair).
        ``weighs_after``: the step's sink weighs each micro-batch's gradients after its backward
        (replicas' buffers), not in the loss (FSDP2's autograd gradients)."""
        layers = across_rank_layers(modules)
        return cls(layers, group, size, rank, weighs_after) if layers else None

    def agree(self, local_total: counts.Count, sizes: list[int], device: torch.device,
              failure: Failure | None = None) -> tuple[int, Any]:
        """One all-reduce: how many micro-batches every rank runs and the global total of the
        counts (the most micro-batches of any rank). Every rank raises here where some rank failed
        before it, or their switches differ."""
        thresholds = any(getattr(m, "local_from", None) is not None for m in self.active)
        agreed = agree(self.group, self.size, self.rank, device, head=[local_total],
                       columns=[len(sizes), thresholds, len(self.active)], failure=failure)
        if failure is not None:
            return 0, agreed.head[0]
        num, thresholds_by_rank, active = ([int(v) for v in column] for column in agreed.columns)
        if len(set(active)) > 1:
            raise ValueError(
                f"mbs_ext.step: the ranks have different numbers of BatchNorm layers taking statistics across "
                f"ranks switched on ({active}, by rank): call mbs_ext.set_batchnorm_across_ranks (or convert_"
                "batchnorm) on every rank alike, between steps")
        padded = max(num)
        self.global_rows = []
        if any(thresholds_by_rank):  # decided from the shared slots: every rank joins this one or none does
            own = [*sizes, *[0] * (padded - len(sizes))]
            self.global_rows = [int(v) for v in all_reduce_sum(own, device, self.group).tolist()]
        return padded, agreed.head[0]

    def enter(self, index: int, zero_rows: bool = False) -> None:
        """Micro-batch ``index`` begins: each active layer gets this micro-batch's turn, unless its
        global rows reach the layer's ``local_from`` (then it normalizes this rank's rows alone)."""
        self.turn = turn = Turn(self.group, zero_rows)
        rows = self.global_rows[index] if index < len(self.global_rows) else 0
        for m in self.active:
            local_from = getattr(m, "local_from", None)
            local = local_from is not None and rows >= local_from
            m.__dict__["_turn"] = None if local else turn

    def weigh(self, weight: Any) -> None:
        """The weight the step gives this micro-batch's gradients after its backward."""
        if self.turn is not None and self.weighs_after:
            self.turn.weight = weight

    def began(self) -> bool:
        """Whether the micro-batch in progress ran a layer's collective (a failing rank cannot
        replay the rest of it)."""
        return self.turn is not None and self.turn.collectives > 0

    @contextlib.contextmanager
    def streaming(self) -> Iterator[None]:
        """Around the pass: no layer keeps a turn after it."""
        try:
            yield
        finally:
            for m in self.active:
                m.__dict__.pop("_turn", None)
            self.turn = None

    def pad(self, pass_: Any, index: int, no_sync: Callable[[], Any]) -> None:
        """Padding micro-batch ``index`` (:mod:`mbs_ext.world.padding`) with zero rows in the statistics."""
        self.enter(index, zero_rows=True)
        self.weigh(0.0)
        with no_sync():
            loss = padding.zero_weight_loss(pass_, lenient=False)
        pass_.sink.backward(loss, 0.0, pass_.options.scaler)

    def catch_up(self, pass_: Any, no_sync: Callable[[], Any]) -> bool:
        """After a failure at micro-batch ``pass_.index``: where no layer's collective ran in it yet,
        run it and every later one as padding, so the other ranks' collectives pair up."""
        if not self.active or self.began() or pass_.template is None:
            return False
        return padding.catch_up(pass_, lambda i: self.pad(pass_, i, no_sync))
