"""A miniature of the paper's Table 4 on a CPU: full-batch training vs MBS under a memory cap.

A small CNN is trained on scikit-learn's digits (the 8x8 images upsampled once to 32x32,
so that activations dominate memory the way they do for real images). For every
mini-batch size B one *child process* trains the same initial model twice over the same
data order: first with :func:`mbs_ext.step` at a fixed micro-batch size, then with the
plain full-batch step (``zero_grad(); loss.backward(); step()`` on the whole mini-batch).

The memory cap
--------------
After the child has imported torch, built model and data and warmed up (one tiny
forward/backward/step on a throwaway copy, so that lazily created allocator arenas and
kernels exist), it reads its own current virtual size (``VmSize``) and sets
``RLIMIT_AS`` to ``VmSize + headroom``. The headroom is calibrated, not guessed: one
calibration child runs the MBS step at the given micro-batch size on the *largest*
mini-batch of the table (so the per-step gather of the mini-batch rows is included)
plus an evaluation pass, and reports its peak growth ``VmPeak - VmSize`` over the same
starting point. The cap is that growth times 1.5 plus 16 MiB of slack:

* MBS needs only micro-batch-sized activations, so its growth does not depend on B and
  the same cap fits every row; 1.5x + 16 MiB absorbs allocator jitter (arena
  fragmentation, caching, run-to-run differences) so MBS never trips it;
* the full-batch step needs activations for all B rows at once, so as soon as B is a
  few times the micro-batch it needs more than the cap and the allocation fails, the
  way a real accelerator runs out of memory.

Children run with ``MALLOC_ARENA_MAX=2`` (glibc otherwise reserves one 64 MiB arena per
thread, which would make address-space accounting depend on thread scheduling),
``MALLOC_MMAP_THRESHOLD_=131072`` (every tensor above 128 KiB gets its own mapping and
gives it back when freed, so the address space follows live memory rather than heap
fragmentation, and where the full batch starts failing does not drift from run to run)
and one intra-op thread each, two children at a time on a two-core machine. An allocation
failure (``torch.OutOfMemoryError``, ``MemoryError`` or an allocator ``RuntimeError``)
in the full-batch step is reported as "Failed", like the paper.

The sweep
---------
Then the papers' headline property as a picture (``sweep.png``): the peak memory of one
training step against the mini-batch size, under the same cap, for the small CNN and the
same CNN with BatchNorm (``bn_cnn``; the step defers its statistics by itself). Per model,
one child takes full-batch steps at sizes ``micro * 2**(k/4)``, ascending until the first
fails: the largest that trained is F. A second child takes one MBS step at each multiple of F
in ``--sweep`` (default 1, 4, 16, 64, 256; ``--sweep 1,4,16,64,256,1024`` reaches 1,024x,
``--sweep none`` skips it); the full batch, failed at about 1.2 F, is not run again. A mini-batch
is row indices drawn with replacement from the training set (``torch.randint``), taken by
``mbs_ext.step(..., indices=)``, which gathers micro-batch by micro-batch, so the host holds only
the data set and the indices; the full batch gathers ``x[indices]``, as it must. The peak is
the step's resident-set growth (``VmHWM`` after ``5`` into ``/proc/self/clear_refs``, minus
``VmRSS`` just before), next to its samples/s. These children run with one malloc arena
(:func:`run_sweep_child`) and set the cap anew before each step (:func:`_sweep_child`).

Run ``python -m mbs_ext table --out DIR`` (or ``main([...])``); writes ``table.md``,
``table.json``, ``table.png`` and ``sweep.png`` to ``DIR`` and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mbs_ext.apps import _args as argtypes
from mbs_ext.apps.data import accuracy, load_digits, small_bn_cnn, small_cnn
from mbs_ext.diagnostics import child_env, malloc_trim, proc_status

RESULT_TAG = "MBS_TABLE_RESULT "
DEFAULT_SIZES = "16,32,64,128,256,512,1024,all"
DEFAULT_SWEEP = "1,4,16,64,256"
GPU_SWEEP = "16,64,91"  # --device cuda: the papers' multiples of the largest full batch
SWEEP_MODELS = {"cnn": small_cnn, "bn_cnn": small_bn_cnn}
CAP_FACTOR = 1.5
CAP_SLACK = 16 << 20
MIB = float(1 << 20)
PROG = "python -m mbs_ext table"  # cli.PROG's table


# --------------------------------------------------------------------------- data, model


def make_optimizer(model, batch_size: int, micro_batch_size: int, base_lr: float):
    """Adam with the learning rate scaled by sqrt(B / micro), capped at 10x the base."""
    import torch

    lr = base_lr * min(10.0, math.sqrt(max(1.0, batch_size / micro_batch_size)))
    return torch.optim.Adam(model.parameters(), lr=lr)


# --------------------------------------------------------------------------- memory


# --------------------------------------------------------------------------- training


def _train(model, opt, x, y, *, batch_size, micro, mbs, epochs, max_steps, seed) -> list[float]:
    """Train; returns per-epoch wall times. Allocation failures propagate."""
    import torch
    from torch import nn

    import mbs_ext

    loss_fn = nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(seed)
    times = []
    for _ in range(epochs):
        perm = torch.randperm(len(y), generator=gen)
        t0 = time.perf_counter()
        for i, s in enumerate(range(0, len(y), batch_size)):
            if max_steps and i >= max_steps:
                break
            idx = perm[s : s + batch_size]
            xb, yb = x[idx], y[idx]
            if mbs:
                mbs_ext.step(model, opt, (xb, yb), loss_fn, micro_batch_size=micro)
            else:
                opt.zero_grad()
                loss = loss_fn(model(xb), yb)
                loss.backward()
                opt.step()
                del loss
            del xb, yb
        times.append(time.perf_counter() - t0)
    return times


def _emit(obj: dict) -> None:
    sys.stdout.write(RESULT_TAG + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _child(args: argparse.Namespace) -> int:
    import copy
    import gc
    import resource

    import torch

    from mbs_ext.diagnostics import is_out_of_memory

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    x, y, xt, yt = load_digits(args.image_size, args.seed)
    size = len(y) if args.size <= 0 else min(args.size, len(y))
    model = small_cnn(args.image_size)
    init_state = copy.deepcopy(model.state_dict())

    # Warm-up on a throwaway copy: kernels, allocator arenas, the streamer, the optimizer.
    scratch = copy.deepcopy(model)
    _train(
        scratch,
        make_optimizer(scratch, args.micro, args.micro, args.lr),
        x[: args.micro * 2],
        y[: args.micro * 2],
        batch_size=args.micro * 2,
        micro=args.micro,
        mbs=True,
        epochs=1,
        max_steps=1,
        seed=args.seed,
    )
    _train(
        scratch,
        make_optimizer(scratch, args.micro, args.micro, args.lr),
        x[: args.micro],
        y[: args.micro],
        batch_size=args.micro,
        micro=args.micro,
        mbs=False,
        epochs=1,
        max_steps=1,
        seed=args.seed,
    )
    accuracy(scratch, xt, yt, chunk=args.micro)
    del scratch
    gc.collect()
    malloc_trim()

    base = proc_status()
    info: dict[str, Any] = {"size": size, "micro": args.micro, "base_vmsize": base.get("VmSize", 0)}
    if args.cap_bytes > 0:
        limit = base["VmSize"] + args.cap_bytes
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        info["cap_bytes"] = args.cap_bytes

    runs = [("mbs", True)] if args.mode == "calibrate" else [("mbs", True), ("full", False)]
    for name, mbs in runs:
        model.load_state_dict(init_state)
        opt = make_optimizer(model, size, args.micro, args.lr)
        rec = dict(info, run=name)
        try:
            times = _train(
                model,
                opt,
                x,
                y,
                batch_size=size,
                micro=args.micro,
                mbs=mbs,
                epochs=args.epochs,
                max_steps=args.max_steps,
                seed=args.seed,
            )
            rec["accuracy"] = accuracy(model, xt, yt, chunk=args.micro)
            rec["epoch_s"] = sum(times) / len(times)
            rec["ok"] = True
        except Exception as exc:  # noqa: BLE001 - classified below, anything else re-raised
            if not is_out_of_memory(exc):
                raise
            rec["ok"] = False
            rec["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        del opt
        gc.collect()
        malloc_trim()
        status = proc_status()
        # VmPeak is the process's lifetime peak: the full run's value also covers the MBS run before it.
        rec["peak_growth"] = status.get("VmPeak", 0) - base.get("VmSize", 0)
        rec["rss_hwm_growth"] = status.get("VmHWM", 0) - base.get("VmRSS", 0)
        _emit(rec)
    return 0


def _sweep_step(model, opt, x, y, idx, *, micro: int, mbs: bool) -> None:
    """One training step over the rows ``idx`` of ``(x, y)``: streamed (the rows gathered
    micro-batch by micro-batch through ``indices=``) or the plain full-batch step on ``x[idx]``."""
    from torch import nn

    import mbs_ext

    loss_fn = nn.CrossEntropyLoss()
    if mbs:
        mbs_ext.step(model, opt, (x, y), loss_fn, micro_batch_size=micro, indices=idx)
        return
    xb, yb = x[idx], y[idx]  # what a full batch needs: all its rows at once
    opt.zero_grad()
    loss = loss_fn(model(xb), yb)
    loss.backward()
    opt.step()
    del loss, xb, yb


def _sweep_child(args: argparse.Namespace) -> int:
    """Steps of ``--sweep-model`` at each mini-batch size of ``--steps-at`` (ascending), all
    ``--sweep-run`` (mbs or full), under the cap; stops at the first that fails.

    A mini-batch of B rows is B indices drawn with replacement from the training set (so B
    may exceed it; one seeded draw, each size its first B): the host holds the data set and
    the indices, nothing mini-batch sized, unless the step gathers it (the full batch does).
    Warm-up is on the model itself (one step of each kind), so that every measured step, the
    first included, finds the step's caches made; and before each size a step of its shapes
    (see below). Every step starts from the initial weights with a fresh optimizer, under
    ``RLIMIT_AS`` set anew to the process's size just before it plus the cap (each new tensor
    shape leaves oneDNN kernels behind, about 3 MiB of address space each: a cap set once
    would shrink from step to step). Each size reports its measured step's peak resident
    growth (``VmHWM`` after ``5`` into ``/proc/self/clear_refs`` just before the step, minus
    ``VmRSS`` then), seconds and samples/s; or, failed, the error and the peak until then.
    """
    import copy
    import gc
    import resource
    import warnings

    import torch

    import mbs_ext
    from mbs_ext.diagnostics import is_out_of_memory

    warnings.filterwarnings("ignore", category=mbs_ext.BatchNormWarning)  # bn_cnn: split statistics, known
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    x, y, _, _ = load_digits(args.image_size, args.seed)
    model = SWEEP_MODELS[args.sweep_model](args.image_size)
    init_state = copy.deepcopy(model.state_dict())
    sizes = [int(s) for s in args.steps_at.split(",")]
    gen = torch.Generator().manual_seed(args.seed)
    idx = torch.randint(len(y), (max(sizes + [2 * args.micro]),), generator=gen)
    mbs = args.sweep_run == "mbs"

    for warm_mbs, rows in ((True, 2 * args.micro), (False, args.micro)):
        _sweep_step(model, make_optimizer(model, rows, args.micro, args.lr), x, y, idx[:rows],
                    micro=args.micro, mbs=warm_mbs)
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]  # only the soft limit moves: it may go back up
    before: dict[str, int] = {}

    def attempt(rows: int) -> float:
        """One step over the first ``rows`` indices from the initial weights, under the cap; its seconds."""
        model.load_state_dict(init_state)
        opt = make_optimizer(model, rows, args.micro, args.lr)
        resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
        gc.collect()
        malloc_trim()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        before.update(proc_status())
        if args.cap_bytes > 0:
            resource.setrlimit(resource.RLIMIT_AS, (before["VmSize"] + args.cap_bytes, hard))
        t0 = time.perf_counter()
        _sweep_step(model, opt, x, y, idx[:rows], micro=args.micro, mbs=mbs)
        return time.perf_counter() - t0

    for size in sizes:
        rec: dict[str, Any] = {
            "model": args.sweep_model, "run": args.sweep_run, "size": size, "micro": args.micro,
            "cap_bytes": args.cap_bytes,
        }
        # A new shape's first call compiles its oneDNN kernels: a step of that shape first (the
        # full batch; for MBS only its last, partial micro-batch is new), under the cap too.
        shape_rows = size if not mbs else (args.micro + size % args.micro if size % args.micro else 0)
        try:
            if shape_rows:
                attempt(shape_rows)
            seconds = attempt(size)
            rec.update(ok=True, seconds=seconds, samples_per_s=size / seconds)
        except Exception as exc:  # noqa: BLE001 - classified below, anything else re-raised
            # Under the cap oneDNN reports a failed mapping for a new kernel this way.
            if not (is_out_of_memory(exc) or (args.cap_bytes and "could not create a primitive" in str(exc))):
                raise
            rec.update(ok=False, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        rec["peak_rss"] = proc_status().get("VmHWM", 0) - before.get("VmRSS", 0)
        _emit(rec)
        if not rec["ok"]:
            break  # a step after a failed one would measure the failure's leftovers
    return 0


def run_sweep_child(
    model: str,
    run: str,
    sizes: list[int],
    *,
    micro: int = 16,
    cap_bytes: int = 0,
    threads: int = 1,
    seed: int = 0,
    lr: float = 1e-3,
    image_size: int = 32,
    timeout: float = 900.0,
) -> dict[str, Any]:
    """One sweep child: steps of ``model`` (a :data:`SWEEP_MODELS` key), ``run`` "mbs" or "full",
    at ``sizes`` in ascending order until the first that fails.

    Returns ``{"records": [rec, ...], "returncode": rc, "stderr": tail}``; a child that died
    (e.g. a native abort on allocation) adds a failed record for the size it was at.
    """
    sizes = sorted(set(sizes))
    cmd = [
        sys.executable, "-m", "mbs_ext.apps.table", "--child", "sweep",
        "--sweep-model", model, "--sweep-run", run, "--steps-at", ",".join(map(str, sizes)),
        "--micro", str(micro), "--cap-bytes", str(int(cap_bytes)), "--threads", str(threads),
        "--seed", str(seed), "--lr", repr(lr), "--image-size", str(image_size),
    ]
    # One malloc arena: a second one reserves 64 MiB of address space up front, and a thread
    # allocating from it grows into that reservation unseen by RLIMIT_AS (measured: a BatchNorm
    # full batch of 128 rows took 60 MiB under a 29 MiB cap with two arenas, failing at 91 with one).
    env = dict(child_env(threads), MALLOC_ARENA_MAX="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    recs = [json.loads(line[len(RESULT_TAG):]) for line in proc.stdout.splitlines() if line.startswith(RESULT_TAG)]
    if proc.returncode != 0 and len(recs) < len(sizes) and all(r["ok"] for r in recs):
        recs.append({"model": model, "run": run, "size": sizes[len(recs)], "micro": micro, "ok": False,
                     "error": f"child exited with {proc.returncode}", "cap_bytes": cap_bytes})
    return {"records": recs, "returncode": proc.returncode, "stderr": proc.stderr[-2000:]}


def run_child(
    mode: str,
    size: int,
    *,
    micro: int = 16,
    cap_bytes: int = 0,
    epochs: int = 1,
    max_steps: int = 0,
    threads: int = 1,
    seed: int = 0,
    lr: float = 1e-3,
    image_size: int = 32,
    timeout: float = 900.0,
) -> dict[str, Any]:
    """Run one child (``mode`` "calibrate" or "row"); ``size`` <= 0 means the whole training set.

    Returns ``{"mbs": rec, "full": rec, "returncode": rc, "stderr": tail}``; a run missing
    from a child that died (e.g. killed by a signal) is absent.
    """
    cmd = [
        sys.executable,
        "-m",
        "mbs_ext.apps.table",
        "--child",
        mode,
        "--size",
        str(size),
        "--micro",
        str(micro),
        "--cap-bytes",
        str(int(cap_bytes)),
        "--epochs",
        str(epochs),
        "--max-steps",
        str(max_steps),
        "--threads",
        str(threads),
        "--seed",
        str(seed),
        "--lr",
        repr(lr),
        "--image-size",
        str(image_size),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env(threads), timeout=timeout)
    out: dict[str, Any] = {"returncode": proc.returncode, "stderr": proc.stderr[-2000:]}
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            rec = json.loads(line[len(RESULT_TAG) :])
            out[rec["run"]] = rec
    return out


def calibrate(size: int, *, micro: int = 16, **kw: Any) -> dict[str, Any]:
    """Peak growth of the MBS run (bytes) and the resulting cap."""
    res = run_child("calibrate", size, micro=micro, **kw)
    rec = res.get("mbs")
    if rec is None or not rec.get("ok"):
        raise RuntimeError(f"calibration child failed (rc={res['returncode']}):\n{res['stderr']}")
    growth = max(rec["peak_growth"], 0)
    return {"growth": growth, "cap": int(growth * CAP_FACTOR + CAP_SLACK), "record": rec}


# --------------------------------------------------------------------------- sweep


def full_batch_sizes(micro: int, limit: int = 1 << 16) -> list[int]:
    """The full-batch search's sizes: ``micro * 2**(k/4)`` up to ``limit``, about 19% apart."""
    sizes, k = [], 0
    while (size := round(micro * 2 ** (k / 4))) <= limit:
        sizes.append(size)
        k += 1
    return sorted(set(sizes))


