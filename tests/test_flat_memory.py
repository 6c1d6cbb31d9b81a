"""The peak memory a step adds does not grow with the number of micro-batches.

That is what streaming is for: a step's memory follows the micro-batch, so a mini-batch of
1,024 micro-batches must cost what one of 8 costs, at the same micro-batch size. Whatever a
step keeps per micro-batch (a gradient, a graph, a row of BatchNorm statistics, a count, a
heap that fragments as micro-batches come and go) breaks it, and only the operating system
sees all of it. Each case runs ``bench/flat_memory.py`` in a fresh child process at ``k=8``
and at ``k=1024`` micro-batches of 2 rows: the child builds everything, takes one warm-up
step, and measures one step, the rise of ``VmHWM`` (reset through ``/proc/self/clear_refs``)
over ``VmRSS`` just before it (on CUDA: ``max_memory_allocated`` over what was allocated).
The children run with glibc's default malloc settings (no ``MALLOC_*``): that is how users
run, and a heap that grows per micro-batch under the defaults is a step that grows.

``rise(1024) - rise(8)`` must stay within :data:`TOL_MIB`; ``cached_loss`` first takes off
what its encodings of every row need by nature (``inherent_mib``, 0.5 MiB at k=1024). One
fresh process per figure, no medians: with no parameter over 256 KiB (bench/flat_memory.py,
``_mlp``) one process's figure is within about 1 MiB of another's (below), and each child costs
7 s of imports, so medians of three would triple the file's three minutes. Two controls keep
single figures honest: ``hand_loop`` (PyTorch's own accumulation loop over the same
micro-batches, no mbs_ext) must pass, or the noise has outgrown the tolerance and a case's
failure says nothing about the step; ``leak`` (a correct step under a ``loss_fn`` that keeps
0.5 MiB per micro-batch) must grow by more than 0.4 MiB per micro-batch, or a flat result
would prove nothing. Two-rank cases (DDP, FSDP2, BatchNorm across ranks, SyncBatchNorm) run
on two gloo ranks under ``tests/ddp_harness.py``'s watchdog; each rank measures its own rise
and the larger counts.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from common import DEVICE_PARAMS, ROOT, run_python

BENCH = ROOT / "bench" / "flat_memory.py"
SMALL, LARGE = 8, 1024  # micro-batches of the two steps compared

# Measured on 2 CPU cores, 5 processes per size: the flat reference `hand_loop` rose 0.57-1.55 MiB
# at k=8 and 0.58-1.54 MiB at k=1024 (pairs: -0.49..+0.72 MiB; the worst pairing of the two
# ranges, +0.97 MiB). The tolerance is twice that: a step that keeps over 2 KiB per micro-batch
# fails it at k=1024, one that keeps a gradient (2 MiB) or one layer's (256 KiB) per micro-batch
# fails by a GiB or a quarter of one.
TOL_MIB = 2.0
LEAK_PER_MICRO_BATCH_MIB = 0.4  # the leak control keeps 0.5 MiB a micro-batch; it must show more than this

SINGLE = ["batchnorm", "tokens", "accumulate", "plain", "device_counts", "cached_loss"]
RANKED = ["fsdp2", "batchnorm_across_ranks", "syncbatchnorm", "ddp"]
FLAT, LEAK = "hand_loop", "leak"  # the controls: must pass, must fail
CHILD_TIMEOUT_S = 240.0  # per single-process child; a two-rank child's ranks have their own watchdog inside
RANKED_TIMEOUT_S = 330.0  # the backstop over the script's run_world (240 s)

pytestmark = [pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc"),
              pytest.mark.slow]  # fresh child processes: out of the quick suite


def _env() -> dict[str, str]:
    """This process's environment without ``MALLOC_*``: the property holds under glibc's defaults,
    and a setting inherited from whoever runs the suite would hide a heap that grows."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env["OMP_NUM_THREADS"] = "1"  # the child also sets one torch thread; no idle pool either
    return env


def _measure(case: str, k: int, device: str) -> dict:
    timeout = RANKED_TIMEOUT_S if case in RANKED else CHILD_TIMEOUT_S
    done = run_python([BENCH, "--case", case, "--k", str(k), "--device", device], env=_env(), timeout=timeout,
                      cwd=ROOT)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _measure_all(cases: list[str], device: str) -> dict[str, dict[int, dict]]:
    """Every case at both sizes, two children at a time, longest first (the figures are per
    process; a neighbour slows a child but does not move its peak)."""
    jobs = [(case, k) for k in (LARGE, SMALL) for case in cases]
    with ThreadPoolExecutor(2) as pool:
        rows = list(pool.map(lambda job: _measure(*job, device), jobs))
    out: dict[str, dict[int, dict]] = {}
    for (case, k), row in zip(jobs, rows):
        out.setdefault(case, {})[k] = row
    return out


