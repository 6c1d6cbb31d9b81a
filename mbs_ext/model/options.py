"""The step's options: one frozen dataclass, validated once, shared by ``step`` and ``MicroBatchStreamer``.

Both entry points build a :class:`StepOptions` from their keyword arguments (or take one
and apply keyword overrides with :meth:`StepOptions.replace`), so the list of options,
their defaults and their checks exist here only.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

ON_NONFINITE = ("skip", "raise")
FSDP_ACCUMULATE = ("sharded", "unsharded")
NORMALIZE_RULES = ("samples", "micro_batches", "sum")

Normalize = str | Callable[[Any], "float | torch.Tensor"] | None


@dataclass(frozen=True)
class StepOptions:
    """How a streamed step runs; every field is checked when the object is made.

    * ``micro_batch_size``: int >= 1, the largest micro-batch (N rows are split into
      ``ceil(N / m)`` micro-batches whose sizes differ by at most one), or ``"auto"``:
      the largest size whose step fits ``memory_budget`` bytes, planned from probe
      micro-batches and cached per input signature. ``memory_budget`` defaults to what
      the device can still give on CUDA and is required on CPU.
    * ``normalize``: how micro-batch losses combine into the mini-batch loss.
      ``None`` (default): read from a ``torch.nn`` loss module (its reduction, class
      weights and ignored targets), else ``"samples"``. ``"samples"``: each loss is a
      mean over its rows (weight n_i/N). ``"sum"``: each loss is a sum (weight 1).
      ``"micro_batches"``: weight 1/M (the papers' rule, wrong for unequal sizes; for
      comparison). A callable ``count(micro_batch)`` returns the number (or total
      weight: any non-negative finite float) of items the micro-batch's loss averages
      over, e.g. its tokens; a device tensor stays on the device (no host sync).
    * ``scaler``: a ``torch.amp.GradScaler``; the loss is scaled per micro-batch and the
      gradient unscaled, checked, stepped and updated once.
    * ``autocast_dtype``: forward and loss run under ``torch.autocast`` in this dtype.
    * ``accumulate_dtype``: dtype of separate accumulation buffers; by default float32
      when any trainable parameter is bf16/fp16, otherwise autograd adds into ``.grad``.
    * ``max_grad_norm``: clip the total norm of the final unscaled gradient.
    * ``on_nonfinite``: ``"skip"`` (warn, change nothing but a GradScaler's scale) or
      ``"raise"`` (FloatingPointError, nothing changed). ``accumulate`` skips by leaving
      ``.grad`` as it was (``skipped=True``, with the warning), or raises with ``"raise"``.
    * ``memory_budget``: bytes the step may use, for ``micro_batch_size="auto"``.
    * ``process_group``: a ``torch.distributed`` process group the model is replicated over
      when the step cannot find DistributedDataParallel in it (a wrapper it does not know):
      the step then sums the counts and the gradients over that group itself (the wrapper
      must not sync gradients). Not needed for DDP and FSDP2, whose groups are read.
    * ``fsdp_accumulate``: under FSDP2, ``"sharded"`` (reduce-scatter every micro-batch:
      1/world of the gradient memory) or ``"unsharded"`` (full gradients accumulate, one
      reduce-scatter at the end: fewer collectives, more memory).
    * ``micro_batch_tokens``: int >= 1: split a padded sequence batch by tokens, not rows
      (docs/tokens.md). Rows are grouped by length, each micro-batch holds at most this
      many tokens counting padding (rows x width) and is trimmed along dim 1 to its longest
      row (every tensor leaf whose dim 1 is the padded width: ids, masks, labels, position
      ids). ``micro_batch_size`` (an int) then caps the rows, or is left out. The batch
      must be right-padded; left padding, labels that are not -100 at padding positions and
      a row longer than the budget are refused before anything runs. ``"auto"``: the largest
      budget whose micro-batch of the longest rows fits ``memory_budget``, planned (as
      ``micro_batch_size="auto"`` plans rows) at the first step and cached per input signature.
    * ``check_count``: after the first step of each input signature that streams more than one
      micro-batch, check with three forwards (the first micro-batch and its halves, no backward)
      that a loss given as a callable averages over the count the step weighs by (the rows, or
      the ``normalize`` given),
      and warn (``CountWarning``) naming the count that fits where it does not
      (:mod:`mbs_ext.counts.agreement`). ``False`` turns the check off.
    * ``token_lengths``: where row lengths come from with ``micro_batch_tokens``: None (the
      batch's ``"attention_mask"`` leaf), the dict key of another 0/1 mask, or a callable
      ``lengths(batch)`` returning a 1-d integer tensor, one length per row.
    * ``noise_scale``: measure the gradient noise scale from the step's own micro-batches
      (``StepResult.noise``, docs/noise-scale.md): each micro-batch's squared gradient norm is
      summed by the op that adds it into the accumulation buffers (which the step then uses
      whatever the parameters' dtype: one gradient's memory more), counted by the step's own
      counts. Needs a mean loss (``normalize`` "samples" or a count) and two micro-batches or
      more; not under FSDP2 yet.
    """

    micro_batch_size: int | str | None = None
    normalize: Normalize = None
    scaler: torch.amp.GradScaler | None = None
    autocast_dtype: torch.dtype | None = None
    max_grad_norm: float | None = None
    accumulate_dtype: torch.dtype | None = None
    on_nonfinite: str = "skip"
    memory_budget: int | None = None
    fsdp_accumulate: str = "sharded"
    process_group: Any = None
    micro_batch_tokens: int | str | None = None
    token_lengths: str | Callable[[Any], torch.Tensor] | None = None
    check_count: bool = True
    noise_scale: bool = False

    def __post_init__(self) -> None:
        if self.micro_batch_size is None and self.micro_batch_tokens is None:
            raise TypeError("micro_batch_size is required (an int >= 1 or 'auto') unless micro_batch_tokens is given")
        if self.micro_batch_size is not None:
            _check_micro_batch_size(self.micro_batch_size)
        _check_tokens(self.micro_batch_tokens, self.token_lengths, self.micro_batch_size)
        check_normalize(self.normalize)
        if self.scaler is not None and not isinstance(self.scaler, torch.amp.GradScaler):
            raise TypeError(f"scaler must be a torch.amp.GradScaler or None, got {type(self.scaler).__name__}")
        _check_dtype(self.autocast_dtype, "autocast_dtype")
        _check_dtype(self.accumulate_dtype, "accumulate_dtype")
        if self.max_grad_norm is not None:
            object.__setattr__(self, "max_grad_norm", _check_max_grad_norm(self.max_grad_norm))
        if self.on_nonfinite not in ON_NONFINITE:
            raise ValueError(f"on_nonfinite must be one of {ON_NONFINITE}, got {self.on_nonfinite!r}")
        check_memory_budget(self.memory_budget)
        if self.process_group is not None and not isinstance(self.process_group, torch.distributed.ProcessGroup):
            raise TypeError("process_group must be a torch.distributed.ProcessGroup (e.g. dist.group.WORLD) or "
                            f"None, got {type(self.process_group).__name__}")
        if self.fsdp_accumulate not in FSDP_ACCUMULATE:
            raise ValueError(f"fsdp_accumulate must be one of {FSDP_ACCUMULATE}, got {self.fsdp_accumulate!r}")
        if not isinstance(self.check_count, bool):
            raise TypeError(f"check_count must be a bool, got {type(self.check_count).__name__}")
        if not isinstance(self.noise_scale, bool):
            raise TypeError(f"noise_scale must be a bool, got {type(self.noise_scale).__name__}")

    def replace(self, **overrides: Any) -> StepOptions:
        """A copy with ``overrides`` applied (and checked; an unknown name is named)."""
        check_names(overrides)
        return dataclasses.replace(self, **overrides) if overrides else self

    @property
    def clipping(self) -> bool:
        return self.max_grad_norm is not None


def make_options(options: StepOptions | None, overrides: dict[str, Any]) -> StepOptions:
    """``options`` with keyword ``overrides``, or options built from the keywords alone. An unknown
    keyword is named, with the option it most likely meant (a typo must not read as a missing
    ``micro_batch_size`` or a bare ``TypeError`` from the dataclass)."""
    check_names(overrides)
    if options is None:
        if "micro_batch_size" not in overrides and "micro_batch_tokens" not in overrides:
            raise TypeError("micro_batch_size is required (an int >= 1 or 'auto'), or micro_batch_tokens, or pass "
                            "options=StepOptions(...)")
        return StepOptions(**overrides)
    if not isinstance(options, StepOptions):
        raise TypeError(f"options must be a mbs_ext.StepOptions, got {type(options).__name__}")
    return options.replace(**overrides)


_FIELDS = frozenset(f.name for f in dataclasses.fields(StepOptions))


def check_names(overrides: dict[str, Any]) -> None:
    """Raise naming every keyword that is no option, with the option it most likely meant."""
    unknown = [k for k in overrides if k not in _FIELDS]
    if unknown:
        raise TypeError("; ".join(_unknown(k) for k in unknown))


def _unknown(key: str) -> str:
    close = difflib.get_close_matches(key, sorted(_FIELDS), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}=?" if close else f"the options are {', '.join(sorted(_FIELDS))}"
    return f"unknown option {key}= ({hint})"


def check_normalize(normalize: Any) -> None:
    """None, a known rule name, or a callable."""
    if normalize is None or (callable(normalize) and not isinstance(normalize, str)):
        return
    if isinstance(normalize, str):
        if normalize not in NORMALIZE_RULES:
            raise ValueError(f"normalize must be one of {NORMALIZE_RULES}, None or a callable, got {normalize!r}")
        return
    raise TypeError(
        f"normalize must be one of {NORMALIZE_RULES}, None or a callable count(micro_batch), "
        f"got {type(normalize).__name__}"
    )


def check_memory_budget(memory_budget: Any) -> None:
    """None or a positive, finite number of bytes."""
    if memory_budget is None:
        return
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float)):
        raise TypeError(f"memory_budget must be a number of bytes (int), got {type(memory_budget).__name__}")
    if not math.isfinite(memory_budget) or memory_budget <= 0:
        raise ValueError(f"memory_budget must be a positive number of bytes, got {memory_budget!r}")


def _check_micro_batch_size(micro_batch_size: Any) -> None:
    if isinstance(micro_batch_size, str):
        if micro_batch_size != "auto":
            raise ValueError(f"micro_batch_size must be an int >= 1 or 'auto', got {micro_batch_size!r}")
        return
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, numbers.Integral):
        raise TypeError(f"micro_batch_size must be an int >= 1 or 'auto', got {type(micro_batch_size).__name__}")
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be an int >= 1, got {micro_batch_size}")


def _check_tokens(tokens: Any, lengths: Any, micro_batch_size: Any) -> None:
    if tokens is None:
        if lengths is not None:
            raise ValueError("token_lengths is read only with micro_batch_tokens: pass micro_batch_tokens=T too")
        return
    if isinstance(tokens, str):  # "auto": planned from memory_budget at the first step (memory/planner.py)
        if tokens != "auto":
            raise ValueError(f"micro_batch_tokens must be an int >= 1, 'auto' or None, got {tokens!r}")
    elif isinstance(tokens, bool) or not isinstance(tokens, numbers.Integral):
        raise TypeError(f"micro_batch_tokens must be an int >= 1, 'auto' or None, got {type(tokens).__name__}")
    elif tokens < 1:
        raise ValueError(f"micro_batch_tokens must be an int >= 1, got {tokens}")
    if micro_batch_size == "auto":
        raise ValueError("micro_batch_tokens bounds the micro-batches itself: with it, micro_batch_size is a cap on "
                         "rows (an int) or None, not 'auto'")
    if lengths is not None and not isinstance(lengths, str) and not callable(lengths):
        raise TypeError("token_lengths must be None (the batch's 'attention_mask'), the dict key of a 0/1 mask, or "
                        f"a callable(batch) returning each row's length, got {type(lengths).__name__}")


def _check_dtype(value: Any, name: str) -> None:
    if value is None:
        return
    if not isinstance(value, torch.dtype):
        raise TypeError(f"{name} must be a floating torch.dtype or None, got {type(value).__name__}")
    if not value.is_floating_point:
        raise ValueError(f"{name} must be a floating dtype, got {value}")


def _check_max_grad_norm(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"max_grad_norm must be a positive number or None, got {type(value).__name__}")
    if math.isnan(value) or value <= 0:
        raise ValueError(f"max_grad_norm must be > 0, got {value}")
    return float(value)
