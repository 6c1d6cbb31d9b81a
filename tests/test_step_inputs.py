"""Inputs to mbs_ext.step: the usual mistakes get errors that name the fix, raised before
anything changes, and so does every bad argument; nested batch structures and ``indices``
are exact; gradients come out shaped like their parameters and holding only their own
bytes; weighted (float) counts are exact.
"""

from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F
from common import assert_bit_identical, assert_models_match, full_batch_step, mlp, mse, pair, snapshot, twins
from torch import nn

import mbs_ext


def classifier(device="cpu", bn=True):
    torch.manual_seed(0)
    layers = [nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3)] if bn else [nn.Linear(5, 3)]
    return nn.Sequential(*layers).double().to(device)


def data(n=10, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)


def ce(model, b):
    return F.cross_entropy(model(b[0]), b[1])


def refused(model, opt, call, exc, match):
    """``call()`` raises ``exc`` matching ``match`` and changes nothing."""
    before = snapshot(model, opt)
    with pytest.raises(exc, match=match):
        call()
    assert_bit_identical(snapshot(model, opt), before)
    assert all(p.grad is None for p in model.parameters())


def test_pair_function_as_loss_fn_names_the_fix(device):
    model = classifier(device)
    opt = torch.optim.Adam(model.parameters())
    opt.step()  # optimizer state exists, so "unchanged" covers it
    refused(model, opt, lambda: mbs_ext.step(model, opt, data(), F.cross_entropy, micro_batch_size=3),
            TypeError, r"torch.nn.functional.cross_entropy.*\(prediction, target\).*nn.CrossEntropyLoss\(\)")


class PairLoss(nn.Module):
    """A custom loss module of the (prediction, target) shape."""

    def forward(self, pred, target):
        return F.mse_loss(pred, target)


def pair_loss_function(output, target):
    return F.cross_entropy(output, target)


@pytest.mark.parametrize("loss_fn", [
    pytest.param(lambda pred, target: F.cross_entropy(pred, target), id="lambda-cross_entropy"),
    pytest.param(lambda p, t: (p - t).pow(2).mean(), id="lambda-arithmetic"),
    pytest.param(lambda pred, t: F.mse_loss(pred, t), id="lambda-mse_loss"),
    pytest.param(pair_loss_function, id="function"),
    pytest.param(PairLoss(), id="module"),
])
def test_prediction_target_loss_gets_a_note_naming_the_convention(loss_fn, device):
    """A loss written as loss(prediction, target) fails inside its own call (torch's TypeError or
    AttributeError, kept and chained as is); a note names mbs_ext's convention and the one-line
    fix, and the step changes nothing."""
    model = classifier(device, bn=False)
    opt = torch.optim.Adam(model.parameters())
    opt.step()
    before = snapshot(model, opt)
    with pytest.raises((TypeError, AttributeError)) as info:
        mbs_ext.step(model, opt, data(), loss_fn, micro_batch_size=3)
    assert_bit_identical(snapshot(model, opt), before)
    assert all(p.grad is None for p in model.parameters())
    assert "mbs_ext" not in str(info.value)  # torch's own error, unchanged
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "mbs_ext calls loss_fn(model, micro_batch)" in notes, notes
    assert "nn.CrossEntropyLoss()" in notes
    name = getattr(loss_fn, "__name__", "")
    fix = f"{name}(model(b[0]), b[1])" if name.isidentifier() else "(model(b[0]), b[1])"
    assert "loss_fn=lambda model, b: " in notes and fix in notes
    if isinstance(loss_fn, nn.Module):
        assert "PairLoss" in notes
    assert notes.index("mbs_ext calls") < notes.index("failed at micro-batch 0")  # the step's note follows


