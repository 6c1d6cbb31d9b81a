"""The main job: train a CNN on real digits with a mini-batch larger than the memory budget.

The same model (same initial weights, same batches) is trained twice: streamed with
``mbs_ext.MicroBatchStreamer`` (at the micro-batch size "auto" plans for ``--budget-mb``,
or at a fixed ``--micro-batch``), and with plain full-batch steps. The model has no
BatchNorm, so the two loss curves must coincide; the demo prints how far apart they
ended, the time each took (one measurement, as noisy as the machine), and the memory each needed.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch
from torch import nn

import mbs_ext
from mbs_ext.apps import _args as argtypes
from mbs_ext.apps.data import accuracy, load_digits, small_cnn
from mbs_ext.diagnostics import measure_saved_bytes

PROG = "python -m mbs_ext demo"  # cli.PROG's demo


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--epochs", type=argtypes.int_at_least(1), default=12, help="epochs to train")
    p.add_argument("--batch-size", type=argtypes.int_at_least(1), default=256, help="rows per optimizer step")
    p.add_argument(
        "--budget-mb", type=argtypes.positive, default=4.0,
        help="memory budget in MiB for activations + inputs; what --micro-batch auto plans for",
    )
    p.add_argument(
        "--micro-batch", type=argtypes.auto_or_int_at_least(1), default="auto",
        help="'auto' (the largest size the planner fits in --budget-mb) or a fixed size >= 1",
    )
    p.add_argument("--lr", type=argtypes.positive, default=2e-3, help="Adam learning rate")
    p.add_argument("--device", default="auto", help="'auto' (a GPU when there is one), 'cpu' or 'cuda[:i]'")
    p.add_argument(
        "--dtype", default="float32", choices=["float32", "float64"],
        help="parameter and data dtype; float64 makes the MBS/full-batch comparison exact on any machine",
    )
    p.add_argument("--out", default="mbs_demo", help="output directory for the PNG and a JSON summary")
    p.add_argument("--seed", type=argtypes.seed, default=0, help="seed for the weights, the split and the order")
    p.add_argument("--no-baseline", action="store_true", help="skip the full-batch comparison run")
    return p


def _args(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    args = p.parse_args(argv)
    try:
        args.device = _device(args.device)
    except ValueError as exc:
        p.error(f"argument --device: {exc}")
    argtypes.check_output_dir(p, args.out)
    return args


def _device(name: str) -> torch.device:
    """``auto``: the GPU when torch sees one and mbs_ext has CUDA kernels, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() and mbs_ext.build_info()["cuda_compiled"] else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"not a device: {name!r} ({exc})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{name!r} asked for, but torch sees no CUDA device; use --device cpu or auto")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name!r}: only cpu and cuda devices are supported")
    return device


