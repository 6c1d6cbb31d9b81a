"""The package's module graph has no import cycle, and the core never reaches into the apps.

Read statically from the sources (module-level and function-level ``import``s alike),
so a cycle hidden behind a lazy import inside a function is caught too.
"""

from __future__ import annotations

import ast
import re
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
            submodules = {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules}
            found |= submodules
            # ``from pkg import submodule`` depends on the submodule; any other name, on ``pkg`` itself.
            if node.module in modules and len(submodules) < len(node.names):
                found.add(node.module)
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
    for planning in ("mbs_ext.memory.planner", "mbs_ext.memory.probe", "mbs_ext.memory.backoff"):
        # Memory planning may use the step's parts (its options, its gradient buffers), never
        # the step: the step calls the planner.
        assert not {"mbs_ext.step.streamer", "mbs_ext.step.attempt"} & graph[planning], planning


# The package's floors, from the ground up (docs/design.md, "Floors"): a module imports from its
# own floor or below, never above. A top-level module is its own name; a package's modules are
# the package's floor. The compiled extension (mbs_ext._C) sits on the ground floor.
FLOORS = (
    ("mbs_ext._native", "mbs_ext._C", "mbs_ext._version", "mbs_ext.messages"),
    ("mbs_ext.ops",),
    ("mbs_ext.model",),
    ("mbs_ext.streaming",),
    ("mbs_ext.counts",),
    ("mbs_ext.memory",),
    ("mbs_ext.world",),
    ("mbs_ext.step",),
    ("mbs_ext", "mbs_ext.diagnostics"),
    ("mbs_ext.apps", "mbs_ext.integrations", "mbs_ext.__main__"),
)


def _floor(module: str) -> int:
    """The floor of ``module``: the longest declared name it is or lies in."""
    best, floor = -1, None
    for level, names in enumerate(FLOORS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, floor = len(name), level
    if floor is None:
        raise AssertionError(f"{module} is on no floor: add its package to FLOORS and to docs/design.md")
    return floor


def test_no_module_imports_a_floor_above_its_own():
    """Packages are floors: what a module needs lies on its own floor or below, so each floor can
    be read, tested and changed knowing only what is under it. ``from mbs_ext import _C`` is the
    extension; any other ``from mbs_ext import name`` reaches the public package."""
    paths = list(PACKAGE.rglob("*.py"))
    modules = {_module_name(p) for p in paths} | {"mbs_ext._C"}
    up = []
    for path in paths:
        module = _module_name(path)
        for dep in _imports(path, modules):
            if _floor(dep) > _floor(module):
                up.append(f"{module} (floor {_floor(module)}) imports {dep} (floor {_floor(dep)})")
    assert not up, "imports running up the floors:\n" + "\n".join(sorted(up))


def test_the_floors_test_sees_an_import_that_runs_up(tmp_path):
    """The check above fails where it should: a counts module that imports the step."""
    bad = tmp_path / "bad.py"
    bad.write_text("from mbs_ext.step.streamer import step\n")
    deps = _imports(bad, {"mbs_ext.step.streamer"})
    assert deps == {"mbs_ext.step.streamer"}
    assert _floor("mbs_ext.step.streamer") > _floor("mbs_ext.counts.normalize")


def test_the_module_map_in_design_md_matches_the_tree():
    """docs/design.md's module map names every module of the core where it lies, and no module
    that is gone (apps/ and integrations/ are named as folders)."""
    text = (PACKAGE.parent / "docs" / "design.md").read_text()
    block = text[text.index("## Module map"):]
    block = block[block.index("```") + 3:]
    block = block[:block.index("```")]
    named, package = set(), None
    for line in block.splitlines():
        top = re.match(r"^(?:mbs_ext/)?(\S+)", line) if not line.startswith(" ") else None
        folder = re.match(r"^ {8}(\w+)/", line)
        module = re.match(r"^ {8}(\w+\.py)\b", line) or re.match(r"^ {10}(\w+\.py)\b", line)
        if top and top.group(1) == "__init__.py":
            named.add("__init__.py")
        elif folder:
            package = folder.group(1)
        elif module:
            named.add(module.group(1) if line.startswith(" " * 8 + module.group(1)) else f"{package}/{module.group(1)}")
    present = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
               if p.parent.name not in ("apps", "integrations") and p.name != "__init__.py"}
    present |= {"__init__.py"} | {f"{p.parent.name}/__init__.py" for p in PACKAGE.glob("*/__init__.py")
                                  if p.parent.name == "world"}  # world's __init__ holds world_of
    assert named == present, (sorted(present - named), sorted(named - present))


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
    "tests/test_components.py": {
        "mbs_ext.counts.loss", "mbs_ext.counts.normalize", "mbs_ext.counts.sources", "mbs_ext.memory.backoff",
        "mbs_ext.step.finish", "mbs_ext.model.members", "mbs_ext.model.options", "mbs_ext.model.rollback",
        "mbs_ext.streaming.batch", "mbs_ext.streaming.ring", "mbs_ext.world", "mbs_ext.world.record",
        "mbs_ext.model.wrappers",
    },
    "tests/test_batchnorm.py": {"mbs_ext.model.batchnorm", "mbs_ext.model.batchnorm_rows"},
    "tests/test_batchnorm_ranks.py": {"mbs_ext.world.pairing"},
    "tests/test_ring.py": {"mbs_ext.streaming.ring"},
    "tests/test_scale_accumulate.py": {"mbs_ext.model.grads", "mbs_ext.memory.planner", "mbs_ext.ops"},
}


