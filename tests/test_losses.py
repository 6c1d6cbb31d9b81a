"""Every torch.nn loss class through mbs_ext.step: exact on an uneven split, or refused clearly.

The classes are read from ``torch.nn.modules.loss`` (every public ``_Loss`` subclass);
``CASES`` says how to build a float64 model head, inputs and targets for each, once per
option the class has (weight, ignore_index, pos_weight, probability targets,
label_smoothing, margins...). A class without a case fails
:func:`test_every_loss_class_has_cases`, so the walk stays complete when torch adds one.

Each case runs with reduction "mean" (and "batchmean" for KLDivLoss) and "sum" on N=23
rows at micro_batch_size 4 and 7 (6 and 4 micro-batches of unequal sizes) and 23 (one micro-batch,
whose count is the total: weight 1, exact from the start) and is compared
with one ordinary full-batch step of a deep copy: every parameter's update (stricter than
the parameter itself) and ``r.loss`` to 1e-10 relative. ``reduction="none"`` is refused
and leaves parameters, buffers, gradients and optimizer state as they were.

The step calls an nn loss as ``loss(model(inputs), targets)``. Classes whose forward takes
more (GaussianNLLLoss's var, CTCLoss's lengths, the pair and triplet losses) are refused on
that path with a message naming the fix, and are exact through the fix: a
``loss_fn(model, batch)`` that calls them (``normalize="sum"`` with reduction="sum").
LinearCrossEntropyLoss owns the classifier's parameters: exact when it is a submodule of
the model, refused when its parameters are not the model's.
"""

from __future__ import annotations

import copy
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import loss as torch_losses

import mbs_ext

pytestmark = [
    pytest.mark.filterwarnings("ignore:reduction. 'mean' divides the total loss:UserWarning"),  # KLDivLoss
    pytest.mark.filterwarnings("ignore:`NLLLoss2d` has been deprecated:FutureWarning"),
]

D = torch.float64
N, F_IN, C = 23, 5, 4
SPLITS = [4, 7, N]  # 6 micro-batches (4,4,4,4,4,3), 4 (6,6,6,5), and one (its count the total)
IGNORED_ROWS = [0, 1, 2, 3, 4, 5, 9, 14, 20]  # rows 0-5: the whole first micro-batch at m=4 and at m=7
TOL = 1e-10

