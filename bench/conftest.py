"""Make bench/ helper modules importable by the studies; say where their results go."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def pytest_report_header() -> str:
    from _results import results_dir

    return f"bench results go to {results_dir()} (bench/_results.py: MBS_BENCH_OUT, MBS_BENCH_UPDATE=1)"
