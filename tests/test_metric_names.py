"""Metric names: presets for TRL and verl logs, one mapping for every monitor, loud mismatches."""

from __future__ import annotations

import argparse
import csv
import json
import warnings
from pathlib import Path

import pytest

from tclightning.callbacks.collapse import CollapseDetector
from tclightning.callbacks.gap_monitor import GapMonitor
from tclightning.callbacks.health_actions import HealthWarning
from tclightning.callbacks.length_feedback import LengthFeedbackMonitor
from tclightning.cli import analyze
from tclightning.errors import TclightningError
from tclightning.health import names as metric_names
from tclightning.health.names import (
    TRL,
    VERL,
    missing_inputs_message,
    resolve_metric_names,
    set_metric_names,
    to_user_names,
)
from tclightning.health.traces import late_length_collapse

from tests.test_health_callbacks import TinyModule, healthy, logged, loader, trainer

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _no_default_names():
    set_metric_names(None)
    yield
    set_metric_names(None)


def health_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, HealthWarning)]


def test_presets_resolve_and_bad_specs_are_one_line_errors():
    assert resolve_metric_names("trl")["reward/mean"] == "reward"
    assert resolve_metric_names("VERL")["response/length_mean"] == "response_length/mean"
    assert resolve_metric_names(None) == {} and resolve_metric_names("canonical") == {}
    with pytest.raises(TclightningError, match="unknown preset 'wandb'"):
        resolve_metric_names("wandb")
    with pytest.raises(TclightningError, match="x is mapped from more than one"):
        resolve_metric_names({"reward/mean": "x", "reward/std": "x"})


def test_docs_table_lists_every_preset_name():
    text = (REPO / "docs" / "metrics.md").read_text()
    for preset in (TRL, VERL):
        for canonical, theirs in preset.items():
            assert f"`{theirs}`" in text and f"`{canonical}`" in text, theirs


def test_messages_use_the_users_names_whole_names_only():
    mapping = {"gap/abs_mean": "rollout/gap", "gap/max": "g"}
    assert to_user_names("gap/abs_mean 0.61 above band; gap/max_x", mapping) == "rollout/gap 0.61 above band; gap/max_x"
    msg = missing_inputs_message("gap", 5, ["gap/abs_mean", "gap/k3"], ["train/loss", "gap_abs", "reward"], {})
    assert "5 steps" in msg and "gap/abs_mean, gap/k3" in msg and "gap_abs" in msg


def test_unmapped_names_warn_once_and_claim_no_health(tmp_path):
    """A module logging `train/reward` etc. without a mapping: one warning per monitor naming what it
    expects and the closest names logged; health/* is -1 (no data), never 0 (healthy)."""
    theirs = {"reward/mean": "train/reward", "response/length_mean": "train/length",
              "response/truncated_frac": "train/truncated", "policy/entropy": "train/entropy",
              "policy/grad_norm": "train/grad_norm", "gap/abs_mean": "train/gap"}
    monitors = [LengthFeedbackMonitor(), GapMonitor()]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer(tmp_path, monitors, 12).fit(TinyModule(healthy, names=theirs), loader())
    messages = health_warnings(record)
    gap = [m for m in messages if m.startswith("[gap]") and "none of its metrics arrived" in m]
    length = [m for m in messages if m.startswith("[length]") and "none of its metrics arrived" in m]
    assert len(gap) == 1 and len(length) == 1, messages
    assert "gap/abs_mean" in gap[0] and "train/gap" in gap[0]
    assert "response/length_mean" in length[0] and "train/length" in length[0]
    assert set(logged(tmp_path, "health/gap").values()) == {-1.0}
    assert set(logged(tmp_path, "health/state").values()) == {-1.0}


