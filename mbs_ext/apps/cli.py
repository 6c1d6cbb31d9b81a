"""``python -m mbs_ext`` (also installed as ``mbs-ext``): the demo, the paper's Table 4, and build facts.

Every usage line and message says :data:`PROG` (``demo`` and ``table`` spell it in their own
parsers, as they cannot import this module, which imports them); ``tests/test_cli.py``
checks that they agree.
"""

from __future__ import annotations

import argparse
import json
import sys

PROG = "python -m mbs_ext"  # the name every usage line and message uses; `mbs-ext` runs the same main()
COMMANDS = {
    "demo": "train a CNN on real digits with a mini-batch larger than a memory budget, next to full-batch steps",
    "table": "the papers' Table 4: full batch vs MBS under a memory cap (a CPU miniature, or --device cuda)",
    "info": "print what this build of mbs_ext contains (build_info() as JSON)",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Micro-Batch Streaming for PyTorch: train mini-batches larger than device memory. "
        "Installed, `mbs-ext` is the same program.",
        epilog=f"Each command lists its options and their defaults: {PROG} COMMAND --help",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands", required=True)
    for name, summary in COMMANDS.items():
        # Only the name is parsed here; each command's own parser reads the rest (and its --help).
        commands.add_parser(name, help=summary, add_help=False)
    return parser


def _info(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog=f"{PROG} info", description=COMMANDS["info"])
    parser.parse_args(argv)
    import mbs_ext

    print(json.dumps(mbs_ext.build_info(), indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if not argv:
        parser.print_help(sys.stderr)
        return 2
    command = parser.parse_args(argv[:1]).command  # -h/--help prints the help and exits 0
    if command == "demo":
        from mbs_ext.apps.demo import main as demo

        return demo(argv[1:])
    if command == "table":
        from mbs_ext.apps.table import main as table

        return table(argv[1:])
    return _info(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
