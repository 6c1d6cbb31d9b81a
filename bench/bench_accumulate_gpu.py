"""GPU study of the fused ``scale_accumulate_`` kernel against the memory-bandwidth ceilings.

Run: ``pytest bench/bench_accumulate_gpu.py`` (skips without a GPU) or
``python bench/bench_accumulate_gpu.py``. Results go where ``bench/_results.py:results_dir("gpu")``
says (``$MBS_BENCH_OUT``; ``bench/results/gpu/`` with ``MBS_BENCH_UPDATE=1``; else a scratch
folder) as ``accumulate_gpu.json`` and ``accumulate_gpu.md``.

What is compared, on the same float32 accumulators (views into one flat buffer, as
``mbs_ext.step`` keeps them) and per-parameter grads (float32, or bf16 accumulated in
float32):

- ``fused``: ``torch.ops.mbs_ext.scale_accumulate_`` (C++ checks + kernel),
- ``fused_api``: ``mbs_ext.scale_accumulate_`` (also the Python argument checks),
- ``foreach``: ``torch._foreach_add_(accs, grads, alpha=scale)``,
- ``flat_add``: one ``add_`` over flat buffers of the same element count (the ceiling a
  flat grad buffer would give),
- ``copy``: a device-to-device copy moving the same number of bytes (read + write),
  the practical bandwidth ceiling;
- ``fused_graph`` / ``foreach_graph``: the ``fused`` / ``foreach`` calls of one pass over the
  buffer sets captured once in a CUDA graph and replayed: the device's time alone, without
  the host's per-call work (checks, launch), which the plain columns include whenever the
  host is slower than the kernel.

Bytes moved per element: read acc + write acc + read grad. Each timed call uses the next
of several buffer sets whose total exceeds the L2 cache several times, so no method is
served from L2. Every round runs every method once, in a rotating order; medians of
per-call times (CUDA events) over the rounds after warm-up are reported.
"""

from __future__ import annotations

import json
import math
import platform
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from shapes import GPU_SHAPES  # noqa: E402

import mbs_ext  # noqa: E402
from mbs_ext.diagnostics import buffer_layout  # noqa: E402

GRADS = {"fp32": torch.float32, "bf16": torch.bfloat16}
METHODS = ["fused", "fused_api", "foreach", "flat_add", "copy", "fused_graph", "foreach_graph"]
SCALE = 0.125
WARMUP_ROUNDS = 3
ROUNDS = 15
L2_MULTIPLE = 4  # buffer sets together span at least this many L2 caches


@dataclass
class BufferSet:
    flat_acc: torch.Tensor
    accs: list[torch.Tensor]
    grads: list[torch.Tensor]
    flat_grad: torch.Tensor
    copy_src: torch.Tensor
    copy_dst: torch.Tensor


def _make_set(shapes: list[tuple[int, ...]], grad_dtype: torch.dtype, gen: torch.Generator) -> BufferSet:
    numel = sum(math.prod(s) for s in shapes)
    # Laid out as the step lays out its accumulators: every view starts on a 16-byte
    # boundary, so the kernels take the vector path the step's calls take.
    offsets, length = buffer_layout([math.prod(s) for s in shapes], 4)
    flat = torch.randn(length, device="cuda", generator=gen)
    accs = [flat.narrow(0, offset, math.prod(s)).view(s) for s, offset in zip(shapes, offsets)]
    flat_acc = flat.narrow(0, 0, numel)  # the flat ceiling adds as many elements as the views hold
    grads = [torch.randn(s, device="cuda", generator=gen).to(grad_dtype) for s in shapes]
    flat_grad = torch.randn(numel, device="cuda", generator=gen).to(grad_dtype)
    half_bytes = numel * (2 * 4 + flat_grad.element_size()) // 2  # a copy moves 2x its size
    copy_src = torch.empty(half_bytes, dtype=torch.uint8, device="cuda")
    copy_dst = torch.empty_like(copy_src)
    return BufferSet(flat_acc, accs, grads, flat_grad, copy_src, copy_dst)