def test_loss_of_the_right_shape_failing_on_its_own_gets_no_convention_note(device):
    """A loss_fn(model, micro_batch) with a mistake of its own, or a model failing inside its
    forward, keeps its error without the (prediction, target) note."""
    model = classifier(device, bn=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for loss_fn in (lambda model, b: F.cross_entropy(model(b[0]), b),  # the whole tuple as the target
                    lambda model, b: F.cross_entropy(model(b), b[1]),  # the model fails on a tuple
                    lambda model, b: F.cross_entropy(model.head(b[0]), b[1])):  # a submodule it lacks
        with pytest.raises((TypeError, AttributeError)) as info:
            mbs_ext.step(model, opt, data(), loss_fn, micro_batch_size=3)
        notes = "\n".join(getattr(info.value, "__notes__", []))
        assert "failed at micro-batch 0" in notes and "loss_fn(model, micro_batch)" not in notes, notes


def test_step_under_no_grad_names_the_fix(device):
    model = classifier(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.no_grad():
        refused(model, opt, lambda: mbs_ext.step(model, opt, data(), ce, micro_batch_size=3),
                RuntimeError, r"gradients disabled.*torch.no_grad\(\).*outside")
    with torch.inference_mode():
        refused(model, opt, lambda: mbs_ext.step(model, opt, data(), ce, micro_batch_size=3),
                RuntimeError, "inference_mode")


def test_data_loader_as_batch_names_the_fix(device):
    model = classifier(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*data()), batch_size=4)
    refused(model, opt, lambda: mbs_ext.step(model, opt, loader, ce, micro_batch_size=3),
            TypeError, r"batch is a DataLoader.*iterate over it")
    refused(model, opt, lambda: mbs_ext.step(model, opt, iter(loader), ce, micro_batch_size=3),
            TypeError, "batch is a _SingleProcessDataLoaderIter")


def test_reduction_none_is_refused(device):
    model = classifier(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = nn.CrossEntropyLoss(reduction="none")
    refused(model, opt, lambda: mbs_ext.step(model, opt, data(), loss, micro_batch_size=3),
            ValueError, r"reduction='none'.*use reduction='mean' or 'sum'")


def test_normalize_contradicting_the_loss_is_refused(device):
    model = classifier(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = nn.CrossEntropyLoss(reduction="sum")
    refused(model, opt, lambda: mbs_ext.step(model, opt, data(), loss, micro_batch_size=3, normalize="samples"),
            ValueError, "leave normalize unset")


def test_nonfinite_loss_warning_points_at_the_caller_and_names_the_micro_batch(device):
    model = classifier(device, bn=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = data(10)
    x[7, 0] = float("nan")  # rows [7, 10) form micro-batch 2 of 3 at size 4 (sizes 4, 3, 3)
    before = snapshot(model, opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        result = mbs_ext.step(model, opt, (x, y), ce, micro_batch_size=4)
    (w,) = [c for c in caught if "non-finite" in str(c.message)]
    assert w.filename == __file__ and w.lineno == line, (w.filename, w.lineno)
    assert "non-finite loss at micro-batch 2 of 3 (rows [7, 10) of the mini-batch)" in str(w.message)
    assert result.skipped
    assert_bit_identical(snapshot(model, opt), before)


def test_result_reports_the_micro_batch_size_used(device):
    model = classifier(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    result = mbs_ext.step(model, opt, data(10), ce, micro_batch_size=4)
    assert (result.micro_batch_size, result.num_micro_batches) == (4, 3)
    result = mbs_ext.step(model, opt, data(9), ce, micro_batch_size=4)
    assert (result.micro_batch_size, result.num_micro_batches) == (3, 3)  # 9 rows: 3 + 3 + 3


# --- weighted counts ------------------------------------------------------------------------------


def weighted_batch(n, seed=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=g, dtype=torch.float64)
    y = torch.randn(n, 3, generator=g, dtype=torch.float64)
    w = torch.rand(n, generator=g, dtype=torch.float64) * 2  # a non-negative weight per row
    return x, y, w


def weighted_mse(model, b):
    x, y, w = b
    return ((model(x) - y).pow(2).mean(1) * w).sum() / w.sum()


@pytest.mark.parametrize("as_tensor", [True, False], ids=["tensor", "float"])
@pytest.mark.parametrize("m", [4, 7])
def test_weighted_float_counts_are_exact(m, as_tensor, device):
    model = classifier(device, bn=False)
    ref = copy.deepcopy(model).cpu()
    opt, ropt = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    batch = weighted_batch(23)

    def weight(b):
        return b[2].sum() if as_tensor else float(b[2].sum())

    r = mbs_ext.step(model, opt, batch, weighted_mse, micro_batch_size=m, normalize=weight)
    loss, _ = full_batch_step(ref, ropt, batch, weighted_mse)
    assert abs(r.loss - loss) <= 1e-10 * abs(loss)
    assert_models_match(model, ref, 1e-10)


# --- gradients shaped like their parameters ---------------------------------------------------------


def test_bf16_channels_last_grads_have_their_parameters_strides():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3), nn.Flatten(), nn.LazyLinear(2))
    model(torch.randn(1, 3, 8, 8))
    model = model.to(torch.bfloat16).to(memory_format=torch.channels_last)
    conv = model[0].weight
    assert not conv.is_contiguous() and conv.is_contiguous(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    x = torch.randn(10, 3, 8, 8).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    y = torch.randn(10, 2).to(torch.bfloat16)
    before = [p.detach().clone() for p in model.parameters()]
    mbs_ext.step(model, opt, (x, y), nn.MSELoss(), micro_batch_size=4)
    for p, b in zip(model.parameters(), before):
        assert p.grad.stride() == p.stride(), (p.shape, p.stride(), p.grad.stride())
        assert p.grad.dtype == p.dtype
        assert not torch.equal(p, b)  # the fused AdamW stepped


def test_every_grad_owns_only_its_own_bytes():
    """Mixed dtypes: fp32 parameters' gradients are not views into the whole float32 buffer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 4))
    model[0].to(torch.bfloat16)
    model[2].to(torch.bfloat16)

    def loss_fn(m, b):
        h = m[0](b[0])
        h = m[1](h.float()).to(torch.bfloat16)
        return (m[2](h).float() - b[1]).pow(2).mean()

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.randn(12, 16).bfloat16(), torch.randn(12, 4))
    mbs_ext.step(model, opt, batch, loss_fn, micro_batch_size=5)
    for name, p in model.named_parameters():
        g = p.grad
        assert g.untyped_storage().nbytes() == g.numel() * g.element_size(), name


# --- batch structures and indices -------------------------------------------------------------


class DictModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(2, 3)

    def forward(self, batch):
        assert batch["tag"] == "keep-me"
        x1, x2 = batch["inputs"]["pair"]
        return self.a(x1) * batch["inputs"]["scale"][:, None] + self.b(x2)


def dict_loss(model, batch):
    return F.mse_loss(model(batch), batch["target"])


def test_nested_dict_batch(device):
    torch.manual_seed(0)
    model, opt, ref, ropt = twins(DictModel().double(), device=device)
    g = torch.Generator().manual_seed(3)
    n = 11
    batch = {
        "inputs": {
            "pair": (torch.randn(n, 4, generator=g, dtype=torch.float64),
                     torch.randn(n, 2, generator=g, dtype=torch.float64)),
            "scale": torch.rand(n, generator=g, dtype=torch.float64),
        },
        "target": torch.randn(n, 3, generator=g, dtype=torch.float64),
        "tag": "keep-me",
    }
    mbs_ext.step(model, opt, batch, dict_loss, micro_batch_size=3)
    full_batch_step(ref, ropt, batch, dict_loss)
    assert_models_match(model, ref, 1e-12)


def test_indices_select_rows_of_a_dataset(device):
    model, opt, ref, ropt = twins(mlp(), device=device)
    dataset = pair(30)
    idx = torch.tensor([29, 3, 3, 17, 0, 8, 21, 5, 12, 12, 1], dtype=torch.int64)
    res = mbs_ext.step(model, opt, dataset, mse, micro_batch_size=4, indices=idx)
    full_batch_step(ref, ropt, (dataset[0][idx], dataset[1][idx]), mse)
    assert_models_match(model, ref, 1e-12)
    assert res.num_samples == 11


# --- bad input: refused before anything changes -----------------------------------------------


def _bad(kind, device):
    model = mlp().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = pair(6)
    kw = {"micro_batch_size": 2}
    loss_fn = mse
    if kind == "model":
        model = "not a module"
    elif kind == "optimizer":
        opt = object()
    elif kind == "foreign_optimizer":
        opt = torch.optim.SGD(mlp().to(device).parameters(), lr=0.1)
    elif kind == "no_trainable":
        model.requires_grad_(False)
    elif kind == "empty_batch":
        batch = pair(0)
    elif kind == "mismatched":
        batch = (torch.randn(6, 5, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64))
    elif kind == "no_tensor":
        batch = {"a": [1, 2], "b": "x"}
    elif kind == "nested_tensor":  # layout strided, but no row sizes to split by
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch: nested tensors are a prototype
            batch = (torch.nested.nested_tensor([torch.randn(2, 5), torch.randn(3, 5)]), torch.randn(2, 3))
    elif kind.startswith("mbs_"):
        kw["micro_batch_size"] = {"mbs_0": 0, "mbs_neg": -2, "mbs_float": 2.0, "mbs_bool": True,
                                  "mbs_str": "big", "mbs_auto": "auto"}[kind]
    elif kind == "loss_not_callable":
        loss_fn = 3
    elif kind == "loss_non_tensor":
        loss_fn = lambda m, b: 1.0  # noqa: E731
    elif kind == "loss_non_scalar":
        loss_fn = lambda m, b: (m(b[0]) - b[1]).pow(2).mean(0)  # noqa: E731
    elif kind == "loss_no_grad":
        loss_fn = lambda m, b: mse(m, b).detach()  # noqa: E731
    elif kind == "loss_other_device":
        loss_fn = lambda m, b: mse(m, b).to("meta")  # noqa: E731
    elif kind == "nn_loss_non_pair":
        loss_fn = nn.MSELoss()
        batch = {"x": batch[0]}
    elif kind == "normalize":
        kw["normalize"] = "tokens"
    elif kind == "indices_float":
        kw["indices"] = torch.tensor([0.0, 1.0])
    elif kind == "indices_2d":
        kw["indices"] = torch.zeros(2, 2, dtype=torch.int64)
    elif kind == "indices_range":
        kw["indices"] = torch.tensor([0, 6])
    elif kind == "indices_empty":
        kw["indices"] = torch.zeros(0, dtype=torch.int64)
    elif kind == "scaler":
        kw["scaler"] = "fp16"
    elif kind == "autocast_dtype":
        kw["autocast_dtype"] = torch.int32
    elif kind == "accumulate_dtype":
        kw["accumulate_dtype"] = torch.int64
    elif kind == "max_grad_norm_zero":
        kw["max_grad_norm"] = 0.0
    elif kind == "max_grad_norm_nan":
        kw["max_grad_norm"] = float("nan")
    elif kind == "on_nonfinite":
        kw["on_nonfinite"] = "ignore"
    return model, opt, batch, loss_fn, kw


BAD = {
    "model": "model", "optimizer": "optimizer", "foreign_optimizer": "optimizer",
    "no_trainable": "trainable", "empty_batch": "empty", "mismatched": "dim-0", "no_tensor": "batch",
    "nested_tensor": "tensor 0 is a nested tensor",
    "mbs_0": "micro_batch_size", "mbs_neg": "micro_batch_size", "mbs_float": "micro_batch_size",
    "mbs_bool": "micro_batch_size", "mbs_str": "micro_batch_size", "mbs_auto": "memory_budget",
    "loss_not_callable": "loss_fn", "loss_non_tensor": "loss_fn", "loss_non_scalar": "loss_fn",
    "loss_no_grad": "loss_fn", "loss_other_device": "loss_fn", "nn_loss_non_pair": "loss_fn",
    "normalize": "normalize", "indices_float": "indices", "indices_2d": "indices",
    "indices_range": "indices", "indices_empty": "indices", "scaler": "scaler",
    "autocast_dtype": "autocast_dtype", "accumulate_dtype": "accumulate_dtype",
    "max_grad_norm_zero": "max_grad_norm", "max_grad_norm_nan": "max_grad_norm",
    "on_nonfinite": "on_nonfinite",
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_bad_input(kind, device):
    if kind == "mbs_auto" and device != "cpu":
        pytest.skip("'auto' needs no memory_budget on CUDA (tested in test_step_cuda.py)")
    model, opt, batch, loss_fn, kw = _bad(kind, device)
    valid = isinstance(model, nn.Module) and isinstance(opt, torch.optim.Optimizer)
    before = snapshot(model, opt) if valid else None
    with pytest.raises((TypeError, ValueError), match=BAD[kind]):
        mbs_ext.step(model, opt, batch, loss_fn, **kw)
    if before is not None:
        assert_bit_identical(snapshot(model, opt), before)
        assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(("typo", "meant"), [("micro_batch_sise", "micro_batch_size"),
                                              ("max_grad_nrom", "max_grad_norm"), ("normalise", "normalize")])
def test_a_mistyped_option_is_named_with_what_it_meant(typo, meant):
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kw = {"micro_batch_size": 4, typo: 1.0} if typo != "micro_batch_sise" else {typo: 4}
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(TypeError, match=rf"unknown option {typo}= \(did you mean {meant}=\?\)"):
        mbs_ext.step(model, opt, (torch.randn(8, 3), torch.randn(8, 1)), torch.nn.MSELoss(), **kw)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    with pytest.raises(TypeError, match=rf"unknown option {typo}="):
        mbs_ext.StepOptions(micro_batch_size=4).replace(**{typo: 1})


def test_dir_shows_the_public_names_only():
    """What a newcomer sees first: ``dir(mbs_ext)`` lists the API, not ``torch`` or ``annotations``."""
    shown = set(dir(mbs_ext))
    assert set(mbs_ext.__all__) <= shown and "diagnostics" in shown
    assert not shown & {"torch", "annotations", "_C"}, shown