@pytest.fixture(scope="module")
def measured():
    """``measured(group, device)``: the figures of a group of cases, measured once per module."""
    cache: dict[tuple[str, str], dict[str, dict[int, dict]]] = {}

    def get(group: str, device: str) -> dict[str, dict[int, dict]]:
        if (group, device) not in cache:
            cases = {"single": [*SINGLE, FLAT, LEAK], "ranked": RANKED}[group]
            cache[group, device] = _measure_all(cases, device)
        return cache[group, device]

    return get


def _growth(rows: dict[int, dict]) -> float:
    """MiB the step of ``LARGE`` micro-batches adds at its peak beyond the step of ``SMALL``, less
    what the case needs by nature in proportion to the mini-batch (``cached_loss``'s encodings)."""
    return ((rows[LARGE]["rise_mib"] - rows[LARGE]["inherent_mib"])
            - (rows[SMALL]["rise_mib"] - rows[SMALL]["inherent_mib"]))


def _shown(case: str, rows: dict[int, dict]) -> str:
    small, large = rows[SMALL], rows[LARGE]
    return (f"{case} ({large['device']}): rise {small['rise_mib']:.2f} MiB at k={SMALL}, {large['rise_mib']:.2f} MiB "
            f"at k={LARGE}, growth {_growth(rows):+.2f} MiB (inherent {large['inherent_mib']:.2f} MiB taken off; "
            f"still held after the step {small['kept_mib']:.2f} / {large['kept_mib']:.2f} MiB; "
            f"step {small['step_s']:.2f} / {large['step_s']:.2f} s)")


def _check_flat(case: str, rows: dict[int, dict]) -> None:
    __tracebackhide__ = True
    for k, row in rows.items():  # the step streamed what was asked (on every rank)
        counts = row["micro_batches"] if isinstance(row["micro_batches"], list) else [row["micro_batches"]]
        assert min(counts) >= k, f"{case}: asked for {k} micro-batches, streamed {counts}"
    assert _growth(rows) <= TOL_MIB, (f"the peak grows with the micro-batches: {_shown(case, rows)}; "
                                      f"tolerance {TOL_MIB} MiB")


# Open on the CPU (2026-11-28), each measured and kept as an expected failure so that the
# figure still runs and a fix shows (strict: an unexpected pass fails until the mark goes):
OPEN_ON_CPU = {
    "cached_loss": (True, "+32 to +34 MiB: glibc's heap under the harness's own InfoNCE loss, whose checkpointed "
                          "chunks make temporaries of 64 x all rows (the loss alone, without mbs_ext, grows the heap "
                          "25 MiB on 2,048 rows); mbs_ext's pass 3 is flat (+20 KB live over 1,024 micro-batches)"),
    "fsdp2": (True, "+14.5 MiB: the heap's top moves as FSDP2's 1 MiB gather and reduce buffers are freed and reused, "
                    "and live heap rose 2.4 MiB up to micro-batch 768 from a source not yet found"),
    # Not strict: its figure straddles the tolerance (+1.95 and +3.15 MiB in two runs).
    "tokens": (False, "+2 to +3 MiB: the token plan's temporaries over every row (about 0.5 MiB each at 2,048 x 32) "
                      "touch heap before the first micro-batch, in proportion to the rows, not the micro-batches"),
}


def _open(request: pytest.FixtureRequest, case: str, device: str) -> None:
    if device == "cpu" and case in OPEN_ON_CPU:
        strict, reason = OPEN_ON_CPU[case]
        request.applymarker(pytest.mark.xfail(strict=strict, reason=reason))


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("case", SINGLE)
def test_peak_of_a_step_is_flat_in_the_micro_batches(measured, case, device, request):
    _open(request, case, device)
    _check_flat(case, measured("single", device)[case])


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", RANKED)
def test_peak_of_a_two_rank_step_is_flat_in_the_micro_batches(measured, case, request):
    _open(request, case, "cpu")
    _check_flat(case, measured("ranked", "cpu")[case])


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_the_measurement_passes_a_hand_written_accumulation_loop(measured, device):
    """The flat control: PyTorch's own gradient accumulation over the same micro-batches, no
    mbs_ext. It must pass, or the tolerance is below the measurement's noise and a case's
    failure says nothing about the step."""
    _check_flat(FLAT, measured("single", device)[FLAT])


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_the_measurement_sees_a_leak_of_half_a_mebibyte_per_micro_batch(measured, device):
    """The failing control: a real step whose ``loss_fn`` keeps 0.5 MiB per micro-batch. It must
    grow by more than 0.4 MiB per micro-batch of ``LARGE`` (the same figures and :func:`_growth`
    as the cases), and so fail the flatness check; otherwise a flat case would prove nothing."""
    rows = measured("single", device)[LEAK]
    assert _growth(rows) > LEAK_PER_MICRO_BATCH_MIB * LARGE, f"the leak went unseen: {_shown(LEAK, rows)}"
    with pytest.raises(AssertionError, match="grows with the micro-batches"):
        _check_flat(LEAK, rows)