def sweep(
    multiples: list[int],
    *,
    cap: int,
    micro: int = 16,
    jobs: int = 2,
    models: tuple[str, ...] = tuple(SWEEP_MODELS),
    search_limit: int = 1 << 16,
    timeout: float = 300.0,
    log: Any = print,
    **common: Any,
) -> dict[str, Any]:
    """Peak memory and throughput of one step against the mini-batch size, per model.

    First the largest full batch F that trains under the cap (one child per model: full-batch
    steps at :func:`full_batch_sizes`, ascending until the first failure); then one MBS child
    per model: one step at each ``multiple * F``. The full batch is not run past its first
    failure. ``common``: ``threads``, ``seed``, ``lr``, ``image_size`` (as :func:`run_sweep_child`).
    """
    multiples = sorted(set(multiples))

    def search(model: str) -> dict[str, Any]:
        res = run_sweep_child(model, "full", full_batch_sizes(micro, search_limit), micro=micro, cap_bytes=cap,
                              timeout=timeout, **common)
        recs = res["records"]
        ok = [r["size"] for r in recs if r["ok"]]
        failed = next((r for r in recs if not r["ok"]), None)
        out = {"full": recs, "full_batch": max(ok) if ok else None, "failed_at": failed and failed["size"]}
        if res["returncode"] != 0:
            out.update(child_returncode=res["returncode"], child_stderr=res["stderr"])
        log(f"  {model}: full batch trains up to F = {out['full_batch']}"
            + (f", fails at {failed['size']} ({_short_error(failed)})" if failed else ""), flush=True)
        return out

    def streamed(model: str) -> list[dict[str, Any]]:
        base = found[model]["full_batch"] or micro
        sizes = [m * base for m in multiples]
        res = run_sweep_child(model, "mbs", sizes, micro=micro, cap_bytes=cap,
                              timeout=timeout + sum(sizes) / 100, **common)
        for rec in res["records"]:
            rec["multiple"] = rec["size"] // base
            log(f"  {model}: MBS at {rec['multiple']:4d} x F = {rec['size']:7d}: "
                + (f"peak {rec['peak_rss'] / MIB:5.1f} MiB, {rec['samples_per_s']:6.0f} samples/s" if rec["ok"]
                   else f"FAILED ({_short_error(rec)})"), flush=True)
        if res["returncode"] != 0:
            found[model].update(mbs_returncode=res["returncode"], mbs_stderr=res["stderr"])
        return res["records"]

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        found = dict(zip(models, pool.map(search, models)))
        for model, recs in zip(models, pool.map(streamed, models)):
            found[model]["mbs"] = recs
    return {"micro": micro, "cap_bytes": cap, "multiples": multiples, "models": found}


