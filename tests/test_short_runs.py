"""Short runs are short: the warm-up cache (hit, miss, bypass, bit-identical weights), the run
directory printed first, output that reaches a log file as it happens, Ctrl-C during the warm-up
(exit 130, no run directory left), failed runs that tidy up, and the intra-op thread default."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from tclightning.cache import DirectoryCache
from tclightning.models.warmup import cached_supervised_warmup
from tclightning.recipes.loader import load_recipe, to_dataclass
from tclightning.run import intra_op_threads, run
from tests.conftest import FAST, CrashAt, with_pickle

REPO = Path(__file__).resolve().parents[1]
WARMUP = ["model.warmup.steps=12", "model.warmup.batch_size=16", "model.warmup.target_accuracy=0"]


@pytest.fixture(scope="module")
def warmup_parts():
    """A small policy with its initial weights, formatter and demonstrations (built once)."""
    from tclightning.grpo.module import GRPOModule

    recipe = to_dataclass(load_recipe("tiny", [*FAST, *WARMUP]))
    module = GRPOModule(model=recipe.model, task=recipe.task, sampler=recipe.sampler, grpo=recipe.grpo,
                        anchor=recipe.anchor, seed=recipe.trainer.seed)
    initial = {k: v.clone() for k, v in module.policy.state_dict().items()}
    examples = module.train_examples
    return module, initial, [e.prompt for e in examples], [e.solution for e in examples], recipe.model.warmup


def _warm(parts, cache: DirectoryCache, cfg=None, **kwargs) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    module, initial, prompts, solutions, default = parts
    module.policy.load_state_dict(initial)
    stats = cached_supervised_warmup(module.policy, module.formatter, prompts, solutions, cfg or default,
                                     {"seed": 0}, cache=cache, **kwargs)
    return {k: v.clone() for k, v in module.policy.state_dict().items()}, stats


def _entries(cache: DirectoryCache) -> list[Path]:
    return sorted(p for p in cache.directory.glob("*") if not p.name.startswith(".")) if cache.directory.exists() else []


def test_warmup_cache_hit_is_bit_identical_and_a_changed_setting_misses(
        warmup_parts, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from dataclasses import replace

    cache = DirectoryCache("warmup", tmp_path)
    computed, _ = _warm(warmup_parts, cache, use_cache=False)
    assert _entries(cache) == []  # a bypass writes nothing
    assert not torch.equal(computed["lm_head.weight"], warmup_parts[1]["lm_head.weight"])  # it trained

    missed, stats = _warm(warmup_parts, cache)  # first time: trains and stores
    assert "warmup/cached" not in stats and len(_entries(cache)) == 1
    assert "reused from the cache" not in capsys.readouterr().err

    hit, stats = _warm(warmup_parts, cache)  # second time: loads
    assert stats["warmup/cached"] == 1.0 and stats["warmup/steps"] == 12
    assert "reused from the cache" in capsys.readouterr().err
    for name, weight in computed.items():  # bit for bit what training computes
        assert torch.equal(missed[name], weight) and torch.equal(hit[name], weight), name

    _, stats = _warm(warmup_parts, cache, cfg=replace(warmup_parts[4], lr=warmup_parts[4].lr / 2))
    assert "warmup/cached" not in stats and len(_entries(cache)) == 2  # another setting, another entry

    _, stats = _warm(warmup_parts, cache, use_cache=False)
    assert "warmup/cached" not in stats  # a bypass: trained again
    monkeypatch.setenv("TCLIGHTNING_NO_CACHE", "1")
    _, stats = _warm(warmup_parts, cache)
    assert "warmup/cached" not in stats and len(_entries(cache)) == 2


def test_run_reuses_the_warmup_and_matches_a_run_without_cache(
        run_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TCLIGHTNING_CACHE", str(tmp_path / "cache"))
    # Accuracy checks run too (every 6 steps), through the trainer's greedy sampler.
    settings = [*FAST, *WARMUP, "model.warmup.target_accuracy=0.99", "model.warmup.check_every=6",
                "trainer.steps=2", "trainer.val_every=0"]
    first = run("tiny", [*settings, "logging.name=first"], quiet=True)
    second = run("tiny", [*settings, "logging.name=second"], quiet=True)
    monkeypatch.setenv("TCLIGHTNING_NO_CACHE", "1")  # what `tclightning run --no-cache` sets
    fresh = run("tiny", [*settings, "logging.name=fresh"], quiet=True)
    monkeypatch.delenv("TCLIGHTNING_NO_CACHE")
    err = capsys.readouterr().err
    assert err.count("supervised warm-up reused from the cache") == 1
    assert "warmup/cached" not in first and second["warmup/cached"] == 1.0 and "warmup/cached" not in fresh
    assert second["warmup/accuracy"] == fresh["warmup/accuracy"]
    got = torch.load(Path(second["run_dir"]) / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    want = torch.load(Path(fresh["run_dir"]) / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    for name, weight in want.items():  # the whole run, RL steps included, is the same
        assert torch.equal(got[name], weight), name


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _entry_is_a_file(entry: Path) -> None:
    entry.rename(entry.with_name(".moved-away"))
    entry.write_text("not a folder\n")


DAMAGE = {
    "weights-truncated": lambda e: _truncate(e / "weights.pt"),
    "weights-garbage": lambda e: (e / "weights.pt").write_bytes(os.urandom(4096)),
    "weights-empty": lambda e: (e / "weights.pt").write_bytes(b""),
    "weights-fifo": lambda e: _fifo(e / "weights.pt"),
    "stats-missing": lambda e: (e / "stats.json").unlink(),
    "stats-not-json": lambda e: (e / "stats.json").write_text("{\"warmup/steps\": 2,"),
    "stats-missing-fields": lambda e: (e / "stats.json").write_text('{"warmup/seconds": 0.5}'),
    "stats-deeply-nested": lambda e: (e / "stats.json").write_text("[" * 100_000 + "]" * 100_000),  # RecursionError
    "stats-fifo": lambda e: _fifo(e / "stats.json"),
    "stats-huge": lambda e: os.truncate(e / "stats.json", 2**33),  # sparse: 8 GiB that use no disk
    "entry-is-a-file": _entry_is_a_file,
    "entry-is-a-fifo": lambda e: (e.rename(e.with_name(".moved-away")), os.mkfifo(e)),
    "weights-nan": lambda e: _poison(e / "weights.pt"),
    "weights-pickle-bomb": lambda e: with_pickle(e / "weights.pt", "punycode"),
}


def _poison(path: Path) -> None:
    state = torch.load(path, weights_only=True)
    name = next(k for k, v in state.items() if v.is_floating_point())
    state[name] = torch.full_like(state[name], float("nan"))
    torch.save(state, path)


@pytest.mark.timeout(180)  # a FIFO opened for reading would wait forever: fail instead
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_warmup_cache_entry_is_trained_again_and_replaced(
        damage: str, run_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TCLIGHTNING_CACHE", str(tmp_path / "cache"))
    settings = [*FAST, "model.warmup.steps=2", "model.warmup.batch_size=4", "model.warmup.target_accuracy=0",
                "trainer.steps=1", "trainer.val_every=0"]
    first = run("tiny", [*settings, "logging.name=first"], quiet=True)
    (entry,) = (tmp_path / "cache" / "warmup").iterdir()
    trained = torch.load(entry / "weights.pt", weights_only=True)
    DAMAGE[damage](entry)
    capsys.readouterr()

    # The new entry is written while the damaged one is still in place (never deleted first).
    import tclightning.models.warmup as warmup_module

    present_while_writing: list[bool] = []
    save = warmup_module.save_tensors

    def spy(obj, path):
        if Path(path).name == "weights.pt":  # the new entry's (written through its folder's descriptor)
            present_while_writing.append(os.path.lexists(entry))
        return save(obj, path)

    monkeypatch.setattr(warmup_module, "save_tensors", spy)
    second = run("tiny", [*settings, "logging.name=second"], quiet=True)
    monkeypatch.setattr(warmup_module, "save_tensors", save)
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "cached supervised warm-up" in notes[0] and "unreadable" in notes[0], notes
    assert "training it again" in notes[0] and str(entry) in notes[0]
    assert "warmup/cached" not in second  # trained again, from the initial weights: the same result
    assert {k: second[k] for k in ("warmup/steps", "warmup/loss_first", "warmup/loss_last")} == \
        {k: first[k] for k in ("warmup/steps", "warmup/loss_first", "warmup/loss_last")}
    assert present_while_writing == [True]
    # Replaced in place: one whole entry, the weights training gives, nothing left beside it but a
    # damaged entry that was a file: a file is removed only by name, and one of someone's renamed
    # to that name meanwhile would be what is removed, so it stays at a hidden name of the cache's.
    beside = sorted(p for p in entry.parent.iterdir() if p.name not in (".moved-away", entry.name))
    if damage in ("entry-is-a-file", "entry-is-a-fifo"):
        assert len(beside) == 1 and beside[0].name.startswith(f".{entry.name}.") and not beside[0].is_dir(), beside
    else:
        assert beside == [], beside
    assert entry.is_dir() and not entry.is_symlink()
    repaired = torch.load(entry / "weights.pt", weights_only=True)
    assert repaired.keys() == trained.keys() and all(torch.equal(repaired[k], trained[k]) for k in trained)

    third = run("tiny", [*settings, "logging.name=third"], quiet=True)
    assert third["warmup/cached"] == 1.0 and third["warmup/steps"] == 2
    err = capsys.readouterr().err
    assert "supervised warm-up reused from the cache" in err and "unreadable" not in err


@pytest.mark.parametrize("entry", ["missing", "damaged", "damaged-busy"])
def test_a_warmup_the_cache_cannot_store_says_so_once_per_run(
        entry: str, run_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A cache that takes no writes (read-only, full), or a damaged entry that cannot be swapped out
    (a mount point), costs the saving: each run trains the warm-up and says once why it could not
    be kept, never that it replaced an entry it could not write."""
    import errno
    import tempfile

    cache = tmp_path / "cache"
    monkeypatch.setenv("TCLIGHTNING_CACHE", str(cache))
    settings = [*FAST, "model.warmup.steps=2", "model.warmup.batch_size=4", "model.warmup.target_accuracy=0",
                "trainer.steps=1", "trainer.val_every=0"]
    if entry.startswith("damaged"):
        run("tiny", [*settings, "logging.name=first"], quiet=True)
        (stored,) = (cache / "warmup").iterdir()
        (stored / "weights.pt").write_bytes(b"")
    capsys.readouterr()
    real = tempfile.mkdtemp

    def read_only(*args: object, dir: object = None, **kwargs: object) -> str:
        if dir is not None and Path(str(dir)).is_relative_to(cache):
            raise OSError(errno.EROFS, "Read-only file system", str(dir))
        return real(*args, dir=dir, **kwargs)

    def busy(a: Path, b: Path) -> None:
        raise OSError(errno.EBUSY, "Device or resource busy")

    if entry == "damaged-busy":
        import tclightning.models.warmup as warmup_module

        monkeypatch.setattr(warmup_module, "exchange", busy)
    else:
        monkeypatch.setattr(tempfile, "mkdtemp", read_only)
    why = "Device or resource busy" if entry == "damaged-busy" else "Read-only file system"
    for name in ("second", "third"):
        summary = run("tiny", [*settings, f"logging.name={name}"], quiet=True)
        assert "warmup/cached" not in summary and summary["warmup/steps"] == 2  # trained each time
        notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
        unstored = [n for n in notes if "could not be stored in the cache" in n]
        assert len(unstored) == 1 and why in unstored[0] and "the next run trains it again" in unstored[0], notes
        assert len(notes) == (1 if entry == "missing" else 2) and not any("replac" in n for n in notes), notes


