"""State a checkpoint carries that no recipe checks: codec bases, cut counters, health-monitor
records, optimizer states, weights and the checkpoint's own sections. Each one that does not fit
is refused with one line, and a refused resume leaves its run directory byte for byte as it was."""

from __future__ import annotations

import copy
import json
import io
import os
import re
import signal
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from tclightning.callbacks.collapse import CollapseDetector
from tclightning.cli.main import main
from tclightning.codecs.lowrank import AdaptiveLowRankCodec
from tclightning.errors import TclightningError
from tclightning.grpo.module import GRPOModule
from tclightning.pipeline import PipelineConfig
from tclightning.pipeline.cuts import CutSet
from tests.conftest import FAST, PICKLE_BOMBS, two_step_run, with_pickle

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return two_step_run(tmp_path_factory.mktemp("hostile-state"))


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _crafted(run_dir: Path, tmp_path: Path, edit) -> Path:
    copied = tmp_path / "run"
    shutil.copytree(run_dir, copied)
    path = copied / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(path, weights_only=False)
    edit(checkpoint)
    torch.save(checkpoint, path)
    return copied


def _first_float_weight(checkpoint: dict) -> str:
    return next(k for k, v in checkpoint["state_dict"].items() if k.startswith("policy.") and v.is_floating_point())


