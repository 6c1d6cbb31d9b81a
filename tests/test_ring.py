"""Behaviour of mbs_ext.StreamRing: exact coverage, gathers by indices, errors from
the worker thread, early stops, no leaked threads, concurrency, lifetime of the
handed-out tensors, input validation, and (with a GPU) the CUDA copy path."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch
from common import run_python
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mbs_ext import StreamRing
from mbs_ext.diagnostics import RING_PRODUCER_THREAD, RING_STAGING_THREAD, os_threads
from mbs_ext.diagnostics import native as _C

CUDA = torch.cuda.is_available() and bool(_C.cuda_compiled)
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device and a CUDA build of mbs_ext")
def make_tensor(shape, dtype, gen):
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    if dtype == torch.int64:
        return torch.randint(-(2**40), 2**40, shape, generator=gen, dtype=torch.int64)
    return torch.randn(shape, generator=gen).to(dtype)


def nested_batch(n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return {
        "x": make_tensor((n, 3, 5), torch.float32, gen),
        "pair": (make_tensor((n,), torch.int64, gen), [make_tensor((n, 2), torch.float16, gen), "tag"]),
        "mask": make_tensor((n, 4), torch.bool, gen),
        "img": make_tensor((n, 2, 3, 3), torch.uint8, gen),
        "meta": 7,
    }


def take(batch, start, stop):
    if isinstance(batch, torch.Tensor):
        return batch[start:stop]
    if isinstance(batch, dict):
        return {k: take(v, start, stop) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(take(v, start, stop) for v in batch)
    return batch


def gather(batch, idx):
    if isinstance(batch, torch.Tensor):
        return batch.index_select(0, idx)
    if isinstance(batch, dict):
        return {k: gather(v, idx) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(gather(v, idx) for v in batch)
    return batch


def assert_same(got, want, device="cpu"):
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor)
        assert got.device.type == torch.device(device).type
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.cpu(), want)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want)
        for k in want:
            assert_same(got[k], want[k], device)
    elif isinstance(want, (tuple, list)):
        assert type(got) is type(want) and len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_same(g, w, device)
    else:
        assert got == want


def balanced_ranges(n: int, m: int) -> list[tuple[int, int]]:
    """Reference for the balanced split, written from its definition: k = ceil(n/m)
    micro-batches, the first n % k one row longer than the rest."""
    k = -(-n // m)
    sizes = [n // k + (1 if j < n % k else 0) for j in range(k)]
    starts = [sum(sizes[:j]) for j in range(k)]
    return [(a, a + b) for a, b in zip(starts, sizes, strict=True)]


def check_stream(ring, batch, n, m, device="cpu"):
    it = ring.stream(batch, m)
    count = 0
    ranges = balanced_ranges(n, m)
    for j, mb in enumerate(it):
        start, stop = ranges[j]
        assert it.index == j and it.rows == (start, stop)
        assert_same(mb, take(batch, start, stop), device)
        count += 1
    assert count == len(ranges) == -(-n // m)
    return count


def test_split_sizes_balanced():
    from mbs_ext.streaming.ring import split_sizes

    assert split_sizes(10, 4) == [4, 3, 3]
    assert split_sizes(8, 4) == [4, 4]
    assert split_sizes(1, 64) == [1]
    assert split_sizes(0, 3) == []
    for n in range(1, 80):
        for m in range(1, n + 2):
            sizes = split_sizes(n, m)
            assert [b - a for a, b in balanced_ranges(n, m)] == sizes
            assert max(sizes) <= m and max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError, match="micro_batch_size"):
        split_sizes(5, 0)


@pytest.mark.parametrize("n", [1, 7, 33])
@pytest.mark.parametrize("m", [1, 4, 50])
@pytest.mark.parametrize("slots", [2, 3])
def test_every_row_once_in_order(n, m, slots):
    ring = StreamRing("cpu", slots=slots)
    batch = nested_batch(n, seed=n * 100 + m)
    count = check_stream(ring, batch, n, m)
    stats = ring.stats()
    assert stats["micro_batches"] == count
    expected_bytes = sum(
        t.nbytes for t in [batch["x"], batch["pair"][0], batch["pair"][1][0], batch["mask"], batch["img"]]
    )
    assert stats["bytes"] == expected_bytes
    assert stats["stage_s"] > 0 and stats["wait_s"] >= 0


def test_single_tensor_and_non_contiguous():
    base = torch.arange(60, dtype=torch.float64).reshape(6, 10)
    t = base.t()  # 10 rows, non-contiguous
    ring = StreamRing("cpu")
    out = list(ring.stream(t, 3))
    assert [o.shape[0] for o in out] == [3, 3, 2, 2]
    assert torch.equal(torch.cat(out), t)
    assert all(o.is_contiguous() for o in out)


def test_requires_grad_leaf_is_streamed_as_data():
    x = torch.randn(9, 4, requires_grad=True)
    out = list(StreamRing("cpu").stream(x, 4))
    assert torch.equal(torch.cat(out), x.detach())
    assert not any(o.requires_grad for o in out)


def test_indices_repeats_and_random_order():
    data = nested_batch(50, seed=3)
    gen = torch.Generator().manual_seed(5)
    idx = torch.randint(0, 50, (123,), generator=gen)  # repeats, random order
    ring = StreamRing("cpu")
    it = ring.stream(data, 10, indices=idx)
    got = []
    ranges = balanced_ranges(123, 10)
    for j, mb in enumerate(it):
        start, stop = ranges[j]
        assert it.index == j and it.rows == (start, stop)
        assert_same(mb, gather(data, idx[start:stop]))
        got.append(mb)
    assert len(got) == 13
    assert ring.stats()["micro_batches"] == 13


def test_stream_reads_what_it_was_given_when_the_caller_changes_it_in_place():
    # The gather reads rows by raw pointer while the caller goes on: a reused shuffle buffer
    # refilled in place, or a batch tensor pointed at other memory, must not change (or
    # overrun) what an open stream reads.
    data = torch.arange(400.0).reshape(200, 2)
    idx = torch.randperm(200, generator=torch.Generator().manual_seed(0))
    expected = data[idx].clone()
    it = iter(StreamRing("cpu").stream(data, 10, indices=idx))
    first = next(it)
    idx.fill_(10**9)
    data.set_(torch.zeros(1, 2))
    assert torch.equal(torch.cat([first, *it]), expected)


def test_indices_int32_accepted():
    data = torch.arange(20).reshape(10, 2)
    idx = torch.tensor([9, 0, 0, 3], dtype=torch.int32)
    out = list(StreamRing("cpu").stream(data, 3, indices=idx))
    assert torch.equal(torch.cat(out), data[idx.long()])


def test_bad_indices_refused_by_the_native_ring_too():
    # Python validates indices with its own messages; the native ring, which gathers
    # rows by raw pointer, still refuses out-of-range ones on its own.
    ring = _C.StreamRing("cpu", 2)
    with pytest.raises(IndexError, match=r"indices must lie in \[0, 10\), got \[0, 99\]"):
        ring.open([torch.arange(10.0)], 3, torch.tensor([0, 1, 99]))
    with pytest.raises(IndexError, match="lie in"):
        ring.open([torch.arange(10.0)], 3, torch.tensor([-1, 1]))


def test_worker_error_surfaces_in_the_caller():
    # A micro-batch too big to allocate: the worker's allocation fails, and the error
    # (still an out-of-memory error, so step's back-off sees it) reaches next().
    # 1 PiB per micro-batch once staged: beyond any address space, whatever the kernel's
    # overcommit policy (a 4 TiB request can succeed where overcommit is unlimited).
    huge = torch.zeros(1, 1).expand(2**52, 1)
    ring = StreamRing("cpu")
    gc.collect()  # rings of earlier tests left in cycles must not stop their threads mid-count
    n_before = os_threads(RING_PRODUCER_THREAD)
    it = ring.stream((huge, "meta"), 2**50)
    with pytest.raises(torch.OutOfMemoryError) as info:
        next(it)
    assert "micro-batch 0" in str(info.value)
    assert it._handle is None  # closed after the error
    with pytest.raises(StopIteration):
        next(it)
    assert os_threads(RING_PRODUCER_THREAD) == n_before
    handle = ring._ring.open([huge], 2**40, None)  # the low-level handle repeats the error
    for _ in range(2):
        with pytest.raises(torch.OutOfMemoryError):
            handle.next()
    handle.close()


def test_early_break_and_thread_count():
    data = nested_batch(64, seed=1)
    ring = StreamRing("cpu")
    list(ring.stream(data, 8))  # warm-up: lazily started pools
    gc.collect()
    gc.collect()
    before = os_threads(RING_PRODUCER_THREAD)
    for k in range(100):
        it = ring.stream(data, 3 + k % 5, indices=torch.randperm(64) if k % 3 == 0 else None)
        for j, _ in enumerate(it):
            if k % 2 == 0 and j == k % 4:
                break  # broken-off stream: left for the next stream / GC to close
        if k % 4 == 1:
            it.close()
    del it
    gc.collect()
    assert os_threads(RING_PRODUCER_THREAD) == before


def test_gc_and_dropping_ring_stop_worker():
    data = torch.randn(1000, 16)
    gc.collect()
    before = os_threads(RING_PRODUCER_THREAD)
    it = StreamRing("cpu").stream(data, 10)  # the ring is a temporary
    next(it)
    assert os_threads(RING_PRODUCER_THREAD) == before + 1
    del it
    gc.collect()
    assert os_threads(RING_PRODUCER_THREAD) == before
    for _ in range(20):
        ring = StreamRing("cpu", slots=3)
        it = ring.stream(data, 7)
        next(it)
        del ring, it
    gc.collect()
    assert os_threads(RING_PRODUCER_THREAD) == before


def test_new_stream_closes_previous():
    data = torch.arange(40)
    ring = StreamRing("cpu")
    first = ring.stream(data, 4)
    assert torch.equal(next(first), data[:4])
    second = ring.stream(data, 5)
    with pytest.raises(RuntimeError, match=r"new stream was started.*own streamer, or pass ring=StreamRing"):
        next(first)
    assert torch.equal(torch.cat(list(second)), data)
    assert ring.stats()["micro_batches"] == 8


def test_close_then_next_stops():
    ring = StreamRing("cpu")
    it = ring.stream(torch.arange(10), 2)
    next(it)
    it.close()
    with pytest.raises(StopIteration):
        next(it)
    it.close()  # idempotent


def test_two_rings_at_once():
    a_data = nested_batch(41, seed=11)
    b_data = torch.randn(77, 3)
    ra, rb = StreamRing("cpu"), StreamRing("cpu", slots=4)
    ia, ib = ra.stream(a_data, 5), rb.stream(b_data, 6)
    got_a, got_b = [], []
    for _ in range(20):
        for it, got in ((ia, got_a), (ib, got_b)):
            mb = next(it, None)
            if mb is not None:
                got.append(mb)
    for (start, stop), mb in zip(balanced_ranges(41, 5), got_a, strict=True):
        assert_same(mb, take(a_data, start, stop))
    assert len(got_a) == 9
    assert torch.equal(torch.cat(got_b), b_data)
    assert ra.stats()["micro_batches"] == 9 and rb.stats()["micro_batches"] == 13


def test_use_from_non_main_threads():
    errors = []

    def work(seed):
        try:
            data = nested_batch(30 + seed, seed=seed)
            ring = StreamRing("cpu")
            for m in (1, 4, 100):
                check_stream(ring, data, 30 + seed, m)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors


def test_micro_batches_stay_valid_after_advancing():
    data = torch.arange(200, dtype=torch.float32).reshape(50, 4)
    ring = StreamRing("cpu", slots=2)
    kept = []
    for mb in ring.stream(data, 3):
        kept.append(mb)  # held while the worker stages (and reuses slots) further
    kept_copy = [k.clone() for k in kept]
    for j, (mb, (start, stop)) in enumerate(zip(kept, balanced_ranges(50, 3), strict=True)):
        assert torch.equal(mb, data[start:stop])
        assert torch.equal(mb, kept_copy[j])
    # Distinct storage for every micro-batch: nothing aliases another.
    ptrs = {k.untyped_storage().data_ptr() for k in kept}
    assert len(ptrs) == len(kept)


def test_autograd_saved_inputs_survive():
    torch.manual_seed(0)
    data = torch.randn(20, 5)
    w = torch.randn(5, 1, requires_grad=True)
    losses = []
    for mb in StreamRing("cpu").stream(data, 4):
        losses.append((mb @ w).pow(2).sum())  # mb saved for backward
    sum(losses).backward()
    w2 = w.detach().clone().requires_grad_(True)
    (data @ w2).pow(2).sum().backward()
    torch.testing.assert_close(w.grad, w2.grad)


def test_stats_reset_on_new_stream():
    ring = StreamRing("cpu")
    list(ring.stream(torch.zeros(10, 10), 2))
    assert ring.stats()["micro_batches"] == 5
    it = ring.stream(torch.zeros(10, 10), 5)
    assert ring.stats()["micro_batches"] == 0
    list(it)
    s = ring.stats()
    assert isinstance(s, dict)
    assert s["micro_batches"] == 2 and s["bytes"] == 400
    assert set(s) >= {"stage_s", "wait_s", "micro_batches", "bytes"}


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"micro_batch_size": 0}, ValueError, "micro_batch_size"),
        ({"micro_batch_size": -3}, ValueError, "micro_batch_size"),
        ({"micro_batch_size": True}, TypeError, "micro_batch_size"),
        ({"micro_batch_size": 2.0}, TypeError, "micro_batch_size"),
        ({"micro_batch_size": 2, "indices": torch.tensor([0, -1])}, ValueError, "negative index -1"),
        ({"micro_batch_size": 2, "indices": torch.tensor([0, 10])}, ValueError, "index 10"),
        ({"micro_batch_size": 2, "indices": torch.tensor([0.0, 1.0])}, TypeError, "indices"),
        ({"micro_batch_size": 2, "indices": torch.tensor([[0, 1]])}, ValueError, "indices"),
        ({"micro_batch_size": 2, "indices": [0, 1]}, TypeError, "indices"),
        ({"micro_batch_size": 2, "indices": torch.tensor([], dtype=torch.int64)}, ValueError, "indices"),
    ],
)
def test_stream_argument_validation(kwargs, exc, match):
    ring = StreamRing("cpu")
    with pytest.raises(exc, match=match):
        ring.stream(torch.zeros(10, 2), **kwargs)


@pytest.mark.parametrize(
    ("batch", "match"),
    [
        ({"a": 1, "b": "x"}, "at least one tensor"),
        ((torch.zeros(4), torch.zeros(5)), "dim-0"),
        (torch.zeros(0, 3), "0 rows"),
        (torch.tensor(3.0), "0-dim"),
    ],
)
def test_batch_validation(batch, match):
    with pytest.raises(ValueError, match=match):
        StreamRing("cpu").stream(batch, 2)


def test_ring_validation():
    with pytest.raises(ValueError, match="slots"):
        StreamRing("cpu", slots=1)
    with pytest.raises(TypeError, match="slots"):
        StreamRing("cpu", slots=2.5)
    with pytest.raises(TypeError, match="slots"):
        StreamRing("cpu", slots=True)
    with pytest.raises(ValueError, match=r"slots must be at most 2\*\*63 - 1"):  # named, not the binding's error
        StreamRing("cpu", slots=2**63)
    with pytest.raises(ValueError, match=r"micro_batch_size must be at most 2\*\*63 - 1"):
        StreamRing("cpu").stream(torch.arange(4), 2**63, indices=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="device"):
        StreamRing("not-a-device")
    with pytest.raises(ValueError, match="device"):
        StreamRing("meta")
    with pytest.raises(TypeError, match="device"):
        StreamRing(3.5)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            StreamRing("cuda")


@needs_cuda
def test_cuda_leaf_rejected():
    with pytest.raises(ValueError, match="CPU"):
        StreamRing("cpu").stream(torch.zeros(4, device="cuda"), 2)
    with pytest.raises(ValueError, match="one device"):
        StreamRing("cuda").stream([torch.zeros(4, device="cuda"), torch.zeros(4)], 2)


@needs_cuda
def test_cuda_batch_on_device_is_sliced_in_place():
    data = torch.arange(30.0, device="cuda").reshape(10, 3)
    ring = StreamRing("cuda")
    it = ring.stream(data, 4)
    views = list(it)
    assert [v.shape[0] for v in views] == [4, 3, 3] and it.rows == (7, 10)
    assert all(v.untyped_storage().data_ptr() == data.untyped_storage().data_ptr() for v in views)
    assert torch.equal(torch.cat(views), data)
    idx = torch.tensor([9, 0, 0, 5, 2])
    out = list(ring.stream(data, 2, indices=idx))
    assert torch.equal(torch.cat(out), data[idx.cuda()])
    assert ring.stats()["staged_bytes"] == 0


@needs_cuda
@pytest.mark.parametrize("threads", [1, 3])
def test_cuda_pinned_batch_is_copied_directly(threads):
    data = {"x": torch.randn(37, 5, 7).pin_memory(), "y": torch.arange(37).pin_memory()}
    ring = StreamRing("cuda", staging_threads=threads)
    check_stream(ring, data, 37, 8, device="cuda")
    stats = ring.stats()
    assert stats["staged_bytes"] == 0 and stats["bytes"] == 37 * 35 * 4 + 37 * 8
    idx = torch.randint(0, 37, (50,))
    got = list(ring.stream(data, 8, indices=idx))  # gathers still go through the pinned slots
    torch.cuda.synchronize()
    assert torch.equal(torch.cat([g["x"] for g in got]).cpu(), data["x"][idx])
    assert ring.stats()["staged_bytes"] > 0


@needs_cuda
@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
def test_cuda_channels_last_batch_keeps_its_values_and_its_layout(pinned):
    """A channels_last image batch arrives channels_last, pinned or not, gathered or not: a
    pinned one is read in place (copied as one block), a pageable one staged row by row in
    its own layout, and with indices the device memory reserved ahead has the staged layout."""
    images = torch.randn(23, 3, 5, 4).contiguous(memory_format=torch.channels_last)
    images = images.pin_memory() if pinned else images
    idx = torch.randperm(23)[:17]
    ring = StreamRing("cuda")
    for _ in range(2):  # the ring, its slots and its reservations reused
        got = list(ring.stream(images, 6))
        torch.cuda.synchronize()
        assert torch.equal(torch.cat(got).cpu(), images)
        assert all(g.is_contiguous(memory_format=torch.channels_last) for g in got)
        assert (ring.stats()["staged_bytes"] == 0) == pinned
        got = list(ring.stream(images, 5, indices=idx))
        torch.cuda.synchronize()
        assert torch.equal(torch.cat(got).cpu(), images[idx])
        assert all(g.is_contiguous(memory_format=torch.channels_last) for g in got)


@needs_cuda
def test_cuda_pinned_batch_with_gapped_rows_is_staged():
    """A pinned batch whose runs of rows are not dense (a column slice) is staged through the
    pinned slots rather than copied by torch through a temporary."""
    base = torch.randn(19, 6, 9).pin_memory()
    ring = StreamRing("cuda")
    got = list(ring.stream(base[:, :, :4], 5))
    torch.cuda.synchronize()
    assert torch.equal(torch.cat(got).cpu(), base[:, :, :4])
    assert ring.stats()["staged_bytes"] == 19 * 6 * 4 * 4


def test_cpu_channels_last_batch_arrives_channels_last():
    """Rows that are dense in another dimension order (channels_last) are staged one block a
    row in that order, with and without indices, and values are exact."""
    images = torch.randn(21, 3, 5, 4).contiguous(memory_format=torch.channels_last)
    idx = torch.randint(0, 21, (30,))
    ring = StreamRing("cpu")
    got = list(ring.stream(images, 4))
    assert torch.equal(torch.cat(got), images)
    assert all(g.is_contiguous(memory_format=torch.channels_last) for g in got)
    got = list(ring.stream(images, 7, indices=idx))
    assert torch.equal(torch.cat(got), images[idx])
    assert all(g.is_contiguous(memory_format=torch.channels_last) for g in got)


tensor_specs = st.lists(
    st.tuples(
        st.sampled_from([torch.float32, torch.float16, torch.uint8, torch.int64, torch.bool, torch.float64]),
        st.lists(st.integers(1, 3), max_size=2),
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=tensor_specs,
    n=st.integers(1, 40),
    m=st.integers(1, 45),
    layout=st.sampled_from(["tensor", "tuple", "list", "tensors_list", "tuple_in_tuple", "dict", "nested"]),
    use_indices=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_random_structures(specs, n, m, layout, use_indices, seed):
    gen = torch.Generator().manual_seed(seed)
    leaves = [make_tensor((n, *shape), dtype, gen) for dtype, shape in specs]
    if layout == "tensor":
        batch = leaves[0]
    elif layout == "tuple":
        batch = tuple(leaves)
    elif layout == "list":
        batch = [*leaves, None]
    elif layout == "tensors_list":  # rebuilt without pytree (as plain tuples and bare tensors are)
        batch = list(leaves)
    elif layout == "tuple_in_tuple":  # a tuple whose leaves are all tensors, but not all at the top
        batch = (leaves[0], tuple(leaves[1:]))
    elif layout == "dict":
        batch = {f"k{i}": t for i, t in enumerate(leaves)}
    else:
        batch = {"a": (leaves[0], {"b": leaves[1:]}), "c": "const"}
    ring = StreamRing("cpu")
    if use_indices:
        idx = torch.randint(0, n, (int(torch.randint(1, 2 * n + 2, (1,), generator=gen)),), generator=gen)
        got = list(ring.stream(batch, m, indices=idx))
        ranges = balanced_ranges(idx.numel(), m)
        assert len(got) == len(ranges)
        for j, mb in enumerate(got):
            assert_same(mb, gather(batch, idx[ranges[j][0] : ranges[j][1]]))
    else:
        check_stream(ring, batch, n, m)
        for j, mb in enumerate(ring.stream(batch, m, copy=False)):  # sliced in place, not staged
            start, stop = balanced_ranges(n, m)[j]
            assert_same(mb, take(batch, start, stop))


# --------------------------------------------------------------------------- CUDA


@needs_cuda
@pytest.mark.parametrize("m", [1, 5, 64])
def test_cuda_correctness(m):
    data = nested_batch(37, seed=2)
    ring = StreamRing("cuda")
    check_stream(ring, data, 37, m, device="cuda")
    idx = torch.randint(0, 37, (90,))
    kept = list(ring.stream(data, m, indices=idx))
    ranges = balanced_ranges(idx.numel(), m)
    torch.cuda.synchronize()
    for j, mb in enumerate(kept):  # stay valid after the iterator moved on
        assert_same(mb, gather(data, idx[ranges[j][0] : ranges[j][1]]), device="cuda")


@needs_cuda
def test_cuda_on_side_stream_and_early_break():
    data = torch.randn(100, 8)
    ring = StreamRing("cuda")
    side = torch.cuda.Stream()
    gc.collect()
    before = os_threads(RING_PRODUCER_THREAD)
    with torch.cuda.stream(side):
        got = []
        for j, mb in enumerate(ring.stream(data, 9)):
            got.append(mb * 1)
            if j == 4:
                break
    side.synchronize()
    assert torch.equal(torch.cat(got).cpu(), data[: sum(_C.split_sizes(100, 9)[:5])])
    gc.collect()
    assert os_threads(RING_PRODUCER_THREAD) == before


@needs_cuda
def test_cuda_copy_overlaps_kernel():
    # Micro-batch i+1 is copied on the ring's copy stream while the current stream
    # runs a long kernel on micro-batch i; after the kernel, taking micro-batch i+1
    # adds (almost) no device time.
    rows, m = 4, 1
    data = torch.randint(0, 256, (rows, 256 * 1024 * 1024), dtype=torch.uint8)  # 256 MiB rows
    # Time one plain pinned H2D copy of a row for reference.
    pinned = data[0].pin_memory()
    dst = torch.empty_like(pinned, device="cuda")
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    dst.copy_(pinned, non_blocking=True)
    e1.record()
    torch.cuda.synchronize()
    copy_ms = e0.elapsed_time(e1)
    del dst, pinned

    ring = StreamRing("cuda", slots=2)
    it = ring.stream(data, m)
    time.sleep(1.5)  # the worker has staged micro-batches 0 and 1
    first = next(it)  # also enqueues the copy of micro-batch 1
    torch.cuda._sleep(int(200e6))  # a long kernel on the current stream (well over copy_ms)
    after_kernel = torch.cuda.Event(enable_timing=True)
    after_kernel.record()
    second = next(it)
    got_second = torch.cuda.Event(enable_timing=True)
    got_second.record()
    torch.cuda.synchronize()
    extra_ms = after_kernel.elapsed_time(got_second)
    assert extra_ms < 0.3 * copy_ms, (extra_ms, copy_ms)
    assert torch.equal(first.cpu(), data[:1]) and torch.equal(second.cpu(), data[1:2])
    it.close()


_OOM_CHILD = """
import sys
import torch
from mbs_ext import StreamRing

