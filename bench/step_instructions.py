"""What the step's own Python costs, counted in instructions rather than timed.

On a shared machine a step's time moves by several percent from run to run, far more than the
step's bookkeeping (tens of microseconds on a 10 ms step): timings cannot tell whether a change
made that bookkeeping grow. Instructions can. This runs ``bench_step.py``'s "guarded" hand loop
(the loop plus the non-finite check and the loss read the step does by default) and
``MicroBatchStreamer.step`` on a tiny MLP (8-8-8-4, 64 rows, one thread: the model's own work is
small, so what is left is the bookkeeping) under valgrind's callgrind, counting only the steps
after a warm-up (instrumentation switched on and dumped with ``callgrind_control``), and prints the
user-space instructions per step of each, and their difference: the instructions the step adds.
Run again, a tree's counts repeat to within a few hundred instructions (valgrind runs the process
on one simulated core, so the machine's load does not enter); between trees the guarded loop, the
same code, moves by up to about 15,000 at 8 micro-batches (other allocations, other paths), which
bounds how closely two trees compare (bench/results/step_overhead_side_by_side.md).

    python bench/step_instructions.py            # k = 1 and 8 micro-batches, this tree
    (cd OTHER_TREE && python /path/to/bench/step_instructions.py)   # another commit, same model

Needs valgrind (``apt-get install valgrind``); each count runs the process under it (about a
minute, most of it importing torch).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

STEPS = 40
WARMUP = 20


def _child(variant: str, k: int) -> None:
    """Inside valgrind: warm up, count ``STEPS`` steps, dump."""
    sys.path[:0] = [str(Path(__file__).parent), os.getcwd()]
    import bench_step
    import torch
    from torch import nn

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x, y = torch.randn(64, 8), torch.randint(0, 4, (64,))
    run = getattr(bench_step, "_" + variant)(model, opt, nn.CrossEntropyLoss(), x, y, 64 // k)
    for _ in range(WARMUP):
        run()
    pid = str(os.getpid())
    subprocess.run(["callgrind_control", "--instr=on", pid], check=True, capture_output=True)
    for _ in range(STEPS):
        run()
    subprocess.run(["callgrind_control", "--dump", pid], check=True, capture_output=True)


def count(variant: str, k: int) -> int:
    """User-space instructions per step of ``variant`` at ``k`` micro-batches."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        subprocess.run(
            ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}.%p",
             sys.executable, __file__, "--child", variant, str(k)],
            check=True, capture_output=True, env={**os.environ, "PYTHONHASHSEED": "0"},
        )
        dumps = [p for p in Path(tmp).iterdir() if p.name.endswith(".1")]  # the dump after the counted steps
        summary = next(line for line in dumps[0].read_text().splitlines() if line.startswith("summary:"))
    return int(summary.split()[1]) // STEPS


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        _child(sys.argv[2], int(sys.argv[3]))
        return
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not installed (apt-get install valgrind)")
    print("| k | guarded loop | step | step adds |\n|---|---|---|---|")
    for k in (1, 8):
        guarded, step = count("guarded", k), count("step", k)
        print(f"| {k} | {guarded:,} | {step:,} | {step - guarded:,} |", flush=True)


if __name__ == "__main__":
    main()
