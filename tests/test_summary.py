"""The run summary carries the health verdict: final state, first warning and first collapse
(step and rule), rollbacks and stops -- in ``summary.json`` and in the printed table."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from conftest import FAST

from tclightning.grpo.summary import health_summary, print_summary, read_metrics, summarize
from tclightning.health.detector import HealthEvent
from tclightning.health.history import MetricHistory
from tclightning.health.rules import Finding, HealthState, Rule


def write_csv(path: Path, states: list[int | None], rollbacks: list[int] | None = None) -> None:
    """A metrics.csv with reward/mean falling and health/state as given (None: not logged)."""
    header = "epoch,step,reward/mean,health/state" + (",health/collapse_rollbacks" if rollbacks else "")
    lines = [header]
    for step, state in enumerate(states):
        row = f"0,{step},{0.4 - 0.01 * step:.3f},{'' if state is None else state}"
        if rollbacks:
            row += f",{rollbacks[step]}"
        lines.append(row)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def event(step: int, kind: str, rule: str, severity: str, message: str = "m") -> HealthEvent:
    return HealthEvent(step, kind, rule, "reward/mean", severity, severity, message)


def test_healthy_run_from_the_csv_alone(tmp_path):
    write_csv(tmp_path / "metrics.csv", [0] * 8)
    summary = summarize(tmp_path)
    assert summary["health"] == {"state": "healthy", "first_warning": None, "first_collapse": None,
                                 "rollbacks": 0, "stopped": None}
    assert json.loads((tmp_path / "summary.json").read_text())["health"]["state"] == "healthy"


def test_planted_collapse_in_the_csv(tmp_path):
    write_csv(tmp_path / "metrics.csv", [0, 0, 0, 1, 1, 2, 2, None, 2], rollbacks=[0, 0, 0, 0, 0, 0, 1, 1, 1])
    health = summarize(tmp_path)["health"]
    assert health["state"] == "collapsing"
    assert health["first_warning"] == {"step": 3, "rule": None, "message": None}
    assert health["first_collapse"] == {"step": 5, "rule": None, "message": None}
    assert health["rollbacks"] == 1


def test_monitor_events_name_the_rules(tmp_path):
    write_csv(tmp_path / "metrics.csv", [0, 0, 1, 1, 2, 2])
    monitor = SimpleNamespace(
        detector=SimpleNamespace(state=HealthState.COLLAPSING, events=[
            event(2, "fired", "reward.drop", "warning", "reward fell 30%"),
            event(4, "escalated", "reward.drop", "collapsing", "reward fell 90%"),
            HealthEvent(5, "stopped", "collapse", "", "collapsing", "collapsing", "state collapsing"),
        ]),
        rollbacks=0,
    )
    not_a_monitor = SimpleNamespace(name="progress bar")
    health = health_summary(read_metrics(tmp_path / "metrics.csv"), [not_a_monitor, monitor])
    assert health["first_warning"] == {"step": 2, "rule": "reward.drop", "message": "reward fell 30%"}
    assert health["first_collapse"] == {"step": 4, "rule": "reward.drop", "message": "reward fell 90%"}
    assert health["stopped"] == {"step": 5, "reason": "state collapsing"}


def test_unmonitored_run_says_so(tmp_path, capsys):
    (tmp_path / "metrics.csv").write_text("epoch,step,reward/mean\n0,0,0.5\n0,1,0.6\n")
    summary = summarize(tmp_path)
    assert summary["health"]["state"] == "not monitored"
    print_summary(summary)
    assert "not monitored" in capsys.readouterr().out


class PlantedCollapse(Rule):
    """Warns from step 1 and collapses from step 3 on: a collapse on demand in a real run."""

    name = "planted.collapse"
    inputs = ("reward/mean",)

    def check(self, history: MetricHistory, step: int) -> list[Finding]:
        if step < 1:
            return []
        severity = HealthState.COLLAPSING if step >= 3 else HealthState.WARNING
        return [Finding(self.name, "reward/mean", severity, f"planted at step {step}")]


def test_real_runs_print_and_save_the_verdict(run_root, capsys):
    from tclightning.callbacks.health_actions import HealthMonitor
    from tclightning.run import run

    healthy = run("tiny", [*FAST, "trainer.steps=4"])
    out = capsys.readouterr().out
    assert healthy["health"]["state"] == "healthy" and healthy["health"]["first_collapse"] is None
    assert "health first warning" in out and "healthy at the last step" in out

    planted = HealthMonitor(rules=[PlantedCollapse()], name="planted", actions=["log", "stop"])
    summary = run("tiny", [*FAST, "trainer.steps=8"], extra_callbacks=[planted])
    out = capsys.readouterr().out
    saved = json.loads((Path(summary["run_dir"]) / "summary.json").read_text())["health"]
    assert saved == summary["health"]
    assert saved["state"] == "collapsing"
    assert saved["first_warning"]["step"] == 1 and saved["first_warning"]["rule"] == "planted.collapse"
    assert saved["first_collapse"]["step"] == 3 and saved["first_collapse"]["rule"] == "planted.collapse"
    assert saved["stopped"]["step"] == 3 and summary["steps"] == 4
    assert "health first collapse" in out and "step 3 (planted.collapse" in out


def test_analyze_health_names_the_first_warning_and_collapse(tmp_path, capsys):
    from tclightning.cli.main import main
    from tclightning.health.traces import late_length_collapse

    trace = late_length_collapse(0)
    trace.to_csv(tmp_path / "metrics.csv")
    assert main(["analyze", "health", str(tmp_path)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("first warning: step ") and "first collapse: step " in last
    warning, collapse = last.split(";")[:2]
    assert warning.endswith(")") and collapse.endswith(")")  # each step names its rules


def test_no_data_is_not_healthy(tmp_path, capsys):
    write_csv(tmp_path / "metrics.csv", [-1, -1, -1])
    summary = summarize(tmp_path)
    assert summary["health"]["state"] == "no data" and summary["health"]["first_warning"] is None
    print_summary(summary)
    assert "saw none of the metrics" in capsys.readouterr().out


def test_the_summary_goes_into_the_run_folder_held_whatever_its_name_leads_to(tmp_path, monkeypatch):
    """summary.json was written by name after the folder's check: a link swapped in while the
    summary was serialised had another run's summary.json written over."""
    import tclightning.grpo.summary as summary_module
    from tclightning.files import own_folder

    run_dir, other = tmp_path / "run", tmp_path / "other-run"
    write_csv(run_dir / "metrics.csv", [0] * 4)
    other.mkdir()
    (other / "summary.json").write_text("theirs")
    own_folder(run_dir)

    def swapped_while_serialised(value: object, **kwargs: object) -> str:
        run_dir.rename(tmp_path / "moved-away")
        run_dir.symlink_to(other)
        return json.dumps(value, **kwargs)

    monkeypatch.setattr(summary_module, "json", SimpleNamespace(dumps=swapped_while_serialised, loads=json.loads))
    summarize(run_dir)  # written into the folder held when the swap came
    assert (other / "summary.json").read_text() == "theirs"
    assert json.loads((tmp_path / "moved-away" / "summary.json").read_text())["steps"] == 4
