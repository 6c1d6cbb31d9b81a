"""Planner accuracy with the operating system as the judge.

For each model and budget a fresh child process (large allocations served by mmap:
``MALLOC_MMAP_THRESHOLD_=65536``, ``MALLOC_TRIM_THRESHOLD_=0``, so freed memory leaves
the process; one torch thread) plans the micro-batch size for a batch larger than the
budget allows, then resets its peak RSS (``5`` into ``/proc/self/clear_refs``) and runs
one ``mbs_ext.step`` over exactly 3 micro-batches of the planned size. The real peak is
the rise of ``VmHWM`` over ``VmRSS`` just before the step. Also recorded: the planning
time against one micro-batch's forward/backward at the planned size ("probe steps"),
the probes the planner ran, the dispatch tracker's view of the same step, and any
out-of-memory back-off (it warns). Target: 0.85 <= real/budget <= 1.00, no back-off,
planning <= 3 probe steps.

On CUDA the child reads ``torch.cuda.max_memory_allocated`` above what was allocated
before the step, and ``torch.cuda.memory_reserved`` (the allocator's footprint).

    python -m pytest bench/bench_planner.py -q -s     # CPU rows; CUDA rows where a GPU exists
    python bench/bench_planner.py --case cnn 200 cpu  # one case, one JSON line

Writes ``planner.json``/``.md``/``.png`` where ``bench/_results.py:results_dir`` says (a scratch
folder unless ``MBS_BENCH_UPDATE=1`` or ``$MBS_BENCH_OUT``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10),
    )


class UNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        def block(i: int, o: int) -> nn.Module:
            return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.ReLU(), nn.Conv2d(o, o, 3, padding=1), nn.ReLU())

        self.d1, self.d2, self.mid = block(3, 16), block(16, 32), block(32, 64)
        self.up2, self.u2 = nn.ConvTranspose2d(64, 32, 2, stride=2), block(64, 32)
        self.up1, self.u1 = nn.ConvTranspose2d(32, 16, 2, stride=2), block(32, 16)
        self.out = nn.Conv2d(16, 10, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.d1(x)
        b = self.d2(nn.functional.max_pool2d(a, 2))
        c = self.mid(nn.functional.max_pool2d(b, 2))
        b = self.u2(torch.cat([self.up2(c), b], 1))
        a = self.u1(torch.cat([self.up1(b), a], 1))
        return self.out(a).mean((2, 3))


class Transformer(nn.Module):
    def __init__(self, d: int = 128, layers: int = 2, vocab: int = 1000) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.1, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x)).mean(1))


# name: (constructor, input shape, integer tokens?, budgets in MiB for the study)
MODELS = {
    "cnn": (cnn, (3, 32, 32), False, (100, 200, 600)),
    "mlp": (mlp, (512,), False, (100, 150, 300)),
    "transformer": (Transformer, (64,), True, (100, 200, 400)),
    "unet": (UNet, (3, 32, 32), False, (100, 200, 400)),
}


def ce(model: nn.Module, mb) -> torch.Tensor:
    return nn.functional.cross_entropy(model(mb[0]), mb[1])


def data(shape, n: int, tokens: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 1000, (n, *shape), generator=g) if tokens else torch.randn(n, *shape, generator=g)
    return x, torch.randint(0, 10, (n,), generator=g)


def child_env() -> dict[str, str]:
    """A measuring child: this checkout importable, one thread, large blocks mmapped and returned on free."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