def test_plain_progress_lines_when_stdout_is_not_a_terminal(
        run_root: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TCLIGHTNING_NO_CACHE", "1")  # the warm-up's progress lines: trained, not reused
    run("tiny", [*FAST, "logging.progress=rich", "trainer.steps=3", "trainer.val_every=0",
                 "model.warmup.steps=4", "model.warmup.batch_size=8"], quiet=True)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("run directory: ") and Path(out[0].split(": ", 1)[1]).is_dir()
    assert any(line.startswith("supervised warm-up: stopped at step 4 of at most 4") for line in out)
    steps = [line for line in out if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == ["1/3", "2/3", "3/3"] and "reward" in steps[-1]
    assert not any("\r" in line or "%" in line for line in out)  # no redrawn bar, no percentage


def _reader(stream) -> queue.Queue:
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in iter(stream.readline, "")], daemon=True).start()
    return lines


def _next_line(lines: queue.Queue, proc: subprocess.Popen, timeout: float = 120.0) -> str:
    try:
        return lines.get(timeout=timeout)
    except queue.Empty:
        proc.kill()
        raise AssertionError("no output line in time") from None


def _default_sigint() -> None:
    """In the child before exec: SIGINT delivered and at its default, as a terminal's Ctrl-C finds
    it. A child inherits an ignored SIGINT, and a test run started in the background of a
    non-interactive shell (``make test &``, CI scripts) has one: the run would never see the signal."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_in_the_warmup_exits_130_and_removes_the_run_directory(tmp_path: Path, signum: int) -> None:
    # Output goes to a pipe (not a terminal) and PYTHONUNBUFFERED is unset: lines must still arrive live.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tclightning", "run", "--recipe", "tiny", "--no-cache", *FAST,
         "logging.progress=rich", "model.warmup.steps=100000", "model.warmup.target_accuracy=1.0",
         "model.warmup.check_every=5", "model.warmup.check_examples=4"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=_default_sigint,
    )
    lines = _reader(proc.stdout)
    first = _next_line(lines, proc)
    assert first.startswith("run directory: "), first
    shown = first.split(": ", 1)[1].strip()
    run_dir = tmp_path / shown
    assert proc.poll() is None and run_dir.is_dir()  # printed at the start, not the end
    line = _next_line(lines, proc)
    assert line.startswith("supervised warm-up: step 5 (at most 100000 steps"), line
    assert proc.poll() is None
    proc.send_signal(signum)  # SIGTERM in the warm-up as Ctrl-C: one line, nothing left (was: exit -15)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    message = err.strip().splitlines()[-1]
    assert message.startswith("interrupted during the supervised warm-up") and f"removed {shown}" in message
    assert not run_dir.exists() and list((tmp_path / "runs" / "tiny").iterdir()) == []


def test_a_run_that_fails_before_it_logs_or_saves_leaves_no_directory(run_root: Path) -> None:
    settings = [*FAST, "trainer.steps=4", "trainer.val_every=0", "trainer.checkpoint_every=2"]
    with pytest.raises(RuntimeError, match="simulated crash"):
        run("tiny", [*settings, "logging.name=early"], quiet=True, extra_callbacks=[CrashAt(0)])
    assert list((run_root / "early").iterdir()) == []
    with pytest.raises(RuntimeError, match="simulated crash"):  # logged steps, no checkpoint: kept to diagnose
        run("tiny", [*settings, "logging.name=logged"], quiet=True, extra_callbacks=[CrashAt(1)])
    (logged,) = (run_root / "logged").iterdir()
    assert (logged / "metrics.csv").is_file() and not (logged / "checkpoints" / "last.ckpt").exists()
    with pytest.raises(RuntimeError, match="simulated crash"):  # past a checkpoint: kept for --resume
        run("tiny", [*settings, "logging.name=late"], quiet=True, extra_callbacks=[CrashAt(3)])
    (kept,) = (run_root / "late").iterdir()
    assert (kept / "checkpoints" / "last.ckpt").is_file()
    with pytest.raises(RuntimeError, match="simulated crash"):  # a resumed directory is never removed
        run("tiny", [*settings, "trainer.steps=6", "trainer.checkpoint_every=25", "logging.name=late"],
            resume="last", quiet=True, extra_callbacks=[CrashAt(4)])
    assert kept.is_dir() and list((run_root / "late").iterdir()) == [kept]


def test_intra_op_threads_default(monkeypatch: pytest.MonkeyPatch) -> None:
    recipe = to_dataclass(load_recipe("tiny", ["trainer.num_threads=null", "trainer.accelerator=cpu"]))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(2)), raising=False)
    assert intra_op_threads(recipe) == 1  # a small machine: one thread, which does not thrash under load
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert intra_op_threads(recipe) == 15
    recipe.trainer.num_threads = 3
    assert intra_op_threads(recipe) == 3  # a setting is obeyed
    assert to_dataclass(load_recipe("tiny")).trainer.num_threads == 1


def test_a_checkpoint_the_disk_refuses_stops_the_run_in_one_line_and_keeps_the_last_one(
    run_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills up at the second checkpoint: the half-written file goes, step 2's checkpoint
    stays whole, and the run stops with one line naming both (the CLI exits 1)."""
    import errno

    import lightning as L

    from tclightning.callbacks.checkpointing import load_checkpoint
    from tclightning.errors import StorageError

    real_save = L.Trainer.save_checkpoint

    def save(trainer: L.Trainer, path: str | Path, *args: object, **kwargs: object) -> None:
        if trainer.global_step >= 4:  # one tick per RL step (grpo.minibatches=1): the step-4 checkpoint
            Path(path).write_bytes(b"half a checkpoint")
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(trainer, path, *args, **kwargs)

    monkeypatch.setattr(L.Trainer, "save_checkpoint", save)
    with pytest.raises(StorageError) as caught:
        run("tiny", [*FAST, "trainer.steps=4", "trainer.val_every=0", "trainer.checkpoint_every=2",
                     "grpo.minibatches=1", "logging.name=full"], quiet=True)
    message = str(caught.value)
    assert "\n" not in message and caught.value.exit_code == 1
    assert "No space left on device" in message and "(step 2) is kept" in message and "--resume" in message
    (run_dir,) = (run_root / "full").iterdir()
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt", "step-000002.ckpt"]
    assert load_checkpoint(checkpoints / "last.ckpt")["global_step"] >= 1


