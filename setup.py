"""Build mbs_ext._C with torch.utils.cpp_extension.

CUDA sources are compiled whenever the installed torch has CUDA and a CUDA toolkit
is found -- a GPU is not needed to compile. ``MBS_EXT_CUDA=0`` forces a CPU-only
build, ``MBS_EXT_CUDA=1`` turns a missing toolkit into an error.

The C++ compiler must link the shared C++ runtime (libstdc++.so): a copy of libstdc++ linked
into the extension (a compiler that adds ``-static-libstdc++``) formats numbers through a
second locale registry inside the torch process, and every message with a number in it
(each argument check) ends the process with SIGSEGV. Such a compiler is replaced by one on
the machine that links it shared, or the build stops and says why (see
docs/known-issues.md).
"""

from __future__ import annotations

import glob
import os
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent.resolve()
DEFAULT_ARCHS = "8.0;9.0+PTX"


def _find_cuda_home() -> str | None:
    """Locate a real CUDA toolkit (one that has include/cuda_runtime.h).

    torch guesses CUDA_HOME from ``which nvcc``; when ``nvcc`` on PATH is a wrapper
    script that guess is wrong, so follow the wrapper to the real compiler.
    """
    candidates: list[Path] = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]))
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = Path(nvcc).resolve()
        candidates.append(real.parent.parent)
        try:  # a shell wrapper: look for an absolute .../bin/nvcc inside it
            text = real.read_text(errors="ignore") if real.stat().st_size < 65536 else ""
        except OSError:
            text = ""
        for token in text.replace('"', " ").replace("'", " ").split():
            if token.startswith("/") and token.endswith("/bin/nvcc"):
                candidates.append(Path(token).resolve().parent.parent)
    candidates += [Path("/usr/local/cuda")] + sorted(
        Path(p) for p in glob.glob("/usr/local/cuda-*")
    )
    for home in candidates:
        if (home / "include" / "cuda_runtime.h").is_file() and (home / "bin" / "nvcc").exists():
            return str(home.resolve())
    return None


_PROBE_SOURCE = "#include <sstream>\nint mbs_probe() { std::ostringstream s; s << 1; return int(s.str().size()); }\n"


