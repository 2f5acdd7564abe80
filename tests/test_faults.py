"""Fault injection: Ctrl-C, kill -9 (also inside a checkpoint write), damaged and crafted
checkpoints, and checkpoints resumed from outside their run directory.

Every resumed run is held to the same verdict (:func:`assert_same_run`): each step logged exactly
once, no hole, and every value equal to one uninterrupted run's on this machine (the same process
settings on both sides, so equality does not depend on the CPU's float kernels). Kills use the
test-only hook ``TCLIGHTNING_TEST_KILL=POINT@STEP`` (``tclightning.callbacks.checkpointing``),
so each kill lands at a named point and reproduces.
"""

from __future__ import annotations

import csv
import os
import re
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from tclightning.callbacks.checkpointing import FAULT_ENV, checkpoint_allow_list, load_checkpoint, reopen_completed_batch
from tclightning.cli.main import main
from tclightning.errors import TclightningError
from tclightning.grpo.summary import read_metrics
from tclightning.run import RUN_MARKER, RunInterrupted, run
from tests.conftest import FAST

STEPS = 6
# No validation (no extra rows), a checkpoint every 2 steps, every step file kept.
SETTINGS = [*FAST, "trainer.val_every=0", "trainer.checkpoint_every=2", "trainer.keep_checkpoints=10"]
WALL_CLOCK = ("time/", "throughput/", "epoch")  # differ between any two runs; everything else must not


def train(root: Path, steps: int, *extra: str, resume: str | None = None, callbacks: tuple[Any, ...] = ()) -> Path:
    """One in-process tiny run under ``root``; returns its run directory."""
    summary = run("tiny", [*SETTINGS, f"logging.root={root}", f"trainer.steps={steps}", *extra],
                  resume=resume, quiet=True, extra_callbacks=callbacks)
    return Path(summary["run_dir"])


def logged_steps(run_dir: Path) -> list[int]:
    """The step of every training row of ``metrics.csv``, in file order (duplicates kept)."""
    with (run_dir / "metrics.csv").open(newline="") as handle:
        return [int(float(row["step"])) for row in csv.DictReader(handle) if row.get("reward/mean")]


def assert_same_run(run_dir: Path, reference: dict[int, dict[str, float]], steps: range) -> None:
    """Rows exactly ``steps`` (no hole, no duplicate), each value equal to the reference's."""
    assert logged_steps(run_dir) == list(steps)
    got = read_metrics(run_dir / "metrics.csv")
    for step in steps:
        want = {k: v for k, v in reference[step].items() if not k.startswith(WALL_CLOCK)}
        assert {k: v for k, v in got[step].items() if not k.startswith(WALL_CLOCK)} == want, step


def assert_rows_behind_checkpoints(run_dir: Path, names: str = "*.ckpt") -> None:
    """A checkpoint claiming step S never gets ahead of metrics.csv: rows 0..S-1 are on disk."""
    logged = set(logged_steps(run_dir))
    for path in (run_dir / "checkpoints").glob(names):
        step = load_checkpoint(path)["tclightning"]["rl_step"]
        assert set(range(step)) <= logged, (path.name, sorted(logged))


def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``folder``: its bytes and modification time."""
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, float]]:
    """The uninterrupted run every resumed run must equal."""
    run_dir = train(tmp_path_factory.mktemp("reference"), STEPS)
    assert logged_steps(run_dir) == list(range(STEPS))
    return read_metrics(run_dir / "metrics.csv")


@pytest.fixture(scope="module")
def five_steps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 5-step run (step-2, step-4, step-5 and last.ckpt); tests work on copies."""
    return train(tmp_path_factory.mktemp("five"), 5)


def copy_run(run_dir: Path, root: Path) -> Path:
    """A copy of ``run_dir`` under ``root/tiny/`` (where ``--resume last`` looks)."""
    target = root / "tiny" / run_dir.name
    shutil.copytree(run_dir, target)
    return target


# -- Ctrl-C and extending a finished run ---------------------------------------------------------


