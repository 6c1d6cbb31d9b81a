"""The ``loss_fn(model, batch)`` convention: adapt ``torch.nn`` losses, read how they average, check results.

A ``torch.nn`` loss module is called as ``loss_fn(model(inputs), targets)`` on an
``(inputs, targets)`` batch, and its configuration says how micro-batch losses combine
(:func:`rule_for`): ``reduction="sum"`` adds sums; ``CrossEntropyLoss``/``NLLLoss``/
``LinearCrossEntropyLoss`` with class-index targets average over the weight of their
non-ignored targets (``sum(weight[target])``, or their number without ``weight``; label
smoothing divides by the same), counted on the device; every other built-in mean
(probability targets, MSE, BCE with ``pos_weight``, Huber, ``KLDivLoss(reduction=
"batchmean")``...) averages over a fixed number of items per row, so ``"samples"`` is
exact for it. A subclass with its own ``forward`` is not guessed at: it needs an
explicit ``normalize``.

A loss written the other way round, as ``loss(prediction, target)``, is the usual first
mistake: a torch function passed as ``loss_fn`` is refused before the step
(:func:`check_loss_fn`), and any other callable that fails because it got the model where it
expected a prediction gets a note on its error naming the convention and the one-line fix
(:func:`loss_caller`); both say it in the words of :func:`_pair_fix`.

What ``loss(model(inputs), targets)`` cannot make exact is refused (:func:`loss_caller`):
a forward taking more than (input, target) (``GaussianNLLLoss``, ``CTCLoss``, the pair
and triplet losses), before the step starts; a loss owning trainable parameters that are
not the model's (``LinearCrossEntropyLoss``'s projection outside the model: the step
normalizes, zeroes and rolls back only the model's parameters), at its first call, undone.

Also the autocast context the forward runs in, shared by the step and the planner's
probes so both measure the same computation.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.modules.loss import _Loss

from mbs_ext.counts.normalize import Rule, rule_of
from mbs_ext.messages import add_note

LossCall = Callable[[nn.Module, Any], torch.Tensor]

# Functions of the (prediction, target) convention that users pass by mistake.
_PAIR_FUNCTION_MODULES = ("torch.nn.functional", "torch", "torch._C._nn", "torch.nn.modules.loss")


def check_loss_fn(loss_fn: Any) -> None:
    """Refuse what cannot be called as ``loss_fn(model, batch)``, naming the fix."""
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(model, batch), got {type(loss_fn).__name__}")
    if isinstance(loss_fn, nn.Module) and not isinstance(loss_fn, _Loss):
        return
    module = getattr(loss_fn, "__module__", None) or ""
    name = getattr(loss_fn, "__name__", "")
    if not isinstance(loss_fn, _Loss) and module in _PAIR_FUNCTION_MODULES and name:
        raise TypeError(_pair_fix(f"loss_fn is {module}.{name}, a (prediction, target) function", name))


def _pair_fix(what: str, name: str) -> str:
    """The message for a ``loss(prediction, target)`` given as ``loss_fn``: ``what`` it is, the
    convention, and the fix with the loss called ``name`` (the one wording for both checks)."""
    return (
        f"{what}; mbs_ext calls loss_fn(model, micro_batch). Pass a torch.nn loss module (e.g. "
        "nn.CrossEntropyLoss(): the step calls it as loss(model(inputs), targets)) or, for an (inputs, targets) "
        f"batch, loss_fn=lambda model, b: {name}(model(b[0]), b[1])"
    )


# Names that say a variable holds a prediction (torch's losses call theirs ``input``).
_PREDICTION_NAMES = frozenset({"pred", "preds", "prediction", "predictions", "predicted", "output", "outputs", "out",
                               "input", "inputs", "logits", "y_pred", "y_hat", "yhat", "scores"})
_FORWARD_FRAMES = frozenset({"_call_impl", "_wrapped_call_impl", "forward", "__call__"})


def _pair_note(exc: BaseException, loss_fn: Callable, model: nn.Module, micro_batch: Any) -> str | None:
    """The note for ``exc``, raised by ``loss_fn(model, micro_batch)``, when ``loss_fn`` looks
    written as ``loss(prediction, target)``; None when nothing says so.

    Read only once the call failed, from what is certain: a TypeError or AttributeError (what
    a module given where a tensor is expected raises) while the model's forward was not running
    (an error inside the model is the model's), and one of: the callable cannot take two
    arguments; the error says the model was taken for a tensor (:func:`_used_as_tensor`); a frame
    of the traceback holds the model under a prediction's name (``pred``, ``logits``, torch's
    ``input``...). A loss written for ``(model, micro_batch)`` that fails on its own has the
    model under its own name, or a prediction (a tensor) under those names, and gets no note.
    """
    if not isinstance(exc, (TypeError, AttributeError)):
        return None
    as_prediction = False
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name in _FORWARD_FRAMES and frame.f_locals.get("self") is model:
            return None
        as_prediction = as_prediction or any(v is model and k.lower() in _PREDICTION_NAMES
                                             for k, v in frame.f_locals.items())
        tb = tb.tb_next
    try:  # a module's own signature is (*args, **kwargs): read its forward's
        signature = inspect.signature(loss_fn.forward if isinstance(loss_fn, nn.Module) else loss_fn)
        binds = signature.bind(model, micro_batch) is not None
    except ValueError:  # no signature to read (a builtin)
        binds = True
    except TypeError:
        binds = False
    if binds and not as_prediction and not _used_as_tensor(exc, model):
        return None
    if isinstance(loss_fn, nn.Module):
        cls = type(loss_fn).__name__
        return _pair_fix(f"loss_fn is a {cls} module whose forward seems to take (prediction, target)",
                         "loss") + f", with loss your {cls} instance"
    name = getattr(loss_fn, "__name__", "")
    if not name.isidentifier():  # a lambda
        return _pair_fix("loss_fn seems written as loss(prediction, target)", "your_loss")
    return _pair_fix(f"loss_fn {name} seems written as {name}(prediction, target)", name)


def _used_as_tensor(exc: BaseException, model: nn.Module) -> bool:
    """Whether ``exc`` says the model was taken for a tensor: a tensor's attribute looked up on it
    (``pred.argmax``; a missing attribute of its own, ``model.nett``, is another mistake), torch
    naming the model's class where it wanted a tensor (``must be Tensor, not Sequential``), or an
    operator given it (``unsupported operand type(s) for -: 'Sequential' and 'tuple'``). Other
    errors that name the class (a method called with the wrong arguments) say nothing of it."""
    cls, text = re.escape(type(model).__name__), str(exc)
    missing = re.match(r"'(\w+)' object has no attribute '(\w+)'", text)
    if isinstance(exc, AttributeError):
        return bool(missing and missing.group(1) == type(model).__name__ and hasattr(torch.Tensor, missing.group(2)))
    return re.search(rf"\bnot {cls}\b|operand type.*'{cls}'|'{cls}' object is not (subscriptable|iterable)",
                     text) is not None


def _noting_pair_errors(loss_fn: Callable) -> LossCall:
    """``loss_fn`` called as ``loss_fn(model, micro_batch)``; an error it raises goes on
    unchanged (the step still undoes everything), with :func:`_pair_note` added when it fits."""

    def call(model: nn.Module, micro_batch: Any) -> torch.Tensor:
        try:
            return loss_fn(model, micro_batch)
        except (TypeError, AttributeError) as exc:
            note = _pair_note(exc, loss_fn, model, micro_batch)
            if note is not None:
                add_note(exc, note)
            raise

    return call


def loss_caller(loss_fn: Callable, pair: bool) -> LossCall:
    """For an ``nn`` loss module ``loss_fn(model(inputs), targets)`` (``pair``: the batch is an
    ``(inputs, targets)`` pair); any other callable is called as it is, with a note on an error
    that says it was written as ``loss(prediction, target)`` (:func:`_pair_note`).

    Refused here, before anything changes: a loss whose forward needs more than (input,
    target). Refused at the first call, which has the model: a loss with trainable
    parameters the model does not hold.
    """
    if not isinstance(loss_fn, _Loss):
        return _noting_pair_errors(loss_fn)
    _check_two_inputs(loss_fn)
    if not pair:
        raise TypeError("loss_fn is a torch.nn loss module, so batch must be an (inputs, targets) pair")
    checked: list[nn.Module] = []
    elementwise = issubclass(_builtin_forward(loss_fn) or object, _ELEMENTWISE_LOSSES)

    def call(model: nn.Module, micro_batch: Any) -> torch.Tensor:
        if not checked or checked[0] is not model:
            _check_loss_parameters(loss_fn, model)
            checked[:] = [model]
        output, target = model(micro_batch[0]), micro_batch[1]
        if elementwise:
            _check_rows_align(loss_fn, output, target)
        return loss_fn(output, target)

    return call


# Losses that compare output and target element by element, broadcasting them to one shape.
_ELEMENTWISE_LOSSES = (nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss, nn.KLDivLoss, nn.PoissonNLLLoss,
                       nn.BCELoss, nn.BCEWithLogitsLoss, nn.SoftMarginLoss)


def _check_rows_align(loss_fn: _Loss, output: Any, target: Any) -> None:
    """Refuse output and target whose rows do not meet row by row. Broadcast right-aligned, a
    leading (row) dimension lands where the other has a trailing one when their numbers of
    dimensions differ: an ``(N, 1)`` output against an ``(N,)`` target makes ``(N, N)``, every
    row against every other, and no split into micro-batches gives what the whole batch gives.
    A 0-dim output (one prediction for every row) meets each row alike."""
    if not (isinstance(output, torch.Tensor) and isinstance(target, torch.Tensor)):
        return
    if output.dim() == 0 or output.dim() == target.dim():
        return
    try:
        shape = f"broadcasts them to {tuple(torch.broadcast_shapes(output.shape, target.shape))}"
    except RuntimeError:
        shape = "cannot broadcast them"
    raise ValueError(
        f"loss_fn={type(loss_fn).__name__} got an output of shape {tuple(output.shape)} and a target of shape "
        f"{tuple(target.shape)}: torch {shape}, which pairs rows of the batch with other rows, and no split "
        "into micro-batches gives what the whole batch gives; make the shapes match (e.g. "
        "model(x).squeeze(-1), or targets.unsqueeze(-1))"
    )


def _check_two_inputs(loss_fn: _Loss) -> None:
    """Refuse a forward with more than two required positional arguments (var, lengths, a
    second or third input): ``loss(model(inputs), targets)`` cannot supply them."""
    required = _required_arguments(type(loss_fn))
    if len(required) <= 2:
        return
    name = type(loss_fn).__name__
    args = ", ".join(required)
    raise TypeError(
        f"loss_fn is a {name}, whose forward takes ({args}), but mbs_ext calls a torch.nn loss module as "
        "loss(model(inputs), targets); pass a loss_fn(model, b) that builds every argument from the micro-batch "
        f"b (a tuple of tensors split by row), e.g. {_EXAMPLES.get(name, _EXAMPLES[None])}. It averages over "
        "rows (the default normalize='samples'); with reduction='sum' pass normalize='sum'"
    )


@functools.cache
def _required_arguments(cls: type) -> tuple[str, ...]:
    """The required positional arguments of ``cls.forward`` (read once per class: a step asks
    every time, and reading a signature costs more than the rest of the check)."""
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]  # without self
    except (TypeError, ValueError):  # no signature to read: let the call say
        return ()
    return tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                 and p.default is p.empty)


_EXAMPLES = {
    "GaussianNLLLoss": "def loss_fn(model, b): mean, var = model(b[0]).chunk(2, dim=1); "
                       "return loss(mean, b[1], var.exp())",
    "CTCLoss": "loss_fn=lambda model, b: loss(model(b[0]).log_softmax(-1).transpose(0, 1), b[1], b[2], b[3])",
    "TripletMarginLoss": "loss_fn=lambda model, b: loss(model(b[0]), model(b[1]), model(b[2]))",
    "TripletMarginWithDistanceLoss": "loss_fn=lambda model, b: loss(model(b[0]), model(b[1]), model(b[2]))",
    None: "loss_fn=lambda model, b: loss(model(b[0]), model(b[1]), b[2])",
}


def _check_loss_parameters(loss_fn: _Loss, model: nn.Module) -> None:
    """Refuse trainable loss parameters outside ``model``: the step weights, zeroes and
    rolls back the gradients of the model's parameters only, so theirs would come out wrong."""
    own = {id(p) for p in model.parameters()}
    stray = [n for n, p in loss_fn.named_parameters() if p.requires_grad and id(p) not in own]
    if stray:
        raise ValueError(
            f"loss_fn {type(loss_fn).__name__} has trainable parameters that are not the model's "
            f"({', '.join(stray)}); mbs_ext streams and normalizes the gradients of the model's parameters only. "
            "Make the loss a submodule of the model (model.head = loss; the model returns the loss's input), "
            "or freeze them (requires_grad_(False))"
        )


