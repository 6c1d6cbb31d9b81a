"""The papers' Table 4 on a GPU: ResNet-50 under a per-process memory cap, full batch vs MBS.

``python -m mbs_ext table --device cuda --model resnet50 --cap-gib 4``

Every measurement runs in a fresh child process whose CUDA memory is capped with
``torch.cuda.set_per_process_memory_fraction``, so an out-of-memory error in one cannot
fragment the next. First the largest full batch that trains under the cap is found
(doubling, then bisection); then full-batch throughput at that limit and mbs_ext
throughput at mini-batches ``--sweep`` times that limit (default 16x, 64x and 91x;
``micro_batch_size="auto"``, the default budget: the room under the cap) are measured,
interleaved over ``--rounds`` rounds; medians are reported, with each run's peak of
``torch.cuda.max_memory_allocated``: the headline is that this peak stays where it is as the
multiple grows. Synthetic ImageNet-shaped data: this table is about memory and speed; the CPU
table (``python -m mbs_ext table``) covers accuracy. The host batch of an MBS run is pinned
and filled by repeating a random block of :data:`BLOCK` rows, so that a 1,024x batch (46,000
images, 28 GB) is ready in seconds rather than drawn row by row.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from mbs_ext.diagnostics import child_env

BLOCK = 256  # rows of random data an MBS run's host batch repeats
TAG = "MBS_TABLE_GPU "
PROG = "python -m mbs_ext table --device cuda"  # cli.PROG's GPU table


def _child(cfg: dict[str, Any]) -> dict[str, Any]:
    """One capped run: a warm-up step, then ``steps`` timed steps; or {"oom": True}."""
    import torch
    import torchvision
    from torch import nn

    import mbs_ext

    device = torch.device("cuda", torch.cuda.current_device())  # the cap wants an index
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cfg["cap_bytes"] / total), device)
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    model = getattr(torchvision.models, cfg["model"])(num_classes=1000).to(device, memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ce = nn.CrossEntropyLoss()
    B, size = cfg["batch"], cfg["image_size"]
    y = torch.randint(0, 1000, (B,))
    micro = micro_batches = None
    try:
        if cfg["mode"] == "full":
            xd = torch.randn(B, 3, size, size, device=device).contiguous(memory_format=torch.channels_last)
            yd = y.to(device)

            def one() -> None:
                opt.zero_grad(set_to_none=True)
                ce(model(xd), yd).backward()
                opt.step()
        else:
            x = torch.empty(B, 3, size, size, pin_memory=True, memory_format=torch.channels_last)
            block = torch.randn(min(B, BLOCK), 3, size, size)
            for start in range(0, B, len(block)):
                x[start : start + len(block)] = block[: B - start]
            pinned = (x, y.pin_memory())
            streamer = mbs_ext.MicroBatchStreamer(model, opt, ce, micro_batch_size="auto")

            def one() -> None:
                nonlocal micro, micro_batches
                r = streamer.step(pinned)
                micro, micro_batches = r.micro_batch_size, r.num_micro_batches
        one()
        times = []
        for _ in range(cfg["steps"]):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            one()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    except torch.OutOfMemoryError:
        return {"oom": True}
    return {"oom": False, "samples_per_s": B / statistics.median(times), "micro_batch": micro,
            "micro_batches": micro_batches, "peak_bytes": torch.cuda.max_memory_allocated(device)}


def _run(cfg: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "mbs_ext.apps.table_gpu", json.dumps(cfg)],
        capture_output=True, text=True, env=child_env(threads=4), timeout=timeout_s,
    )
    for line in proc.stdout.splitlines():
        if line.startswith(TAG):
            return json.loads(line[len(TAG):])
    if "OutOfMemoryError" in proc.stderr or "out of memory" in proc.stderr:
        return {"oom": True}
    raise RuntimeError(f"table child {cfg} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")


def largest_full_batch(base: dict[str, Any], timeout_s: float) -> int:
    """Doubling, then bisection, on capped full-batch runs; 0 when not even one row fits."""
    def fits(b: int) -> bool:
        ok = not _run({**base, "mode": "full", "batch": b, "steps": 1}, timeout_s)["oom"]
        print(f"  full batch {b:5d}: {'fits' if ok else 'out of memory'}", flush=True)
        return ok

    lo, hi = 0, 8
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > max(1, lo // 32):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _say(variant: str, rows: int, run: dict[str, Any]) -> None:
    """One run's line as it ends, so that a run cut off by a time limit still shows what it measured."""
    what = "out of memory" if run["oom"] else (
        f"{run['samples_per_s']:.1f} samples/s, peak {run['peak_bytes'] / 2**20:.1f} MiB, "
        f"micro-batch {run['micro_batch']} x {run['micro_batches']}")
    print(f"  {variant} ({rows} rows): {what}", flush=True)