class CtrlCAt(L.Callback):
    """Sends this process SIGINT as RL step ``step`` begins, like a user's Ctrl-C."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if batch.step == self.step:
            os.kill(os.getpid(), signal.SIGINT)


def test_ctrl_c_then_resume_continues_to_the_target_step(tmp_path: Path, reference) -> None:
    run_dir = train(tmp_path, STEPS, callbacks=(CtrlCAt(2),))
    assert logged_steps(run_dir) == [0, 1, 2]  # the step under way finishes, then the run stops
    assert load_checkpoint(run_dir / "checkpoints" / "last.ckpt")["tclightning"]["rl_step"] == 3
    assert train(tmp_path, STEPS, resume="last") == run_dir
    assert_same_run(run_dir, reference, range(STEPS))


class AbortAt(L.Callback):
    """A Ctrl-C that cannot wait for the step (the second one) as RL step ``step`` ends."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if batch.step == self.step:
            raise KeyboardInterrupt


def test_an_abort_before_the_first_checkpoint_does_not_promise_a_resume(tmp_path: Path) -> None:
    with pytest.raises(RunInterrupted) as stopped:
        train(tmp_path, STEPS, "trainer.checkpoint_every=4", callbacks=(AbortAt(1),))
    assert "no checkpoint was saved yet" in str(stopped.value) and "--resume" not in str(stopped.value)
    run_dir = next((tmp_path / "tiny").iterdir())
    assert not list((run_dir / "checkpoints").glob("*.ckpt")) and logged_steps(run_dir)  # the logged steps stay


def test_a_finished_run_extends_from_a_step_that_is_not_a_checkpoint_multiple(tmp_path: Path, five_steps, reference) -> None:
    run_dir = copy_run(five_steps, tmp_path)
    assert train(tmp_path, STEPS, resume="last") == run_dir  # 5 steps, checkpoint_every=2
    assert_same_run(run_dir, reference, range(STEPS))


class SaveAtTrainEnd(L.Callback):
    """Writes a checkpoint from ``on_train_end``: Lightning then records the epoch as finished
    (the form ``last.ckpt`` had before every checkpoint was taken at the end of its step)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.save_checkpoint(self.path, weights_only=False)


def test_a_checkpoint_written_at_the_end_of_training_still_extends(tmp_path: Path, reference) -> None:
    end = tmp_path / "end.ckpt"
    run_dir = train(tmp_path, 3, callbacks=(SaveAtTrainEnd(end),))
    loops = load_checkpoint(end)["loops"]["fit_loop"]
    assert loops["epoch_progress"]["total"]["completed"] == 1  # the form that used to end a resume at once
    shutil.copyfile(end, run_dir / "checkpoints" / "last.ckpt")
    train(tmp_path, STEPS, resume="last")
    assert_same_run(run_dir, reference, range(STEPS))


def test_reopen_completed_batch_gives_the_counters_of_a_batch_end_checkpoint() -> None:
    def progress(ready: int, completed: int, processed: int) -> dict[str, int]:
        return {"ready": ready, "started": ready, "processed": processed, "completed": completed}

    def checkpoint(batch_completed: int, epochs_done: int, stepped: int) -> dict[str, Any]:
        return {"epoch": epochs_done, "loops": {"fit_loop": {
            "epoch_loop.state_dict": {"_batches_that_stepped": stepped},
            "epoch_loop.batch_progress": {"total": progress(7, batch_completed, 7), "current": progress(7, batch_completed, 7),
                                          "is_last_batch": bool(epochs_done)},
            "epoch_progress": {"total": progress(1, epochs_done, epochs_done), "current": progress(1, epochs_done, epochs_done)},
        }}}

    at_end, at_batch_end = checkpoint(7, 1, 7), checkpoint(6, 0, 6)
    assert reopen_completed_batch(at_end) and at_end == at_batch_end
    assert not reopen_completed_batch(at_batch_end) and at_batch_end == checkpoint(6, 0, 6)
    during_validation = checkpoint(7, 0, 7)  # a SIGTERM after the step, while its validation ran
    during_validation["loops"]["fit_loop"]["epoch_loop.batch_progress"]["is_last_batch"] = False
    assert reopen_completed_batch(during_validation) and during_validation == at_batch_end


# -- kill -9 -------------------------------------------------------------------------------------


def cli_run(root: Path, steps: int, *extra: str, kill: str | None = None, resume: str | None = None) -> subprocess.CompletedProcess[str]:
    """``tclightning run`` in a child process; ``kill`` = ``POINT@STEP`` (see ``FAULT_ENV``)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop(FAULT_ENV, None)
    if kill:
        env[FAULT_ENV] = kill
    args = [sys.executable, "-m", "tclightning", "run", "--recipe", "tiny", *SETTINGS, f"logging.root={root}",
            f"trainer.steps={steps}", *extra, *(["--resume", resume] if resume else [])]
    return subprocess.run(args, cwd=root.parent, env=env, capture_output=True, text=True, timeout=300)


