"""The build links the shared C++ runtime (setup.py's compiler check).

A copy of libstdc++ linked into the extension keeps its own locale registry inside the torch
process, and number formatting there breaks: on the GPU machine of 2026-11-26 (torch 2.11,
a default compiler that adds -static-libstdc++) every argument-check message with a number
in it ended the process with SIGSEGV. setup.py probes the compiler and swaps it for one that
links libstdc++.so; these tests run that probe against real compilers.
"""

from __future__ import annotations

import importlib.util
import runpy
import shutil
import subprocess
from pathlib import Path

import pytest

import mbs_ext  # noqa: F401  (loads the extension)

ROOT = Path(__file__).resolve().parent.parent
needs_toolchain = pytest.mark.skipif(
    shutil.which("g++") is None or shutil.which("readelf") is None, reason="needs g++ and readelf"
)


@pytest.fixture(scope="module")
def setup_helpers() -> dict:
    return runpy.run_path(str(ROOT / "setup.py"), run_name="setup_helpers")  # does not build


@pytest.fixture
def static_gxx(tmp_path: Path) -> str:
    """A compiler like the GPU machine's: g++ that links libstdc++ into every shared object."""
    wrapper = tmp_path / "g++"
    wrapper.write_text(f'#!/bin/sh\nexec {shutil.which("g++")} -static-libstdc++ "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


@needs_toolchain
def test_the_probe_tells_a_static_runtime_from_a_shared_one(setup_helpers, static_gxx):
    probe = setup_helpers["links_shared_runtime"]
    assert probe("g++") is True
    assert probe(static_gxx) is False
    assert probe("/nonexistent/g++") is None  # cannot tell: the build goes on as before


@needs_toolchain
@pytest.mark.skipif(shutil.which("ldd") is None, reason="needs ldd")
def test_without_readelf_the_probe_reads_ldd(setup_helpers, static_gxx, monkeypatch):
    which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "readelf" else which(name, *a, **k))
    probe = setup_helpers["links_shared_runtime"]
    assert probe("g++") is True
    assert probe(static_gxx) is False


@needs_toolchain
def test_a_static_runtime_compiler_is_replaced_by_a_shared_one(setup_helpers, static_gxx):
    chosen = setup_helpers["choose_cxx"]({"CXX": static_gxx})
    assert chosen is not None and chosen["CXX"] != static_gxx
    assert setup_helpers["links_shared_runtime"](chosen["CXX"]) is True
    assert setup_helpers["choose_cxx"]({"CXX": shutil.which("g++")}) is None  # a good one is kept


@pytest.mark.skipif(shutil.which("readelf") is None, reason="needs readelf")
def test_the_extension_links_the_shared_cpp_runtime():
    library = importlib.util.find_spec("mbs_ext._C").origin
    needed = subprocess.run(["readelf", "-d", library], capture_output=True, text=True, check=True)
    libs = [line for line in needed.stdout.splitlines() if "(NEEDED)" in line]
    assert any("libstdc++" in line or "libc++" in line for line in libs), libs
