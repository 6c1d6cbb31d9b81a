"""argparse types and dependency checks shared by the apps' command lines.

An invalid value becomes ``PROG: error: argument --OPTION: MESSAGE`` after the usage
line, exit status 2: never a traceback.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import tempfile
from pathlib import Path


def int_at_least(low: int):
    """An argparse type: an integer >= ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
        return value

    return parse


def positive(text: str) -> float:
    """An argparse type: a finite number > 0 (not nan, not inf)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def seed(text: str) -> int:
    """An argparse type: a seed scikit-learn takes, 0 .. 2**32 - 1."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"must be an integer from 0 to {2**32 - 1}, got {text!r}")
    return value


def missing(packages: dict[str, str]) -> list[str]:
    """The pip names of the ``{import name: pip name}`` packages that cannot be imported.

    Looked up without importing (``importlib.util.find_spec``); a package blocked with
    ``sys.modules[name] = None`` counts as missing, as an import would.
    """
    return [pip for module, pip in packages.items() if importlib.util.find_spec(module) is None]


def auto_or_int_at_least(low: int):
    """An argparse type: ``auto`` or an integer >= ``low``."""
    as_int = int_at_least(low)

    def parse(text: str) -> int | str:
        if text == "auto":
            return text
        try:
            return as_int(text)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"must be 'auto' or an integer >= {low}, got {text!r}") from None

    return parse


def check_output_dir(parser: argparse.ArgumentParser, path: str) -> None:
    """``--out`` can be made and written (checked before a run, created only at its end): the
    path is a directory or does not exist yet, and its nearest existing ancestor is a directory
    this process may write into. Else a usage error, not a traceback after the run."""
    out = Path(path)
    start = out
    while not start.exists() and start.parent != start:
        start = start.parent
    if not start.is_dir():
        where = "is not a directory" if start == out else f"cannot be created in {str(start)!r}"
        parser.error(f"argument --out: {path!r} {where}")
    try:  # what mkdir would meet there (permissions, a read-only or virtual file system)
        os.rmdir(tempfile.mkdtemp(prefix=".mbs-ext-out-", dir=start))
    except OSError as exc:
        parser.error(f"argument --out: {path!r} cannot be written in {str(start)!r} ({exc.strerror or exc})")