def _runner(method: str, found_inf: torch.Tensor,
            sets: list[BufferSet]) -> Callable[[list[BufferSet]], object] | None:
    """One pass over ``sets`` by ``method``: a call per set, or one graph replay (None when the
    capture fails: that method's columns read nan)."""
    if method.endswith("_graph"):
        call = _call(method.removesuffix("_graph"), found_inf)
        for b in sets:  # once outside the capture, as torch asks of code about to be captured
            call(b)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                for b in sets:
                    call(b)
        except Exception as e:  # noqa: BLE001 - reported as a missing column, not the end of the study
            print(f"{method}: capture failed: {e}")
            return None
        return lambda _sets: graph.replay()
    call = _call(method, found_inf)

    def each(pass_sets: list[BufferSet]) -> None:
        for b in pass_sets:
            call(b)
    return each


def _call(method: str, found_inf: torch.Tensor) -> Callable[[BufferSet], object]:
    scale_t = torch.tensor(SCALE, dtype=torch.float64)  # a CPU scalar, read by value
    op = torch.ops.mbs_ext.scale_accumulate_
    if method == "fused":
        return lambda b: op(b.accs, b.grads, scale_t, found_inf)
    if method == "fused_api":
        return lambda b: mbs_ext.scale_accumulate_(b.accs, b.grads, SCALE, found_inf)
    if method == "foreach":
        return lambda b: torch._foreach_add_(b.accs, b.grads, alpha=SCALE)
    if method == "flat_add":
        return lambda b: b.flat_acc.add_(b.flat_grad, alpha=SCALE)
    if method == "copy":
        return lambda b: b.copy_dst.copy_(b.copy_src)
    raise ValueError(method)