def test_ctrl_c_before_the_first_step_is_an_interrupt_not_a_failure(run_root: Path) -> None:
    """Lightning turns a KeyboardInterrupt it did not expect (here at the start of training, after
    the warm-up) into exit 1 after its own shutdown; the run reports an interrupt (exit 130)."""
    import lightning as L

    from tclightning.run import RunInterrupted

    class CtrlCAtTrainStart(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            raise KeyboardInterrupt

    with pytest.raises(RunInterrupted, match=r"^interrupted; removed .* \(nothing was saved yet\)"):
        run("tiny", [*FAST, "trainer.steps=2", "trainer.val_every=0", "logging.name=ctrl-c-start"], quiet=True,
            extra_callbacks=[CtrlCAtTrainStart()])
    assert not any((run_root / "ctrl-c-start").glob("*"))


@pytest.mark.parametrize("value, disabled", [("", False), ("0", False), ("false", False), ("No", False), ("OFF", False),
                                             ("1", True), ("true", True), ("yes", True)])
def test_the_no_cache_variable_reads_off_as_off(monkeypatch: pytest.MonkeyPatch, value: str, disabled: bool) -> None:
    from tclightning.cache import cache_disabled_by_env

    monkeypatch.setenv("TCLIGHTNING_NO_CACHE", value)
    assert cache_disabled_by_env() is disabled


@pytest.mark.parametrize("how", ["new-entry", "replacing-an-unreadable-one"])
def test_a_link_put_in_place_of_a_cache_entry_being_written_is_never_written_through(how: str, tmp_path: Path) -> None:
    """A cache entry is written into a folder made beside it and renamed into place: reached by name
    after it was made, a link to someone's folder put at that name had their files written over and
    became the entry."""
    from tclightning.models.warmup import _replace_entry

    user = tmp_path / "user"
    user.mkdir()
    for name in ("weights.pt", "stats.json", "notes.txt"):
        (user / name).write_text("mine")
    cache = DirectoryCache("warmup", tmp_path / "cache")
    cache.directory.mkdir(parents=True)

    def write(folder: Path) -> None:
        staged = next(cache.directory.glob(".k.*"))  # what another process sees, and swaps
        staged.rename(tmp_path / "moved-away")
        staged.symlink_to(user)
        (folder / "weights.pt").write_text("the warm-up's")
        (folder / "stats.json").write_text("{}")

    if how == "new-entry":
        why = cache.put("k", write)
    else:
        entry = cache.path("k")
        entry.mkdir()
        (entry / "weights.pt").write_text("unreadable")
        why = _replace_entry(cache, "k", os.lstat(entry), write)
    assert why is not None and "replaced while written" in why
    assert {p.name: p.read_text() for p in user.iterdir()} == dict.fromkeys(("weights.pt", "stats.json", "notes.txt"),
                                                                             "mine")
    assert not cache.path("k").is_symlink()


def _user_folder_and_cache(tmp_path: Path) -> tuple[Path, DirectoryCache]:
    """A folder of someone's (``notes.txt``: "mine") and an empty warm-up cache beside it."""
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    cache = DirectoryCache("warmup", tmp_path / "cache")
    cache.directory.mkdir(parents=True)
    return user, cache


@pytest.mark.parametrize("how", ["entry-there-already", "write-failed", "replacing-an-unreadable-one"])
def test_a_folder_renamed_to_the_temporary_name_as_it_is_removed_is_left_whole(
        how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The temporary folder was removed by name once its name was seen to lead to it: a folder of
    someone's renamed there in between (the removal's own open, microseconds later) was removed
    whole. Only the folder written (or the unreadable entry swapped out) is removed, checked on the
    descriptor it is emptied through."""
    import errno

    import tclightning.cache as cache_module
    import tclightning.models.warmup as warmup_module
    from tclightning.files import remove_tree
    from tclightning.models.warmup import _replace_entry

    user, cache = _user_folder_and_cache(tmp_path)
    landed: list[Path] = []

    def swapped_then_removed(folder: Path, **kwargs: object) -> bool:
        if not landed:  # the rename that lands between the look at the name and the removal
            folder.rename(tmp_path / "moved-away")
            user.rename(folder)
            landed.append(folder)
        return remove_tree(folder, **kwargs)

    monkeypatch.setattr(cache_module, "remove_tree", swapped_then_removed)
    monkeypatch.setattr(warmup_module, "remove_tree", swapped_then_removed)

    def write(folder: Path) -> None:
        if how == "write-failed":
            raise OSError(errno.ENOSPC, "No space left on device")
        (folder / "weights.pt").write_text("the warm-up's")

    entry = cache.path("k")
    if how == "entry-there-already":
        entry.mkdir()
        (entry / DirectoryCache.COMPLETE).write_text("ok\n")
        cache.put("k", write)
    elif how == "write-failed":
        cache.put("k", write)
    else:
        entry.mkdir()
        (entry / "weights.pt").write_text("unreadable")
        (entry / DirectoryCache.COMPLETE).write_text("ok\n")  # the cache's own, damaged
        _replace_entry(cache, "k", os.lstat(entry), write)
    assert landed and {p.name: p.read_text() for p in landed[0].iterdir()} == {"notes.txt": "mine"}


@pytest.mark.parametrize(("how", "blocked"), [("new-entry", False), ("new-entry", True),
                                             ("replacing-an-unreadable-one", False)],
                         ids=["new-entry", "new-entry-its-name-taken-again", "replacing-an-unreadable-one"])
def test_a_folder_renamed_to_the_temporary_name_as_it_moves_into_place_is_put_back(
        how: str, blocked: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The written folder was moved into place by its name after a look at it: a folder of someone's
    renamed to that name in between became the cache entry (and the next run, finding it
    unreadable, removed it). It is put back where it was renamed to, the entry left unwritten; where
    that name is taken again meanwhile (the put-back failed, leaving it at the entry), beside it."""
    import tclightning.cache as cache_module
    import tclightning.models.warmup as warmup_module
    from tclightning.models.warmup import _replace_entry

    user, cache = _user_folder_and_cache(tmp_path)
    landed: list[Path] = []

    def swapped_first(tmp: Path) -> None:
        if not landed and Path(tmp).name.startswith(".k."):
            Path(tmp).rename(tmp_path / "moved-away")
            user.rename(tmp)
            landed.append(Path(tmp))

    real_replace, real_exchange = os.replace, warmup_module.exchange

    def replace(src: Any, dst: Any) -> None:
        swapped_first(src)
        real_replace(src, dst)
        if blocked and Path(src) == landed[0] and not Path(src).exists():  # taken again: the put-back fails
            Path(src).mkdir()
            (Path(src) / "other.txt").write_text("another's")

    def exchange(a: Path, b: Path) -> None:
        swapped_first(a)
        real_exchange(a, b)

    monkeypatch.setattr(cache_module.os, "replace", replace)
    monkeypatch.setattr(warmup_module, "exchange", exchange)

    def write(folder: Path) -> None:
        (folder / "weights.pt").write_text("the warm-up's")

    entry = cache.path("k")
    if how == "new-entry":
        why = cache.put("k", write)
    else:
        entry.mkdir()
        (entry / "weights.pt").write_text("unreadable")
        why = _replace_entry(cache, "k", os.lstat(entry), write)
    assert why is not None and "replaced while written" in why
    assert landed and not (entry / "notes.txt").exists()
    kept = [folder for folder in cache.directory.glob(".k.*") if (folder / "notes.txt").exists()]
    assert len(kept) == 1 and {p.name: p.read_text() for p in kept[0].iterdir()} == {"notes.txt": "mine"}
    assert (kept[0] == landed[0]) != blocked


def test_a_folder_of_yours_at_a_cache_entry_holding_an_entrys_file_names_is_kept(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An unreadable entry was removed when it held no name but an entry's: a folder of someone's
    left at the entry (holding a weights.pt and a stats.json of theirs) went. The cache writes its
    completion mark last, before the entry moves into place: a folder without it was never one."""
    from tclightning.models.warmup import _replace_entry

    cache = DirectoryCache("warmup", tmp_path / "cache")
    entry = cache.path("k")
    entry.mkdir(parents=True)
    for name in ("weights.pt", "stats.json"):
        (entry / name).write_text("mine")

    def write(folder: Path) -> None:
        (folder / "weights.pt").write_text("the warm-up's")

    assert _replace_entry(cache, "k", os.lstat(entry), write) is None
    assert (entry / "weights.pt").read_text() == "the warm-up's"
    (kept,) = cache.directory.glob(".k.*")
    assert {p.name: p.read_text() for p in kept.iterdir()} == {"weights.pt": "mine", "stats.json": "mine"}
    assert f"it is kept as {kept}" in capsys.readouterr().err


@pytest.mark.parametrize("when", ["while-written", "before-it-is-held"])
def test_a_folder_put_in_place_of_a_cache_entry_being_written_is_never_removed_nor_written_into(
        when: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder of someone's renamed to the entry's temporary name while it was written was removed
    whole by the clean-up; one renamed there before the folder was held was written into and made
    the entry."""
    import tempfile

    import tclightning.cache as cache_module

    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    cache = DirectoryCache("warmup", tmp_path / "cache")
    cache.directory.mkdir(parents=True)

    def swap_in_user_folder() -> None:
        staged = next(cache.directory.glob(".k.*"))
        staged.rename(tmp_path / "moved-away")
        user.rename(staged)

    if when == "before-it-is-held":
        made = tempfile.mkdtemp
        monkeypatch.setattr(cache_module.tempfile, "mkdtemp",
                            lambda *args, **kwargs: (folder := made(*args, **kwargs), swap_in_user_folder())[0])
    why = cache.put("k", lambda folder: swap_in_user_folder() if when == "while-written" else None)
    assert why is not None
    kept = next(p for p in [user, *cache.directory.glob(".k.*")] if p.is_dir())
    assert [(p.name, p.read_text()) for p in kept.iterdir()] == [("notes.txt", "mine")]
    assert cache.get("k") is None


def test_the_copy_a_killed_warm_up_left_in_the_cache_is_removed_by_the_next(tmp_path: Path) -> None:
    """A warm-up killed while it wrote its cache entry left a hidden full copy of the weights
    (270 MB for SmolLM2) that no later run removed. Only a copy named after a process no longer
    running goes: one being written, and a folder of yours named alike, stay."""
    user, cache = _user_folder_and_cache(tmp_path)
    abandoned = cache.directory / ".k.999999999-abcd1234"  # no such process
    abandoned.mkdir()
    (abandoned / "weights.pt").write_text("a killed warm-up's")
    writing = cache.directory / f".k.{os.getpid()}-wxyz5678"  # a process still running
    writing.mkdir()
    yours = cache.directory / ".k.notes"
    yours.mkdir()
    (abandoned / "user").symlink_to(user)  # removed, never followed

    def write(folder: Path) -> None:
        (folder / "weights.pt").write_text("the warm-up's")

    assert cache.put("k", write) is None and (cache.path("k") / "weights.pt").read_text() == "the warm-up's"
    assert not abandoned.exists() and writing.is_dir() and yours.is_dir()
    assert (user / "notes.txt").read_text() == "mine"
