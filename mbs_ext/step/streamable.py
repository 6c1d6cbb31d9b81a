"""Whether a loss streams exactly: the streamed gradient against the full batch's, on a sample.

Losses that add up over rows stream exactly; a loss that couples the rows (in-batch
negatives) or BatchNorm in training mode does not, silently. :func:`check_streamable` tells
which, with the streamed step itself (not a copy of its rules) on a float64 copy of the model.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from mbs_ext.memory.probe import probing
from mbs_ext.model.members import model_device
from mbs_ext.step.streamer import accumulate
from mbs_ext.streaming import batch as _batch
from mbs_ext.streaming.ring import split_sizes

__all__ = ["check_streamable"]


def check_streamable(model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], torch.Tensor], *,
                     micro_batch_size: int, rows: int = 32, tol: float = 1e-6, **options: Any) -> None:
    """Raise ValueError when streaming ``loss_fn`` in micro-batches of ``micro_batch_size`` gives
    another gradient than the full batch; return quietly for losses that add up over rows.

    On the first ``rows`` rows of ``batch`` (split so there are at least two micro-batches),
    a float64 copy of the model takes the gradient once as one micro-batch and once streamed
    (``options`` as for :func:`mbs_ext.accumulate`, e.g. ``normalize=``). Dropout is off in the
    copies (its draws differ by split anyway); BatchNorm in training mode stays on, since its
    per-micro-batch statistics are a cause of difference the message names. The model, its
    ``.grad``, buffers and the RNG are untouched.
    """
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be an int >= 1 for check_streamable, got {micro_batch_size!r}")
    info = _batch.check(batch, None, model_device(model))
    n = min(rows, info.rows)
    if n < 2:
        raise ValueError(f"check_streamable needs at least 2 rows to split, the batch has {info.rows}")
    sample = pytree.tree_map(_as_float64, _batch.take(batch, torch.arange(n)))
    m = min(micro_batch_size, max(1, n // 2))
    grads = []
    # probing() puts the RNG streams back (the CPU's and, for a CUDA model, the device's), as
    # after the planner's probes; the model's own buffers and .grad are not touched here.
    with probing(model, model_device(model)), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for size in (n, m):
            twin = _float64_twin(model)
            accumulate(twin, sample, loss_fn, micro_batch_size=size, **options)
            grads.append([p.grad for p in twin.parameters() if p.grad is not None])
    full, streamed = grads
    worst = max((_rel(a, b) for a, b in zip(streamed, full)), default=0.0)
    if len(full) != len(streamed) or worst > tol:
        with probing(model, model_device(model)), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cause = _cause(model, sample, loss_fn, n, m, options)
        raise ValueError(
            f"check_streamable: the streamed gradient differs from the full batch's by {worst:.2e} (relative, float64, "
            f"{n} rows in micro-batches of {m}): {cause}"
        )


def _cause(model: nn.Module, sample: Any, loss_fn: Callable, n: int, m: int, options: dict) -> str:
    """Why the streamed gradient differs: BatchNorm, the count the loss averages over, or rows coupled.

    A loss that averages over items is, on the whole sample, a weighted mean of the micro-batches'
    own losses - its gradient ``G = sum_i w_i g_i`` with ``w_i`` each micro-batch's share of the items
    (all 1 for a sum). The weights are found by least squares from each micro-batch's gradient
    alone (``g_i``, one micro-batch: weight 1 whatever the count); where they reproduce ``G``, the
    loss adds up and only the count given is off, and the count that fits is named where one of the
    usual ones does. Where no weights do, the loss couples the rows."""
    if any(isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod.training for mod in model.modules()):
        return ("BatchNorm layers in training mode normalize each micro-batch by its own rows (and the loss may "
                "couple rows too). For the full batch's gradient put them in eval mode or use a normalization over "
                "each row (nn.GroupNorm, nn.LayerNorm); for a loss over the whole mini-batch's encodings use "
                "mbs_ext.CachedLoss(encode, loss)")
    sizes = split_sizes(n, m)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    parts = [_batch.take(sample, torch.arange(a, a + k)) for a, k in zip(starts, sizes)]
    columns = [_flat_grad(model, part, loss_fn, options) for part in [*parts, sample]]
    full = columns.pop()
    g = torch.stack(columns, dim=1)
    w = torch.linalg.lstsq(g, full[:, None]).solution[:, 0]
    residual = ((g @ w - full).norm() / full.norm().clamp_min(1e-300)).item()
    if residual > 1e-6:
        return ("the loss couples the rows (each micro-batch would see only its own, e.g. in-batch negatives): "
                "no weighting of the micro-batches' own gradients gives the full batch's. For a loss over the whole "
                "mini-batch's encodings use mbs_ext.CachedLoss(encode, loss)")
    shares = [round(v, 4) for v in w.tolist()]
    fitting = [name for name, counts in _candidates(parts, options).items() if _fits(w, counts, name != '"sum"')]
    said = (f"the count that fits: normalize={fitting[0]}" if fitting else
            "none of the usual counts fits: pass normalize=count(micro_batch) returning the items the loss "
            "averages over")
    return (f"the loss adds up over rows, but not over the count the step weighed the micro-batches by: the full "
            f"batch weighs the {len(sizes)} micro-batches' own losses by {shares}. Say what the loss averages over "
            f"with normalize= ({said})")


def _flat_grad(model: nn.Module, part: Any, loss_fn: Callable, options: dict) -> torch.Tensor:
    """The gradient of ``loss_fn`` on ``part`` as one micro-batch (weight 1), flattened."""
    twin = _float64_twin(model)
    kept = {k: v for k, v in options.items() if k not in ("normalize", "micro_batch_size")}
    accumulate(twin, part, loss_fn, micro_batch_size=_batch.check(part, None, model_device(twin)).rows, **kept)
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).cpu()
                      for p in twin.parameters() if p.requires_grad])


def _candidates(parts: list[Any], options: dict) -> dict[str, list[float]]:
    """The usual counts of each micro-batch, by how ``normalize=`` would name them."""
    rows = [float(_batch.check(p, None, torch.device("cpu")).rows) for p in parts]
    out = {'"sum"': [1.0] * len(parts), '"samples" (the rows)': rows}
    given = options.get("normalize")
    if callable(given):
        out["the normalize callable given"] = [float(given(p)) for p in parts]
    if all(isinstance(p, dict) and isinstance(p.get("labels"), torch.Tensor) for p in parts):
        out['lambda mb: (mb["labels"][..., 1:] != -100).sum() (a causal LM\'s shifted labels)'] = [
            float((p["labels"][..., 1:] != -100).sum()) for p in parts]
        out['lambda mb: (mb["labels"] != -100).sum()'] = [float((p["labels"] != -100).sum()) for p in parts]
    return out


def _fits(w: torch.Tensor, counts: list[float], share: bool) -> bool:
    """Whether weights ``w`` are the counts' shares (a mean), or with ``share=False`` the counts
    themselves (a sum)."""
    c = torch.tensor(counts, dtype=w.dtype)
    if c.sum() <= 0:
        return False
    target = c / c.sum() if share else c
    return bool(((w - target).abs() <= 1e-6 * target.abs().max()).all())
def _as_float64(x: Any) -> Any:
    return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _float64_twin(model: nn.Module) -> nn.Module:
    twin = copy.deepcopy(model).double()
    for mod in twin.modules():
        if isinstance(mod, nn.modules.dropout._DropoutNd):
            mod.eval()
    return twin


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    den = b.norm().item()
    return (a - b).norm().item() / (den if den > 0 else 1.0)
