"""Writes one study's results to bench/results/ as JSON and a Markdown table."""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).parent / "results"


def machine() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def write(study: str, data: dict, table: list[dict], note: str = "") -> Path:
    """Save `data` (+ machine facts) to <study>.json and `table` rows to <study>.md."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    payload = {"study": study, "machine": machine(), **data}
    (RESULTS_DIR / f"{study}.json").write_text(json.dumps(payload, indent=2) + "\n")
    lines = [f"# {study}", ""]
    if note:
        lines += [note, ""]
    if table:
        cols = list(table[0])
        lines.append("| " + " | ".join(cols) + " |")
        lines.append("|" + "---|" * len(cols))
        for row in table:
            lines.append("| " + " | ".join(_fmt(row[c]) for c in cols) + " |")
    (RESULTS_DIR / f"{study}.md").write_text("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines))
    return RESULTS_DIR / f"{study}.json"


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
