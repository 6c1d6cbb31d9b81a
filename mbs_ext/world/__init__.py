"""The world a step runs in: one process, replicas, or shards.

Everything that differs between one process, data-parallel replicas (DDP or
``process_group=``) and FSDP2 shards lives in one of three classes with the same hooks
(:class:`~mbs_ext.world.one.World`, :class:`~mbs_ext.world.replicas.Replicas`,
:class:`~mbs_ext.world.shards.Shards`); the step, the pass and the normalizer call the
hooks and do not ask which world they are in. What the ranks tell each other rides in
one collective whose layout is defined once (:mod:`mbs_ext.world.record`).

:func:`world_of` finds the world of a model: DDP through its wrappers, FSDP2 from its
parameters, or ``process_group`` for a replicated model the step cannot recognise. A
plain model while ``torch.distributed`` runs with several ranks is refused: each rank
would silently take its own step and the replicas would drift apart.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from mbs_ext.model.wrappers import WRAPPED, find_ddp, unwrap
from mbs_ext.world import fsdp
from mbs_ext.world.one import Phase, World
from mbs_ext.world.record import Failure, PeerFailed, Record
from mbs_ext.world.replicas import Replicas
from mbs_ext.world.shards import Shards

__all__ = ["Failure", "PeerFailed", "Phase", "Record", "Replicas", "Shards", "World", "find_ddp", "unwrap",
           "world_of"]


def world_of(model: nn.Module, params: list[nn.Parameter], process_group: Any = None) -> World:
    """The world of ``model``, whose trainable parameters are ``params``."""
    ddp = find_ddp(model)
    if fsdp.dtensor_params(params):
        modules, group = fsdp.fully_sharded(unwrap(model), params)
        if ddp is not None or process_group not in (None, group):
            raise ValueError("model is sharded by FSDP2, which sets its process group; pass no "
                             "process_group and no DistributedDataParallel around it")
        return Shards(modules, group)
    if ddp is not None and process_group not in (None, ddp.process_group):
        raise ValueError("process_group differs from the DistributedDataParallel module's; pass none")
    if ddp is not None:
        return Replicas(ddp, ddp.process_group)
    if process_group is not None:  # a replica the step sums over itself
        return Replicas(None, process_group)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(
            f"model is a plain {type(model).__name__} (no DistributedDataParallel in it or behind "
            f"{'/'.join('.' + a for a in WRAPPED)}) while torch.distributed runs with "
            f"{dist.get_world_size()} ranks: each rank would take its own optimizer step and the "
            "replicas would drift apart. Wrap the model in DistributedDataParallel (the step then "
            "normalizes over all ranks), pass process_group= for a replica whose wrapper the step "
            "does not recognise (the step then sums counts and gradients over that group itself; "
            "the wrapper must not), or step each rank alone on purpose outside mbs_ext"
        )
    return World()
