"""What the sum of squares costs the fused op: ``scale_accumulate_`` with and without ``sq_norm``.

Run: ``python bench/bench_sq_norm.py`` (``--help`` for sizes). The parameter set is a realistic
one of ~25 tensors, 10M float32 elements in all (a few large matrices, their biases and norms);
grads float32 (or ``--grad-dtype bfloat16``) into float32 accumulators. The variants run
interleaved, every round each once in a rotating order, on the same tensors, so the drifts of a
shared machine hit them alike; the medians and their ratio are printed and written, as JSON, to
``sq_norm.json`` where bench/_results.py says studies write. The op adds ``scale * g`` into the
same accumulators every call, so the values grow by a constant per call: no denormals, no
non-finite values.

The sum is per call of the op, i.e. per micro-batch: what it adds to a step is this ratio's
excess times the op's share of the step (the op is one pass over the gradients; forward and
backward are many).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import interleaved, machine, results_dir  # noqa: E402

import mbs_ext  # noqa: E402


def shapes(total: int = 10_000_000) -> list[tuple[int, ...]]:
    """~25 tensors adding up to about ``total`` elements: an embedding, blocks of two matrices
    with their biases and norm weights, and a head, the way a small transformer's are."""
    d = 512
    blocks = 4
    per_block = 2 * (d * 4 * d) + 4 * d + d + 2 * d  # two matrices, their biases, a norm
    vocab = max(1, (total - blocks * per_block - 2 * d) // d)
    out: list[tuple[int, ...]] = [(vocab, d)]
    for _ in range(blocks):
        out += [(4 * d, d), (4 * d,), (d, 4 * d), (d,), (d,), (d,)]
    out += [(d,), (d,)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=10_000_000)
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--grad-dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--sq-dtype", default="float64", choices=["float32", "float64"])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    gen = torch.Generator().manual_seed(0)
    grad_dtype = getattr(torch, args.grad_dtype)
    sizes = shapes(args.elements)
    accs = [torch.randn(s, generator=gen) for s in sizes]
    grads = [torch.randn(s, generator=gen).to(grad_dtype) for s in sizes]
    found_inf = torch.zeros(())
    sq_norm = torch.zeros((), dtype=getattr(torch, args.sq_dtype))
    runs = {
        "without": lambda: mbs_ext.scale_accumulate_(accs, grads, 0.125, found_inf),
        "with sq_norm": lambda: mbs_ext.scale_accumulate_(accs, grads, 0.125, found_inf, sq_norm),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    round_robin = interleaved(runs, times)
    for _ in range(3):  # warm-up: page in, wake the thread pool
        round_robin()
    for samples in times.values():
        samples.clear()
    for _ in range(args.rounds):
        round_robin()

    med = {name: statistics.median(samples) for name, samples in times.items()}
    ratio = med["with sq_norm"] / med["without"]
    # Paired per round (the two ran back to back): the median of the per-round ratios.
    paired = statistics.median(w / wo for w, wo in zip(times["with sq_norm"], times["without"]))
    numel = sum(g.numel() for g in grads)
    print(f"{len(sizes)} tensors, {numel:,} elements, grads {args.grad_dtype} -> float32, sq_norm {args.sq_dtype}, "
          f"{torch.get_num_threads()} threads, {args.rounds} interleaved rounds")
    for name, m in med.items():
        print(f"  {name:>13}: median {m * 1e3:8.3f} ms")
    print(f"  with / without: {ratio:.4f} (ratio of medians), {paired:.4f} (median of per-round ratios)")
    out = results_dir() / "sq_norm.json"
    out.write_text(json.dumps({
        "study": "sq_norm", "machine": machine(), "tensors": len(sizes), "elements": numel,
        "grad_dtype": args.grad_dtype, "sq_dtype": args.sq_dtype, "rounds": args.rounds,
        "median_s": med, "ratio_of_medians": ratio, "median_of_ratios": paired,
    }, indent=2) + "\n")
    print(f"  written to {out}")


if __name__ == "__main__":
    main()