def _resume(copied: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    capsys.readouterr()
    code = main(["run", "--recipe", "tiny", *FAST, "trainer.steps=3", "trainer.val_every=0", "--quiet",
                 "--resume", str(copied)])
    err = [line for line in capsys.readouterr().err.splitlines()
           if line.startswith("error:") or "Traceback" in line]
    return code, err


@pytest.mark.parametrize("edit, names", [
    (lambda c: c["tclightning"]["rng"].__setitem__("python", (3, (1, 2, 3), None)), ("could not be restored",)),
    (lambda c: c.__setitem__("optimizer_states", []), ("optimizer_states", "could not be restored")),
    (lambda c: c["state_dict"].__setitem__(_first_float_weight(c), c["state_dict"][_first_float_weight(c)] > 0),
     ("torch.bool",)),
    (lambda c: c["loops"]["fit_loop"]["epoch_loop.state_dict"].__setitem__("_batches_that_stepped", 5),
     ("batches stepped: 5",)),
    (lambda c: c["optimizer_states"][0]["param_groups"][0].__setitem__("lr", 1e308), ("learning rate 1e+308",)),
    (lambda c: c["optimizer_states"][0]["state"][0].__setitem__("step", torch.tensor(float("nan"))),
     ("step count of parameter 0 is nan",)),
    (lambda c: c["lr_schedulers"][0].__setitem__("_last_lr", [1e9]), ("last reported 1000000000.0",)),
    (lambda c: [g.__setitem__("initial_lr", 1.0) for g in c["optimizer_states"][0]["param_groups"]],
     ("base learning rate is 1.0",)),
    # the schedule steps with each optimizer step: -100 trained at a negative learning rate
    (lambda c: c["lr_schedulers"][0].__setitem__("last_epoch", -100), ("schedule is at tick -100",)),
    (lambda c: c["lr_schedulers"][0].__setitem__("last_epoch", 10**12), ("schedule is at tick 1000000000000",)),
], ids=["rng", "no-optimizer-state", "bool-weight", "loop-counter", "lr", "adam-step", "last-lr", "base-lr",
        "schedule-negative", "schedule-past"])
def test_a_refused_resume_leaves_the_run_directory_as_it_was(
        run_dir: Path, tmp_path: Path, edit, names: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    copied = _crafted(run_dir, tmp_path, edit)
    before = _snapshot(copied)
    code, err = _resume(copied, capsys)
    assert code == 2 and len(err) == 1, err
    for name in names:
        assert name in err[0], err
    assert _snapshot(copied) == before  # recipe.yaml, hparams.yaml, metrics.csv and tb/ untouched


def test_a_resume_trains_with_the_recipe_s_adamw_settings(run_dir: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A checkpoint's ``maximize`` trained by gradient ascent without a word, its ``eps`` and
    ``weight_decay`` were taken as they were, and its ``amsgrad`` or ``capturable`` ended the first
    step in a traceback: every setting but the rates is the recipe's."""
    crafted = {"maximize": True, "amsgrad": True, "capturable": True, "eps": 1e30, "weight_decay": 0.5,
               "betas": (0.0, 0.0)}
    copied = _crafted(run_dir, tmp_path,
                      lambda c: [g.update(crafted) for g in c["optimizer_states"][0]["param_groups"]])
    code, err = _resume(copied, capsys)
    assert code == 0 and not err, err
    resumed = torch.load(copied / "checkpoints" / "last.ckpt", weights_only=False)
    (group,) = resumed["optimizer_states"][0]["param_groups"]
    assert (group["maximize"], group["amsgrad"], group["capturable"], group["eps"], group["weight_decay"]) == \
        (False, False, False, 1e-8, 0.0) and tuple(group["betas"]) == (0.9, 0.99)


@pytest.mark.parametrize("edit, names", [
    (lambda c: c.__setitem__("hyper_parameters", None), ("'hyper_parameters' is a NoneType",)),
    (lambda c: c.__setitem__("tclightning", [1, 2]), ("'tclightning' is a list",)),
    (lambda c: c["hyper_parameters"]["model"]["tiny"].__setitem__("num_heads", 3), ("model.tiny.num_heads",)),
    (lambda c: c["state_dict"][_first_float_weight(c)].view(-1).__setitem__(0, float("nan")), ("NaN or Inf",)),
    (lambda c: c["state_dict"].__setitem__(_first_float_weight(c), c["state_dict"][_first_float_weight(c)].long()),
     ("torch.int64",)),
    (lambda c: c["hyper_parameters"]["task"].__setitem__("system_prompt", "${oc.env:HOME}"),
     ("task.system_prompt", "interpolation")),
    (lambda c: c["hyper_parameters"]["grpo"].__setitem__("lr", "${grpo.lr}"), ("grpo.lr", "interpolation")),
    (lambda c: c.__setitem__("pytorch-lightning_version", "0.0.1"), ("'pytorch-lightning_version' is '0.0.1'",)),
], ids=["hparams-none", "state-a-list", "heads", "nan-weight", "int-weight", "env-interpolation", "self-reference",
        "lightning-0.0.1"])
def test_a_checkpoint_that_does_not_fit_is_one_line_for_export_and_the_api(
        run_dir: Path, tmp_path: Path, edit, names: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    copied = _crafted(run_dir, tmp_path, edit)
    ckpt = copied / "checkpoints" / "last.ckpt"
    with pytest.raises(TclightningError) as refused:
        GRPOModule.load_from_checkpoint(str(ckpt))
    with ckpt.open("rb") as handle, pytest.raises(TclightningError):
        GRPOModule.load_from_checkpoint(handle)
    capsys.readouterr()
    assert main(["export", str(ckpt), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    for name in names:
        assert name in str(refused.value) and name in err[0], (name, str(refused.value), err)
    assert not (tmp_path / "out").exists()


def _cuts() -> CutSet:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=50)
    model = transformers.LlamaForCausalLM(config).eval()
    return CutSet(model, PipelineConfig(layout="all", stages=2, codec="lowrank", rate=0.25))


@pytest.mark.parametrize("state, match", [
    ({"garbage": 1}, "expected step, codec and forward"),
    ({"step": 3, "codec": "lowrank", "forward": []}, "one codec state per cut"),
    ({"step": -7, "codec": "lowrank", "forward": [{}]}, "step -7"),
    ({"step": True, "codec": "lowrank", "forward": [{}]}, "step True"),
    ({"step": 0, "codec": "zip", "forward": [{}]}, "codec 'zip'"),
    ({"step": 0, "forward": [[1]]}, "one codec state per cut"),
    ({"step": 0, "forward": [{}], "sender": [{}, {}]}, "in 'sender'"),
], ids=["other-keys", "no-codec-states", "negative-step", "bool-step", "unknown-codec", "entry-a-list", "senders"])
def test_a_cut_state_that_is_not_for_these_cuts_is_refused_before_anything_changes(state: dict, match: str) -> None:
    with _cuts() as cuts:
        assert len(cuts.boundaries) == 1
        before = copy.deepcopy(cuts.state_dict())
        with pytest.raises(ValueError, match=match):
            cuts.load_state_dict(state)
        assert cuts.state_dict() == before and cuts.config.codec == "lowrank"


def _fitted(dim: int = 16, rank: int = 4) -> AdaptiveLowRankCodec:
    codec = AdaptiveLowRankCodec(dim, rank, token_slots=4)
    gen = torch.Generator().manual_seed(0)
    codec.observe_dense(torch.randn(200, dim, generator=gen), torch.randint(0, 9, (200,), generator=gen))
    codec.fit_shared(1)
    return codec


@pytest.mark.parametrize("edit, match", [
    (lambda s: s.__setitem__("basis", s["basis"][:-1]), "'basis'.*shape 16x4"),
    (lambda s: s.__setitem__("basis", "x"), "'basis'.*got str"),
    (lambda s: s.__setitem__("mean", s["mean"].long()), "'mean'"),
    (lambda s: s["basis"].__setitem__((0, 0), float("inf")), "'basis'"),
    (lambda s: s.__setitem__("token_offsets", s["token_offsets"][:1]), "'token_offsets'"),
    (lambda s: s.__setitem__("version", -1), "'version'"),
    (lambda s: s.__setitem__("shared", {"count": 5, "total": torch.zeros(16, dtype=torch.float64),
                                        "outer": torch.zeros(3, 3, dtype=torch.float64)}), "'outer'"),
], ids=["basis-rows", "basis-text", "mean-ints", "basis-inf", "offsets", "version", "moments"])
def test_a_basis_codec_refuses_saved_state_of_another_size_or_kind(edit, match: str) -> None:
    saved = _fitted().state_dict()
    _fitted().load_state_dict(copy.deepcopy(saved))  # its own state loads
    edit(saved)
    with pytest.raises(ValueError, match=match):
        AdaptiveLowRankCodec(16, 4, token_slots=4).load_state_dict(saved)


@pytest.mark.parametrize("key, value", [("rollbacks", -100), ("lr_factor", float("nan")), ("lr_factor", 0.0),
                                        ("last_healthy_path", 3), ("stopped_at", -1), ("no_data_warned", "yes")])
def test_a_health_monitor_refuses_a_saved_state_out_of_range(key: str, value: object) -> None:
    state = CollapseDetector().state_dict()
    CollapseDetector().load_state_dict(copy.deepcopy(state))
    state[key] = value
    monitor = CollapseDetector()
    with pytest.raises(ValueError, match=key):
        monitor.load_state_dict(state)
    assert monitor.rollbacks == 0


@pytest.mark.parametrize("signum", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_ctrl_c_after_a_command_finished_is_one_line_and_exit_130(signum: str) -> None:
    script = ("import os, signal, time\n"
              "from tclightning.console import exit_at_late_interrupt\n"
              "exit_at_late_interrupt()\n"
              f"os.kill(os.getpid(), signal.{signum})\n"
              "time.sleep(30)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert done.returncode == 130 and done.stderr.strip() == "interrupted while exiting; the command had finished"


@pytest.mark.parametrize("signum", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_ctrl_c_while_the_interpreter_is_torn_down_leaves_the_exit_code(signum: str) -> None:
    """Python resets its signal handlers to the default before it tears the modules down: a Ctrl-C
    or SIGTERM there (a finished run's objects being freed) killed the command without a word."""
    script = ("import os, signal, sys, time\n"
              "from tclightning.console import ignore_interrupts_at_teardown, sigterm_interrupts\n"
              "if sys.argv[1] == 'ignore':\n"
              "    ignore_interrupts_at_teardown()\n"
              "    sigterm_interrupts()\n"
              "class Late:\n"
              "    def __del__(self):\n"
              f"        os.kill(os.getpid(), signal.{signum})\n"
              "        time.sleep(0.2)\n"
              "late = Late()\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    without = subprocess.run([sys.executable, "-c", script, "keep"], capture_output=True, text=True, timeout=60, env=env)
    done = subprocess.run([sys.executable, "-c", script, "ignore"], capture_output=True, text=True, timeout=60, env=env)
    assert without.returncode == -getattr(signal, signum)  # what the console command did before
    assert done.returncode == 0 and done.stderr == "", (done.returncode, done.stderr)


def test_a_gguf_package_is_found_without_running_its_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tclightning.models.loading import package_folder, resolve_gguf

    package = tmp_path / "planted" / "sub"
    package.mkdir(parents=True)
    for folder in (package.parent, package):
        (folder / "__init__.py").write_text(f"open({str(tmp_path / 'RAN')!r}, 'a').write('x')\n")
    (package / "model.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert package_folder("planted.sub") == package and package_folder("planted.missing") is None
    assert resolve_gguf("planted.sub:model.gguf") == (str(package), "model.gguf")
    assert not (tmp_path / "RAN").exists() and "planted" not in sys.modules


def test_load_from_checkpoint_takes_no_hparams_file(run_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "hp.yaml").write_text("model: {source: hf, name: x, trust_remote_code: true}\n")
    with pytest.raises(TclightningError, match="hparams_file"):
        GRPOModule.load_from_checkpoint(str(run_dir / "checkpoints" / "last.ckpt"), hparams_file=tmp_path / "hp.yaml")


@pytest.mark.parametrize("link", ["checkpoints/.step.ckpt.tmp", "checkpoints/.last.ckpt.tmp", "trajectory",
                                  "trajectory/point-00000003.pt", "tb/checkpoints", "tb/nested/events.out"])
def test_a_resume_refuses_a_link_planted_where_it_writes(run_dir: Path, tmp_path: Path, link: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    copied = tmp_path / "run"
    shutil.copytree(run_dir, copied)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "precious.txt").write_text("precious")
    planted = copied / link
    planted.parent.mkdir(parents=True, exist_ok=True)
    planted.symlink_to(mine if link in ("trajectory", "tb/checkpoints") else mine / "precious.txt")
    before = _snapshot(copied)
    capsys.readouterr()
    assert main(["run", "--recipe", "tiny", *FAST, "trainer.steps=4", "trainer.val_every=0", "--quiet",
                 "--resume", str(copied)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a symbolic link" in err[0] and link in err[0], err
    assert _snapshot(copied) == before
    assert sorted(p.name for p in mine.iterdir()) == ["precious.txt"] and (mine / "precious.txt").read_text() == "precious"


def test_a_resume_prunes_only_its_own_step_files(run_dir: Path, tmp_path: Path) -> None:
    copied = tmp_path / "run"
    shutil.copytree(run_dir, copied)
    folder = copied / "checkpoints"
    keep = {name: name.encode() for name in ("step-000001.keep.ckpt", "step-000002 backup.ckpt", "step-0000001.ckpt")}
    for name, data in keep.items():
        (folder / name).write_bytes(data)
    assert main(["run", "--recipe", "tiny", *FAST, "trainer.steps=4", "trainer.val_every=0",
                 "trainer.checkpoint_every=1", "trainer.keep_checkpoints=1", "--quiet", "--resume", str(copied)]) == 0
    assert all((folder / name).read_bytes() == data for name, data in keep.items())
    assert sorted(p.name for p in folder.glob("step-*.ckpt") if p.name not in keep) == ["step-000004.ckpt"]


@pytest.mark.parametrize("record", [b"my notes on this run \xff\n", b"a: [unclosed\n"], ids=["not-utf8", "not-yaml"])
def test_a_resume_keeps_a_record_it_cannot_read_beside_the_new_one(run_dir: Path, tmp_path: Path, record: bytes,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A ``recipe.yaml`` the resume could not read (your notes written over it, damage) was
    replaced by the new record without a word."""
    copied = tmp_path / "run"
    shutil.copytree(run_dir, copied)
    (copied / "recipe.yaml").write_bytes(record)
    capsys.readouterr()
    assert main(["run", "--recipe", "tiny", *FAST, "trainer.steps=3", "trainer.val_every=0", "--quiet",
                 "--resume", str(copied)]) == 0
    assert (copied / "recipe.before-step-2.yaml").read_bytes() == record
    assert "recipe.yaml is not a record it can read; the earlier record is kept as recipe.before-step-2.yaml" \
        in capsys.readouterr().err


def test_a_checkpoint_load_in_one_thread_keeps_its_allow_list_when_another_thread_s_ends(run_dir: Path) -> None:
    """torch's allow-list is one per process: a load ending in one thread took the globals away from
    another thread's load, and that genuine checkpoint was refused as crafted."""
    import threading

    from tclightning.callbacks.checkpointing import checkpoint_allow_list, checkpoint_globals, load_checkpoint

    entered, leave = threading.Event(), threading.Event()

    def other_thread_s_load() -> None:
        with checkpoint_allow_list():
            entered.set()
            leave.wait(60)

    other = threading.Thread(target=other_thread_s_load)
    other.start()
    assert entered.wait(60)
    with checkpoint_allow_list():
        leave.set()
        other.join(60)  # the other block has ended while this one is open
        assert all(g in torch.serialization.get_safe_globals() for g in checkpoint_globals())
        load_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    assert not any(g in torch.serialization.get_safe_globals() for g in checkpoint_globals())


def test_step_files_are_pruned_oldest_step_first_past_a_million_steps(tmp_path: Path) -> None:
    """By name, ``step-1000000.ckpt`` sorted before ``step-999999.ckpt``: the newest file was pruned;
    a name of other digits than ASCII's (which ``\\d`` matched) is a user's."""
    from tclightning.callbacks.checkpointing import own_step_files

    for name in ("step-999998.ckpt", "step-1000000.ckpt", "step-999999.ckpt", "step-1000001.ckpt", "step-0999999.ckpt",
                 "step-\uff10\uff10\uff10\uff10\uff10\uff11.ckpt"):  # a user's, in fullwidth digits int() reads
        (tmp_path / name).write_bytes(b"")
    assert [p.name for p in own_step_files(tmp_path, 1_000_000)] == ["step-999998.ckpt", "step-999999.ckpt",
                                                                     "step-1000000.ckpt"]


def test_a_kernel_interface_that_stat_calls_a_file_is_never_read(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from tclightning.files import regular_file

    (tmp_path / "kmsg.yaml").symlink_to("/proc/self/status")  # S_ISREG; /proc/kmsg of the same kind blocks
    with pytest.raises(TclightningError, match="a kernel interface, not a file"):
        regular_file(tmp_path / "kmsg.yaml", "recipe")
    assert main(["run", "--recipe", str(tmp_path / "kmsg.yaml")]) == 2
    assert "kernel interface" in capsys.readouterr().err


def test_an_export_beside_a_folder_named_like_a_staging_folder_of_no_process_goes_on(run_dir: Path,
                                                                                      tmp_path: Path) -> None:
    (tmp_path / ".out.export-99999999999999999999-x").mkdir()
    assert main(["export", str(run_dir), str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "tclightning_export.json").is_file()


def test_analyze_trajectory_refuses_a_fifo_point_at_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    os.mkfifo(tmp_path / "point-00000000.pt")
    assert main(["analyze", "trajectory", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "named pipe (FIFO)" in err[0], err


def _write_probe_csv(path: Path) -> None:
    from tclightning.cli.probe import write_csv

    write_csv([{"config": "dense"}], path, ("config",))


def _write_figure(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tclightning.files import save_figure

    fig, _ = plt.subplots()
    save_figure(fig, path, dpi=20)
    plt.close(fig)


def _write_tensors(path: Path) -> None:
    from tclightning.files import save_tensors

    save_tensors({"x": torch.zeros(2)}, path)


def _write_trace(path: Path) -> None:
    from tclightning.health.traces import Trace

    import numpy as np

    Trace("t", "", [(0, {"reward/mean": 0.5})], np.zeros(1), None, 1).to_csv(path)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("planted", ["link", "fifo"])
@pytest.mark.parametrize("write", [_write_probe_csv, _write_figure, _write_tensors, _write_trace],
                         ids=["probe-csv", "figure", "tensors", "trace-csv"])
def test_a_report_is_written_beside_a_link_or_fifo_never_through_it(tmp_path: Path, write, planted: str) -> None:
    """``probe ... --out``, ``analyze trajectory``, trajectory points and synthetic traces write by
    atomic replace: a link at the name is replaced (the file it names untouched), a FIFO never waited on."""
    mine = tmp_path / "mine.txt"
    mine.write_text("precious")
    path = tmp_path / "out.file"
    if planted == "link":
        path.symlink_to(mine)
    else:
        os.mkfifo(path)
    write(path)
    assert mine.read_text() == "precious"
    assert path.is_file() and not path.is_symlink() and path.stat().st_size > 0


def test_a_failed_run_keeps_its_folder_when_another_run_or_a_file_lies_inside(tmp_path: Path) -> None:
    from tclightning.files import own_folder
    from tclightning.run import RUN_MARKER, discard_unfinished_run

    def unfinished(name: str) -> Path:  # as mark_run_dir makes it: its folders taken as the run's
        folder = tmp_path / name
        folder.mkdir()
        own_folder(folder)
        for made in ("tb", "checkpoints"):
            (folder / made).mkdir(parents=True)
            own_folder(folder / made)
        _made_by_the_run(folder / RUN_MARKER)
        _made_by_the_run(folder / "recipe.yaml", "name: tiny\n")
        return folder

    alone = unfinished("alone")
    assert discard_unfinished_run(alone, created=True) and not alone.exists()
    host = unfinished("host")
    inner = host / "tb" / "tiny" / "20260101-000000"  # a run whose logging.root lies inside this one
    (inner / "checkpoints").mkdir(parents=True)
    (inner / RUN_MARKER).write_text("")
    (inner / "checkpoints" / "note.txt").write_text("finished")
    assert not discard_unfinished_run(host, created=True)
    assert (inner / "checkpoints" / "note.txt").read_text() == "finished"
    other = unfinished("other")
    (other / "notes.md").write_text("mine")
    assert not discard_unfinished_run(other, created=True) and (other / "notes.md").read_text() == "mine"
    for placed in ("tb/notes.txt", "checkpoints/README.txt", "trajectory/mine.pt"):  # inside the run's own folders
        kept = unfinished(placed.replace("/", "-"))
        (kept / placed).parent.mkdir(exist_ok=True)
        (kept / placed).write_text("mine")
        assert not discard_unfinished_run(kept, created=True) and (kept / placed).read_text() == "mine", placed
    written = unfinished("written")  # what the run itself writes there goes with it
    for own in ("tb/events.out.tfevents.1.host.1.0", "tb/hparams.yaml", "checkpoints/.last.ckpt.tmp"):
        (written / own).parent.mkdir(exist_ok=True)
        _made_by_the_run(written / own)
    assert discard_unfinished_run(written, created=True) and not written.exists()


def _made_by_the_run(path: Path, text: str = "written by the run") -> None:
    """``path`` written as the run writes its files (this process made it)."""
    from tclightning.files import own_file

    with own_file(path, "x") as handle:
        handle.write(text)


def _failed_new_run(folder: Path) -> Path:
    """A new run folder as mark_run_dir makes it, with what a run that failed at once wrote."""
    from tclightning.files import own_folder
    from tclightning.run import RUN_MARKER

    folder.mkdir()
    own_folder(folder)
    for made in ("tb", "checkpoints"):
        (folder / made).mkdir()
        own_folder(folder / made)
    for written in (RUN_MARKER, "recipe.yaml", "tb/hparams.yaml", "tb/events.out.tfevents.1.host.1.0"):
        _made_by_the_run(folder / written)
    return folder


@pytest.mark.parametrize("put", ["a folder beside", "a folder in place of tb", "a file in place of one"])
def test_what_is_renamed_into_a_failed_run_folder_after_its_check_stays(put: str, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The check of a failed new run's entries was by name and its removal emptied the folder
    whole: a folder of yours renamed in between (a Ctrl-C before the first step) went with it."""
    import tclightning.run as run_module
    from tclightning.run import discard_unfinished_run

    run_dir = _failed_new_run(tmp_path / "run")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "results.csv").write_text("precious")
    removal = run_module.remove_tree

    def renamed_in_first(folder: Path, **kwargs: object) -> bool:
        if put == "a folder beside":
            mine.rename(run_dir / "trajectory")
        elif put == "a folder in place of tb":
            (run_dir / "tb").rename(tmp_path / "old-tb")
            mine.rename(run_dir / "tb")
        else:
            (mine / "results.csv").rename(run_dir / "recipe.yaml")
        return removal(folder, **kwargs)

    monkeypatch.setattr(run_module, "remove_tree", renamed_in_first)
    assert not discard_unfinished_run(run_dir, created=True)
    kept = {"a folder beside": "trajectory/results.csv", "a folder in place of tb": "tb/results.csv",
            "a file in place of one": "recipe.yaml"}[put]
    assert (run_dir / kept).read_text() == "precious"
    assert sorted(p.relative_to(run_dir).as_posix() for p in run_dir.rglob("*")) == sorted({kept, kept.split("/")[0]})


@pytest.mark.parametrize("written", ["before-the-run", "during-the-run"])
def test_a_file_of_yours_moved_into_a_failed_run_folder_under_a_name_the_run_writes_is_kept(
        written: str, tmp_path: Path) -> None:
    """A file of yours moved into a failed new run's folder under a name the run writes (an events
    file into tb/, a summary.json) was removed with it: the names were all that was checked (then
    its age, and one written during the run was still removed)."""
    from tclightning.run import discard_unfinished_run

    for placed in ("summary.json", "tb/events.out.tfevents.2.host.2.0", "recipe.yaml"):
        run_dir = _failed_new_run(tmp_path / placed.replace("/", "-"))
        mine = tmp_path / f"mine-{run_dir.name}"
        mine.write_text("precious")
        if written == "before-the-run":
            os.utime(mine, ns=(time.time_ns() - 3600 * 10**9,) * 2)
        mine.replace(run_dir / placed)
        assert not discard_unfinished_run(run_dir, created=True)
        assert (run_dir / placed).read_text() == "precious"
    assert discard_unfinished_run(fresh := _failed_new_run(tmp_path / "fresh"), created=True) and not fresh.exists()


def test_a_file_the_run_replaced_or_gave_up_is_forgotten_where_no_generation_is_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a filesystem that keeps no inode generations (overlayfs), a file of yours handed the inode
    number of one the run had replaced was taken for the run's: the numbers the run frees are forgotten."""
    from tclightning import files

    monkeypatch.setattr(files, "_MADE_FILES", {})
    monkeypatch.setattr(files, "_made_identity", lambda fd: (*(lambda i: (i.st_dev, i.st_ino))(os.fstat(fd)), None))
    record = tmp_path / "recipe.yaml"
    files.replace_text(record, "first")
    first = os.lstat(record)
    files.replace_text(record, "second")  # the first file's number is free now
    assert (first.st_dev, first.st_ino, None) not in files._MADE_FILES
    assert files.made_file(record) is not None
    with pytest.raises(RuntimeError):
        files.replace_file(tmp_path / "other.yaml", lambda handle: (_ for _ in ()).throw(RuntimeError("full")))
    assert len(files._MADE_FILES) == 1  # the temporary file given up: its number forgotten too


def test_a_program_that_calls_run_keeps_its_own_process_settings(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``run(...)`` left the MLflow tracking URI, Lightning's seed variables, torch's thread count,
    the threads' exception hook, the random generators it seeds, Lightning's logger level and a
    warnings filter as the run set them (the program's next run logged elsewhere); and it put back
    the whole environment, undoing what another thread of the program changed meanwhile."""
    import logging
    import random
    import threading
    import warnings

    import lightning.pytorch as pl
    import numpy as np

    from tclightning.run import run

    go, done = threading.Event(), threading.Event()

    def program_thread() -> None:  # a thread of the program, busy while the run trains
        if go.wait(300):
            os.environ["TCL_TEST_MINE"] = "set"
            os.environ.pop("TCL_TEST_GONE", None)
        done.set()

    class ProgramThread(pl.Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            go.set()
            done.wait(60)
            library = threading.Thread(target=lambda: os.environ.__setitem__("TCL_TEST_LIBRARY", "run's"))
            library.start()  # a thread the run starts (a library's worker): its writes are the run's
            library.join()

    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # an earlier test's abandoned request may set it late
    lightning_log = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    threads, level = torch.get_num_threads(), lightning_log.level
    torch.set_num_threads(2)  # the run sets 1 (trainer.num_threads)
    os.environ["TCL_TEST_GONE"] = "removed by the program"
    try:
        environment, hook, filters = dict(os.environ), threading.excepthook, list(warnings.filters)
        program = threading.Thread(target=program_thread)
        program.start()
        generators = torch.random.get_rng_state(), random.getstate(), np.random.get_state()[1].tolist()
        run("tiny", [*FAST, "trainer.steps=1", "trainer.val_every=0", f"logging.root={tmp_path}",
                     "logging.loggers=[csv,mlflow]"], quiet=True, extra_callbacks=[ProgramThread()])
        program.join(60)
        kept = {name: value for name, value in environment.items() if name != "TCL_TEST_GONE"}
        assert dict(os.environ) == {**kept, "TCL_TEST_MINE": "set"}  # the program's thread's changes, none of the run's
        assert torch.get_num_threads() == 2 and threading.excepthook is hook
        assert torch.equal(torch.random.get_rng_state(), generators[0]) and random.getstate() == generators[1]
        assert np.random.get_state()[1].tolist() == generators[2]
        assert lightning_log.level == level
        assert [f for f in warnings.filters if f[1] is not None and "LeafSpec" in f[1].pattern] == \
            [f for f in filters if f[1] is not None and "LeafSpec" in f[1].pattern] == []
    finally:
        go.set()
        torch.set_num_threads(threads)
        os.environ.pop("TCL_TEST_MINE", None)


def test_the_environment_a_thread_changes_in_the_block_is_put_back_another_thread_s_stays() -> None:
    """:func:`own_writes_undone`: this thread's sets and removals undone (nested blocks each their own),
    and a thread's it started meanwhile; a thread's that was alive before kept; and ``os.environ`` its
    own class again once no block is open."""
    import threading

    from tclightning.environment import own_writes_undone

    environ_type = type(os.environ)
    plain = environ_type.__setitem__
    os.environ["TCL_TEST_OLD"] = "old"
    go = threading.Event()
    program = threading.Thread(target=lambda: go.wait(60) and os.environ.update(TCL_TEST_OTHER="kept"))
    program.start()
    try:
        with own_writes_undone():
            os.environ["TCL_TEST_NEW"] = "new"
            del os.environ["TCL_TEST_OLD"]
            with own_writes_undone():
                os.environ["TCL_TEST_OLD"] = "inner"
                os.environb[b"TCL_TEST_BYTES"] = b"b"
            assert "TCL_TEST_OLD" not in os.environ and "TCL_TEST_BYTES" not in os.environ
            go.set()
            program.join(60)
            worker = threading.Thread(target=lambda: os.environ.update(TCL_TEST_WORKER="undone"))
            worker.start()
            worker.join()
        assert os.environ["TCL_TEST_OLD"] == "old" and "TCL_TEST_NEW" not in os.environ
        assert "TCL_TEST_WORKER" not in os.environ
        assert os.environ["TCL_TEST_OTHER"] == "kept" and environ_type.__setitem__ is plain
        with pytest.raises(RuntimeError), own_writes_undone():
            os.environ["TCL_TEST_NEW"] = "new"
            raise RuntimeError("the run failed")
        assert "TCL_TEST_NEW" not in os.environ
        # a name the block wrote and the program's thread wrote after it: the program's value stays
        go.clear()
        program = threading.Thread(target=lambda: go.wait(60) and os.environ.update(TCL_TEST_NEW="program's"))
        program.start()
        with own_writes_undone():
            os.environ["TCL_TEST_NEW"] = "run's"
            go.set()
            program.join(60)
        assert os.environ["TCL_TEST_NEW"] == "program's"
        # a hook of the program's on os.environ, put there between two blocks: it runs in a block and stays
        seen: list[object] = []

        def hook(self: object, key: object, value: object) -> None:
            seen.append(key)
            plain(self, key, value)

        environ_type.__setitem__ = hook  # type: ignore[method-assign]
        try:
            with own_writes_undone():
                os.environ["TCL_TEST_NEW"] = "again"
            assert environ_type.__setitem__ is hook and seen == ["TCL_TEST_NEW"] * 2  # the write and its undoing
            assert os.environ["TCL_TEST_NEW"] == "program's"
        finally:
            environ_type.__setitem__ = plain  # type: ignore[method-assign]
    finally:
        for name in ("TCL_TEST_OLD", "TCL_TEST_OTHER", "TCL_TEST_NEW"):
            os.environ.pop(name, None)


def test_a_file_that_got_the_inode_number_of_one_the_run_made_is_not_the_run_s(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run's file deleted, its inode number handed out again to a file of yours (ext4 does at once),
    moved into a failed new run's folder: taken for the run's own by its device and inode, and deleted."""
    from tclightning import files

    monkeypatch.setattr(files, "_MADE_FILES", {})
    made = tmp_path / "made"
    _made_by_the_run(made)
    identity = os.lstat(made)
    assert files.made_file(made) == (identity.st_dev, identity.st_ino)
    (entry,) = files._MADE_FILES
    if entry[2] is None:
        pytest.skip("this filesystem keeps no inode generations")
    files._MADE_FILES.clear()  # as if the run's file was deleted and its number handed to this one
    files._MADE_FILES[(entry[0], entry[1], entry[2] + 1)] = files._RECORD.get()
    assert files.made_file(made) is None
    files._MADE_FILES[entry] = files._RECORD.get()
    files.forget_made_files()  # a new run: an earlier run's files are not its own
    assert files.made_file(made) is None


def test_a_run_in_another_thread_keeps_the_record_of_the_files_it_made(tmp_path: Path) -> None:
    """Two new runs in two threads of one program: the second's start forgot the first's files, so
    the first, failing before its first step, kept its empty run folder."""
    import threading

    from tclightning import files

    steps: list[tuple[str, object]] = []
    second_began = threading.Event()

    def first_run() -> None:
        files.forget_made_files()
        files.replace_text(tmp_path / "first.yaml", "first")
        steps.append(("mine", files.made_file(tmp_path / "first.yaml")))
        second_began.wait(60)
        steps.append(("after the second began", files.made_file(tmp_path / "first.yaml")))
        steps.append(("the second's", files.made_file(tmp_path / "second.yaml")))

    def second_run() -> None:
        files.forget_made_files()
        files.replace_text(tmp_path / "second.yaml", "second")
        second_began.set()

    threads = [threading.Thread(target=first_run), threading.Thread(target=second_run)]
    threads[0].start()
    while not steps:
        time.sleep(0.01)
    threads[1].start()
    for thread in threads:
        thread.join(60)
    first = os.lstat(tmp_path / "first.yaml")
    assert steps == [("mine", (first.st_dev, first.st_ino)), ("after the second began", (first.st_dev, first.st_ino)),
                     ("the second's", None)]


@pytest.mark.parametrize("where", ["tb", "trajectory"])
def test_a_file_of_yours_where_a_new_run_makes_a_folder_is_one_line_and_kept(where: str, tmp_path: Path) -> None:
    """A file at a new run's tb/ or trajectory/ was a FileExistsError traceback, and the run's
    clean-up then removed it with the run folder."""
    from tclightning.callbacks.trajectory import TrajectoryRecorder
    from tclightning.recipes.loader import load_recipe, to_dataclass
    from tclightning.run import discard_unfinished_run, mark_run_dir

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / where).write_text("mine")
    with pytest.raises(TclightningError, match=f"{where} is (not a folder|a link, a file)"):
        if where == "tb":
            mark_run_dir(run_dir, to_dataclass(load_recipe("tiny", [])))
        else:
            recorder = TrajectoryRecorder()
            recorder._take(run_dir / where, fresh=True)
    assert not discard_unfinished_run(run_dir, created=True)
    assert (run_dir / where).read_text() == "mine"


def _bind_mount(source: Path, target: Path) -> None:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a bind mount needs root")
    target.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "--bind", str(source), str(target)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"mount --bind refused here: {done.stderr.decode().strip()}")


def test_an_export_into_an_empty_mount_point_names_it(run_dir: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """An empty volume mounted at OUT was refused as "written by another export meanwhile"."""
    volume, out = tmp_path / "volume", tmp_path / "out"
    volume.mkdir()
    _bind_mount(volume, out)
    try:
        capsys.readouterr()
        assert main(["export", str(run_dir), str(out)]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        assert err == [f"error: export: {out} is a mount point, which the export cannot be moved onto; export into "
                       f"a new folder inside it ({out / 'policy'})"], err
        assert not any(volume.iterdir())
    finally:
        subprocess.run(["umount", str(out)], check=False)


@pytest.mark.parametrize("remove", ["remove_tree", "export --overwrite"])
def test_a_removal_never_reaches_into_a_bind_mount(run_dir: Path, tmp_path: Path, remove: str) -> None:
    from tclightning.files import remove_tree

    data = tmp_path / "data"
    data.mkdir()
    (data / "precious.txt").write_text("precious")
    out = tmp_path / "out"
    if remove == "export --overwrite":
        assert main(["export", str(run_dir), str(out)]) == 0
    mounted = out / "sub"
    _bind_mount(data, mounted)  # same filesystem: only the mount table tells it apart
    try:
        if remove == "remove_tree":
            (out / "mine.txt").write_text("gone")
            assert not remove_tree(out)
            assert not (out / "mine.txt").exists()
        else:  # an export is flat files: one holding a folder (the mount) is someone's, never replaced
            assert main(["export", str(run_dir), str(out), "--overwrite"]) == 2
        assert (data / "precious.txt").read_text() == "precious"
    finally:
        for table in Path("/proc/self/mounts").read_text().splitlines():
            point = table.split(" ")[1]
            if point.startswith(str(tmp_path)):
                subprocess.run(["umount", "-l", point], check=False)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("planted, said", [("fifo", "config.json: is a named pipe"),
                                           ("kernel", "tokenizer.json: is /proc/"),
                                           ("template-fifo", "default.jinja: is a named pipe"),
                                           ("huge-template", "chat_template.jinja: is 65 MiB")])
def test_a_model_folder_whose_files_are_not_files_is_one_line(tmp_path: Path, planted: str, said: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    if planted == "fifo":
        os.mkfifo(folder / "config.json")  # transformers would wait on it forever
    else:
        (folder / "config.json").write_text("{}")
    if planted == "kernel":
        (folder / "tokenizer.json").symlink_to("/proc/self/status")  # S_ISREG, as /proc/kmsg, which blocks
    elif planted == "template-fifo":  # the tokenizer reads every template in this folder
        (folder / "additional_chat_templates").mkdir()
        os.mkfifo(folder / "additional_chat_templates" / "default.jinja")
    elif planted == "huge-template":  # read whole into memory: sparse, no disk used
        with (folder / "chat_template.jinja").open("wb") as handle:
            handle.truncate(65 * 2**20)
    capsys.readouterr()
    assert main(["run", "--recipe", "tiny", "model.source=hf", f"model.name={folder}",
                 f"logging.root={tmp_path / 'runs'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.name" in err[0] and said in err[0], err
    assert not (tmp_path / "runs").exists()


@pytest.mark.timeout(30)
def test_a_task_file_past_its_size_bound_is_refused_unread(tmp_path: Path) -> None:
    from tclightning.tasks.data import TASK_FILE_MAX_BYTES, read_rows

    big = tmp_path / "big.jsonl"
    with big.open("wb") as handle:
        handle.truncate(TASK_FILE_MAX_BYTES + 1)  # sparse: no disk used, and no line break in it
    with pytest.raises(TclightningError, match="more than the 4 GiB"):
        read_rows(big)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("key, value", [("task.num_train", 10**12), ("grpo.lr", -1.0), ("sampler.temperature", 0.0)])
def test_load_from_checkpoint_checks_every_hyper_parameter_in_its_range(
        run_dir: Path, tmp_path: Path, key: str, value: object) -> None:
    def edit(checkpoint: dict) -> None:
        section, name = key.split(".")
        checkpoint["hyper_parameters"][section][name] = value

    copied = _crafted(run_dir, tmp_path, edit)
    with pytest.raises(TclightningError, match=rf"^{key}: "):
        GRPOModule.load_from_checkpoint(str(copied / "checkpoints" / "last.ckpt"))


@pytest.mark.parametrize("out", ["/proc/out", "/sys/out"])
def test_an_export_into_a_kernel_filesystem_is_one_line(run_dir: Path, out: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["export", str(run_dir), out]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"export: cannot write in {Path(out).parent}" in err[0], err


@pytest.mark.parametrize("folder", ["tb", "trajectory"])
def test_a_resume_whose_run_folder_is_a_file_is_blamed_on_the_folder(run_dir: Path, tmp_path: Path, folder: str,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    copied = tmp_path / "run"
    shutil.copytree(run_dir, copied)
    if (copied / folder).is_dir():
        shutil.rmtree(copied / folder)
    (copied / folder).write_text("a file of mine")
    before = _snapshot(copied)
    code, err = _resume(copied, capsys)
    assert code == 2 and len(err) == 1 and f"{copied / folder} is not a folder" in err[0], err
    assert _snapshot(copied) == before


@pytest.mark.parametrize("given", ["link", "link/checkpoints/last.ckpt"])
def test_a_resume_through_a_link_you_made_to_the_run_folder_continues_it_in_place(
        run_dir: Path, tmp_path: Path, given: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``--resume`` of a link to a run folder (yours: you typed it) is that folder: it stopped
    mid-run with "was replaced during the run" when the run's folder checks met the link."""
    copied = tmp_path / "run"
    shutil.copytree(run_dir, copied)
    (tmp_path / "link").symlink_to(copied)
    code, err = _resume(tmp_path / given, capsys)
    assert code == 0 and not err, err
    assert torch.load(copied / "checkpoints" / "last.ckpt", weights_only=False)["tclightning"]["rl_step"] == 3
    assert (tmp_path / "link").is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == ["link", "run"]


def test_a_folder_exchanged_with_the_run_folder_a_resume_locked_is_never_resumed_instead(
        run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A resume locks its run folder, then took "the run folder" by name only later: another run's
    folder exchanged with it in between (while the checkpoint loads) was resumed instead, its
    metrics cut and its last checkpoint moved aside, with no word."""
    import tclightning.run as run_module

    mine, theirs = tmp_path / "run", tmp_path / "theirs"
    shutil.copytree(run_dir, mine)
    shutil.copytree(run_dir, theirs)
    (theirs / "notes.txt").write_text("theirs")
    before = _snapshot(theirs)
    load = run_module.resume_module

    def exchanged_while_loading(*args: Any, **kwargs: Any) -> Any:
        mine.rename(tmp_path / "aside")
        theirs.rename(mine)
        (tmp_path / "aside").rename(theirs)
        return load(*args, **kwargs)

    monkeypatch.setattr(run_module, "resume_module", exchanged_while_loading)
    code, err = _resume(mine, capsys)
    assert code == 2 and len(err) == 1 and "changed while this resume started" in err[0], err
    assert _snapshot(mine) == before  # theirs, now at the name: untouched


def test_a_resume_from_a_bare_file_name_reads_the_file_in_the_working_folder(
        run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``--resume mine.ckpt`` read ``../mine.ckpt`` (the path was rebuilt from its parent's name, empty)."""
    here = tmp_path / "here"
    here.mkdir()
    shutil.copyfile(run_dir / "checkpoints" / "last.ckpt", here / "mine.ckpt")
    (tmp_path / "mine.ckpt").write_bytes(b"not this one")
    monkeypatch.chdir(here)
    capsys.readouterr()
    assert main(["run", "--recipe", "tiny", *FAST, "trainer.steps=3", "trainer.val_every=0",
                 f"logging.root={tmp_path / 'runs'}", "--quiet", "--resume", "mine.ckpt"]) == 0
    assert str(here / "mine.ckpt") in capsys.readouterr().err  # the note of a new run folder names the file read


def test_resume_last_never_picks_a_linked_run_folder(run_dir: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "runs"
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(run_dir, elsewhere)
    (root / "tiny").mkdir(parents=True)
    (root / "tiny" / "99991231-235959").symlink_to(elsewhere)  # the newest name, and the newest files
    before = _snapshot(elsewhere)
    capsys.readouterr()
    assert main(["run", "--recipe", "tiny", *FAST, "trainer.steps=3", "trainer.val_every=0", f"logging.root={root}",
                 "--quiet", "--resume", "last"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no checkpoint under" in err[0], err
    assert _snapshot(elsewhere) == before


def test_resume_last_while_another_run_prunes_its_checkpoints_is_no_traceback(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``--resume last`` while another run of the recipe prunes its step files: one listed and gone
    before its time was read was a FileNotFoundError traceback."""
    from tclightning.recipes.loader import load_recipe, to_dataclass
    from tclightning.run import plan_run

    for name, step in (("20260101-000000", 1), ("20260101-000001", 2)):
        (tmp_path / "runs" / "tiny" / name / "checkpoints").mkdir(parents=True)
        (tmp_path / "runs" / "tiny" / name / "checkpoints" / f"step-{step:06d}.ckpt").write_bytes(b"x")
    pruned = tmp_path / "runs" / "tiny" / "20260101-000001" / "checkpoints" / "step-000002.ckpt"
    listed = Path.is_file

    def pruned_once_listed(path: Path) -> bool:
        found = listed(path)
        if path == pruned and found:
            path.unlink()  # the other run prunes it now
        return found

    monkeypatch.setattr(Path, "is_file", pruned_once_listed)
    recipe = to_dataclass(load_recipe("tiny", [f"logging.root={tmp_path / 'runs'}"]))
    with pytest.raises(TclightningError) as refused:  # the older run's folder, which has no last.ckpt
        plan_run(recipe, "last")
    assert "20260101-000000" in str(refused.value)


def test_an_abandoned_staging_folder_another_export_tidied_first_is_passed_over(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Two exports tidying the same abandoned staging folder: the second's rmdir of one the first had
    removed was a FileNotFoundError traceback."""
    from tclightning import export

    abandoned = tmp_path / ".policy.export-999999-abc"
    abandoned.mkdir()
    monkeypatch.setattr(export, "process_running", lambda pid: abandoned.rmdir())  # the other export, just before
    export.clear_abandoned_staging(tmp_path / "policy")
    assert not abandoned.exists()


@pytest.mark.timeout(120)
def test_prompts_that_leave_no_room_to_answer_are_left_out_with_a_note(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A 100k-character question on a 128-position model would never finish sampling: such
    prompts are left out (as verl's filter_overlong_prompts), and the run says how many."""
    rows = [{"question": "q" * n, "answer": "#### 1"} for n in (5, 6, 7, 8, 9, 10, 11, 12, 100_000, 500)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    capsys.readouterr()
    assert main(["run", "--recipe", "tiny", *FAST, "trainer.steps=1", "trainer.val_every=0", "task.name=gsm8k",
                 f"task.path={tmp_path / 'rows.jsonl'}", "task.eval_size=2", "grpo.prompts_per_step=2",
                 f"logging.root={tmp_path / 'runs'}", "--quiet"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "prompts are longer" in line]
    assert len(notes) == 1 and notes[0].startswith("note: 2 of 10 prompts"), notes


@pytest.mark.parametrize("argument, value", [("seed", 2**70), ("total_steps", -5), ("val_batch_size", 0)])
def test_the_module_s_own_arguments_are_checked_as_a_checkpoint_stores_them(argument: str, value: int) -> None:
    with pytest.raises(TclightningError, match=rf"^{argument}: "):
        GRPOModule(**{argument: value})


@pytest.mark.timeout(60)
@pytest.mark.parametrize("config, said", [
    (b"{bad", "cannot be loaded as a model (OSError"),
    (b'{"model_type": "llama", "hidden_size": 65536, "num_hidden_layers": 100000, "num_attention_heads": 2}',
     "declares 100000 layers, not a layer count"),
    (b'{"model_type": "llama", "hidden_size": 65536, "num_hidden_layers": 8, "num_attention_heads": 2}',
     "far more than its weight files hold"),
])
def test_a_model_folder_transformers_cannot_load_is_one_line(tmp_path: Path, config: bytes, said: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_bytes(config)
    (folder / "model.safetensors").write_bytes(os.urandom(64))
    capsys.readouterr()
    assert main(["run", "--recipe", "tiny", "model.source=hf", f"model.name={folder}",
                 f"logging.root={tmp_path / 'runs'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and said in err[0], err
    assert not (tmp_path / "runs").exists()


@pytest.mark.timeout(30)
def test_an_export_of_a_checkpoint_naming_an_uncached_hub_model_is_one_line_at_once(
        run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def edit(checkpoint: dict) -> None:
        checkpoint["hyper_parameters"]["model"].update(source="hf", name="nobody-here/no-such-model")

    copied = _crafted(run_dir, tmp_path, edit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    capsys.readouterr()
    assert main(["export", str(copied), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not in the Hugging Face cache" in err[0], err


@pytest.mark.parametrize("command", [["analyze", "trajectory", "{run}"], ["probe", "cuts", "--recipe", "tiny"],
                                     ["probe", "inference", "--recipe", "tiny"], ["probe", "coherence", "--recipe", "tiny"],
                                     ["bench", "step-link", "--recipe", "tiny", "--dir"], ["bench", "two-node", "--dir"]],
                         ids=["analyze-trajectory", "probe-cuts", "probe-inference", "probe-coherence", "bench-step-link",
                              "bench-two-node"])
def test_an_output_folder_through_a_link_loop_is_one_line_before_any_work(
        tmp_path: Path, command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """``--out loop/x`` with ``loop -> loop``: mkdir failed with ELOOP after the work (probe cuts:
    the whole probe), a traceback."""
    run = tmp_path / "run" / "trajectory"
    run.mkdir(parents=True)
    for i in range(3):
        torch.save({"step": i, "point": torch.arange(8.0) * i}, run / f"point-{i:08d}.pt")
    (tmp_path / "loop").symlink_to("loop")
    argv = [part.replace("{run}", str(tmp_path / "run")) for part in command]
    argv += [str(tmp_path / "loop" / "x")] if argv[-1] == "--dir" else ["--out", str(tmp_path / "loop" / "x")]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "loop is a link that leads nowhere" in err[0], err


@pytest.mark.parametrize("where", ["a-checkpoint-weight", "a-trajectory-point", "an-anchor-replay"])
def test_state_in_a_float_type_torch_cannot_check_for_nan_is_refused_in_one_line(where: str, tmp_path: Path) -> None:
    """float8 and float4 tensors load (torch.save writes them) but CPU torch has no isfinite for
    them: each check that looked for NaN raised NotImplementedError, a traceback."""
    from tclightning.models.loading import check_weights
    from tclightning.probes.trajectory import load_trajectory

    odd = torch.zeros(8, dtype=torch.float8_e4m3fn)
    if where == "a-checkpoint-weight":
        with pytest.raises(TclightningError, match="weight 'w' is a torch.float8_e4m3fn tensor"):
            check_weights({"w": torch.zeros(8)}, {"w": odd}, "checkpoint x")
    elif where == "a-trajectory-point":
        for i in range(3):
            torch.save({"step": i, "point": odd}, tmp_path / f"point-{i:08d}.pt")
        with pytest.raises(TclightningError, match="not a point"):
            load_trajectory(tmp_path)
    else:
        def odd_logp(job: dict) -> None:
            rollouts = job["payload"]["rollouts"]
            rollouts.logp_sampler = rollouts.logp_sampler.to(torch.float8_e4m3fn)

        anchor, params, computed = _restored_job(odd_logp)
        with pytest.raises(TclightningError, match="its replay is not"):
            anchor.tick(1, first=False, parameters=lambda: params, payload=lambda: None,
                        gradient=lambda job: computed.append(job) or ([torch.zeros_like(p) for p in params], 0.0))


def test_a_folder_where_a_report_goes_is_refused_before_any_report_is_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--overwrite`` into a folder holding a folder named ``trajectory.md``: the line said nothing
    was written, after ``trajectory.json`` was."""
    run = tmp_path / "run" / "trajectory"
    run.mkdir(parents=True)
    for i in range(3):
        torch.save({"step": i, "point": torch.arange(8.0) * i + i * i}, run / f"point-{i:08d}.pt")
    (tmp_path / "out" / "trajectory.md").mkdir(parents=True)
    capsys.readouterr()
    assert main(["analyze", "trajectory", str(tmp_path / "run"), "--out", str(tmp_path / "out"), "--overwrite"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds a folder trajectory.md" in err[0], err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["trajectory.md"]


def test_analyze_trajectory_shows_terminal_escapes_in_a_point_s_fields_never_sends_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A point's ``unit`` or ``method`` is any short text: an escape in it would retitle or clear the
    terminal the table is printed to."""
    run = tmp_path / "run" / "trajectory"
    run.mkdir(parents=True)
    for i in range(3):
        torch.save({"step": i, "point": torch.arange(8.0) * i, "unit": "\x1b]0;owned\x07step", "method": "\x1b[2J"},
                   run / f"point-{i:08d}.pt")
    capsys.readouterr()
    assert main(["analyze", "trajectory", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\\x1b]0;owned\\x07step" in out, out


@pytest.mark.parametrize("saved", ["parameter", "requires-grad"])
def test_analyze_trajectory_reads_a_point_saved_with_its_gradient_flag_as_its_values(
        tmp_path: Path, saved: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A point saved as an ``nn.Parameter`` or a tensor that requires grad passed every check, then
    the plot's ``.numpy()`` raised (a traceback, after the JSON and markdown were written)."""
    run = tmp_path / "run" / "trajectory"
    run.mkdir(parents=True)
    for i in range(4):
        point = torch.arange(8.0) * i + torch.full((8,), float(i * i))
        point = torch.nn.Parameter(point) if saved == "parameter" else point.requires_grad_()
        torch.save({"step": i, "point": point}, run / f"point-{i:08d}.pt")
    assert main(["analyze", "trajectory", str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "analysis" / "trajectory.png").is_file()


@pytest.mark.parametrize("bad", ["garbage", "not-a-dict", "nan", "scalar", "stride-0", "compressed", "pickle-bomb",
                                 "point-holds-itself", "unit-holds-itself", "seed-nan", "one-step-twice", "out-is-a-file",
                                 "out-under-proc", "linked-default", "huge-values"])
def test_analyze_trajectory_refuses_bad_points_and_outputs_in_one_line(tmp_path: Path, bad: str,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A stride-0 point of 1.6 KB expanded to 2^30 values before any check (a compressed record
    likewise inflates): each is refused before a value is read."""
    folder = tmp_path / "run" / "trajectory"
    folder.mkdir(parents=True)
    for i in range(4):
        point = torch.full((8,), float(i)) + torch.arange(8.0) * i
        if bad == "nan" and i == 2:
            point[0] = float("nan")
        if bad == "stride-0" and i == 2:
            point = torch.zeros(1).expand(1 << 24)
        if bad == "huge-values" and i == 2:  # finite, but squared to inf: the eigensolver raised LinAlgError
            point = torch.full((8,), 1e308, dtype=torch.float64)
        record = {"step": i, "point": point if bad != "scalar" else torch.tensor(float(i))}
        looped: list = [1.0]
        looped.append(looped)  # walked without end (a report's json.dumps too)
        if i == 2 and bad in ("point-holds-itself", "unit-holds-itself"):
            record["point" if bad == "point-holds-itself" else "unit"] = looped
        if bad == "seed-nan":  # the report's JSON holds no NaN: json.dumps raised
            record["seed"] = float("nan")
        if bad == "one-step-twice":  # analysed as a trajectory without a word
            record["step"] = 1
        torch.save(record if bad != "not-a-dict" or i < 3 else [1, 2], folder / f"point-{i:08d}.pt")
    if bad == "garbage":
        (folder / "point-00000009.pt").write_bytes(b"not torch")
    if bad == "pickle-bomb":
        with_pickle(folder / "point-00000009.pt", "dict-key-of-shared-tuples")
    if bad == "compressed":  # the same records, deflated
        stored = folder / "point-00000002.pt"
        with zipfile.ZipFile(stored) as source:
            records = [(info.filename, source.read(info)) for info in source.infolist()]
        with zipfile.ZipFile(stored, "w", zipfile.ZIP_DEFLATED) as deflated:
            for name, data in records:
                deflated.writestr(name, data)
    out = {"out-is-a-file": tmp_path / "afile", "out-under-proc": Path("/proc/self/x")}.get(bad)
    (tmp_path / "afile").write_text("mine")
    if bad == "linked-default":
        (tmp_path / "elsewhere").mkdir()
        (tmp_path / "run" / "analysis").symlink_to(tmp_path / "elsewhere")
    capsys.readouterr()
    assert main(["analyze", "trajectory", str(tmp_path / "run"), *(["--out", str(out)] if out else [])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    said = {"stride-0": "stored bytes", "compressed": "is compressed", "pickle-bomb": "ages to hash",
            "huge-values": "a value past 1e+100"}.get(bad)
    assert said is None or said in err[0], err
    assert (tmp_path / "afile").read_text() == "mine" and not any((tmp_path / "elsewhere").glob("*")) \
        if bad == "linked-default" else (tmp_path / "afile").read_text() == "mine"


@pytest.mark.timeout(30)
def test_load_from_checkpoint_naming_an_uncached_hub_model_is_refused_at_once(
        run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def edit(checkpoint: dict) -> None:
        checkpoint["hyper_parameters"]["model"].update(source="hf", name="nobody-here/no-such-model")

    copied = _crafted(run_dir, tmp_path, edit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(TclightningError, match="not in the Hugging Face cache"):
        GRPOModule.load_from_checkpoint(str(copied / "checkpoints" / "last.ckpt"))


def _first_moment(checkpoint: dict) -> dict:
    return next(iter(checkpoint["optimizer_states"][0]["state"].values()))


@pytest.mark.parametrize("edit, match", [
    (lambda c: _first_moment(c).update(exp_avg=torch.zeros(3)), "exp_avg of parameter"),
    (lambda c: _first_moment(c).update(exp_avg_sq=_first_moment(c)["exp_avg_sq"] * float("nan")), "exp_avg_sq"),
    (lambda c: c["optimizer_states"][0]["param_groups"][0].update(lr="big"), "are not numbers"),
    (lambda c: c["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"].update(ready=9, started=9),
     "ready, started, completed"),
], ids=["moment-shape", "moment-nan", "lr-text", "loop-counters"])
def test_an_optimizer_or_loop_state_that_does_not_fit_is_refused_before_the_first_step(
        run_dir: Path, tmp_path: Path, edit, match: str, capsys: pytest.CaptureFixture[str]) -> None:
    copied = _crafted(run_dir, tmp_path, edit)
    before = _snapshot(copied)
    code, err = _resume(copied, capsys)
    assert code == 2 and len(err) == 1 and match in err[0], err
    assert _snapshot(copied) == before


@pytest.mark.parametrize("edit", [lambda sd: sd.pop(next(iter(sd))), lambda sd: sd.update({"policy.extra": torch.zeros(1)})],
                         ids=["missing", "unexpected"])
def test_load_from_checkpoint_names_weights_that_are_not_the_model_s(run_dir: Path, tmp_path: Path, edit) -> None:
    copied = _crafted(run_dir, tmp_path, lambda c: edit(c["state_dict"]))
    with pytest.raises(TclightningError, match="weights"):
        GRPOModule.load_from_checkpoint(str(copied / "checkpoints" / "last.ckpt"))


@pytest.mark.parametrize("named", ["mine", "mine/new/.."], ids=["the-folder", "through-a-folder-yet-to-be-made"])
def test_a_run_dir_variable_naming_a_folder_of_yours_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str], named: str) -> None:
    """``mine/new/..`` is ``mine`` once the run has made ``new``: it is refused as ``mine`` is."""
    from tclightning.run import RUN_DIR_ENV

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "metrics.csv").write_text("my,own\n")
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / named))
    capsys.readouterr()
    assert main(["run", "--recipe", "tiny", *FAST, "trainer.devices=2", "trainer.strategy=pipeline", "pipeline.stages=2",
                 f"logging.root={tmp_path / 'runs'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a folder of yours" in err[0], err
    assert sorted(p.name for p in mine.iterdir()) == ["metrics.csv"] and (mine / "metrics.csv").read_text() == "my,own\n"


def test_load_from_checkpoint_names_a_missing_lightning_version(run_dir: Path, tmp_path: Path) -> None:
    """Lightning's load reads the version before anything else: without it, one line, not a KeyError."""
    copied = _crafted(run_dir, tmp_path, lambda c: c.pop("pytorch-lightning_version"))
    with pytest.raises(TclightningError, match="has no 'pytorch-lightning_version'"):
        GRPOModule.load_from_checkpoint(str(copied / "checkpoints" / "last.ckpt"))


def test_a_run_dir_variable_naming_a_finished_run_is_refused_by_rank_0(
        run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A new multi-process run never writes over the run the variable names (its ranks other than 0
    write into what rank 0 made; rank 0 itself needs a new folder)."""
    from tclightning.run import RUN_DIR_ENV

    copied = tmp_path / "run"
    shutil.copytree(run_dir, copied)
    before = _snapshot(copied)
    monkeypatch.setenv(RUN_DIR_ENV, str(copied))
    capsys.readouterr()
    assert main(["run", "--recipe", "tiny", *FAST, "trainer.devices=2", "trainer.strategy=pipeline", "pipeline.stages=2",
                 f"logging.root={tmp_path / 'runs'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already holds a run" in err[0], err
    assert _snapshot(copied) == before and not (tmp_path / "runs").exists()


def test_rank_0_accepts_a_named_folder_holding_only_what_its_peers_wrote_first(tmp_path: Path) -> None:
    """torchrun starts every rank at once: a peer may make the folder, its marker and this recipe
    before rank 0 looks; anything else, or another recipe, is an earlier run's."""
    from tclightning.run import RUN_MARKER, RunPlan, require_run_dir_for_rank_0

    fresh = RunPlan(tmp_path / "unused", None, None)
    named = tmp_path / "named"
    require_run_dir_for_rank_0(named, fresh, "a: 1\n")  # not there yet
    named.mkdir()
    (named / RUN_MARKER).write_text("marker\n")
    (named / "recipe.yaml").write_text("a: 1\n")
    require_run_dir_for_rank_0(named, fresh, "a: 1\n")
    with pytest.raises(TclightningError, match="already holds a run"):
        require_run_dir_for_rank_0(named, fresh, "a: 2\n")
    (named / "metrics.csv").write_text("step\n")
    with pytest.raises(TclightningError, match="already holds a run"):
        require_run_dir_for_rank_0(named, fresh, "a: 1\n")
    resumed = RunPlan(tmp_path / "other", tmp_path / "other" / "checkpoints" / "last.ckpt", 1, new_dir=False)
    (tmp_path / "other").mkdir()
    with pytest.raises(TclightningError, match="--resume continues"):
        require_run_dir_for_rank_0(named, resumed, "a: 1\n")
    require_run_dir_for_rank_0(tmp_path / "other", resumed, "a: 1\n")


@pytest.mark.parametrize("env, rank", [({}, 0), ({"LOCAL_RANK": "1"}, 1), ({"NODE_RANK": "1"}, 2),
                                       ({"NODE_RANK": "1", "LOCAL_RANK": "1"}, 3), ({"RANK": "0", "LOCAL_RANK": "1"}, 0),
                                       ({"SLURM_PROCID": "3"}, 3)],
                         ids=["user-started", "lightning-local", "lightning-node", "lightning-both", "torchrun", "slurm"])
def test_the_launch_rank_is_what_the_launcher_set(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], rank: int) -> None:
    from tclightning.recipes.loader import load_recipe, to_dataclass
    from tclightning.run import launch_rank

    for name in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "LOCAL_RANK", "NODE_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert launch_rank(to_dataclass(load_recipe("tiny", ["trainer.devices=2"]))) == rank


@pytest.mark.timeout(60)
def test_a_resume_whose_metrics_csv_is_past_its_size_bound_is_refused_unread(run_dir: Path, tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    copied = tmp_path / "run"
    shutil.copytree(run_dir, copied)
    with (copied / "metrics.csv").open("r+b") as handle:
        handle.truncate(8 * 2**30)  # sparse: 8 GiB of NULs, no disk used
    code, err = _resume(copied, capsys)
    assert code == 2 and len(err) == 1 and "more than the 1 GiB" in err[0], err


def test_load_from_checkpoint_never_lets_lightning_build_classes_a_checkpoint_names(
        run_dir: Path, tmp_path: Path) -> None:
    """Lightning's load_from_checkpoint hands an ``_instantiator`` in the hyper-parameters the
    ``class_path`` dicts it finds, importing their modules: a data-only checkpoint must not."""
    (tmp_path / "evilpkg").mkdir()
    (tmp_path / "evilpkg" / "__init__.py").write_text(f"open({str(tmp_path / 'PWNED')!r}, 'w').close()\nclass X: pass\n")

    def edit(checkpoint: dict) -> None:
        checkpoint["hyper_parameters"]["_instantiator"] = "lightning.pytorch.cli.instantiate_module"
        checkpoint["hyper_parameters"]["task"]["sources"] = [{"class_path": "evilpkg.X"}]

    copied = _crafted(run_dir, tmp_path, edit)
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(TclightningError, match="_instantiator"):
            GRPOModule.load_from_checkpoint(str(copied / "checkpoints" / "last.ckpt"))
    finally:
        sys.path.remove(str(tmp_path))
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.timeout(60)
def test_a_checkpoint_whose_shared_references_expand_without_end_is_refused(run_dir: Path, tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    def edit(checkpoint: dict) -> None:
        node: list = ["x"]
        for _ in range(60):  # 2^60 values to anything that walks it, 60 lists in the file
            node = [node, node]
        checkpoint["hyper_parameters"]["task"]["sources"] = node

    copied = _crafted(run_dir, tmp_path, edit)
    with pytest.raises(TclightningError, match="expand without end"):
        GRPOModule.load_from_checkpoint(str(copied / "checkpoints" / "last.ckpt"))
    assert main(["export", str(copied), str(tmp_path / "out")]) == 2
    code, err = _resume(copied, capsys)
    assert code == 2 and len(err) == 1 and "expand without end" in err[0], err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shape", ["holds-itself", "deep"])
def test_a_checkpoint_that_nests_without_end_is_refused_in_one_line(run_dir: Path, tmp_path: Path, shape: str,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    def edit(checkpoint: dict) -> None:
        if shape == "holds-itself":
            looped: dict = {}
            looped["again"] = looped
            checkpoint["hyper_parameters"]["model"]["extra"] = looped
        else:
            deep: list = []
            for _ in range(300):  # as deep as pickle itself writes; past the checkpoint's 64
                deep = [deep]
            checkpoint["hyper_parameters"]["task"]["sources"] = deep

    copied = _crafted(run_dir, tmp_path, edit)
    capsys.readouterr()
    assert main(["export", str(copied), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "expand without end" in err[0], err


def test_load_from_checkpoint_never_reads_a_huge_file_whole(tmp_path: Path) -> None:
    """A sparse 64 GiB file (no disk used) under a 4 GiB address-space limit: refused in one line,
    where reading it whole would fail with a MemoryError."""
    sparse = tmp_path / "sparse.ckpt"
    with sparse.open("wb") as handle:
        handle.truncate(64 * 2**30)
    code = ("import resource, sys\nresource.setrlimit(resource.RLIMIT_AS, (4 * 2**30, 4 * 2**30))\n"
            "from tclightning.errors import TclightningError\nfrom tclightning.grpo.module import GRPOModule\n"
            f"try:\n    GRPOModule.load_from_checkpoint({str(sparse)!r})\n"
            "except TclightningError as err:\n    print('refused:', err)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert done.returncode == 0 and done.stdout.startswith(f"refused: checkpoint {sparse}"), done.stderr[-2000:]


def test_a_checkpoint_whose_records_are_compressed_is_refused_before_anything_expands(
        run_dir: Path, tmp_path: Path) -> None:
    """torch.save stores its records as they are: a deflated one is a small file asking for gigabytes."""
    import zipfile

    from tclightning.callbacks.checkpointing import CheckpointRefused, load_checkpoint

    bomb = tmp_path / "bomb.ckpt"
    with zipfile.ZipFile(run_dir / "checkpoints" / "last.ckpt") as original, \
            zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as packed:
        for info in original.infolist():
            packed.writestr(info.filename, original.read(info))
    with pytest.raises(CheckpointRefused, match="is compressed, which torch.save never does"):
        load_checkpoint(bomb)
    with pytest.raises(TclightningError, match="is compressed"):
        GRPOModule.load_from_checkpoint(str(bomb))


@pytest.mark.timeout(60)  # each runs for hours or allocates a terabyte once torch.load calls what it asks
@pytest.mark.parametrize("bomb", sorted(PICKLE_BOMBS))
def test_a_pickle_calling_allowed_globals_with_hostile_arguments_is_refused_before_it_runs(
        tmp_path: Path, bomb: str) -> None:
    """``weights_only`` allows ``set``, ``bytearray``, ``_codecs.encode`` and (for the RNG state)
    numpy arrays, each with any arguments, and hashes any dict key: the pickle is read first."""
    from tclightning.callbacks.checkpointing import CheckpointRefused, load_checkpoint

    path = with_pickle(tmp_path / "bomb.ckpt", bomb)
    with pytest.raises(CheckpointRefused, match="refused: it"):
        load_checkpoint(path)
    with pytest.raises(CheckpointRefused, match="refused: it"), path.open("rb") as handle:
        load_checkpoint(handle)


@pytest.mark.timeout(60)  # torch.load would hash a tuple 2^60 times
@pytest.mark.parametrize("name", ["same-name", "other-case", "beside-it"])
def test_a_pickle_torch_may_read_in_place_of_the_one_checked_is_checked_too(run_dir: Path, tmp_path: Path,
                                                                             name: str) -> None:
    """torch finds ``archive/data.pkl`` ignoring case and takes the first of two equal names; Python's
    zip reader the last, by exact name: a bomb placed first, or as ``DATA.PKL`` beside a genuine
    pickle renamed, passed the check and ran."""
    import warnings

    from tclightning.callbacks.checkpointing import CheckpointRefused, load_checkpoint

    doubled = tmp_path / "doubled.ckpt"
    with_pickle(tmp_path / "bomb.pt", "dict-key-of-shared-tuples")
    with zipfile.ZipFile(tmp_path / "bomb.pt") as bomb, zipfile.ZipFile(run_dir / "checkpoints" / "last.ckpt") as real, \
            zipfile.ZipFile(doubled, "w", zipfile.ZIP_STORED) as archive, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile's "Duplicate name" is the point
        pickled = next(info for info in bomb.infolist() if info.filename.endswith("data.pkl"))
        for info in real.infolist():
            if info.filename.endswith("data.pkl"):
                planted = {"same-name": info.filename, "other-case": info.filename.upper()}.get(name)
                archive.writestr(planted or info.filename.replace("data.pkl", "DATA.PKL"), bomb.read(pickled))
                archive.writestr(info.filename.replace("data.pkl", "real.pkl") if name == "beside-it" else info.filename,
                                 real.read(info))
            else:
                archive.writestr(info.filename, real.read(info))
    with pytest.raises(CheckpointRefused, match="refused: it"):
        load_checkpoint(doubled)


def test_a_dict_of_more_int_keys_than_any_state_holds_is_refused(tmp_path: Path) -> None:
    """Ints hash to themselves: a pickle can choose thousands whose slots probe into each other."""
    from tclightning.tensor_files import MAX_INT_KEYS, RefusedTensorFile, check_torch_file

    torch.save({"held": dict.fromkeys(range(MAX_INT_KEYS), 0)}, tmp_path / "most.pt")
    check_torch_file(tmp_path / "most.pt")
    torch.save({"held": dict.fromkeys(range(MAX_INT_KEYS + 1), 0)}, tmp_path / "more.pt")
    with pytest.raises(RefusedTensorFile, match=f"more than {MAX_INT_KEYS} int keys"):
        check_torch_file(tmp_path / "more.pt")


@pytest.mark.timeout(120)
def test_a_resume_from_a_pickle_bomb_is_one_line_and_changes_nothing(run_dir: Path, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    copied = tmp_path / "run"
    shutil.copytree(run_dir, copied)
    with_pickle(copied / "checkpoints" / "last.ckpt", "set-over-a-stride-0-array")
    before = _snapshot(copied)
    code, err = _resume(copied, capsys)
    assert code == 2 and len(err) == 1 and "asks to load builtins.set" in err[0], err
    assert _snapshot(copied) == before


def test_load_from_checkpoint_refuses_a_pipe_at_once(run_dir: Path) -> None:
    read_end, write_end = os.pipe()
    with os.fdopen(read_end, "rb") as pipe:
        try:
            with pytest.raises(TclightningError, match="not seekable"):
                GRPOModule.load_from_checkpoint(pipe)  # its writer never closes it: reading it would wait
        finally:
            os.close(write_end)


@pytest.mark.parametrize("legacy", ["hparams", "module_arguments", "hparams_name"])
def test_load_from_checkpoint_refuses_the_legacy_keys_lightning_also_reads_arguments_from(
        run_dir: Path, tmp_path: Path, legacy: str) -> None:
    def edit(checkpoint: dict) -> None:
        model = {"source": "hf", "name": str(tmp_path), "trust_remote_code": True}
        checkpoint[legacy] = "model" if legacy == "hparams_name" else {"model": model}

    copied = _crafted(run_dir, tmp_path, edit)
    with pytest.raises(TclightningError, match=f"holds '{legacy}', where Lightning also reads"):
        GRPOModule.load_from_checkpoint(str(copied / "checkpoints" / "last.ckpt"))


def _with_metadata(checkpoint: dict, metadata: object) -> None:
    checkpoint["state_dict"]._metadata = metadata


@pytest.mark.parametrize("edit, said", [
    (lambda c: _with_metadata(c, {"": 5}), "_metadata is not each module's version by name"),
    (lambda c: _with_metadata(c, [1]), "its pickle sets the state of a dict in a form torch.save never writes"),
    (lambda c: c.__setitem__("state_dict", {i: t for i, t in enumerate(c["state_dict"].values())}),
     "keyed by int 0, not by name"),
    (lambda c: c["state_dict"].__setitem__(None, torch.zeros(1)), "keyed by NoneType None, not by name"),
], ids=["metadata-of-ints", "metadata-a-list", "int-keys", "a-none-key"])
def test_a_state_dict_of_another_form_is_one_line_everywhere(run_dir: Path, tmp_path: Path, edit, said: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """torch's load_state_dict reads a state dict's ``_metadata`` and keys as torch.save writes
    them: other values were an AttributeError traceback (load_from_checkpoint, probe coherence
    --checkpoint, lightning fit --ckpt_path), an int key a TypeError one."""
    copied = _crafted(run_dir, tmp_path, edit)
    ckpt = copied / "checkpoints" / "last.ckpt"
    with pytest.raises(TclightningError, match=said):
        GRPOModule.load_from_checkpoint(str(ckpt))
    for command in (["export", str(copied), str(tmp_path / "out")],
                    ["probe", "coherence", "--recipe", "tiny", *FAST, "--checkpoint", str(ckpt), "--out",
                     str(tmp_path / "probe")]):
        capsys.readouterr()
        assert main(command) == 2, command
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and str(ckpt) in err[0], (command, err)
    code, err = _resume(copied, capsys)
    assert code == 2 and len(err) == 1 and said in err[0], err


def _expanded(value: torch.Tensor) -> torch.Tensor:
    """``value``'s shape over one stored number (stride 0): a few bytes in the file, all of it once copied."""
    return value.new_zeros(1).expand(value.shape)


@pytest.mark.parametrize("edit", [
    lambda c: c["state_dict"].__setitem__(_first_float_weight(c), _expanded(c["state_dict"][_first_float_weight(c)])),
    lambda c: c["optimizer_states"][0]["state"][0].__setitem__(
        "exp_avg", _expanded(c["optimizer_states"][0]["state"][0]["exp_avg"])),
], ids=["weight", "adam-moment"])
def test_a_tensor_over_fewer_stored_bytes_than_its_shape_is_refused_everywhere(
        run_dir: Path, tmp_path: Path, edit, capsys: pytest.CaptureFixture[str]) -> None:
    """A weight or a moment of stride 0 is how a checkpoint of kilobytes asks for a model of gigabytes
    whose shapes all match its hyper-parameters: refused before anything is built or copied."""
    copied = _crafted(run_dir, tmp_path, edit)
    with pytest.raises(TclightningError, match="stored bytes"):
        GRPOModule.load_from_checkpoint(str(copied / "checkpoints" / "last.ckpt"))
    capsys.readouterr()
    assert main(["export", str(copied), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "stored bytes" in err[0], err
    assert not (tmp_path / "out").exists()
    code, err = _resume(copied, capsys)
    assert code == 2 and len(err) == 1 and "stored bytes" in err[0], err


@pytest.mark.parametrize("nested", ["stride-0", "too-many-values", "stride-0-in-a-set"])
def test_a_rollouts_object_in_a_checkpoint_is_walked_like_any_container(tmp_path: Path, nested: str) -> None:
    """The anchor circuit's replay ``Rollouts`` (an allow-listed dataclass) was a leaf to both
    walks: a 1 MB checkpoint whose replay held 200000 x 200000 stride-0 tensors resumed and trained
    on them without end."""
    from tclightning.callbacks.checkpointing import MAX_CHECKPOINT_VALUES, CheckpointRefused, load_checkpoint
    from tclightning.sampling.base import Rollouts

    ids = torch.zeros(2, 3, dtype=torch.long)
    rollouts = Rollouts(prompt_ids=ids, prompt_mask=ids, completion_ids=ids, completion_mask=ids.float(),
                        logp_sampler=ids.float(), texts=["a", "b"], truncated=torch.zeros(2, dtype=torch.bool),
                        group_size=2)
    if nested == "stride-0":
        rollouts.completion_ids = torch.zeros(1, dtype=torch.long).expand(200_000, 200_000)
    elif nested == "stride-0-in-a-set":
        rollouts.texts = {torch.zeros(1).expand(200_000, 200_000)}  # type: ignore[assignment]
    else:
        rollouts.texts = [""] * MAX_CHECKPOINT_VALUES
    torch.save({"tclightning": {"anchor": {"pending": [{"rollouts": rollouts}]}}}, tmp_path / "x.ckpt")
    said = {"too-many-values": "more than", "stride-0-in-a-set": "asks to load builtins.set"}.get(nested, "stored bytes")
    with pytest.raises(CheckpointRefused, match=said):  # a set is refused before anything in it is built
        load_checkpoint(tmp_path / "x.ckpt")


@pytest.mark.parametrize("state", ["an-attribute-more", "a-field-missing", "a-field-twice", "no-fields-at-all"])
def test_a_rollouts_object_in_a_checkpoint_holds_its_fields_and_nothing_else(tmp_path: Path, state: str) -> None:
    """A ``Rollouts`` pickled with an attribute more (``select`` set to an OrderedDict, hiding its
    method) passed the scan, and a resume failed on it with a TypeError traceback."""
    from collections import OrderedDict

    from tclightning.callbacks.checkpointing import CheckpointRefused, load_checkpoint
    from tclightning.sampling.base import Rollouts

    ids = torch.zeros(2, 3, dtype=torch.long)
    rollouts = Rollouts(prompt_ids=ids, prompt_mask=ids, completion_ids=ids, completion_mask=ids.float(),
                        logp_sampler=ids.float(), texts=["a", "b"], truncated=torch.zeros(2, dtype=torch.bool),
                        group_size=2)
    torch.save({"tclightning": {"anchor": {"pending": [{"rollouts": rollouts}]}}}, tmp_path / "plain.ckpt")
    assert isinstance(load_checkpoint(tmp_path / "plain.ckpt")["tclightning"]["anchor"]["pending"][0]["rollouts"],
                      Rollouts)
    if state == "an-attribute-more":
        rollouts.select = OrderedDict()  # type: ignore[method-assign]
    elif state == "a-field-missing":
        del rollouts.texts
    elif state == "no-fields-at-all":  # torch.save writes no BUILD for an empty __dict__
        rollouts = object.__new__(Rollouts)
    torch.save({"tclightning": {"anchor": {"pending": [{"rollouts": rollouts}]}}}, tmp_path / "x.ckpt")
    if state == "a-field-twice":  # the same key set twice in the fields' dict (torch.save never repeats one)
        _repeat_a_field(tmp_path / "plain.ckpt", tmp_path / "x.ckpt")
    said = ("builds a tclightning.sampling.base.Rollouts without setting its fields" if state == "no-fields-at-all"
            else "sets the state of a object in a form torch.save never writes")
    with pytest.raises(CheckpointRefused, match=said):
        load_checkpoint(tmp_path / "x.ckpt")


def _repeat_a_field(source: Path, target: Path) -> None:
    """``source`` with its pickle's ``'group_size'`` key and value set once more in the same SETITEMS."""
    with zipfile.ZipFile(source) as archive, zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as out:
        for info in archive.infolist():
            data = archive.read(info)
            if info.filename.endswith("data.pkl"):
                # BINUNICODE 'group_size', BINPUT n, BININT1 2
                data, found = re.subn(rb"X\x0a\x00\x00\x00group_sizeq.K\x02", lambda m: m.group(0) * 2, data)
                assert found == 1
            out.writestr(info, data)


@pytest.mark.parametrize("overwrite", [False, True], ids=["new", "overwrite"])
def test_a_folder_renamed_to_an_export_s_staging_name_as_it_moves_into_place_is_put_back(
        run_dir: Path, tmp_path: Path, overwrite: bool, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The staging folder was moved into place by its name after a look at it: a folder of yours
    renamed to that name in between became the export (and the next --overwrite replaced it)."""
    import tclightning.export as export_module

    out = tmp_path / "out"
    if overwrite:
        assert main(["export", str(run_dir), str(out)]) == 0
    before = _snapshot(out) if overwrite else {}
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.md").write_text("mine")
    moved: list[Path] = []

    def renamed_in_first(staging: Path) -> None:
        if not moved:
            Path(staging).rename(tmp_path / "moved-away")
            mine.rename(staging)
            moved.append(Path(staging))

    real_rename, real_exchange = export_module.os.rename, export_module.exchange

    def rename(src: Any, dst: Any) -> None:
        if Path(dst) == out:
            renamed_in_first(src)
        real_rename(src, dst)

    def exchange(a: Path, b: Path) -> None:
        renamed_in_first(a)
        real_exchange(a, b)

    monkeypatch.setattr(export_module.os, "rename", rename)
    monkeypatch.setattr(export_module, "exchange", exchange)
    capsys.readouterr()
    assert main(["export", str(run_dir), str(out), *(["--overwrite"] if overwrite else [])]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "Writing model shards" not in line]
    assert len(err) == 1 and "another folder was renamed to its folder's name" in err[0], err
    assert (moved[0] / "notes.md").read_text() == "mine" and sorted(p.name for p in moved[0].iterdir()) == ["notes.md"]
    assert _snapshot(out) == before if overwrite else not out.exists()


def test_an_export_through_a_folder_yet_to_be_made_is_checked_where_it_lands(
        run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``mine/new/..`` is ``mine``: refused as ``mine`` is (not empty, not an export), and no
    ``mine/new`` is left behind."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.md").write_text("mine\n")
    for overwrite in ([], ["--overwrite"]):
        capsys.readouterr()
        assert main(["export", str(run_dir), str(mine / "new" / ".."), *overwrite]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{mine} is not" in err[0], err
    assert sorted(p.name for p in mine.iterdir()) == ["notes.md"]


def test_a_probe_never_writes_over_files_in_a_folder_you_named(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    from tclightning.cli.options import output_folder

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "cuts.md").write_text("my notes\n")
    for named in (mine, mine / "new" / ".."):
        with pytest.raises(TclightningError, match=r"already holds cuts\.md.*--overwrite replaces"):
            output_folder("probe cuts", named, ("cuts.csv", "cuts.md"), named=True)
    assert output_folder("probe cuts", mine, ("cuts.md",), named=True, overwrite=True) == mine
    assert output_folder("probe cuts", mine, ("cuts.md",)) == mine  # the probe's own default folder: a rerun
    (tmp_path / "default").symlink_to(mine)  # a default folder that is a link (a cloned repository's) is not followed
    with pytest.raises(TclightningError, match="is a symbolic link; name the folder"):
        output_folder("probe cuts", tmp_path / "default", ("cuts.md",))
    capsys.readouterr()
    assert main(["probe", "cuts", "--recipe", "tiny", "--out", str(mine)]) == 2  # before anything is measured
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already holds cuts.md" in err[0], err
    assert sorted(p.name for p in mine.iterdir()) == ["cuts.md"] and (mine / "cuts.md").read_text() == "my notes\n"


def test_two_commands_given_one_out_folder_together_never_both_write_it(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Two ``analyze trajectory --out OUT`` (or ``probe cuts``) started together both found OUT empty
    and both wrote it, one report silently replacing the other: the folder is held while written,
    and checked again then."""
    from tclightning.cli.options import output_claimed, output_folder

    out = tmp_path / "out"
    writes = ("trajectory.json", "trajectory.md")
    assert output_folder("analyze trajectory", out, writes, named=True) == out  # both looked: empty
    with output_claimed("analyze trajectory", out, writes, named=True):  # the first writes
        (out / "trajectory.json").write_text("the first's")
        with pytest.raises(TclightningError, match="another command is writing into it now; nothing was written"):
            with output_claimed("analyze trajectory", out, writes, named=True):
                pytest.fail("the second wrote too")
    with pytest.raises(TclightningError, match="already holds trajectory.json"):  # the second, once it is done
        with output_claimed("analyze trajectory", out, writes, named=True):
            pytest.fail("the second wrote over the first's report")
    assert (out / "trajectory.json").read_text() == "the first's"
    new = tmp_path / "a" / "b"
    with pytest.raises(RuntimeError), output_claimed("analyze trajectory", new, writes, named=True):
        raise RuntimeError("the analysis failed")
    assert not (tmp_path / "a").exists()  # the folders it made go with a failure


def test_analyze_health_refuses_more_tensorboard_events_than_it_reads(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A million scalars in an event file took TensorBoard's reader minutes: refused by size, unread."""
    from tclightning.health.io import EVENTS_MAX_BYTES

    events = tmp_path / "events.out.tfevents.1.host"
    with events.open("wb") as handle:
        handle.truncate(EVENTS_MAX_BYTES + 1)  # sparse: no disk used
    capsys.readouterr()
    assert main(["analyze", "health", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "MiB of TensorBoard events" in err[0] and "metrics.csv" in err[0], err


@pytest.mark.timeout(600)  # two processes that train: minutes on a loaded 2-core machine
def test_a_rank_other_than_0_writes_nothing_into_the_run_dir_it_is_named(run_dir: Path, tmp_path: Path) -> None:
    """A second node's rank (NODE_RANK=1) named into an earlier run rewrote its recipe.yaml, and one
    named into a new folder left it behind (marker and recipe) when its rank 0 never came."""
    from tclightning.run import RUN_DIR_ENV
    from tests.test_interrupts import _free_port

    earlier = tmp_path / "earlier"
    shutil.copytree(run_dir, earlier)
    before = _snapshot(earlier)
    repo = Path(__file__).resolve().parents[1]
    for named in (earlier, tmp_path / "new"):
        env = {**os.environ, "PYTHONPATH": str(repo), "NODE_RANK": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(_free_port()), RUN_DIR_ENV: str(named)}
        done = subprocess.run([sys.executable, "-m", "tclightning", "run", "--recipe", "tiny", *FAST, "trainer.steps=2",
                               "trainer.seed=9", "trainer.num_nodes=2", "trainer.strategy=pipeline", "pipeline.stages=2",
                               "pipeline.timeout_s=3"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 2 and "did not all meet" in done.stderr, done.stderr[-3000:]
    assert _snapshot(earlier) == before and not (tmp_path / "new").exists()


def _restored_job(edit) -> tuple:
    """An anchor whose pending job came back from a checkpoint and was edited by ``edit``."""
    from tclightning.anchor import Anchor, AnchorCircuit, AnchorSchedule
    from tclightning.anchor.mergers import make_merger
    from tclightning.sampling.base import Rollouts

    params = [torch.nn.Parameter(torch.ones(3, 2)), torch.nn.Parameter(torch.ones(2))]
    ids = torch.zeros(2, 3, dtype=torch.long)
    rollouts = Rollouts(prompt_ids=ids, prompt_mask=ids, completion_ids=ids, completion_mask=ids.float(),
                        logp_sampler=ids.float(), texts=["a", "b"], truncated=torch.zeros(2, dtype=torch.bool),
                        group_size=2)
    replay = {"rollouts": rollouts, "advantages": torch.zeros(2), "rows": torch.tensor([0, 1])}
    saved = Anchor(make_merger("signed_ema"), AnchorCircuit(AnchorSchedule(latency=1, cadence=1)))
    saved.tick(0, first=True, parameters=lambda: params, payload=lambda: replay, gradient=lambda job: ([], 0.0))
    state = copy.deepcopy(saved.state_dict())
    edit(state["circuit"]["pending"][0])
    restored = Anchor(make_merger("signed_ema"), AnchorCircuit(AnchorSchedule(latency=1, cadence=1)))
    restored.vocab_size = 10  # token ids 0..9
    restored.load_state_dict(state)
    computed: list = []
    return restored, params, computed


@pytest.mark.parametrize("edit, said", [
    (lambda job: job.update(snapshot=[torch.zeros(3) for _ in job["snapshot"]]), "snapshot is not shaped"),
    (lambda job: job.update(snapshot=job["snapshot"][:1]), "snapshot is not shaped"),
    (lambda job: job["payload"]["rollouts"].__setattr__("texts", 12345), "replay is not"),
    (lambda job: job["payload"]["rollouts"].__setattr__("group_size", "x"), "replay is not"),
    (lambda job: job["payload"].update(rows=torch.tensor([0, 7])), "replay is not"),
    (lambda job: job["payload"].update(rollouts=[1, 2]), "replay is not"),
    (lambda job: job["payload"]["rollouts"].completion_ids.fill_(-5), "replay is not"),  # an IndexError traceback
    (lambda job: job["payload"]["rollouts"].prompt_ids.fill_(10), "replay is not"),  # past the vocabulary: the same
    (lambda job: job["payload"]["rollouts"].completion_mask.fill_(1e30), "replay is not"),  # anchor/bytes of 1e34
    (lambda job: job["payload"]["rollouts"].logp_sampler.fill_(float("nan")), "replay is not"),
], ids=["snapshot-shapes", "snapshot-count", "texts-an-int", "group-size-a-word", "rows-out-of-range", "no-rollouts",
        "negative-token-ids", "token-ids-past-the-vocabulary", "mask-not-0-or-1", "logp-nan"])
def test_an_anchor_job_restored_from_a_checkpoint_that_does_not_fit_is_one_line(edit, said: str) -> None:
    """A checkpoint's pending anchor job (snapshot, replay) was computed as restored: a RuntimeError
    or TypeError traceback at its delivery. Refused before anything of it is computed."""
    anchor, params, computed = _restored_job(edit)
    with pytest.raises(TclightningError, match=f"anchor job of tick 0: its {said}"):
        anchor.tick(1, first=False, parameters=lambda: params, payload=lambda: None,
                    gradient=lambda job: computed.append(job) or ([torch.zeros_like(p) for p in params], 0.0))
    assert not computed


def test_a_module_s_anchor_bounds_replayed_token_ids_by_its_model_s_vocabulary() -> None:
    """Token ids past the vocabulary in a checkpoint's replay were an IndexError traceback in the embedding."""
    module = GRPOModule(model={"tiny": {"hidden_size": 32, "num_layers": 1, "intermediate_size": 64}},
                        anchor={"merger": "signed_ema"})
    assert module.anchor is not None
    assert module.anchor.vocab_size == module.policy.get_input_embeddings().num_embeddings > 0


@pytest.mark.parametrize("edit", [
    lambda job: job.update(snapshot=7), lambda job: job.update(tick="soon"), lambda job: job.pop("due_tick"),
], ids=["snapshot-a-number", "tick-a-word", "no-due-tick"])
def test_an_anchor_circuit_state_tclightning_never_writes_is_one_line(edit) -> None:
    with pytest.raises(TclightningError, match="anchor circuit state is not one tclightning writes"):
        _restored_job(edit)


def test_an_anchor_job_restored_whole_is_delivered() -> None:
    anchor, params, computed = _restored_job(lambda job: None)
    anchor.tick(1, first=False, parameters=lambda: params, payload=lambda: None,
                gradient=lambda job: computed.append(job) or ([torch.zeros_like(p) for p in params], 0.0))
    assert len(computed) == 1 and anchor.pop_delivery() is not None


@pytest.mark.parametrize("flags", [0, 1, 5])
def test_a_numpy_dtype_whose_state_claims_objects_is_refused(tmp_path: Path, flags: int) -> None:
    """Any flat tuple passed as a dtype's state: flags of an object dtype on a uint32 array's dtype
    (an RNG key) made numpy read its numbers as object pointers. Only a plain dtype's state passes."""
    import io
    import pickletools

    import numpy as np

    from tclightning.tensor_files import RefusedTensorFile, check_torch_file

    path = tmp_path / "rng.ckpt"
    torch.save({"key": np.arange(4, dtype=np.uint32)}, path)
    with zipfile.ZipFile(path) as archive:
        records = [(info.filename, bytearray(archive.read(info))) for info in archive.infolist()]
    pickled = next(data for name, data in records if name.endswith("data.pkl"))
    ops = list(pickletools.genops(io.BytesIO(bytes(pickled))))
    start = next(i for i, (op, arg, _) in enumerate(ops) if op.name == "BININT1" and arg == 3)  # the state's version
    last = next(i for i in range(start, len(ops)) if ops[i][0].name == "TUPLE") - 1  # its flags: a BININT1 0
    assert ops[last][0].name == "BININT1" and ops[last][1] == 0
    pickled[ops[last][2] + 1] = flags
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for name, data in records:
            archive.writestr(name, bytes(data))
    if flags == 0:
        check_torch_file(path, numpy_arrays=True)
        return
    with pytest.raises(RefusedTensorFile, match="sets the state of a dtype"):
        check_torch_file(path, numpy_arrays=True)


def test_a_dict_whose_attributes_would_hide_its_items_is_refused(run_dir: Path, tmp_path: Path) -> None:
    """An ``OrderedDict`` pickled with instance attributes (``BUILD``): ``values`` or ``items`` set to
    ``collections.OrderedDict`` made ``d.values()`` empty, so every bound that walked a dict through
    its own methods (the values count, thin tensors, class keys) skipped what lay below it: a list
    holding itself twice per level there then kept an export walking for days. A state dict's
    ``_metadata`` (what torch.save writes) still loads."""
    import collections

    from tclightning.callbacks.checkpointing import load_checkpoint
    from tclightning.export import export_policy

    ckpt = load_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    assert isinstance(ckpt["state_dict"], collections.OrderedDict) and hasattr(ckpt["state_dict"], "_metadata")
    bomb: list = []
    for _ in range(40):
        bomb = [bomb, bomb]
    hidden = collections.OrderedDict(ckpt["hyper_parameters"])
    hidden["model"] = {**hidden["model"], "bomb": bomb}
    hidden.values = hidden.items = collections.OrderedDict  # type: ignore[method-assign]
    ckpt["hyper_parameters"] = hidden
    torch.save(ckpt, tmp_path / "hidden.ckpt")
    for load in (load_checkpoint, GRPOModule.load_from_checkpoint, lambda p: export_policy(p, tmp_path / "out")):
        with pytest.raises(TclightningError, match="sets the state of a dict in a form torch.save never writes"):
            load(tmp_path / "hidden.ckpt")
    assert not (tmp_path / "out").exists()
    ckpt = load_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    ckpt["state_dict"]._metadata = 5  # not the dict torch.save writes: load_state_dict's AttributeError
    torch.save(ckpt, tmp_path / "metadata.ckpt")
    with pytest.raises(TclightningError, match="sets the state of a dict in a form torch.save never writes"):
        load_checkpoint(tmp_path / "metadata.ckpt")


def test_a_pickle_of_nothing_but_marks_is_refused_at_once(tmp_path: Path) -> None:
    """Each open mark holds a list: 20 MB of them took minutes and 1.7 GB to read through."""
    from tclightning.tensor_files import MAX_OPEN_MARKS, RefusedTensorFile, check_torch_file

    torch.save({"step": 0}, tmp_path / "marks.pt")
    with zipfile.ZipFile(tmp_path / "marks.pt") as archive:
        records = [(info.filename, archive.read(info)) for info in archive.infolist()]
    with zipfile.ZipFile(tmp_path / "marks.pt", "w", zipfile.ZIP_STORED) as archive:
        for name, data in records:
            archive.writestr(name, b"\x80\x02" + b"(" * (MAX_OPEN_MARKS + 1) + b"." if name.endswith("data.pkl") else data)
    with pytest.raises(RefusedTensorFile, match=f"more than {MAX_OPEN_MARKS} marks"):
        check_torch_file(tmp_path / "marks.pt")


def _records_sharing_one_block(path: Path, copies: int) -> Path:
    """A torch file whose central directory lists ``copies`` more records (``data/1``...) all
    pointing at the bytes of ``data/0``: a small file torch would read as ``copies`` storages."""
    import struct

    torch.save({"t": torch.zeros(1 << 16, dtype=torch.uint8)}, path)
    data = path.read_bytes()
    end = data.rindex(b"PK\x05\x06")
    entries, size, offset = struct.unpack("<HII", data[end + 10:end + 20])
    directory, at, shared = data[offset:offset + size], 0, b""
    while at < len(directory):
        name_length, extra_length, comment_length = struct.unpack("<HHH", directory[at + 28:at + 34])
        length = 46 + name_length + extra_length + comment_length
        if directory[at + 46:at + 46 + name_length].endswith(b"/data/0"):
            shared = directory[at:at + length]
        at += length
    added = b"".join(shared.replace(b"/data/0", f"/data/{i}".encode(), 1) for i in range(1, copies + 1))
    directory += added
    tail = data[end:end + 10] + struct.pack("<HII", entries + copies, len(directory), offset) + data[end + 20:]
    path.write_bytes(data[:offset] + directory + tail)
    return path


def test_a_torch_file_whose_records_share_their_bytes_is_refused(tmp_path: Path) -> None:
    """Each of 512 records listed over one 16 MB block was read whole: gigabytes from 17 MB."""
    from tclightning.tensor_files import RefusedTensorFile, check_torch_file

    path = _records_sharing_one_block(tmp_path / "shared.pt", 9)
    with zipfile.ZipFile(path) as archive:
        assert sum(info.compress_size for info in archive.infolist()) > path.stat().st_size  # crafted as meant
    with pytest.raises(RefusedTensorFile, match="records that overlap"):
        check_torch_file(path)
    with pytest.raises(RefusedTensorFile, match="records that overlap"), path.open("rb") as handle:
        check_torch_file(handle)


def test_a_torch_file_of_another_byte_order_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch swaps the bytes of every tensor of a file whose byteorder record is not this machine's,
    and on the meta device (a resume's and an export's first look at a checkpoint) it crashed the
    process doing so: a segmentation fault, no line."""
    from tclightning.tensor_files import RefusedTensorFile, check_torch_file

    torch.save({"w": torch.zeros(4)}, tmp_path / "little.pt")
    check_torch_file(tmp_path / "little.pt")
    monkeypatch.setattr(sys, "byteorder", "big")  # as torch.save writes it on a big-endian machine
    torch.save({"w": torch.zeros(4)}, tmp_path / "big.pt")
    monkeypatch.undo()
    with pytest.raises(RefusedTensorFile, match="its byteorder record says b'big'"):
        check_torch_file(tmp_path / "big.pt")


@pytest.mark.parametrize("layout", ["data-before-the-archive", "a-pickle-before-the-archive", "zip64-locator-elsewhere",
                                    "directory-elsewhere",
                                    "a-comment", "end-record-signature-in-a-field", "records-by-another-name",
                                    "two-pickles"])
def test_a_torch_file_laid_out_as_torch_save_never_does_is_refused(tmp_path: Path, layout: str) -> None:
    """torch's reader (miniz) and Python's zipfile find the end record, the zip64 end record and the
    directory in different ways: data before the archive, a zip64 locator naming another end
    record, a directory offset pointing past the one zipfile reads (into a comment holding another),
    an end-record signature inside the end record's own fields each let torch unpickle another
    archive than the one checked; each of 40,000 pickles made the check walk every record again."""
    import struct

    from tclightning.tensor_files import RefusedTensorFile, check_torch_file

    path = tmp_path / "odd.pt"
    torch.save({"step": 1}, path)
    check_torch_file(path)
    data = path.read_bytes()
    end, locator, zip64_end = len(data) - 22, len(data) - 42, len(data) - 98
    assert data[end:end + 4] == b"PK\x05\x06" and data[locator:locator + 4] == b"PK\x06\x07"  # as torch.save writes
    if layout == "data-before-the-archive":
        path.write_bytes(b"\0" * 64 + data)
    elif layout == "a-pickle-before-the-archive":  # every offset past it: torch reads the file as a pre-1.6
        path.write_bytes(b"\x80\x02}q\x00.")  # pickle from byte 0, never as the archive checked
        with zipfile.ZipFile(path, "a", zipfile.ZIP_STORED) as archive, zipfile.ZipFile(io.BytesIO(data)) as saved:
            for info in saved.infolist():
                archive.writestr(info.filename, saved.read(info))
    elif layout == "zip64-locator-elsewhere":
        path.write_bytes(data[:locator + 8] + struct.pack("<Q", 0) + data[locator + 16:])
    elif layout == "directory-elsewhere":  # both the zip64 and the plain end record say 22 bytes further
        (size, at), (size32, at32) = struct.unpack("<QQ", data[zip64_end + 40:zip64_end + 56]), \
            struct.unpack("<II", data[end + 12:end + 20])
        data = data[:zip64_end + 48] + struct.pack("<Q", at + 22) + data[zip64_end + 56:]
        path.write_bytes(data[:end + 16] + struct.pack("<I", at32 + 22) + data[end + 20:])
    elif layout == "a-comment":
        path.write_bytes(data[:-2] + struct.pack("<H", 4) + b"note")
    elif layout == "end-record-signature-in-a-field":  # a search for the last signature lands inside the record,
        # where no locator is found 20 bytes before it: the locator naming another end record went unseen
        data = data[:locator + 8] + struct.pack("<Q", 0) + data[locator + 16:]
        path.write_bytes(data[:end + 12] + b"PK\x05\x06" + data[end + 16:])
    elif layout == "records-by-another-name":  # a name zipfile reads as cp437 and torch as UTF-8
        with zipfile.ZipFile(path, "a", zipfile.ZIP_STORED) as archive:
            archive.writestr(f"{archive.namelist()[0].partition('/')[0]}/\u00e9", b"")
        data = path.read_bytes()
        for header in (b"PK\x03\x04", b"PK\x01\x02"):  # the record's UTF-8 flag taken off
            at = data.rindex(header)
            flags = 8 if header == b"PK\x01\x02" else 6
            data = data[:at + flags] + b"\0\0" + data[at + flags + 2:]
        path.write_bytes(data)
    else:
        with zipfile.ZipFile(path, "a", zipfile.ZIP_STORED) as archive:
            archive.writestr("other/data.pkl", b"\x80\x02}.")
    said = "2 pickles" if layout == "two-pickles" else "another archive than the one checked"
    with pytest.raises(RefusedTensorFile, match=said):
        check_torch_file(path)


def test_an_open_checkpoint_not_at_its_start_is_refused(run_dir: Path) -> None:
    """torch.load reads an open file from where it is, the check from its start: a file moved past
    its start had torch unpickle bytes the check never read."""
    from tclightning.callbacks.checkpointing import load_checkpoint

    with (run_dir / "checkpoints" / "last.ckpt").open("rb") as handle:
        handle.seek(1)
        with pytest.raises(TclightningError, match="not at its start"):
            load_checkpoint(handle)
        handle.seek(0)
        assert load_checkpoint(handle)["tclightning"]["rl_step"] == 2
    read_end, write_end = os.pipe()  # read once only: the check and torch.load each need its start
    os.write(write_end, (run_dir / "checkpoints" / "last.ckpt").read_bytes()[:4096])
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe, pytest.raises(TclightningError, match="cannot be read twice"):
        load_checkpoint(pipe)


def test_a_checkpoint_rewritten_in_place_after_its_check_is_never_what_is_loaded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check read the open file, then torch.load read it again: bytes written into the same file
    in between (a refused pickle) were unpickled. The pickle checked is the pickle loaded."""
    import tclightning.callbacks.checkpointing as checkpointing
    import tclightning.tensor_files as tensor_files

    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "tclightning": {"rl_step": 1}}, path)
    rewritten = tmp_path / "other.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(2)}, "tclightning": {"rl_step": 666}}, rewritten)
    check = tensor_files.check_torch_file

    def then_rewritten(source, **kwargs):
        check(source, **kwargs)
        with path.open("r+b") as same_file:  # the same file, not a rename: an open handle sees it
            same_file.write(rewritten.read_bytes())
            same_file.truncate()

    monkeypatch.setattr(tensor_files, "check_torch_file", then_rewritten)
    for map_location in ("cpu", "meta"):
        torch.save({"state_dict": {"w": torch.ones(2)}, "tclightning": {"rl_step": 1}}, path)
        assert checkpointing.load_checkpoint(path, map_location)["tclightning"]["rl_step"] == 1


def test_a_first_reads_view_gives_each_byte_as_first_read_while_recording(tmp_path: Path) -> None:
    """What the view read while recording it gives again, whatever the file holds since; the rest
    (and everything read once recording stopped) comes from the file as it is."""
    from tclightning.tensor_files import FirstReads

    path = tmp_path / "file"
    path.write_bytes(bytes(range(100)))
    with path.open("rb") as handle:
        view = FirstReads(handle)
        view.seek(10)
        assert view.read(5) == bytes(range(10, 15))
        view.seek(20)
        assert view.read(5) == bytes(range(20, 25))
        path.write_bytes(b"\xff" * 100)  # written over, in the same file
        view.seek(12)
        assert view.read(10) == bytes([12, 13, 14, *[255] * 5, 20, 21])  # kept, then read (and kept), then kept
        view.recording = False
        view.seek(15)
        assert view.read(3) == b"\xff" * 3  # kept while recording: the file's bytes then
        path.write_bytes(bytes(100))
        assert view.seek(0, os.SEEK_END) == 100
        view.seek(8)
        assert view.read(20) == bytes(2) + bytes([10, 11, 12, 13, 14]) + b"\xff" * 5 + bytes([20, 21, 22, 23, 24]) + bytes(3)
        path.write_bytes(bytes(50))  # cut short: it ends there
        view.seek(45)
        assert view.read(20) == bytes(5)


def _rewritten_after_its_check(monkeypatch: pytest.MonkeyPatch, path: Path, other: Path) -> None:
    """Right before torch.load reads ``path`` (every check done), its owner writes ``other``'s
    bytes into it in place (``other``: the same layout, another pickle)."""
    load = torch.load

    def rewritten_then_loaded(source, *args, **kwargs):
        with path.open("r+b") as same_file:
            same_file.write(other.read_bytes())
            same_file.truncate()
        return load(source, *args, **kwargs)

    monkeypatch.setattr(torch, "load", rewritten_then_loaded)


def test_a_trajectory_point_rewritten_in_place_after_its_check_is_never_what_is_loaded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check read the open point file, then torch.load read it again: a pickle written into it in
    between was unpickled."""
    from tclightning.probes.trajectory import _point

    path, other = tmp_path / "point-000001.pt", tmp_path / "other.pt"
    torch.save({"step": 1, "point": torch.ones(4)}, path)
    torch.save({"step": 9, "point": torch.ones(4)}, other)
    _rewritten_after_its_check(monkeypatch, path, other)
    assert _point(path)["step"] == 1


def test_a_warmup_cache_entry_rewritten_in_place_after_its_check_is_never_what_is_loaded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check read the open weights file, then torch.load read it again: a pickle written into it
    in between was unpickled."""
    from tclightning.models import TinyModelConfig
    from tclightning.models.loading import build_tiny_model
    from tclightning.models.char_tokenizer import build_char_tokenizer
    from tclightning.models.warmup import read_warmup_entry

    model = build_tiny_model(TinyModelConfig(hidden_size=16, num_layers=1, intermediate_size=32),
                             build_char_tokenizer())
    state = model.state_dict()
    entry = tmp_path / "entry"
    entry.mkdir()
    (entry / "complete").write_text("")
    (entry / "stats.json").write_text(json.dumps({"warmup/steps": 2, "warmup/loss_first": 1.0,
                                                  "warmup/loss_last": 0.5, "warmup/seconds": 1.0}))
    torch.save(state, entry / "weights.pt")
    name = next(iter(state))  # the same file with one name changed (same length): another model's
    torch.save({(name[:-1] + ("x" if name[-1] != "x" else "y") if key == name else key): value
                for key, value in state.items()}, tmp_path / "other.pt")
    _rewritten_after_its_check(monkeypatch, entry / "weights.pt", tmp_path / "other.pt")
    loaded, _ = read_warmup_entry(entry, model)
    assert set(loaded) == set(state)


def _sparse_checkpoint(path: Path, elements: int, rl_step: int) -> None:
    """A checkpoint of one float tensor of ``elements`` zeros that takes a few KB of disk: its
    tensor's bytes are holes (a file of any size, cheaply)."""
    holes = path.with_suffix(".holes")
    with holes.open("wb") as file:
        file.truncate(4 * elements)
    zeros = torch.from_file(str(holes), shared=False, size=elements)  # mapped: nothing read
    with torch.serialization.skip_data():  # the tensor's bytes are skipped over, left as holes
        torch.save({"state_dict": {"w": zeros}, "tclightning": {"rl_step": rl_step}}, path)
    holes.unlink()


def test_a_checkpoint_over_2_gib_rewritten_in_place_after_its_check_is_never_what_is_loaded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file too large to read into memory was checked, then read again by torch.load: a pickle
    written into it in between (a refused call that runs for hours) was unpickled. torch.load reads
    the pickle the check read, and from the file only the tensors' bytes (data)."""
    import tclightning.callbacks.checkpointing as checkpointing
    import tclightning.tensor_files as tensor_files

    path, rewritten = tmp_path / "last.ckpt", tmp_path / "other.ckpt"
    elements = 2**29 + 1024  # 2 GiB and 4 KiB of float32
    _sparse_checkpoint(rewritten, elements, 666)  # the same layout, another pickle of the same length
    check = tensor_files.check_torch_file

    def then_rewritten(source, **kwargs):
        check(source, **kwargs)
        with rewritten.open("rb") as other, path.open("r+b") as same_file:  # the same file, written over
            same_file.write(other.read(1 << 16))

    monkeypatch.setattr(tensor_files, "check_torch_file", then_rewritten)
    _sparse_checkpoint(path, elements, 1)
    assert path.stat().st_size > 2 * 2**30 and path.stat().st_blocks * 512 < 2**20
    loaded = checkpointing.load_checkpoint(path, map_location="meta")
    assert loaded["tclightning"]["rl_step"] == 1 and loaded["state_dict"]["w"].shape == (elements,)