def only_run_dir(root: Path) -> Path:
    (run_dir,) = (root / "tiny").iterdir()
    return run_dir


def test_kill_inside_a_checkpoint_write_then_resume_leaves_no_hole(tmp_path: Path, reference) -> None:
    """The step-4 checkpoint is written but not committed when the process dies: the row of
    step 3 may or may not be on disk, and the resume (from step 2) makes it whole either way."""
    root = tmp_path / "runs"
    killed = cli_run(root, STEPS, kill="written@4")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    run_dir = only_run_dir(root)
    assert load_checkpoint(run_dir / "checkpoints" / "last.ckpt")["tclightning"]["rl_step"] == 2
    assert not (run_dir / "checkpoints" / "step-000004.ckpt").exists()
    assert_rows_behind_checkpoints(run_dir)
    train(root, STEPS, resume="last")
    assert_same_run(run_dir, reference, range(STEPS))


@pytest.mark.parametrize("kill", ["step-start@2", "step-start@3"])
def test_a_resume_from_an_earlier_step_killed_early_keeps_one_history_without_a_hole(
        tmp_path: Path, five_steps, reference, kill: str) -> None:
    """Resumed from ``step-2.ckpt`` of a 5-step run, killed as its first new step begins (no new
    row yet: ``metrics.csv`` is as it was) or its second (the new step 2 on disk, no checkpoint):
    ``last.ckpt`` is now the history ``metrics.csv`` records (the replaced one is kept as
    ``last.before-step-2.ckpt``), and ``--resume last`` continues it with no hole."""
    root = tmp_path / "runs"
    run_dir = copy_run(five_steps, root)
    rows, old_last = (run_dir / "metrics.csv").read_bytes(), (run_dir / "checkpoints" / "last.ckpt").read_bytes()
    killed = cli_run(root, STEPS, kill=kill, resume=str(run_dir / "checkpoints" / "step-000002.ckpt"))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    if kill == "step-start@2":
        assert (run_dir / "metrics.csv").read_bytes() == rows
    else:
        assert logged_steps(run_dir) == [0, 1, 2]
    assert (run_dir / "checkpoints" / "last.before-step-2.ckpt").read_bytes() == old_last
    assert load_checkpoint(run_dir / "checkpoints" / "last.ckpt")["tclightning"]["rl_step"] == 2
    train(root, STEPS, resume="last")
    assert_same_run(run_dir, reference, range(STEPS))


def test_a_resume_whose_run_moved_on_while_it_started_is_refused(
        tmp_path: Path, five_steps, monkeypatch: pytest.MonkeyPatch) -> None:
    """The resume planned from ``last.ckpt`` at step 5; before it took the run's lock, the run
    it waited for wrote another ``last.ckpt``. It stops in one line instead of cutting the rows to
    the step it planned from."""
    import tclightning.run as run_module

    run_dir = copy_run(five_steps, tmp_path / "runs")
    take_lock = run_module.hold_lock

    def run_moves_on(folder: Path, what: str) -> int:
        shutil.copyfile(run_dir / "checkpoints" / "step-000004.ckpt", run_dir / "checkpoints" / "last.ckpt")
        return take_lock(folder, what)

    monkeypatch.setattr(run_module, "hold_lock", run_moves_on)
    before = snapshot(run_dir)
    with pytest.raises(TclightningError, match="changed while this resume started"):
        train(tmp_path / "runs", STEPS, resume=str(run_dir))
    assert {k: v for k, v in snapshot(run_dir).items() if k != "checkpoints/last.ckpt"} == {
        k: v for k, v in before.items() if k != "checkpoints/last.ckpt"}


