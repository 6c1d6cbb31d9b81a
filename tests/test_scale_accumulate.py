"""The fused scale-and-accumulate op against a float64 per-tensor reference."""

from __future__ import annotations

import itertools
import math
import re
from collections import UserList
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from common import TESTS, run_python

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


def _copies_during(call) -> list[str]:
    """The copy-making aten ops the profiler records while ``call`` runs (also those issued from
    inside the op's C++ kernel)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        call()
    names = ("aten::clone", "aten::contiguous", "aten::copy_", "aten::empty_like")
    return [e.name for e in prof.events() if e.name in names]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_equal_stride_pair_is_not_copied(device, dtype):
    """A channels_last accumulator and its channels_last grad (a conv weight's layout) accumulate
    in place, with no contiguous stand-ins; a pair whose strides differ still needs them."""
    gen = torch.Generator().manual_seed(3)
    shape = (8, 3, 5, 4)
    acc = torch.randn(shape, generator=gen).to(device).contiguous(memory_format=torch.channels_last)
    grad = torch.randn(shape, generator=gen).to(device, dtype).contiguous(memory_format=torch.channels_last)
    assert not acc.is_contiguous() and acc.stride() == grad.stride()
    expected = acc.double() + 0.5 * grad.double()
    copies = _copies_during(lambda: mbs_ext.scale_accumulate_([acc], [grad], 0.5))
    assert copies == [], copies
    assert acc.stride() == grad.stride()
    torch.testing.assert_close(acc.double(), expected, rtol=1e-6, atol=1e-6)
    # The same check sees the stand-ins where strides differ: the test can fail.
    plain = torch.zeros(shape, device=device)
    assert _copies_during(lambda: mbs_ext.scale_accumulate_([plain], [grad], 0.5))


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


def _bad_calls(device: str) -> list[tuple[str, object, type, str]]:
    """(id, thunk, error, message pattern) for bad calls of the Python API on `device`."""

    def z(*shape, dtype=torch.float32, dev=device):
        return torch.zeros(shape or (2,), dtype=dtype, device=dev)

    def leaf():
        return z().requires_grad_()

    def ok():
        return [z() for _ in range(4)]

    def shared(make):  # one buffer used twice in a call
        return lambda: make(z(8))

    cases = [
        ("length", lambda: ([z()], [], 1.0), ValueError, "same length"),
        ("length-rev", lambda: ([], [z()], 1.0), ValueError, "same length"),
        ("shape", lambda: ([z()], [z(3)], 1.0), ValueError, r"accumulators\[0\] has shape"),
        ("shape-3", lambda: ([*ok(), z()], [*ok(), z(2, 1)], 1.0), ValueError, r"accumulators\[4\] has shape"),
        ("int-acc", lambda: ([z(dtype=torch.int32)], [z()], 1.0), TypeError, r"accumulators\[0\]"),
        ("int-grad", lambda: ([z()], [z(dtype=torch.int64)], 1.0), TypeError, r"grads\[0\]"),
        ("bool-grad", lambda: ([*ok(), z()], [*ok(), z(dtype=torch.bool)], 1.0), TypeError, r"grads\[4\]"),
        ("complex-grad", lambda: ([z()], [z(dtype=torch.complex64)], 1.0), TypeError, r"grads\[0\]"),
        ("sparse-grad", lambda: ([z()], [z().to_sparse()], 1.0), TypeError, r"grads\[0\] must be a dense"),
        ("meta-acc", lambda: ([z(dev="meta")], [z(dev="meta")], 1.0), ValueError, "meta"),
        ("meta-grad", lambda: ([z()], [z(dev="meta")], 1.0), ValueError, r"grads\[0\] is on meta"),
        ("not-tensor", lambda: ([z()], [[1.0, 2.0]], 1.0), TypeError, r"grads\[0\]"),
        ("none", lambda: ([*ok(), None], [*ok(), z()], 1.0), TypeError, r"accumulators\[4\]"),
        ("single-tensor", lambda: (z(), [z()], 1.0), TypeError, "list or tuple"),
        ("generator", lambda: ((t for t in [z()]), [z()], 1.0), TypeError, "list or tuple"),
        ("scale-shape", lambda: ([z()], [z()], torch.ones(2)), ValueError, "scale"),
        ("scale-str", lambda: ([z()], [z()], "x"), TypeError, "scale"),
        ("scale-bool", lambda: ([z()], [z()], True), TypeError, "scale"),
        ("scale-complex", lambda: ([z()], [z()], 1j), TypeError, "scale"),
        ("scale-inf", lambda: ([z()], [z()], math.inf), ValueError, "scale must be finite"),
        ("scale-huge-int", lambda: ([z()], [z()], 10**400), ValueError, "scale must be finite"),
        ("scale-int-tensor", lambda: ([z()], [z()], torch.tensor(2)), TypeError, "scale"),
        ("acc-requires-grad", lambda: ([leaf()], [z()], 1.0), ValueError, r"accumulators\[0\] requires grad"),
        ("grad-requires-grad", lambda: ([z()], [leaf()], 1.0), ValueError, r"grads\[0\] requires grad"),
        ("expanded-acc", lambda: ([z(1).expand(4)], [z(4)], 1.0), ValueError, "share memory"),
        ("same-acc-twice", shared(lambda b: ([b, b], [z(8), z(8)], 1.0)), ValueError, "share memory"),
        ("acc-is-grad", shared(lambda b: ([b], [b], 1.0)), ValueError, "share memory"),
        ("overlapping-views", shared(lambda b: ([b[:5], b[4:]], [z(5), z(4)], 1.0)), ValueError, "share memory"),
        ("found-inf-in-acc", shared(lambda b: ([b], [z(8)], 1.0, b[3])), ValueError, "found_inf"),
        ("sq-norm-shape", lambda: ([z()], [z()], 1.0, None, z(1)), ValueError, "sq_norm must be a 0-dim"),
        ("sq-norm-f16", lambda: ([z()], [z()], 1.0, None, z(dtype=torch.float16)[0]), TypeError,
         "sq_norm must be a float32 or float64"),
        ("sq-norm-int", lambda: ([z()], [z()], 1.0, None, torch.zeros((), dtype=torch.int64, device=device)),
         TypeError, "sq_norm must be a float32 or float64"),
        ("sq-norm-number", lambda: ([z()], [z()], 1.0, None, 0.0), TypeError, "sq_norm must be a 0-dim .* or None"),
        ("sq-norm-requires-grad", lambda: ([z()], [z()], 1.0, None, torch.zeros((), device=device, requires_grad=True)),
         ValueError, "sq_norm requires grad"),
        ("sq-norm-in-acc", shared(lambda b: ([b], [z(8)], 1.0, None, b[3])), ValueError, "sq_norm"),
        ("sq-norm-in-grad", shared(lambda b: ([z(8)], [b], 1.0, None, b[0])), ValueError, "sq_norm"),
        ("sq-norm-is-found-inf", shared(lambda b: ([z()], [z()], 1.0, b[0], b[0])), ValueError,
         "found_inf and sq_norm may share memory"),
        ("sq-norm-sparse", lambda: ([z()], [z()], 1.0, None, torch.zeros(2, device=device).to_sparse()), TypeError,
         "sq_norm must be a dense"),
    ]
    if device == "cuda":
        cases += [
            ("sq-norm-cpu", lambda: ([z()], [z()], 1.0, None, torch.zeros((), dtype=torch.float64)), ValueError,
             "sq_norm is on cpu"),
            ("acc-cuda-grad-cpu", lambda: ([z()], [z(dev="cpu")], 1.0), ValueError, r"grads\[0\] is on cpu"),
            ("acc-cpu-grad-cuda", lambda: ([z(dev="cpu")], [z()], 1.0), ValueError, r"grads\[0\] is on cuda"),
            ("scale-cuda-tensors-cpu", lambda: ([z(dev="cpu")], [z(dev="cpu")], torch.tensor(1.0, device="cuda")),
             ValueError, "scale is on cuda"),
            ("found-inf-cpu", lambda: ([z()], [z()], 1.0, torch.zeros(())), ValueError, "found_inf is on cpu"),
        ]
    return cases


def _bad_case_ids(device: str) -> list[str]:
    return [case[0] for case in _bad_calls(device)]


@pytest.mark.parametrize("case", _bad_case_ids("cuda"))
def test_bad_arguments(device, case):
    cases = {c[0]: c for c in _bad_calls(device)}
    if case not in cases:
        pytest.skip(f"{case} needs two device types")
    _, make_args, error, match = cases[case]
    with pytest.raises(error, match=match):
        mbs_ext.scale_accumulate_(*make_args())


def _raw_bad_calls(device: str) -> list[tuple[str, object, type, str]]:
    """Bad calls straight through torch.ops: the C++ checks, before any data access."""

    def z(*shape, dtype=torch.float32, dev=device):
        return torch.zeros(shape or (2,), dtype=dtype, device=dev)

    def flag(dev=device, dtype=torch.float32, shape=()):
        return torch.zeros(shape, dtype=dtype, device=dev)

    def shared(make):  # one buffer used twice in a call
        return lambda: make(z(8))

    one = torch.tensor(1.0)
    cases = [
        ("length", lambda: ([z()], [], one, flag()), ValueError, "same length"),
        ("length-rev", lambda: ([], [z()], one, flag()), ValueError, "same length"),
        ("length-many", lambda: ([z(), z(), z()], [z()], one, flag()), ValueError, "same length"),
        ("shape", lambda: ([z(), z()], [z(), z(3)], one, flag()), ValueError, r"accumulators\[1\] has shape"),
        ("int-acc", lambda: ([z(dtype=torch.int32)], [z()], one, flag()), TypeError, r"accumulators\[0\]"),
        ("complex-grad", lambda: ([z()], [z(dtype=torch.complex64)], one, flag()), TypeError, r"grads\[0\]"),
        ("found-inf-shape", lambda: ([z()], [z()], one, flag(shape=(2,))), ValueError, "found_inf"),
        ("found-inf-f64", lambda: ([z()], [z()], one, flag(dtype=torch.float64)), ValueError, "found_inf"),
        ("scale-shape", lambda: ([z()], [z()], torch.ones(2), flag()), ValueError, "scale"),
        ("scale-int", lambda: ([z()], [z()], torch.tensor(1), flag()), TypeError, "scale"),
        ("scale-f16", lambda: ([z()], [z()], torch.tensor(1.0, dtype=torch.float16), flag()), TypeError, "scale"),
        ("expanded-acc", lambda: ([z(1).expand(4)], [z(4)], one, flag()), ValueError, "share memory"),
        ("acc-is-grad", shared(lambda b: ([b], [b], one, flag())), ValueError, "share memory"),
        ("same-acc-twice", shared(lambda b: ([b, b], [z(8), z(8)], one, flag())), ValueError, "share memory"),
        ("found-inf-in-acc", shared(lambda b: ([b], [z(8)], one, b[2])), ValueError, "found_inf"),
        ("sq-norm-shape", lambda: ([z()], [z()], one, flag(), flag(shape=(1,))), ValueError, "sq_norm must be a 0-dim"),
        ("sq-norm-bf16", lambda: ([z()], [z()], one, flag(), flag(dtype=torch.bfloat16)), TypeError, "sq_norm"),
        ("sq-norm-in-acc", shared(lambda b: ([b], [z(8)], one, flag(), b[5])), ValueError, "sq_norm"),
    ]
    if device == "cuda":
        cases += [
            ("sq-norm-cpu", lambda: ([z()], [z()], one, flag(), flag(dev="cpu")), ValueError, "sq_norm is on cpu"),
            ("acc-cuda-grad-cpu", lambda: ([z()], [z(dev="cpu")], one, flag()), ValueError, r"grads\[0\] is on cpu"),
            ("acc-cpu-grad-cuda", lambda: ([z(dev="cpu")], [z()], one, flag(dev="cpu")), ValueError, "on cpu"),
            ("found-inf-cpu", lambda: ([z()], [z()], one, flag(dev="cpu")), ValueError, "found_inf is on cpu"),
            # Everything on the CPU but a CUDA scale: the dispatcher picks the CUDA kernel.
            ("only-scale-cuda", lambda: ([z(dev="cpu")], [z(dev="cpu")], one.cuda(), flag(dev="cpu")), ValueError,
             "CUDA kernel was called with tensors on cpu"),
            ("empty-scale-cuda", lambda: ([], [], one.cuda(), flag(dev="cpu")), ValueError, "CUDA kernel"),
            ("length-scale-cuda", lambda: ([z(dev="cpu")], [], one.cuda(), flag(dev="cpu")), ValueError, "same length"),
        ]
    return cases


_CRASH_CANARY = r"""
import re, sys, torch
sys.path.insert(0, {tests!r})
import test_scale_accumulate as t
failures = []
makers = [(t._bad_calls, lambda a: t.mbs_ext.scale_accumulate_(*a)),
          (t._raw_bad_calls, lambda a: torch.ops.mbs_ext.scale_accumulate_(*a))]
for maker, call in makers:
    for name, make_args, error, match in maker({device!r}):
        print(f"{{maker.__name__}} {{name}}", flush=True)  # the last line names a case that crashed
        try:
            call(make_args())
        except error as exc:
            if not re.search(match, str(exc)):
                failures.append(f"{{name}}: message {{exc}} does not match {{match!r}}")
        except Exception as exc:
            failures.append(f"{{name}}: {{type(exc).__name__}}: {{exc}}")
        else:
            failures.append(f"{{name}}: no error")
print("FAILURES:", *failures, sep="\n")
sys.exit(1 if failures else 0)
"""


def test_bad_arguments_never_crash_the_process(device):
    """Every bad call, through the Python API and straight through torch.ops (the C++ checks
    alone, raising from inside the kernels), in a child process: a crash there fails this
    test with the name of the case instead of killing the test run."""
    code = _CRASH_CANARY.format(tests=str(TESTS), device=device)
    proc = run_python(code, timeout=300, check=False)  # judged here: the last case started names a crash
    last = proc.stdout.strip().splitlines()[-1:] if proc.returncode < 0 else []
    assert proc.returncode == 0, (
        f"exit {proc.returncode} (a negative code is a signal; last case started: {last})\n"
        f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )


def test_requires_grad_tensors_accepted_without_grad_mode(device):
    acc = torch.ones(5, device=device, requires_grad=True)
    grad = torch.full((5,), 2.0, device=device)
    with torch.no_grad():
        mbs_ext.scale_accumulate_([acc], [grad], 0.5)
    assert torch.equal(acc.detach().cpu(), torch.full((5,), 2.0))


def _opcheck_args(device: str) -> list[tuple]:
    gen = torch.Generator().manual_seed(1)

    def r(*shape, dtype=torch.float32):
        return torch.randn(shape, generator=gen).to(device, dtype)

    strided = r(6, 4)[:, ::2]  # non-contiguous accumulator, written back
    return [
        ([r(5), r(3, 2, dtype=torch.float64)], [r(5, dtype=torch.bfloat16), r(3, 2)], torch.tensor(0.5),
         torch.zeros((), device=device)),
        ([strided, r(7, dtype=torch.float16)], [r(6, 2, dtype=torch.float16), r(7, dtype=torch.float64)],
         torch.tensor(-2.0, dtype=torch.float64, device=device), torch.zeros((), device=device)),
        ([], [], torch.tensor(1.0), torch.zeros((), device=device)),
    ]


@pytest.mark.parametrize("which", range(3))
def test_opcheck(device, which):
    args = _opcheck_args(device)[which]
    torch.library.opcheck(torch.ops.mbs_ext.scale_accumulate_.default, args)


@pytest.mark.parametrize("acc_dtype,grad_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                  (torch.bfloat16, torch.float32), (torch.float64, torch.float16)])
def test_misaligned_views_and_chunk_edges(device, acc_dtype, grad_dtype):
    """Views at every byte offset class: the vector path from the first jointly aligned element,
    the scalar path where the two can never be aligned together, and chunk boundaries in both."""
    n = 2 * 65536 + 5
    gen = torch.Generator().manual_seed(3)
    acc_base = torch.randn(n + 8, generator=gen).to(device, acc_dtype)
    grad_base = torch.randn(n + 8, generator=gen).to(device, grad_dtype)
    for a_off, g_off in itertools.product([0, 1, 3], [0, 1, 2, 5]):
        acc = acc_base.clone()[a_off : a_off + n]
        grad = grad_base[g_off : g_off + n]
        expected = reference(acc, grad, 0.75)
        found_inf = mbs_ext.scale_accumulate_([acc], [grad], 0.75)
        assert_matches(acc, expected)
        assert found_inf.item() == 0.0


def test_many_launches(device):
    """More tensors than one launch's metadata holds (1,344 on a CUDA 13 build, 168 before), with
    a large tensor among tiny ones: every element updated exactly once."""
    gen = torch.Generator().manual_seed(4)
    sizes = [int(torch.randint(1, 300, (), generator=gen)) for _ in range(1500)]
    sizes.insert(100, 384 * 65536 + 4099)
    accs = [torch.randn(s, generator=gen).to(device) for s in sizes]
    grads = [torch.randn(s, generator=gen).to(device, torch.bfloat16) for s in sizes]
    expected = [reference(a, g, 1.5) for a, g in zip(accs, grads)]
    grads[100][-1] = math.nan
    expected[100][-1] = math.nan
    found_inf = mbs_ext.scale_accumulate_(accs, grads, 1.5)
    for out, ref in zip(accs, expected):
        assert_matches(out, ref)
    assert found_inf.item() == 1.0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensor_longer_than_one_piece():
    """The CUDA plan cuts a tensor of 2^31 elements or more into pieces with 32-bit counts:
    elements on both sides of the cut, and the last ones, are updated exactly once."""
    if torch.cuda.mem_get_info()[0] < 40 * 2**30:
        pytest.skip("needs 40 GiB of free GPU memory")
    n = 2**31 + 4099
    gen = torch.Generator(device="cuda").manual_seed(7)
    acc = torch.randn(n, generator=gen, device="cuda")
    grad = torch.randn(n, generator=gen, device="cuda").to(torch.bfloat16)
    before = acc.clone()
    grad[-2] = math.inf
    found_inf = mbs_ext.scale_accumulate_([acc], [grad], 0.5)
    assert found_inf.item() == 1.0
    step = 2**27
    for lo in range(0, n, step):
        hi = min(lo + step, n)
        expected = reference(before[lo:hi], grad[lo:hi], 0.5)
        assert_matches(acc[lo:hi], expected)


def test_accumulation_buffer_views_are_16_byte_aligned(device):
    """Odd-sized parameters do not push later views off the 16-byte vector path; the padding
    between views stays zero; the planner counts the padded buffer."""
    from mbs_ext.memory import planner
    from mbs_ext.model import grads

    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 7), torch.nn.Linear(7, 2))
    model = model.to(device, torch.bfloat16)
    params = list(model.parameters())
    bufs = grads.GradBuffers(params, torch.float32)
    assert all(v.data_ptr() % 16 == 0 for v in bufs.views)
    gen = torch.Generator().manual_seed(5)
    expected = [torch.zeros(p.shape, dtype=torch.float64) for p in params]
    for scale in (0.5, -1.25):
        for p, e in zip(params, expected):
            p.grad = torch.randn(p.shape, generator=gen).to(device, torch.bfloat16)
            e += scale * p.grad.double().cpu()
        bufs.add_(scale)
    for v, e in zip(bufs.views, expected):
        torch.testing.assert_close(v.double().cpu(), e, rtol=1e-6, atol=1e-6)
    flat = bufs.flats[0]
    written = torch.zeros(flat.numel(), dtype=torch.bool, device=device)
    for v in bufs.views:
        offset = (v.data_ptr() - flat.data_ptr()) // flat.element_size()
        written[offset : offset + v.numel()] = True
    assert flat.numel() > sum(p.numel() for p in params)  # there is padding to check
    assert torch.count_nonzero(flat[~written]) == 0
    assert planner._gradient_bytes(model, torch.float32)[1] == flat.numel() * flat.element_size()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_no_host_sync_and_graph_capture():
    """With a device scale and a given found_inf, the call never synchronizes, and it replays
    inside a CUDA graph with the flag written on the device."""
    accs = [torch.zeros(1000, device="cuda"), torch.zeros(70_000, device="cuda")]
    grads = [torch.ones(1000, device="cuda", dtype=torch.bfloat16), torch.ones(70_000, device="cuda")]
    scale = torch.tensor(0.5, device="cuda")
    found_inf = torch.zeros((), device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        mbs_ext.scale_accumulate_(accs, grads, scale, found_inf)
        mbs_ext.scale_accumulate_(accs, grads, 0.25, found_inf)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(accs[1].cpu(), torch.full((70_000,), 0.75))
    assert found_inf.item() == 0.0

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        mbs_ext.scale_accumulate_(accs, grads, scale, found_inf)  # warm-up outside capture
        with torch.cuda.graph(graph, stream=stream):
            mbs_ext.scale_accumulate_(accs, grads, scale, found_inf)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    before = accs[0].clone()
    scale.fill_(2.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(accs[0], before + 2.0)
    assert found_inf.item() == 0.0
    grads[1][12_345] = math.inf
    graph.replay()
    torch.cuda.synchronize()
    assert found_inf.item() == 1.0


def test_python_api_under_torch_compile():
    def accumulate(accs, grads, found_inf):
        mbs_ext.scale_accumulate_(accs, grads, 2.0, found_inf)
        return accs[0] * 1

    accs, found_inf = [torch.zeros(4)], torch.zeros(())
    out = torch.compile(accumulate, backend="aot_eager", fullgraph=True)(accs, [torch.ones(4)], found_inf)
    assert torch.equal(out, torch.full((4,), 2.0))
    assert found_inf.item() == 0.0


def test_python_api_under_fake_tensor_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        found_inf = mbs_ext.scale_accumulate_([torch.zeros(4)], [torch.ones(4)], 2.0)
    assert found_inf.shape == () and found_inf.dtype == torch.float32


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


_DEEP_BAD = {
    "int-grad": lambda: (torch.zeros(3), torch.ones(3, dtype=torch.int32), TypeError),
    "shape": lambda: (torch.zeros(3), torch.ones(4), ValueError),
    "meta-grad": lambda: (torch.zeros(3), torch.ones(3, device="meta"), ValueError),
    "acc-requires-grad": lambda: (torch.zeros(3, requires_grad=True), torch.ones(3), ValueError),
    "grad-requires-grad": lambda: (torch.zeros(3), torch.ones(3, requires_grad=True), ValueError),
    "expanded-acc": lambda: (torch.zeros(1).expand(3), torch.ones(3), ValueError),
    "not-tensor": lambda: (torch.zeros(3), [1.0, 2.0, 3.0], TypeError),
    "sparse-acc": lambda: (torch.zeros(3).to_sparse(), torch.ones(3), TypeError),
}


@pytest.mark.parametrize("kind", sorted(_DEEP_BAD))
def test_bad_pair_deep_in_a_long_list_is_named_and_nothing_is_written(kind):
    # The per-pair scan runs in C++; the pair it points at must get the same named error as the
    # first pair would, and no accumulator may change before the error.
    n, bad = 3000, 2718
    accs = [torch.zeros(3) for _ in range(n)]
    grads = [torch.full((3,), float(i)) for i in range(n)]
    accs[7], grads[7] = torch.zeros(2, 3).t(), torch.ones(3, 2)  # non-contiguous but valid
    accs[bad], grads[bad], error = _DEEP_BAD[kind]()
    with pytest.raises(error, match=rf"(accumulators|grads)\[{bad}\]") as info:
        mbs_ext.scale_accumulate_(accs, grads, 0.5)
    assert not str(info.value).startswith("scale_accumulate_:"), "raised by the kernel, not before dispatch"
    assert all(bool((a == 0).all()) for i, a in enumerate(accs) if i != bad and a.layout == torch.strided)


def test_long_list_with_non_contiguous_pairs_matches_torch_add():
    accs = [torch.randn(5, 3).t() if i % 3 == 0 else torch.randn(4) for i in range(1000)]
    grads = [torch.randn(3, 5) if i % 3 == 0 else torch.randn(8)[::2] for i in range(1000)]
    expected = [torch.add(a.double(), g.double(), alpha=0.25) for a, g in zip(accs, grads)]
    mbs_ext.scale_accumulate_(accs, grads, 0.25)
    for a, e in zip(accs, expected):
        torch.testing.assert_close(a.double(), e, rtol=1e-6, atol=1e-6)


def test_fake_kernel_runs_the_checks():
    """The fake kernel raises what the eager call raises (same C++ checks, no data needed),
    without the kernels' prefix: a bad call under fake tensors never reaches a kernel."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = torch.ops.mbs_ext.scale_accumulate_
    with FakeTensorMode():
        accs, grads = [torch.zeros(2), torch.zeros(2)], [torch.zeros(2), torch.zeros(3)]
        with pytest.raises(ValueError, match=r"^accumulators\[1\] has shape \[2\] but grads\[1\] has shape \[3\]$"):
            op(accs, grads, torch.tensor(1.0), torch.zeros(()))
        with pytest.raises(TypeError, match=r"^grads\[0\] must be float32"):
            op([torch.zeros(2)], [torch.zeros(2, dtype=torch.int32)], torch.tensor(1.0), torch.zeros(()))
        with pytest.raises(ValueError, match="found_inf must be a 0-dim float32 tensor"):
            op([torch.zeros(2)], [torch.zeros(2)], torch.tensor(1.0), torch.zeros(2))
        with pytest.raises(ValueError, match=r"accumulators\[0\] has elements that share memory"):
            op([torch.zeros(1).expand(4)], [torch.zeros(4)], torch.tensor(1.0), torch.zeros(()))
    with pytest.raises(ValueError, match=r"^accumulators\[1\] has shape \[2\] but grads\[1\] has shape \[3\]$"):
        mbs_ext.scale_accumulate_([torch.zeros(2), torch.zeros(2)], [torch.zeros(2), torch.zeros(3)], 1.0)


@pytest.mark.parametrize("dynamic", [False, True])
def test_bad_call_under_torch_compile_raises_the_eager_message(dynamic):
    """Traced, the public call's checks run in the fake kernel (dynamo cannot trace into C++):
    a shape mismatch fails the compilation with the message the eager call raises."""
    def accumulate(accs, grads):
        mbs_ext.scale_accumulate_(accs, grads, 2.0)
        return accs[0] * 1

    compiled = torch.compile(accumulate, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    assert torch.equal(compiled([torch.zeros(5)], [torch.ones(5)]), torch.full((5,), 2.0))
    with pytest.raises(Exception, match=r"accumulators\[0\] has shape \[\w+\] but grads\[0\] has shape \[\w+\]"):
        compiled([torch.zeros(7)], [torch.ones(6)])
    with pytest.raises(Exception, match=r"accumulators\[0\] requires grad"):
        compiled([torch.zeros(4, requires_grad=True)], [torch.ones(4)])


def test_dispatch_modes_and_profilers_see_the_op():
    """An eager call runs its kernel without the dispatcher; under a dispatch mode or a profiler
    it goes through the registered op (so they see it), with the same checks and messages."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    acc = torch.zeros(3)
    with Seen() as seen:
        mbs_ext.scale_accumulate_([acc], [torch.ones(3)], 0.5)
        with pytest.raises(ValueError, match=r"^accumulators\[0\] has shape \[3\] but grads\[0\] has shape \[4\]$"):
            mbs_ext.scale_accumulate_([torch.zeros(3)], [torch.ones(4)], 0.5)
    assert "mbs_ext.scale_accumulate_.default" in seen.ops
    assert torch.equal(acc, torch.full((3,), 0.5))
    with torch.profiler.profile() as prof:
        mbs_ext.scale_accumulate_([acc], [torch.ones(3)], 0.5)
    assert "mbs_ext::scale_accumulate_" in {e.name for e in prof.events()}
    assert torch.equal(acc, torch.full((3,), 1.0))


def test_tuples_numbers_and_16_bit_scales_take_every_path(device):
    """What the one crossing leaves to Python (other sequences, other numbers, 16-bit scales)
    adds what the fast path adds, into the given found_inf."""
    acc = torch.zeros(4, device=device)
    grad = torch.ones(4, device=device)
    found_inf = torch.zeros((), device=device)
    scales = [0.5, 1, Fraction(1, 2), torch.tensor(0.5, dtype=torch.bfloat16, device=device),
              torch.tensor(0.5, dtype=torch.float64)]
    for scale in scales:
        for seqs in (([acc], [grad]), ((acc,), (grad,)), (UserList([acc]), UserList([grad]))):
            assert mbs_ext.scale_accumulate_(*seqs, scale, found_inf) is found_inf
    assert torch.equal(acc.cpu(), torch.full((4,), 3 * 3.0))
    assert found_inf.item() == 0.0


def test_the_checks_are_written_once():
    """One check layer: every message of the op's argument checks is in csrc/ops/arguments.cpp
    alone; the Python face keeps only what C++ does not see (sequences, numbers, DTensors),
    and _C has one entry for the op (no scans beside it)."""
    root = Path(__file__).resolve().parent.parent
    sources = [*(root / "csrc").rglob("*.cpp"), *(root / "csrc").rglob("*.cu"), *(root / "csrc").rglob("*.h"),
               *(root / "mbs_ext").rglob("*.py")]
    messages = ["has shape", "must be a torch.Tensor", "is not differentiable", "may share memory;",
                "has elements that share memory",
                "same length", "must be float32, float64, bfloat16 or float16", "must be a dense",
                "found_inf must be a 0-dim float32", "scale must be float32 or float64", "kernel was called with",
                "runs on cpu and cuda tensors", "is not aligned", "sq_norm must be a 0-dim",
                "sq_norm must be a float32 or float64", "sq_norm requires grad"]
    for message in messages:
        holders = sorted(str(p.relative_to(root)) for p in sources if message in p.read_text())
        assert holders == ["csrc/ops/arguments.cpp"], (message, holders)
    native = mbs_ext.diagnostics.native
    assert [name for name in dir(native) if "scale" in name or "fault" in name or "scan" in name] == [
        "_scale_accumulate"
    ]


@pytest.mark.parametrize("call", ["mbs_ext", "torch add_"])
def test_an_accumulator_saved_for_backward_is_caught_by_autograd(call):
    """What the op writes gets a new version, as with torch's own in-place ops: a backward through
    an accumulator autograd saved, then changed by the op, is refused instead of silently wrong."""
    x = torch.randn(3, requires_grad=True)
    acc, found_inf = torch.zeros(3), torch.zeros(())
    y = (x * acc).sum()  # the product saves acc for x's gradient
    version = acc._version
    if call == "mbs_ext":
        before = found_inf._version
        mbs_ext.scale_accumulate_([acc], [torch.ones(3)], 1.0, found_inf)
        assert found_inf._version > before
    else:
        acc.add_(torch.ones(3))
    assert acc._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


# --- sq_norm: the sum of squares of the grads, read in the same pass ------------------------------

SQ_DTYPES = [torch.float64, torch.float32]


def squares_reference(grads) -> float:
    """sum(g^2) over every element of every grad, as read, in float64 on the host (independent of the op)."""
    return math.fsum(float((g.detach().cpu().double() ** 2).sum()) for g in grads)


def sq_rtol(device: str, sq_dtype: torch.dtype, grads=()) -> float:
    # CPU: float64 squares and sums (a few roundings of 2^-53), but float32 grads (into float32
    # accumulators, where the CPU has AVX2) squared in float32, 8 to a lane's partial sum, then
    # float64 (within 8 * 2^-24); CUDA: float per thread (<= 18 terms), float64 per block; a
    # float32 output rounds once per block on CUDA, once per call on the CPU.
    if sq_dtype == torch.float32:
        return 1e-6 if device == "cpu" else 1e-4
    if device == "cpu":
        return 1e-6 if any(g.dtype == torch.float32 for g in grads) else 1e-12
    return 2e-6


@pytest.mark.parametrize("acc_dtype,grad_dtype", list(itertools.product(FLOATS, FLOATS)))
@pytest.mark.parametrize("sq_dtype", SQ_DTYPES)
def test_sq_norm_every_dtype_pair(device, acc_dtype, grad_dtype, sq_dtype):
    """The sum of squares of the grads as read (not scaled, not rounded to the accumulator's
    dtype), added to what sq_norm held, with the same updates as a call without it."""
    gen = torch.Generator().manual_seed(hash((acc_dtype, grad_dtype, sq_dtype)) % 2**31)
    shapes = random_shapes(gen, 12) + [(1003,), (4097, 3), (70_001,)]
    accs = [torch.randn(s, generator=gen).to(device, acc_dtype) for s in shapes]
    grads = [(3 * torch.randn(s, generator=gen)).to(device, grad_dtype) for s in shapes]
    twins = [a.clone() for a in accs]
    start = 2.5
    sq_norm = torch.full((), start, dtype=sq_dtype, device=device)
    found_inf = mbs_ext.scale_accumulate_(accs, grads, -0.3, sq_norm=sq_norm)
    mbs_ext.scale_accumulate_(twins, grads, -0.3)
    for out, twin in zip(accs, twins):
        assert torch.equal(out, twin)  # the updates do not change with the sum
    assert found_inf.item() == 0.0
    assert sq_norm.dtype == sq_dtype and sq_norm.shape == () and sq_norm.device.type == torch.device(device).type
    expected = start + squares_reference(grads)
    assert sq_norm.item() == pytest.approx(expected, rel=sq_rtol(device, sq_dtype, grads))


def test_sq_norm_adds_up_over_calls_and_scale_does_not_enter(device):
    gen = torch.Generator().manual_seed(11)
    accs = [torch.zeros(300, device=device), torch.zeros(7, 9, device=device, dtype=torch.float64)]
    sq_norm = torch.zeros((), dtype=torch.float64, device=device)
    total = 0.0
    for scale in (0.5, -4.0, 1e-3):
        grads = [torch.randn(300, generator=gen).to(device, torch.bfloat16),
                 torch.randn(7, 9, generator=gen).to(device, torch.float64)]
        mbs_ext.scale_accumulate_(accs, grads, scale, None, sq_norm)
        total += squares_reference(grads)
        assert sq_norm.item() == pytest.approx(total, rel=sq_rtol(device, torch.float64, grads))


def test_sq_norm_non_contiguous_and_empty_grads(device):
    """Strided grads (copied to contiguous stand-ins, as the op does) and transposed pairs count
    every logical element once; empty tensors and an empty call add nothing."""
    gen = torch.Generator().manual_seed(12)
    base = torch.randn(40, 18, generator=gen).to(device)
    grads = [base[:, ::2], torch.randn(9, 5, generator=gen).to(device).t(), torch.zeros(0, device=device),
             torch.randn(3, 0, generator=gen).to(device), torch.randn(33, generator=gen).to(device, torch.float16)[::3]]
    accs = [torch.zeros(g.shape, device=device) for g in grads]
    accs[1] = torch.zeros(9, 5, device=device).t()  # the same strides as its grad: used as it is
    sq_norm = torch.zeros((), dtype=torch.float64, device=device)
    mbs_ext.scale_accumulate_(accs, grads, 1.0, None, sq_norm)
    assert sq_norm.item() == pytest.approx(squares_reference(grads), rel=sq_rtol(device, torch.float64, grads))
    for a, g in zip(accs, grads):
        torch.testing.assert_close(a, g.float(), rtol=0, atol=0)

    nothing = torch.full((), 7.0, dtype=torch.float64, device=device)
    mbs_ext.scale_accumulate_([], [], 1.0, None, nothing)
    mbs_ext.scale_accumulate_([torch.zeros(0, 3, device=device)], [torch.zeros(0, 3, device=device)], 1.0, None,
                              nothing)
    assert nothing.item() == 7.0


def test_sq_norm_large_call_is_the_same_every_run_and_any_thread_count():
    """On the CPU the sum is added in fixed blocks in a fixed order: bit for bit the same on every
    run, with one thread or several."""
    gen = torch.Generator().manual_seed(13)
    grads = [torch.randn(n, generator=gen) for n in (3_000_001, 5, 70_000, 1 << 18)]
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, max(2, threads), 1, max(2, threads)):
            torch.set_num_threads(n)
            sq_norm = torch.zeros((), dtype=torch.float64)
            mbs_ext.scale_accumulate_([torch.zeros_like(g) for g in grads], grads, 1.0, None, sq_norm)
            results.append(sq_norm.item())
    finally:
        torch.set_num_threads(threads)
    assert len(set(results)) == 1, results
    assert results[0] == pytest.approx(squares_reference(grads), rel=sq_rtol("cpu", torch.float64, grads))


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("grad_dtype", FLOATS)
def test_sq_norm_non_finite(device, bad, grad_dtype):
    """A non-finite grad makes the sum inf (inf) or NaN (NaN), and found_inf is set as without it."""
    grads = [torch.ones(4096 + 3, device=device, dtype=grad_dtype), torch.ones(5, device=device, dtype=grad_dtype)]
    grads[0][-2] = bad
    sq_norm = torch.zeros((), dtype=torch.float64, device=device)
    found_inf = mbs_ext.scale_accumulate_([torch.zeros_like(g, dtype=torch.float32) for g in grads], grads, 1.0,
                                          None, sq_norm)
    assert found_inf.item() == 1.0
    assert math.isnan(sq_norm.item()) if math.isnan(bad) else sq_norm.item() == math.inf


def test_sq_norm_float64_grad_is_squared_as_read(device):
    """A float64 grad beyond float32's range (inf for a float32 accumulator, so flagged) is
    squared in float64: 1e100 gives 1e200, not inf."""
    sq_norm = torch.zeros((), dtype=torch.float64, device=device)
    grads = [torch.tensor([1e100, 2.0], dtype=torch.float64, device=device)]
    found_inf = mbs_ext.scale_accumulate_([torch.zeros(2, device=device)], grads, 1.0, None, sq_norm)
    assert found_inf.item() == 1.0
    assert sq_norm.item() == pytest.approx(1e200, rel=1e-12)


def test_sq_norm_through_every_path(device):
    """The public call's fast path, the dispatched path (a tuple subclass, a 16-bit scale),
    torch.ops directly, and keyword arguments all add the same sum."""
    gen = torch.Generator().manual_seed(14)
    grads = [torch.randn(100, generator=gen).to(device), torch.randn(3, 3, generator=gen).to(device, torch.bfloat16)]
    accs = [torch.zeros(g.shape, device=device) for g in grads]
    expected = squares_reference(grads)
    sq_norm = torch.zeros((), dtype=torch.float64, device=device)
    found_inf = torch.zeros((), device=device)
    calls = [
        lambda: mbs_ext.scale_accumulate_(accs, grads, 0.5, found_inf, sq_norm),
        lambda: mbs_ext.scale_accumulate_(accs, grads, 0.5, sq_norm=sq_norm),
        lambda: mbs_ext.scale_accumulate_(UserList(accs), UserList(grads), 0.5, found_inf, sq_norm),
        lambda: mbs_ext.scale_accumulate_(accs, grads, torch.tensor(0.5, dtype=torch.bfloat16, device=device),
                                          sq_norm=sq_norm),
        lambda: torch.ops.mbs_ext.scale_accumulate_(accs, grads, torch.tensor(0.5), found_inf, sq_norm),
        lambda: torch.ops.mbs_ext.scale_accumulate_(accs, grads, torch.tensor(0.5), found_inf, sq_norm=sq_norm),
    ]
    for n, call in enumerate(calls, start=1):
        call()
        assert sq_norm.item() == pytest.approx(n * expected, rel=sq_rtol(device, torch.float64, grads)), n
    assert found_inf.item() == 0.0


def test_sq_norm_version_is_bumped():
    sq_norm = torch.zeros((), dtype=torch.float64)
    before = sq_norm._version
    mbs_ext.scale_accumulate_([torch.zeros(3)], [torch.ones(3)], 1.0, None, sq_norm)
    assert sq_norm._version > before
    assert sq_norm.item() == 3.0


@pytest.mark.parametrize("sq_dtype", SQ_DTYPES)
def test_opcheck_with_sq_norm(device, sq_dtype):
    # opcheck runs the op on copies: its schema test checks that sq_norm is declared mutated.
    for args in _opcheck_args(device):
        sq_norm = torch.full((), 0.5, dtype=sq_dtype, device=device)
        torch.library.opcheck(torch.ops.mbs_ext.scale_accumulate_.default, (*args, sq_norm))


def test_sq_norm_under_torch_compile():
    def accumulate(accs, grads, found_inf, sq_norm):
        mbs_ext.scale_accumulate_(accs, grads, 2.0, found_inf, sq_norm)
        return accs[0] * 1, sq_norm * 1

    accs, found_inf = [torch.zeros(4)], torch.zeros(())
    sq_norm = torch.zeros((), dtype=torch.float64)
    compiled = torch.compile(accumulate, backend="aot_eager", fullgraph=True)
    out, seen = compiled(accs, [torch.full((4,), 3.0)], found_inf, sq_norm)
    assert torch.equal(out, torch.full((4,), 6.0))
    assert sq_norm.item() == 36.0 and seen.item() == 36.0
    with pytest.raises(Exception, match="sq_norm must be a 0-dim"):
        compiled(accs, [torch.ones(4)], found_inf, torch.zeros(2, dtype=torch.float64))


def test_sq_norm_fake_kernel_checks():
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = torch.ops.mbs_ext.scale_accumulate_
    with FakeTensorMode():
        op([torch.zeros(2)], [torch.zeros(2)], torch.tensor(1.0), torch.zeros(()), torch.zeros((), dtype=torch.float64))
        with pytest.raises(TypeError, match="^sq_norm must be a float32 or float64 tensor, got Half$"):
            op([torch.zeros(2)], [torch.zeros(2)], torch.tensor(1.0), torch.zeros(()),
               torch.zeros((), dtype=torch.float16))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("sq_dtype", SQ_DTYPES)
def test_cuda_sq_norm_no_host_sync_and_graph_capture(sq_dtype):
    """With sq_norm the call still never synchronizes, and it replays in a CUDA graph: each
    replay adds the grads' current sum of squares on the device."""
    accs = [torch.zeros(1000, device="cuda"), torch.zeros(70_000, device="cuda")]
    grads = [torch.ones(1000, device="cuda", dtype=torch.bfloat16), torch.full((70_000,), 2.0, device="cuda")]
    scale = torch.tensor(0.5, device="cuda")
    found_inf = torch.zeros((), device="cuda")
    sq_norm = torch.zeros((), device="cuda", dtype=sq_dtype)
    per_call = 1000 * 1.0 + 70_000 * 4.0
    torch.cuda.set_sync_debug_mode("error")
    try:
        mbs_ext.scale_accumulate_(accs, grads, scale, found_inf, sq_norm)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert sq_norm.item() == per_call

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        mbs_ext.scale_accumulate_(accs, grads, scale, found_inf, sq_norm)  # warm-up outside capture
        with torch.cuda.graph(graph, stream=stream):
            mbs_ext.scale_accumulate_(accs, grads, scale, found_inf, sq_norm)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    sq_norm.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert sq_norm.item() == per_call
    grads[1].fill_(3.0)
    graph.replay()
    torch.cuda.synchronize()
    assert sq_norm.item() == per_call + 1000 * 1.0 + 70_000 * 9.0
    assert found_inf.item() == 0.0


@pytest.mark.parametrize("n", [1, 1023, 1024, 400_003])
def test_sum_of_squares_of_float32_buffers_matches_float64(n):
    """The mini-batch's squared norm is taken over float32 buffers in rows of float32 norms summed in
    float64 (no float64 copy of the buffer): within 1e-6 of the float64 sum of float64 squares."""
    from mbs_ext.model.grads import sum_of_squares

    g = torch.Generator().manual_seed(n)
    flat = torch.randn(n, generator=g) * 1e-3 + 2e-3
    want = flat.double().square().sum().item()
    got = sum_of_squares(flat)
    assert got.dtype == torch.float64 and got.dim() == 0
    assert got.item() == pytest.approx(want, rel=1e-6)
    assert sum_of_squares(flat.double()).item() == pytest.approx(want, rel=1e-14)


@pytest.mark.parametrize("dtype", FLOATS)
def test_sum_squares_reads_dense_tensors_once_and_flags_only_inf_and_nan(dtype):
    """``sum_squares_`` (the noise scale's read of the first gradients and of the final sums):
    the float64 sum of the squares over contiguous and channels_last tensors, added to what
    sq_norm held, nothing written to the tensors; found_inf for an inf or NaN element, not for a
    finite float32 whose float32 square passes float32's range."""
    from mbs_ext.ops import sum_squares_

    gen = torch.Generator().manual_seed(17)
    tensors = [(3 * torch.randn(s, generator=gen)).to(dtype) for s in [(1003,), (7, 9), (0,), (70_001,)]]
    tensors.append(torch.randn(2, 5, 4, 3, generator=gen).to(dtype).to(memory_format=torch.channels_last))
    copies = [t.clone() for t in tensors]
    sq_norm, found_inf = torch.full((), 0.5, dtype=torch.float64), torch.zeros(())
    sum_squares_(tensors, sq_norm, found_inf)
    assert all(torch.equal(t, c) for t, c in zip(tensors, copies)) and found_inf.item() == 0.0
    assert sq_norm.item() == pytest.approx(0.5 + squares_reference(tensors), rel=sq_rtol("cpu", torch.float64, tensors))
    tensors[3][12_345] = float("nan")
    sum_squares_(tensors, sq_norm, found_inf)
    assert found_inf.item() == 1.0 and math.isnan(sq_norm.item())
    if dtype == torch.float32:
        big, sq_norm, found_inf = torch.full((40,), 1e20), torch.zeros((), dtype=torch.float64), torch.zeros(())
        sum_squares_([big], sq_norm, found_inf)
        assert found_inf.item() == 0.0 and sq_norm.item() in (math.inf, pytest.approx(40e40, rel=1e-12))


def test_sum_squares_refuses_what_it_cannot_read():
    from mbs_ext.ops import sum_squares_

    sq_norm, found_inf = torch.zeros((), dtype=torch.float64), torch.zeros(())
    for tensors, a, b, name in [([torch.zeros(8)[::2]], sq_norm, found_inf, "tensors[0]"),
                                ([torch.zeros(3, dtype=torch.int32)], sq_norm, found_inf, "tensors[0]"),
                                ([torch.zeros(3)], torch.zeros(1, dtype=torch.float64), found_inf, "sq_norm"),
                                ([torch.zeros(3)], sq_norm, torch.zeros((), dtype=torch.float64), "found_inf")]:
        with pytest.raises(ValueError, match=f"not so for {re.escape(name)}"):
            sum_squares_(tensors, a, b)


def test_buffers_are_reused_from_step_to_step_only_where_nothing_else_holds_them():
    """The step's flat buffers come back zeroed the next step (no new allocation) once their views
    are gone; a ``.grad`` view the caller kept keeps its values, and that step takes a new buffer."""
    from mbs_ext.model.grads import BufferPool, GradBuffers

    params = [nn_param(torch.randn(5, 3)), nn_param(torch.randn(7))]
    pool = BufferPool()

    def step(value: float) -> None:
        bufs = GradBuffers(params, torch.float32, pool=pool)
        for p in params:
            p.grad = torch.full_like(p, value)
        bufs.add_(2.0)
        bufs.finish(1.0, [True, True])

    step(1.0)
    kept = params[0].grad  # a view of the first step's buffer, which the caller keeps
    first_ptr = kept.data_ptr()
    for p in params:
        p.grad = None  # what the next step does first
    step(3.0)
    assert torch.equal(kept, torch.full((5, 3), 2.0)) and params[0].grad.data_ptr() != first_ptr
    assert torch.equal(params[1].grad, torch.full((7,), 6.0))
    second_ptr = params[0].grad.data_ptr()
    del kept
    for p in params:
        p.grad = None
    step(0.5)  # nothing holds the second step's buffer any more: it is reused, zeroed first
    assert params[0].grad.data_ptr() == second_ptr and torch.equal(params[0].grad, torch.full((5, 3), 1.0))


def nn_param(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t)


@pytest.mark.parametrize("dtype", FLOATS)
def test_add_squares_sums_the_accumulators_as_read_and_the_grads_in_one_pass(dtype):
    """``add_squares_`` (a parameter's second gradient into its first, as taken): the update of
    ``scale_accumulate_`` at scale 1 bit for bit, the grads' squares as its ``sq_norm`` sums them,
    the accumulators' squares before the update, and found_inf for an inf or NaN in either. Without
    ``acc_sq_norm`` (a later gradient): the same update bit for bit, the grads' squares, and an
    inf accumulator left to the final check."""
    from mbs_ext.ops import add_squares_

    gen = torch.Generator().manual_seed(23)
    shapes = [(1003,), (7, 9), (0,), (70_001,)]
    accs = [(2 * torch.randn(s, generator=gen)).to(dtype) for s in shapes]
    accs.append(torch.randn(2, 5, 4, 3, generator=gen).to(dtype).to(memory_format=torch.channels_last))
    grads = [torch.randn(a.shape, generator=gen).to(dtype) for a in accs]
    grads[-1] = grads[-1].to(memory_format=torch.channels_last)
    before, twins = [a.clone() for a in accs], [a.clone() for a in accs]
    sq, acc_sq = torch.zeros((), dtype=torch.float64), torch.full((), 1.0, dtype=torch.float64)
    found_inf = torch.zeros(())
    alone, grads_only = [a.clone() for a in accs], torch.zeros((), dtype=torch.float64)
    add_squares_(accs, grads, sq, acc_sq, found_inf)
    add_squares_(alone, grads, grads_only, None, found_inf)
    mbs_ext.scale_accumulate_(twins, grads, 1.0)
    assert all(torch.equal(a, t) and torch.equal(b, t) for a, b, t in zip(accs, alone, twins))
    assert found_inf.item() == 0.0
    for got in (sq, grads_only):
        assert got.item() == pytest.approx(squares_reference(grads), rel=sq_rtol("cpu", torch.float64, grads))
    assert acc_sq.item() == pytest.approx(1.0 + squares_reference(before), rel=sq_rtol("cpu", torch.float64, before))
    accs[0][5] = alone[0][5] = float("inf")
    add_squares_(alone, grads, grads_only, None, found_inf)
    assert found_inf.item() == 0.0 and math.isfinite(grads_only.item())
    add_squares_(accs, grads, sq, acc_sq, found_inf)
    assert found_inf.item() == 1.0 and math.isinf(acc_sq.item())
    with pytest.raises(ValueError, match=re.escape("not so for grads[1] (not laid out as its accumulator)")):
        add_squares_(accs[:2], [grads[0], grads[1].t().contiguous().t()], sq, acc_sq, found_inf)


def test_a_buffer_cast_into_grad_or_of_a_failed_step_is_not_kept_between_steps():
    """The pool keeps only buffers whose views became the ``.grad`` (memory held between steps
    anyway): bf16 parameters' float32 buffer (cast into a bf16 ``.grad``) and a step's buffer
    released without finishing are freed as before, not held until the next step."""
    from mbs_ext.model.grads import BufferPool, GradBuffers

    pool = BufferPool()
    params = [nn_param(torch.randn(6, dtype=torch.bfloat16))]
    bufs = GradBuffers(params, torch.float32, pool=pool)
    params[0].grad = torch.ones(6, dtype=torch.bfloat16)
    bufs.add_(1.0)
    bufs.finish(1.0, [True])
    assert params[0].grad.dtype == torch.bfloat16 and torch.equal(params[0].grad, torch.ones(6, dtype=torch.bfloat16))
    assert pool.flats == {}
    same = [nn_param(torch.randn(6))]
    GradBuffers(same, torch.float32, pool=pool).release()  # a step that failed
    assert pool.flats == {}
