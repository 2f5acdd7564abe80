"""The ``lightning`` command: the presets' header command (``lightning fit --config ...
--trainer.callbacks=callbacks/X.yaml``) runs LightningCLI on a user's module with the preset's
callbacks, and ``tclightning run --config FILE`` is ``--recipe FILE``."""

from __future__ import annotations

import importlib.util
import re
import shlex
import sys
import warnings
from pathlib import Path

import pytest
import yaml
from conftest import FAST, REPO

from tclightning.cli import lightning as lightning_cli

PRESETS = sorted((REPO / "callbacks").glob("*.yaml"))
HAS_JSONARGPARSE = importlib.util.find_spec("jsonargparse") is not None

MY_CONFIG = """\
model:
  class_path: lightning.pytorch.demos.boring_classes.BoringModel
data:
  class_path: lightning.pytorch.demos.boring_classes.BoringDataModule
trainer:
  max_steps: 2
  limit_val_batches: 0
  log_every_n_steps: 1
  enable_progress_bar: false
  enable_model_summary: false
  logger:
    class_path: lightning.pytorch.loggers.CSVLogger
    init_args: {save_dir: logs}
"""


def header_command(preset: Path) -> list[str]:
    """The command of a preset's header comment from ``fit`` on, split like a shell would:
    ``lightning fit ...`` or ``python my_trainer.py fit ...`` (a user's own LightningCLI script,
    which parses the same options as ``lightning fit``)."""
    lines = [line.lstrip("#").strip() for line in preset.read_text().splitlines() if line.startswith("#")]
    (command,) = [line for line in lines if line.startswith(("lightning fit ", "python my_trainer.py fit "))]
    argv = shlex.split(command)
    return argv[argv.index("fit"):]


@pytest.mark.skipif(not HAS_JSONARGPARSE, reason="lightning fit needs jsonargparse (pip install 'lightning[pytorch-extra]')")
@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_preset_header_command_runs(preset, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "callbacks").symlink_to(REPO / "callbacks")
    (tmp_path / "my_config.yaml").write_text(MY_CONFIG)
    argv = header_command(preset)
    assert f"--trainer.callbacks=callbacks/{preset.name}" in argv
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert lightning_cli.main(argv) == 0
    (saved,) = (tmp_path / "logs").rglob("config.yaml")  # LightningCLI saves the parsed config
    used = [cb["class_path"] for cb in yaml.safe_load(saved.read_text())["trainer"]["callbacks"]]
    wanted = [entry["class_path"] for entry in yaml.safe_load(preset.read_text())]
    assert used[: len(wanted)] == wanted
    if preset.stem == "anchor-controller":  # a module without an anchor: it says it has nothing to do
        assert any("has no anchor" in str(w.message) for w in caught)
    elif preset.stem != "trajectory":  # the monitors ran on the user's module and logged their verdict
        (metrics,) = (tmp_path / "logs").rglob("metrics.csv")
        assert "health/state" in metrics.read_text().splitlines()[0].split(",")
    else:
        assert list(tmp_path.rglob("trajectory/point-*.pt"))


def test_lightning_fit_without_jsonargparse_is_one_line(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "jsonargparse" else real(name, *a))
    assert lightning_cli.main(["fit", "--config", "x.yaml"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: lightning fit runs LightningCLI, which needs jsonargparse: "
                   "pip install 'lightning[pytorch-extra]'")


def test_help_lists_fit_and_run(capsys):
    with pytest.raises(SystemExit):
        lightning_cli.main(["--help"])
    out = capsys.readouterr().out
    assert "fit" in out and "run" in out and "lightning fit --config cfg.yaml --trainer.callbacks=" in out


def test_tclightning_run_config_is_recipe(run_root, capsys):
    from tclightning.cli.main import main

    recipe = str(REPO / "recipes" / "tiny.yaml")
    assert main(["run", "--config", recipe, "--quiet", *FAST, "trainer.steps=1"]) == 0
    assert list(run_root.glob("tiny/*/summary.json"))


@pytest.mark.skipif(not HAS_JSONARGPARSE, reason="lightning fit needs jsonargparse (pip install 'lightning[pytorch-extra]')")
def test_a_config_yaml_of_yours_is_never_overwritten(tmp_path, monkeypatch, capsys):
    """With no logger LightningCLI saves its config in the working folder: one already there is
    kept and the command says so in one line (LightningCLI's own default)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_config.yaml").write_text(MY_CONFIG)
    (tmp_path / "config.yaml").write_text("mine: true\n")
    argv = ["fit", "--config", "my_config.yaml", "--trainer.logger=false", "--trainer.default_root_dir=."]
    assert lightning_cli.main(argv) != 0
    assert (tmp_path / "config.yaml").read_text() == "mine: true\n"
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: ") and "config.yaml" in err[-1], err


@pytest.mark.skipif(not HAS_JSONARGPARSE, reason="lightning fit needs jsonargparse (pip install 'lightning[pytorch-extra]')")
def test_a_second_callback_with_one_checkpoint_state_is_one_line(tmp_path, monkeypatch, capsys):
    """A preset's CollapseDetector and one more: one line naming both (Lightning's RuntimeError
    traceback as the Trainer was made, before), nothing written."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_config.yaml").write_text(MY_CONFIG)
    argv = ["fit", "--config", "my_config.yaml", f"--trainer.callbacks={REPO / 'callbacks' / 'monitoring.yaml'}",
            "--trainer.callbacks+=tclightning.callbacks.CollapseDetector"]
    assert lightning_cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --trainer.callbacks[3]: a second CollapseDetector with the same checkpoint "
                              "state as --trainer.callbacks[2]"), err
    assert not (tmp_path / "logs").exists()