def case(name: str, budget_mib: float, device: str = "cpu", rows: int = 0, with_tracker: bool = False) -> dict:
    """Plan, then one step at the planned size, measured from outside the planner (run in a fresh child)."""
    import mbs_ext
    from mbs_ext.diagnostics import malloc_trim, proc_status

    torch.set_num_threads(1)
    dev = torch.device(device)
    make, shape, tokens, _ = MODELS[name]
    torch.manual_seed(0)
    model = make().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    budget = int(budget_mib * MiB)
    # The batch stays on the host (on CUDA the step stages each micro-batch to the device).
    batch = list(data(shape, rows or 16384, tokens))
    # What the first forward/backward of a process initialises once (oneDNN kernels, lazy
    # state) is paid by the first step with or without planning: timed apart, as init_s.
    t0 = time.perf_counter()
    ce(model, [t[:2].to(dev) for t in batch]).backward()
    model.zero_grad(set_to_none=True)
    t_init = time.perf_counter() - t0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        plan = mbs_ext.plan_micro_batch(model, batch, ce, memory_budget=budget)
        t_plan = time.perf_counter() - t0
        m = plan.micro_batch_size
        if 3 * m > len(batch[0]):  # the step must run exactly 3 micro-batches of the planned size
            batch = list(data(shape, 3 * m, tokens))
        step_batch = [t[: 3 * m] for t in batch]  # views: a CPU step streams them in place
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)  # max_memory_reserved too
            before = torch.cuda.memory_allocated(dev)
            reserved = torch.cuda.memory_reserved(dev)
        import gc

        gc.collect()
        malloc_trim()
        rss = proc_status()["VmRSS"]
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        t0 = time.perf_counter()
        result = mbs_ext.step(model, opt, step_batch, ce, micro_batch_size=m)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t_step = time.perf_counter() - t0
        hwm = proc_status()["VmHWM"]
        if with_tracker:  # the dispatch tracker's view of the same step (one more step)
            from mbs_ext.diagnostics import PeakTracker

            with PeakTracker() as tracker:
                mbs_ext.step(model, opt, step_batch, ce, micro_batch_size=m)
    backoffs = sum(issubclass(w.category, RuntimeWarning) and "memory" in str(w.message) for w in caught)
    out = {"device": dev.type, "model": name, "budget_MiB": budget_mib, "rows": rows or 16384,
           "planned": m, "micro_batches": result.num_micro_batches, "probes": list(plan.probes),
           "init_s": round(t_init, 3), "plan_s": round(t_plan, 3),
           "probe_step_s": round(t_step / result.num_micro_batches, 3),
           "plan/probe_step": round(t_plan / (t_step / result.num_micro_batches), 2), "backoffs": backoffs}
    out["meter"] = plan.meter
    probed = dict(plan.verified).get(m)
    out["probe/budget"] = round(probed / budget, 3) if probed else None  # the planner's own reading
    if dev.type == "cuda":
        out["real/budget"] = round((torch.cuda.max_memory_allocated(dev) - before) / budget, 3)
        # What the caching allocator reserved beyond what it held before the step: the
        # device memory the step really took (block rounding and fragmentation included).
        out["reserved/budget"] = round((torch.cuda.max_memory_reserved(dev) - reserved) / budget, 3)
    else:
        out["real/budget"] = round((hwm - rss) / budget, 3)
        if with_tracker:
            out["tracker/budget"] = round(tracker.peak / budget, 3)
    return out


def run_case(name: str, budget_mib: float, device: str = "cpu", timeout: float = 300, rows: int = 0,
             with_tracker: bool = False) -> dict:
    """``case`` in a fresh process with the measuring environment; a watchdog timeout bounds it."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--case", name, str(budget_mib), device, str(rows),
           "tracker" if with_tracker else ""]
    done = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{name} {budget_mib} MiB: child failed ({done.returncode})\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


NOTES = """\
Columns: meter is what judged the planned size (rss: the OS, RssPeak; tracker: PeakTracker;
cuda: the caching allocator). probe/budget is the planner's own reading at the planned size,
real/budget the judge's, tracker/budget the dispatch tracker's view of the same step (it sees
op outputs only: the U-Net's convolution buffers are missing, so the tracker-judged planner
before RssPeak planned 252 rows at 200 MiB, real 1.155x; MLP, CNN and the transformer agree
with the OS to 0.5%).