def _outside_imports(path: Path) -> set[str]:
    """Every ``mbs_ext`` module or private name ``path`` imports, in every import form: ``import
    mbs_ext.x``, ``from mbs_ext.x import y``, ``from mbs_ext import x`` (a module, or a private
    name ``_x``) and ``importlib.import_module("mbs_ext.x")``."""
    modules = {_module_name(p) for p in PACKAGE.rglob("*.py")}
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "mbs_ext"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "mbs_ext":
            if node.module == "mbs_ext.apps":
                found |= {f"mbs_ext.apps.{a.name}" for a in node.names}
                continue
            names = {f"{node.module}.{a.name}": a.name for a in node.names}
            found |= {n for n, a in names.items() if n in modules or (a.startswith("_") and a != "__version__")}
            if not set(names) <= modules:  # a name from the module itself, not only its submodules
                found.add(node.module)
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"):
            name = str(node.args[0].value)
            if name.split(".")[0] == "mbs_ext":
                found.add(name)
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


_PATH_PROBE = r"""
import json, os, sys, torch
import torch.distributed as dist
from torch import nn
import mbs_ext

path, package = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()
if path == "ddp":
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[3], rank=0, world_size=1)
    model = nn.parallel.DistributedDataParallel(model)
batch = (torch.randn(10, 5, dtype=torch.float64), torch.randint(0, 3, (10,)))
size = dict(micro_batch_size="auto", memory_budget=64 << 20) if path == "auto" else dict(micro_batch_size=4)
loss_fn = nn.CrossEntropyLoss()
if path == "cached_loss":  # a loss over all rows at once: passes 1-2 prepare, pass 3 streams as any loss
    loss_fn = mbs_ext.CachedLoss(lambda m, mb: m(mb[0]), lambda m, enc: torch.logsumexp(enc, 0).sum())
streamer = mbs_ext.MicroBatchStreamer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, **size)
if path != "auto":
    streamer.step(batch)  # the "auto" path plans in its first step: trace that one

def is_batch(v):  # the batch, or CachedLoss's pass-3 batch: the batch beside each row's position
    return v is batch or (type(v) is tuple and len(v) == 2 and v[0] is batch)

def holds(frame):
    for v in frame.f_locals.values():
        if is_batch(v) or is_batch(getattr(v, "batch", None)):  # the batch, or a call's record of it
            return True
    return False

chains = set()

def trace(frame, event, arg):
    chain, f = [], frame
    while f is not None:
        if f.f_code.co_filename.startswith(package) and holds(f):
            name = os.path.relpath(f.f_code.co_filename, package)
            if not chain or chain[-1] != name:
                chain.append(name)
        f = f.f_back
    chains.add(tuple(reversed(chain)))
    return trace

sys.settrace(trace)
try:
    streamer.step(batch)
finally:
    sys.settrace(None)
print(json.dumps(sorted(chains)))
"""