mib = 1 << 20
rows, row_bytes = 16, 64 * mib
data = torch.randint(0, 256, (rows, row_bytes), dtype=torch.uint8)
ring = StreamRing("cuda")
torch.cuda.init()
total = torch.cuda.get_device_properties(0).total_memory
# A fresh process: nothing reserved, so every 64 MiB block needs new reserved memory.
assert torch.cuda.memory_reserved() == 0, torch.cuda.memory_reserved()
torch.cuda.set_per_process_memory_fraction(5.5 * row_bytes / total)
handle = ring._ring.open([data], 1, None)
kept = []
try:
    while True:
        out = handle.next()
        assert out is not None, "the cap never bit"
        kept.append(out[0])
        del out
except torch.OutOfMemoryError:
    pass
assert 2 <= len(kept) < rows, len(kept)
assert handle.index == len(kept) - 1, (handle.index, len(kept))
try:
    handle.next()
    raise AssertionError("the stream went on after its failure")
except RuntimeError as exc:
    assert "ended with an error" in str(exc), str(exc)
assert handle.closed
torch.cuda.synchronize()
for j, got in enumerate(kept):
    assert torch.equal(got.cpu(), data[j : j + 1]), j
n_kept = len(kept)
del got
kept.clear()
torch.cuda.synchronize()
assert torch.cuda.memory_allocated() == 0, torch.cuda.memory_allocated()
torch.cuda.set_per_process_memory_fraction(1.0)
assert torch.equal(torch.cat([mb.cpu() for mb in ring.stream(data[:5], 2)]), data[:5])
print("kept", n_kept)
"""


@needs_cuda
def test_cuda_out_of_memory_mid_stream_loses_nothing_and_leaks_nothing(tmp_path):
    # A real cap, in a child process of its own (nothing reserved before it, and a crash
    # cannot take the suite down): the caller keeps every micro-batch, so the ring's device
    # allocations fail part-way through the stream -- in its optional copy ahead and
    # reservation (ignored: the micro-batch is copied on the next call) and then in a
    # copy's own allocation (raised). Every micro-batch handed out before is exact and in
    # order, the stream is over for good (the native handle raises again instead of
    # skipping ahead), nothing the ring allocated stays allocated, and the ring streams
    # again once memory is back.
    script = tmp_path / "child.py"
    script.write_text(_OOM_CHILD)
    proc = run_python([script], timeout=600)
    assert "kept" in proc.stdout


def test_dropped_buffers_recycled_kept_ones_untouched():
    # Host memory of dropped micro-batches is reused; micro-batches still referenced
    # (even as a view) are never written again, across many streams.
    data = torch.arange(4000, dtype=torch.int64).reshape(1000, 4)
    ring = StreamRing("cpu")
    kept = {}
    for rep in range(5):
        for j, mb in enumerate(ring.stream(data, 50)):
            if j % 7 == rep:
                kept[(rep, j)] = mb[1:]  # a view keeps the storage alive
    for (_, j), view in kept.items():
        assert torch.equal(view, data[j * 50 + 1 : j * 50 + 50])


def test_micro_batch_can_be_resized_and_mutated():
    data = torch.arange(30.0).reshape(10, 3)
    out = []
    for mb in StreamRing("cpu").stream(data, 4):
        mb.add_(1)  # user-owned: writing does not disturb the source or later items
        out.append(mb)
    assert torch.equal(torch.cat(out), data + 1)
    big = out[0]
    big.resize_(100, 3)
    big.zero_()
    assert torch.equal(torch.cat(out[1:]), data[4:] + 1)
    assert torch.equal(data, torch.arange(30.0).reshape(10, 3))


def test_copy_false_on_cpu_hands_out_views():
    data = {"x": torch.arange(30.0).reshape(10, 3), "y": torch.arange(10), "tag": "keep"}
    ring = StreamRing("cpu")
    it = ring.stream(data, 4, copy=False)
    got = []
    for mb in it:
        assert mb["tag"] == "keep"
        assert mb["x"].untyped_storage().data_ptr() == data["x"].untyped_storage().data_ptr()
        got.append((it.index, it.rows, mb))
    assert [(i, r) for i, r, _ in got] == [(0, (0, 4)), (1, (4, 7)), (2, (7, 10))]
    assert torch.equal(torch.cat([mb["x"] for *_, mb in got]), data["x"])
    assert torch.equal(torch.cat([mb["y"] for *_, mb in got]), data["y"])
    stats = ring.stats()
    assert stats["micro_batches"] == 3 and stats["bytes"] == 30 * 4 + 10 * 8 and stats["stage_s"] == 0.0


@pytest.mark.parametrize("m", [4, 10, 64])  # several micro-batches, exactly one, one capped at the rows
def test_copy_false_views_are_tensors_of_their_own(m):
    """A loss that marks its inputs (``requires_grad_()``, as a gradient penalty does) must not
    change the caller's batch, also when the one micro-batch covers all of it."""
    data = torch.arange(30.0).reshape(10, 3)
    views = list(StreamRing("cpu").stream(data, m, copy=False))
    for mb in views:
        assert mb is not data and mb.untyped_storage().data_ptr() == data.untyped_storage().data_ptr()
        mb.requires_grad_(True)
    assert not data.requires_grad
    assert torch.equal(torch.cat([mb.detach() for mb in views]), data)


