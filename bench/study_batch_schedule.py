"""Constant batch size vs a ramp vs the noise-scale autopilot, at the same number of samples.

Run: ``python bench/study_batch_schedule.py`` (``--help``). scikit-learn's digits (the demo's
data, 16 x 16 here), the demo's small CNN, Adam with the learning rate coupled to the size by
the square root (``scaled_lr(..., "sqrt")``, base ``--lr`` at 32 rows), micro-batches of 16 rows,
every run drawing its rows from a :class:`mbs_ext.SampleOrder` of the same seed. The schedules:

* ``constant 32``: 32 rows at every step (the sample-efficient end: the most steps);
* ``constant``: ``--batch`` rows at every step;
* ``ramp``: 32 rows up to ``--batch`` over the first 40% of the samples (multiples of 32);
* ``autopilot``: ``B <- clip(k * B_simple, 32, 2 * --batch)`` from the step's own noise scale
  (``noise_scale=True``), up only, with 25% hysteresis, acting on estimates whose standard error
  is within half of them (the autopilot's default).

Every run sees ``--epochs`` epochs of samples. Every ``--every`` samples the loss over the whole
training set is taken (model in eval mode, no gradient). Reported: the final loss of each, the
optimizer steps each needed to first reach each constant run's final loss (where it does), the
steps in all, and the wall time. Written as ``batch_schedule.{json,md,png}`` where
bench/_results.py says studies write (``MBS_BENCH_UPDATE=1``: bench/results/). The result is
what it is on this task: the study says where the autopilot does not save steps.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import results_dir, write  # noqa: E402

import mbs_ext  # noqa: E402
from mbs_ext.apps.data import load_digits, small_cnn  # noqa: E402

BASE = 32  # the size the base learning rate is for, and the smallest size any schedule uses
MICRO = 16  # rows per micro-batch: a step of BASE rows has two, enough for the noise scale


def _schedule(name: str, batch: int, samples: int, max_rel_stderr: float | None = 0.5):
    if name == "constant 32":
        return mbs_ext.Steps(((0, BASE),))
    if name == "constant":
        return mbs_ext.Steps(((0, batch),))
    if name == "ramp":
        return mbs_ext.Ramp(start=BASE, end=batch, over=int(0.4 * samples), multiple_of=BASE)
    return mbs_ext.Autopilot(minimum=BASE, maximum=2 * batch, k=1.0, hysteresis=0.25, multiple_of=BASE,
                             max_rel_stderr=max_rel_stderr)


@torch.no_grad()
def _train_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    loss = F.cross_entropy(model(x), y).item()
    model.train()
    return loss


def run(name: str, data: tuple, args: argparse.Namespace) -> dict:
    """One schedule over ``args.epochs`` epochs of samples: its loss curve, sizes and steps."""
    x, y = data
    samples = args.epochs * len(y)
    model = small_cnn(image_size=16, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    streamer = mbs_ext.MicroBatchStreamer(model, opt, torch.nn.CrossEntropyLoss(), micro_batch_size=MICRO,
                                          noise_scale=True)
    order = mbs_ext.SampleOrder(len(y), seed=args.seed)
    schedule = _schedule(name, args.batch, samples, args.max_rel_stderr)
    curve = [(0, 0, _train_loss(model, x, y))]  # (samples, steps, loss)
    sizes, b_simple, steps, t0, next_eval = [], [], 0, time.perf_counter(), args.every
    while order.samples_seen < samples:
        size = min(schedule.size(order.samples_seen, streamer.noise), samples - order.samples_seen)
        for group in opt.param_groups:
            group["lr"] = mbs_ext.scaled_lr(args.lr, BASE, size, "sqrt")
        streamer.step((x, y), indices=order.next(size))
        steps += 1
        sizes.append((order.samples_seen, size))
        b_simple.append((order.samples_seen, streamer.noise.b_simple))
        if order.samples_seen >= next_eval or order.samples_seen >= samples:
            curve.append((order.samples_seen, steps, _train_loss(model, x, y)))
            next_eval += args.every
    return {"name": name, "curve": curve, "sizes": sizes, "b_simple": b_simple, "steps": steps,
            "wall_s": time.perf_counter() - t0}


def _reach(result: dict, target: float) -> tuple[int | None, int | None]:
    """The steps and samples a run took to first reach ``target`` loss (None where it never does)."""
    return next(((steps, seen) for seen, steps, loss in result["curve"] if loss <= target), (None, None))


def _plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_s, ax_t, ax_b) = plt.subplots(1, 3, figsize=(15, 4.2))
    for r in results:
        seen, steps, loss = zip(*r["curve"])
        ax_s.plot(seen, loss, label=r["name"])
        ax_t.plot(steps, loss, label=r["name"])
        ax_b.step(*zip(*r["sizes"]), where="post", label=f"{r['name']}: batch size")
    auto = results[-1]  # the autopilot's
    known = [(s, b) for s, b in auto["b_simple"] if b is not None]
    if known:
        ax_b.plot(*zip(*known), ":", color="gray", label="B_simple (autopilot's run)")
    ax_s.set(xlabel="samples", ylabel="training loss", yscale="log", title="loss over samples")
    ax_t.set(xlabel="optimizer steps", ylabel="training loss", yscale="log", title="loss over steps")
    ax_b.set(xlabel="samples", ylabel="rows", yscale="log", title="batch size and B_simple")
    for ax in (ax_s, ax_t, ax_b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch", type=int, default=256, help="the constant run's size, the ramp's end")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam's rate at 32 rows")
    parser.add_argument("--every", type=int, default=1024, help="samples between two loss readings")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-rel-stderr", type=float, default=0.5, help="the autopilot's gate (its default)")
    parser.add_argument("--only", help="run this schedule alone (a quick look; no table against the others)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    x, y, _, _ = load_digits(size=16, seed=args.seed)
    if args.only:
        r = run(args.only, (x, y), args)
        print(r["name"], "final loss", r["curve"][-1][2], "steps", r["steps"], "sizes",
              sorted({size for _, size in r["sizes"]}))
        return
    results = [run(name, (x, y), args) for name in ("constant 32", "constant", "ramp", "autopilot")]
    results[1]["name"] = f"constant {args.batch}"
    table = []
    for r in results:
        row = {"schedule": r["name"], "final loss": r["curve"][-1][2], "steps": r["steps"]}
        for ref in results[:2]:
            steps, _ = _reach(r, ref["curve"][-1][2])
            row[f"steps to {ref['name']}'s loss"] = steps if steps is not None else "not reached"
            row[f"saved vs {ref['name']}"] = f"{1 - steps / ref['steps']:.0%}" if steps is not None else "-"
        table.append({**row, "wall s": r["wall_s"]})
    out = results_dir()
    _plot(results, out / "batch_schedule.png")
    write("batch_schedule", {"args": vars(args), "runs": results}, table,
          note=f"Digits CNN (16 x 16), Adam, sqrt LR coupling from {BASE} rows, {args.epochs} epochs of samples "
               "each (python bench/study_batch_schedule.py). Steps to a constant run's final loss, and the share "
               f"of that run's steps saved (loss read every {args.every} samples: a run is credited at the first "
               "reading at or below it).")


if __name__ == "__main__":
    main()
