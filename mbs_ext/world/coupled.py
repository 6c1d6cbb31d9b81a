"""What a loss that couples the rows (:class:`mbs_ext.CachedLoss`) needs of the ranks.

Its loss scores every row against every other one, so under DDP (or ``process_group=``) it
must see every rank's encodings: the negatives are global, as a full-batch step on all ranks'
rows would have them. Before it, one all-reduce shares whether each rank's batch passed its
checks (then rank 0's buffers go to every rank). After the no-grad pass each rank hands in its encodings; one small
all-reduce shares the row counts and any failure of that pass (so a rank that failed never
leaves the others waiting in a gather), one object all-gather the leaves' row shapes and dtypes
(which must agree), then one all-gather per encoding leaf
(padded to the most rows) gives every rank the same mini-batch, rank 0's rows first. The loss
then runs on every rank alike, and each back-propagates its own rows' slice of the encoding
gradients: the step's sum over ranks is the full-batch gradient. FSDP2 is refused: its
parameters are sharded, and the loss's own parameters (a learned temperature) would need their
full tensors on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mbs_ext.world.one import World
from mbs_ext.world.record import Failure, agree
from mbs_ext.world.replicas import Replicas
from mbs_ext.world.shards import Shards


def check(world: World) -> None:
    """Refuse, before anything runs, a world whose ranks cannot share encodings."""
    if isinstance(world, Shards):
        raise ValueError("CachedLoss does not run under FSDP2 yet (its loss would need the full parameters on "
                         "every rank): use DistributedDataParallel, process_group= for replicas, or one process")


def begin(world: World, failure: Failure | None, device: torch.device) -> None:
    """Before the no-grad pass: every rank raises where some rank's checks of its batch failed
    (``failure``: this rank's), then rank 0's buffers on every rank, as the streamed pass will have
    them (and DDP's own broadcast off, which would run in whichever forward comes first)."""
    if world.group is None:
        return
    agree(world.group, world.size, world.rank, device, failure=failure)
    if failure is None and isinstance(world, Replicas):
        world.sync_buffers()


def gather(world: World, leaves: list[torch.Tensor], failure: Failure | None,
           device: torch.device) -> tuple[list[torch.Tensor], int]:
    """Every rank's ``leaves`` concatenated in rank order, and the position of this rank's first
    row in them. Every rank raises where some rank failed (``failure``: this rank's) or where
    the ranks' encodings differ in structure or shape beyond their rows."""
    if world.group is None:
        return leaves, 0
    s, rank = world.size, world.rank
    agreed = agree(world.group, s, rank, device, columns=[leaves[0].shape[0] if leaves else 0], failure=failure)
    if failure is not None:
        return [], 0
    # Each leaf's row shape and dtype, exactly: the all-gathers below need them alike on every rank.
    layouts: list[object] = [None] * s
    dist.all_gather_object(layouts, [(tuple(t.shape[1:]), str(t.dtype)) for t in leaves], group=world.group)
    if any(layout != layouts[0] for layout in layouts):
        raise ValueError("CachedLoss: the ranks' encodings differ in structure, dtype or shape beyond their rows "
                         f"(row shape and dtype of each leaf, by rank: {layouts}); encode must return the same "
                         "structure, dtypes and row shapes on every rank")
    counts = [int(v) for v in agreed.columns[0]]
    most = max(counts)
    out = []
    for t in leaves:
        padded = t.new_zeros((most, *t.shape[1:]))
        padded[: t.shape[0]] = t
        parts = [torch.empty_like(padded) for _ in range(s)]
        dist.all_gather(parts, padded, group=world.group)
        out.append(torch.cat([p[:n] for p, n in zip(parts, counts)]))
    return out, sum(counts[:rank])


def confirm(world: World, failure: Failure | None, device: torch.device) -> None:
    """After the loss ran on every rank: every rank raises where some rank's loss failed (the
    others would otherwise wait for it in the streamed pass)."""
    if world.group is None:
        return
    agree(world.group, world.size, world.rank, device, failure=failure)
