"""``python -m mbs_ext`` / ``mbs-ext``: the demo, the paper's Table 4, and build facts."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="mbs-ext", description="Micro-Batch Streaming for PyTorch")
    parser.add_argument("command", choices=["demo", "table", "info"], help="what to run")
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    args, rest = parser.parse_known_args(argv[:1])
    if args.command == "demo":
        from mbs_ext.apps.demo import main as demo

        return demo(argv[1:])
    if args.command == "table":
        from mbs_ext.apps.table import main as table

        return table(argv[1:])
    import mbs_ext

    print(json.dumps(mbs_ext.build_info(), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