def _builtin_forward(loss_fn: _Loss) -> type | None:
    """The torch.nn class whose ``forward`` ``loss_fn`` runs, or None for a custom forward."""
    for cls in type(loss_fn).__mro__:
        if "forward" in vars(cls):
            return cls if cls.__module__.startswith("torch.nn.") else None
    return None


def rule_for(loss_fn: Callable, normalize: Any) -> Rule:
    """The count rule of a step: from ``normalize`` when given, else read from an ``nn`` loss."""
    if not isinstance(loss_fn, _Loss):
        return rule_of(normalize)
    name = type(loss_fn).__name__
    reduction = getattr(loss_fn, "reduction", "mean")
    if reduction == "none":
        raise ValueError(
            f"loss_fn={name}(reduction='none') returns one loss per item, and a step needs one number; "
            "use reduction='mean' or 'sum' (mbs_ext keeps either exact over the whole mini-batch)"
        )
    base = _builtin_forward(loss_fn)
    if base is None:
        if normalize is None:
            raise ValueError(
                f"loss_fn is a {name} with its own forward, so mbs_ext cannot tell how it averages; pass "
                "normalize='samples' (a mean over rows), normalize='sum' (a sum) or a count callable"
            )
        return rule_of(normalize)
    derived = _derived_rule(loss_fn, base, reduction)
    if normalize is None:
        return derived
    # A mean may be weighed by the caller's own counts (or the papers' 1/M, for comparison);
    # a sum is exact only added up: counts or 1/M would divide it.
    if derived.kind != "sum" and (normalize == "micro_batches" or callable(normalize)):
        return rule_of(normalize)
    if normalize != derived.kind:
        given = "a count callable" if callable(normalize) else repr(normalize)
        raise ValueError(
            f"normalize={given} contradicts loss_fn={name}(reduction={reduction!r}), which "
            f"{'adds up' if derived.kind == 'sum' else 'averages over ' + derived.source}; "
            "leave normalize unset and mbs_ext normalizes as the loss does"
        )
    return derived