def main(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        print(f"{PROG}: torch sees no CUDA device", file=sys.stderr)
        return 2
    missing = [name for name in ("torchvision", "matplotlib") if importlib.util.find_spec(name) is None]
    if missing:
        print(f"{PROG} needs {', '.join(missing)}: pip install {' '.join(missing)}", file=sys.stderr)
        return 2
    base = {"model": args.model, "cap_bytes": int(args.cap_gib * 2**30), "image_size": args.image_size}
    t0 = time.perf_counter()
    # The search runs a dozen capped children (about 20 s each for ResNet-50 on an H100): a
    # limit found before can be handed in with --full-batch.
    limit = args.full_batch or largest_full_batch(base, args.child_timeout)
    if limit == 0:
        print("not even one row trains under the cap", file=sys.stderr)
        return 1
    multiples = list(args.sweep)
    runs: dict[str, list[dict]] = {"full": []} | {f"mbs_{k}x": [] for k in multiples}
    for _ in range(args.rounds):  # interleaved: the machine's drift hits every variant alike
        runs["full"].append(_run({**base, "mode": "full", "batch": limit, "steps": args.steps}, args.child_timeout))
        _say("full batch", limit, runs["full"][-1])
        for k in multiples:
            cfg = {**base, "mode": "mbs", "batch": k * limit, "steps": args.steps}
            runs[f"mbs_{k}x"].append(_run(cfg, args.child_timeout))
            _say(f"MBS {k}x", k * limit, runs[f"mbs_{k}x"][-1])
    full_ok = [r for r in runs["full"] if not r["oom"]]
    if not full_ok:  # the limit found by bisection stopped fitting: nothing to compare against
        print(f"the full batch of {limit} rows ran out of memory in every round", file=sys.stderr)
        return 1
    full = statistics.median(r["samples_per_s"] for r in full_ok)
    mib = lambda rs: round(max(r["peak_bytes"] for r in rs) / 2**20, 1)  # noqa: E731
    rows = [{"variant": "full batch", "mini_batch": limit, "micro_batch": limit, "micro_batches": 1,
             "peak_mib": mib(full_ok), "samples_per_s": round(full, 1), "vs_full": 1.0}]
    for k in multiples:
        ok = [r for r in runs[f"mbs_{k}x"] if not r["oom"]]
        sps = statistics.median(r["samples_per_s"] for r in ok) if ok else 0.0
        rows.append({"variant": f"MBS {k}x", "mini_batch": k * limit,
                     "micro_batch": ok[0]["micro_batch"] if ok else "out of memory",
                     "micro_batches": ok[0]["micro_batches"] if ok else None,
                     "peak_mib": mib(ok) if ok else None,
                     "samples_per_s": round(sps, 1), "vs_full": round(sps / full, 3)})
    _write(Path(args.out), rows, {**base, "rounds": args.rounds, "steps": args.steps,
                                  "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                  "wall_s": round(time.perf_counter() - t0, 1), "runs": runs})
    return 0


def _write(out: Path, rows: list[dict], meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "table_gpu.json").write_text(json.dumps({"rows": rows, **meta}, indent=2) + "\n")
    cols = list(rows[0])
    lines = [f"# Table 4 on {meta['gpu']}: {meta['model']} under a {meta['cap_bytes'] / 2**30:g} GiB cap", "",
             f"torch {meta['torch']}, medians of {meta['rounds']} interleaved rounds x {meta['steps']} steps; "
             f"peak_mib: the largest torch.cuda.max_memory_allocated of a run's process", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    (out / "table_gpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    from mbs_ext.diagnostics import pyplot

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([r["variant"] for r in rows], [r["samples_per_s"] for r in rows], color=["k"] + ["C0"] * (len(rows) - 1))
    ax.set(ylabel="samples / s", title=f"{meta['model']}, {meta['cap_bytes'] / 2**30:g} GiB cap")
    fig.tight_layout()
    fig.savefig(out / "table_gpu.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    print(TAG + json.dumps(_child(json.loads(sys.argv[1]))), flush=True)