@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The tensors here are tiny: a second intra-op thread only spins (3-8x slower on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


HAS_LINEAR_CE = hasattr(nn, "LinearCrossEntropyLoss")
needs_linear_ce = pytest.mark.skipif(not HAS_LINEAR_CE, reason="this torch has no nn.LinearCrossEntropyLoss")
LOSS_CLASSES = sorted(
    name
    for name, cls in vars(torch_losses).items()
    if inspect.isclass(cls) and issubclass(cls, torch_losses._Loss) and not name.startswith("_")
)


class Net(nn.Module):
    """Linear-Tanh-Linear (float64), then ``post``; a ``forwards`` buffer counts calls, so a
    refused step is seen to leave buffers alone. ``head`` (optional) rides along as a submodule."""

    def __init__(self, n_out: int, post: nn.Module | None = None, head: nn.Module | None = None) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(F_IN, 6), nn.Tanh(), nn.Linear(6, n_out)).to(D)
        self.post = post if post is not None else nn.Identity()
        self.head = head
        self.register_buffer("forwards", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        return self.post(self.body(x))


def x_in(*shape: int) -> torch.Tensor:
    return torch.randn(N, *(shape or (F_IN,)), dtype=D)


def probs(*shape: int) -> torch.Tensor:
    return torch.randn(N, *shape, dtype=D).softmax(1)


def labels(*shape: int, ignore: int | None = None) -> torch.Tensor:
    t = torch.randint(0, C, (N, *shape))
    if ignore is not None:
        t[IGNORED_ROWS] = ignore
    return t


def signs(*shape: int) -> torch.Tensor:
    return torch.randint(0, 2, (N, *shape)).to(D) * 2 - 1


def class_weight() -> torch.Tensor:
    return torch.rand(C, dtype=D) + 0.5


LOG_SOFTMAX = nn.LogSoftmax(dim=1)


def log_softmax_over(*k: int) -> nn.Module:
    """(N, C*prod(k)) -> log-probabilities of shape (N, C, *k) over dim 1."""
    return nn.Sequential(nn.Unflatten(1, (C, *k)), nn.LogSoftmax(dim=1))


def multi_label_targets() -> torch.Tensor:
    """MultiLabelMarginLoss targets: each row's classes first, then -1."""
    t = torch.full((N, C), -1)
    for i in range(N):
        k = 1 + i % (C - 1)
        t[i, :k] = torch.randperm(C)[:k]
    return t


@dataclass
class Case:
    """One loss class with one set of options.

    ``make(reduction)`` returns ``(model, loss, batch)``; ``call`` (multi-input classes) is
    how the loss is called instead of ``loss(model(batch[0]), batch[1])``.
    """

    cls: str
    option: str
    make: Callable[[str], tuple[nn.Module, nn.Module, Any]]
    call: Callable[[nn.Module, nn.Module, Any], torch.Tensor] | None = None

    @property
    def id(self) -> str:
        return f"{self.cls}-{self.option}"

    def reductions(self) -> list[str]:
        return ["mean", "batchmean", "sum"] if self.cls == "KLDivLoss" else ["mean", "sum"]


def pair(cls: str, option: str, n_out: int, targets: Callable[[], torch.Tensor], post: nn.Module | None = None,
         **kw: Any) -> Case:
    """A ``loss(model(x), y)`` case: Net(n_out) + ``post`` on x, ``targets()`` as y."""

    def make(reduction: str) -> tuple[nn.Module, nn.Module, Any]:
        model = Net(n_out, post)
        opts = {k: v() if callable(v) else v for k, v in kw.items()}
        return model, getattr(nn, cls)(reduction=reduction, **opts), (x_in(), targets())

    return Case(cls, option, make)


def linear_ce(option: str, targets: Callable[[], torch.Tensor], **kw: Any) -> Case:
    """LinearCrossEntropyLoss as the model's ``head``: the model outputs features, the loss projects them."""

    def make(reduction: str) -> tuple[nn.Module, nn.Module, Any]:
        opts = {k: v() if callable(v) else v for k, v in kw.items()}
        head = nn.LinearCrossEntropyLoss(3, C, bias=True, dtype=D, reduction=reduction, **opts)
        model = Net(3, head=head)
        return model, model.head, (x_in(), targets())

    return Case("LinearCrossEntropyLoss", option, make)


def multi(cls: str, option: str, make_batch: Callable[[], Any], n_out: int,
          call: Callable[[nn.Module, nn.Module, Any], torch.Tensor], post: nn.Module | None = None,
          **kw: Any) -> Case:
    """A loss whose forward takes more than (input, target): called by ``call(loss, model, batch)``."""

    def make(reduction: str) -> tuple[nn.Module, nn.Module, Any]:
        return Net(n_out, post), getattr(nn, cls)(reduction=reduction, **kw), make_batch()

    return Case(cls, option, make, call)


def gaussian_call(loss: nn.Module, model: nn.Module, b: Any) -> torch.Tensor:
    mean, var = model(b[0]).chunk(2, dim=1)
    return loss(mean, b[1], F.softplus(var) + 0.1)


def embed_pair_call(loss: nn.Module, model: nn.Module, b: Any) -> torch.Tensor:
    return loss(model(b[0]), model(b[1]), b[2])


def rank_call(loss: nn.Module, model: nn.Module, b: Any) -> torch.Tensor:
    return loss(model(b[0]).squeeze(1), model(b[1]).squeeze(1), b[2])


def triplet_call(loss: nn.Module, model: nn.Module, b: Any) -> torch.Tensor:
    return loss(model(b[0]), model(b[1]), model(b[2]))


T_CTC, S_CTC = 8, 3


def ctc_batch() -> Any:
    """(features (N, T, F), padded targets (N, S), input lengths, target lengths), all split by row."""
    targets = torch.randint(1, C, (N, S_CTC))
    return x_in(T_CTC, F_IN), targets, torch.randint(6, T_CTC + 1, (N,)), torch.randint(1, S_CTC + 1, (N,))


def ctc_call(loss: nn.Module, model: nn.Module, b: Any) -> torch.Tensor:
    return loss(model(b[0]).log_softmax(-1).transpose(0, 1), b[1], b[2], b[3])


def cosine_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return 1 - F.cosine_similarity(a, b)


CASES: list[Case] = [
    pair("L1Loss", "default", 3, lambda: x_in(3)),
    pair("MSELoss", "default", 3, lambda: x_in(3)),
    pair("SmoothL1Loss", "default", 3, lambda: 2 * x_in(3)),
    pair("SmoothL1Loss", "beta=0.5", 3, lambda: 2 * x_in(3), beta=0.5),
    pair("HuberLoss", "default", 3, lambda: 2 * x_in(3)),
    pair("HuberLoss", "delta=0.5", 3, lambda: 2 * x_in(3), delta=0.5),
    pair("PoissonNLLLoss", "default", 3, lambda: torch.poisson(torch.full((N, 3), 2.0, dtype=D))),
    pair("PoissonNLLLoss", "full", 3, lambda: torch.poisson(torch.full((N, 3), 3.0, dtype=D)), full=True),
    pair("PoissonNLLLoss", "rate-input", 3, lambda: torch.poisson(torch.full((N, 3), 2.0, dtype=D)),
         post=nn.Softplus(), log_input=False),
    pair("KLDivLoss", "prob-target", C, lambda: probs(C), post=LOG_SOFTMAX),
    pair("KLDivLoss", "log_target", C, lambda: probs(C).log(), post=LOG_SOFTMAX, log_target=True),
    pair("BCELoss", "default", 3, lambda: torch.rand(N, 3, dtype=D), post=nn.Sigmoid()),
    pair("BCELoss", "weight", 3, lambda: torch.rand(N, 3, dtype=D), post=nn.Sigmoid(),
         weight=lambda: torch.rand(3, dtype=D) + 0.5),
    pair("BCEWithLogitsLoss", "default", 3, lambda: torch.rand(N, 3, dtype=D)),
    pair("BCEWithLogitsLoss", "weight", 3, lambda: torch.rand(N, 3, dtype=D), weight=lambda: torch.rand(3, dtype=D)),
    pair("BCEWithLogitsLoss", "pos_weight", 3, lambda: torch.rand(N, 3, dtype=D),
         pos_weight=lambda: torch.rand(3, dtype=D) * 3),
    pair("BCEWithLogitsLoss", "weight+pos_weight", 3, lambda: torch.rand(N, 3, dtype=D),
         weight=lambda: torch.rand(3, dtype=D), pos_weight=lambda: torch.rand(3, dtype=D) * 3),
    pair("HingeEmbeddingLoss", "default", 3, lambda: signs(3)),
    pair("HingeEmbeddingLoss", "margin=0.5", 3, lambda: signs(3), margin=0.5),
    pair("SoftMarginLoss", "default", 3, lambda: signs(3)),
    pair("MultiLabelMarginLoss", "default", C, multi_label_targets),
    pair("MultiLabelSoftMarginLoss", "default", C, lambda: torch.randint(0, 2, (N, C)).to(D)),
    pair("MultiLabelSoftMarginLoss", "weight", C, lambda: torch.randint(0, 2, (N, C)).to(D), weight=class_weight),
    pair("MultiMarginLoss", "default", C, labels),
    pair("MultiMarginLoss", "weight", C, labels, weight=class_weight),
    pair("MultiMarginLoss", "p=2-margin=0.5", C, labels, p=2, margin=0.5),
    pair("CrossEntropyLoss", "class-index", C, labels),
    pair("CrossEntropyLoss", "weight", C, labels, weight=class_weight),
    pair("CrossEntropyLoss", "ignore_index", C, lambda: labels(ignore=-1), ignore_index=-1),
    pair("CrossEntropyLoss", "weight+ignore_index", C, lambda: labels(ignore=-1), weight=class_weight,
         ignore_index=-1),
    # torch never reads an ignored class's weight: a NaN there changes nothing.
    pair("CrossEntropyLoss", "weight-NaN-on-the-ignored-class", C, lambda: labels(ignore=0), ignore_index=0,
         weight=lambda: torch.cat([torch.tensor([float("nan")], dtype=D), class_weight()[1:]])),
    pair("CrossEntropyLoss", "label_smoothing", C, labels, label_smoothing=0.2),
    pair("CrossEntropyLoss", "weight+ignore_index+label_smoothing", C, lambda: labels(ignore=-1),
         weight=class_weight, ignore_index=-1, label_smoothing=0.2),
    pair("CrossEntropyLoss", "prob-target", C, lambda: probs(C)),
    pair("CrossEntropyLoss", "prob-target+weight+label_smoothing", C, lambda: probs(C), weight=class_weight,
         label_smoothing=0.2),
    pair("CrossEntropyLoss", "k-dim+weight+ignore_index", C * 3, lambda: labels(3, ignore=-100),
         post=nn.Unflatten(1, (C, 3)), weight=class_weight),
    pair("CrossEntropyLoss", "k-dim-prob-target", C * 3, lambda: probs(C, 3), post=nn.Unflatten(1, (C, 3))),
    pair("NLLLoss", "class-index", C, labels, post=LOG_SOFTMAX),
    pair("NLLLoss", "weight+ignore_index", C, lambda: labels(ignore=2), post=LOG_SOFTMAX, weight=class_weight,
         ignore_index=2),
    pair("NLLLoss", "k-dim+weight+ignore_index", C * 3, lambda: labels(3, ignore=-100), post=log_softmax_over(3),
         weight=class_weight),
    pair("NLLLoss2d", "2-d+weight+ignore_index", C * 4, lambda: labels(2, 2, ignore=-1), post=log_softmax_over(2, 2),
         weight=class_weight, ignore_index=-1),
    *([  # newer torch only (not in 2.11)
        linear_ce("class-index", labels),
        linear_ce("weight+ignore_index", lambda: labels(ignore=-100), weight=class_weight),
        linear_ce("weight+ignore_index+label_smoothing", lambda: labels(ignore=1), weight=class_weight,
                  ignore_index=1, label_smoothing=0.2),
        linear_ce("prob-target+weight", lambda: probs(C), weight=class_weight),
    ] if HAS_LINEAR_CE else []),
    multi("GaussianNLLLoss", "default", lambda: (x_in(), x_in(3)), 6, gaussian_call),
    multi("GaussianNLLLoss", "full", lambda: (x_in(), x_in(3)), 6, gaussian_call, full=True),
    multi("CosineEmbeddingLoss", "margin=0.2", lambda: (x_in(), x_in(), signs()), 3, embed_pair_call, margin=0.2),
    multi("MarginRankingLoss", "margin=0.1", lambda: (x_in(), x_in(), signs()), 1, rank_call, margin=0.1),
    multi("TripletMarginLoss", "default", lambda: (x_in(), x_in(), x_in()), 3, triplet_call),
    multi("TripletMarginLoss", "p=1-swap", lambda: (x_in(), x_in(), x_in()), 3, triplet_call, p=1, swap=True),
    multi("TripletMarginWithDistanceLoss", "cosine", lambda: (x_in(), x_in(), x_in()), 3, triplet_call,
          distance_function=cosine_distance),
    multi("CTCLoss", "default", ctc_batch, C, ctc_call),
]

FIRST_CASES = list({c.cls: c for c in reversed(CASES)}.values())  # one case per class


def test_every_loss_class_has_cases():
    """A public _Loss subclass torch adds must get a case here (or this walk is incomplete)."""
    covered = {c.cls for c in CASES}
    assert not set(LOSS_CLASSES) - covered, f"no case for {sorted(set(LOSS_CLASSES) - covered)}: add them to CASES"
    gone = sorted(covered - set(LOSS_CLASSES))
    assert not gone, f"cases for classes torch no longer has: {gone}"


def build(case: Case, reduction: str) -> tuple[nn.Module, nn.Module, Any, Callable[[nn.Module, Any], torch.Tensor]]:
    """Model, loss, batch and ``loss_fn(model, batch)`` of the full-batch reference."""
    torch.manual_seed(0)
    model, loss, batch = case.make(reduction)
    return model, loss, batch, full_call(case, loss)


def full_call(case: Case, loss: nn.Module) -> Callable[[nn.Module, Any], torch.Tensor]:
    """The ordinary ``loss_fn(model, batch)``: ``loss(model(x), y)``, or the case's multi-input call."""
    if case.call is None:
        return lambda m, b: loss(m(b[0]), b[1])
    return lambda m, b: case.call(loss, m, b)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` (``|a - b|`` where ``b`` is zero)."""
    scale = b.norm().item()
    diff = (a - b).norm().item()
    return diff / scale if scale else diff


def step_args(case: Case, loss: nn.Module, reduction: str) -> tuple[Any, dict]:
    """What mbs_ext.step is given: the nn loss itself, or the call wrapping a multi-input loss."""
    if case.call is None:
        return loss, {}
    return full_call(case, loss), ({"normalize": "sum"} if reduction == "sum" else {})


EXACT = [
    pytest.param(case, reduction, m, id=f"{case.id}-{reduction}-m{m}")
    for case in CASES
    for reduction in case.reductions()
    for m in SPLITS
]


@pytest.mark.parametrize(("case", "reduction", "m"), EXACT)
def test_step_equals_full_batch(case: Case, reduction: str, m: int):
    model, loss, batch, _ = build(case, reduction)
    ref_model, ref_loss_module = copy.deepcopy((model, loss))  # one memo: a loss inside the model stays inside
    start = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.5, momentum=0.9)

    loss_fn, kw = step_args(case, loss, reduction)
    r = mbs_ext.step(model, opt, batch, loss_fn, micro_batch_size=m, **kw)

    ref_opt.zero_grad()
    ref_loss = full_call(case, ref_loss_module)(ref_model, batch)
    ref_loss.backward()
    ref_opt.step()

    assert r.num_micro_batches == -(-N // m)
    assert abs(r.loss - ref_loss.item()) <= TOL * abs(ref_loss.item()), (r.loss, ref_loss.item())
    assert_updates_match(model, ref_model, start)


def assert_updates_match(model: nn.Module, ref_model: nn.Module, start: list[torch.Tensor]) -> None:
    """Every parameter and its update within TOL relative of the reference's.

    The pair and triplet losses see only differences of outputs, so the last bias's true
    gradient is 0 and its reference update is rounding noise (~1e-17): such an update (under
    1e-12 of the largest) is compared relative to the largest update instead.
    """
    largest = max((q - p0).norm().item() for q, p0 in zip(ref_model.parameters(), start))
    assert largest > 0
    for (name, p), q, p0 in zip(model.named_parameters(), ref_model.parameters(), start):
        step, ref_step = p - p0, q - p0
        if ref_step.norm().item() > 1e-12 * largest:
            err = rel(step, ref_step)
        else:
            err = (step - ref_step).norm().item() / largest
        assert err <= TOL, f"{name}: update off by {err:.2e} relative"
        assert rel(p, q) <= TOL


def state_of(model: nn.Module, loss: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict, dict]:
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        {k: v.clone() for k, v in loss.state_dict().items()},
        copy.deepcopy(opt.state_dict()),
    )


def assert_unchanged(before: tuple[dict, dict, dict], model: nn.Module, loss: nn.Module,
                     opt: torch.optim.Optimizer) -> None:
    after = state_of(model, loss, opt)
    for old, new in zip(before[:2], after[:2]):
        assert old.keys() == new.keys()
        assert all(torch.equal(old[k], new[k]) for k in old), "a parameter or buffer changed"
    assert before[2]["param_groups"] == after[2]["param_groups"]
    assert before[2]["state"].keys() == after[2]["state"].keys()
    for k, s in before[2]["state"].items():
        assert all(torch.equal(v, after[2]["state"][k][name]) for name, v in s.items()), "optimizer state changed"
    assert all(p.grad is None for p in model.parameters())


def primed(case: Case, reduction: str) -> tuple[nn.Module, nn.Module, Any, torch.optim.Optimizer]:
    """A model one ordinary step in (so the optimizer has momentum state), gradients set to None."""
    model, loss, batch, full_loss = build(case, reduction)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    full_loss(model, batch).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, loss, batch, opt


@pytest.mark.parametrize("case", [pytest.param(c, id=c.cls) for c in FIRST_CASES])
def test_reduction_none_is_refused(case: Case):
    """reduction='none' gives one loss per item: refused (for an nn loss before anything runs;
    through a multi-input call, at the first micro-batch, and undone)."""
    model, loss, batch, opt = primed(case, "none")
    before = state_of(model, loss, opt)
    loss_fn, _ = step_args(case, loss, "none")
    match = "reduction='mean' or 'sum'" if case.call is None else "0-dim"
    with pytest.raises(ValueError, match=match):
        mbs_ext.step(model, opt, batch, loss_fn, micro_batch_size=4)
    assert_unchanged(before, model, loss, opt)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.cls) for c in FIRST_CASES if c.call is not None])
def test_multi_input_loss_refused_on_the_nn_path(case: Case):
    """loss(model(inputs), targets) cannot feed var/lengths/a second input: refused up front,
    naming the loss_fn(model, batch) fix."""
    model, loss, batch, opt = primed(case, "mean")
    before = state_of(model, loss, opt)
    with pytest.raises(TypeError, match=r"pass a loss_fn\(model, b\)"):
        mbs_ext.step(model, opt, (batch[0], batch[-1]), loss, micro_batch_size=4)
    assert_unchanged(before, model, loss, opt)


@needs_linear_ce
def test_linear_cross_entropy_with_parameters_outside_the_model_is_refused():
    """The step normalizes, rolls back and zeroes only the model's parameters: a loss owning
    trainable parameters the model does not hold is refused (make it a submodule of the model)."""
    torch.manual_seed(0)
    model = Net(3)
    loss = nn.LinearCrossEntropyLoss(3, C, dtype=D)
    opt = torch.optim.SGD([*model.parameters(), *loss.parameters()], lr=0.1)
    before = state_of(model, loss, opt)
    with pytest.raises(ValueError, match="submodule of the model"):
        mbs_ext.step(model, opt, (x_in(), labels()), loss, micro_batch_size=4)
    assert_unchanged(before, model, loss, opt)
    assert all(p.grad is None for p in loss.parameters())
    assert int(model.forwards) == 0


class RowSquaredError(torch_losses._Loss):
    """A custom loss: the squared error summed over a row's columns, averaged over rows."""

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((input - target) ** 2).sum(1).mean()


def test_custom_loss_forward_needs_normalize():
    torch.manual_seed(0)
    model = Net(3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = state_of(model, RowSquaredError(), opt)
    with pytest.raises(ValueError, match="normalize="):
        mbs_ext.step(model, opt, (x_in(), x_in(3)), RowSquaredError(), micro_batch_size=4)
    assert_unchanged(before, model, RowSquaredError(), opt)


@pytest.mark.parametrize("m", SPLITS, ids=lambda m: f"m{m}")
def test_custom_loss_row_mean_exact_with_normalize_samples(m: int):
    case = Case("RowSquaredError", "samples", lambda r: (Net(3), RowSquaredError(), (x_in(), x_in(3))))
    assert_exact(case, m, normalize="samples")


def assert_exact(case: Case, m: int, **kw: Any) -> None:
    """``mbs_ext.step(..., **kw)`` with the case's nn loss equals one full-batch SGD step."""
    model, loss, batch, full_loss = build(case, "mean")
    ref = copy.deepcopy(model)
    start = [p.detach().clone() for p in model.parameters()]
    opt, ref_opt = (torch.optim.SGD(x.parameters(), lr=0.5) for x in (model, ref))
    r = mbs_ext.step(model, opt, batch, loss, micro_batch_size=m, **kw)
    ref_loss = full_loss(ref, batch)
    ref_loss.backward()
    ref_opt.step()
    assert abs(r.loss - ref_loss.item()) <= TOL * ref_loss.item()
    assert_updates_match(model, ref, start)


@pytest.mark.parametrize("m", SPLITS, ids=lambda m: f"m{m}")
def test_subclass_without_own_forward_reads_the_builtin_rule(m: int):
    """A subclass that keeps CrossEntropyLoss's forward averages like it: exact with ignored targets."""

    class MyCrossEntropy(nn.CrossEntropyLoss):
        pass

    case = Case("MyCrossEntropy", "ignore_index", lambda r: (
        Net(C), MyCrossEntropy(weight=class_weight(), ignore_index=-1), (x_in(), labels(ignore=-1))))
    assert_exact(case, m)


@pytest.mark.parametrize("loss", [nn.MSELoss(), nn.L1Loss(), nn.HuberLoss(reduction="sum")],
                         ids=lambda loss: type(loss).__name__)
def test_output_and_target_mixing_rows_are_refused(loss: nn.Module):
    """An (N, 1) output against an (N,) target broadcasts to (N, N): rows meet other rows, which
    no split reproduces (torch only warns); refused at the first micro-batch, nothing changed."""
    torch.manual_seed(0)
    model = Net(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"output of shape \(4, 1\) and a target of shape \(4,\).*\(4, 4\)"):
        mbs_ext.step(model, opt, (x_in(), x_in(1).squeeze(1)), loss, micro_batch_size=4)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters()) and model.forwards.item() == 0


NOTHING_TO_AVERAGE = [  # a (model, loss, batch) whose loss has no item to average over: torch's mean is NaN
    pytest.param(lambda: (Net(C), nn.CrossEntropyLoss(ignore_index=-1), (x_in(), torch.full((N,), -1))),
                 id="CrossEntropyLoss-all-ignored"),
    pytest.param(lambda: (Net(C), nn.CrossEntropyLoss(ignore_index=-1, label_smoothing=0.2),
                          (x_in(), torch.full((N,), -1))), id="CrossEntropyLoss-label_smoothing-all-ignored"),
    pytest.param(lambda: (Net(C, LOG_SOFTMAX), nn.NLLLoss(ignore_index=2), (x_in(), torch.full((N,), 2))),
                 id="NLLLoss-all-ignored"),
    pytest.param(lambda: (Net(C), nn.CrossEntropyLoss(weight=torch.tensor([0.0, 0.0, 1.0, 1.0], dtype=D)),
                          (x_in(), torch.randint(0, 2, (N,)))), id="CrossEntropyLoss-present-classes-weigh-0"),
    pytest.param(lambda: (lambda m: (m, m.head, (x_in(), torch.full((N,), -100))))(
        Net(3, head=nn.LinearCrossEntropyLoss(3, C, dtype=D))), id="LinearCrossEntropyLoss-all-ignored",
        marks=needs_linear_ce),
]


@pytest.mark.parametrize("m", SPLITS, ids=lambda m: f"m{m}")
@pytest.mark.parametrize("make", NOTHING_TO_AVERAGE)
def test_a_mini_batch_with_nothing_to_average_is_an_error(make: Callable[[], tuple], m: int):
    """Every target ignored (or weighing 0): the mean is undefined. Refused at every split, also at
    one micro-batch, whose count is the total; the model's
    parameters, buffers, gradients and optimizer state are as before, for step and accumulate."""
    torch.manual_seed(0)
    model, loss, batch = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = state_of(model, loss, opt)
    with pytest.raises(ValueError, match="sum to 0"):
        mbs_ext.step(model, opt, batch, loss, micro_batch_size=m)
    assert_unchanged(before, model, loss, opt)
    with pytest.raises(ValueError, match="sum to 0"):
        mbs_ext.accumulate(model, batch, loss, micro_batch_size=m)
    assert_unchanged(before, model, loss, opt)


@pytest.mark.parametrize("m", SPLITS, ids=lambda m: f"m{m}")
def test_class_weights_that_sum_below_zero_are_refused_at_every_split(m: int):
    """A negative class weight makes a count negative: refused at every split, one micro-batch
    included (its count is taken like any other), naming the count; nothing changes."""
    torch.manual_seed(0)
    model, loss = Net(C), nn.CrossEntropyLoss(weight=torch.tensor([1.0, -3.0, 1.0, 1.0], dtype=D))
    batch = (x_in(), torch.ones(N, dtype=torch.long))  # every row of class 1: each count is negative
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = state_of(model, loss, opt)
    with pytest.raises(ValueError, match="non-negative finite"):
        mbs_ext.step(model, opt, batch, loss, micro_batch_size=m)
    assert_unchanged(before, model, loss, opt)


@pytest.mark.parametrize("m", SPLITS, ids=lambda m: f"m{m}")
def test_nothing_to_average_under_a_new_grad_scaler_is_the_same_error(m: int):
    """No micro-batch scales a loss (each counts 0 items), so a new GradScaler has no scale yet:
    the step still fails with what is wrong, the counts, and leaves everything as it was."""
    torch.manual_seed(0)
    model, loss, batch = Net(C), nn.CrossEntropyLoss(ignore_index=-1), (x_in(), torch.full((N,), -1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = state_of(model, loss, opt)
    with pytest.raises(ValueError, match="sum to 0"):
        mbs_ext.step(model, opt, batch, loss, micro_batch_size=m, scaler=torch.amp.GradScaler("cpu"))
    assert_unchanged(before, model, loss, opt)


def test_one_micro_batch_with_a_non_finite_loss_keeps_its_count():
    """At one micro-batch a non-finite loss with targets to count is what it is (not a count of 0):
    the step is skipped with a warning and reports the loss, which no count divides."""
    torch.manual_seed(0)
    model = Net(C)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = x_in()
    x[7] = float("nan")  # a counted row (IGNORED_ROWS are ignored)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.warns(RuntimeWarning, match="non-finite loss at micro-batch 0 of 1"):
        r = mbs_ext.step(model, opt, (x, labels(ignore=-100)), nn.CrossEntropyLoss(), micro_batch_size=N)
    assert r.skipped and r.num_micro_batches == 1 and r.loss != r.loss  # NaN
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


class Shared(nn.Module):
    """One learned prediction for every row: a 0-dim output."""

    def __init__(self) -> None:
        super().__init__()
        self.value = nn.Parameter(torch.zeros((), dtype=D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.value * 1.0


@pytest.mark.parametrize("m", SPLITS, ids=lambda m: f"m{m}")
@pytest.mark.parametrize("case", [
    # Broadcasts that keep rows apart: an (N, 1) output against (N, 3) targets, a 0-dim output.
    Case("MSELoss", "broadcast-columns", lambda r: (Net(1), nn.MSELoss(reduction=r), (x_in(), x_in(3)))),
    Case("L1Loss", "0-dim-output", lambda r: (Shared(), nn.L1Loss(reduction=r), (x_in(), x_in(3)))),
], ids=lambda c: c.id)
def test_broadcasts_that_keep_rows_apart_are_exact(case: Case, m: int):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns of any size difference
        assert_exact(case, m)


@pytest.mark.parametrize(("loss", "normalize"), [
    pytest.param(nn.MSELoss(reduction="sum"), "samples", id="MSELoss-sum-vs-samples"),
    pytest.param(nn.MSELoss(), "sum", id="MSELoss-mean-vs-sum"),
    # Counts or the papers' 1/M would divide a sum: never the full batch's gradient.
    pytest.param(nn.MSELoss(reduction="sum"), lambda mb: len(mb[1]), id="MSELoss-sum-vs-count"),
    pytest.param(nn.CrossEntropyLoss(reduction="sum"), lambda mb: (mb[1] != -100).sum(), id="CE-sum-vs-count"),
    pytest.param(nn.MSELoss(reduction="sum"), "micro_batches", id="MSELoss-sum-vs-micro_batches"),
])
def test_normalize_contradicting_the_loss_is_refused(loss: nn.Module, normalize: Any):
    torch.manual_seed(0)
    model = Net(3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="contradicts"):
        mbs_ext.step(model, opt, (x_in(), x_in(3)), loss, micro_batch_size=4, normalize=normalize)
    assert all(p.grad is None for p in model.parameters())