def test_copy_false_with_indices_still_gathers():
    data = torch.arange(20.0).reshape(10, 2)
    idx = torch.tensor([9, 0, 0, 5])
    out = list(StreamRing("cpu").stream(data, 3, indices=idx, copy=False))
    assert torch.equal(torch.cat(out), data[idx])
    assert all(o.untyped_storage().data_ptr() != data.untyped_storage().data_ptr() for o in out)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_staging_threads_exact_for_every_layout(threads):
    gen = torch.Generator().manual_seed(threads)
    base = torch.randn(40, 6, 9, generator=gen)
    batch = {
        "dense": base,
        "strided_rows": base[:, :, :4],  # rows not contiguous: torch's copy path
        "every_other": torch.randn(80, 3, 3, generator=gen)[::2],  # rows contiguous, stride(0) gapped
        "expanded": torch.randn(1, 5, generator=gen).expand(40, 5),  # stride(0) == 0
        "conj": torch.randn(40, 2, dtype=torch.complex64, generator=gen).conj(),
        "wide": torch.randint(0, 255, (40, 70000), dtype=torch.uint8, generator=gen),  # splits across workers
    }
    ring = StreamRing("cpu", staging_threads=threads)
    assert ring.staging_threads == threads
    check_stream(ring, batch, 40, 7)
    idx = torch.randint(0, 40, (61,), generator=gen)
    ranges = balanced_ranges(61, 9)
    for j, mb in enumerate(ring.stream(batch, 9, indices=idx)):
        assert_same(mb, gather(batch, idx[ranges[j][0] : ranges[j][1]]))


def test_staging_threads_argument_and_default():
    assert StreamRing("cpu").staging_threads == 1
    assert "staging_threads=1" in repr(StreamRing("cpu"))
    for bad, exc in [(0, ValueError), (1000, ValueError), (2.0, TypeError), (True, TypeError)]:
        with pytest.raises(exc, match="staging_threads"):
            StreamRing("cpu", staging_threads=bad)


def test_staging_threads_are_the_rings_own():
    gc.collect()
    before = os_threads(RING_STAGING_THREAD)
    ring = StreamRing("cpu", staging_threads=3)
    # A worker names itself once it runs: give the two a few seconds to start.
    deadline = time.monotonic() + 5.0
    while os_threads(RING_STAGING_THREAD) < before + 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert os_threads(RING_STAGING_THREAD) == before + 2  # the caller's worker thread counts as the third
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        data = torch.randn(64, 1000)
        assert torch.equal(torch.cat(list(ring.stream(data, 10))), data)
    finally:
        torch.set_num_threads(old)
    del ring
    gc.collect()
    assert os_threads(RING_STAGING_THREAD) == before
