"""Data-parallel ranks: which process group a step normalizes over, and what the ranks share.

A model handed to the step may be DistributedDataParallel itself or wrapped around
it (``torch.compile``'s ``OptimizedModule``, framework wrappers exposing ``.module``),
or sharded by FSDP2 (:mod:`mbs_ext.sharded`). The step finds the DDP module through
those wrappers: only DDP's ``no_sync`` keeps micro-batches from all-reducing, and only
its process group says what "global" means. A plain model while ``torch.distributed``
runs with several ranks is refused: each rank would silently take its own step and the
replicas would drift apart. Here too: the all-reduce primitive of the step's small
collectives, and the failure record that rides in them (:class:`Failure`,
:class:`PeerFailed`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mbs_ext import sharded

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


_NO_CONTEXT = contextlib.nullcontext()  # reusable: entered once per micro-batch


class PeerFailed(RuntimeError):
    """Another rank failed in this step; this rank undid its part too (nothing changed).
    ``out_of_memory``: every rank that failed ran out of memory while streaming (the step then
    backs off on every rank, as one process does)."""

    def __init__(self, message: str, out_of_memory: bool = False) -> None:
        super().__init__(message)
        self.out_of_memory = out_of_memory


@dataclass(frozen=True)
class Failure:
    """Where this rank failed before the step's collective: ``micro_batch`` -1 means before the
    first one (checks, buffers)."""

    micro_batch: int
    out_of_memory: bool


def out_of_memory_while_streaming(slots: list[float], world: int) -> bool:
    """From the failure record summed over the ranks (:meth:`Ranks.failure_slots`): some rank
    failed, and every one that did ran out of memory at a micro-batch (a smaller one may help)."""
    failed = [r for r in range(world) if slots[r] > 0]
    return bool(failed) and all(slots[r] >= 2 and slots[world + r] > 0 for r in failed)


@dataclass(frozen=True)
class Ranks:
    """The DDP module and process group of a step (``ddp is None``: one process)."""

    ddp: DistributedDataParallel | None
    group: Any
    world: int
    rank: int = 0
    fsdp: tuple[nn.Module, ...] = ()  # FSDP2 modules (then ddp is None; see mbs_ext.sharded)

    @staticmethod
    def of(model: nn.Module, params: list[nn.Parameter], process_group: Any = None) -> Ranks:
        """The ranks of ``model`` (DDP found through wrappers, FSDP2 from its parameters), or of
        ``process_group`` for a replicated model the step cannot recognise."""
        ddp = find_ddp(model)
        if sharded.dtensor_params(params):
            modules, group = sharded.fully_sharded(unwrap(model), params)
            if ddp is not None or process_group not in (None, group):
                raise ValueError("model is sharded by FSDP2, which sets its process group; pass no "
                                 "process_group and no DistributedDataParallel around it")
            return Ranks(None, group, dist.get_world_size(group), dist.get_rank(group), modules)
        if ddp is not None and process_group not in (None, ddp.process_group):
            raise ValueError("process_group differs from the DistributedDataParallel module's; pass none")
        if ddp is None and process_group is not None:  # a replica the step sums over itself
            return Ranks(None, process_group, dist.get_world_size(process_group), dist.get_rank(process_group))
        if ddp is None:
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                raise ValueError(
                    f"model is a plain {type(model).__name__} (no DistributedDataParallel in it or behind "
                    f"{'/'.join('.' + a for a in _WRAPPED)}) while torch.distributed runs with "
                    f"{dist.get_world_size()} ranks: each rank would take its own optimizer step and the "
                    "replicas would drift apart. Wrap the model in DistributedDataParallel (the step then "
                    "normalizes over all ranks), pass process_group= for a replica whose wrapper the step "
                    "does not recognise (the step then sums counts and gradients over that group itself; "
                    "the wrapper must not), or step each rank alone on purpose outside mbs_ext"
                )
            return Ranks(None, None, 1)
        group = ddp.process_group
        return Ranks(ddp, group, dist.get_world_size(group), dist.get_rank(group))

    @property
    def summing(self) -> bool:
        """Whether the step sums the gradients over the ranks itself (DDP, or an explicit
        ``process_group``); FSDP2 reduce-scatters them on its own."""
        return self.group is not None and not self.fsdp

    def no_sync(self) -> contextlib.AbstractContextManager:
        """DDP's ``no_sync`` for every micro-batch: the step sums the gradients itself (see
        :func:`mbs_ext.grads.sink_dtype`)."""
        return self.ddp.no_sync() if self.ddp is not None else _NO_CONTEXT

    def sync_buffers(self) -> None:
        """Rank 0's module buffers to every rank, once per step before the first micro-batch, as
        DDP's forward does each iteration (``broadcast_buffers``). DDP's own broadcast is switched
        off for the step's forwards: it would run in whichever forward comes first, which a rank
        that fails before it never reaches, leaving the others waiting."""
        ddp = self.ddp
        if ddp is None:
            return
        ddp.require_forward_param_sync = False  # DDP's own broadcast: off for the step's forwards
        if getattr(ddp, "broadcast_buffers", False):
            self._broadcast_buffers(ddp)

    @torch.no_grad()
    def _broadcast_buffers(self, ddp: DistributedDataParallel) -> None:
        ignore = getattr(ddp, "parameters_to_ignore", set())
        groups: dict[tuple, list[torch.Tensor]] = {}
        for name, b in ddp.module.named_buffers():
            if name not in ignore:
                groups.setdefault((b.device, b.dtype), []).append(b)
        src = dist.get_global_rank(self.group, 0)
        for bufs in groups.values():
            flat = torch._utils._flatten_dense_tensors(bufs)
            dist.broadcast(flat, src=src, group=self.group)
            for b, v in zip(bufs, torch._utils._unflatten_dense_tensors(flat, bufs)):
                b.copy_(v)

    def agree_micro_batches(self, local_total: Any, num_mb: int, device: torch.device,
                            failure: Failure | None = None) -> tuple[int, Any]:
        """FSDP2, before the first micro-batch: one all-reduce gives the largest number of
        micro-batches of any rank and the global total count, and tells every rank whether one
        failed before it (then every rank raises here). One host read: the loop needs its count."""
        counts = [0.0] * self.world
        counts[self.rank] = float(num_mb)
        values = self.all_reduce_sum([local_total], device, host_tail=counts + self.failure_slots(failure))
        tail = values[1:].tolist()
        self.raise_failures(tail[self.world:])
        return int(max(tail[: self.world])), values[0]

    def failure_slots(self, failure: Failure | None) -> list[float]:
        """This rank's part of the failure record that rides in the step's collective: per rank,
        1 + the micro-batch it failed at + 1 (0: no failure), then 1.0 per rank for out of memory."""
        slots = [0.0] * (2 * self.world)
        if failure is not None:
            slots[self.rank] = failure.micro_batch + 2.0
            slots[self.world + self.rank] = float(failure.out_of_memory)
        return slots

    def raise_failures(self, slots: list[float]) -> None:
        """Raise :class:`PeerFailed` naming every other rank that failed (``slots`` summed over the
        ranks and read on the host); nothing when no other rank did."""
        others = [r for r in range(self.world) if slots[r] > 0 and r != self.rank]
        if not others:
            return
        where = "; ".join(
            f"rank {r} {'ran out of memory' if slots[self.world + r] > 0 else 'raised'} "
            + ("before its first micro-batch" if slots[r] < 2 else f"at micro-batch {int(slots[r]) - 2}")
            for r in others
        )
        raise PeerFailed(
            f"mbs_ext.step: {where}; every rank undid the step (parameters, buffers, optimizer state and "
            "gradients are as before it), and the failing rank raised its own error",
            out_of_memory=out_of_memory_while_streaming(slots, self.world),
        )

    def agree_size(self, size: int | None, device: torch.device) -> int | None:
        """Out-of-memory back-off across ranks: the smallest micro-batch size any rank found
        (None where some rank found none). One all-reduce and one host read, on this path only."""
        t = torch.tensor([float(size or 0)], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item()) or None

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
