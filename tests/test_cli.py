"""The command line: the demo really trains and matches the full batch; info and table wiring."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import mbs_ext
from mbs_ext.apps.cli import main


def test_demo_trains_and_matches_full_batch(tmp_path):
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


def test_info_prints_build_info():
    out = subprocess.run([sys.executable, "-m", "mbs_ext", "info"], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == mbs_ext.build_info()


def test_bad_command_and_options_are_rejected(capsys):
    assert main([]) == 2
    with pytest.raises(SystemExit) as info:
        main(["demo", "--micro-batch", "big"])
    assert info.value.code == 2
    assert "--micro-batch" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["demo", "--device", "tpu"])
    assert "--device" in capsys.readouterr().err
