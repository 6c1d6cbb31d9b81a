"""The Table 4 miniature: a capped child where the full batch fails and MBS trains."""

from __future__ import annotations

import json
import sys

import pytest
import torch

pytest.importorskip("sklearn")

from mbs_ext.apps import table  # noqa: E402

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc and RLIMIT_AS")


@pytest.fixture(scope="module")
def cal():
    """One calibration child at B=1024, micro-batch 16 (shared by the capped-child tests)."""
    return table.calibrate(1024, micro=16, epochs=1, max_steps=1, threads=1)


@linux_only
@pytest.mark.slow
@pytest.mark.memory_study
def test_capped_child_full_batch_fails_mbs_succeeds(cal):
    assert 0 < cal["growth"] < 64 << 20, cal
    res = table.run_child("row", 1024, micro=16, cap_bytes=cal["cap"], epochs=1, max_steps=1, threads=1)
    assert res["returncode"] == 0, res["stderr"]
    mbs, full = res["mbs"], res["full"]
    assert mbs["ok"], mbs
    assert mbs["cap_bytes"] == cal["cap"]
    assert 0.0 <= mbs["accuracy"] <= 1.0 and mbs["epoch_s"] > 0
    assert not full["ok"], full
    assert "allocate" in full["error"].lower() or "memory" in full["error"].lower(), full["error"]


@linux_only
@pytest.mark.slow
@pytest.mark.memory_study
def test_capped_child_small_full_batch_fits(cal):
    # The cap is not a blanket failure: at B = micro-batch the full batch fits too.
    res = table.run_child("row", 16, micro=16, cap_bytes=cal["cap"], epochs=1, max_steps=2, threads=1)
    assert res["returncode"] == 0, res["stderr"]
    assert res["mbs"]["ok"] and res["full"]["ok"], res
    # Same initial weights, same data order, one micro-batch per step: the same model.
    assert res["mbs"]["accuracy"] == pytest.approx(res["full"]["accuracy"], abs=0.01)


def test_parse_sizes():
    assert table._parse_sizes("16,32,all", 100) == [16, 32, 100]
    assert table._parse_sizes("512,16,full,16", 100) == [16, 100]


def test_write_table(tmp_path):
    ok = {"ok": True, "accuracy": 0.9, "epoch_s": 1.25}
    rows = [
        {"size": 16, "micro": 16, "full": dict(ok), "mbs": dict(ok, epoch_s=1.5)},
        {
            "size": 1024,
            "micro": 16,
            "full": {"ok": False, "error": "RuntimeError: can't allocate"},
            "mbs": dict(ok, accuracy=0.5),
        },
    ]
    meta = {"epochs": 1, "n_train": 1437, "n_test": 360, "growth_bytes": 10 << 20, "cap_bytes": 31 << 20}
    paths = table.write_table(rows, tmp_path / "out", meta)
    md = paths["md"].read_text()
    assert "| 16 | 16 | 90.00% | 1.25 | 90.00% | 1.50 |" in md
    assert "| 1024 | 16 | Failed | Failed | 50.00% | 1.25 |" in md
    assert paths["png"].stat().st_size > 1000
    assert json.loads(paths["json"].read_text())["rows"][1]["full"]["ok"] is False


