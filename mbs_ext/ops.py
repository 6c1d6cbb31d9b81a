"""Python face of the fused ``mbs_ext::scale_accumulate_`` op.

Every argument is checked before anything is written, and errors name the argument
(``grads[3]``). The checks are C++, written once (csrc/ops/arguments.{h,cpp}) for the
kernels, for this module and for the fake kernel. An eager call crosses into C++ once:
``_C._scale_accumulate`` checks the arguments and runs the kernel of their device, and
returns a fault rather than raising it, so that a bad argument raises here, in Python,
and never as a C++ exception. Python keeps what that crossing leaves to it: sequences
other than lists and tuples, numbers other than finite floats and ints, 16-bit scale
tensors, DTensors, and calls the dispatcher must see (torch.compile, fake tensors and
other tensor subclasses, dispatch and torch-function modes, profilers), which go through
the registered op; under torch.compile its fake kernel runs the checks that need no data.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import torch

from mbs_ext._native import _C  # also loads the op registrations

_OP = torch.ops.mbs_ext.scale_accumulate_


@torch.library.register_fake("mbs_ext::scale_accumulate_")
def _scale_accumulate_fake(accumulators, grads, scale, found_inf, sq_norm=None) -> None:
    # The kernels' checks but those that read memory (alignment, overlap): fake tensors
    # have none. In-place op with no outputs: nothing else to describe.
    _raise(_C._scale_accumulate(accumulators, grads, scale, found_inf, False, sq_norm))


def _raise(fault: tuple[str, str] | None) -> None:
    """Raises a fault the C++ checks report as ``("type" | "value", message)``."""
    if fault is not None:
        kind, message = fault
        raise (TypeError if kind == "type" else ValueError)(message)


def _as_list(name: str, seq: object) -> list:
    if isinstance(seq, list):
        return seq
    if isinstance(seq, torch.Tensor) or isinstance(seq, (str, bytes)) or not isinstance(seq, Sequence):
        raise TypeError(f"{name} must be a list or tuple of tensors, got {type(seq).__name__}")
    return list(seq)


def _as_scale(scale: float | torch.Tensor) -> torch.Tensor:
    """A Python number as a float64 CPU scalar (read by value: no copy to a device); a 16-bit
    float tensor as float32 on its own device (no host sync); other tensors as they are."""
    if isinstance(scale, torch.Tensor):
        if scale.dtype in (torch.float16, torch.bfloat16):
            scale = scale.to(torch.float32)
        return scale.detach()
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a Python number or a 0-dim tensor, got {type(scale).__name__}")
    try:
        value = float(scale)
    except OverflowError:  # an int beyond any float (10**400)
        raise ValueError("scale must be finite, got an int too large for a float") from None
    if not math.isfinite(value):
        raise ValueError(f"scale must be finite, got {value}")
    return torch.tensor(value, dtype=torch.float64)


def is_dtensor(t: Any) -> bool:
    """A ``torch.distributed.tensor.DTensor`` (FSDP2's parameters and gradients)."""
    dtensor = getattr(getattr(torch.distributed, "tensor", None), "DTensor", None)
    return dtensor is not None and isinstance(t, dtensor)


def _refuse_dtensors(*groups: Any) -> None:
    """DTensors (FSDP2's sharded gradients) have no sharding rule for the op: refused with the
    fix, instead of the dispatcher's error about shared memory."""
    for name, group in zip(("accumulators", "grads", "found_inf", "sq_norm"), groups):
        items = group if isinstance(group, list) else [group]
        if any(is_dtensor(t) for t in items):
            raise TypeError(f"{name} holds DTensors (sharded, e.g. FSDP2 gradients), which scale_accumulate_ does "
                            "not take: pass their local shards ([t.to_local() for t in ...]), which it adds "
                            "shard by shard")


def _dispatched(accumulators: Any, grads: Any, scale: Any, found_inf: torch.Tensor | None,
                sq_norm: torch.Tensor | None) -> torch.Tensor:
    """The call through the registered op, for what the one crossing leaves to Python."""
    accumulators = _as_list("accumulators", accumulators)
    grads = _as_list("grads", grads)
    _refuse_dtensors(accumulators, grads, found_inf, sq_norm)
    scale = _as_scale(scale)
    if found_inf is None:  # on the tensors' device: accumulators[0]'s, else sq_norm's, else scale's, else the CPU
        first = accumulators[0] if accumulators else sq_norm if isinstance(sq_norm, torch.Tensor) else scale
        device = first.device if isinstance(first, torch.Tensor) else torch.device("cpu")
        found_inf = torch.zeros((), dtype=torch.float32, device=device)
    if not torch.compiler.is_compiling():  # traced, the fake kernel checks
        _raise(_C._scale_accumulate(accumulators, grads, scale, found_inf, False, sq_norm))
    _OP(accumulators, grads, scale, found_inf, sq_norm)
    return found_inf


def scale_accumulate_(
    accumulators: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    scale: float | torch.Tensor,
    found_inf: torch.Tensor | None = None,
    sq_norm: torch.Tensor | None = None,
) -> torch.Tensor:
    """``accumulators[i] += scale * grads[i]`` for every i, in one fused pass.

    Math runs in float32 (float64 for float64 accumulators), so bf16/fp16 gradients
    can accumulate into float32 buffers without a cast copy. ``found_inf`` (a 0-dim
    float32 tensor on the tensors' device) is set to 1.0 when any grad holds inf or
    NaN and is never reset here; it is created when not given and returned. Nothing
    here synchronizes with the GPU: ``scale`` may be a device tensor and is not checked (a
    non-finite one makes the accumulators non-finite without setting ``found_inf``).

    ``sq_norm`` (a 0-dim float32 or float64 tensor on the tensors' device): when given, the
    op adds to it the sum of squares of every element of every grad, as read (before
    ``scale``), in the same pass over the grads: ``sq_norm += sum(g.double()**2 for g in
    grads)``, with no extra read of memory and no host sync. On the CPU the squares are
    summed in float64 in fixed blocks (one call gives the same sum every run), except float32
    grads into float32 accumulators where the CPU has AVX2: squared in float32, at most 8 to a
    float32 partial sum, then float64 (within 5e-7 relative; widening each grad cost more than
    the pass itself). On CUDA: float per thread, float64 per block, one atomic add per block
    (whose block order, and so last bits, vary). Never reset here: several calls add up. A
    non-finite grad makes it inf or NaN (``found_inf`` flags it too); where squares are taken
    in float32 (float32 grads, and CUDA) so does a finite grad past about 1.8e19, which
    ``found_inf`` does not flag. Without it the op runs as it did before it existed.

    Raises TypeError/ValueError naming the argument for: lists of different lengths,
    non-tensors, non-float or sparse tensors, shape or device mismatches, devices
    other than cpu/cuda, tensors that require grad while grad mode is on (the op is
    not differentiable), expanded accumulators, a found_inf or sq_norm of the wrong
    dtype or shape, and accumulators, a found_inf or a sq_norm that share memory with
    another argument.
    """
    if not torch.compiler.is_compiling():
        out = _C._scale_accumulate(accumulators, grads, scale, found_inf, True, sq_norm)
        if type(out) is tuple:
            _raise(out)
        if out is not None:
            return out
    return _dispatched(accumulators, grads, scale, found_inf, sq_norm)


def sum_squares_(tensors: Sequence[torch.Tensor], sq_norm: torch.Tensor, found_inf: torch.Tensor) -> None:
    """``sq_norm += sum(t.double() ** 2 for t in tensors)`` and ``found_inf = 1.0`` where an element
    is inf or NaN, in one read of the tensors: the op's loop with its squares, without the update
    (the same sums: float32 tensors squared in float32 a few at a time, the rest in float64).

    With the noise scale: the squares of each parameter's first gradient, and once a step the
    squared norm of the accumulated gradient with its non-finite check (mbs_ext/model/grads.py).
    CPU only, and a helper rather than an op: the tensors must be dense CPU float tensors
    (contiguous or channels_last: no overlap, no gap), ``sq_norm`` a 0-dim float64/float32 and
    ``found_inf`` a 0-dim float32 CPU tensor (ValueError naming the argument otherwise).
    """
    _C._sum_squares(_as_list("tensors", tensors), sq_norm, found_inf)


def noise_tap(params: Sequence[torch.Tensor], found_inf: torch.Tensor) -> Any:
    """Hooks before autograd's accumulation into each of ``params``' ``.grad``, within a step: from
    ``begin()`` (every ``.grad`` empty), on from the step's second ``weigh()`` to its ``end()`` or
    ``finish()``. A parameter's first gradient of the step becomes its ``.grad`` as it is (the
    first micro-batch's as autograd takes them, with no hook at all), each later one is added
    into it by the op's CPU loop with its squares, in the one pass over the sum that autograd's own
    addition would make, while the gradient is still in the caches. The squares go to the running
    micro-batch's sum (``weigh(loss, weight)`` weighs a micro-batch's loss and begins it;
    ``squares()`` lists the sums, host floats); ``read_pending()`` adds the squares of sums that are
    still a first gradient to the micro-batch it came with; ``finish()`` reads the final sums'
    squared norm with their non-finite check, takes the hooks off and says whether a gradient came
    in parts within a micro-batch. No Python runs per parameter
    (csrc/ops/noise_tap.h). The noise scale's sums on the CPU (mbs_ext/model/grads.py). A helper
    as :func:`sum_squares_` is: dense CPU float parameters that are leaves requiring grad, a 0-dim
    float32 ``found_inf`` set on inf/NaN (cleared by ``begin()``)."""
    return _C._NoiseTap(_as_list("params", params), found_inf)


def add_squares_(accumulators: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], sq_norm: torch.Tensor,
                 acc_sq_norm: torch.Tensor | None, found_inf: torch.Tensor) -> None:
    """``accumulators[i] += grads[i]`` with ``sq_norm`` += the grads' squares (as the op sums them),
    in one pass; ``found_inf = 1.0`` where a grad is inf or NaN. With ``acc_sq_norm``, in the same
    pass also ``acc_sq_norm`` += the squares of the accumulators as read, before the update, and
    ``found_inf`` set where one of them is inf or NaN.

    The kernel the noise tap runs inside the backward (:func:`noise_tap`): the first addition into
    a sum that is still one micro-batch's gradient as it was taken gives that gradient's squares
    without a read of its own (``acc_sq_norm``), later ones only the grads' (the accumulators'
    squares cost a pass over a sum out of the caches 10-15% more).
    CPU only, a helper as :func:`sum_squares_` is: each accumulator a dense CPU float tensor laid
    out as its grad (ValueError naming the argument otherwise).
    """
    _C._add_squares(_as_list("accumulators", accumulators), _as_list("grads", grads), sq_norm, acc_sq_norm,
                    found_inf)
