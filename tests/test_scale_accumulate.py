"""The fused scale-and-accumulate op against a float64 per-tensor reference."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import mbs_ext

FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
# Tolerance of one accumulator-dtype rounding on top of the float64 reference.
RTOL = {torch.float32: 2e-6, torch.float64: 1e-12, torch.bfloat16: 8e-3, torch.float16: 1e-3}


def reference(acc: torch.Tensor, grad: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.add(acc.double(), grad.double(), alpha=scale).to(acc.dtype)


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype
    tol = RTOL[out.dtype]
    torch.testing.assert_close(out.double(), ref.double(), rtol=tol, atol=tol, equal_nan=True)


def random_shapes(gen: torch.Generator, count: int) -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = [(0,), (1,), (3, 0), (7,), (1, 1, 1)]
    while len(shapes) < count:
        ndim = int(torch.randint(1, 4, (), generator=gen))
        shapes.append(tuple(int(torch.randint(1, 40, (), generator=gen)) for _ in range(ndim)))
    return shapes[:count]


@pytest.mark.parametrize("acc_dtype,grad_dtype", list(itertools.product(FLOATS, FLOATS)))
@pytest.mark.parametrize("scale_kind", ["number", "tensor"])
def test_every_dtype_pair(device, acc_dtype, grad_dtype, scale_kind):
    gen = torch.Generator().manual_seed(hash((acc_dtype, grad_dtype)) % 2**31)
    shapes = random_shapes(gen, 12) + [(1003,), (4097, 3)]
    accs = [torch.randn(s, generator=gen).to(device, acc_dtype) for s in shapes]
    grads = [torch.randn(s, generator=gen).to(device, grad_dtype) for s in shapes]
    scale = 0.3 if scale_kind == "number" else torch.tensor(0.3, device=device)
    expected = [reference(a, g, float(scale)) for a, g in zip(accs, grads)]
    found_inf = mbs_ext.scale_accumulate_(accs, grads, scale)
    for out, ref in zip(accs, expected):
        assert_matches(out, ref)
    assert found_inf.item() == 0.0
    assert found_inf.device.type == torch.device(device).type


def test_mixed_dtypes_in_one_call_and_many_tensors(device):
    gen = torch.Generator().manual_seed(0)
    shapes = random_shapes(gen, 260)
    accs, grads = [], []
    for i, shape in enumerate(shapes):
        accs.append(torch.randn(shape, generator=gen).to(device, FLOATS[i % 4]))
        grads.append(torch.randn(shape, generator=gen).to(device, FLOATS[(i // 4) % 4]))
    expected = [reference(a, g, -1.75) for a, g in zip(accs, grads)]
    mbs_ext.scale_accumulate_(accs, grads, -1.75)
    for out, ref in zip(accs, expected):
        assert_matches(out, ref)


def test_large_tensor_spans_threads(device):
    # Large enough that the CPU kernel splits the flat range across threads and
    # the CUDA kernel uses many chunks per tensor.
    acc = torch.randn(3_000_001, device=device)
    grad = torch.randn(3_000_001, device=device)
    small_acc = [torch.randn(5, device=device) for _ in range(50)]
    small_grad = [torch.randn(5, device=device) for _ in range(50)]
    expected = [reference(a, g, 2.0) for a, g in zip([acc, *small_acc], [grad, *small_grad])]
    mbs_ext.scale_accumulate_([acc, *small_acc], [grad, *small_grad], 2.0)
    for out, ref in zip([acc, *small_acc], expected):
        assert_matches(out, ref)


def test_non_contiguous_tensors(device):
    base_acc = torch.randn(33, 18, device=device)
    base_grad = torch.randn(18, 33, device=device, dtype=torch.bfloat16)
    acc = base_acc[:, ::2]  # strided view: written back in place
    grad = base_grad.t()[:, 1::2]
    untouched = base_acc[:, 1::2].clone()
    expected = reference(acc, grad, 0.5)
    mbs_ext.scale_accumulate_([acc], [grad], 0.5)
    assert_matches(acc, expected)
    assert torch.equal(base_acc[:, 1::2], untouched)
    assert_matches(base_acc[:, ::2], expected)


def test_zero_pairs_is_a_no_op(device):
    found_inf = torch.zeros((), device=device)
    assert mbs_ext.scale_accumulate_([], [], 1.0, found_inf) is found_inf
    assert found_inf.item() == 0.0


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("where", ["first", "last", "tail"])
@pytest.mark.parametrize("grad_dtype", FLOATS)
def test_found_inf(device, bad, where, grad_dtype):
    sizes = [17, 4096 + 3, 1]
    accs = [torch.zeros(n, device=device) for n in sizes]
    grads = [torch.ones(n, device=device, dtype=grad_dtype) for n in sizes]
    if where == "first":
        grads[0][0] = bad
    elif where == "last":
        grads[-1][-1] = bad
    else:  # a vector tail element of an odd-sized tensor
        grads[1][-2] = bad
    found_inf = mbs_ext.scale_accumulate_(accs, grads, 1.0)
    assert found_inf.item() == 1.0
    flat = torch.cat([a.cpu() for a in accs])
    assert (~torch.isfinite(flat)).sum().item() == 1  # propagates into the accumulator
    # Never reset by the op: a clean call keeps the flag set.
    clean = [torch.ones(3, device=device)]
    mbs_ext.scale_accumulate_([torch.zeros(3, device=device)], clean, 1.0, found_inf)
    assert found_inf.item() == 1.0


def test_scale_tensor_on_device_is_read_on_device(device):
    scale = torch.tensor(0.25, device=device, dtype=torch.float64)
    acc = [torch.ones(10, device=device, dtype=torch.float64)]
    mbs_ext.scale_accumulate_(acc, [torch.full((10,), 4.0, device=device, dtype=torch.float64)], scale)
    assert torch.equal(acc[0].cpu(), torch.full((10,), 2.0, dtype=torch.float64))


@pytest.mark.parametrize(
    "make_args,error,match",
    [
        (lambda: ([torch.zeros(2)], [], 1.0), ValueError, "same length"),
        (lambda: ([torch.zeros(2)], [torch.zeros(3)], 1.0), ValueError, r"accumulators\[0\] has shape"),
        (lambda: ([torch.zeros(2, dtype=torch.int32)], [torch.zeros(2)], 1.0), TypeError, r"accumulators\[0\]"),
        (lambda: ([torch.zeros(2)], [torch.zeros(2, dtype=torch.int64)], 1.0), TypeError, r"grads\[0\]"),
        (lambda: ([torch.zeros(2)], [torch.zeros(2)], torch.ones(2)), ValueError, "scale"),
        (lambda: ([torch.zeros(2)], [torch.zeros(2)], "x"), TypeError, "scale"),
        (lambda: ([torch.zeros(2)], [torch.zeros(2)], True), TypeError, "scale"),
        (lambda: (torch.zeros(2), [torch.zeros(2)], 1.0), TypeError, "sequences"),
        (lambda: ([torch.zeros(2)], [[1.0, 2.0]], 1.0), TypeError, r"grads\[0\]"),
    ],
)
def test_bad_arguments(make_args, error, match):
    accs, grads, scale = make_args()
    with pytest.raises(error, match=match):
        mbs_ext.scale_accumulate_(accs, grads, scale)


def test_bad_found_inf():
    with pytest.raises(ValueError, match="found_inf"):
        mbs_ext.scale_accumulate_([torch.zeros(2)], [torch.zeros(2)], 1.0, torch.zeros(2))
    with pytest.raises(ValueError, match="found_inf"):
        mbs_ext.scale_accumulate_([torch.zeros(2)], [torch.zeros(2)], 1.0, torch.zeros((), dtype=torch.float64))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_mismatched_devices_named():
    with pytest.raises(ValueError, match=r"grads\[0\] is on"):
        mbs_ext.scale_accumulate_([torch.zeros(2, device="cuda")], [torch.zeros(2)], 1.0)


def test_opcheck():
    gen = torch.Generator().manual_seed(1)
    accs = [torch.randn(5, generator=gen), torch.randn(3, 2, generator=gen, dtype=torch.float64)]
    grads = [torch.randn(5, generator=gen, dtype=torch.bfloat16), torch.randn(3, 2, generator=gen)]
    args = (accs, grads, torch.tensor(0.5), torch.zeros(()))
    torch.library.opcheck(torch.ops.mbs_ext.scale_accumulate_.default, args)


def test_works_under_torch_compile():
    def accumulate(accs, grads):
        torch.ops.mbs_ext.scale_accumulate_(accs, grads, torch.tensor(2.0), torch.zeros(()))
        return accs[0] * 1

    accs = [torch.zeros(4)]
    out = torch.compile(accumulate, backend="aot_eager", fullgraph=True)(accs, [torch.ones(4)])
    assert torch.equal(out, torch.full((4,), 2.0))


def test_build_info():
    info = mbs_ext.build_info()
    assert set(info) >= {"cuda_compiled", "cuda_archs", "torch_version", "openmp", "version"}
    assert info["torch_version"] == torch.__version__
    if info["cuda_compiled"]:
        assert info["cuda_archs"], "a CUDA build must report the archs it compiled"
