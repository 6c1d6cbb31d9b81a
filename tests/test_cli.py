"""The command line: the demo really trains and matches the full batch; help, errors, wiring."""

from __future__ import annotations

import argparse
import json
import re
import sys

import pytest
from common import run_python

import mbs_ext
from mbs_ext import MicroBatchPlan
from mbs_ext.apps import demo, table, table_gpu
from mbs_ext.apps.cli import PROG, main


def test_demo_trains_and_matches_full_batch(tmp_path, capsys):
    # float64: the MBS and full-batch runs then differ only by float64 rounding, on any machine
    # and thread count (in float32, reduction order alone moved the curves 4.5e-4 apart on a GPU).
    argv = ["demo", "--epochs", "1", "--batch-size", "128", "--budget-mb", "4", "--dtype", "float64"]
    code = main([*argv, "--out", str(tmp_path)])
    assert code == 0
    summary = json.loads((tmp_path / "demo.json").read_text())
    assert (tmp_path / "demo.png").stat().st_size > 10_000
    assert 1 <= summary["micro_batch"] < 128  # the budget forced streaming
    assert summary["saved_bytes_micro_batch"] <= 4 * 2**20 < summary["saved_bytes_full_batch"]
    # BatchNorm-free: the two loss curves coincide to float64 rounding (a 1/M weighting of the
    # uneven split, or any other normalization error, is many orders of magnitude larger).
    assert summary["max_loss_gap"] < 1e-9
    assert summary["test_accuracy_mbs"] == summary["test_accuracy_full"]
    assert summary["test_accuracy_mbs"] > 0.3  # better than chance (0.1) after one epoch
    # The size came from the planner for this budget, and the demo says so.
    assert summary["micro_batch_origin"] == "budget"
    assert summary["planned_micro_batch"] == summary["micro_batch"]
    out = capsys.readouterr().out
    assert f"micro-batch size chosen for the 4 MiB budget: {summary['micro_batch']} (mini-batch 128)" in out


@pytest.mark.slow  # a fresh interpreter
def test_info_prints_build_info():
    out = run_python(["-m", "mbs_ext", "info"], timeout=120)
    assert json.loads(out.stdout) == mbs_ext.build_info()


def test_bad_command_and_options_are_rejected(capsys):
    assert main([]) == 2
    assert f"usage: {PROG}" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["demo", "--micro-batch", "big"])
    assert info.value.code == 2
    assert "--micro-batch" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["demo", "--device", "tpu"])
    assert "--device" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["train"])
    assert info.value.code == 2
    assert "invalid choice: 'train'" in capsys.readouterr().err


# --------------------------------------------------------------------------- --help


