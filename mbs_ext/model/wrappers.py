"""Finding the DistributedDataParallel module and the plain module through wrappers.

A model handed to the step may be DistributedDataParallel itself or wrapped around it
(``torch.compile``'s ``OptimizedModule``, framework wrappers exposing ``.module``). Only
DDP's ``no_sync`` keeps micro-batches from all-reducing, and only its process group says
what "global" means; probes need the plain module under all of them (no collectives).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

# Attributes through which wrappers expose the module they wrap: torch.compile's
# OptimizedModule (_orig_mod), Lightning Fabric's _FabricModule (_forward_module: what its
# forward calls, the DDP module; its ``.module`` is the *unwrapped* model), and ``.module``
# (DDP itself, Accelerate, most others).
WRAPPED = ("_orig_mod", "_forward_module", "module")


def _inner(m: Any) -> list[nn.Module]:
    """The modules ``m`` exposes as wrapped, in :data:`WRAPPED` order."""
    out = []
    for a in WRAPPED:
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
