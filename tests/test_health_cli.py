"""`tclightning analyze health`: readers (CSVLogger rows, any CSV, TensorBoard) and output."""

from __future__ import annotations

import argparse
import json
import struct
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
    with pytest.raises(TclightningError, match="no health rule reads 'gap/abs_men'"):
        run_cli(["health", str(path), "--name", "gap/abs_men=my_gap"])  # a typo would leave the rule no data
    with pytest.raises(TclightningError, match="has no metric 'my_gpa'"):
        run_cli(["health", str(path), "--name", "gap/abs_mean=my_gap", "--name", "reward/mean=my_gpa"])
    # a typo of YOURS where the file has the canonical column too: its canonical column was replayed
    both = tmp_path / "both.csv"
    both.write_text("step,reward/mean,train/reward\n" + "".join(f"{s},0.3,0.3\n" for s in range(5)))
    with pytest.raises(TclightningError, match="has no metric 'train/rewrad'"):
        run_cli(["health", str(both), "--name", "reward/mean=train/rewrad"])
    assert run_cli(["health", str(both), "--name", "reward/mean=train/reward"]) == 0
    # two mappings of one name: one was dropped without a word
    with pytest.raises(TclightningError, match="'train/reward' is already read as 'reward/mean'"):
        run_cli(["health", str(both), "--name", "reward/mean=train/reward", "--name", "gap/abs_mean=train/reward"])
    with pytest.raises(TclightningError, match="'reward/mean' is already read from 'train/reward'"):
        run_cli(["health", str(both), "--name", "reward/mean=train/reward", "--name", "reward/mean=reward/mean"])
    twice = ["--name", "reward/mean=train/reward"] * 2  # the same mapping again is no conflict
    assert run_cli(["health", str(both), *twice]) == 0


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


@pytest.mark.parametrize("step", [-3, 2**62])
def test_an_event_file_step_out_of_range_is_refused_as_a_csv_one_is(step, tmp_path):
    """A negative step was replayed first, and one near 2^62 as the last of a run that long."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "tb"))
    writer.add_scalar("reward/mean", 0.3, 0)
    writer.add_scalar("reward/mean", 0.3, step)
    writer.close()
    with pytest.raises(TclightningError, match=f"reward/mean at step {step}, not a whole number in"):
        read_run(tmp_path)


def test_a_damaged_event_file_is_refused_and_a_tail_cut_short_is_read(tmp_path, capsys):
    """TensorBoard's reader stops at a damaged record without a word: one flipped byte made the
    replay judge the first 2 of 60 steps and call the run healthy (its collapse at step 40 unseen)."""
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
    from torch.utils.tensorboard import SummaryWriter

    from tclightning.cli.main import main

    writer = SummaryWriter(str(tmp_path / "w"))
    for step in range(60):
        writer.add_scalar("reward/mean", 0.5 if step < 40 else float("nan"), step)
    writer.close()
    (events,) = (tmp_path / "w").iterdir()
    data = bytearray(events.read_bytes())
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / events.name).write_bytes(data[:-7])  # a live run's last record
    data[300] ^= 0xFF
    (tmp_path / "damaged").mkdir()
    (tmp_path / "damaged" / events.name).write_bytes(data)
    capsys.readouterr()
    assert main(["analyze", "health", str(tmp_path / "damaged")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "a checksum does not match" in lines[0], lines
    rows = read_run(tmp_path / "cut")
    assert [step for step, _ in rows] == list(range(59))
    length = struct.pack("<Q", 2**62)  # a length whose own checksum holds: the reader allocates it
    (tmp_path / "huge").mkdir()
    (tmp_path / "huge" / events.name).write_bytes(events.read_bytes() + length + struct.pack("<I", masked_crc32c(length)))
    assert main(["analyze", "health", str(tmp_path / "huge")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "more bytes than can be read" in lines[0], lines


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


@pytest.mark.parametrize(
    "text, has",
    [
        ("step\n0\n1\n", "it has no metric values, only step"),
        ("step,epoch\n0,0\n1,0\n", "it has no metric values, only step"),
        ("step,foo,bar\n0,1,2\n1,1,2\n", "it has bar, foo"),
        ("step,train/reward\n0,0.5\n1,0.5\n", "it has train/reward"),
    ],
    ids=["only-step", "only-bookkeeping", "unknown-columns", "unmapped-name"],
)
def test_a_csv_without_any_metric_the_rules_read_is_an_error_not_healthy(tmp_path, capsys, text, has):
    from tclightning.cli.main import main

    path = tmp_path / "m.csv"
    path.write_text(text)
    capsys.readouterr()
    assert main(["analyze", "health", str(path)]) == 2
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and "healthy" not in out.out, out
    assert lines[0].startswith(f"error: {path}: no metric columns the health rules read ({has}")
    assert "--name CANONICAL=YOURS" in lines[0]
    assert main(["analyze", "health", str(path), "--json"]) == 2  # the JSON verdict is refused alike
    # mapped to a canonical name, the same file replays
    if "train/reward" in text:
        assert main(["analyze", "health", str(path), "--name", "reward/mean=train/reward", "--json"]) == 0


def test_a_csv_with_a_byte_order_mark_reads_like_one_without(tmp_path, capsys):
    from tclightning.cli.main import main

    plain = tmp_path / "plain.csv"
    late_length_collapse(0).to_csv(plain)
    excel = tmp_path / "excel.csv"
    excel.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())  # Excel's "CSV UTF-8" starts with a BOM
    assert read_run(excel) == read_run(plain)
    capsys.readouterr()
    assert main(["analyze", "health", str(plain), "--json"]) == 0
    expected = json.loads(capsys.readouterr().out)
    assert main(["analyze", "health", str(excel), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == expected and expected["first_warning_step"] is not None


@pytest.mark.parametrize("text, said", [
    ("step,reward/mean,reward/mean\n1,0.3,0.02\n", "the column 'reward/mean' appears twice in its header"),
    ("step,reward/mean\n1,0.3\n2,0.3,0.02,0.01\n", ":3: 4 cells where the header names 2 columns"),
], ids=["column-twice", "row-longer-than-header"])
def test_a_csv_whose_columns_do_not_line_up_is_refused_in_one_line(tmp_path, capsys, text: str, said: str):
    """Which of two same-named columns, or which column a row's extra cells belong to, cannot be
    told: a verdict on such a file would be on numbers that may not be the metric it names."""
    from tclightning.cli.main import main

    path = tmp_path / "metrics.csv"
    path.write_text(text)
    capsys.readouterr()
    assert main(["analyze", "health", str(path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and said in lines[0], lines