def _short_error(rec: dict) -> str:
    """A failed record's error without the allocator's preamble ("[enforce fail at ...] ... DefaultCPUAllocator: ")."""
    return rec.get("error", "").rpartition("DefaultCPUAllocator: ")[2][:120]


def _peak(rec: dict | None) -> str:
    if rec is None:
        return "-"
    return f"{rec['peak_rss'] / MIB:.1f}" if rec.get("ok") else "Failed"


def _rate(rec: dict | None) -> str:
    if rec is None:
        return "-"
    return f"{rec['samples_per_s']:.0f}" if rec.get("ok") else "Failed"


def _full_at(res: dict[str, Any], size: int) -> dict | None:
    """The full-batch record at ``size``: measured, or a failure at a smaller size (not run
    again), or None (not run)."""
    rec = next((r for r in res["full"] if r["size"] == size), None)
    if rec is None and res.get("failed_at") is not None and size >= res["failed_at"]:
        return {"ok": False, "size": size, "not_run": True}
    return rec


def format_sweep(result: dict[str, Any]) -> str:
    """The sweep as a markdown table: one line per model and multiple of its F."""
    lines = [
        "| Model | x F | Mini-batch | Peak w/o MBS (MiB) | Samples/s w/o MBS | Peak w/ MBS (MiB) | Samples/s w/ MBS |",
        "|:--|---:|---:|---:|---:|---:|---:|",
    ]
    for model, res in result["models"].items():
        for rec in res.get("mbs", []):
            full = _full_at(res, rec["size"])
            lines.append(
                f"| {model} | {rec['multiple']} | {rec['size']} | {_peak(full)} | {_rate(full)} | "
                f"{_peak(rec)} | {_rate(rec)} |"
            )
    return "\n".join(lines)


