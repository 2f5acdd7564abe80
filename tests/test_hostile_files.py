"""Paths a run opens but did not create: a FIFO or a device where a checkpoint or metrics.csv
should be is refused with one line at once, never waited on."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tclightning.callbacks.checkpointing import load_checkpoint
from tclightning.cli.main import main
from tclightning.errors import TclightningError
from tclightning.run import run
from tests.conftest import FAST

pytestmark = pytest.mark.timeout(120)  # a regression here hangs: fail instead


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hostile-files")
    summary = run("tiny", [*FAST, "trainer.steps=2", "trainer.val_every=0", "trainer.checkpoint_every=1",
                           f"logging.root={root}"], quiet=True)
    return Path(summary["run_dir"])


def test_a_fifo_or_device_is_not_a_checkpoint(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe.ckpt")
    (tmp_path / "zero.ckpt").symlink_to("/dev/zero")
    with pytest.raises(TclightningError, match=r"pipe.ckpt: is a named pipe \(FIFO\), not a regular file"):
        load_checkpoint(tmp_path / "pipe.ckpt")
    with pytest.raises(TclightningError, match="zero.ckpt: is a device, not a regular file"):
        load_checkpoint(tmp_path / "zero.ckpt")


def test_resume_refuses_a_fifo_metrics_csv_and_export_skips_a_fifo_last_ckpt(
        run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    (copy / "metrics.csv").unlink()
    os.mkfifo(copy / "metrics.csv")
    assert main(["run", "--recipe", "tiny", *FAST, "trainer.steps=3", "--resume", str(copy)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "metrics.csv: is a named pipe (FIFO)" in err[0], err
    (copy / "checkpoints" / "last.ckpt").unlink()
    os.mkfifo(copy / "checkpoints" / "last.ckpt")
    out = tmp_path / "exported"
    assert main(["export", str(copy), str(out)]) == 0  # the newest readable step checkpoint instead
    assert (out / "config.json").is_file()


def test_a_resume_that_cannot_continue_the_run_is_refused_before_anything_is_written(
        run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    record = (copy / "recipe.yaml").read_text()
    files = sorted(p.relative_to(copy).as_posix() for p in copy.rglob("*"))
    for change in ("model.tiny.hidden_size=64", "sampler.group_size=3", "pipeline.codec=lowrank"):
        assert main(["run", "--recipe", "tiny", *FAST, "trainer.steps=3", change, "--resume", str(copy)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        key = change.partition("=")[0]
        assert len(err) == 1 and f"key '{key}' was" in err[0], err
        assert (copy / "recipe.yaml").read_text() == record
        assert sorted(p.relative_to(copy).as_posix() for p in copy.rglob("*")) == files


def test_a_resume_with_a_new_learning_rate_keeps_the_earlier_record(run_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    record = (copy / "recipe.yaml").read_text()
    run("tiny", [*FAST, "trainer.steps=3", "trainer.val_every=0", "trainer.checkpoint_every=1", "grpo.lr=1e-4",
                 f"logging.root={run_dir.parent.parent}"], resume=str(copy), quiet=True)
    assert (copy / "recipe.before-step-2.yaml").read_text() == record
    assert "lr: 0.0001" in (copy / "recipe.yaml").read_text()


@pytest.mark.parametrize("content", ["foreign-dict", "a-list"])
def test_a_last_ckpt_that_reads_but_is_not_tclightnings_stops_the_resume(
        run_dir: Path, tmp_path: Path, content: str, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    torch.save({"state_dict": {}} if content == "foreign-dict" else [1, 2, 3], copy / "checkpoints" / "last.ckpt")
    crafted = (copy / "checkpoints" / "last.ckpt").read_bytes()
    assert main(["run", "--recipe", "tiny", *FAST, "trainer.steps=3", "--resume", str(copy)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "last.ckpt" in err[0] and "not a" in err[0], err
    assert (copy / "checkpoints" / "last.ckpt").read_bytes() == crafted  # not replaced by an older file


def test_two_nodes_without_a_launcher_are_refused_at_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from tclightning.run import LAUNCHER_ENV

    for name in LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--recipe", "fast-only-lowrank", *FAST, "trainer.num_nodes=2", "trainer.devices=1",
                 "pipeline.stages=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "trainer.num_nodes=2: start it on every node with a launcher" in err[0], err
    assert not (tmp_path / "runs").exists()


def test_analyze_health_refuses_a_fifo_metrics_csv(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    os.mkfifo(tmp_path / "metrics.csv")
    for given in (tmp_path / "metrics.csv", tmp_path):  # the file itself, and the run directory holding it
        assert main(["analyze", "health", str(given)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "is a named pipe (FIFO), not a regular file" in err[0], err
