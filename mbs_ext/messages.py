"""How errors and warnings reach the user: notes on exceptions, warnings that point at the caller.

Used wherever the step raises or warns (the finish, the back-off, a failing rank's join), so
that every message is added and pointed the same way.
"""

from __future__ import annotations

import os
import sys

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def add_note(exc: BaseException, text: str) -> None:
    """Note ``text`` on ``exc`` where Python can (3.11 and later), for the user to read."""
    if hasattr(exc, "add_note"):
        exc.add_note(text)


def caller_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning point at the first frame outside mbs_ext."""
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    return level
