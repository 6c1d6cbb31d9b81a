"""What a streamer keeps between steps: the model's binding (parameters, device, world), the
ring, the ``"auto"`` plans and the sizes learned from out-of-memory back-off.

``mbs_ext.step`` keeps one per model, so calling it in a loop reuses all of it.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mbs_ext.memory import planner
from mbs_ext.model import members as _model
from mbs_ext.model.options import StepOptions
from mbs_ext.step import count_check
from mbs_ext.streaming.batch import BatchInfo
from mbs_ext.streaming.ring import StreamRing
from mbs_ext.streaming.tokens import row_lengths
from mbs_ext.world import World, world_of

Plans = dict[tuple, planner.MicroBatchPlan]  # "auto" plans, per input signature


@dataclass(frozen=True)
class Binding:
    """The model's parameters, device and world, and what they were found for."""

    key: tuple  # (optimizer, process group, device of the first parameter, torch.distributed world size)
    params: list[nn.Parameter]
    device: torch.device
    world: World


@dataclass
class StepCache:
    ring: StreamRing | None = None
    plans: Plans = field(default_factory=dict)
    size_cap: dict[tuple, int] = field(default_factory=dict)  # learned from out-of-memory back-off
    token_budgets: dict[tuple, int] = field(default_factory=dict)  # micro_batch_tokens="auto", by signature
    binding: Binding | None = None  # of the latest step
    counts_checked: set = field(default_factory=set)  # signatures whose count was checked (step.count_check)

    def bind(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, process_group: Any,
             found: _model.Members) -> Binding:
        """The model's trainable parameters (checked against the optimizer), its device and its world.

        The parameters are looked up every step (``found``: a user may freeze, thaw or add
        some between steps); the rest is redone when they, their device, the optimizer or
        the state of torch.distributed changed, so a steady loop skips the walks through the
        wrappers and the ownership check (what a framework's optimizer wrapper says is read
        every step: it changes inside its accumulation context).
        """
        params = _model.trainable(model, found)
        size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 0
        key = (optimizer, process_group, params[0].device, size)
        old = self.binding
        if (old is not None and old.key == key and len(old.params) == len(params)
                and all(map(operator.is_, old.params, params))):
            if optimizer is not None:
                _model.check_framework_optimizer(optimizer)
            return old
        self.binding = None
        params = _model.check_model_optimizer(model, optimizer, found)
        self.binding = Binding(key, params, _model.model_device(model), world_of(model, params, process_group))
        return self.binding

    def ring_for(self, device: torch.device) -> StreamRing:
        if self.ring is None or self.ring.device != device:
            self.ring = StreamRing(device)
        return self.ring

    def check_count(self, key: tuple, model: nn.Module, call: Any, options: StepOptions, size: int,
                    loss_fn: Any) -> None:
        """The loss's count checked on the first step of signature ``key`` (:mod:`mbs_ext.step.count_check`)."""
        count_check.check_once(self.counts_checked, key, model, call, options, size, loss_fn)

    def size_for(self, model: nn.Module, opts: StepOptions, batch: Any, info: BatchInfo, binding: Binding,
                 loss_call: Any) -> tuple[int, tuple]:
        """The size to stream with, and the key under which out-of-memory back-off remembers one."""
        if opts.micro_batch_size != "auto":
            key: tuple = ("fixed", info.signature)
            # Grouped by tokens without a row cap: the token budget alone bounds a micro-batch.
            m = info.rows if opts.micro_batch_size is None else int(opts.micro_batch_size)
        else:
            # Keyed on the caller's budget, not on a measured free-memory figure that
            # moves from step to step, so plans and back-off sizes stay remembered.
            # noise_scale: the step then accumulates in buffers, which the plan makes room for.
            key = ("auto", info.signature, opts.memory_budget, opts.autocast_dtype, opts.noise_scale)
            plan = self.plans.get(key)
            # A plan is capped by the rows of the batch it was made for; a larger batch
            # with the same signature may afford a larger micro-batch, so re-plan then.
            if plan is None or (plan.micro_batch_size >= plan.num_rows and info.rows > plan.num_rows):
                plan = planner.plan(
                    model, batch, loss_call, planner.default_budget(binding.device, opts.memory_budget),
                    num_rows=info.rows, indices=info.indices,
                    accumulate_dtype=binding.world.buffer_dtype(opts.accumulate_dtype, binding.params),
                    autocast_dtype=opts.autocast_dtype,
                )
                self.plans[key] = plan
            m = plan.micro_batch_size
        return max(1, min(m, self.size_cap.get(key, m), info.rows)), key

    def tokens_for(self, model: nn.Module, opts: StepOptions, batch: Any, info: BatchInfo, binding: Binding,
                   loss_call: Any) -> StepOptions:
        """``opts`` with the token budget to cut by: the caller's, or for ``"auto"`` the one planned
        for this input signature and budget (planned again where a batch's longest row would not
        fit the budget planned before: its micro-batch of one row was never measured)."""
        if not isinstance(opts.micro_batch_tokens, str):
            return opts
        key = ("auto", info.signature, opts.memory_budget, opts.autocast_dtype, opts.noise_scale)
        budget = self.token_budgets.get(key)
        if budget is None or int(row_lengths(batch, info, opts.token_lengths)[0].max()) > budget:
            budget, _ = planner.plan_token_budget(
                model, batch, loss_call, planner.default_budget(binding.device, opts.memory_budget), info=info,
                token_lengths=opts.token_lengths,
                accumulate_dtype=binding.world.buffer_dtype(opts.accumulate_dtype, binding.params),
                autocast_dtype=opts.autocast_dtype,
            )
            self.token_budgets[key] = budget
        return dataclasses.replace(opts, micro_batch_tokens=budget)