def _sweep_md(result: dict[str, Any], n_train: int | None) -> list[str]:
    cap_mib = result["cap_bytes"] / MIB
    md = [
        "## Peak memory against mini-batch size",
        "",
        f"One training step at each mini-batch size, micro-batch {result['micro']}, each under the same cap as the "
        f"table (RLIMIT_AS: the process's size just before the step + {cap_mib:.1f} MiB). A mini-batch is row "
        f"indices drawn with replacement from the {n_train or 'training'} training images (a seeded "
        "`torch.randint`), so it may be far larger than the data set: the host holds only the data set and the "
        "indices. MBS takes them as `indices=` and gathers each micro-batch as it streams; the full batch "
        "gathers all its rows (`x[indices]`), as a full batch must. Peak: the step's resident-set growth "
        "(VmHWM after `5` into /proc/self/clear_refs just before the step, minus VmRSS then). F: the largest "
        "full batch that trained (full-batch steps at 16 x 2^(k/4), ascending until the first failure). "
        "bn_cnn: the small CNN with BatchNorm2d after each convolution, deferred by the step.",
        "",
        format_sweep(result),
        "",
    ]
    for model, res in result["models"].items():
        pts = ", ".join(
            f"{r['size']}: {r['peak_rss'] / MIB:.1f} MiB" if r["ok"] else f"{r['size']}: Failed ({_short_error(r)})"
            for r in res["full"]
        )
        md.append(f"- {model}, full batch: F = {res['full_batch']}; {pts}")
    return [*md, ""]