KILL_POINTS = ["step-start", "written", "half-written", "step-file", "committed"]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 2, 5, 9])  # between them: every point but "written" (a fast test)
def test_kill_9_at_seeded_random_points_then_resume_last(tmp_path: Path, seed: int, reference) -> None:
    """Two kills at seeded points (any of ``KILL_POINTS``, at any step; checkpoint points only
    at checkpoint steps), each followed by ``--resume last``: the run still equals the reference."""
    rng = random.Random(seed)
    points = sorted(((rng.choice(KILL_POINTS), rng.randrange(1, STEPS)) for _ in range(2)), key=lambda k: k[1])
    root = tmp_path / "runs"
    resume = None
    for point, step in points:
        if point != "step-start":
            step = max(2, step - step % 2)  # checkpoints are written at steps 2, 4 and at the end
        result = cli_run(root, STEPS, kill=f"{point}@{step}", resume=resume)
        # A later kill point can come too late: the run then resumes from before it, or has ended.
        assert result.returncode in (0, -signal.SIGKILL), result.stderr[-2000:]
        # After a resume, step files past the resume point belong to the earlier history until
        # the run reaches them again; last.ckpt is always the current one.
        assert_rows_behind_checkpoints(only_run_dir(root), "*.ckpt" if resume is None else "last.ckpt")
        if any((root / "tiny").glob("*/checkpoints/*.ckpt")):
            resume = "last"
        else:  # killed before the first checkpoint: nothing to resume, so start again
            nothing = cli_run(root, STEPS, resume="last")
            assert nothing.returncode == 2 and "no checkpoint under" in nothing.stderr
            shutil.rmtree(only_run_dir(root))
    final = cli_run(root, STEPS, resume="last")
    assert final.returncode == 0, final.stderr[-2000:]
    assert_same_run(only_run_dir(root), reference, range(STEPS))


# -- damaged checkpoints -------------------------------------------------------------------------


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def empty(path: Path) -> None:
    path.write_bytes(b"")


def garbage(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[:4096] = bytes(random.Random(0).randrange(256) for _ in range(4096))
    path.write_bytes(bytes(data))


def missing(path: Path) -> None:
    path.unlink()


@pytest.mark.parametrize(("damage", "files", "fallback"), [
    (truncate, ["last.ckpt"], 5),
    (empty, ["last.ckpt"], 5),
    (garbage, ["last.ckpt"], 5),
    (missing, ["last.ckpt"], 5),
    (truncate, ["last.ckpt", "step-000005.ckpt"], 4),
], ids=["truncated", "empty", "garbage", "missing", "truncated-with-newest-step"])
def test_a_damaged_last_ckpt_falls_back_to_the_newest_readable_step_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], five_steps, reference, damage, files, fallback,
) -> None:
    run_dir = copy_run(five_steps, tmp_path)
    for name in files:
        damage(run_dir / "checkpoints" / name)
    train(tmp_path, STEPS, resume="last")
    notice = capsys.readouterr().err
    assert f"resuming from step-{fallback:06d}.ckpt (step {fallback})" in notice
    assert_same_run(run_dir, reference, range(STEPS))


def test_last_and_step_files_are_separate_files(five_steps) -> None:
    ckpts = five_steps / "checkpoints"
    inodes = {p.name: p.stat().st_ino for p in ckpts.glob("*.ckpt")}
    assert sorted(inodes) == ["last.ckpt", "step-000002.ckpt", "step-000004.ckpt", "step-000005.ckpt"]
    assert len(set(inodes.values())) == len(inodes) and all(p.stat().st_nlink == 1 for p in ckpts.glob("*.ckpt"))


