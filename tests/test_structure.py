"""The package's module graph has no import cycle, and the core never reaches into the apps.

Read statically from the sources (module-level and function-level ``import``s alike),
so a cycle hidden behind a lazy import inside a function is caught too.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
from common import run_python

PACKAGE = Path(__file__).resolve().parent.parent / "mbs_ext"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The mbs_ext modules ``path`` imports (``from mbs_ext import x`` counts as mbs_ext.x)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module in modules:
                found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules}
    return found


def _graph() -> dict[str, set[str]]:
    paths = [p for p in PACKAGE.rglob("*.py")]
    modules = {_module_name(p) for p in paths}
    # The package facade imports everything; it is the root, not part of a cycle.
    return {_module_name(p): _imports(p, modules) - {"mbs_ext"} for p in paths}


def test_no_import_cycle():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep):] + [dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)


def test_core_does_not_import_apps_or_step_from_planner():
    graph = _graph()
    for module, deps in graph.items():
        if ".apps" not in module and module not in ("mbs_ext", "mbs_ext.__main__"):
            assert not any(".apps" in d for d in deps), f"{module} imports the apps: {deps}"
    for planning in ("mbs_ext.planner", "mbs_ext.probe", "mbs_ext.backoff"):
        assert "mbs_ext.step" not in graph[planning], planning


@pytest.mark.slow  # one fresh interpreter re-importing every module: out of the quick suite
def test_every_module_imports_alone():
    graph = _graph()
    code = (
        "import importlib, sys\n"
        "for name in sys.argv[1:]:\n"
        "    for m in [k for k in sys.modules if (k == 'mbs_ext' or k.startswith('mbs_ext.'))\n"
        "              and k not in ('mbs_ext._native', 'mbs_ext._C', 'mbs_ext.ops')]:\n"
        "        del sys.modules[m]\n"
        "    importlib.import_module(name)\n"
    )
    modules = sorted(m for m in graph if m != "mbs_ext.__main__")
    # The native module and the op registrations stay loaded: torch keeps op registrations
    # for the process, so executing them twice would test torch, not the import graph.
    run_python(["-c", code, *modules], cwd=PACKAGE.parent, timeout=300)


def test_diagnostics_is_an_attribute_after_import_mbs_ext():
    """The README names ``mbs_ext.diagnostics``: in a fresh interpreter, ``import mbs_ext`` alone
    makes it an attribute, with what the README says it holds (memory probes and meters)."""
    code = (
        "import sys, mbs_ext\n"
        "d = mbs_ext.diagnostics\n"
        "assert d is sys.modules['mbs_ext.diagnostics'], d\n"
        "assert callable(d.measure_peak) and callable(d.PeakTracker) and callable(d.RssPeak), dir(d)\n"
    )
    run_python(code, cwd=PACKAGE.parent.parent, timeout=120)


ROOT = PACKAGE.parent
# Unit tests of one component import that component; everything else outside the core
# goes through the public API (``mbs_ext``) and ``mbs_ext.diagnostics``.
COMPONENT_TESTS = {
    "tests/test_components.py": {"mbs_ext.normalize", "mbs_ext.ring", "mbs_ext.batch", "mbs_ext.finish",
                                 "mbs_ext.backoff", "mbs_ext.options", "mbs_ext.loss", "mbs_ext.rollback",
                                 "mbs_ext.ranks"},
    "tests/test_batchnorm.py": {"mbs_ext.batchnorm"},
    "tests/test_ring.py": {"mbs_ext.ring"},
    "tests/test_scale_accumulate.py": {"mbs_ext.grads", "mbs_ext.planner"},
}


def _outside_imports(path: Path) -> set[str]:
    """Every ``mbs_ext`` module or private name ``path`` imports (``from mbs_ext import _x`` counts)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "mbs_ext"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "mbs_ext":
            if node.module == "mbs_ext.apps":
                found |= {f"mbs_ext.apps.{a.name}" for a in node.names}
                continue
            found.add(node.module)
            if node.module == "mbs_ext":
                found |= {f"mbs_ext.{a.name}" for a in node.names if a.name.startswith("_") and a.name != "__version__"}
    return found


@pytest.mark.parametrize("where", ["mbs_ext/apps", "bench", "tests"])
def test_public_line(where):
    import mbs_ext

    public = {"mbs_ext", "mbs_ext.diagnostics"}
    assert set(mbs_ext.__all__) >= {"step", "MicroBatchStreamer", "StepOptions", "StreamRing"}
    missing = [rel for rel in COMPONENT_TESTS if not (ROOT / rel).is_file()]
    assert not missing, f"COMPONENT_TESTS names files that do not exist (renamed?): {missing}"
    for path in sorted((ROOT / where).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        allowed = public | COMPONENT_TESTS.get(rel, set())
        for name in _outside_imports(path):
            if name.startswith("mbs_ext.apps."):
                # The apps' own modules: private ones only from inside the apps.
                ok = where == "mbs_ext/apps" or not name.rsplit(".", 1)[1].startswith("_")
            else:
                # The framework integrations are public modules of their own.
                ok = name in allowed or name.startswith("mbs_ext.integrations.")
            assert ok, f"{rel} imports {name}: use mbs_ext's public API or mbs_ext.diagnostics"


def test_no_class_over_150_lines_and_no_function_over_50():
    """Each piece small enough to read whole (the apps aside)."""
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "apps" in path.relative_to(PACKAGE).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            size = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.ClassDef) and size > 150 or (
                isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and size > 50
            ):
                too_long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({size} lines)")
    assert not too_long, too_long


def test_the_batch_takes_a_short_path_through_the_package():
    """Followed through a step (every moment a frame of mbs_ext holds the caller's batch), the
    batch enters no file more than three times and comes back to a file it left at most 8 times;
    the ring is one of the files it visits (the hop batch -> ring is a call, not hidden)."""
    import os

    import torch
    from torch import nn

    import mbs_ext

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    batch = (torch.randn(10, 5, dtype=torch.float64), torch.randint(0, 3, (10,)))
    streamer = mbs_ext.MicroBatchStreamer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                          nn.CrossEntropyLoss(), micro_batch_size=4)
    streamer.step(batch)
    package = str(PACKAGE) + os.sep
    files: list[str] = []

    def holder(frame):
        while frame is not None:
            if frame.f_code.co_filename.startswith(package) and any(v is batch for v in frame.f_locals.values()):
                return frame.f_code.co_filename
            frame = frame.f_back
        return None

    def trace(frame, event, arg):
        where = holder(frame)
        if where is not None and (not files or files[-1] != where):
            files.append(where)
        return trace

    sys.settrace(trace)
    try:
        streamer.step(batch)
    finally:
        sys.settrace(None)
    names = [Path(f).name for f in files]
    assert names[0] == "step.py" and "ring.py" in names, names
    assert max(names.count(n) for n in names) <= 3, names
    assert sum(1 for i, n in enumerate(names) if n in names[:i]) <= 8, names