def _help(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    return capsys.readouterr().out


def _option_entries(help_text: str) -> dict[str, str]:
    """Each option of an argparse help, by its first flag, with its whole entry on one line."""
    entries: dict[str, str] = {}
    flag = None
    for line in help_text.splitlines():
        m = re.match(r"  (-{1,2}[\w-]+)", line)
        if m:
            flag = m.group(1)
            entries[flag] = ""
        elif not line.strip() or not line.startswith("   "):
            flag = None  # a blank line or a section title ends an entry
        if flag:
            entries[flag] = " ".join((entries[flag] + " " + line).split())
    return entries


@pytest.mark.slow  # a fresh interpreter
def test_help_lists_the_commands_under_one_program_name(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "100")  # the same line width here and in the subprocess
    monkeypatch.setattr(sys, "argv", ["/somewhere/bin/mbs-ext", "--help"])  # the console script's argv[0]
    text = _help(sys.argv[1:], capsys)
    assert text.startswith(f"usage: {PROG} ")
    for command in ("demo", "table", "info"):
        assert re.search(rf"^\s+{command}\s+\S", text, re.M), f"{command} is not listed:\n{text}"
    assert f"{PROG} COMMAND --help" in " ".join(text.split())
    # The same name through `python -m mbs_ext`, not "__main__.py".
    proc = run_python(["-m", "mbs_ext", "--help"], timeout=120)
    assert proc.stdout == text


def test_every_app_names_the_same_program():
    # demo and table cannot import cli.PROG (cli imports them), so they spell it out.
    assert demo.PROG == f"{PROG} demo"
    assert table.PROG == f"{PROG} table"
    assert table_gpu.PROG == f"{PROG} table --device cuda"


DEMO_DEFAULTS = {
    "--epochs": "12", "--batch-size": "256", "--budget-mb": "4.0", "--micro-batch": "auto", "--lr": "0.002",
    "--device": "auto", "--dtype": "float32", "--out": "mbs_demo", "--seed": "0", "--no-baseline": "False",
}
TABLE_DEFAULTS = {
    "--out": "mbs_table", "--epochs": "3", "--micro-batch": "16", "--sizes": "16,32,64,128,256,512,1024,all",
    "--jobs": "0", "--max-steps": "0", "--seed": "0", "--lr": "0.001", "--image-size": "auto",
    "--device": "cpu", "--model": "resnet50", "--cap-gib": "4.0", "--rounds": "3", "--steps": "3",
    "--sweep": "auto", "--full-batch": "0",
}


@pytest.mark.parametrize(
    "command, defaults", [("demo", DEMO_DEFAULTS), ("table", TABLE_DEFAULTS), ("info", {})]
)
def test_command_help_lists_every_option_with_its_default(command, defaults, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "100")
    text = _help([command, "--help"], capsys)
    assert text.startswith(f"usage: {PROG} {command} ")
    entries = _option_entries(text)
    assert set(entries) == {"-h", *defaults}, text
    for option, default in defaults.items():
        assert f"(default: {default}" in entries[option], entries[option]


# --------------------------------------------------------------------------- invalid numbers

BAD_NUMBERS = [
    ("demo", "--epochs", "0"), ("demo", "--epochs", "-2"), ("demo", "--epochs", "1.5"),
    ("demo", "--batch-size", "0"),
    ("demo", "--budget-mb", "0"), ("demo", "--budget-mb", "-4"), ("demo", "--budget-mb", "nan"),
    ("demo", "--budget-mb", "inf"), ("demo", "--budget-mb", "lots"),
    ("demo", "--micro-batch", "0"), ("demo", "--micro-batch", "-8"), ("demo", "--micro-batch", "2.5"),
    ("demo", "--lr", "0"), ("demo", "--lr", "nan"),
    ("demo", "--seed", "-1"), ("demo", "--seed", str(2**32)),
    ("table", "--epochs", "0"), ("table", "--micro-batch", "0"),
    ("table", "--sizes", "0"), ("table", "--sizes", "16,x"), ("table", "--sizes", ","),
    ("table", "--jobs", "-1"), ("table", "--max-steps", "-1"), ("table", "--seed", "-5"),
    ("table", "--lr", "-0.1"), ("table", "--image-size", "0"), ("table", "--image-size", "3"),
    ("table", "--image-size", "big"),
    ("table", "--cap-gib", "0"), ("table", "--cap-gib", "inf"), ("table", "--rounds", "0"), ("table", "--steps", "0"),
]


@pytest.mark.parametrize("command, option, value", BAD_NUMBERS)
def test_an_invalid_number_is_a_usage_error_naming_the_option(command, option, value, capsys):
    with pytest.raises(SystemExit) as info:
        main([command, option, value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: {PROG} {command} ")
    assert f"error: argument {option}: " in err
    assert "Traceback" not in err


@pytest.mark.parametrize("command", ["demo", "table"])
def test_an_output_directory_that_cannot_be_made_is_a_usage_error(command, tmp_path, capsys):
    """Said before the run, not as a traceback after it: under a file, and a file itself."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for out, says in [(blocker / "out", "cannot be created in"), (blocker, "is not a directory")]:
        with pytest.raises(SystemExit) as info:
            main([command, "--out", str(out)])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert f"error: argument --out: {str(out)!r} {says}" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # nothing left behind


def test_a_budget_too_small_for_the_model_is_a_usage_error(tmp_path, capsys):
    # Positive, so it passes the type check; the planner then finds not one sample fits.
    out = tmp_path / "demo"
    with pytest.raises(SystemExit) as info:
        main(["demo", "--budget-mb", "0.01", "--device", "cpu", "--out", str(out)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: {PROG} demo ")
    assert "error: argument --budget-mb: 0.01 MiB does not fit" in err
    assert not out.exists()  # stopped before training


# --------------------------------------------------------------------------- missing extras


@pytest.mark.slow  # a fresh interpreter
def test_table_without_scikit_learn_says_what_to_install(tmp_path):
    out = tmp_path / "table"
    code = "\n".join([
        "import runpy, sys",
        "sys.modules['sklearn'] = None  # importing sklearn now fails, as if it were not installed",
        f"sys.argv = ['mbs_ext', 'table', '--out', {str(out)!r}, '--sizes', '16']",
        "runpy.run_module('mbs_ext', run_name='__main__', alter_sys=True)",
    ])
    proc = run_python(code, cwd=tmp_path, timeout=120, check=False)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip() == (
        f"{PROG} table needs scikit-learn, which is not installed: "
        "pip install 'mbs_ext[demo]' (or: pip install scikit-learn)"
    )
    assert not out.exists()


def test_demo_without_scikit_learn_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn", None)  # importing sklearn now fails, as if it were not installed
    with pytest.raises(SystemExit) as info:
        main(["demo", "--device", "cpu", "--out", str(tmp_path / "demo")])
    assert info.value.code == f"{PROG} demo needs scikit-learn, which is not installed: " + (
        "pip install 'mbs_ext[demo]' (or: pip install scikit-learn)"
    )


# --------------------------------------------------------------------------- what the demo says


def _plan(micro: int, rows: int) -> MicroBatchPlan:
    return MicroBatchPlan(
        micro_batch_size=micro, saved_bytes_per_sample=1, input_bytes_per_sample=1, per_sample_bytes=2,
        fixed_bytes=0, memory_budget=4 << 20, num_rows=rows,
    )


@pytest.mark.parametrize(
    "micro_batch, used, plans, origin, sentence",
    [
        ("auto", 40, {"k": _plan(40, 256)}, "budget",
         "micro-batch size chosen for the 4 MiB budget: 40 (mini-batch 256)"),
        ("auto", 256, {"k": _plan(256, 256)}, "budget",
         "micro-batch size 256: the whole mini-batch of 256 fits the 4 MiB budget, so nothing is streamed"),
        ("auto", 20, {"k": _plan(40, 256)}, "backoff",
         "micro-batch size 20: planned 40 for the 4 MiB budget, lowered by out-of-memory back-off"),
        (32, 32, {}, "fixed", "micro-batch size 32, set with --micro-batch (not planned; --budget-mb is unused)"),
        (999, 256, {}, "fixed",
         "micro-batch size 256: --micro-batch 999 is more than the mini-batch of 256 "
         "(not planned; --budget-mb is unused)"),
        (32, 16, {}, "backoff", "micro-batch size 16: --micro-batch 32, lowered by out-of-memory back-off"),
    ],
)
def test_demo_says_chosen_for_the_budget_only_when_the_planner_chose_it(micro_batch, used, plans, origin, sentence):
    args = argparse.Namespace(micro_batch=micro_batch, budget_mb=4.0)
    got = demo._micro_batch_origin(args, used, 256, plans)
    assert got[0] == origin and got[2] == sentence
    assert ("chosen for" in sentence) == (origin == "budget" and used < 256)


def test_demo_at_a_fixed_micro_batch_does_not_claim_the_budget(tmp_path, capsys):
    argv = ["demo", "--epochs", "1", "--batch-size", "256", "--micro-batch", "64", "--no-baseline", "--device", "cpu"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "budget" not in out.replace("--budget-mb is unused", "")
    assert "micro-batch size 64, set with --micro-batch (not planned; --budget-mb is unused)" in out
    summary = json.loads((tmp_path / "demo.json").read_text())
    assert summary["micro_batch"] == 64
    assert (summary["micro_batch_origin"], summary["planned_micro_batch"]) == ("fixed", None)
