"""`tclightning analyze health`: readers (CSVLogger rows, any CSV, TensorBoard) and output."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tclightning.cli import analyze
from tclightning.errors import TclightningError
from tclightning.health.io import read_metrics_csv, read_run
from tclightning.health.traces import late_length_collapse


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tclightning")
    analyze.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["analyze", *argv])
    return args.func(args)


def test_csvlogger_rows_are_merged_by_step(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_text(
        "epoch,step,reward/mean,val/accuracy,train/loss\n"
        "0,0,0.5,,1.0\n"
        "0,0,,0.40,\n"
        "0,1,0.6,,0.9\n"
    )
    rows = read_metrics_csv(path, {"train/loss": "loss/policy"})
    assert rows == [(0, {"reward/mean": 0.5, "val/accuracy": 0.4, "loss/policy": 1.0}),
                    (1, {"reward/mean": 0.6, "loss/policy": 0.9})]


def test_csv_without_step_column_is_a_user_error(tmp_path):
    path = tmp_path / "x.csv"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(TclightningError, match="no 'step' column"):
        read_run(path)
    with pytest.raises(TclightningError, match="no such file"):
        read_run(tmp_path / "missing")


def test_json_output_on_a_run_directory(tmp_path, capsys):
    trace = late_length_collapse(0)
    trace.to_csv(tmp_path / "run" / "metrics.csv")
    assert run_cli(["health", str(tmp_path / "run"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"first_warning_step", "first_collapse_step", "events"}
    assert trace.collapse_step - out["first_warning_step"] >= 10
    assert out["events"][0]["kind"] == "fired" and out["events"][0]["step"] == out["first_warning_step"]


def test_timeline_output_and_name_mapping(tmp_path, capsys):
    path = tmp_path / "mine.csv"
    lines = ["step,my_gap"] + [f"{s},0.61" for s in range(5)]
    path.write_text("\n".join(lines) + "\n")
    assert run_cli(["health", str(path), "--name", "gap/abs_mean=my_gap"]) == 0
    out = capsys.readouterr().out
    assert "gap.level" in out and "before any update" in out and "first warning: step 0" in out
    with pytest.raises(TclightningError, match="CANONICAL=YOURS"):
        run_cli(["health", str(path), "--name", "oops"])


def test_tensorboard_event_files(tmp_path, capsys):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "tb"))
    for step in range(6):
        writer.add_scalar("gap/abs_mean", 0.61, step)
        writer.add_scalar("reward/mean", 0.3, step)
    writer.close()
    rows = read_run(tmp_path)
    assert [s for s, _ in rows] == list(range(6)) and rows[0][1]["gap/abs_mean"] == pytest.approx(0.61)
    assert run_cli(["health", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["first_warning_step"] == 0


def test_main_dispatch_turns_user_errors_into_exit_2(tmp_path, capsys):
    from tclightning.cli.main import main

    assert main(["analyze", "health", str(tmp_path / "nope")]) == 2
    assert "no such file" in capsys.readouterr().err


PRESETS = sorted((Path(__file__).resolve().parents[1] / "callbacks").glob("*.yaml"))


@pytest.mark.parametrize("preset", [p for p in PRESETS if p.stem.startswith(("monitoring", "collapse-guard"))], ids=lambda p: p.stem)
def test_presets_instantiate(preset):
    import importlib

    import yaml

    from tclightning.callbacks.health_actions import HealthMonitor

    entries = yaml.safe_load(preset.read_text())
    assert isinstance(entries, list) and entries
    callbacks = []
    for entry in entries:
        module, _, cls = entry["class_path"].rpartition(".")
        callbacks.append(getattr(importlib.import_module(module), cls)(**entry.get("init_args", {})))
    assert all(isinstance(cb, HealthMonitor) for cb in callbacks)
    assert len({cb.state_key for cb in callbacks}) == len(callbacks)
    if preset.stem == "collapse-guard":
        assert "rollback" in callbacks[-1].actions and callbacks[-1].rollback_lr_scale == 0.5