def links_shared_runtime(cxx: str) -> bool | None:
    """Whether ``cxx`` links a shared object against the shared C++ runtime, read from the
    dynamic section of a one-line probe it builds (``readelf -d``, else ``ldd``); None when that
    cannot be told (the compiler, or both readers, missing or failing)."""
    reader = shutil.which("readelf") or shutil.which("ldd")
    if reader is None:
        return None
    args = ["-d"] if Path(reader).name == "readelf" else []
    with tempfile.TemporaryDirectory() as tmp:
        src, lib = Path(tmp, "probe.cpp"), Path(tmp, "probe.so")
        src.write_text(_PROBE_SOURCE)
        try:
            built = subprocess.run([*shlex.split(cxx), "-shared", "-fPIC", str(src), "-o", str(lib)],
                                   capture_output=True, timeout=120)
            if built.returncode != 0:
                return None
            dynamic = subprocess.run([reader, *args, str(lib)], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return None
    if dynamic.returncode != 0:
        return None
    # readelf: "(NEEDED) Shared library: [libstdc++.so.6]"; ldd: "libstdc++.so.6 => /lib/...".
    needed = [line for line in dynamic.stdout.splitlines() if "(NEEDED)" in line or "=>" in line]
    return any("libstdc++" in line or "libc++" in line for line in needed)


def choose_cxx(env: dict[str, str]) -> dict[str, str] | None:
    """``CC``/``CXX`` to build with when the compiler the build would use links its own copy of
    the C++ runtime (see the module docstring); None to keep it. Raises when no compiler on
    the machine links the shared runtime."""
    current = env.get("CXX") or sysconfig.get_config_var("CXX") or "c++"
    if links_shared_runtime(current) is not False:
        return None
    tried = [current]
    for cxx in ("/usr/bin/g++", "/usr/bin/c++", "g++", "c++", "clang++"):
        path = shutil.which(cxx)
        if path is None or path in tried or Path(path).resolve() == Path(shutil.which(current) or current).resolve():
            continue
        tried.append(path)
        if links_shared_runtime(path):
            cc = {"g++": "gcc", "c++": "cc", "clang++": "clang"}[Path(path).name]
            return {"CXX": path, "CC": shutil.which(cc, path=str(Path(path).parent)) or path}
    raise RuntimeError(
        f"mbs_ext: the C++ compiler {current!r} links its own copy of libstdc++ into shared objects "
        "(-static-libstdc++), and an extension built so crashes inside torch on its first message "
        f"with a number in it; no other compiler found links the shared runtime (tried {tried}). "
        "Set CXX (and CC) to a compiler that links libstdc++.so, e.g. the distribution's g++."
    )


def _use_shared_runtime() -> None:
    chosen = choose_cxx(dict(os.environ))
    if chosen is not None:
        print(f"mbs_ext: {os.environ.get('CXX') or 'the default C++ compiler'} links libstdc++ statically into "
              f"shared objects; building with CXX={chosen['CXX']} CC={chosen['CC']} instead (see setup.py)")
        os.environ.update(chosen)


def _want_cuda() -> bool:
    flag = os.environ.get("MBS_EXT_CUDA", "").strip()
    if flag == "0":
        return False
    import torch

    home = _find_cuda_home()
    if torch.version.cuda is None or home is None:
        if flag == "1":
            raise RuntimeError(
                "MBS_EXT_CUDA=1 but a CUDA build is impossible: "
                f"torch.version.cuda={torch.version.cuda!r}, CUDA toolkit found at {home!r}. "
                "Install a CUDA build of torch and set CUDA_HOME to the toolkit root."
            )
        return False
    os.environ["CUDA_HOME"] = home
    if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        try:
            has_gpu = torch.cuda.is_available()
        except Exception:
            has_gpu = False
        if not has_gpu:
            os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_ARCHS
    return True


def _extension():
    import torch
    from torch.utils import cpp_extension

    use_cuda = _want_cuda()
    if use_cuda:
        # cpp_extension read CUDA_HOME at import time; refresh it with the real toolkit.
        cpp_extension.CUDA_HOME = os.environ["CUDA_HOME"]

    def cpp_sources(*dirs: str, ext: str = "cpp") -> list[str]:
        # */bindings.cpp are compiled inside csrc/module.cpp: one parse of torch's pybind header.
        return sorted(f for d in dirs for f in glob.glob(f"csrc/{d}/*.{ext}") if Path(f).name != "bindings.cpp")

    # Each directory is one subsystem; cuda/ directories only in a CUDA build, no_cuda/ only without.
    sources = ["csrc/module.cpp"] + cpp_sources("build_info", "ops", "ops/cpu", "ring", "ring/cpu", "ring/core")
    define_macros: list[tuple[str, str | None]] = []
    # -g0: Python's own CFLAGS carry -g, and debug information for torch's headers doubles the
    # compile time of every unit that includes them; MBS_EXT_DEBUG=1 keeps it.
    debug = os.environ.get("MBS_EXT_DEBUG") == "1"
    cxx_flags = ["-O3", "-g" if debug else "-g0", "-fvisibility=hidden"]
    extra_link: list[str] = []
    openmp = torch.backends.openmp.is_available()
    if openmp:
        cxx_flags.append("-fopenmp")
        extra_link.append("-fopenmp")
    define_macros.append(("MBS_EXT_OPENMP", "1" if openmp else "0"))
    if use_cuda:
        sources += cpp_sources("build_info", "ops/cuda", ext="cu") + cpp_sources("ring/cuda")
        define_macros.append(("MBS_EXT_WITH_CUDA", "1"))
        cls = cpp_extension.CUDAExtension
        extra = {"cxx": cxx_flags, "nvcc": ["-O3"]}
    else:
        sources += cpp_sources("ring/no_cuda")
        cls = cpp_extension.CppExtension
        extra = {"cxx": cxx_flags}
    return cls(
        name="mbs_ext._C",
        sources=sources,
        include_dirs=[str(ROOT / "csrc")],
        define_macros=define_macros,
        extra_compile_args=extra,
        extra_link_args=extra_link,
    )


def main() -> None:
    from torch.utils.cpp_extension import BuildExtension

    _use_shared_runtime()
    setup(
        ext_modules=[_extension()],
        cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    )


if __name__ == "__main__":  # setuptools runs this file as __main__; tests import its helpers
    main()
