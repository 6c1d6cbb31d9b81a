"""Where the studies write (:func:`results_dir`, the one rule), and one study's results as JSON and a Markdown table."""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

COMMITTED = Path(__file__).resolve().parent / "results"  # the figures the docs quote
SCRATCH = Path(tempfile.gettempdir()) / "mbs_ext-bench"


def results_dir(sub: str = "") -> Path:
    """The folder a study writes to, made if missing; every study and ``bench/report.py`` ask here.

    ``$MBS_BENCH_OUT`` when set (as given; ``scripts/gpu_check.sh`` sets it); else, with
    ``MBS_BENCH_UPDATE=1``, ``bench/results/<sub>``, the committed figures; else a scratch folder,
    ``<tmp>/mbs_ext-bench/<sub>``. Running a study to see what it measures must not overwrite the
    figures the docs quote, which came from a quiet machine: replacing them is asked for.
    """
    if os.environ.get("MBS_BENCH_OUT"):
        out = Path(os.environ["MBS_BENCH_OUT"])
    elif os.environ.get("MBS_BENCH_UPDATE") == "1":
        out = COMMITTED / sub
    else:
        out = SCRATCH / sub
    out.mkdir(parents=True, exist_ok=True)
    return out


def machine() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def write(study: str, data: dict, table: list[dict], note: str = "") -> Path:
    """Save `data` (+ machine facts) to <study>.json and `table` rows to <study>.md in :func:`results_dir`."""
    out = results_dir()
    payload = {"study": study, "machine": machine(), **data}
    (out / f"{study}.json").write_text(json.dumps(payload, indent=2) + "\n")
    lines = [f"# {study}", ""]
    if note:
        lines += [note, ""]
    if table:
        cols = list(table[0])
        lines.append("| " + " | ".join(cols) + " |")
        lines.append("|" + "---|" * len(cols))
        for row in table:
            lines.append("| " + " | ".join(_fmt(row[c]) for c in cols) + " |")
    (out / f"{study}.md").write_text("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines))
    print(f"wrote {out / study}.json and .md")
    return out / f"{study}.json"


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def interleaved(runs: dict[str, Callable[[], object]], times: dict[str, list[float]]) -> Callable[[], None]:
    """One benchmark round: every variant once, in an order that rotates each round, so
    slow drifts of a shared machine hit all variants alike. Appends to ``times``."""
    order = list(runs)
    state = {"round": 0}

    def round_robin() -> None:
        r = state["round"] % len(order)
        state["round"] += 1
        for name in order[r:] + order[:r]:
            start = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - start)

    return round_robin
