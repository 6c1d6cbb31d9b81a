"""Data-parallel ranks: which process group a step normalizes over, and its one collective.

A model handed to the step may be DistributedDataParallel itself or wrapped around
it (``torch.compile``'s ``OptimizedModule``, framework wrappers exposing ``.module``).
The step finds the DDP module through those wrappers: only DDP's ``no_sync`` keeps
micro-batches from all-reducing, and only its process group says what "global" means.
A plain model while ``torch.distributed`` runs with several ranks is refused: each
rank would silently take its own step and the replicas would drift apart.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

# Attributes through which wrappers expose the module they wrap: torch.compile's
# OptimizedModule (_orig_mod), Lightning Fabric's _FabricModule (_forward_module: what its
# forward calls, the DDP module; its ``.module`` is the *unwrapped* model), and ``.module``
# (DDP itself, Accelerate, most others).
_WRAPPED = ("_orig_mod", "_forward_module", "module")


def _inner(m: Any) -> list[nn.Module]:
    """The modules ``m`` exposes as wrapped, in :data:`_WRAPPED` order."""
    out = []
    for a in _WRAPPED:
        try:
            inner = getattr(m, a, None)
        except Exception:  # a wrapper's __getattr__ may raise anything
            inner = None
        if isinstance(inner, nn.Module) and inner is not m:
            out.append(inner)
    return out


def find_ddp(model: nn.Module) -> DistributedDataParallel | None:
    """The DistributedDataParallel module ``model`` is or wraps, if any (every wrapper path is
    searched, since a wrapper may expose both the module it calls and the unwrapped one)."""
    seen: set[int] = set()
    todo: list[Any] = [model]
    while todo:
        m = todo.pop(0)
        if not isinstance(m, nn.Module) or id(m) in seen:
            continue
        if isinstance(m, DistributedDataParallel):
            return m
        seen.add(id(m))
        todo.extend(_inner(m))
    return None


def unwrap(model: nn.Module) -> nn.Module:
    """The module under DDP, ``torch.compile`` and Fabric wrappers (for probes that must not run
    collectives). Only those: a user's own module may well have a submodule called ``module``."""
    seen: set[int] = set()
    m = model
    while id(m) not in seen:
        seen.add(id(m))
        if isinstance(m, DistributedDataParallel):
            m = m.module
            continue
        inner = [i for i in _inner(m) if i is not getattr(m, "module", None)]
        if not inner:
            return m
        m = inner[0]
    return m


def _refuse_fully_sharded(model: nn.Module) -> None:
    """FSDP2 (``fully_shard``) is not streamed yet: every forward of a sharded module gathers its
    parameters with a collective, so ranks with different numbers of micro-batches would hang,
    and its reduce-scatter averages per micro-batch. Refused rather than silently wrong."""
    fsdp_module = getattr(getattr(torch.distributed, "fsdp", None), "FSDPModule", None)
    if fsdp_module is None:
        return
    for name, m in unwrap(model).named_modules():
        if isinstance(m, fsdp_module):
            raise ValueError(
                f"model is sharded by FSDP2 (fully_shard on {name or 'the model'}), which mbs_ext does not "
                "stream yet: its per-forward all-gathers would hang ranks with different numbers of "
                "micro-batches. Use DistributedDataParallel, or a plain gradient accumulation loop under FSDP2"
            )


@dataclass(frozen=True)
class Ranks:
    """The DDP module and process group of a step (``ddp is None``: one process)."""

    ddp: DistributedDataParallel | None
    group: Any
    world: int

    @staticmethod
    def of(model: nn.Module) -> Ranks:
        _refuse_fully_sharded(model)
        ddp = find_ddp(model)
        if ddp is None:
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                raise ValueError(
                    f"model is a plain {type(model).__name__} (no DistributedDataParallel in it or behind "
                    f"{'/'.join('.' + a for a in _WRAPPED)}) while torch.distributed runs with "
                    f"{dist.get_world_size()} ranks: each rank would take its own optimizer step and the "
                    "replicas would drift apart. Wrap the model in DistributedDataParallel (the step then "
                    "normalizes over all ranks), or step each rank alone on purpose outside mbs_ext"
                )
            return Ranks(None, None, 1)
        return Ranks(ddp, ddp.process_group, dist.get_world_size(ddp.process_group))

    def no_sync(self, syncing: bool) -> contextlib.AbstractContextManager:
        """DDP's ``no_sync`` unless this backward is the one that all-reduces."""
        if self.ddp is None or syncing:
            return contextlib.nullcontext()
        return self.ddp.no_sync()

    def all_reduce_sum(
        self, values: list[float | torch.Tensor], device: torch.device, host_tail: list[float] | None = None
    ) -> torch.Tensor:
        """Per-rank values summed over the group in one collective, as a float64 vector on ``device``.

        No host sync: host numbers are gathered into one tensor and copied once (from
        pinned memory on CUDA), device values are stacked where they are. Without a
        group it only stacks them.
        """
        host = [(i, float(v)) for i, v in enumerate(values) if not isinstance(v, torch.Tensor)]
        host_values = [v for _, v in host] + list(host_tail or [])
        on_host = torch.tensor(host_values, dtype=torch.float64)
        if device.type == "cuda":
            on_host = on_host.pin_memory().to(device, non_blocking=True)
        else:
            on_host = on_host.to(device)
        parts: list[torch.Tensor] = []
        k = 0
        for v in values:
            if isinstance(v, torch.Tensor):
                parts.append(v.detach().to(device, torch.float64).reshape(1))
            else:
                parts.append(on_host[k : k + 1])
                k += 1
        t = torch.cat(parts + [on_host[k:]])
        if self.group is not None:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t