def test_one_mapping_serves_every_monitor_and_messages_use_it(tmp_path):
    theirs = {"reward/mean": "train/reward", "gap/abs_mean": "train/gap"}

    def schedule(step: int) -> dict[str, float]:
        return {**healthy(step), "gap/abs_mean": 0.61}

    gap, collapse = GapMonitor(), CollapseDetector(metric_names=theirs)  # the mapping given once
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer(tmp_path, [gap, collapse], 8).fit(TinyModule(schedule, names=theirs), loader())
    assert gap.metric_names == theirs and gap.detector.first_warning_step == 0
    messages = health_warnings(record)
    assert not [m for m in messages if "none of its metrics arrived" in m]
    level = [m for m in messages if "gap.level" in m]
    # printed once for the run although both monitors found it, in the user's name
    assert len(level) == 1 and "train/gap 0.61" in level[0] and "gap/abs_mean" not in level[0], messages
    for monitor in (gap, collapse):  # ... and kept in both monitors' timelines
        assert [e.rule for e in monitor.detector.events if e.kind == "fired"].count("gap.level") == 1
    assert logged(tmp_path, "health/state")[7] == 1.0


def test_set_metric_names_once_for_all_monitors_and_conflicts_are_errors(tmp_path):
    set_metric_names("trl")
    monitor = GapMonitor()
    trl_gap = {"reward": 0.5, "sampling/sampling_logp_difference/mean": 0.61}

    def schedule(step: int) -> dict[str, float]:
        return trl_gap

    trainer(tmp_path, [monitor], 3).fit(TinyModule(schedule), loader())
    assert monitor.detector.first_warning_step == 0
    set_metric_names(None)
    conflicting = [GapMonitor(metric_names="trl"), CollapseDetector(metric_names="verl"), LengthFeedbackMonitor()]
    with pytest.raises(TclightningError, match="maps reward/mean to both reward and critic/score/mean"):
        trainer(tmp_path, conflicting, 2).fit(TinyModule(schedule), loader())


def trl_csv(path: Path) -> int:
    """A TRL-style log (log_history columns) of the synthetic late length collapse; returns its collapse step."""
    trace = late_length_collapse(0)
    canonical_to_trl = dict(TRL)
    rows = []
    for step, metrics in trace.rows:
        row = {"step": step}
        for name, value in metrics.items():
            if name in canonical_to_trl:
                row[canonical_to_trl[name]] = value
            elif name.startswith("val/"):
                row["eval_" + name[4:]] = value  # TRL's eval prefix: not mapped, ignored by the rules
        rows.append(row)
    columns = ["step", *sorted({k for r in rows for k in r} - {"step"})]
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    assert trace.collapse_step is not None
    return trace.collapse_step


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tclightning")
    analyze.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["analyze", *argv])
    return args.func(args)


def test_trl_csv_replay_finds_the_planted_collapse(tmp_path, capsys):
    path = tmp_path / "trl_log.csv"
    collapse_step = trl_csv(path)
    # TRL names unread without the preset: an error that says so, not a "healthy" for want of data
    with pytest.raises(TclightningError, match="these look like trl names: add --names trl"):
        run_cli(["health", str(path), "--json"])
    assert run_cli(["health", str(path), "--names", "trl", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["first_warning_step"] is not None and collapse_step - out["first_warning_step"] >= 10
    assert out["first_collapse_step"] is not None and out["first_collapse_step"] > out["first_warning_step"]
    assert run_cli(["health", str(path), "--names", "trl"]) == 0
    text = capsys.readouterr().out
    assert "sampling/sampling_logp_difference/mean" in text and "gap/abs_mean" not in text
    with pytest.raises(TclightningError, match="--names: unknown preset"):
        run_cli(["health", str(path), "--names", "nope"])


@pytest.mark.parametrize("preset", ["trl", "verl"])
def test_yaml_presets_read_the_frameworks_names(preset):
    import yaml

    from tclightning.recipes.loader import resolve_callback_class

    entries = yaml.safe_load((REPO / "callbacks" / f"monitoring-{preset}.yaml").read_text())
    for entry in entries:
        monitor = resolve_callback_class(entry["class_path"], "preset", "class_path")(**entry["init_args"])
        assert monitor.metric_names == dict(getattr(metric_names, preset.upper()))
