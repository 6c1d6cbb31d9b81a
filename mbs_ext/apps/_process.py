"""Helpers for measuring child processes: their environment, /proc memory figures, malloc_trim.

Table 4 and the memory benchmark run each configuration in a fresh child under a real
address-space limit; these are the pieces both need.
"""

from __future__ import annotations

import os
from pathlib import Path


def proc_status() -> dict[str, int]:
    """``Vm*`` fields of /proc/self/status, in bytes."""
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Vm"):
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[key] = int(parts[0]) * 1024
    return out


def malloc_trim() -> None:
    """Hand freed heap memory back to the OS (glibc), so RSS tracks live memory."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def child_env(threads: int) -> dict[str, str]:
    """Environment of a measuring child: this checkout importable, few malloc arenas, big
    tensors in their own mappings (freed memory returns to the OS), ``threads`` threads."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])  # the checkout holding mbs_ext/
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["MALLOC_ARENA_MAX"] = "2"
    env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    env["OMP_NUM_THREADS"] = str(threads)
    env["MKL_NUM_THREADS"] = str(threads)
    return env


def os_threads() -> int:
    """Threads of this process as the OS counts them (Linux /proc)."""
    return len(os.listdir("/proc/self/task"))