def _epoch_batches(n: int, batch_size: int, epoch: int, seed: int) -> list[torch.Tensor]:
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch))
    return list(order.split(batch_size))


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = _args(parser, argv)
    missing = argtypes.missing({"tqdm": "tqdm", "sklearn": "scikit-learn", "matplotlib": "matplotlib"})
    if missing:
        raise SystemExit(
            f"{PROG} needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not installed: "
            f"pip install 'mbs_ext[demo]' (or: pip install {' '.join(missing)})"
        )
    from tqdm import tqdm

    device = args.device
    dtype = getattr(torch, args.dtype)
    x_train, y_train, x_test, y_test = load_digits(seed=args.seed)
    x_train, x_test = x_train.to(dtype), x_test.to(dtype)
    dataset = (x_train, y_train)
    budget = int(args.budget_mb * 2**20)
    loss_fn = nn.CrossEntropyLoss()
    full_rows = min(args.batch_size, len(y_train))  # rows of every step but an epoch's last

    mbs_model = small_cnn(seed=args.seed).to(device=device, dtype=dtype)
    full_model = copy.deepcopy(mbs_model)
    if args.micro_batch == "auto":
        # A budget that cannot hold one sample's step is a bad --budget-mb: say so before training.
        first = _epoch_batches(len(y_train), args.batch_size, 0, args.seed)[0]
        try:
            mbs_ext.plan_micro_batch(mbs_model, dataset, loss_fn, budget, indices=first)
        except ValueError as exc:
            parser.error(f"argument --budget-mb: {args.budget_mb:g} MiB does not fit this model's step ({exc})")
    mbs_opt = torch.optim.Adam(mbs_model.parameters(), lr=args.lr)
    full_opt = torch.optim.Adam(full_model.parameters(), lr=args.lr)
    # noise_scale: the step also measures the gradient noise scale B_simple from its own
    # micro-batches (docs/noise-scale.md), the batch size this task would train best at.
    streamer = mbs_ext.MicroBatchStreamer(
        mbs_model, mbs_opt, loss_fn, micro_batch_size=args.micro_batch, memory_budget=budget, noise_scale=True
    )

    history = {"mbs_loss": [], "full_loss": [], "mbs_acc": [], "full_acc": [], "b_simple": []}
    mbs_time = full_time = 0.0
    micro = None
    how = f"budget {args.budget_mb:g} MiB" if args.micro_batch == "auto" else f"micro-batch {args.micro_batch}"
    print(
        f"mbs_ext {mbs_ext.__version__} on {device}: {len(y_train)} training digits (32x32), "
        f"mini-batch {args.batch_size}, {how}, {args.dtype}"
    )
    for epoch in range(args.epochs):
        batches = _epoch_batches(len(y_train), args.batch_size, epoch, args.seed)
        bar = tqdm(batches, desc=f"epoch {epoch + 1}/{args.epochs}", unit="step", leave=False)
        for rows in bar:
            start = time.perf_counter()
            result = streamer.step(dataset, indices=rows)
            mbs_time += time.perf_counter() - start
            if len(rows) == full_rows:  # an epoch's last, shorter batch may use a smaller size
                micro = result.micro_batch_size
            history["mbs_loss"].append(result.loss)
            noise = result.noise
            history["b_simple"].append((noise.b_simple, noise.b_simple_stderr) if noise else (None, None))
            if not args.no_baseline:
                start = time.perf_counter()
                full_opt.zero_grad()
                xb, yb = x_train[rows].to(device), y_train[rows].to(device)
                full_loss = loss_fn(full_model(xb), yb)
                full_loss.backward()
                full_opt.step()
                full_time += time.perf_counter() - start
                history["full_loss"].append(full_loss.item())
            b_simple = history["b_simple"][-1][0]
            bar.set_postfix(loss=f"{result.loss:.4f}", micro=micro,
                            B_simple="-" if b_simple is None else f"{b_simple:.0f}")
        history["mbs_acc"].append(accuracy(mbs_model, x_test, y_test))
        if not args.no_baseline:
            history["full_acc"].append(accuracy(full_model, x_test, y_test))
        tqdm.write(
            f"epoch {epoch + 1:3d}  loss {history['mbs_loss'][-1]:.4f}  test acc {history['mbs_acc'][-1]:.3f}"
            + ("" if args.no_baseline else f"  (full batch: acc {history['full_acc'][-1]:.3f})")
        )

    # Activation memory actually saved for backward: one micro-batch vs the whole mini-batch.
    probe_rows = torch.arange(min(args.batch_size, len(y_train)))
    call = lambda model, mb: loss_fn(model(mb[0]), mb[1])  # noqa: E731
    full_bytes = measure_saved_bytes(
        mbs_model, (x_train[probe_rows].to(device), y_train[probe_rows].to(device)), call
    )
    micro_bytes = measure_saved_bytes(
        mbs_model, (x_train[probe_rows[:micro]].to(device), y_train[probe_rows[:micro]].to(device)), call
    )
    summary = {
        "device": str(device),
        "dtype": args.dtype,
        "mini_batch": args.batch_size,
        "micro_batch": micro,
        "budget_bytes": budget,
        "test_accuracy_mbs": history["mbs_acc"][-1],
        "saved_bytes_full_batch": full_bytes,
        "saved_bytes_micro_batch": micro_bytes,
        "time_mbs_s": mbs_time,
        "b_simple": history["b_simple"][-1][0],
        "b_simple_stderr": history["b_simple"][-1][1],
    }
    origin, planned, sentence = _micro_batch_origin(args, micro, full_rows, streamer.plans())
    summary.update(micro_batch_origin=origin, planned_micro_batch=planned)
    print(f"\n{sentence}")
    print(f"test accuracy with MBS: {history['mbs_acc'][-1]:.3f}")
    b_simple, stderr = history["b_simple"][-1]
    if b_simple is not None:
        print(f"gradient noise scale at the end (B_simple, the critical batch size it predicts): {b_simple:.0f}"
              + ("" if stderr is None else f" +- {stderr:.0f}") + f", trained at {args.batch_size}")
    print(
        f"activation memory saved for backward: micro-batch {micro_bytes / 2**20:.2f} MiB "
        f"vs full batch {full_bytes / 2**20:.2f} MiB ({full_bytes / max(micro_bytes, 1):.1f}x less)"
    )
    if not args.no_baseline:
        gap = max(abs(a - b) for a, b in zip(history["mbs_loss"], history["full_loss"]))
        summary.update(
            test_accuracy_full=history["full_acc"][-1],
            time_full_s=full_time,
            overhead_vs_full=mbs_time / full_time,
            overhead_note="one run, timed under whatever else the machine ran: noisy, not a benchmark",
            max_loss_gap=gap,
        )
        print(f"test accuracy with full batch: {history['full_acc'][-1]:.3f}")
        print(
            f"time: MBS {mbs_time:.2f} s vs full batch {full_time:.2f} s ({mbs_time / full_time:.2f}x; one noisy "
            "measurement under whatever else this machine runs, not a benchmark: see docs/benchmarks.md)"
        )
        print(f"largest gap between the MBS and full-batch loss curves: {gap:.2e}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _plot(history, out / "demo.png", micro, args.batch_size)
    (out / "demo.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {out / 'demo.png'} and {out / 'demo.json'}")
    return 0


def _micro_batch_origin(
    args: argparse.Namespace, micro: int, full_rows: int, plans: dict
) -> tuple[str, int | None, str]:
    """Where the micro-batch size the steps used came from: ``(origin, planned size, a sentence)``.

    Only a size the planner chose for the budget is said to be chosen for the budget; a fixed
    ``--micro-batch`` or a size lowered by out-of-memory back-off is reported as such.
    """
    if args.micro_batch == "auto":
        planned = max(plans.values(), key=lambda plan: plan.num_rows).micro_batch_size
        budget = f"the {args.budget_mb:g} MiB budget"
        if micro < planned:
            return "backoff", planned, (
                f"micro-batch size {micro}: planned {planned} for {budget}, lowered by out-of-memory back-off"
            )
        if planned >= full_rows:
            return "budget", planned, (
                f"micro-batch size {micro}: the whole mini-batch of {full_rows} fits {budget}, so nothing is streamed"
            )
        return "budget", planned, f"micro-batch size chosen for {budget}: {micro} (mini-batch {full_rows})"
    fixed = args.micro_batch
    if micro < min(fixed, full_rows):
        return "backoff", None, (
            f"micro-batch size {micro}: --micro-batch {fixed}, lowered by out-of-memory back-off"
        )
    if fixed > full_rows:
        return "fixed", None, (
            f"micro-batch size {micro}: --micro-batch {fixed} is more than the mini-batch of {full_rows} "
            "(not planned; --budget-mb is unused)"
        )
    return "fixed", None, f"micro-batch size {micro}, set with --micro-batch (not planned; --budget-mb is unused)"


def _plot(history: dict, path: Path, micro: int | None, batch_size: int) -> None:
    from mbs_ext.diagnostics import pyplot

    plt = pyplot()

    fig, (ax_loss, ax_acc, ax_noise) = plt.subplots(1, 3, figsize=(16, 4))
    ax_loss.plot(history["mbs_loss"], label=f"MBS (micro-batch {micro})", lw=2.5, alpha=0.7)
    if history["full_loss"]:
        ax_loss.plot(history["full_loss"], "--", label=f"full batch ({batch_size})", lw=1.2, color="k")
    ax_loss.set(xlabel="optimizer step", ylabel="training loss", yscale="log", title="loss per step")
    ax_loss.legend()
    epochs = range(1, len(history["mbs_acc"]) + 1)
    ax_acc.plot(epochs, history["mbs_acc"], "o-", label="MBS", lw=2.5, alpha=0.7)
    if history["full_acc"]:
        ax_acc.plot(epochs, history["full_acc"], "x--", label="full batch", color="k")
    ax_acc.set(xlabel="epoch", ylabel="test accuracy", title="test accuracy")
    ax_acc.legend()
    steps = [i for i, (b, _) in enumerate(history["b_simple"]) if b is not None]
    if steps:
        b = [history["b_simple"][i][0] for i in steps]
        err = [history["b_simple"][i][1] or 0.0 for i in steps]
        ax_noise.plot(steps, b, lw=2, label="B_simple (moving average)")
        ax_noise.fill_between(steps, [v - e for v, e in zip(b, err)], [v + e for v, e in zip(b, err)], alpha=0.25,
                              label="+- its standard error")
    ax_noise.axhline(batch_size, color="k", ls="--", lw=1.2, label=f"mini-batch used ({batch_size})")
    ax_noise.set(xlabel="optimizer step", ylabel="samples", title="gradient noise scale from the micro-batches")
    ax_noise.legend()
    fig.suptitle("mbs_ext: micro-batch streaming equals the full-batch step (digits, small CNN)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