def _plot_sweep(result: dict[str, Any], path: Path) -> None:
    from mbs_ext.diagnostics import pyplot

    plt = pyplot()
    fig, (ax_mem, ax_rate) = plt.subplots(1, 2, figsize=(12, 4.6))
    failed_label = "without MBS: Failed"
    for i, (model, res) in enumerate(result["models"].items()):
        color = f"C{i}"
        full_ok = [r for r in res["full"] if r["ok"]]
        mbs_ok = [r for r in res.get("mbs", []) if r["ok"]]
        for ax, key, scale in ((ax_mem, "peak_rss", 1 / MIB), (ax_rate, "samples_per_s", 1.0)):
            if full_ok:
                ax.plot([r["size"] for r in full_ok], [r[key] * scale for r in full_ok], "o-", color=color,
                        markersize=3, label=f"{model}: without MBS (full batch)")
            if mbs_ok:
                ax.plot([r["size"] for r in mbs_ok], [r[key] * scale for r in mbs_ok], "s--", color=color,
                        label=f"{model}: with MBS (micro-batch {result['micro']})")
        fail = next((r for r in res["full"] if not r["ok"]), None)
        if fail is not None:
            y = fail.get("peak_rss", 0) / MIB
            if full_ok:
                ax_mem.plot([full_ok[-1]["size"], fail["size"]], [full_ok[-1]["peak_rss"] / MIB, y], ":", color=color)
            ax_mem.scatter([fail["size"]], [y], marker="x", color="red", s=90, zorder=5, label=failed_label)
            ax_rate.axvline(fail["size"], color=color, linestyle=":", alpha=0.6)
            failed_label = None
        for r in mbs_ok:
            ax_mem.annotate(f"{r['multiple']}x", (r["size"], r["peak_rss"] / MIB), textcoords="offset points",
                            xytext=(0, 7 if i % 2 else -13), ha="center", fontsize=7, color=color)
    ax_mem.set_ylim(bottom=0)
    ax_rate.set_ylim(bottom=0)
    for ax, ylabel in ((ax_mem, "peak memory of one step (MiB, resident growth)"), (ax_rate, "samples/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("mini-batch size (rows drawn with replacement)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    ax_rate.set_title("throughput (dotted: where the full batch failed)", fontsize=9)
    ax_mem.set_title("peak memory (red x: the full batch failed)", fontsize=9)
    fig.suptitle(
        f"One step under a {result['cap_bytes'] / MIB:.1f} MiB cap (RLIMIT_AS), 1x to "
        f"{max(result['multiples'])}x the largest full batch F (digits, CPU)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _multiples(text: str) -> list[int] | None:
    """An argparse type: 'none' (no sweep), 'auto' (None: the device's default) or comma-separated integers >= 1."""
    if text.strip().lower() == "none":
        return []
    if text.strip().lower() == "auto":
        return None
    tokens = [tok.strip() for tok in text.split(",") if tok.strip()]
    if not tokens or not all(tok.isdigit() and int(tok) >= 1 for tok in tokens):
        raise argparse.ArgumentTypeError(f"must be 'none', 'auto' or comma-separated integers >= 1, got {text!r}")
    return sorted({int(tok) for tok in tokens})


def sweep_multiples(parsed: list[int] | None, device: str) -> list[int]:
    """--sweep as parsed, with 'auto' (None) made the device's own default."""
    if parsed is not None:
        return parsed
    return _multiples(GPU_SWEEP if device == "cuda" else DEFAULT_SWEEP)


# --------------------------------------------------------------------------- table


def _fmt_acc(rec: dict | None) -> str:
    if not rec or not rec.get("ok"):
        return "Failed"
    return f"{100 * rec['accuracy']:.2f}%"


def _fmt_time(rec: dict | None) -> str:
    if not rec or not rec.get("ok"):
        return "Failed"
    return f"{rec['epoch_s']:.2f}"


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| Mini-batch | Micro-batch | Accuracy w/o MBS | Epoch time w/o MBS (s) "
        "| Accuracy w/ MBS | Epoch time w/ MBS (s) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['size']} | {r['micro']} | {_fmt_acc(r.get('full'))} | {_fmt_time(r.get('full'))} | "
            f"{_fmt_acc(r.get('mbs'))} | {_fmt_time(r.get('mbs'))} |"
        )
    return "\n".join(lines)


def write_table(
    rows: list[dict[str, Any]], out_dir: str | os.PathLike, meta: dict[str, Any], sweep: dict[str, Any] | None = None
) -> dict[str, Path]:
    """Write ``table.md``, ``table.json`` and ``table.png`` (and with a :func:`sweep` result
    its section, its ``"sweep"`` key and ``sweep.png``); returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = format_table(rows)
    cap_mib = meta.get("cap_bytes", 0) / MIB
    md = [
        "# MBS on a CPU: full-batch training vs micro-batch streaming under a memory cap",
        "",
        f"Digits (upsampled to {meta.get('image_size', 32)}x{meta.get('image_size', 32)}), small CNN, "
        f"{meta.get('epochs')} epoch(s), {meta.get('n_train')} training / {meta.get('n_test')} test images. "
        f"Each row ran in a child process capped (RLIMIT_AS) at its post-warm-up size + {cap_mib:.1f} MiB "
        f"(= {CAP_FACTOR} x the MBS peak growth of {meta.get('growth_bytes', 0) / MIB:.1f} MiB + "
        f'{CAP_SLACK / MIB:.0f} MiB). "Failed": the full-batch step hit an allocation error.',
        "",
        table,
        "",
    ]
    paths = {"md": out / "table.md", "json": out / "table.json", "png": out / "table.png"}
    data: dict[str, Any] = {"meta": meta, "rows": rows}
    if sweep:
        md += _sweep_md(sweep, meta.get("n_train"))
        data["sweep"] = sweep
        paths["sweep_png"] = out / "sweep.png"
        _plot_sweep(sweep, paths["sweep_png"])
    paths["md"].write_text("\n".join(md))
    paths["json"].write_text(json.dumps(data, indent=2))
    _plot(rows, paths["png"])
    return paths


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    from mbs_ext.diagnostics import pyplot

    plt = pyplot()

    sizes = [r["size"] for r in rows]
    fig, (ax_acc, ax_t) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, label, style in (("full", "without MBS", "o-"), ("mbs", "with MBS", "s--")):
        ok = [(r["size"], r[key]) for r in rows if r.get(key) and r[key].get("ok")]
        if ok:
            ax_acc.plot([s for s, _ in ok], [100 * rec["accuracy"] for _, rec in ok], style, label=label)
            ax_t.plot([s for s, _ in ok], [rec["epoch_s"] for _, rec in ok], style, label=label)
    failed = [r["size"] for r in rows if not (r.get("full") and r["full"].get("ok"))]
    if failed:
        for ax in (ax_acc, ax_t):
            lo = ax.get_ylim()[0] if ax.has_data() else 0.0
            ax.scatter(
                failed,
                [lo] * len(failed),
                marker="x",
                color="red",
                s=70,
                zorder=5,
                label="without MBS: Failed",
                clip_on=False,
            )
    for ax, ylabel in ((ax_acc, "test accuracy (%)"), (ax_t, "epoch time (s)")):
        if len(set(sizes)) > 1:
            ax.set_xscale("log", base=2)
        ax.set_xlabel("mini-batch size")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Full batch vs MBS under a memory cap (digits, small CNN, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _parse_sizes(text: str, n_train: int) -> list[int]:
    sizes = []
    for tok in text.split(","):
        tok = tok.strip().lower()
        if not tok:
            continue
        sizes.append(n_train if tok in ("all", "full") else min(int(tok), n_train))
    return sorted(dict.fromkeys(sizes))


def _sizes(text: str) -> str:
    """An argparse type: comma-separated integers >= 1 or 'all'/'full'; kept as text (see _parse_sizes)."""
    tokens = [tok.strip().lower() for tok in text.split(",") if tok.strip()]
    bad = [tok for tok in tokens if tok not in ("all", "full") and not (tok.isdigit() and int(tok) >= 1)]
    if not tokens or bad:
        raise argparse.ArgumentTypeError(
            f"must be comma-separated sizes, each an integer >= 1 or 'all', got {text!r}"
        )
    return text


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog=f"Then the peak memory and throughput of one step against the mini-batch size (sweep.png): "
        f"--sweep MULTIPLES of the largest full batch that trains under the cap, comma-separated "
        f"(default: {DEFAULT_SWEEP}; 'none' skips it; 1,4,16,64,256,1024 reaches 1,024x in about "
        f"7 more minutes on two cores), for the small CNN and the same with BatchNorm.",
    )
    p.add_argument(
        "--out", default="mbs_table", help="output directory (default: %(default)s; mbs_table_gpu with --device cuda)"
    )
    p.add_argument("--epochs", type=argtypes.int_at_least(1), default=3, help="epochs per run")
    p.add_argument("--micro-batch", type=argtypes.int_at_least(1), default=16, help="MBS micro-batch size")
    p.add_argument(
        "--sizes",
        type=_sizes,
        default=DEFAULT_SIZES,
        help="comma-separated mini-batch sizes, 'all' = the whole training set",
    )
    p.add_argument("--jobs", type=argtypes.int_at_least(0), default=0, help="children run at once, 0 = min(2, CPUs)")
    p.add_argument(
        "--max-steps", type=argtypes.int_at_least(0), default=0,
        help="cap on steps per epoch for quick runs, 0 = none",
    )
    p.add_argument("--seed", type=argtypes.seed, default=0, help="seed for the weights, split and order")
    p.add_argument("--lr", type=argtypes.positive, default=1e-3, help="Adam base lr, scaled by sqrt(B/micro)")
    p.add_argument(
        "--image-size", type=argtypes.auto_or_int_at_least(4), default="auto",
        help="image side in pixels (>= 4: the CNN halves it twice); auto: 32 on cpu, 224 on cuda",
    )
    p.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu",
        help="cpu: the miniature under an OS memory cap; cuda: ResNet-type models under a CUDA cap",
    )
    p.add_argument("--model", default="resnet50", help="--device cuda: a torchvision model name")
    p.add_argument("--cap-gib", type=argtypes.positive, default=4.0, help="--device cuda: per-process CUDA memory cap")
    p.add_argument("--rounds", type=argtypes.int_at_least(1), default=3, help="--device cuda: rounds (medians)")
    p.add_argument("--steps", type=argtypes.int_at_least(1), default=3, help="--device cuda: timed steps per run")
    p.add_argument("--full-batch", type=argtypes.int_at_least(0), default=0,
                   help="--device cuda: the largest full batch under the cap when known (0: search for it)")
    p.add_argument("--child-timeout", type=argtypes.positive, default=300, help=argparse.SUPPRESS)
    # Listed in the epilog (the options' list is pinned by tests/test_cli.py).
    p.add_argument("--sweep", type=_multiples, default="auto",
                   help=f"multiples of the largest full batch for the memory sweep (e.g. 1,4,16,64,256,1024), "
                        f"none, or auto: {DEFAULT_SWEEP} on cpu, {GPU_SWEEP} on cuda")
    # Child-process options (internal).
    p.add_argument("--child", choices=("calibrate", "row", "sweep"), help=argparse.SUPPRESS)
    p.add_argument("--sweep-model", choices=tuple(SWEEP_MODELS), default="cnn", help=argparse.SUPPRESS)
    p.add_argument("--sweep-run", choices=("mbs", "full"), default="mbs", help=argparse.SUPPRESS)
    p.add_argument("--steps-at", default="16", help=argparse.SUPPRESS)
    p.add_argument("--size", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--micro", type=argtypes.int_at_least(1), default=16, help=argparse.SUPPRESS)
    p.add_argument("--cap-bytes", type=argtypes.int_at_least(0), default=0, help=argparse.SUPPRESS)
    p.add_argument("--threads", type=argtypes.int_at_least(1), default=1, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.device == "cuda" and args.out == "mbs_table":
        args.out = "mbs_table_gpu"
    if args.child is None:
        argtypes.check_output_dir(parser, args.out)
    if args.device == "cuda":
        from mbs_ext.apps import table_gpu

        args.image_size = 224 if args.image_size == "auto" else args.image_size
        args.sweep = sweep_multiples(args.sweep, args.device)
        return table_gpu.main(args)
    args.image_size = 32 if args.image_size == "auto" else args.image_size
    args.sweep = sweep_multiples(args.sweep, args.device)
    if args.child:
        args.mode = args.child
        return _sweep_child(args) if args.child == "sweep" else _child(args)
    missing = argtypes.missing({"sklearn": "scikit-learn", "matplotlib": "matplotlib"})
    if missing:
        raise SystemExit(
            f"{PROG} needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not installed: "
            f"pip install 'mbs_ext[demo]' (or: pip install {' '.join(missing)})"
        )

    from sklearn.datasets import load_digits as sk_digits

    n_total = len(sk_digits().target)
    n_test = int(math.ceil(n_total * 0.2))
    n_train = n_total - n_test
    sizes = _parse_sizes(args.sizes, n_train)
    cpus = os.cpu_count() or 1
    jobs = args.jobs if args.jobs > 0 else max(1, min(2, cpus))
    threads = max(1, cpus // jobs)
    common = dict(
        micro=args.micro_batch, threads=threads, seed=args.seed, lr=args.lr, image_size=args.image_size
    )

    t0 = time.perf_counter()
    cal = calibrate(max(sizes), max_steps=2, epochs=1, **common)
    print(
        f"calibration: MBS peak growth {cal['growth'] / MIB:.1f} MiB at micro-batch {args.micro_batch} "
        f"-> cap {cal['cap'] / MIB:.1f} MiB above each child's warm size",
        flush=True,
    )

    def row(size: int) -> dict[str, Any]:
        res = run_child(
            "row", size, cap_bytes=cal["cap"], epochs=args.epochs, max_steps=args.max_steps, **common
        )
        r: dict[str, Any] = {
            "size": size,
            "micro": args.micro_batch,
            "mbs": res.get("mbs"),
            "full": res.get("full"),
        }
        if res["returncode"] != 0:
            r["child_returncode"] = res["returncode"]
            r["child_stderr"] = res["stderr"]
            if r["full"] is None and r["mbs"] is not None and r["mbs"].get("ok"):
                # The child died inside the capped full-batch run (e.g. a native abort on allocation).
                r["full"] = {"ok": False, "error": f"child exited with {res['returncode']}"}
        status = "ok" if r["full"] and r["full"].get("ok") else "Failed"
        print(
            f"  B={size:5d}: without MBS {status}; with MBS "
            f"{'ok' if r['mbs'] and r['mbs'].get('ok') else 'FAILED'}",
            flush=True,
        )
        return r

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        rows = list(pool.map(row, sizes))

    meta = {
        "epochs": args.epochs,
        "micro_batch": args.micro_batch,
        "max_steps": args.max_steps,
        "seed": args.seed,
        "lr": args.lr,
        "image_size": args.image_size,
        "n_train": n_train,
        "n_test": n_test,
        "growth_bytes": cal["growth"],
        "cap_bytes": cal["cap"],
        "cap_factor": CAP_FACTOR,
        "cap_slack": CAP_SLACK,
        "threads_per_child": threads,
        "jobs": jobs,
    }
    print(format_table(rows), flush=True)
    swept = None
    if args.sweep:
        print(
            f"sweep: one step at {', '.join(f'{m}x' for m in args.sweep)} the largest full batch F under the same "
            f"cap; mini-batches are row indices drawn with replacement (indices=), so the host holds only the "
            f"data set and the indices",
            flush=True,
        )
        swept = sweep(args.sweep, cap=cal["cap"], jobs=jobs, timeout=args.child_timeout, **common)
        print(format_sweep(swept))
        meta["sweep_multiples"] = args.sweep
    meta["wall_s"] = round(time.perf_counter() - t0, 2)
    paths = write_table(rows, args.out, meta, swept)
    print(f"wrote {paths['md']}, {', '.join(str(paths[k]) for k in ('png', 'sweep_png') if k in paths)} "
          f"({meta['wall_s']} s)")
    bad = [r["size"] for r in rows if not (r.get("mbs") and r["mbs"].get("ok"))]
    if bad:
        print(f"warning: MBS failed at mini-batch sizes {bad}", file=sys.stderr)
    bad = [f"{model} at {r['size']}" for model, res in (swept or {}).get("models", {}).items()
           for r in res.get("mbs", []) if not r["ok"]]
    if bad:
        print(f"warning: MBS failed in the sweep: {', '.join(bad)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
