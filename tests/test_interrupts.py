"""Real processes: Ctrl-C stops cleanly with a checkpoint and a resume continues it; SIGKILL loses
at most the steps since the last checkpoint, and a resume continues with the same numbering and no
duplicated rows. (tests/test_faults.py injects the faults at named points.)"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tclightning.callbacks.checkpointing import load_checkpoint
from tclightning.grpo.summary import read_metrics
from tclightning.run import run
from tests.conftest import FAST
from tests.test_faults import CtrlCAt, assert_same_run

REPO = Path(__file__).resolve().parents[1]


def _python(script: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``script`` run by a Python process of its own (signals go to it alone), this checkout importable."""
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def _start(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "tclightning", "run", "--recipe", "tiny", *FAST, *args],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.csv"
    if not path.is_file():
        return []
    with path.open() as handle:
        return [int(row["step"]) for row in csv.DictReader(handle) if row.get("reward/mean")]


def _wait_for(predicate, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def _run_dir(tmp_path: Path) -> Path:
    _wait_for(lambda: any((tmp_path / "runs" / "tiny").glob("*/recipe.yaml")))
    return next((tmp_path / "runs" / "tiny").iterdir())


def test_ctrl_c_finishes_the_step_checkpoints_and_resume_continues(tmp_path: Path) -> None:
    proc = _start(tmp_path, "trainer.steps=500", "trainer.val_every=0")  # no validation on the way out
    run_dir = _run_dir(tmp_path)
    _wait_for(lambda: len(_steps(run_dir)) >= 2)
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output[-2000:]
    assert "Traceback" not in output
    steps = _steps(run_dir)
    assert steps == list(range(len(steps))) and len(steps) < 500
    ckpt = load_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    assert ckpt["tclightning"]["rl_step"] == len(steps)  # the checkpoint holds every logged step
    # The interrupted run continues (here to two steps past the stop) and equals one that never stopped.
    target = len(steps) + 2
    settings = [*FAST, f"logging.root={tmp_path / 'runs'}", "trainer.val_every=0", f"trainer.steps={target}"]
    assert Path(run("tiny", settings, resume="last", quiet=True)["run_dir"]) == run_dir
    reference = Path(run("tiny", [*settings, "logging.name=reference"], quiet=True)["run_dir"])
    assert_same_run(run_dir, read_metrics(reference / "metrics.csv"), range(target))


def test_sigkill_then_resume_keeps_numbering(tmp_path: Path) -> None:
    # A long run, killed once it has passed a checkpoint: the wait's condition stays true until
    # the kill, so a slow or loaded machine cannot miss it (a 12-step run could finish first).
    proc = _start(tmp_path, "trainer.steps=500", "trainer.checkpoint_every=3", "trainer.val_every=0")
    run_dir = _run_dir(tmp_path)
    last = run_dir / "checkpoints" / "last.ckpt"
    _wait_for(lambda: last.exists() and len(_steps(run_dir)) >= 7)
    proc.kill()
    proc.wait(timeout=60)
    logged = _steps(run_dir)
    saved = load_checkpoint(last)["tclightning"]["rl_step"]
    assert saved % 3 == 0 and 0 < saved <= len(logged) < 500  # killed mid-run, after a checkpoint
    target = len(logged) + 2  # past every row the killed run wrote
    resumed = subprocess.run(
        [sys.executable, "-m", "tclightning", "run", "--recipe", "tiny", *FAST, f"trainer.steps={target}",
         "trainer.checkpoint_every=3", "trainer.val_every=0", "--resume", "last"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert _steps(run_dir) == list(range(target))  # no row lost or repeated across the kill


# Validation every 2 RL steps (after steps 2, 4, 6), so a stop can land on or between validations.
VALIDATED = [*FAST, "trainer.val_every=2", "trainer.steps=6"]


def _val_rows(run_dir: Path) -> list[tuple[int, dict[str, str]]]:
    """Every validation row of ``metrics.csv`` in file order (duplicates kept): its step and values."""
    with (run_dir / "metrics.csv").open(newline="") as handle:
        return [(int(float(row["step"])), {k: v for k, v in row.items() if k.startswith("val/") and v})
                for row in csv.DictReader(handle) if row.get("val/accuracy")]


@pytest.fixture(scope="module")
def validated_reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The uninterrupted run with validation on."""
    root = tmp_path_factory.mktemp("validated")
    return run("tiny", [*VALIDATED, f"logging.root={root}"], quiet=True)


@pytest.mark.parametrize("stop_at", [2, 3], ids=["between-validations", "at-a-validation"])
def test_ctrl_c_then_resume_validates_exactly_when_an_uninterrupted_run_does(
        tmp_path: Path, validated_reference: dict, stop_at: int) -> None:
    # Ctrl-C as step `stop_at` begins: that step finishes (stop_at + 1 steps done), then the run stops.
    settings = [*VALIDATED, f"logging.root={tmp_path}"]
    stopped = run("tiny", settings, quiet=True, extra_callbacks=[CtrlCAt(stop_at)])
    run_dir = Path(stopped["run_dir"])
    assert _steps(run_dir) == list(range(stop_at + 1))
    reference_dir = Path(validated_reference["run_dir"])
    done = stop_at + 1  # a validation row is logged at step (steps done - 1)
    assert _val_rows(run_dir) == [r for r in _val_rows(reference_dir) if r[0] < done]  # none unscheduled
    resumed = run("tiny", settings, resume="last", quiet=True)
    assert Path(resumed["run_dir"]) == run_dir and _steps(run_dir) == list(range(6))
    assert [step for step, _ in _val_rows(reference_dir)] == [0, 1, 3, 5]  # start, then every 2 steps
    assert _val_rows(run_dir) == _val_rows(reference_dir)  # the same steps, the same values
    assert resumed["val_accuracy_last"] == validated_reference["val_accuracy_last"]


@pytest.mark.parametrize("hook, signum", [("setup", "SIGTERM"), ("on_fit_start", "SIGTERM"), ("setup", "SIGHUP")])
def test_sigterm_after_the_run_folder_exists_and_before_training_is_one_line(tmp_path: Path, hook: str,
                                                                             signum: str) -> None:
    """Between the run folder and the first step (the trainer's setup, a checkpoint's restore)
    nothing holds SIGTERM yet: the run stops as Ctrl-C would, in one line, and takes its empty
    folder with it. A SIGHUP (the terminal closed) is a SIGTERM."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "tclightning", "run", "--recipe", "tiny", *FAST, "trainer.steps=2", "logging.root=runs",
         f"callbacks=[{{class_path: tests.conftest.SigtermAt, init_args: {{hook: {hook}, signum: {signum}}}}}]"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 130 and len(lines) == 1 and "interrupted" in lines[0], (done.returncode, done.stderr[-3000:])
    assert not any((tmp_path / "runs" / "tiny").iterdir())


def test_a_second_sigterm_during_a_long_step_stops_the_run_at_once(tmp_path: Path) -> None:
    """The first SIGTERM asks Lightning to stop after the step; a second one (a scheduler that does
    not wait) stops now, as a second Ctrl-C does, keeping the checkpoints saved so far."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "tclightning", "run", "--recipe", "tiny", *FAST, "trainer.steps=50", "logging.root=runs",
         "trainer.val_every=0", "trainer.checkpoint_every=1",
         "callbacks=[{class_path: tests.conftest.LongStepAfterTwoSigterms, init_args: {step: 1}}]"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 130 and "interrupted" in lines[-1] and "Traceback" not in done.stderr, (
        done.returncode, done.stderr[-3000:])
    (run_dir,) = (tmp_path / "runs" / "tiny").iterdir()
    assert load_checkpoint(run_dir / "checkpoints" / "last.ckpt")["tclightning"]["rl_step"] == 1


def test_a_sigterm_at_a_resume_s_last_step_leaves_the_summary_of_the_steps_made(tmp_path: Path) -> None:
    """A SIGTERM stops after the step, checkpoint written, exit 130: the run's summary.json still
    told of the run before the resume (2 steps where the checkpoint holds 4)."""
    import json

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "tclightning", "run", "--recipe", "tiny", *FAST, "logging.root=runs",
               "trainer.val_every=0"]
    first = subprocess.run([*command, "trainer.steps=2"], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs" / "tiny").iterdir()
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2
    done = subprocess.run(
        [*command, "trainer.steps=4",
         "callbacks=[{class_path: tests.conftest.SigtermAt, init_args: {hook: on_train_batch_start, step: 3}}]",
         "--resume", str(run_dir)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 130 and "Traceback" not in done.stderr, (done.returncode, done.stderr[-3000:])
    assert load_checkpoint(run_dir / "checkpoints" / "last.ckpt")["tclightning"]["rl_step"] == 4
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 4


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _waiting_for_a_peer(tmp_path: Path, timeout_s: int, port: int | None = None) -> subprocess.Popen[str]:
    """Rank 1 of two nodes whose rank 0 never comes: it waits at the rendezvous."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO), "NODE_RANK": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port or _free_port())}
    env.pop("TCLIGHTNING_RUN_DIR", None)
    command = [sys.executable, "-m", "tclightning", "run", "--recipe", "tiny", *FAST, "trainer.steps=2",
               "logging.root=runs", "trainer.num_nodes=2", "trainer.strategy=pipeline", "pipeline.stages=2",
               f"pipeline.timeout_s={timeout_s}"]
    return subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_sigterm_while_waiting_for_the_other_nodes_is_one_line(tmp_path: Path) -> None:
    """The store waits for its peers in C++ and retries an interrupted call: a SIGTERM there still
    stops the run at once, in one line, and takes its empty folder with it."""
    with _waiting_for_a_peer(tmp_path, timeout_s=600) as child:
        assert child.stdout is not None and child.stdout.readline().startswith("run directory: ")
        time.sleep(3)  # into the rendezvous
        started = time.monotonic()
        child.send_signal(signal.SIGTERM)
        _, err = child.communicate(timeout=120)
    assert time.monotonic() - started < 60  # not the 600 s of pipeline.timeout_s
    lines = err.strip().splitlines()
    assert child.returncode == 130 and len(lines) == 1 and "interrupted" in lines[0], (child.returncode, err[-3000:])
    assert not any((tmp_path / "runs" / "tiny").iterdir())


def test_a_rendezvous_no_peer_joins_is_one_line_naming_where_it_waited(tmp_path: Path) -> None:
    with _waiting_for_a_peer(tmp_path, timeout_s=3) as child:
        _, err = child.communicate(timeout=240)
    assert child.returncode == 2, (child.returncode, err[-3000:])
    assert "Traceback" not in err and "frame #" not in err, err[-3000:]
    assert "error: trainer.num_nodes=2" in err.strip().splitlines()[-1] and "pipeline.timeout_s=3" in err
    assert not any((tmp_path / "runs" / "tiny").iterdir())


def test_a_master_that_accepts_and_never_answers_is_one_line_after_the_timeout(tmp_path: Path) -> None:
    """A host at MASTER_ADDR that takes the connection and says nothing: the store's own timeout
    never starts, and the node waited for ever."""
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)  # the kernel completes each handshake; nobody ever reads or answers
        started = time.monotonic()
        with _waiting_for_a_peer(tmp_path, timeout_s=3, port=silent.getsockname()[1]) as child:
            _, err = child.communicate(timeout=240)
    assert child.returncode == 2 and "Traceback" not in err, (child.returncode, err[-3000:])
    assert "did not all meet" in err.strip().splitlines()[-1] and time.monotonic() - started < 200
    assert not any((tmp_path / "runs" / "tiny").iterdir())


def test_a_sighup_during_the_warm_up_stops_the_run_as_sigterm_does(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO), "TCLIGHTNING_CACHE": str(tmp_path / "cache")}
    command = [sys.executable, "-m", "tclightning", "run", "--recipe", "tiny", "trainer.steps=2",
               "model.warmup.steps=100000", "logging.root=runs"]
    with subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as child:
        assert child.stdout is not None and child.stdout.readline().startswith("run directory: ")
        child.send_signal(signal.SIGHUP)
        _, err = child.communicate(timeout=120)
    assert child.returncode == 130 and "interrupted" in err.strip().splitlines()[-1], (child.returncode, err[-3000:])
    assert not any((tmp_path / "runs" / "tiny").iterdir())


def test_ctrl_c_right_after_the_run_folder_is_made_removes_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C between the run folder's creation and the trainer (here: as the run takes its lock,
    where a slow console's "run directory:" line also falls) is one line and takes the folder with it."""
    import tclightning.run as run_module

    def interrupted(folder: Path, what: str) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(run_module, "hold_lock", interrupted)
    with pytest.raises(run_module.RunInterrupted, match="interrupted before training started; removed"):
        run("tiny", [*FAST, "trainer.steps=1", f"logging.root={tmp_path / 'runs'}"], quiet=True)
    assert not any((tmp_path / "runs" / "tiny").iterdir())


def test_an_interrupt_that_escapes_the_fit_after_its_steps_never_says_training_had_not_started(
        tmp_path: Path) -> None:
    """A second SIGTERM while Lightning shut the run down after a saved step escaped as a bare
    interrupt, said as "interrupted before training started"."""
    import lightning.pytorch as pl

    import tclightning.run as run_module

    class InterruptedTwice(pl.Callback):  # the second while Lightning handles the first
        def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
            if trainer.global_step == 2:  # step 1's checkpoint is in
                raise KeyboardInterrupt

        def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
            raise KeyboardInterrupt

    with pytest.raises(run_module.RunInterrupted, match=r"^interrupted; .* keeps its checkpoints \(`--resume` continues it\)"):
        run("tiny", [*FAST, "trainer.steps=3", "trainer.val_every=0", "trainer.checkpoint_every=1",
                     f"logging.root={tmp_path / 'runs'}"], quiet=True, extra_callbacks=[InterruptedTwice()])
    (run_dir,) = (tmp_path / "runs" / "tiny").iterdir()
    assert json.loads((run_dir / "summary.json").read_text())["steps"] >= 1


def test_a_ctrl_c_as_the_run_folder_is_made_takes_it_away(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C between the run folder's making and the run taking it as its own left the empty folder."""
    import tclightning.run as run_module

    taken = run_module.own_folder

    def interrupted_first(folder: Path, *args: object, **kwargs: object) -> None:
        signal.raise_signal(signal.SIGINT)
        taken(folder, *args, **kwargs)

    monkeypatch.setattr(run_module, "own_folder", interrupted_first)
    with pytest.raises(run_module.RunInterrupted, match="interrupted before training started; removed"):
        run("tiny", [*FAST, "trainer.steps=1", f"logging.root={tmp_path / 'runs'}"], quiet=True)
    assert not any((tmp_path / "runs" / "tiny").iterdir())


def test_ctrl_c_while_a_finished_run_writes_its_summary_waits_for_it(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import tclightning.grpo.summary as summary_module

    write = summary_module.summarize

    def interrupted_then_written(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        return write(*args, **kwargs)

    monkeypatch.setattr(summary_module, "summarize", interrupted_then_written)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as a terminal's Python has it
    with pytest.raises(KeyboardInterrupt):  # delivered once the summary is on disk
        run("tiny", [*FAST, "trainer.steps=1", "trainer.val_every=0", f"logging.root={tmp_path / 'runs'}"], quiet=True)
    (run_dir,) = (tmp_path / "runs" / "tiny").iterdir()
    assert (run_dir / "summary.json").is_file()


def test_a_sigterm_in_a_finalizer_still_stops_the_run_before_training() -> None:
    """A SIGTERM whose handler runs inside a finalizer (a ``ZipFile.__del__`` the garbage collector
    ran) raised an interrupt Python prints as "Exception ignored" and drops: the run went on, and a
    warm-up of hours ran to its end. The signal is sent again once the finalizer is done."""
    from tclightning.callbacks.checkpointing import SigtermBeforeTraining

    class Finalized:
        def __del__(self) -> None:
            os.kill(os.getpid(), signal.SIGTERM)
            sum(range(1000))  # the handler runs here, inside __del__

    with SigtermBeforeTraining(), pytest.raises(KeyboardInterrupt):
        Finalized()
        time.sleep(5)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_a_library_swallowed_before_training_still_stops_the_run_at_the_next_hook(signum: int) -> None:
    """A Ctrl-C while the trainer set up or restored a checkpoint was lost to a bare ``except:``
    there: the run trained every step and exited 0."""
    from tclightning.callbacks.checkpointing import SigtermBeforeTraining

    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as a terminal's Python has it
    with SigtermBeforeTraining() as guard:
        try:
            os.kill(os.getpid(), signum)
            time.sleep(5)
        except BaseException:  # noqa: BLE001 -- a library's bare `except:`
            pass
        with pytest.raises(KeyboardInterrupt):
            guard.setup(None, None, "fit")  # type: ignore[arg-type]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_goes_back_to_its_handler_once_training_starts() -> None:
    """After ``on_train_start`` a Ctrl-C is the step-finishing stop's, whichever callback ran first."""
    from tclightning.callbacks.checkpointing import GracefulStop, SigtermBeforeTraining

    signal.signal(signal.SIGINT, signal.default_int_handler)
    for order in ("guard-first", "stop-first"):
        with SigtermBeforeTraining() as guard:
            stop = GracefulStop()
            hooks = [guard, stop] if order == "guard-first" else [stop, guard]
            for callback in hooks:
                callback.on_train_start(None, None)  # type: ignore[arg-type]
            os.kill(os.getpid(), signal.SIGINT)  # the first asks to stop after the step
            assert stop.requested, order
            with pytest.raises(KeyboardInterrupt):  # the second stops at once
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.mark.parametrize("kind", ["ctrl-c", "sigterm"])
def test_a_stop_a_rank_takes_while_it_waits_in_the_agreement_is_agreed_at_the_next_step(kind: str) -> None:
    """Across processes the ranks agree at each step's end whether to stop (a max-reduce of their
    requests). A Ctrl-C or SIGTERM that reached a rank while it waited in that reduce was written
    over by the agreed "no": lost, and the run trained on to its last step. It is agreed at the
    next step instead, and no rank stops at a step the others do not."""
    from types import SimpleNamespace

    import torch

    from tclightning.callbacks.checkpointing import GracefulStop

    stop = GracefulStop()
    sent: list[int] = []

    def reduce(tensor: torch.Tensor, reduce_op: str) -> torch.Tensor:
        if not sent:  # the signal's handler runs as the reduce returns the other rank's "no"
            sent.append(1)
            stop._handle(signal.SIGINT, None) if kind == "ctrl-c" else stop._note_sigterm(signal.SIGTERM, None)
            return torch.zeros(2)
        return tensor

    trainer = SimpleNamespace(world_size=2, strategy=SimpleNamespace(reduce=reduce), should_stop=False,
                              _signal_connector=SimpleNamespace(received_sigterm=False), limit_val_batches=1.0,
                              fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(_should_check_val_fx=lambda _: True),
                                                       _data_fetcher=None))
    stop.on_train_batch_end(trainer, None)  # type: ignore[arg-type]
    assert not trainer.should_stop and not trainer._signal_connector.received_sigterm  # the other rank goes on too
    stop.on_train_batch_end(trainer, None)  # type: ignore[arg-type]
    if kind == "ctrl-c":
        assert trainer.should_stop
    else:  # Lightning's own SIGTERM stop: checkpoint, then every rank ends after this step
        assert trainer._signal_connector.received_sigterm


def test_a_sigterm_a_library_swallowed_in_the_warm_up_stops_it_at_the_next_step(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    import tclightning.models.warmup as warmup
    from tclightning.models.config import WarmupConfig

    steps: list[int] = []

    def step(*args: object) -> None:
        steps.append(len(steps))
        if len(steps) == 2:
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
            except BaseException:  # noqa: BLE001 -- a library's bare `except:` inside the step
                pass

    monkeypatch.setattr(warmup, "_warmup_step", step)
    with pytest.raises(warmup.WarmupInterrupted):
        warmup.supervised_warmup(torch.nn.Linear(2, 2), None, [], [], WarmupConfig(steps=100))  # type: ignore[arg-type]
    assert len(steps) == 2


def test_a_closed_terminal_stops_any_command_as_sigterm_does_and_its_cleanup_runs(tmp_path: Path) -> None:
    """SIGHUP's default ended a command (a bench holding network namespaces) without its cleanup."""
    marker = tmp_path / "cleaned"
    script = ("import os, signal, sys, time\n"
              "import tclightning.recipes.loader as loader\n"
              "import tclightning.cli.main as cli\n"
              "def listing():\n"
              "    try:\n"
              "        os.kill(os.getpid(), signal.SIGHUP)\n"
              "        time.sleep(30)\n"
              "    finally:\n"
              f"        open({str(marker)!r}, 'w').write('done')\n"
              "loader.list_recipes = listing\n"
              "sys.argv = ['tclightning', 'recipes', 'list']\n"
              "sys.exit(cli.main())\n")
    done = _python(script)
    assert done.returncode == 130 and done.stderr.strip() == "interrupted", (done.returncode, done.stderr[-2000:])
    assert marker.read_text() == "done"


def test_a_sigterm_once_the_command_has_finished_is_one_line(tmp_path: Path) -> None:
    """Between the end of a command and Python's exit nothing held SIGTERM: the finished command
    died by the signal (exit -15) without a word."""
    script = ("import os, signal, sys, time\n"
              "import tclightning.cli.main as cli\n"
              "def finished():\n"
              "    os.kill(os.getpid(), signal.SIGTERM)\n"
              "    time.sleep(5)\n"
              "cli.refused_output = finished\n"
              "sys.argv = ['tclightning', 'recipes', 'list']\n"
              "sys.exit(cli.main())\n")
    done = _python(script)
    assert done.returncode == 130 and done.stderr.strip() == "interrupted while exiting; the command had finished", \
        (done.returncode, done.stderr[-2000:])


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
@pytest.mark.parametrize("writing", ["summary", "loggers", "teardown"])
def test_an_interrupt_while_a_finished_run_writes_its_record_is_said_once_it_is_written(
        writing: str, signum: int, tmp_path: Path) -> None:
    """A SIGTERM while a finished run wrote summary.json, or its loggers their last rows, or while
    Lightning tore the fit down, was swallowed (exit 0; a Ctrl-C gave 130, or was lost in the
    teardown): the run's handler for the time before training still held it."""
    slowed = {"summary": "tclightning.grpo.summary.summarize",
              "loggers": "tclightning.logging.ResumableCSVLogger.finalize",
              "teardown": "tclightning.callbacks.checkpointing.GracefulStop.teardown"}[writing]  # Lightning's, at the end
    owner, name = slowed.rsplit(".", 1)
    script = ("import importlib, os, signal, sys, threading, time\n"
              f"owner = importlib.import_module({owner!r}) if {writing!r} == 'summary' else "
              f"getattr(importlib.import_module({owner.rsplit('.', 1)[0]!r}), {owner.rsplit('.', 1)[1]!r})\n"
              f"real = getattr(owner, {name!r})\n"
              "import tclightning.run as run_module\n"
              "fit, fitted = run_module._fit, []\n"
              "def _fit(*args, **kwargs):\n"
              "    fit(*args, **kwargs)\n"
              "    fitted.append(True)\n"
              "run_module._fit = _fit\n"
              "def slow(*args, **kwargs):\n"
              f"    if fitted or {writing!r} == 'teardown':  # as the run ends (Lightning finalizes its loggers in the fit too)\n"
              f"        threading.Timer(0.3, lambda: os.kill(os.getpid(), {int(signum)})).start()\n"
              "        time.sleep(1.5)\n"
              "    return real(*args, **kwargs)\n"
              f"setattr(owner, {name!r}, slow)\n"
              "import tclightning.cli.main as cli\n"
              f"sys.argv = ['tclightning', 'run', '--recipe', 'tiny', *{FAST!r}, 'trainer.steps=1', "
              "'trainer.val_every=0', 'logging.root=runs', '--quiet']\n"
              "sys.exit(cli.main())\n")
    done = _python(script, cwd=tmp_path)
    (run_dir,) = (tmp_path / "runs" / "tiny").iterdir()
    assert done.returncode == 130, (done.returncode, done.stderr[-2000:])
    assert done.stderr.strip().splitlines()[-1] == (f"interrupted as the run finished; {run_dir.relative_to(tmp_path)} "
                                                     "keeps its checkpoints and summary.json"), done.stderr[-2000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] >= 1  # written first, then said
    assert len([row for row in csv.DictReader((run_dir / "metrics.csv").open()) if row.get("reward/mean")]) == 1


@pytest.mark.parametrize("command", [["tclightning", "recipes", "list"], ["lightning", "fit", "--help"],
                                     ["lightning", "run", "--help"]])
def test_an_interrupt_while_torch_loads_is_said_once_it_is_loaded(command: list[str], tmp_path: Path) -> None:
    """A SIGTERM or Ctrl-C while torch's C++ start-up ran aborted the command with a C++ stack
    (SIGABRT), or was swallowed there and the command went on (or failed on a half-imported module);
    ``lightning`` died by a SIGTERM while it started, without a word."""
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "import os, signal, time\n"
        "try:  # what torch's C++ start-up does with an interrupt raised inside it: it cannot pass it on\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(1)\n"
        "except KeyboardInterrupt:\n"
        "    pass\n")
    main = "tclightning.cli.main" if command[0] == "tclightning" else "tclightning.cli.lightning"
    script = f"import sys\nimport {main} as cli\nsys.argv = {command!r}\nsys.exit(cli.main())\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": f"{tmp_path}:{REPO}"})
    assert done.returncode == 130 and done.stderr.strip().splitlines()[-1] == "interrupted", \
        (done.returncode, done.stderr[-2000:])


def test_a_second_sigterm_while_the_first_one_s_line_is_said_is_no_traceback() -> None:
    """A SIGTERM stopped a resume's restore; a second one, milliseconds later, came while the
    command said so: a KeyboardInterrupt traceback after the one line."""
    script = ("import argparse, os, signal, sys\n"
              "import tclightning.cli.main as cli\n"
              "class SecondSigterm:\n"
              "    def __init__(self, stream): self.stream, self.sent = stream, False\n"
              "    def write(self, text):\n"
              "        if not self.sent:\n"
              "            self.sent = True\n"
              "            os.kill(os.getpid(), signal.SIGTERM)\n"
              "        return self.stream.write(text)\n"
              "    def __getattr__(self, name): return getattr(self.stream, name)\n"
              "def stopped(args):\n"
              "    sys.stderr = SecondSigterm(sys.stderr)\n"
              "    raise KeyboardInterrupt('interrupted before training started; nothing was written')\n"
              "real = cli.build_parser\n"
              "def build():\n"
              "    parser = real()\n"
              "    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))\n"
              "    listing = next(a for a in commands.choices['recipes']._actions\n"
              "                   if isinstance(a, argparse._SubParsersAction))\n"
              "    listing.choices['list'].set_defaults(func=stopped)\n"
              "    return parser\n"
              "cli.build_parser = build\n"
              "sys.argv = ['tclightning', 'recipes', 'list']\n"
              "sys.exit(cli.main())\n")
    done = _python(script)
    assert done.returncode == 130 and "Traceback" not in done.stderr, (done.returncode, done.stderr[-2000:])


def test_a_command_that_gave_up_on_a_download_ends_though_its_library_threads_still_read() -> None:
    """datasets downloads 16 files or more on a thread pool started inside the watched download:
    given up on (the pace's one line), its workers, still reading dripping bodies, were joined by
    the interpreter at exit, and the command never ended."""
    script = (
        "import concurrent.futures, sys, threading\n"
        "from tclightning.cli.main import finish_loggers_or_exit\n"
        "from tclightning.limits import watched\n"
        "never = threading.Event()\n"
        "def download():\n"
        "    pool = concurrent.futures.ThreadPoolExecutor(2)\n"
        "    list(pool.map(lambda _: never.wait(), range(2)))\n"
        "def interrupted(waited):\n"
        "    if waited > 0.3 and sys.argv[1] == 'interrupted':\n"
        "        raise KeyboardInterrupt\n"
        "    return 0.5 - waited if sys.argv[1] == 'given-up' else 0.1\n"
        "try:\n"
        "    watched(download, interrupted)\n"
        "except (TimeoutError, KeyboardInterrupt):\n"
        "    print('error: its download fell below 1 MiB/s', file=sys.stderr)\n"
        "sys.exit(finish_loggers_or_exit(2))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for how in ("given-up", "interrupted"):  # a Ctrl-C or SIGTERM during the download leaves it reading too
        done = subprocess.run([sys.executable, "-c", script, how], env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 2 and done.stderr.strip().splitlines() == [
            "error: its download fell below 1 MiB/s"], (how, done.returncode, done.stderr[-2000:])