def _check_correct(shapes: list[tuple[int, ...]], grad_dtype: torch.dtype) -> None:
    """The kernel must be right before its speed means anything: float64 reference on one set."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    b = _make_set(shapes, grad_dtype, gen)
    expected = [a.double() + SCALE * g.double() for a, g in zip(b.accs, b.grads)]
    found_inf = mbs_ext.scale_accumulate_(b.accs, b.grads, SCALE)
    for a, e in zip(b.accs, expected):
        torch.testing.assert_close(a.double(), e, rtol=2e-6, atol=2e-6)
    assert found_inf.item() == 0.0


def _time_per_call(fn: Callable[[list[BufferSet]], object], sets: list[BufferSet]) -> float:
    """Seconds per call, over one pass through every set (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(sets)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / len(sets)


def measure(name: str, grad_key: str) -> dict:
    shapes = GPU_SHAPES[name]()
    grad_dtype = GRADS[grad_key]
    _check_correct(shapes, grad_dtype)
    numel = sum(math.prod(s) for s in shapes)
    op_bytes = numel * (2 * 4 + torch.empty((), dtype=grad_dtype).element_size())
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    l2 = getattr(props, "L2_cache_size", 0) or 50 * 2**20
    n_sets = max(2, math.ceil(L2_MULTIPLE * l2 / op_bytes))
    gen = torch.Generator(device="cuda").manual_seed(0)
    sets = [_make_set(shapes, grad_dtype, gen) for _ in range(n_sets)]
    found_inf = torch.zeros((), device="cuda")
    runs = {m: run for m in METHODS if (run := _runner(m, found_inf, sets)) is not None}
    names = list(runs)
    times: dict[str, list[float]] = {m: [] for m in names}
    for r in range(WARMUP_ROUNDS + ROUNDS):
        order = names[r % len(names) :] + names[: r % len(names)]
        for m in order:
            t = _time_per_call(runs[m], sets)
            if r >= WARMUP_ROUNDS:
                times[m].append(t)
    med = {m: statistics.median(times[m]) if m in times else math.nan for m in METHODS}
    gbs = {m: op_bytes / med[m] / 1e9 for m in METHODS}
    del sets, runs  # the graphs hold their buffer sets
    torch.cuda.empty_cache()
    return {
        "shapes": name,
        "grads": f"{grad_key} -> fp32",
        "tensors": len(shapes),
        "elements": numel,
        "bytes_per_call": op_bytes,
        "buffer_sets": n_sets,
        "median_us": {m: med[m] * 1e6 for m in METHODS},
        "gb_per_s": gbs,
        "fused_pct_of_copy": 100 * gbs["fused"] / gbs["copy"],
        "fused_api_pct_of_copy": 100 * gbs["fused_api"] / gbs["copy"],
        "flat_add_pct_of_copy": 100 * gbs["flat_add"] / gbs["copy"],
        "foreach_pct_of_copy": 100 * gbs["foreach"] / gbs["copy"],
        "fused_vs_foreach": med["foreach"] / med["fused"],
        "fused_api_vs_foreach": med["foreach"] / med["fused_api"],
        "fused_graph_pct_of_copy": 100 * gbs["fused_graph"] / gbs["copy"],
        "fused_graph_vs_foreach_graph": med["foreach_graph"] / med["fused_graph"],
    }


def machine() -> dict:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {
        "gpu": torch.cuda.get_device_name(),
        "sms": props.multi_processor_count,
        "l2_bytes": getattr(props, "L2_cache_size", None),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "mbs_ext": mbs_ext.build_info(),
        "platform": platform.platform(),
    }


def write(results: list[dict], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    info = machine()
    payload = {
        "study": "accumulate_gpu",
        "machine": info,
        "rounds": ROUNDS,
        "warmup_rounds": WARMUP_ROUNDS,
        "scale": SCALE,
        "targets": {"gpt2 % of copy": 90, "resnet50 % of copy": 85, "fp32 fused vs foreach": 1.0,
                    "tiny2000 fused vs foreach": 1.0},
        "results": results,
    }
    (out / "accumulate_gpu.json").write_text(json.dumps(payload, indent=2) + "\n")
    lines = [
        "# accumulate_gpu",
        "",
        f"{info['gpu']}, torch {info['torch']} (CUDA {info['cuda']}). Medians of {ROUNDS} interleaved rounds "
        f"after {WARMUP_ROUNDS} warm-up rounds; inputs rotated over buffer sets spanning >= {L2_MULTIPLE}x L2. "
        "GB/s counts read acc + write acc + read grad; copy = device-to-device copy of the same bytes. "
        "fused = torch.ops call (C++ checks + kernel); fused_api adds the Python argument checks; "
        "graph = the same calls captured in a CUDA graph and replayed (device time, no host work).",
        "",
        "| shapes | grads | tensors | fused GB/s | % of copy | fused_api % of copy | foreach % of copy "
        "| flat add_ % of copy | copy GB/s | fused vs foreach | fused_api vs foreach "
        "| fused graph % of copy | fused graph vs foreach graph |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        g = r["gb_per_s"]
        lines.append(
            f"| {r['shapes']} | {r['grads']} | {r['tensors']} | {g['fused']:.0f} | {r['fused_pct_of_copy']:.1f} "
            f"| {r['fused_api_pct_of_copy']:.1f} | {r['foreach_pct_of_copy']:.1f} | {r['flat_add_pct_of_copy']:.1f} "
            f"| {g['copy']:.0f} | {r['fused_vs_foreach']:.2f}x | {r['fused_api_vs_foreach']:.2f}x "
            f"| {r['fused_graph_pct_of_copy']:.1f} | {r['fused_graph_vs_foreach_graph']:.2f}x |"
        )
    (out / "accumulate_gpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return out


def run_all() -> Path:
    results = [measure(name, grad_key) for name in GPU_SHAPES for grad_key in GRADS]
    from _results import results_dir

    return write(results, results_dir("gpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_accumulate_gpu():
    """The whole study; the numbers are written, not asserted (ratios from one run on one GPU)."""
    out = run_all()
    assert (out / "accumulate_gpu.json").is_file()


if __name__ == "__main__":
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        sys.exit(0)
    run_all()
