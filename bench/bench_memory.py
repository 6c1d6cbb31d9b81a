"""Peak resident memory vs mini-batch size: full-batch step vs MBS at a fixed micro-batch.

One child process per point. The child imports torch, builds the small CNN of
:mod:`mbs_ext.apps.table` and a synthetic host batch of B images (1x32x32), warms up on a
throwaway copy (so kernels and allocator arenas exist), returns freed memory to the OS,
resets its resident high-water mark (``/proc/self/clear_refs``; falls back to
``ru_maxrss``) and then runs two training steps. Children run with
``MALLOC_ARENA_MAX=2`` and ``MALLOC_MMAP_THRESHOLD_=131072`` so that freed tensors leave
the resident set at once and the peak reflects live memory, not heap fragmentation.
The reported number is the peak RSS growth over that starting point, i.e. the working
memory of the step; the host batch itself is allocated before the measurement starts,
like a batch that already sits in host memory.

Expected: MBS is flat in B (its activations are micro-batch sized), the full-batch step
grows linearly with B. ``pytest bench/bench_memory.py`` runs it and writes
``memory.{json,md,png}`` where ``bench/_results.py`` says (``bench/results/`` with
``MBS_BENCH_UPDATE=1``, else a scratch folder).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mbs_ext.diagnostics import child_env

ROOT = Path(__file__).resolve().parent.parent
SIZES = (16, 64, 256, 1024, 4096)
MICRO = 16
STEPS = 2
TAG = "MBS_MEMORY_RESULT "
MIB = float(1 << 20)


def _child(mode: str, size: int, micro: int, steps: int, threads: int) -> dict:
    import copy
    import gc
    import resource

    import torch
    from torch import nn

    import mbs_ext
    from mbs_ext.apps.data import small_cnn
    from mbs_ext.diagnostics import malloc_trim, proc_status

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    x = torch.randn(size, 1, 32, 32)
    y = torch.randint(0, 10, (size,))
    loss_fn = nn.CrossEntropyLoss()
    model = small_cnn(32)

    def one_step(m, opt, xb, yb, use_mbs):
        if use_mbs:
            mbs_ext.step(m, opt, (xb, yb), loss_fn, micro_batch_size=micro)
        else:
            opt.zero_grad()
            loss_fn(m(xb), yb).backward()
            opt.step()

    scratch = copy.deepcopy(model)
    sopt = torch.optim.Adam(scratch.parameters(), lr=1e-3)
    one_step(scratch, sopt, x[: 2 * micro], y[: 2 * micro], True)
    one_step(scratch, sopt, x[:micro], y[:micro], False)
    del scratch, sopt
    gc.collect()
    malloc_trim()

    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        method = "VmHWM after clear_refs"
        base = proc_status()["VmRSS"]
    except OSError:
        method = "ru_maxrss"
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    for _ in range(steps):
        one_step(model, opt, x, y, mode == "mbs")
    elapsed = time.perf_counter() - t0
    if method == "ru_maxrss":
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    else:
        peak = proc_status()["VmHWM"]
    return {
        "mode": mode,
        "size": size,
        "micro": micro,
        "steps": steps,
        "peak_growth_bytes": peak - base,
        "base_rss_bytes": base,
        "method": method,
        "step_s": elapsed / steps,
    }


def run_point(mode: str, size: int, micro: int = MICRO, steps: int = STEPS, threads: int = 1) -> dict:
    # Same child settings as the Table 4 rows: a small malloc arena count, and tensors
    # above 128 KiB in their own mappings, so RSS follows live memory.
    env = child_env(threads)
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        mode,
        "--size",
        str(size),
        "--micro",
        str(micro),
        "--steps",
        str(steps),
        "--threads",
        str(threads),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    for line in proc.stdout.splitlines():
        if line.startswith(TAG):
            return json.loads(line[len(TAG) :])
    raise RuntimeError(f"memory child {mode} B={size} failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")


def measure(sizes=SIZES, micro: int = MICRO, steps: int = STEPS) -> dict:
    cpus = os.cpu_count() or 1
    jobs = max(1, min(2, cpus))
    threads = max(1, cpus // jobs)
    points = [(mode, b) for b in sizes for mode in ("full", "mbs")]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        recs = list(pool.map(lambda p: run_point(p[0], p[1], micro, steps, threads), points))
    by = {(r["mode"], r["size"]): r for r in recs}
    full0 = by[("full", sizes[0])]["peak_growth_bytes"]
    mbs0 = by[("mbs", sizes[0])]["peak_growth_bytes"]
    rows = []
    for b in sizes:
        f = by[("full", b)]["peak_growth_bytes"]
        m = by[("mbs", b)]["peak_growth_bytes"]
        rows.append(
            {
                "size": b,
                "full_mib": f / MIB,
                "mbs_mib": m / MIB,
                "full_over_mbs": f / m,
                "full_vs_first": f / full0,
                "mbs_vs_first": m / mbs0,
                "full_step_s": by[("full", b)]["step_s"],
                "mbs_step_s": by[("mbs", b)]["step_s"],
            }
        )
    # Least-squares slope of the full-batch growth, bytes per sample.
    n = len(sizes)
    mx = sum(sizes) / n
    my = sum(r["full_mib"] for r in rows) / n
    slope = sum((b - mx) * (r["full_mib"] - my) for b, r in zip(sizes, rows, strict=True)) / sum(
        (b - mx) ** 2 for b in sizes
    )
    return {
        "micro_batch": micro,
        "steps": steps,
        "threads_per_child": threads,
        "method": recs[0]["method"],
        "model": "mbs_ext.apps.data.small_cnn(32), Adam, synthetic 1x32x32 inputs",
        "full_slope_kib_per_sample": slope * 1024,
        "rows": rows,
        "points": recs,
        "wall_s": round(time.perf_counter() - t0, 2),
    }


def write_results(res: dict, out: Path | None = None) -> dict[str, Path]:
    from _results import results_dir

    out = results_dir() if out is None else out
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "memory.json", "md": out / "memory.md", "png": out / "memory.png"}
    paths["json"].write_text(json.dumps(res, indent=2))
    first = res["rows"][0]["size"]
    lines = [
        "# Peak memory vs mini-batch size",
        "",
        f"Peak RSS growth during {res['steps']} training steps (small CNN, 1x32x32 inputs, Adam), one child "
        f"process per point, measured as {res['method']}. MBS uses micro-batch {res['micro_batch']}. "
        f"Full-batch slope: {res['full_slope_kib_per_sample']:.0f} KiB per sample.",
        "",
        f"| Mini-batch | Full batch (MiB) | MBS (MiB) | Full / MBS | Full vs B={first} | MBS vs B={first} "
        "| Full step (s) | MBS step (s) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['size']} | {r['full_mib']:.1f} | {r['mbs_mib']:.1f} | {r['full_over_mbs']:.2f}x | "
            f"{r['full_vs_first']:.2f}x | {r['mbs_vs_first']:.2f}x | "
            f"{r['full_step_s']:.3f} | {r['mbs_step_s']:.3f} |"
        )
    paths["md"].write_text("\n".join(lines) + "\n")

    from mbs_ext.diagnostics import pyplot

    plt = pyplot()

    sizes = [r["size"] for r in res["rows"]]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(sizes, [r["full_mib"] for r in res["rows"]], "o-", label="full batch")
    ax.plot(
        sizes, [r["mbs_mib"] for r in res["rows"]], "s--", label=f"MBS (micro-batch {res['micro_batch']})"
    )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("mini-batch size")
    ax.set_ylabel("peak RSS growth (MiB)")
    ax.set_title("Peak memory vs mini-batch size (CPU)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(paths["png"], dpi=110)
    plt.close(fig)
    return paths


def test_peak_memory_vs_batch_size():
    res = measure()
    paths = write_results(res)
    print(paths["md"].read_text())
    rows = {r["size"]: r for r in res["rows"]}
    small, big = min(SIZES), max(SIZES)
    # MBS is flat: the largest mini-batch needs at most 1.2x the memory of B = micro-batch.
    assert rows[big]["mbs_mib"] <= 1.2 * rows[small]["mbs_mib"], res["rows"]
    # The full batch grows linearly: 4x the rows, at least 3x the memory at the top end.
    assert rows[big]["full_mib"] >= 3.0 * rows[big // 4]["full_mib"], res["rows"]
    assert rows[big]["full_mib"] >= 10 * rows[big]["mbs_mib"], res["rows"]


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--child", choices=("full", "mbs"))
    p.add_argument("--size", type=int, default=16)
    p.add_argument("--micro", type=int, default=MICRO)
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    if a.child:
        print(TAG + json.dumps(_child(a.child, a.size, a.micro, a.steps, a.threads)), flush=True)
    else:
        r = measure()
        print(write_results(r)["md"].read_text())