def test_no_readable_checkpoint_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], five_steps) -> None:
    run_dir = copy_run(five_steps, tmp_path)
    for path in (run_dir / "checkpoints").glob("*.ckpt"):
        truncate(path)
    before = snapshot(run_dir)
    code = main(["run", "--recipe", "tiny", *SETTINGS, f"logging.root={tmp_path}", "--resume", "last"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "last.ckpt" in err and "no readable step-*.ckpt" in err
    assert snapshot(run_dir) == before


# -- crafted checkpoints -------------------------------------------------------------------------


class Payload:
    """Unpickling this runs ``os.system`` / ``exec`` / ``open`` to create ``marker``."""

    def __init__(self, marker: Path, how: str) -> None:
        self.marker, self.how = marker, how

    def __reduce__(self) -> tuple[Any, ...]:
        if self.how == "system":
            return os.system, (f"touch {self.marker}",)
        if self.how == "exec":
            return exec, (f"open({str(self.marker)!r}, 'w').close()",)
        return open, (str(self.marker), "w")


@pytest.mark.parametrize("how", ["system", "exec", "open"])
@pytest.mark.parametrize("where", ["loose file", "inside a checkpoint", "as a run's last.ckpt"])
def test_a_crafted_pickle_is_refused_with_exit_2_and_never_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], five_steps, how: str, where: str,
) -> None:
    marker = tmp_path / "PAYLOAD-RAN"
    root = tmp_path / "runs"
    if where == "loose file":
        crafted, resume = tmp_path / "crafted.ckpt", str(tmp_path / "crafted.ckpt")
        torch.save({"tclightning": {"rl_step": 1}, "state_dict": Payload(marker, how)}, crafted)
    else:
        run_dir = copy_run(five_steps, root)
        crafted = run_dir / "checkpoints" / "last.ckpt"
        checkpoint = torch.load(crafted, weights_only=False)
        checkpoint["callbacks"]["extra"] = Payload(marker, how)
        torch.save(checkpoint, crafted)
        resume = "last" if where == "as a run's last.ckpt" else str(crafted)
    before = sorted(root.rglob("*")) if root.exists() else []
    code = main(["run", "--recipe", "tiny", *SETTINGS, f"logging.root={root}", "--resume", resume])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "refused" in err and str(crafted) in err
    assert not marker.exists()
    assert (sorted(root.rglob("*")) if root.exists() else []) == before  # no run directory, no write
    # Lightning's own load, under the same allow-list, refuses it as well.
    with pytest.raises(Exception, match="GLOBAL"), checkpoint_allow_list():
        torch.load(crafted, weights_only=True)
    assert not marker.exists()


def test_load_checkpoint_reads_a_real_checkpoint_and_names_a_broken_one(tmp_path: Path, five_steps) -> None:
    assert load_checkpoint(five_steps / "checkpoints" / "last.ckpt")["tclightning"]["rl_step"] == 5
    broken = tmp_path / "broken.ckpt"
    broken.write_bytes((five_steps / "checkpoints" / "last.ckpt").read_bytes()[:1000])
    with pytest.raises(TclightningError, match=r"^checkpoint .*broken\.ckpt: cannot read it") as err:
        load_checkpoint(broken)
    assert "\n" not in str(err.value)


# -- resuming a checkpoint from outside its run directory ----------------------------------------


@pytest.mark.parametrize("layout", ["mine/checkpoints/last.ckpt", "mine/step-4.ckpt", "mine/run/checkpoints/last.ckpt"])
def test_resume_of_a_checkpoint_outside_its_run_directory_touches_nothing_beside_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], five_steps, reference, layout: str,
) -> None:
    """The user's folder holds their own recipe.yaml and metrics.csv (30 rows) beside a copied
    checkpoint; the last layout is a whole run directory copied without its marker."""
    mine = tmp_path / "mine"
    ckpt = tmp_path / layout
    if layout.startswith("mine/run/"):
        shutil.copytree(five_steps, mine / "run")
        (mine / "run" / RUN_MARKER).unlink()
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(five_steps / "checkpoints" / "step-000004.ckpt", ckpt)
    (mine / "recipe.yaml").write_text("name: my own recipe\n")
    (mine / "metrics.csv").write_text("step,value\n" + "".join(f"{i},{i}\n" for i in range(30)))
    before = snapshot(mine)
    root = tmp_path / "runs"
    run_dir = train(root, STEPS, resume=str(ckpt))
    assert snapshot(mine) == before
    assert run_dir.parent == root / "tiny" and (run_dir / RUN_MARKER).is_file()
    assert "not inside a run directory tclightning created" in capsys.readouterr().err
    assert_same_run(run_dir, reference, range(4, STEPS))  # continues from step 4 in its own folder


