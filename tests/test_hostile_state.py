"""State a checkpoint carries that no recipe checks: codec bases, cut counters, health-monitor
records, optimizer states, weights and the checkpoint's own sections. Each one that does not fit
is refused with one line, and a refused resume leaves its run directory byte for byte as it was."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
from pathlib import Path

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
from tests.conftest import FAST, two_step_run

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
], ids=["rng", "no-optimizer-state", "bool-weight"])
def test_a_refused_resume_leaves_the_run_directory_as_it_was(
        run_dir: Path, tmp_path: Path, edit, names: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    copied = _crafted(run_dir, tmp_path, edit)
    before = _snapshot(copied)
    code, err = _resume(copied, capsys)
    assert code == 2 and len(err) == 1, err
    for name in names:
        assert name in err[0], err
    assert _snapshot(copied) == before  # recipe.yaml, hparams.yaml, metrics.csv and tb/ untouched


@pytest.mark.parametrize("edit, names", [
    (lambda c: c.__setitem__("hyper_parameters", None), ("'hyper_parameters' is a NoneType",)),
    (lambda c: c.__setitem__("tclightning", [1, 2]), ("'tclightning' is a list",)),
    (lambda c: c["hyper_parameters"]["model"]["tiny"].__setitem__("num_heads", 3), ("model.tiny.num_heads",)),
    (lambda c: c["state_dict"][_first_float_weight(c)].view(-1).__setitem__(0, float("nan")), ("NaN or Inf",)),
    (lambda c: c["state_dict"].__setitem__(_first_float_weight(c), c["state_dict"][_first_float_weight(c)].long()),
     ("torch.int64",)),
], ids=["hparams-none", "state-a-list", "heads", "nan-weight", "int-weight"])
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


def test_ctrl_c_after_a_command_finished_is_one_line_and_exit_130() -> None:
    script = ("import os, signal, time\n"
              "from tclightning.console import exit_at_late_interrupt\n"
              "exit_at_late_interrupt()\n"
              "os.kill(os.getpid(), signal.SIGINT)\n"
              "time.sleep(30)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert done.returncode == 130 and done.stderr.strip() == "interrupted while exiting; the command had finished"


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


def test_a_resume_writes_no_file_through_a_planted_link_and_prunes_only_its_own_step_files(
        run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    copied = tmp_path / "run"
    shutil.copytree(run_dir, copied)
    mine = tmp_path / "mine.txt"
    mine.write_text("precious")
    folder = copied / "checkpoints"
    for name in (".step.ckpt.tmp", ".last.ckpt.tmp"):
        (folder / name).symlink_to(mine)
    keep = {name: name.encode() for name in ("step-000001.keep.ckpt", "step-000002 backup.ckpt")}
    for name, data in keep.items():
        (folder / name).write_bytes(data)
    capsys.readouterr()
    assert main(["run", "--recipe", "tiny", *FAST, "trainer.steps=4", "trainer.val_every=0",
                 "trainer.checkpoint_every=1", "trainer.keep_checkpoints=1", "--quiet", "--resume", str(copied)]) == 0
    assert mine.read_text() == "precious"
    assert all((folder / name).read_bytes() == data for name, data in keep.items())
    assert not any(p.is_symlink() for p in folder.iterdir())
    assert sorted(p.name for p in folder.glob("step-*.ckpt") if p.name not in keep) == ["step-000004.ckpt"]


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
