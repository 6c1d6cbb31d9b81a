"""Fused scale-and-accumulate vs torch's foreach, a per-tensor loop, and one big add_.

Run: ``pytest bench/bench_accumulate.py``. All variants run side by side in one
session (this machine is shared and noisy), so only their ratios are claimed.
Bytes moved per element: read acc + write acc + read grad.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from _results import interleaved
from shapes import MODELS

import mbs_ext

CASES = {"fp32->fp32": (torch.float32, torch.float32), "bf16->fp32": (torch.float32, torch.bfloat16)}
METHODS = ["fused", "foreach", "loop", "ceiling"]
SCALE = 0.125
ROUNDS = 11
_medians: dict[tuple[str, str, str], float] = {}
_bytes: dict[tuple[str, str], int] = {}


def _make(model: str, case: str):
    acc_dtype, grad_dtype = CASES[case]
    shapes = MODELS[model]()
    gen = torch.Generator().manual_seed(0)
    accs = [torch.randn(s, generator=gen, dtype=acc_dtype) for s in shapes]
    grads = [torch.randn(s, generator=gen).to(grad_dtype) for s in shapes]
    numel = sum(math.prod(s) for s in shapes)
    _bytes[(model, case)] = numel * (2 * accs[0].element_size() + grads[0].element_size())
    return accs, grads, numel


def _runner(method: str, accs, grads, numel):
    if method == "fused":
        found_inf = torch.zeros(())
        return lambda: mbs_ext.scale_accumulate_(accs, grads, SCALE, found_inf)
    if method == "foreach":
        return lambda: torch._foreach_add_(accs, grads, alpha=SCALE)
    if method == "loop":
        def loop():
            for a, g in zip(accs, grads):
                a.add_(g, alpha=SCALE)
        return loop
    big_acc = torch.randn(numel, dtype=accs[0].dtype)
    big_grad = torch.randn(numel).to(grads[0].dtype)
    return lambda: big_acc.add_(big_grad, alpha=SCALE)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("model", list(MODELS))
def test_accumulate(benchmark, model, case):
    """All methods on the same tensors, interleaved: each round runs every method once,
    in a rotating order, so drifts of a shared machine hit them alike."""
    accs, grads, numel = _make(model, case)
    runs = {method: _runner(method, accs, grads, numel) for method in METHODS}
    times: dict[str, list[float]] = {method: [] for method in METHODS}
    round_robin = interleaved(runs, times)

    benchmark.group = f"accumulate {model} {case} (one round = every method once)"
    benchmark.extra_info["bytes"] = _bytes[(model, case)]
    benchmark.pedantic(round_robin, rounds=ROUNDS, iterations=1, warmup_rounds=2)
    for method, samples in times.items():
        median = statistics.median(samples[-ROUNDS:])
        benchmark.extra_info[f"{method}_median_s"] = median
        _medians[(model, case, method)] = median


def test_report():
    """Ratios of the medians above; written to accumulate.{json,md} (bench/_results.py says where)."""
    if len(_medians) < len(MODELS) * len(CASES) * len(METHODS):
        pytest.skip("run the whole module to get the report")
    from _results import write

    rows, data = [], {}
    for model in MODELS:
        for case in CASES:
            med = {m: _medians[(model, case, m)] for m in METHODS}
            gbs = {m: _bytes[(model, case)] / med[m] / 1e9 for m in METHODS}
            row = {
                "model": model,
                "case": case,
                "fused GB/s": gbs["fused"],
                "foreach GB/s": gbs["foreach"],
                "loop GB/s": gbs["loop"],
                "ceiling GB/s": gbs["ceiling"],
                "fused vs foreach": med["foreach"] / med["fused"],
                "fused vs ceiling": med["ceiling"] / med["fused"],
            }
            rows.append(row)
            data[f"{model} {case}"] = {"median_s": med, "gb_per_s": gbs}
    write(
        "accumulate",
        {"results": data, "targets": {"fp32 vs foreach": 1.1, "fp32 vs ceiling": 0.85, "bf16 vs foreach": 4.0}},
        rows,
        note=f"Medians of {ROUNDS} interleaved rounds (every method once per round, rotating order), "
        f"{torch.get_num_threads()} threads. "
        "Ratios > 1 mean the fused op is faster.",
    )


CALL_METHODS = ["api", "raw_op", "foreach"]
CALL_COUNTS = [152, 2000]  # a ResNet-sized list of small tensors, and many of them
_call_medians: dict[int, dict[str, float]] = {}


@pytest.mark.parametrize("count", CALL_COUNTS)
def test_call_overhead(benchmark, count):
    """What the public ``mbs_ext.scale_accumulate_`` costs over the bare dispatcher op and
    ``torch._foreach_add_`` when a call carries many small tensors (the argument checks run
    in C++, once per call).

    On a GPU the kernel is asynchronous, so host work per call is all the caller waits
    for; on this CPU it adds to the kernel's time.
    """
    from shapes import tiny_shapes

    from mbs_ext.diagnostics import scale_accumulate_unchecked as _OP

    gen = torch.Generator().manual_seed(0)
    shapes = tiny_shapes(count)
    accs = [torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    found_inf = torch.zeros(())
    scale = torch.tensor(SCALE, dtype=torch.float64)
    runs = {
        "api": lambda: mbs_ext.scale_accumulate_(accs, grads, SCALE, found_inf),
        "raw_op": lambda: _OP(accs, grads, scale, found_inf),
        "foreach": lambda: torch._foreach_add_(accs, grads, alpha=SCALE),
    }
    rounds = 4 * ROUNDS if count > 1000 else 40 * ROUNDS  # short calls: more rounds
    times: dict[str, list[float]] = {method: [] for method in CALL_METHODS}
    benchmark.group = f"accumulate call overhead, {count:,} small tensors"
    benchmark.pedantic(interleaved(runs, times), rounds=rounds, iterations=1, warmup_rounds=3)
    med = {m: statistics.median(times[m][-rounds:]) for m in CALL_METHODS}
    _call_medians[count] = med
    benchmark.extra_info.update({f"{m}_median_s": v for m, v in med.items()})


def test_call_report():
    """The call-overhead medians above, written to accumulate_calls.* (bench/_results.py says where)."""
    if len(_call_medians) < len(CALL_COUNTS):
        pytest.skip("run every test_call_overhead to get the report")
    from _results import write

    rows = [
        {"tensors": count, "method": m, "median us": med[m] * 1e6, "vs foreach": med["foreach"] / med[m],
         "time / foreach": med[m] / med["foreach"]}
        for count, med in _call_medians.items()
        for m in CALL_METHODS
    ]
    data = {
        str(count): {"median_s": med, "api_over_raw_us": (med["api"] - med["raw_op"]) * 1e6,
                     "api_time_over_foreach": med["api"] / med["foreach"]}
        for count, med in _call_medians.items()
    }
    write(
        "accumulate_calls",
        {"results": data, "targets": {"api time / foreach, 152 tensors": 1.3}},
        rows,
        note=f"Tensors of 16 to 2,015 float32 elements (bench/shapes.py tiny_shapes); medians of {40 * ROUNDS} "
        f"(152 tensors) and {4 * ROUNDS} (2,000) interleaved rounds, {torch.get_num_threads()} threads. "
        "`time / foreach` < 1 means faster than `torch._foreach_add_`; `raw_op` is the registered op "
        "called through `torch.ops` (its kernel checks too).",
    )