@pytest.mark.slow  # four fresh interpreters tracing a step line by line
@pytest.mark.parametrize("path", ["fixed", "auto", "ddp", "cached_loss"])
def test_the_batch_flows_one_way_through_the_package(path):
    """Followed through a step - fixed size, ``"auto"`` (planning included), DDP and CachedLoss
    (its passes 1-2, then its pass 3 through the step's own way in) - at every
    moment, the files of mbs_ext whose frames hold the caller's batch (or a call's record of it)
    form a chain from the step down: no file is in its own chain twice (the batch is handed on,
    never back into a file it came through), and the ring is on the way."""
    import json
    import os
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = run_python(["-c", _PATH_PROBE, path, str(PACKAGE) + os.sep, str(port)], timeout=300).stdout
    chains = [tuple(c) for c in json.loads(out.strip().splitlines()[-1]) if c]
    assert chains and all(c[0] == "step/streamer.py" for c in chains), chains
    assert any("streaming/ring.py" in c for c in chains), chains
    if path == "cached_loss":  # pass 3 runs the attempt as any loss does, with no call of its own into it
        assert any("step/attempt.py" in c for c in chains) and any("step/cached.py" in c for c in chains), chains
        assert not any("step/attempt.py" in c and "step/cached.py" in c for c in chains), chains
    back = [c for c in chains if len(set(c)) != len(c)]
    assert not back, f"the batch flows back into a file it came through: {back}"


def _core_files():
    return [p for p in sorted(PACKAGE.rglob("*.py")) if "apps" not in p.relative_to(PACKAGE).parts]


def test_no_backslash_continuations():
    """Lines are joined by brackets, never by a trailing backslash (which simple tools misread)."""
    import io
    import tokenize

    found = []
    for path in _core_files():
        text = path.read_text()
        lines = text.splitlines()
        strings = set()  # lines inside string tokens (a backslash there is text)
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.STRING:
                strings.update(range(tok.start[0], tok.end[0]))
        found += [f"{path.relative_to(ROOT)}:{i}" for i, line in enumerate(lines, 1)
                  if line.rstrip().endswith("\\") and i not in strings and not line.lstrip().startswith("#")]
    assert not found, found


def _mode_tests(tree: ast.AST) -> list[int]:
    """Lines where code asks which distributed mode it runs in: the world's kind, DDP/FSDP2 found
    by hand, the size of torch.distributed's world, or whether a process group is set."""
    worlds = {"World", "Replicas", "Shards", "DistributedDataParallel"}
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("fsdp", "ddp", "summing", "get_world_size"):
            lines.append(node.lineno)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("isinstance", "hasattr"):
            names = {getattr(n, "id", getattr(n, "attr", None)) for n in ast.walk(node.args[1])}
            if names & worlds or "_get_fsdp_state" in {getattr(n, "value", None) for n in ast.walk(node.args[1])}:
                lines.append(node.lineno)
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Attribute) and s.attr in ("group", "process_group") for s in sides):
                lines.append(node.lineno)
    return sorted(set(lines))


def test_distributed_modes_are_asked_in_the_world_only():
    """What differs between one process, replicas and shards lives in mbs_ext/world; the rest of
    the core calls its hooks and asks which mode it runs in at most a handful of times."""
    outside = {}
    for path in _core_files():
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(("world/", "integrations/")):
            continue
        lines = _mode_tests(ast.parse(path.read_text()))
        if lines:
            outside[rel] = lines
    assert sum(map(len, outside.values())) <= 6, outside
    # The check sees what it looks for: the world itself asks.
    assert _mode_tests(ast.parse((PACKAGE / "world" / "__init__.py").read_text()))


def test_every_package_is_installed():
    """pyproject.toml lists packages by name: a new subpackage left out would be missing from an
    installed mbs_ext while every test run from the checkout still passed."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    present = {_module_name(p) for p in PACKAGE.rglob("__init__.py")}
    assert present == listed, (sorted(present - listed), sorted(listed - present))


def test_no_file_holds_an_unresolved_merge():
    """A merge left half done (its conflict markers committed) reads as two versions of the same
    text; docs/design.md once carried one. Every tracked text file is read."""
    import re
    import subprocess

    try:
        tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    marker = re.compile(rb"^(<{7} |={7}$|>{7} )", re.MULTILINE)
    found = []
    for name in filter(None, tracked.decode().split("\0")):
        path = ROOT / name
        if path.is_file() and path.suffix in {".py", ".md", ".cpp", ".h", ".cu", ".cuh", ".txt", ".toml", ".sh", ""}:
            data = path.read_bytes()
            found += [(name, data.count(b"\n", 0, m.start()) + 1) for m in marker.finditer(data)]
    assert not found, found