def _derived_rule(loss_fn: _Loss, base: type, reduction: str) -> Rule:
    if reduction == "sum":
        return Rule("sum", source=f"{type(loss_fn).__name__}(reduction='sum')")
    if issubclass(base, _CLASS_TARGET_LOSSES):
        count = _ClassTargetCount(loss_fn)
        return Rule("count", count, f"the weight of the non-ignored targets of {base.__name__}", per_row=count.per_row)
    return Rule("samples", source="its rows")


# Losses whose class-index mean divides by sum(weight[target]) over non-ignored targets.
# LinearCrossEntropyLoss (newer torch) is cross_entropy after its own projection and
# does not subclass CrossEntropyLoss, so it is named here.
_CLASS_TARGET_LOSSES: tuple[type, ...] = tuple(
    c for c in (nn.CrossEntropyLoss, nn.NLLLoss, getattr(nn, "LinearCrossEntropyLoss", None)) if c is not None
)


class _ClassTargetCount:
    """``sum(weight[target])`` over targets other than ``ignore_index`` (their number without
    ``weight``): the denominator of a class-index CrossEntropyLoss/NLLLoss/LinearCrossEntropyLoss
    mean, on the device; with label smoothing torch divides the smoothing term by the same sum.
    ``ignore_index=None`` (LinearCrossEntropyLoss's default) means torch's -100. Probability
    targets (floating point) average over rows. On the CPU the count is read at once: there
    is no device queue to wait for, and a host number spares the step's bookkeeping."""

    def __init__(self, loss_fn: _Loss) -> None:
        self.loss_fn = loss_fn

    def __call__(self, micro_batch: Any) -> Any:
        rows = self.per_row(micro_batch[1])
        if rows is None or isinstance(rows, int):
            return 1.0 if rows is None else float(rows * len(micro_batch[1]))
        count = rows.sum()
        return float(count.item()) if count.device.type == "cpu" else count

    def per_row(self, target: torch.Tensor) -> torch.Tensor | int | None:
        """Each row's part of the count on the target's device: int64 targets kept, or their
        float64 class weights; an int when every row counts the same (probability targets,
        nothing ignored); None for a single unbatched probability target, which counts 1."""
        n = target.shape[0] if target.dim() else 0
        if target.is_floating_point():
            return target[0].numel() // target.shape[1] if target.dim() >= 2 else None
        ignore = self.loss_fn.ignore_index
        ignore = -100 if ignore is None else ignore
        weight = self.loss_fn.weight
        if weight is None and target.device.type == "cpu" and target.numel():
            if ignore < 0:  # class targets are >= 0: nothing is ignored when the smallest is above it
                nothing_ignored = int(target.min()) > ignore
            else:
                lo, hi = torch.aminmax(target)
                nothing_ignored = not int(lo) <= ignore <= int(hi)
            if nothing_ignored:  # every row counts all its targets
                return target.numel() // n
        keep = target != ignore
        if weight is None:
            return keep.reshape(n, -1).sum(1)
        # where, not a product with keep: an ignored class's weight may be NaN (torch never reads it).
        picked = weight.to(torch.float64)[target.masked_fill(~keep, 0)]
        return torch.where(keep, picked, 0.0).reshape(n, -1).sum(1)


