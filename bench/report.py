"""Turn one benchmark run into a README.md and PNG plots in the studies' results folder.

Usage: ``pytest bench/ --benchmark-json=FILE`` then ``python bench/report.py FILE``. The
per-study JSON files the benchmarks wrote (accumulate, step, ring, memory) supply the ratios;
the pytest-benchmark JSON supplies the raw timing table. The folder is the studies' own
(``bench/_results.py``): a scratch folder, or ``bench/results/`` with ``MBS_BENCH_UPDATE=1``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from _results import results_dir

from mbs_ext.diagnostics import pyplot

plt = pyplot()

RESULTS = results_dir()


def _load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def plot_step(step: dict) -> str | None:
    rows = step.get("results", {})
    if not rows:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, model in zip(axes, ("mlp", "cnn")):
        mine = [r for r in rows.values() if r["model"] == model]
        ks = [r["k"] for r in mine]
        for key, label, style in [
            ("step ms", "mbs_ext.step", "o-"),
            ("hand ms", "hand-written loop", "s--"),
            ("guarded ms", "hand-written loop + non-finite check", "d-."),
            ("mbp ms", "mbp-pytorch 0.2.6", "^:"),
        ]:
            ax.plot(ks, [r[key] for r in mine], style, label=label)
        ax.axhline(mine[0]["full ms"], color="k", lw=1, label="full batch")
        ax.set_xscale("log", base=2)
        ax.minorticks_off()
        ax.set(xticks=ks, xticklabels=ks, xlabel="micro-batches k (B=512)", ylabel="ms / step", title=model)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "step.png", dpi=100)
    plt.close(fig)
    return "step.png"


def plot_accumulate(acc: dict) -> str | None:
    res = acc.get("results", {})
    if not res:
        return None
    labels = list(res)
    methods = ["fused", "foreach", "loop", "ceiling"]
    fig, ax = plt.subplots(figsize=(10, 3.8))
    width = 0.2
    for i, m in enumerate(methods):
        ax.bar([j + i * width for j in range(len(labels))], [res[k]["gb_per_s"][m] for k in labels], width,
               label=m)
    ax.set_xticks([j + 1.5 * width for j in range(len(labels))], labels, fontsize=8)
    ax.set(ylabel="GB/s (read acc + write acc + read grad)", title="scale-and-accumulate throughput (CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "accumulate.png", dpi=100)
    plt.close(fig)
    return "accumulate.png"


_STUDIES = ("accumulate", "step", "ring", "memory")  # written into the page itself


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__)
        return 2
    raw = json.loads(Path(argv[0]).read_text())
    lines = ["# Benchmark results", "",
             f"Machine: {raw.get('machine_info', {}).get('cpu', {}).get('brand_raw', '?')}, "
             f"{raw.get('datetime', '')}. All variants of a study ran side by side in one session;"
             " only ratios are claimed.", ""]
    for name in _STUDIES:
        md = RESULTS / f"{name}.md"
        if md.exists():
            body = md.read_text().splitlines()
            lines += ["#" + body[0], *body[1:], ""]
    # Studies and comparisons written elsewhere in the folder (before/after runs, side-by-side
    # trees, the rank studies): linked, so that a regenerated page still leads to them.
    others = sorted(p.name for p in RESULTS.glob("*.md")
                    if p.stem != "README" and p.stem not in _STUDIES)
    if others:
        lines += ["## Other studies", "", *(f"- [{name}]({name})" for name in others), ""]
    plots = []
    step, acc = _load("step"), _load("accumulate")
    if step:
        plots.append(plot_step(step))
    if acc:
        plots.append(plot_accumulate(acc))
    for extra in ("memory.png", "ring.png"):
        if (RESULTS / extra).exists():
            plots.append(extra)
    lines += ["## Plots", ""] + [f"![{p}]({p})" for p in plots if p] + [""]
    lines += ["## Raw timings (pytest-benchmark medians)", "", "| benchmark | median ms | rounds |", "|---|---|---|"]
    for b in raw.get("benchmarks", []):
        lines.append(f"| {b['fullname'].split('::')[-1]} | {b['stats']['median'] * 1e3:.3f} | {b['stats']['rounds']} |")
    (RESULTS / "README.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {RESULTS / 'README.md'} and {', '.join(p for p in plots if p)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