Why RssPeak switches glibc to mmap-and-return (mallopt) for its duration, measured in a child
*without* the MALLOC_ environment (glibc's dynamic thresholds), real/budget of the step:
trim only, no mallopt: mlp 150 MiB 1.949, unet 200 MiB 1.202 (the planner's search did not
converge: it reads the heap's history); with mallopt: mlp 0.957, unet 0.955, cnn 200 MiB 0.949.
Meter resolution: a 1-64 MiB tensor reads 80 KiB under its size every time (deterministic);
hence RSS judges budgets from 8 MiB, the tracker below (existing tests grade 64 KiB-4 MiB
budgets by the tracker)."""

COLS = ["device", "model", "budget_MiB", "meter", "planned", "real/budget", "probe/budget", "tracker/budget", "init_s",
        "plan_s", "probe_step_s", "plan/probe_step",
        "probes", "backoffs"]


def write(rows: list[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "judge": "CPU: VmHWM rise over VmRSS of one step at the planned size, fresh process, "
                     "MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0, 1 thread; "
                     "CUDA: max_memory_allocated above the allocation before the step"}
    (out / "planner.json").write_text(json.dumps({"study": "planner", **meta, "rows": rows}, indent=2) + "\n")
    cols = COLS + [c for c in ("reserved/budget",) if any(c in r for r in rows)]
    lines = ["# planner: planned micro-batch against the real peak", "", f"torch {meta['torch']}, GPU {meta['gpu']}",
             "", f"Judge: {meta['judge']}. probes: rows of each probe the planner ran (warm-up, line fit, "
             "verifications at full size). plan/probe_step: planning time over one micro-batch's forward+backward "
             "at the planned size.", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    lines += ["", NOTES]
    (out / "planner.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    short = {"transformer": "tfm"}
    labels = [f"{short.get(r['model'], r['model'])}\n{r['budget_MiB']:g}" for r in rows]
    ax[0].bar(range(len(rows)), [r["real/budget"] for r in rows], color="tab:blue", label="real (OS)")
    tracked = [(i, r["tracker/budget"]) for i, r in enumerate(rows) if r.get("tracker/budget")]
    if tracked:
        ax[0].plot(*zip(*tracked), "k_", ms=14, mew=2, ls="", label="dispatch tracker")
        ax[0].legend(fontsize=7, loc="lower right")
    ax[0].axhspan(0.85, 1.0, color="tab:green", alpha=0.15)
    ax[0].set_ylim(0.6, 1.15)
    ax[0].set_ylabel("real peak / budget (OS)")
    ax[1].bar(range(len(rows)), [r["plan/probe_step"] for r in rows], color="tab:orange")
    ax[1].axhline(3, color="tab:red", ls="--")
    ax[1].set_ylabel("planning time / probe step")
    for a in ax:
        a.set_xticks(range(len(rows)), labels, fontsize=7)
    fig.suptitle(f"micro_batch_size='auto' on {rows[0]['device']}: model / budget (MiB)")
    fig.tight_layout()
    fig.savefig(out / "planner.png", dpi=110)


CUDA_SCALE = 8  # CUDA budgets: the CPU ones times this
CUDA_ROWS = {"mlp": 1 << 18}  # rows to plan for on CUDA (default 1 << 16): more than any plan


def devices() -> list[str]:
    """``$MBS_PLANNER_DEVICES`` (e.g. "cuda" in scripts/gpu_check.sh), else cpu and cuda where present."""
    wanted = os.environ.get("MBS_PLANNER_DEVICES", "cpu cuda").split()
    return [d for d in wanted if d == "cpu" or (d == "cuda" and torch.cuda.is_available())]


def test_planner_accuracy() -> None:
    rows = []
    if "cpu" in devices():
        rows += [run_case(name, b, with_tracker=True) for name, spec in MODELS.items() for b in spec[3]]
    if "cuda" in devices():
        # Each child reads its own process's allocator, so children may share the GPU:
        # $MBS_PLANNER_JOBS of them at once (scripts/gpu_check.sh, where device time is short).
        cases = [(name, b * CUDA_SCALE, "cuda", 300, CUDA_ROWS.get(name, 1 << 16))
                 for name, spec in MODELS.items() for b in spec[3]]
        with ThreadPoolExecutor(int(os.environ.get("MBS_PLANNER_JOBS", "1"))) as pool:
            rows += list(pool.map(lambda c: run_case(*c), cases))
    assert rows, "no device selected"
    from _results import results_dir

    write(rows, results_dir())
    for r in rows:
        print(r)
    assert all(r["backoffs"] == 0 for r in rows)
    assert all(r["planned"] < r["rows"] for r in rows)
    assert all(0.85 <= r["real/budget"] <= 1.0 for r in rows)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--case":
        name, budget, device = sys.argv[2], float(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else "cpu"
        rows = int(sys.argv[5]) if len(sys.argv) > 5 else 0
        print(json.dumps(case(name, budget, device, rows, with_tracker="tracker" in sys.argv[6:])))
    else:
        test_planner_accuracy()
