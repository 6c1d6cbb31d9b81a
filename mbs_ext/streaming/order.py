"""Which rows each mini-batch takes, counted in samples: a data order that resumes at any batch size.

Under streaming the mini-batch size is free to change from step to step, so progress cannot be
counted in batches or steps (a resumed run whose batch size changed would land elsewhere in its
data). :class:`SampleOrder` counts samples: each epoch is a seeded permutation of the dataset's
rows, and a mini-batch of any size takes the next rows of it (running on into the next epoch's
permutation where it reaches the end, so every epoch's rows are each taken exactly once and no
row is dropped). Its state - seed, epoch, samples into the epoch, samples and tokens seen - is a
few numbers; the permutation of an epoch is made again from ``(seed, epoch)``. Across ranks the
order is global: every rank draws the same mini-batch and takes its own share of it
(:meth:`SampleOrder.next` with ``rank`` and ``world``), so a run resumes at any world size.
A mini-batch may also be sized in tokens (:meth:`SampleOrder.next_tokens`: the fewest next rows
whose lengths reach the size), which ``tokens_seen`` then counts. The rows go to the step as
``indices=`` into a dataset held on the host.
"""

from __future__ import annotations

from typing import Any

import torch


class SampleOrder:
    """Mini-batches of rows of a ``rows``-row dataset, in seeded per-epoch permutations."""

    def __init__(self, rows: int, seed: int = 0) -> None:
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise ValueError(f"rows must be an int >= 1 (the dataset's rows), got {rows!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        self.rows, self.seed = rows, seed
        self.epoch = 0
        self.position = 0  # samples of this epoch already taken
        self.samples_seen = 0
        self.tokens_seen = 0
        # The permutations of the last two epochs asked for, made when first needed: a mini-batch
        # that runs into the next epoch reads both (twice, sized in tokens), making each once.
        self._perms: dict[int, torch.Tensor] = {}

    def permutation(self, epoch: int) -> torch.Tensor:
        """Epoch ``epoch``'s order of the rows (int64, on the host), the same for every call and rank."""
        perm = self._perms.get(epoch)
        if perm is None:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            perm = torch.randperm(self.rows, generator=g)
            self._perms = {e: p for e, p in self._perms.items() if e == epoch - 1 or e == epoch + 1}
            self._perms[epoch] = perm
        return perm

    def next(self, batch_size: int, rank: int = 0, world: int = 1) -> torch.Tensor:
        """The next mini-batch of ``batch_size`` rows of the global order, and this rank's share of
        it (balanced contiguous parts, rank 0's first). Every rank calls it alike."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < world:
            raise ValueError(f"batch_size must be an int >= the number of ranks ({world}), got {batch_size!r}")
        _check_rank(rank, world)
        return _share(self._take(batch_size), rank, world)

    def next_tokens(self, tokens: int, lengths: torch.Tensor, rank: int = 0, world: int = 1) -> torch.Tensor:
        """The next mini-batch of about ``tokens`` tokens: the fewest next rows of the order whose
        ``lengths`` (each dataset row's tokens) add up to ``tokens`` or more (at least one row per
        rank), and this rank's share of them. Their tokens are added to ``tokens_seen``, the clock
        of a schedule in tokens. Every rank calls it alike."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"tokens must be an int >= 1, got {tokens!r}")
        _check_lengths(lengths, self.rows, full=False)
        _check_rank(rank, world)
        rows = self._take(max(world, self._rows_reaching(tokens, lengths)))
        self.tokens_seen += int(lengths[rows].sum())
        return _share(rows, rank, world)

    def _take(self, batch_size: int) -> torch.Tensor:
        """The next ``batch_size`` rows of the global order (running on into the next epoch)."""
        parts, left = [], batch_size
        while left:
            take = min(left, self.rows - self.position)
            parts.append(self.permutation(self.epoch)[self.position:self.position + take])
            self.position += take
            left -= take
            if self.position == self.rows:
                self.epoch, self.position = self.epoch + 1, 0
        self.samples_seen += batch_size
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def _rows_reaching(self, tokens: int, lengths: torch.Tensor) -> int:
        """How many of the next rows it takes for their lengths to reach ``tokens`` (takes nothing):
        running sums over windows of the order that double from 1,024 rows, so a step reads
        about as many lengths as it takes rows, not the rest of the epoch."""
        need, rows, epoch, position, window = tokens, 0, self.epoch, self.position, 1024
        while True:
            if position == self.rows:
                epoch, position = epoch + 1, 0
            part = lengths[self.permutation(epoch)[position:position + window]]
            if part.numel() and int(part.min()) < 0:  # read anyway; a negative count breaks the running sums
                raise ValueError("lengths must be token counts >= 0; a row of this order has a negative one")
            running = part.cumsum(0)
            k = int(torch.searchsorted(running, need))
            if k < part.numel():
                return rows + k + 1
            if rows >= 2 * self.rows and need == tokens:  # two epochs' rows: every row holds 0 tokens
                raise ValueError("lengths: every row has 0 tokens, so no mini-batch reaches a size in tokens")
            need -= int(running[-1])
            rows += part.numel()
            position += part.numel()
            window *= 2

    def count_tokens(self, tokens: int) -> None:
        """Add a step's tokens (every rank's) to the count a token-based schedule reads."""
        self.tokens_seen += int(tokens)

    def state_dict(self) -> dict:
        return {"rows": self.rows, "seed": self.seed, "epoch": self.epoch, "position": self.position,
                "samples_seen": self.samples_seen, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state: dict) -> None:
        if state["rows"] != self.rows:
            raise ValueError(f"load_state_dict: the state is of a {state['rows']}-row dataset, this order's has "
                             f"{self.rows} rows")
        self.seed, self.epoch, self.position = int(state["seed"]), int(state["epoch"]), int(state["position"])
        self._perms = {}  # made from another seed, perhaps
        self.samples_seen, self.tokens_seen = int(state["samples_seen"]), int(state["tokens_seen"])


def _check_rank(rank: int, world: int) -> None:
    if not 0 <= rank < world:
        raise ValueError(f"rank must lie in [0, {world}), got {rank}")


def _share(rows: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s balanced contiguous part of a mini-batch's ``rows`` (rank 0's first)."""
    share, extra = divmod(len(rows), world)
    start = rank * share + min(rank, extra)
    return rows[start:start + share + (rank < extra)].clone()


def _check_lengths(lengths: Any, rows: int, full: bool = True) -> None:
    """``lengths``: one integer token count per dataset row (``full``: also none negative, some
    above 0, an O(rows) pass made once where a schedule is set up)."""
    if not isinstance(lengths, torch.Tensor) or lengths.dim() != 1 or lengths.numel() != rows or (
            lengths.is_floating_point() or lengths.is_complex() or lengths.dtype == torch.bool
            or lengths.device.type != "cpu"):
        got = (f"{lengths.dtype} tensor of shape {tuple(lengths.shape)}" if isinstance(lengths, torch.Tensor)
               else type(lengths).__name__)
        raise ValueError(f"lengths must be a 1-D integer CPU tensor of each of the {rows} rows' tokens, got {got}")
    if full and (int(lengths.min()) < 0 or int(lengths.sum()) == 0):
        raise ValueError("lengths must be token counts >= 0, not all 0")


class MiniBatches:
    """A batch sampler over a :class:`SampleOrder`: each item is the row indices of the next
    mini-batch, of ``size`` rows (an int, or a schedule answering ``size(samples_seen, noise)``:
    :class:`mbs_ext.Ramp`, :class:`mbs_ext.Steps`, :class:`mbs_ext.Autopilot` with ``noise``, the
    streamer's, or a function returning it where it is made later, as under Lightning:
    ``lambda: trainer.strategy.last_result and trainer.strategy.last_result.noise``), this rank's
    share of it under ``rank``/``world``, until ``total_samples``. With ``lengths`` (each dataset
    row's tokens, a 1-D integer tensor) sizes are in tokens: a mini-batch is the fewest next rows
    reaching ``size`` tokens (:meth:`SampleOrder.next_tokens`), and a schedule's clock is
    ``tokens_seen`` (a ramp in tokens on a clock of tokens); ``total_samples`` still counts rows.

    Hand it to a DataLoader as ``batch_sampler=`` where the loader should gather the rows (a
    dataset read row by row, collated on the host), and to torchdata's ``StatefulDataLoader`` to
    have its ``state_dict()`` carry this one's: the order's and the schedule's state, so the
    loader resumes at the same sample at any batch size. Iterating it again goes on from where it
    is (the order counts samples, not passes over the loader). With ``num_workers > 0`` a loader
    draws mini-batches ahead of the step, so an autopilot's sizes are decided that much earlier."""

    def __init__(self, order: SampleOrder, size: int | object, noise: object = None,
                 total_samples: int | None = None, rank: int = 0, world: int = 1,
                 lengths: torch.Tensor | None = None) -> None:
        if not isinstance(order, SampleOrder):
            raise TypeError(f"order must be a mbs_ext.SampleOrder, got {type(order).__name__}")
        if not (isinstance(size, int) and not isinstance(size, bool) and size >= 1) and not callable(
                getattr(size, "size", None)):
            raise ValueError(f"size must be an int >= 1 or a schedule with size(samples_seen, noise), got {size!r}")
        if lengths is not None:
            _check_lengths(lengths, order.rows)
        self.order, self.size, self.noise, self.lengths = order, size, noise, lengths
        self.total_samples, self.rank, self.world = total_samples, rank, world

    def __iter__(self) -> MiniBatches:
        return self

    def __next__(self) -> list[int]:
        if self.total_samples is not None and self.order.samples_seen >= self.total_samples:
            raise StopIteration
        noise = self.noise() if callable(self.noise) else self.noise
        order, lengths = self.order, self.lengths
        clock = order.samples_seen if lengths is None else order.tokens_seen
        size = self.size if isinstance(self.size, int) else self.size.size(clock, noise)
        if lengths is None:
            return order.next(size, rank=self.rank, world=self.world).tolist()
        return order.next_tokens(size, lengths, rank=self.rank, world=self.world).tolist()

    def state_dict(self) -> dict:
        schedule = getattr(self.size, "state_dict", None)
        return {"order": self.order.state_dict(), "schedule": schedule() if schedule is not None else None}

    def load_state_dict(self, state: dict) -> None:
        self.order.load_state_dict(state["order"])
        if state.get("schedule") is not None:
            self.size.load_state_dict(state["schedule"])