def test_metrics_csv_is_only_ever_replaced_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keeping rows on resume and adding a column rewrite metrics.csv: by an atomic rename, so
    dying before it (here: the rename fails) leaves the previous file whole; and the rows past the
    resume point go only with the first new row."""
    import tclightning.logging as run_logging

    path = tmp_path / "metrics.csv"
    path.write_text("a,step\n0.0,0\n1.0,1\n2.0,2\n")
    logger = run_logging.ResumableCSVLogger(tmp_path, resume_step=2)
    logger.save()  # nothing new logged: nothing cut
    assert path.read_text() == "a,step\n0.0,0\n1.0,1\n2.0,2\n"

    def dies(*args: Any) -> None:
        raise OSError("killed before the rename")

    monkeypatch.setattr(run_logging.os, "replace", dies)
    with pytest.raises(OSError, match="killed"):  # a new column: the file is rewritten (and saved at once)
        logger.log_metrics({"a": 2.5, "b": 7.0}, step=2)
    assert path.read_text() == "a,step\n0.0,0\n1.0,1\n2.0,2\n"
    # the header the file still has: a later save appended a row of the new columns under it (a full disk)
    assert logger.experiment.metrics_keys == ["a", "step"]
    monkeypatch.undo()
    logger.save()
    with path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["step"], r["a"], r["b"]) for r in rows] == [("0", "0.0", ""), ("1", "1.0", ""), ("2", "2.5", "7.0")]


@pytest.mark.parametrize("before", ["\n", " \n\r\n", "\ufeff", "\ufeff\n"],
                         ids=["blank-line", "white-space-lines", "byte-order-mark", "byte-order-mark-then-blank-line"])
def test_a_resume_keeps_the_rows_of_a_metrics_csv_that_starts_with_a_blank_line(before: str, tmp_path: Path) -> None:
    """A blank first line (an editor's, a tool's), or a byte-order mark and one, was read as a header
    of no names: the resume kept none of the earlier steps' rows, and the summary and ``analyze
    health`` read none (a mark alone made the first column ``\\ufeffreward/mean``)."""
    import tclightning.logging as run_logging
    from tclightning.grpo.summary import read_metrics
    from tclightning.health.io import read_run

    path = tmp_path / "metrics.csv"
    path.write_text(before + "reward/mean,step\n0.25,0\n0.5,1\n0.75,2\n")
    assert read_metrics(path) == {0: {"reward/mean": 0.25}, 1: {"reward/mean": 0.5}, 2: {"reward/mean": 0.75}}
    assert [step for step, _ in read_run(path)] == [0, 1, 2]
    logger = run_logging.ResumableCSVLogger(tmp_path, resume_step=2)
    logger.log_metrics({"reward/mean": 0.875}, step=2)
    logger.save()
    assert read_metrics(path) == {0: {"reward/mean": 0.25}, 1: {"reward/mean": 0.5}, 2: {"reward/mean": 0.875}}


@pytest.mark.parametrize("text, said", [
    ("Step,reward/mean\n0,0.5\n1,0.5\n", "no 'step' column"),  # a spreadsheet's capital
    ("step;reward/mean\n0;0.5\n1;0.5\n", "no 'step' column"),  # a spreadsheet's separator
    ("step,reward/mean\n0,0.5\nabc,0.5\n2,0.5\n", ":3: step 'abc' is not a number"),
    ("step,reward/mean\n0,0.5\n1,0.5,x\n2,0.5\n", ":3: 3 cells where the header names 2 columns"),
    ("step,reward/mean\n0,0.5\n1e400,0.5\n", ":3: step '1e400' is not a number"),
    ("step,step\n0,0\n", "the column 'step' appears twice"),
], ids=["capital-step", "semicolons", "step-no-number", "row-longer", "step-overflow", "step-twice"])
def test_a_resume_refuses_a_metrics_csv_it_cannot_continue_in_one_line(text: str, said: str, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A ``metrics.csv`` whose rows the resume cannot continue: it was rewritten keeping none of its
    rows, or the resume trained a step and ended in a traceback (every later resume too)."""
    from tclightning.run import require_readable_rows

    path = tmp_path / "metrics.csv"
    path.write_text(text)
    with pytest.raises(TclightningError, match=f"--resume: .*{re.escape(said)}.*nothing was written"):
        require_readable_rows(path)
    path.write_bytes(text.encode("utf-16"))  # another encoding
    with pytest.raises(TclightningError, match="not a CSV text file"):
        require_readable_rows(path)
    path.write_text("step,reward/mean\n0,0.5\n1,0.")  # a last row a crash cut short: the resume drops it
    require_readable_rows(path)


@pytest.mark.parametrize("cut", ["2.0,1", "2.0,abc", "2.0,-1", "2.0,1,x,y"],
                         ids=["step-10-cut-to-1", "damaged-step", "negative-step", "longer"])
