"""Paths a run opens but did not create: a FIFO or a device where a checkpoint or metrics.csv
should be is refused with one line at once, never waited on."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest

from tclightning.callbacks.checkpointing import load_checkpoint
from tclightning.cli.main import main
from tclightning.errors import TclightningError
from tclightning.run import RecordSnapshot, run
from tests.conftest import FAST, two_step_run

pytestmark = pytest.mark.timeout(120)  # a regression here hangs: fail instead


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return two_step_run(tmp_path_factory.mktemp("hostile-files"))


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
    # ...and trains at it: the schedule goes on where it was, at half the rate (2e-4 -> 1e-4)
    from tclightning.grpo.summary import read_metrics

    before_lr = read_metrics(run_dir / "metrics.csv")[1]["policy/lr"]
    resumed_lr = read_metrics(copy / "metrics.csv")[2]["policy/lr"]
    warmup = 5  # tiny's grpo.warmup_steps; one tick a step, logged after it: lr = lr0 * (step + 2) / (warmup + 1)
    assert before_lr == pytest.approx(2e-4 * 3 / (warmup + 1), rel=1e-6)
    assert resumed_lr == pytest.approx(1e-4 * 4 / (warmup + 1), rel=1e-6)


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


@pytest.mark.parametrize("name, value", [("MASTER_PORT", "abc"), ("MASTER_PORT", "99999"), ("NODE_RANK", "abc"),
                                         ("NODE_RANK", "-1"), ("NODE_RANK", "5")])
def test_a_launcher_variable_no_rank_can_use_is_refused_at_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str], name: str,
                                                                value: str) -> None:
    """A port that is not one (a traceback from the store), a node rank past the nodes (a wait for
    peers that never come): one line before anything starts."""
    monkeypatch.setenv("NODE_RANK", "0")
    monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--recipe", "fast-only-lowrank", *FAST, "trainer.num_nodes=2", "trainer.devices=1",
                 "pipeline.stages=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{name}={value!r}: expected a whole number" in err[0], err
    assert not (tmp_path / "runs").exists()


def test_analyze_health_refuses_a_fifo_metrics_csv(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    os.mkfifo(tmp_path / "metrics.csv")
    for given in (tmp_path / "metrics.csv", tmp_path):  # the file itself, and the run directory holding it
        assert main(["analyze", "health", str(given)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "is a named pipe (FIFO), not a regular file" in err[0], err


def test_a_recipe_piped_to_dev_stdin_is_named_as_given(tmp_path: Path) -> None:
    """``--recipe /dev/stdin`` fed by a pipe was "/proc/<pid>/fd/pipe:[N]: No such file or directory":
    a path never given, and a false reason."""
    done = subprocess.run([sys.executable, "-m", "tclightning", "recipes", "show", "/dev/stdin"], input="name: x\n",
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert done.returncode == 2 and done.stderr.strip() == \
        "error: /dev/stdin: is a named pipe (FIFO), not a regular file; nothing was read", done.stderr


@pytest.mark.parametrize("link", ["to-itself", "to-nowhere"])
def test_analyze_health_of_a_run_whose_metrics_csv_is_a_link_to_no_file_is_one_line(
        link: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A metrics.csv linked to itself was an OSError (too many levels of links) traceback."""
    run_dir = tmp_path / "run"
    (run_dir / "tb").mkdir(parents=True)
    (run_dir / "metrics.csv").symlink_to("metrics.csv" if link == "to-itself" else "gone.csv")
    (run_dir / "tb" / "metrics.csv").symlink_to("metrics.csv")  # and one below, found by the search
    assert main(["analyze", "health", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "metrics.csv: is a link that leads to no file" in err[0], err
    (run_dir / "metrics.csv").unlink()  # the one below, found by the search, is the newest: never an older one
    (run_dir / "version_0").mkdir()
    (run_dir / "version_0" / "metrics.csv").write_text("step,reward/mean\n0,0.5\n")
    os.utime(run_dir / "version_0" / "metrics.csv", (1, 1))
    assert main(["analyze", "health", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tb/metrics.csv: is a link that leads to no file (the newest" in err[0], err


def _snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` by relative path, with its SHA-256."""
    import hashlib

    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _storage_refuses(monkeypatch: pytest.MonkeyPatch, folder: Path, refusal: str, after: int = 0) -> None:
    """From the ``after``-th temporary file created under ``folder`` on, the storage refuses:
    ``read-only`` fails the file's creation with EROFS, ``not-permitted`` with EPERM (an immutable
    file, a root-squashed share), ``full`` creates it for real but hands back a descriptor of
    ``/dev/full``, whose every write fails with ENOSPC as a full disk's does."""
    import errno
    import tempfile

    real, calls = tempfile.mkstemp, []

    def mkstemp(*args: object, dir: object = None, **kwargs: object) -> tuple[int, str]:
        under = dir is not None and Path(str(dir)).resolve().is_relative_to(folder.resolve())
        calls.append(under)
        if not under or calls.count(True) <= after:
            return real(*args, dir=dir, **kwargs)
        if refusal == "read-only":
            raise OSError(errno.EROFS, "Read-only file system", str(dir))
        if refusal == "not-permitted":
            raise OSError(errno.EPERM, "Operation not permitted", str(dir))
        fd, name = real(*args, dir=dir, **kwargs)
        os.close(fd)
        return os.open("/dev/full", os.O_WRONLY), name

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)


@pytest.mark.parametrize("refusal", ["read-only", "full", "not-permitted"])
def test_a_resume_onto_storage_that_takes_no_writes_is_one_line_and_loses_nothing(
        run_dir: Path, tmp_path: Path, refusal: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    before = _snapshot(copy)
    _storage_refuses(monkeypatch, copy, refusal)
    assert main(["run", "--recipe", "tiny", *FAST, "trainer.steps=3", "--resume", str(copy)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    reason = {"read-only": "Read-only file system", "full": "No space left on device",
              "not-permitted": "Operation not permitted"}[refusal]
    assert len(err) == 1 and err[0].startswith("error: --resume: cannot write in") and reason in err[0], err
    assert "nothing was written" in err[0]
    assert _snapshot(copy) == before  # no file changed, none added (no temporary file left either)


@pytest.mark.parametrize("refusal", ["full", "not-permitted"])
def test_a_disk_that_fills_up_during_a_resume_is_one_line_and_keeps_the_run(
        run_dir: Path, tmp_path: Path, refusal: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The write check passes, then the disk is full (or a file may not be replaced: an immutable
    metrics.csv was a PermissionError traceback) when the resume rewrites the run's records (a
    changed learning rate keeps the earlier record too): each is replaced whole or not at all."""
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    before = _snapshot(copy)
    _storage_refuses(monkeypatch, copy, refusal, after=2)  # the two write checks (run, checkpoints) pass
    assert main(["run", "--recipe", "tiny", *FAST, "trainer.steps=3", "grpo.lr=1e-4", "--resume", str(copy)]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("note:")]
    reason = "No space left on device" if refusal == "full" else "Operation not permitted"
    assert len(err) == 1 and reason in err[0] and f"--resume {copy}" in err[0], err
    assert _snapshot(copy) == before


def test_tensors_onto_a_full_disk_raise_the_storage_error(tmp_path: Path) -> None:
    """torch's file writer reports a full disk as a RuntimeError ("unexpected pos"); the warm-up cache
    and the trajectory points are written so that it is the OSError, which a run reports in one line,
    and the file at the name stays as it was."""
    import resource
    import signal

    import torch

    from tclightning.files import HeldFolder, refused_by_storage, save_tensors, storage_reason

    path = tmp_path / "point.pt"
    save_tensors({"w": torch.ones(3)}, path)
    before = path.read_bytes()
    held = HeldFolder(tmp_path)  # the points are written through the folder's descriptor
    limits, handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (len(before) + 100, limits[1]))  # a disk that fills at once
    try:
        with pytest.raises(OSError) as caught:
            save_tensors({"w": torch.zeros(100_000)}, held.path / "point.pt")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
        held.close()
    assert refused_by_storage(caught.value), caught.value
    # the refusal names the file by its folder's name (a run said its run folder's storage refused it,
    # for a TrajectoryRecorder dirpath elsewhere; /proc/self/fd/N told nothing)
    assert storage_reason(caught.value).startswith(f"{path}: "), storage_reason(caught.value)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["point.pt"]
    full = tmp_path / "full.pt"
    full.symlink_to("/dev/full")  # a link at the name is replaced, never written through
    save_tensors({"w": torch.ones(3)}, full)
    assert not full.is_symlink() and torch.equal(torch.load(full, weights_only=True)["w"], torch.ones(3))
    assert os.path.exists("/dev/full")


def _edit_last(run: Path, edit) -> None:
    import torch

    path = run / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(path, weights_only=False)
    edit(checkpoint)
    torch.save(checkpoint, path)


@pytest.mark.parametrize("rl_step", [0, True])
def test_a_checkpoint_whose_rl_step_disagrees_with_its_loops_is_refused_and_keeps_the_rows(
        run_dir: Path, tmp_path: Path, rl_step: object, capsys: pytest.CaptureFixture[str]) -> None:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    _edit_last(copy, lambda c: c["tclightning"].__setitem__("rl_step", rl_step))
    before = _snapshot(copy)
    assert main(["run", "--recipe", "tiny", *FAST, "trainer.steps=3", "--resume", str(copy)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "last.ckpt" in err[0] and ("training loops" in err[0] or "no RL step" in err[0]), err
    assert _snapshot(copy) == before  # metrics.csv keeps its rows


def test_a_last_ckpt_linked_into_another_run_never_writes_that_run(run_dir: Path, tmp_path: Path) -> None:
    victim, ours = tmp_path / "victim", tmp_path / "ours"
    shutil.copytree(run_dir, victim)
    shutil.copytree(run_dir, ours)
    (ours / "checkpoints" / "last.ckpt").unlink()
    (ours / "checkpoints" / "last.ckpt").symlink_to(victim / "checkpoints" / "step-000002.ckpt")
    before = _snapshot(victim)
    summary = run("tiny", [*FAST, "trainer.steps=3", "trainer.val_every=0", f"logging.root={tmp_path / 'runs'}"],
                  resume=str(ours), quiet=True)
    assert Path(summary["run_dir"]).parent.parent == tmp_path / "runs"  # a new run directory continues it
    assert _snapshot(victim) == before


@pytest.mark.parametrize("run_dir_variable", [False, True], ids=["plain", "with-the-run-dir-variable-set"])
def test_a_second_resume_of_a_run_that_is_still_going_is_refused(
        run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        run_dir_variable: bool) -> None:
    """Also when ``TCLIGHTNING_RUN_DIR`` names the run: only a rank other than 0 writes without the lock."""
    from tclightning.files import hold_lock
    from tclightning.run import RUN_DIR_ENV

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    if run_dir_variable:
        monkeypatch.setenv(RUN_DIR_ENV, str(copy))
    held = hold_lock(copy, "test")  # as the other resume's process holds it
    try:
        before = _snapshot(copy)
        assert main(["run", "--recipe", "tiny", *FAST, "trainer.steps=3", "--resume", str(copy)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "another process is writing" in err[0], err
        assert _snapshot(copy) == before
    finally:
        os.close(held)
    run("tiny", [*FAST, "trainer.steps=3", "trainer.val_every=0"], resume=str(copy), quiet=True)  # free again


def test_a_resume_from_outside_its_run_keeps_the_checkpoints_model_and_group_size(
        run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    loose = tmp_path / "loose.ckpt"
    shutil.copyfile(run_dir / "checkpoints" / "last.ckpt", loose)
    for change in ("model.tiny.hidden_size=64", "sampler.group_size=3"):
        assert main(["run", "--recipe", "tiny", *FAST, "trainer.steps=3", f"logging.root={tmp_path}/runs", change,
                     "--resume", str(loose)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"key '{change.partition('=')[0]}' was" in err[0], err
    assert not (tmp_path / "runs").exists()


def test_a_resume_with_nothing_left_to_train_is_refused(run_dir: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    before = _snapshot(copy)
    for steps in (1, 2):  # the checkpoint is at step 2
        assert main(["run", "--recipe", "tiny", *FAST, f"trainer.steps={steps}", "--resume", str(copy)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "leaves nothing to train" in err[0], err
    assert _snapshot(copy) == before


def test_a_checkpoint_whose_state_does_not_fit_is_one_line(run_dir: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    _edit_last(copy, lambda c: c["state_dict"].pop(next(iter(c["state_dict"]))))
    assert main(["run", "--recipe", "tiny", *FAST, "trainer.steps=3", "--resume", str(copy)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("note:")]
    assert len(err) == 1 and "could not be restored" in err[0] and "Traceback" not in err[0], err
    assert (copy / "checkpoints" / "last.ckpt").is_file() and (copy / "checkpoints" / "step-000002.ckpt").is_file()


@pytest.mark.parametrize("swap", ["none", "link", "another-folder"])
def test_a_refused_resume_puts_its_record_back_only_into_the_folders_it_snapshotted(swap: str, tmp_path: Path) -> None:
    """A resume refused while restoring puts the run's record back and removes the TensorBoard files
    it added: through a link put in place of ``tb/`` meanwhile, that removed every file of the
    folder linked to and wrote ``hparams.yaml`` there."""
    run_dir = tmp_path / "run"
    (run_dir / "tb").mkdir(parents=True)
    (run_dir / "metrics.csv").write_text("step\n1\n")
    (run_dir / "tb" / "hparams.yaml").write_text("a: 1\n")
    (run_dir / "tb" / "events.out.tfevents.1").write_bytes(b"old")
    before = RecordSnapshot.take(run_dir)
    (run_dir / "metrics.csv").write_text("step\n1\n2\n")  # what the resume wrote
    (run_dir / "tb" / "hparams.yaml").write_text("a: 2\n")
    (run_dir / "tb" / "events.out.tfevents.2").write_bytes(b"new")
    user = tmp_path / "user"
    user.mkdir()
    (user / "u1.txt").write_text("mine")
    (user / "hparams.yaml").write_text("mine")
    if swap != "none":
        (run_dir / "tb").rename(tmp_path / "tb-away")
        if swap == "link":
            (run_dir / "tb").symlink_to(user)
        else:
            user = user.rename(run_dir / "tb")
    before.put_back()
    assert (run_dir / "metrics.csv").read_text() == "step\n1\n"
    if swap == "none":
        assert sorted(p.name for p in (run_dir / "tb").iterdir()) == ["events.out.tfevents.1", "hparams.yaml"]
        assert (run_dir / "tb" / "hparams.yaml").read_text() == "a: 1\n"
    else:
        assert {p.name: p.read_text() for p in user.iterdir()} == {"u1.txt": "mine", "hparams.yaml": "mine"}


@pytest.mark.parametrize("when", ["as-the-run-folder-is-made", "before-the-first-checkpoint"])
def test_a_link_put_in_place_of_a_new_run_s_checkpoints_folder_is_never_written_through(
        when: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A link to someone's folder put at ``checkpoints/`` in a new run's folder before its first
    checkpoint was taken for the checkpoint folder: their ``last.ckpt`` written over and their
    ``step-*.ckpt`` pruned."""
    import tclightning.run as run_module

    user = tmp_path / "user"
    user.mkdir()
    for name in ("last.ckpt", "step-000001.ckpt", "notes.txt"):
        (user / name).write_text("mine")
    claim, mark = run_module.claim_run_dir, run_module.mark_run_dir

    def planted(run_dir: Path) -> None:
        if (run_dir / "checkpoints").is_dir():
            (run_dir / "checkpoints").rmdir()
        (run_dir / "checkpoints").symlink_to(user)

    if when == "as-the-run-folder-is-made":
        monkeypatch.setattr(run_module, "claim_run_dir", lambda planned: (made := claim(planned), planted(made))[0])
    else:
        monkeypatch.setattr(run_module, "mark_run_dir", lambda *args, **kwargs: (made := mark(*args, **kwargs),
                                                                                 planted(made))[0])
    code = main(["run", "--recipe", "tiny", *FAST, "trainer.steps=2", f"logging.root={tmp_path}/runs"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code != 0 and len(err) == 1 and "checkpoints was replaced during the run" in err[0], err
    assert {p.name: p.read_text() for p in user.iterdir()} == dict.fromkeys(
        ("last.ckpt", "step-000001.ckpt", "notes.txt"), "mine")


def test_a_link_swapped_in_for_checkpoints_just_before_the_prune_is_never_pruned_through(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The checkpoint writer checked its folder, then pruned old step files by name: a link to
    someone's folder swapped in between had their step files removed."""
    import tclightning.callbacks.checkpointing as checkpointing

    user = tmp_path / "user"
    user.mkdir()
    (user / "step-000001.ckpt").write_text("mine")
    copy = checkpointing.copy_file

    def copied_then_swapped(source: Path, target: Path) -> None:
        copy(source, target)
        if target.name == "step-000003.ckpt":  # the prune of step 1 comes next
            folder = Path(os.path.realpath(target.parent))  # (written through its descriptor's path)
            folder.rename(tmp_path / "moved-away")
            folder.symlink_to(user)

    monkeypatch.setattr(checkpointing, "copy_file", copied_then_swapped)
    code = main(["run", "--recipe", "tiny", *FAST, "trainer.steps=3", "trainer.checkpoint_every=1",
                 "trainer.keep_checkpoints=2", f"logging.root={tmp_path}/runs"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code != 0 and len(err) == 1 and "checkpoints was replaced during the run" in err[0], err
    assert [(p.name, p.read_text()) for p in user.iterdir()] == [("step-000001.ckpt", "mine")]


@pytest.mark.parametrize("when", ["as-made", "after-the-first-step"])
def test_a_link_put_in_place_of_a_new_run_folder_is_never_written_through(
        when: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A link to someone's folder put at a new run folder's name the moment it was made was taken
    for the run's folder by every writer, which looked first after it: their metrics.csv and
    recipe.yaml were replaced."""
    import tclightning.run as run_module

    user = tmp_path / "user"
    user.mkdir()
    for name in ("metrics.csv", "recipe.yaml", "summary.json", "hparams.yaml"):
        (user / name).write_text("mine")
    made: list[Path] = []

    def swapped(run_dir: Path) -> None:
        run_dir.rename(tmp_path / "moved-away")
        run_dir.symlink_to(user)

    claim = run_module.claim_run_dir

    def claimed_then_swapped(planned: Path) -> Path:
        made.append(claim(planned))
        if when == "as-made":
            swapped(made[0])
        return made[0]

    monkeypatch.setattr(run_module, "claim_run_dir", claimed_then_swapped)
    if when == "after-the-first-step":
        from tclightning.callbacks.checkpointing import StepCheckpoint

        save = StepCheckpoint.on_train_batch_end

        def swap_once(self, *args, **kwargs):
            if not (tmp_path / "moved-away").exists():
                swapped(made[0])
            return save(self, *args, **kwargs)

        monkeypatch.setattr(StepCheckpoint, "on_train_batch_end", swap_once)
    code = main(["run", "--recipe", "tiny", *FAST, "trainer.steps=2", f"logging.root={tmp_path}/runs"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code != 0 and len(err) == 1 and "was replaced during the run" in err[0], err
    assert {p.name: p.read_text() for p in user.iterdir()} == dict.fromkeys(
        ("metrics.csv", "recipe.yaml", "summary.json", "hparams.yaml"), "mine")


def test_task_data_that_is_a_fifo_is_refused_at_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "gsm8k").mkdir()
    os.mkfifo(tmp_path / "gsm8k" / "train.jsonl")
    assert main(["run", "--recipe", "tiny", *FAST, f"logging.root={tmp_path}/runs", "task.name=gsm8k",
                 f"task.path={tmp_path / 'gsm8k'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a named pipe (FIFO)" in err[0], err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("stdout", ["a-pipe-closed-early", "closed"])
def test_a_run_whose_stdout_goes_away_finishes_without_a_traceback(stdout: str, tmp_path: Path) -> None:
    """`tclightning run ... | head -1`, or stdout closed (`>&-`): the run trains to the end."""
    import subprocess
    import sys

    argv = [sys.executable, "-m", "tclightning", "run", "--recipe", "tiny", *[a for a in FAST if "progress" not in a],
            "logging.progress=tqdm", "trainer.steps=3", "trainer.val_every=0", f"logging.root={tmp_path}"]
    if stdout == "closed":
        child = subprocess.run(argv, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=100,
                               preexec_fn=lambda: os.close(1))
        code, err = child.returncode, child.stderr
    else:
        child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert child.stdout is not None and child.stdout.readline().startswith("run directory:")
        child.stdout.close()  # as `head -1` does
        code, err = child.wait(timeout=100), child.stderr.read()
    assert code == 0 and "Traceback" not in err and "Error" not in err, err
    (run,) = (tmp_path / "tiny").iterdir()
    assert (run / "checkpoints" / "step-000003.ckpt").is_file()


@pytest.mark.timeout(600)  # five command starts: minutes on a loaded 2-core machine
def test_a_console_that_refuses_writes_changes_no_outcome(tmp_path: Path) -> None:
    """stdout on ``/dev/full``: the run trains to the end (its record is whole) and exits 1 with a
    line saying its output is incomplete, as ``recipes list`` does; stderr on ``/dev/full`` or
    closed: a refused input still exits 2."""
    import subprocess
    import sys

    def cli(*argv: str, **streams) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "tclightning", *argv], text=True, timeout=300,
                              stdin=subprocess.DEVNULL, **streams)

    with open("/dev/full", "w") as full:
        listed = cli("recipes", "list", stdout=full, stderr=subprocess.PIPE)
        assert listed.returncode == 1 and "standard output refused a write" in listed.stderr, listed.stderr
        ran = cli("run", "--recipe", "tiny", *FAST, "trainer.steps=1", "trainer.val_every=0", f"logging.root={tmp_path}",
                  stdout=full, stderr=subprocess.PIPE)
        assert ran.returncode == 1 and "Traceback" not in ran.stderr, ran.stderr
        (run,) = (tmp_path / "tiny").iterdir()
        assert (run / "summary.json").is_file() and (run / "checkpoints" / "last.ckpt").is_file()
        assert cli("run", "--recipe", "no-such-recipe", stdout=subprocess.DEVNULL, stderr=full).returncode == 2
    closed = subprocess.run([sys.executable, "-m", "tclightning", "run", "--recipe", "no-such-recipe"], timeout=120,
                            stdout=subprocess.DEVNULL, preexec_fn=lambda: os.close(2))
    assert closed.returncode == 2


@pytest.mark.parametrize("linked", ["hparams.yaml", "checkpoints", "tb"])
def test_a_resume_never_writes_through_a_link_in_its_run_directory(
        run_dir: Path, tmp_path: Path, linked: str, capsys: pytest.CaptureFixture[str]) -> None:
    copy, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    shutil.copytree(run_dir, copy)
    shutil.move(copy / linked, elsewhere)
    (copy / linked).symlink_to(elsewhere)
    before = _snapshot(elsewhere) if elsewhere.is_dir() else elsewhere.read_bytes()
    assert main(["run", "--recipe", "tiny", *FAST, "trainer.steps=3", "--resume", str(copy)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a symbolic link" in err[0], err
    assert (_snapshot(elsewhere) if elsewhere.is_dir() else elsewhere.read_bytes()) == before


@pytest.mark.parametrize("name", ["hparams.yaml", "tb/hparams.yaml", ".lock"])
def test_a_run_file_that_is_a_fifo_or_a_folder_is_refused_at_once(
        run_dir: Path, tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]) -> None:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    target = copy / name
    if target.exists():
        target.unlink()
    (target.mkdir() if name == ".lock" else os.mkfifo(target))
    assert main(["run", "--recipe", "tiny", *FAST, "trainer.steps=3", "--resume", str(copy)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a regular file" in err[0], err


def test_a_resume_never_overwrites_a_file_named_like_its_earlier_record(run_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    (copy / "recipe.before-step-2.yaml").write_text("the user's own\n")
    record = (copy / "recipe.yaml").read_text()
    run("tiny", [*FAST, "trainer.steps=3", "trainer.val_every=0", "grpo.lr=1e-4"], resume=str(copy), quiet=True)
    assert (copy / "recipe.before-step-2.yaml").read_text() == "the user's own\n"
    assert (copy / "recipe.before-step-2-1.yaml").read_text() == record


def test_a_full_disk_under_tensorboard_s_writer_thread_prints_no_traceback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The event writer's thread dies on a full disk; the run's own thread reports it (one line) at
    its next log, so the thread's traceback is not shown. Other threads' errors still are."""
    import errno
    import threading

    from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread

    from tclightning.logging import build_tensorboard

    shown: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: shown.append(args.exc_value))
    build_tensorboard(tmp_path)

    def fail(error: BaseException) -> None:
        raise error

    class Writer(_AsyncWriterThread):
        def __init__(self, error: BaseException) -> None:
            threading.Thread.__init__(self, target=fail, args=(error,))

        run = threading.Thread.run

    full, bug, other = OSError(errno.ENOSPC, "No space left on device"), ValueError("a bug"), OSError(errno.ENOSPC, "x")
    for thread in (Writer(full), Writer(bug), threading.Thread(target=fail, args=(other,))):
        thread.start()
        thread.join()
    assert shown == [bug, other]


class PlantAt(L.Callback):
    """At the start of RL step 2 puts a link to ``target`` (or a FIFO) where the run's file
    ``pattern`` (a glob in the run directory) is."""

    def __init__(self, pattern: str, target: Path | None) -> None:
        self.pattern, self.target = pattern, target

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if batch.step == 2:
            (path,) = Path(trainer.default_root_dir).glob(self.pattern)
            path.unlink()
            path.symlink_to(self.target) if self.target is not None else os.mkfifo(path)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("planted", ["link", "fifo"])
@pytest.mark.parametrize("pattern", ["metrics.csv", "tb/events.out.tfevents.*", "tb/hparams.yaml"])
def test_a_record_replaced_during_the_run_is_never_written_through_or_waited_on(
        tmp_path: Path, planted: str, pattern: str) -> None:
    """Lightning's CSV writer and TensorBoard's reopen their file by name at each write: a link or a
    FIFO put there mid-run would be written through or waited on. The CSV is opened as the run's
    own file (a replaced one stops the run in one line); the event file is written through the
    descriptor it was created with; hparams.yaml is replaced whole."""
    mine = tmp_path / "mine.csv"
    mine.write_text("my,own\n1,2\n")
    settings = [*FAST, "trainer.steps=4", "trainer.val_every=0", f"logging.root={tmp_path / 'runs'}"]
    plant = PlantAt(pattern, mine if planted == "link" else None)
    if pattern == "metrics.csv":
        with pytest.raises(TclightningError, match="is no longer the run's own file"):
            run("tiny", settings, quiet=True, extra_callbacks=[plant])
    else:
        run("tiny", settings, quiet=True, extra_callbacks=[plant])
    assert mine.read_text() == "my,own\n1,2\n"


class MoveRunAway(L.Callback):
    """At the start of RL step 2 moves the run's folder elsewhere, as an `rm -rf` or a `mv` would take it."""

    def __init__(self, to: Path) -> None:
        self.to = to

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if batch.step == 2:
            shutil.move(trainer.default_root_dir, self.to)


@pytest.mark.timeout(120)
def test_a_run_whose_folder_goes_away_stops_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(TclightningError, match="went away during the run|was replaced during the run"):
        run("tiny", [*FAST, "trainer.steps=4", "trainer.val_every=0", f"logging.root={tmp_path / 'runs'}"],
            quiet=True, extra_callbacks=[MoveRunAway(tmp_path / "moved")])
    assert (tmp_path / "moved" / "metrics.csv").is_file()  # what it saved is where it was taken


class SwapFolder(L.Callback):
    """At the start of RL step 2 puts a link to another run's folder where ``name`` (``checkpoints``
    or the run folder itself) is, as a hostile neighbour in a shared folder could."""

    def __init__(self, name: str, other: Path) -> None:
        self.name, self.other = name, other

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if batch.step == 2:
            run_dir = Path(trainer.default_root_dir)
            target = run_dir / "checkpoints" if self.name == "checkpoints" else run_dir
            shutil.move(target, target.with_name(target.name + ".moved"))
            target.symlink_to(self.other / ("checkpoints" if self.name == "checkpoints" else ""))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["checkpoints", "run"])
def test_a_folder_swapped_for_a_link_mid_run_never_carries_writes_into_another_run(
        run_dir: Path, tmp_path: Path, name: str) -> None:
    other = tmp_path / "other"
    shutil.copytree(run_dir, other)
    before = _snapshot(other)
    with pytest.raises(TclightningError, match="was replaced during the run"):
        run("tiny", [*FAST, "trainer.steps=4", "trainer.val_every=0", "trainer.checkpoint_every=1",
                     f"logging.root={tmp_path / 'runs'}"], quiet=True, extra_callbacks=[SwapFolder(name, other)])
    assert _snapshot(other) == before


class FolderAt(L.Callback):
    """At the start of RL step 2 puts a folder (holding a file of someone's) where the run's file
    ``name`` is, or will be."""

    def __init__(self, name: str) -> None:
        self.name = name

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if batch.step == 2:
            path = Path(trainer.default_root_dir) / self.name
            path.unlink(missing_ok=True)
            path.mkdir()
            (path / "keep.txt").write_text("mine")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name, said", [("metrics.csv", "is no longer the run's own file (a link, a folder"),
                                        ("tb/hparams.yaml", "a folder is in its place"),
                                        ("summary.json", "a folder is in its place")])
def test_a_folder_put_in_place_of_a_record_mid_run_is_one_error_and_kept(tmp_path: Path, name: str, said: str) -> None:
    settings = [*FAST, "trainer.steps=3", "trainer.val_every=0", f"logging.root={tmp_path / 'runs'}"]
    with pytest.raises(TclightningError, match=re.escape(said)):
        run("tiny", settings, quiet=True, extra_callbacks=[FolderAt(name)])
    (kept,) = (tmp_path / "runs").glob(f"tiny/*/{name}/keep.txt")
    assert kept.read_text() == "mine" and not list(kept.parent.parent.glob(f".{kept.parent.name}.*.tmp"))


def test_own_file_writes_bytes_only_into_a_regular_file_of_its_own(tmp_path: Path) -> None:
    from tclightning.files import own_file

    theirs = tmp_path / "theirs.log"
    theirs.write_text("keep")
    (tmp_path / "linked.log").symlink_to(theirs)
    os.mkfifo(tmp_path / "fifo.log")
    (tmp_path / "folder.log").mkdir()
    for planted in ("linked.log", "fifo.log", "folder.log"):
        with pytest.raises(TclightningError, match="is no longer the run's own file"):
            own_file(tmp_path / planted, "wb")
    assert theirs.read_text() == "keep"
    with own_file(tmp_path / "node0.log", "wb") as log:
        log.write(b"abc")
    with own_file(tmp_path / "node0.log", "wb") as log:  # truncated, as open("wb") would
        log.write(b"d")
    with own_file(tmp_path / "node0.log", "rb") as log:
        assert log.read() == b"d"


def test_a_two_node_bench_never_runs_into_an_earlier_run(tmp_path: Path) -> None:
    from tclightning.bench.nodes import run_nodes

    earlier = tmp_path / "run"
    earlier.mkdir()
    (earlier / "metrics.csv").write_text("step\n0\n")
    with pytest.raises(TclightningError, match="already holds something"):
        run_nodes(["--recipe", "tiny"], run_dir=earlier, cwd=tmp_path)
    assert (earlier / "metrics.csv").read_text() == "step\n0\n"


class LinksWhileSerialising(L.Callback):
    """While each checkpoint is serialised (the window in which Lightning's own writer would copy
    it from ``$TMPDIR`` onto the name), plants links to ``victim`` at every name a checkpoint is
    written to: the temporary file, the step file and ``last.ckpt``."""

    def __init__(self, victim: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.victim, self.monkeypatch, self.writers = victim, monkeypatch, set()

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        import torch

        folder, save = Path(trainer.default_root_dir) / "checkpoints", torch.save

        def planting(obj: object, f: object, *args: object, **kwargs: object) -> None:
            save(obj, f, *args, **kwargs)
            if isinstance(obj, dict) and "state_dict" in obj:
                self.writers.add(type(trainer.strategy.checkpoint_io).__name__)
                for name in (".last.ckpt.tmp", "last.ckpt", f"step-{trainer.global_step:06d}.ckpt"):
                    (folder / name).unlink(missing_ok=True)
                    (folder / name).symlink_to(self.victim)

        self.monkeypatch.setattr(torch, "save", planting)


def test_a_link_planted_at_a_checkpoint_name_while_it_is_written_is_replaced_never_written_through(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    planting = LinksWhileSerialising(victim, monkeypatch)
    summary = run("tiny", [*FAST, "trainer.steps=3", "trainer.val_every=0", "trainer.checkpoint_every=1",
                           f"logging.root={tmp_path / 'runs'}"], quiet=True, extra_callbacks=[planting])
    assert victim.read_text() == "precious" and planting.writers == {"OwnFileCheckpointIO"}
    folder = Path(summary["run_dir"]) / "checkpoints"
    assert not [p for p in folder.iterdir() if p.is_symlink() and p.name != ".last.ckpt.tmp"]
    assert load_checkpoint(folder / "last.ckpt")["tclightning"]["rl_step"] == 3


def test_copy_file_replaces_a_link_or_fifo_at_its_target(tmp_path: Path) -> None:
    from tclightning.files import copy_file

    source, victim = tmp_path / "source.bin", tmp_path / "victim.txt"
    source.write_bytes(b"state" * 1000)
    victim.write_text("precious")
    (tmp_path / "linked").symlink_to(victim)
    os.mkfifo(tmp_path / "fifo")
    for target in ("linked", "fifo", "new"):
        copy_file(source, tmp_path / target)
        assert (tmp_path / target).read_bytes() == source.read_bytes() and not (tmp_path / target).is_symlink()
    assert victim.read_text() == "precious"


class _Listed:
    """What ``os.scandir`` returns, listed already."""

    def __init__(self, entries: list) -> None:
        self.entries = entries

    def __enter__(self) -> _Listed:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def __iter__(self):
        return iter(self.entries)


def test_remove_tree_never_follows_a_link_swapped_in_for_a_sub_folder_while_it_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tclightning.files import remove_tree

    tree, victim = tmp_path / "tree", tmp_path / "victim"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "ours.txt").write_text("ours")
    victim.mkdir()
    (victim / "precious.txt").write_text("keep")
    real, swapped = os.scandir, []

    def listing_then_swap(path: object = ".") -> _Listed:
        entries = list(real(path))  # type: ignore[arg-type]
        if not swapped:  # right after the first listing: sub/ becomes a link to the victim
            swapped.append(True)
            (tree / "sub").rename(tree / "sub.moved")
            (tree / "sub").symlink_to(victim)
        return _Listed(entries)

    monkeypatch.setattr(os, "scandir", listing_then_swap)
    remove_tree(tree)
    assert swapped and sorted(p.name for p in victim.iterdir()) == ["precious.txt"]
    assert (victim / "precious.txt").read_text() == "keep"


class HardLinkAt(L.Callback):
    """At the start of RL step 2 puts a hard link to ``target`` (a regular file, not a link) in
    place of the run's ``metrics.csv``."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if batch.step == 2:
            path = Path(trainer.default_root_dir) / "metrics.csv"
            path.unlink()
            os.link(self.target, path)


@pytest.mark.timeout(120)
def test_another_regular_file_put_in_place_of_metrics_csv_is_never_appended_to(tmp_path: Path) -> None:
    mine = tmp_path / "mine.csv"
    mine.write_text("name,balance\nalice,100\n")
    settings = [*FAST, "trainer.steps=4", "trainer.val_every=0", f"logging.root={tmp_path / 'runs'}"]
    with pytest.raises(TclightningError, match="is no longer the run's own file"):
        run("tiny", settings, quiet=True, extra_callbacks=[HardLinkAt(mine)])
    assert mine.read_text() == "name,balance\nalice,100\n"


@pytest.mark.timeout(120)
def test_a_checkpoint_written_into_a_folder_swapped_in_while_it_was_written_is_taken_back(
        run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``checkpoints/`` replaced (a link, a bind mount) between the folder check and the write: the
    file lands in the other run's folder; the check before it is published stops the run and
    removes that file, leaving the other run as it was."""
    from tclightning.callbacks.checkpointing import OwnFileCheckpointIO

    other = tmp_path / "other"
    shutil.copytree(run_dir, other)
    before = _snapshot(other)
    save = OwnFileCheckpointIO.save_checkpoint

    def swapped_first(self, checkpoint, path, storage_options=None):
        folder = Path(path).parent
        if checkpoint["global_step"] == 2 and not folder.is_symlink():
            folder.rename(folder.with_name("checkpoints.moved"))
            folder.symlink_to(other / "checkpoints")
        return save(self, checkpoint, path, storage_options)

    monkeypatch.setattr(OwnFileCheckpointIO, "save_checkpoint", swapped_first)
    with pytest.raises(TclightningError, match="was replaced during the run"):
        run("tiny", [*FAST, "trainer.steps=4", "trainer.val_every=0", "trainer.checkpoint_every=1",
                     f"logging.root={tmp_path / 'runs'}"], quiet=True)
    assert _snapshot(other) == before


def test_tree_walks_a_chain_of_a_thousand_and_more_nested_folders(tmp_path: Path) -> None:
    """``Path.rglob`` recurses: 1500 nested folders in a run's checkpoints/ (or below a folder
    ``analyze health`` searches) were a RecursionError traceback."""
    from tclightning.files import tree

    deepest = tmp_path
    for _ in range(1500):  # 3000 characters of path: within PATH_MAX
        deepest = deepest / "d"
        os.mkdir(deepest)
    (deepest / "metrics.csv").write_text("step\n0\n")
    try:
        found = list(tree(tmp_path))
    finally:  # from the deepest up: pytest's own clean-up (shutil.rmtree) recurses too
        (deepest / "metrics.csv").unlink()
        for level in range(1500):
            deepest.rmdir()
            deepest = deepest.parent
    assert len(found) == 1501 and found[-1].name == "metrics.csv"


def test_remove_tree_removes_a_chain_of_a_thousand_and_more_nested_folders(tmp_path: Path) -> None:
    """No recursion (1500 levels are past Python's limit); one descriptor a level."""
    import resource

    from tclightning.files import remove_tree

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2048:
        if hard != resource.RLIM_INFINITY and hard < 2048:
            pytest.skip(f"1500 levels need 1500 descriptors; this process may open {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (2048, hard))
    deepest = tmp_path / "tree"
    os.mkdir(deepest)
    for _ in range(1500):
        deepest = deepest / "d"
        os.mkdir(deepest)
    (deepest / "f.txt").write_text("x")
    assert remove_tree(tmp_path / "tree") and not (tmp_path / "tree").exists()


def test_a_resume_whose_event_file_the_storage_refuses_puts_its_record_back(
        run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """An immutable tb/ refuses the event file only once the record was rewritten: nothing trained,
    yet recipe.yaml said the refused run's trainer.steps."""
    import errno

    from torch.utils.tensorboard import SummaryWriter

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    before = _snapshot(copy)

    def refused(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EPERM, "Operation not permitted", str(copy / "tb"))

    monkeypatch.setattr(SummaryWriter, "__init__", refused)
    assert main(["run", "--recipe", "tiny", *FAST, "trainer.steps=5", "--resume", str(copy)]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("note:")]
    assert len(err) == 1 and "Operation not permitted" in err[0], err
    assert _snapshot(copy) == before


def _fifo_over(path: Path) -> None:
    """Rename a FIFO over ``path``: what someone who can write its folder does between two opens."""
    fifo = path.with_name(path.name + ".fifo")
    os.mkfifo(fifo)
    os.replace(fifo, path)


@pytest.mark.timeout(120)  # a regression opens the FIFO and waits for a writer: fail instead
@pytest.mark.parametrize("reader", ["analyze-health-metrics", "task-json-array", "task-jsonl", "task-csv"])
def test_a_fifo_renamed_over_an_input_between_its_reads_is_never_opened(reader: str, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """An input was checked, read once, then opened again by name (the metrics' row count then its
    rows; a .json's first byte then its text; datasets after the check): a FIFO renamed over it in
    between was waited on for ever. Each is read from the one file opened and checked."""
    import tclightning.health.io as health_io
    import tclightning.tasks.data as data

    rows = [{"question": "1+1", "answer": "#### 2"}, {"question": "2+2", "answer": "#### 4"}]
    if reader == "analyze-health-metrics":
        path = tmp_path / "metrics.csv"
        path.write_text("step,reward/mean\n0,0.5\n1,0.75\n")
        first_pass = health_io._require_rows_at_most

        def then_swapped(*args):
            first_pass(*args)
            _fifo_over(path)

        monkeypatch.setattr(health_io, "_require_rows_at_most", then_swapped)
        assert [values["reward/mean"] for _, values in health_io.read_metrics_csv(path, max_rows=10)] == [0.5, 0.75]
        return
    suffix = {"task-json-array": ".json", "task-jsonl": ".jsonl", "task-csv": ".csv"}[reader]
    path = tmp_path / f"rows{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(rows))
    elif suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        path.write_text("question,answer\n1+1,#### 2\n2+2,#### 4\n")
    # swapped after the first read (.json's first byte), before datasets opens it (.csv), or between
    # the check and the open (.jsonl: refused in one line, never waited on)
    step = {".json": "_first_byte", ".csv": "load_with_datasets", ".jsonl": "regular_file"}[suffix]
    original = getattr(data, step)

    def then_swapped(*args, **kwargs):
        if step != "load_with_datasets":
            found = original(*args, **kwargs)
            _fifo_over(path)
            return found
        _fifo_over(path)
        return original(*args, **kwargs)

    monkeypatch.setattr(data, step, then_swapped)
    if suffix == ".jsonl":
        with pytest.raises(TclightningError, match="is no longer a regular file"):
            data.read_rows(path)
    else:
        assert data.read_rows(path) == rows


def test_a_file_copied_into_memory_is_copied_only_up_to_the_size_checked(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A model folder's small file grown (sparse, to gigabytes) while it was copied into memory was
    copied whole: time and memory without bound."""
    import tclightning.files as files

    (tmp_path / "config.json").write_bytes(b"{}" * 8)
    opened = files.open_regular

    class GrowsOnRead:
        def __init__(self, handle) -> None:
            self.handle = handle

        def fileno(self) -> int:
            return self.handle.fileno()

        def read(self, size: int = -1) -> bytes:
            data = self.handle.read(size)
            os.truncate(tmp_path / "config.json", 2**30)  # its owner grows it as soon as it is read
            return data

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self.handle.close()

    monkeypatch.setattr(files, "open_regular", lambda *args, **kwargs: GrowsOnRead(opened(*args, **kwargs)))
    with files.pinned_files(tmp_path, [tmp_path / "config.json"], "the model folder's file", copied_up_to=2**20) as view:
        assert (view / "config.json").read_bytes() == b"{}" * 8


def test_a_folder_too_many_to_hold_open_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Out of descriptors for the copies (a folder of 11,000 files) was an OSError traceback."""
    import errno

    import tclightning.files as files
    from tclightning.errors import TclightningError

    (tmp_path / "config.json").write_text("{}")

    def no_more(name: str) -> int:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(os, "memfd_create", no_more)
    with pytest.raises(TclightningError, match="cannot hold its files open to read them \\(Too many open files\\)"):
        with files.pinned_files(tmp_path, [tmp_path / "config.json"], "the model folder's file", copied_up_to=2**20):
            pass