def check_loss(loss: Any, device: torch.device) -> None:
    """A 0-dim tensor on the model's device that requires grad."""
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"loss_fn must return a 0-dim torch.Tensor, got {type(loss).__name__}")
    if loss.dim() != 0:
        raise ValueError(f"loss_fn must return a 0-dim (scalar) tensor, got shape {tuple(loss.shape)}")
    if not loss.requires_grad:
        raise ValueError(
            "loss_fn returned a tensor that does not require grad: it must be computed from the model's "
            "output (not detached, not under torch.no_grad())"
        )
    if loss.device != device:
        raise ValueError(f"loss_fn returned a tensor on {loss.device}, but the model is on {device}")


_NO_AUTOCAST = contextlib.nullcontext()  # reusable: entered once per micro-batch


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """``torch.autocast`` for ``dtype`` on ``device``'s type, or a no-op when dtype is None."""
    if dtype is None:
        return _NO_AUTOCAST
    return torch.autocast(device_type=device.type, dtype=dtype)


def rule_and_call(made: dict, loss_fn: Callable, normalize: Any, pair: bool) -> tuple[Rule, Callable]:
    """The count rule and the loss call, made once per loss reduction (a caller may change it
    between steps) and batch kind: the checks behind them need not run every step."""
    key = (getattr(loss_fn, "reduction", None), pair)
    if key not in made:
        made[key] = (rule_for(loss_fn, normalize), loss_caller(loss_fn, pair))
    return made[key]