def test_the_resume_s_rewrite_leaves_out_a_last_row_a_crash_cut_short(cut: str, tmp_path: Path) -> None:
    """A last row with no line break after it, cut inside its step cell (``10`` to ``1``), was kept by
    the resume's rewrite as a row of step 1 (every reader then took step 10's cells for step 1's),
    and a damaged one ended the resume in a traceback after its first step."""
    import tclightning.logging as run_logging
    from tclightning.grpo.summary import read_metrics
    from tclightning.run import require_readable_rows

    path = tmp_path / "metrics.csv"
    path.write_text("a,step\n0.0,0\n1.0,1\n" + cut)
    require_readable_rows(path)  # the resume's check leaves it unread
    logger = run_logging.ResumableCSVLogger(tmp_path, resume_step=2)
    logger.log_metrics({"a": 2.5}, step=2)
    logger.save()
    assert read_metrics(path) == {0: {"a": 0.0}, 1: {"a": 1.0}, 2: {"a": 2.5}}
    assert path.read_text().count("\n") == 4



def test_a_whole_last_metrics_row_saved_without_its_line_break_is_kept(tmp_path: Path) -> None:
    """A last row with every cell (an editor's save drops the final line break) was taken for one a
    crash cut short and dropped, a hole at the checkpoint's own step; a header alone with no line
    break ended the resume in an IndexError traceback."""
    import tclightning.logging as run_logging
    from tclightning.grpo.summary import read_metrics

    path = tmp_path / "metrics.csv"
    path.write_text("step,val/a\n0,0.5\n1,0.75")
    logger = run_logging.ResumableCSVLogger(tmp_path, resume_step=2)
    logger.log_metrics({"val/a": 0.875}, step=2)
    logger.save()
    assert read_metrics(path) == {0: {"val/a": 0.5}, 1: {"val/a": 0.75}, 2: {"val/a": 0.875}}
    path.write_text("step,val/a")
    logger = run_logging.ResumableCSVLogger(tmp_path, resume_step=0)
    logger.log_metrics({"val/a": 0.5}, step=0)
    logger.save()
    assert read_metrics(path) == {0: {"val/a": 0.5}}


def test_a_metrics_row_of_more_cells_than_the_header_is_left_out_of_the_summary(tmp_path: Path) -> None:
    """A row appended under an older header (a full disk failed the rewrite adding its columns) made
    the failure handler's summary a TypeError traceback: its extra cells came as a list."""
    from tclightning.grpo.summary import read_metrics

    path = tmp_path / "metrics.csv"
    path.write_text("step,val/accuracy\n0,0.5\n0,1.0,2.0,3.0\n1,0.75\nabc,0.9\n2,\x00\n")
    assert read_metrics(path) == {0: {"val/accuracy": 0.5}, 1: {"val/accuracy": 0.75}}  # nor damaged cells


def test_a_metrics_row_cut_short_by_a_crash_is_dropped_by_the_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """A crash in the middle of an append leaves a row without its step cell: the resume printed
    a TypeError traceback reading it."""
    monkeypatch.chdir(tmp_path)
    base = ["run", "--recipe", "tiny", *FAST, "trainer.val_every=0", "trainer.checkpoint_every=1", "logging.root=runs"]
    assert main([*base, "trainer.steps=3", "--quiet"]) == 0
    (run_dir,) = (tmp_path / "runs" / "tiny").iterdir()
    with (run_dir / "metrics.csv").open("a") as handle:
        handle.write("0,3.1e-08,0.0,1.0,4.7")
    assert main([*base, "trainer.steps=5", "--quiet", "--resume", str(run_dir)]) == 0, capsys.readouterr().err
    with (run_dir / "metrics.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [row["step"] for row in rows] == ["0", "1", "2", "3", "4"] and all(None not in row.values() for row in rows)
    # a damaged row: one line before anything is written (a step was trained, then a traceback)
    rows[3]["step"] = "abc"
    with (run_dir / "metrics.csv").open("w", newline="") as handle:
        out = csv.DictWriter(handle, fieldnames=list(rows[0]))
        out.writeheader()
        out.writerows(rows)
    damaged = (run_dir / "metrics.csv").read_text()
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    capsys.readouterr()
    assert main([*base, "trainer.steps=7", "--quiet", "--resume", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "step 'abc' is not a number" in err[0], err
    assert (run_dir / "metrics.csv").read_text() == damaged
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before