@pytest.mark.skipif(not HAS_JSONARGPARSE, reason="lightning fit needs jsonargparse (pip install 'lightning[pytorch-extra]')")
@pytest.mark.parametrize("hparams, said", [
    ({"_class_path": "antigravity.Nothing"}, "by name (_class_path)"),
    ({"class_path": "antigravity.Nothing"}, "by name (class_path)"),
    ({"lr": 0.1, "inner": [{"init_args": {"model": {"trust_remote_code": True}}}]}, "by name (init_args)"),
    ({"__path__": 1}, "by name (__path__)"),  # jsonargparse's own: it replaced --model
    ({"dict_kwargs": {"lr": 0.1}}, "by name (dict_kwargs)"),
    ({"model": {"source": "hf", "name": "x", "trust_remote_code": True}}, "never turns on remote code"),
])
def test_a_ckpt_path_s_hyper_parameters_never_name_a_class_or_turn_on_remote_code(
        hparams, said, tmp_path, monkeypatch, capsys):
    """LightningCLI merges ``--ckpt_path``'s hyper-parameters into the model's arguments, and a
    ``_class_path`` there would import any module the checkpoint names."""
    import sys

    import torch

    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_config.yaml").write_text(MY_CONFIG)
    torch.save({"hyper_parameters": hparams, "state_dict": {}}, tmp_path / "crafted.ckpt")
    monkeypatch.delitem(sys.modules, "antigravity", raising=False)
    assert lightning_cli.main(["fit", "--config", "my_config.yaml", "--ckpt_path", "crafted.ckpt"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: --ckpt_path crafted.ckpt") and said in err[-1], err
    assert "antigravity" not in sys.modules


@pytest.mark.skipif(not HAS_JSONARGPARSE, reason="lightning fit needs jsonargparse (pip install 'lightning[pytorch-extra]')")
def test_a_ckpt_path_lightning_fit_wrote_resumes_the_model_given(tmp_path, monkeypatch, capsys):
    """LightningCLI records the class it built as ``_class_path`` in every checkpoint of a module that
    saves its hyper-parameters: each was refused as naming a class, though --model gave that class.
    Hyper-parameters that do not fit --model are one line (jsonargparse's usage text, before)."""
    import torch

    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_config.yaml").write_text(MY_CONFIG)
    assert lightning_cli.main(["fit", "--config", "my_config.yaml"]) == 0
    (written,) = tmp_path.rglob("*.ckpt")
    checkpoint = torch.load(written, weights_only=False)
    checkpoint["hyper_parameters"] = {"_class_path": "lightning.pytorch.demos.boring_classes.BoringModel",
                                      "_instantiator": "lightning.pytorch.cli.instantiate_module"}
    torch.save(checkpoint, tmp_path / "mine.ckpt")
    argv = ["fit", "--config", "my_config.yaml", "--trainer.max_steps=3", "--ckpt_path", "mine.ckpt"]
    assert lightning_cli.main(argv) == 0, capsys.readouterr().err
    checkpoint["hyper_parameters"]["_class_path"] = "lightning.pytorch.demos.boring_classes.DemoModel"  # not --model's
    torch.save(checkpoint, tmp_path / "other.ckpt")
    assert lightning_cli.main([*argv[:-1], "other.ckpt"]) == 2
    assert "by name (_class_path)" in capsys.readouterr().err
    # a text: jsonargparse reads it as a module to import (by a callable's or a class's argument, under any
    # name), or as a configuration file to read, which names one
    (tmp_path / "planted_module.py").write_text("import pathlib\npathlib.Path('ran').write_text('x')\n")
    (tmp_path / "sub.yaml").write_text("class_path: planted_module.Planted\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for hparams in ({"_class_path": "lightning.pytorch.demos.boring_classes.BoringModel", "act": "planted_module.fn"},
                    {"head": ["planted_module.Planted"]}, {"head": "sub.yaml"}, {"act": "plant\u00e9d.fn"}):
        checkpoint["hyper_parameters"] = hparams
        torch.save(checkpoint, tmp_path / "naming.ckpt")
        capsys.readouterr()
        assert lightning_cli.main([*argv[:-1], "naming.ckpt"]) == 2
        assert "is a text, which the parser may read as a file or a module" in capsys.readouterr().err
    assert not (tmp_path / "ran").exists() and "planted_module" not in sys.modules
    checkpoint["hyper_parameters"] = {"act": 3}
    torch.save(checkpoint, tmp_path / "unfit.ckpt")
    capsys.readouterr()
    assert lightning_cli.main([*argv[:-1], "unfit.ckpt"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --ckpt_path unfit.ckpt: its hyper-parameters (act) are no arguments of --model "
                   "lightning.pytorch.demos.boring_classes.BoringModel; nothing was built"], err


@pytest.mark.parametrize("ckpt_path, said", [
    ("http://127.0.0.1:9/x.ckpt", "only a local checkpoint file"),
    ("simplecache::file:///x.ckpt", "only a local checkpoint file"),
    ("pipe.ckpt", "no regular file"),
    ("missing.ckpt", "no regular file"),
])
def test_a_ckpt_path_that_is_no_local_regular_file_is_one_line(ckpt_path, said, tmp_path, monkeypatch, capsys):
    """A URL would be fetched from a server that may never answer, a FIFO waited on forever."""
    import os

    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_config.yaml").write_text(MY_CONFIG)
    os.mkfifo(tmp_path / "pipe.ckpt")
    assert lightning_cli.main(["fit", "--config", "my_config.yaml", "--ckpt_path", ckpt_path]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith(f"error: --ckpt_path {ckpt_path}") and said in err[-1], err


@pytest.mark.skipif(not HAS_JSONARGPARSE, reason="lightning fit needs jsonargparse (pip install 'lightning[pytorch-extra]')")
@pytest.mark.parametrize("option, folder, said", [
    ("--trainer.default_root_dir", "dbfs://host/r", "error: trainer.default_root_dir dbfs://host/r cannot be written: "
                                                    "TypeError"),
    ("--trainer.default_root_dir", "jupyter://host/r", "error: trainer.default_root_dir jupyter://host/r cannot be written"),
    ("--trainer.default_root_dir", "generic://x", "error: trainer.default_root_dir generic://x cannot be written"),
    ("--trainer.default_root_dir", "ftp://127.0.0.1:{port}/r", "cannot be written: ConnectionRefusedError"),
    ("--trainer.callbacks.dirpath", "generic://x", "error: the configuration's lightning.pytorch.callbacks.ModelCheckpoint "
                                                   "could not be built: GenericFileSystem"),
])  # fmt: skip
def test_a_store_fsspec_cannot_make_is_one_line(option, folder, said, tmp_path, monkeypatch, capsys):
    """The Trainer makes its default logger's store under default_root_dir, and ModelCheckpoint its
    dirpath's, as they are built: a store whose constructor fails (no token, a refused port) was a
    traceback."""
    import socket

    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    folder = folder.format(port=port)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_config.yaml").write_text(MY_CONFIG)
    argv = ["fit", "--config", "my_config.yaml", f"{option}={folder}"]
    if option.startswith("--trainer.callbacks"):
        argv.insert(3, "--trainer.callbacks+=ModelCheckpoint")
    capsys.readouterr()
    assert lightning_cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and said in err[-1] and "Traceback" not in "\n".join(err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my_config.yaml"]  # nothing written


def _boring_checkpoint(path: str, weights_only: bool = False) -> None:
    """A checkpoint of Lightning's BoringModel after one step of a fit, saved at ``path``."""
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

    trainer = pl.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0)
    trainer.fit(BoringModel(), BoringDataModule())
    trainer.save_checkpoint(path, weights_only=weights_only)


@pytest.mark.skipif(not HAS_JSONARGPARSE, reason="lightning fit needs jsonargparse (pip install 'lightning[pytorch-extra]')")
def test_a_weights_only_ckpt_path_that_cannot_resume_a_fit_is_one_line(tmp_path, monkeypatch, capsys):
    """Lightning's own restore of a weights-only checkpoint (``save_weights_only``) into a fit raised
    a KeyError traceback."""
    monkeypatch.chdir(tmp_path)
    _boring_checkpoint("weights.ckpt", weights_only=True)
    (tmp_path / "my_config.yaml").write_text(MY_CONFIG)
    capsys.readouterr()
    assert lightning_cli.main(["fit", "--config", "my_config.yaml", "--ckpt_path", "weights.ckpt"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: --ckpt_path: the checkpoint cannot be restored into this fit (KeyError: "
                                      "'Trying to restore optimizer state"), err


def _metadata_of_ints(checkpoint: dict) -> None:
    checkpoint["state_dict"]._metadata = {"": 5}  # torch's load_state_dict reads each value's "version"


@pytest.mark.skipif(not HAS_JSONARGPARSE, reason="lightning fit needs jsonargparse (pip install 'lightning[pytorch-extra]')")
@pytest.mark.parametrize("edit", [
    _metadata_of_ints,
    lambda c: c.__setitem__("state_dict", {7: t for t in c["state_dict"].values()}),
    lambda c: c.__setitem__("loops", {"fit_loop": 5}),
    lambda c: c.__setitem__("lr_schedulers", [5]),
    lambda c: c["optimizer_states"][0].__setitem__("param_groups", []),
], ids=["metadata-of-ints", "int-keys", "loops-of-ints", "schedulers-of-ints", "no-parameter-groups"])
def test_a_ckpt_path_whose_state_lightning_cannot_restore_is_one_line(edit, tmp_path, monkeypatch, capsys):
    """Only a KeyError or RuntimeError of Lightning's restore was one line; its other errors on a
    checkpoint of another form (an AttributeError, TypeError, ValueError) were tracebacks."""
    import torch

    monkeypatch.chdir(tmp_path)
    _boring_checkpoint("saved.ckpt")
    checkpoint = torch.load("saved.ckpt", weights_only=False)
    edit(checkpoint)
    torch.save(checkpoint, "crafted.ckpt")
    (tmp_path / "my_config.yaml").write_text(MY_CONFIG)
    capsys.readouterr()
    assert lightning_cli.main(["fit", "--config", "my_config.yaml", "--ckpt_path", "crafted.ckpt"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and re.match(rf"error: --ckpt_path(:| crafted.ckpt)", err[-1]), err
    assert not any("Traceback" in line for line in err), err


@pytest.mark.skipif(not HAS_JSONARGPARSE, reason="lightning fit needs jsonargparse (pip install 'lightning[pytorch-extra]')")
def test_a_ckpt_path_lightning_never_wrote_is_one_line(tmp_path, monkeypatch, capsys):
    """A torch file of plain tensors passes every check, and Lightning's load then read its
    'pytorch-lightning_version' unguarded: a KeyError traceback."""
    import torch

    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_config.yaml").write_text(MY_CONFIG)
    torch.save({"weight": torch.zeros(2)}, tmp_path / "plain.pt")
    assert lightning_cli.main(["fit", "--config", "my_config.yaml", "--ckpt_path", "plain.pt"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: --ckpt_path plain.pt has no 'pytorch-lightning_version'"), err
    assert not any("Traceback" in line for line in err), err


@pytest.mark.skipif(not HAS_JSONARGPARSE, reason="lightning fit needs jsonargparse (pip install 'lightning[pytorch-extra]')")
@pytest.mark.parametrize("checked", ["http_runs/last.ckpt", "file:last.ckpt"])
def test_a_ckpt_path_lightning_reads_as_a_url_is_the_local_file_checked(checked, tmp_path, monkeypatch, capsys):
    """Lightning reads any path starting with "http" as a URL: ``http_runs/last.ckpt``, checked here
    as the local file, was loaded from torch's download cache (``$TORCH_HOME/hub/checkpoints/last.ckpt``)
    with full unpickling, and a payload planted there ran; ``file:last.ckpt`` was checked as that
    file and ``last.ckpt`` loaded."""
    import os

    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))
    trainer = pl.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0)
    trainer.fit(BoringModel(), BoringDataModule())
    (tmp_path / "http_runs").mkdir()
    trainer.save_checkpoint("benign.ckpt")  # Lightning itself would save file:last.ckpt as last.ckpt
    os.replace("benign.ckpt", checked)
    planted = tmp_path / ("torch-home/hub/checkpoints/last.ckpt" if checked.startswith("http") else "last.ckpt")
    planted.parent.mkdir(parents=True, exist_ok=True)
    checkpoint = torch.load(checked, weights_only=False)
    checkpoint["x"] = Marker(str(tmp_path / "ran"))
    torch.save(checkpoint, planted)
    (tmp_path / "my_config.yaml").write_text(MY_CONFIG.replace("max_steps: 2", "max_steps: 3"))
    assert lightning_cli.main(["fit", "--config", "my_config.yaml", "--ckpt_path", checked]) == 0
    assert not (tmp_path / "ran").exists()


@pytest.mark.skipif(not HAS_JSONARGPARSE, reason="lightning fit needs jsonargparse (pip install 'lightning[pytorch-extra]')")
@pytest.mark.parametrize("name", ["last", "best", "hpc"])
def test_a_file_named_like_lightning_s_checkpoint_names_is_never_read_for_the_model(name, tmp_path, monkeypatch):
    """``--ckpt_path last`` is Lightning's own name, which tclightning left unchecked; LightningCLI
    then read a file called ``last`` in the working folder for the model's arguments, and its
    ``_class_path`` imported any module."""
    import torch

    monkeypatch.chdir(tmp_path)
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / f"planted_{name}.py").write_text(
        f"open({str(tmp_path / 'ran')!r}, 'w').write('imported')\n"
        "from lightning.pytorch.demos.boring_classes import BoringModel as Planted\n")
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    torch.save({"hyper_parameters": {"_class_path": f"planted_{name}.Planted"}}, tmp_path / name)
    (tmp_path / "my_config.yaml").write_text(MY_CONFIG)
    code = lightning_cli.main(["fit", "--config", "my_config.yaml", "--ckpt_path", name])
    assert code == (0 if name == "last" else 2)  # Lightning finds no ModelCheckpoint (best), no HPC checkpoint (hpc)
    assert not (tmp_path / "ran").exists()


@pytest.mark.timeout(120)  # torch.load would hash a tuple 2^60 times
@pytest.mark.skipif(not HAS_JSONARGPARSE, reason="lightning fit needs jsonargparse (pip install 'lightning[pytorch-extra]')")
def test_a_checkpoint_lightning_finds_by_name_is_checked_as_any_other(tmp_path, monkeypatch, capsys):
    """``--ckpt_path hpc`` loads the newest ``hpc_ckpt_N.ckpt`` Lightning finds in the run's root
    folder: read through tclightning's checks, a crafted one is refused in one line; with none
    there, Lightning's refusal is one line too."""
    from tests.conftest import with_pickle

    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_config.yaml").write_text(MY_CONFIG)
    argv = ["fit", "--config", "my_config.yaml", "--trainer.default_root_dir=.", "--ckpt_path", "hpc"]
    capsys.readouterr()
    assert lightning_cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: --ckpt_path: ") and "no HPC checkpoint" in err[-1], err
    with_pickle(tmp_path / "hpc_ckpt_1.ckpt", "dict-key-of-shared-tuples")
    assert lightning_cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "hpc_ckpt_1.ckpt" in err[-1] and "ages to hash" in err[-1], err


class Marker:
    """Unpickled, it creates ``path``: what a payload would do instead."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


@pytest.mark.skipif(not HAS_JSONARGPARSE, reason="lightning fit needs jsonargparse (pip install 'lightning[pytorch-extra]')")
@pytest.mark.parametrize("argv", [
    ["--config", "pipe.yaml"], ["--config", "my_config.yaml", "--trainer.callbacks=pipe.yaml"], ["-cpipe.yaml"],
    ["--config", "my_config.yaml", "--config", "names_callbacks.yaml"],
    ["--config", "my_config.yaml", "--config", "names_model.yaml"],
], ids=["config", "callbacks-file", "short-option-attached", "inside-a-config-callbacks", "inside-a-config-model"])
@pytest.mark.timeout(120)  # a regression waits on the FIFO: fail instead
def test_a_fifo_given_to_lightning_fit_is_one_line(argv, tmp_path, monkeypatch, capsys):
    """jsonargparse opened it and waited for ever: named on the command line, or in a config file
    (every file jsonargparse reads is checked as it reads it)."""
    import os

    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_config.yaml").write_text(MY_CONFIG)
    (tmp_path / "names_callbacks.yaml").write_text("trainer: {callbacks: pipe.yaml}\n")
    (tmp_path / "names_model.yaml").write_text("model: pipe.yaml\n")
    os.mkfifo(tmp_path / "pipe.yaml")
    assert lightning_cli.main(["fit", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "pipe.yaml: is a named pipe (FIFO), not a regular file" in err[-1], err


def test_open_regular_refuses_a_fifo_swapped_in_after_the_look(tmp_path):
    """The check is on the descriptor opened: the file read is the file checked."""
    import os

    from tclightning.errors import TclightningError
    from tclightning.files import open_regular, regular_file

    path = tmp_path / "last.ckpt"
    path.write_bytes(b"x")
    regular_file(path, "checkpoint")
    path.unlink()
    os.mkfifo(path)  # swapped in between the look and the open
    with pytest.raises(TclightningError, match="no longer a regular file"):
        open_regular(path, "checkpoint")
    path.unlink()
    path.write_bytes(b"y")
    with open_regular(path, "checkpoint") as handle:
        assert handle.read() == b"y"


@pytest.mark.skipif(not HAS_JSONARGPARSE, reason="lightning fit needs jsonargparse (pip install 'lightning[pytorch-extra]')")
@pytest.mark.timeout(300)
def test_a_closed_terminal_stops_lightning_fit_as_sigterm_does(tmp_path: Path) -> None:
    """SIGHUP's default ended ``lightning fit`` without a word (exit 129): it is a SIGTERM, which
    Lightning's own handler turns into a stop after the step."""
    import os
    import signal
    import subprocess
    import sys
    import time

    (tmp_path / "my_config.yaml").write_text(MY_CONFIG.replace("max_steps: 2", "max_steps: 100000000\n  max_epochs: -1"))
    child = subprocess.Popen([sys.executable, "-c", "import sys; from tclightning.cli.lightning import main; "
                              "sys.exit(main())", "fit", "--config", "my_config.yaml"],
                             cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while not list((tmp_path / "logs").rglob("*.ckpt")) and time.monotonic() < deadline:
            time.sleep(0.5)  # an epoch's checkpoint: the fit (and Lightning's SIGTERM handler) is under way
        child.send_signal(signal.SIGHUP)
        out, _ = child.communicate(timeout=120)
    finally:
        child.kill()
    assert child.returncode == 0 and "Received SIGTERM" in out, (child.returncode, out[-2000:])


@pytest.mark.skipif(not HAS_JSONARGPARSE, reason="lightning fit needs jsonargparse (pip install 'lightning[pytorch-extra]')")
@pytest.mark.parametrize("content, said", [
    ("".join(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}' if i else 'x'] * 10)}]\n" for i in range(9))
     + "trainer: {callbacks: *a8}\n", "more than 20000 values once its aliases are expanded"),
    ("u0: &u0 [x, x, x, x, x, x, x, x, x, x]\n" + "".join(f"u{i}: &u{i} [*u{i - 1}, *u{i - 1}, *u{i - 1}, *u{i - 1}, "
                                                          f"*u{i - 1}, *u{i - 1}, *u{i - 1}, *u{i - 1}]\n"
                                                          for i in range(1, 9)), "more than 20000 values"),
    (b"trainer: {max_steps: \xff\xfe}\n", "not UTF-8 text (byte 0xff at offset 21)"),
    (b"#" * ((1 << 20) + 1), "larger than a lightning: a file the configuration names can be"),
], ids=["alias-bomb", "alias-bomb-in-keys-no-one-reads", "not-utf8", "past-1-mib"])
@pytest.mark.timeout(120)  # a regression expands the bomb for ever: fail instead
def test_a_config_file_lightning_fit_reads_is_bounded_as_a_recipe_is(content, said, tmp_path, monkeypatch, capsys):
    """A 456-byte config of aliases expanded to 10^9 values inside jsonargparse (no end, gigabytes),
    bytes that are not UTF-8 were a traceback, and a file of any size was read whole."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_config.yaml").write_text(MY_CONFIG)
    (tmp_path / "odd.yaml").write_bytes(content.encode() if isinstance(content, str) else content)
    assert lightning_cli.main(["fit", "--config", "my_config.yaml", "--config", "odd.yaml"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "odd.yaml" in err[0] and said in err[0], err


_FLOW_BOMB = "[&a0 [x,x,x,x,x,x,x,x,x,x], " + ", ".join(
    f"&a{i} [" + ",".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)) + "]"


@pytest.mark.skipif(not HAS_JSONARGPARSE, reason="lightning fit needs jsonargparse (pip install 'lightning[pytorch-extra]')")
@pytest.mark.parametrize("argv, said", [
    (["--config", "trainer: {callbacks: " + _FLOW_BOMB + "}"], "more than 20000 values"),
    ([f"--trainer.callbacks={_FLOW_BOMB}"], "more than 20000 values"),
    ([f"--trainer={{callbacks: {_FLOW_BOMB}}}"], "more than 20000 values"),
    (["--config", "trainer: {max_steps: " + "9" * 5000 + "}"], "a number of 5000 characters"),
    (["--config", "trainer: {max_steps: 0x" + "f" * 5000 + "}"], "a number of 5002 characters"),
    (["--config", "trainer: {max_steps: 1" + ":59" * 2000 + "}"], "a number of 6001 characters"),
], ids=["config-text", "option-value", "section-value", "integer-of-5000-digits", "hex-integer",
        "base-60-integer"])
@pytest.mark.timeout(120)  # a regression expands the bomb for ever: fail instead
def test_yaml_text_lightning_fit_parses_is_bounded_as_a_recipe_is(argv, said, tmp_path, monkeypatch, capsys):
    """jsonargparse parses a --config that names no file, and every option value, as YAML: the
    alias bomb bounded in a file ran without end as text, and an integer Python does not convert
    was a traceback."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_config.yaml").write_text(MY_CONFIG)
    assert lightning_cli.main(["fit", "--config", "my_config.yaml", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and said in err[0], err


@pytest.fixture
def silent_server():
    """A URL on a local server that accepts a connection and never answers."""
    import socket

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield f"http://127.0.0.1:{server.getsockname()[1]}/config.yaml"


@pytest.mark.skipif(not HAS_JSONARGPARSE, reason="lightning fit needs jsonargparse (pip install 'lightning[pytorch-extra]')")
@pytest.mark.parametrize("form", ["--config URL", "-cURL", "--config=simplecache::URL"])
@pytest.mark.timeout(120)  # a regression waits on the server: fail instead
def test_a_remote_config_is_refused_in_one_line(form, silent_server, tmp_path, monkeypatch, capsys):
    """Lightning turns on jsonargparse's fsspec reading: a config URL on a server that never
    answers was waited on for ever."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_config.yaml").write_text(MY_CONFIG)
    argv = form.replace("URL", silent_server).split(" ")
    assert lightning_cli.main(["fit", "--config", "my_config.yaml", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and silent_server in err[0] and "only a local file is read" in err[0], err
    assert not (tmp_path / "logs").exists()


@pytest.mark.skipif(not HAS_JSONARGPARSE, reason="lightning fit needs jsonargparse (pip install 'lightning[pytorch-extra]')")
@pytest.mark.parametrize("where", ["option-value", "in-a-config-callbacks", "in-a-config-model"])
@pytest.mark.timeout(120)  # a regression waits on the server: fail instead
def test_a_url_a_value_names_is_not_fetched(where, silent_server, tmp_path, monkeypatch):
    """A URL given as a value, or named inside a config file, is a value jsonargparse refuses,
    not a file it waits on; Lightning's own reading mode is back afterwards."""
    from jsonargparse._optionals import _get_config_read_mode

    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_config.yaml").write_text(MY_CONFIG)
    (tmp_path / "names_url.yaml").write_text(
        f"model: {silent_server}\n" if where == "in-a-config-model" else f"trainer: {{callbacks: {silent_server}}}\n")
    argv = [f"--trainer.callbacks={silent_server}"] if where == "option-value" else ["--config", "names_url.yaml"]
    with pytest.raises(SystemExit) as stopped:  # jsonargparse's usage error, as for any value it cannot take
        lightning_cli.main(["fit", "--config", "my_config.yaml", *argv])
    assert stopped.value.code == 2 and "s" in _get_config_read_mode()
    assert not (tmp_path / "logs").exists()


@pytest.mark.skipif(not HAS_JSONARGPARSE, reason="lightning fit needs jsonargparse (pip install 'lightning[pytorch-extra]')")
@pytest.mark.timeout(120)  # a regression waits on the server: fail instead
def test_a_logger_whose_remote_store_never_answers_stops_lightning_fit_in_one_line(silent_server, tmp_path,
                                                                                   monkeypatch, capsys):
    """A TensorBoard logger writing to a server that never answers was waited on without end."""
    import tclightning.network

    monkeypatch.setattr(tclightning.network, "REMOTE_SETUP_S", 1.0)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_config.yaml").write_text(MY_CONFIG)
    assert lightning_cli.main(["fit", "--config", "my_config.yaml", "--trainer.logger=TensorBoardLogger",
                               f"--trainer.logger.save_dir={silent_server}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "gave no answer within 1 s" in err[-1] and silent_server in err[-1], err


@pytest.mark.skipif(not HAS_JSONARGPARSE, reason="lightning fit needs jsonargparse (pip install 'lightning[pytorch-extra]')")
def test_a_ckpt_path_is_read_for_its_hyper_parameters_once_checked_never_again_by_path(tmp_path, monkeypatch, capsys):
    """LightningCLI loaded the ``--ckpt_path`` file again by its path for the model's arguments,
    after tclightning had checked it: a crafted file renamed over it in between was unpickled
    unchecked (a quadratic ``_codecs.encode`` call ran without end). The arguments come from the
    checked read, merged as LightningCLI merges them."""
    import lightning.pytorch.cli as lightning_cli_module
    import torch

    class TorchWithoutLoad:  # LightningCLI's torch, whose load by path must not be called
        def __getattr__(self, name: str):
            if name == "load":
                raise AssertionError("LightningCLI read the checkpoint again by its path, unchecked")
            return getattr(torch, name)

    monkeypatch.chdir(tmp_path)
    _boring_checkpoint("boring.ckpt")
    checkpoint = torch.load("boring.ckpt", weights_only=True)
    checkpoint["hparams_name"] = "kwargs"  # what Lightning records for any module that saves its arguments
    torch.save(checkpoint, "named.ckpt")
    checkpoint["hyper_parameters"] = {"scale": 3.0}
    torch.save(checkpoint, "scaled.ckpt")
    monkeypatch.setattr(lightning_cli_module, "torch", TorchWithoutLoad())
    (tmp_path / "my_config.yaml").write_text(MY_CONFIG.replace("max_steps: 2", "max_steps: 3"))
    for name in ("boring.ckpt", "named.ckpt"):  # LightningCLI reads only hyper_parameters: hparams_name is no risk
        assert lightning_cli.main(["fit", "--config", "my_config.yaml", "--ckpt_path", name]) == 0
    capsys.readouterr()  # jsonargparse's refusal, as LightningCLI's own merge gives, in one line
    assert lightning_cli.main(["fit", "--config", "my_config.yaml", "--ckpt_path", "scaled.ckpt"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --ckpt_path scaled.ckpt: its hyper-parameters (scale)"), err


@pytest.mark.skipif(not HAS_JSONARGPARSE, reason="lightning fit needs jsonargparse (pip install 'lightning[pytorch-extra]')")
@pytest.mark.parametrize("remote", ["default-root-dir", "mlflow-server"])
@pytest.mark.timeout(120)  # a regression waits on the server: fail instead
def test_a_remote_folder_or_server_the_fit_needs_that_never_answers_is_one_line(remote, silent_server, tmp_path,
                                                                                monkeypatch, capsys):
    """Lightning writes its config beside ``default_root_dir`` at setup, and MLflow asks its server
    for the experiment: each waited on a server that never answers without end."""
    import tclightning.network

    monkeypatch.setattr(tclightning.network, "REMOTE_SETUP_S", 1.0)
    monkeypatch.chdir(tmp_path)
    # LightningCLI saves its config into the first logger's folder: a local one comes first
    mlflow = (f"    - class_path: lightning.pytorch.loggers.CSVLogger\n      init_args: {{save_dir: logs}}\n"
              f"    - class_path: lightning.pytorch.loggers.MLFlowLogger\n      init_args: {{tracking_uri: '{silent_server}'}}\n")
    (tmp_path / "my_config.yaml").write_text(MY_CONFIG if remote == "default-root-dir" else
                                             MY_CONFIG.split("  logger:")[0] + "  logger:\n" + mlflow)
    argv = ["--trainer.logger=false", f"--trainer.default_root_dir={silent_server}"] if remote == "default-root-dir" else []
    if remote == "mlflow-server":
        pytest.importorskip("mlflow")
    assert lightning_cli.main(["fit", "--config", "my_config.yaml", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "gave no answer within 1 s" in err[-1], err


@pytest.mark.skipif(not HAS_JSONARGPARSE, reason="lightning fit needs jsonargparse (pip install 'lightning[pytorch-extra]')")
def test_async_checkpointing_into_a_remote_store_is_one_line(tmp_path, monkeypatch, capsys):
    """AsyncCheckpointIO writes from a thread of its own, which no time limit reaches and for which
    the process waits at its exit: an ftp store dripping its answer held the finished fit for ever."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_config.yaml").write_text(MY_CONFIG)
    assert lightning_cli.main(["fit", "--config", "my_config.yaml", "--trainer.plugins=AsyncCheckpointIO",
                               "--trainer.default_root_dir=memory://store/runs"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: AsyncCheckpointIO writes checkpoints from a thread no time limit "
                                      "reaches, and a store of this fit is remote"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my_config.yaml"]


@pytest.mark.skipif(not HAS_JSONARGPARSE, reason="lightning fit needs jsonargparse (pip install 'lightning[pytorch-extra]')")
def test_a_first_logger_without_a_folder_for_the_config_is_one_line(silent_server, tmp_path, monkeypatch, capsys):
    """LightningCLI saves its config into the first logger's folder and asserts it has one: an
    MLflow logger on a server has none (an AssertionError traceback). Refused before the server
    is asked anything."""
    pytest.importorskip("mlflow")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_config.yaml").write_text(MY_CONFIG)
    assert lightning_cli.main(["fit", "--config", "my_config.yaml", "--trainer.logger=MLFlowLogger",
                               f"--trainer.logger.tracking_uri={silent_server}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: LightningCLI saves its configuration into the first logger's folder, "
                                      "and the MLFlowLogger writes to a server"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my_config.yaml"]


@pytest.mark.skipif(not HAS_JSONARGPARSE, reason="lightning fit needs jsonargparse (pip install 'lightning[pytorch-extra]')")
@pytest.mark.skipif(importlib.util.find_spec("s3fs") is not None, reason="s3fs is installed: the store opens")
def test_a_class_of_the_configuration_that_cannot_be_built_is_one_line(tmp_path, monkeypatch, capsys):
    """jsonargparse's instantiation error (a logger whose store needs a package) was a 20-line
    traceback; its class and its own error are the line."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_config.yaml").write_text(MY_CONFIG)
    assert lightning_cli.main(["fit", "--config", "my_config.yaml", "--trainer.logger=CSVLogger",
                               "--trainer.logger.save_dir=s3://bucket/logs"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("error: the configuration's lightning.pytorch.loggers.CSVLogger could not be built: "
                       "Install s3fs to access S3 (nothing was trained)"), err
    # a protocol fsspec does not know: jsonargparse words it as no subtype of the union matching
    assert lightning_cli.main(["fit", "--config", "my_config.yaml", "--trainer.logger=CSVLogger",
                               "--trainer.logger.save_dir=gopher://host/logs"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("error: the configuration's lightning.pytorch.loggers.CSVLogger could not be built: "
                       "Protocol not known: gopher (nothing was trained)"), err
    for where in (["--trainer.default_root_dir=gopher://host/runs"],  # read by Lightning's own constructors
                  ["--trainer.callbacks=ModelCheckpoint", "--trainer.callbacks.dirpath=gopher://host/ckpt"]):
        assert lightning_cli.main(["fit", "--config", "my_config.yaml", *where]) == 2
        err = capsys.readouterr().err
        last = err.strip().splitlines()[-1]
        assert "Traceback" not in err and last.startswith("error: ") and "gopher" in last, err
        assert "fsspec does not know" in last or "Protocol not known" in last, err


@pytest.mark.timeout(120)  # a regression waits for the second node: fail instead
def test_lightning_fit_on_several_nodes_started_by_hand_is_one_line(tmp_path, monkeypatch, capsys):
    """``--trainer.num_nodes=2`` with no launcher waited in torch's rendezvous for a node that never
    comes, as ``tclightning run`` refuses at once."""
    from tclightning.run import LAUNCHER_ENV

    for name in LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_config.yaml").write_text(MY_CONFIG)
    assert lightning_cli.main(["fit", "--config", "my_config.yaml", "--trainer.num_nodes=2",
                               "--trainer.strategy=ddp"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --trainer.num_nodes=2: start it on every node with a launcher"), err


def test_a_fit_failure_that_is_not_the_input_s_is_shown_as_it_is_and_a_remote_one_in_one_line() -> None:
    """``_fit_failure`` named ``remote_failure`` without importing it: any failure of another kind (a
    remote store that stopped answering mid-fit included) ended in a NameError traceback."""
    from tclightning.cli.lightning import _fit_failure

    import socket

    assert _fit_failure(ZeroDivisionError("a bug")) is None  # a bug: shown in full, as it is
    silent, _ = socket.socketpair()
    silent.settimeout(0.01)
    with silent, pytest.raises(TimeoutError) as read:
        silent.makefile("rb").read(1)  # a peer that never answers
    stalled = _fit_failure(read.value)
    assert stalled is not None and str(stalled).startswith("a remote store or server stopped answering")
    # a timeout of your own (a callback's lock) was called a remote store's, its traceback hidden, and
    # a ValueError of yours that says ckpt_path= a --ckpt_path problem
    assert _fit_failure(TimeoutError("my lock took too long")) is None
    assert _fit_failure(ValueError("my callback: ckpt_path=None is not supported here")) is None
