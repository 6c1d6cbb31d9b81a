"""Constant batch size vs a ramp vs the noise-scale autopilot, at the same number of samples.

Run: ``python bench/study_batch_schedule.py`` (``--help``). Two tasks (``--task``):

* ``digits``: scikit-learn's digits (the demo's data, 16 x 16 here) and the demo's small CNN;
* ``gpt``: a small causal transformer (two pre-norm layers, 64 wide, 4 heads) predicting the
  next byte of Python's own documentation text (``pydoc_data.topics``, which ships with CPython:
  466 KB, cut into 14,127 rows of 33 bytes; each row's 32 predictions averaged, so every row
  counts the same and ``"samples"`` is the exact count).

Adam with the learning rate coupled to the size by the square root (``scaled_lr(..., "sqrt")``,
base ``--lr`` at 32 rows), micro-batches of 16 rows, every run drawing its rows from a
:class:`mbs_ext.SampleOrder` of the same seed. The schedules:

* ``constant 32``: 32 rows at every step (the sample-efficient end: the most steps);
* ``constant``: ``--batch`` rows at every step;
* ``ramp``: 32 rows up to ``--batch`` over the first 40% of the samples (multiples of 32);
* ``autopilot``: ``B <- clip(k * B_simple, 32, 2 * --batch)`` from the step's own noise scale
  (``noise_scale=True``), up only, with 25% hysteresis, acting on estimates whose standard error
  is within half of them (the autopilot's default).

Every run sees ``--epochs`` epochs of samples. Every ``--every`` samples the training loss is
taken (model in eval mode, no gradient: over the whole training set for digits, over a fixed
2,048 of its rows for the gpt task). Reported: the final loss of each, the
optimizer steps each needed to first reach each constant run's final loss (where it does), the
steps in all, and the wall time. Written as ``batch_schedule.{json,md,png}`` (digits) or
``batch_schedule_gpt.{json,md,png}`` where
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


class TinyGPT(torch.nn.Module):
    """A causal transformer over bytes: token and position embeddings, pre-norm layers, a head."""

    def __init__(self, context: int, width: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(256, width)
        self.position = torch.nn.Parameter(0.02 * torch.randn(context, width))
        layer = torch.nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True,
                                                 norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm, self.head = torch.nn.LayerNorm(width), torch.nn.Linear(width, 256)
        self.register_buffer("causal", torch.nn.Transformer.generate_square_subsequent_mask(context),
                             persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        h = self.blocks(self.embed(ids) + self.position[:t], mask=self.causal[:t, :t], is_causal=True)
        return self.head(self.norm(h))


def _next_byte_loss(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
    """The mean over a micro-batch's rows and positions of the next byte's cross-entropy."""
    ids, targets = batch
    return F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())


def _task(name: str, seed: int) -> dict:
    """The data ``(x, y)``, a fresh model, the step's loss (and its count) and the rows the
    training loss is read over."""
    if name == "digits":
        x, y, _, _ = load_digits(size=16, seed=seed)
        return {"data": (x, y), "model": lambda: small_cnn(image_size=16, seed=0),
                "loss": torch.nn.CrossEntropyLoss(), "normalize": None, "eval_rows": slice(None)}
    from pydoc_data.topics import topics

    text = "\n".join(topics[k] for k in sorted(topics)).encode()
    rows = torch.tensor(list(text[:len(text) // 33 * 33]), dtype=torch.long).view(-1, 33)

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return TinyGPT(context=32)

    return {"data": (rows[:, :-1], rows[:, 1:]), "model": model, "loss": _next_byte_loss, "normalize": "samples",
            "eval_rows": slice(0, 2048)}


@torch.no_grad()
def _train_loss(model: torch.nn.Module, task: dict) -> float:
    x, y = task["data"]
    rows = task["eval_rows"]
    model.eval()
    logits = model(x[rows])
    loss = F.cross_entropy(logits.flatten(0, -2) if logits.dim() > 2 else logits, y[rows].flatten()).item()
    model.train()
    return loss


def run(name: str, task: dict, args: argparse.Namespace) -> dict:
    """One schedule over ``args.epochs`` epochs of samples: its loss curve, sizes and steps."""
    x, y = task["data"]
    samples = args.epochs * len(y)
    model = task["model"]()
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    streamer = mbs_ext.MicroBatchStreamer(model, opt, task["loss"], micro_batch_size=MICRO, noise_scale=True,
                                          normalize=task["normalize"])
    order = mbs_ext.SampleOrder(len(y), seed=args.seed)
    schedule = _schedule(name, args.batch, samples, args.max_rel_stderr)
    curve = [(0, 0, _train_loss(model, task))]  # (samples, steps, loss)
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
            curve.append((order.samples_seen, steps, _train_loss(model, task)))
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
    parser.add_argument("--task", default="digits", choices=["digits", "gpt"])
    parser.add_argument("--epochs", type=int, default=None, help="epochs of samples (digits 30, gpt 3)")
    parser.add_argument("--batch", type=int, default=256, help="the constant run's size, the ramp's end")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam's rate at 32 rows")
    parser.add_argument("--every", type=int, default=1024, help="samples between two loss readings")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-rel-stderr", type=float, default=0.5, help="the autopilot's gate (its default)")
    parser.add_argument("--only", help="run this schedule alone (a quick look; no table against the others)")
    args = parser.parse_args(argv)
    args.epochs = args.epochs or {"digits": 30, "gpt": 3}[args.task]
    torch.set_num_threads(1)
    task = _task(args.task, args.seed)
    if args.only:
        r = run(args.only, task, args)
        print(r["name"], "final loss", r["curve"][-1][2], "steps", r["steps"], "sizes",
              sorted({size for _, size in r["sizes"]}))
        return
    results = [run(name, task, args) for name in ("constant 32", "constant", "ramp", "autopilot")]
    results[1]["name"] = f"constant {args.batch}"
    table = []
    for r in results:
        row = {"schedule": r["name"], "final loss": r["curve"][-1][2], "steps": r["steps"]}
        for ref in results[:2]:
            steps, _ = _reach(r, ref["curve"][-1][2])
            row[f"steps to {ref['name']}'s loss"] = steps if steps is not None else "not reached"
            row[f"saved vs {ref['name']}"] = f"{1 - steps / ref['steps']:.0%}" if steps is not None else "-"
        table.append({**row, "wall s": r["wall_s"]})
    stem = "batch_schedule" if args.task == "digits" else f"batch_schedule_{args.task}"
    what = {"digits": "Digits CNN (16 x 16)", "gpt": "Byte-level GPT (2 layers, 64 wide) on pydoc_data's text"}
    _plot(results, results_dir() / f"{stem}.png")
    write(stem, {"args": vars(args), "runs": results}, table,
          note=f"{what[args.task]}, Adam, sqrt LR coupling from {BASE} rows, {args.epochs} epochs of samples "
               f"each (python bench/study_batch_schedule.py --task {args.task}). Steps to a constant run's final "
               f"loss, and the share of that run's steps saved (loss read every {args.every} samples: a run is "
               "credited at the first reading at or below it).")


if __name__ == "__main__":
    main()