@linux_only
@pytest.mark.slow
@pytest.mark.memory_study
def test_main_tiny(tmp_path, capsys):
    out = tmp_path / "tbl"
    argv = ["--out", str(out), "--epochs", "1", "--max-steps", "1", "--sizes", "16,all", "--sweep", "1"]
    assert table.main(argv) == 0
    md = (out / "table.md").read_text()
    assert (out / "table.png").exists()
    data = json.loads((out / "table.json").read_text())
    sizes = [r["size"] for r in data["rows"]]
    assert sizes == [16, data["meta"]["n_train"]]
    assert all(r["mbs"]["ok"] for r in data["rows"])
    assert data["rows"][0]["full"]["ok"] and not data["rows"][1]["full"]["ok"]
    assert "Failed" in md and "Failed" in capsys.readouterr().out
    # The sweep ran too (one multiple here), beside the table.
    assert (out / "sweep.png").stat().st_size > 1000
    assert data["sweep"]["multiples"] == [1] and set(data["sweep"]["models"]) == set(table.SWEEP_MODELS)
    assert "## Peak memory against mini-batch size" in md


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
def test_gpu_table_without_cuda_is_a_clear_error(capsys):
    assert table.main(["--device", "cuda", "--model", "resnet50", "--cap-gib", "4"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_gpu_table_bisects_the_largest_full_batch(monkeypatch):
    """The search finds the limit with few children, whatever it is."""
    from mbs_ext.apps import table_gpu

    for limit in (1, 7, 45, 300):
        calls = []

        def fake_run(cfg, timeout_s, limit=limit, calls=calls):
            calls.append(cfg["batch"])
            return {"oom": cfg["batch"] > limit}

        monkeypatch.setattr(table_gpu, "_run", fake_run)
        found = table_gpu.largest_full_batch({}, 1.0)
        assert limit - limit // 32 <= found <= limit and len(calls) <= 16, (limit, found, calls)


# --------------------------------------------------------------------------- the sweep


@linux_only
@pytest.mark.slow
@pytest.mark.memory_study
def test_sweep_mbs_peak_is_flat_and_the_full_batch_fails(cal):
    """The papers' property, measured by the OS: one MBS step at 16x the largest full batch F
    peaks within a few MiB of one at 1x, for the plain CNN and the BatchNorm one, under the same
    cap where the full batch fails just above F."""
    res = table.sweep([1, 16], cap=cal["cap"], micro=16, jobs=2, threads=1, log=lambda *a, **k: None)
    assert res["multiples"] == [1, 16]
    for model, found in res["models"].items():
        f, failed = found["full_batch"], found["failed_at"]
        assert f is not None and 16 <= f < failed <= 2 * f, (model, f, failed)
        full = {r["size"]: r for r in found["full"]}
        assert all(r["ok"] for size, r in full.items() if size <= f) and not full[failed]["ok"], found["full"]
        assert len(found["mbs"]) == 2 and all(r["ok"] for r in found["mbs"]), found["mbs"]
        one, sixteen = found["mbs"]
        assert (one["size"], sixteen["size"], sixteen["multiple"]) == (f, 16 * f, 16)
        assert abs(sixteen["peak_rss"] - one["peak_rss"]) < 3 << 20, (model, one, sixteen)
        # ... and far below what the full batch needed at 1x.
        assert sixteen["peak_rss"] < full[f]["peak_rss"] / 2, (model, sixteen, full[f])


def test_full_batch_sizes():
    sizes = table.full_batch_sizes(16, limit=256)
    assert sizes[0] == 16 and sizes[-1] == 256 and sizes == sorted(set(sizes))
    assert all(1.1 < b / a < 1.3 for a, b in zip(sizes, sizes[1:]))


def test_sweep_option():
    assert table._parser().parse_args([]).sweep is None  # auto: the device's default
    assert table.sweep_multiples(None, "cpu") == [1, 4, 16, 64, 256]
    assert table.sweep_multiples(None, "cuda") == [16, 64, 91]
    assert table.sweep_multiples([2, 8], "cuda") == [2, 8]
    assert table._parser().parse_args(["--sweep", "auto"]).sweep is None
    assert table._parser().parse_args(["--sweep", "16,1,4,1"]).sweep == [1, 4, 16]
    assert table._parser().parse_args(["--sweep", "none"]).sweep == []
    for bad in ("0", "1,x", ",", ""):
        with pytest.raises(SystemExit):
            table._parser().parse_args(["--sweep", bad])


def test_write_table_with_sweep(tmp_path):
    def rec(size, peak_mib, rate=500.0, ok=True, **kw):
        return {"size": size, "ok": ok, "peak_rss": int(peak_mib * (1 << 20)), "samples_per_s": rate, **kw}

    sweep = {
        "micro": 16, "cap_bytes": 30 << 20, "multiples": [1, 4],
        "models": {
            "cnn": {
                "full_batch": 100, "failed_at": 119,
                "full": [rec(84, 19.0), rec(100, 22.0, 400.0), rec(119, 29.0, ok=False, error="RuntimeError: x")],
                "mbs": [rec(100, 4.0, 600.0, multiple=1), rec(400, 4.5, 650.0, multiple=4)],
            },
        },
    }
    ok = {"ok": True, "accuracy": 0.9, "epoch_s": 1.25}
    rows = [{"size": 16, "micro": 16, "full": dict(ok), "mbs": dict(ok)}]
    paths = table.write_table(rows, tmp_path, {"n_train": 1437, "cap_bytes": 30 << 20}, sweep)
    md = paths["md"].read_text()
    assert "| cnn | 1 | 100 | 22.0 | 400 | 4.0 | 600 |" in md
    assert "| cnn | 4 | 400 | Failed | Failed | 4.5 | 650 |" in md  # failed at 119: not run again
    assert "F = 100" in md and "119: Failed (RuntimeError: x)" in md
    assert paths["sweep_png"].stat().st_size > 1000
    assert json.loads(paths["json"].read_text())["sweep"]["models"]["cnn"]["full_batch"] == 100


def test_help_names_the_sweep_option(capsys):
    with pytest.raises(SystemExit):
        table.main(["--help"])
    assert "--sweep MULTIPLES" in " ".join(capsys.readouterr().out.split())
