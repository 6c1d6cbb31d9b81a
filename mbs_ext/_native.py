"""Loads the compiled extension once, with an actionable error when it is missing."""

from __future__ import annotations

import torch  # noqa: F401  (registers the dispatcher before the extension loads)

try:
    from mbs_ext import _C
except ImportError as exc:  # pragma: no cover - only on a broken install
    raise ImportError(
        "mbs_ext._C is not built. Install with `pip install --no-build-isolation .` "
        "(or `python setup.py build_ext --inplace` in a checkout)."
    ) from exc

__all__ = ["_C"]
