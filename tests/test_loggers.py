"""``logging.loggers``: the Lightning loggers people use, by short name or class_path, validated on
load with one-line errors; W&B (offline) and MLflow (local file store) tested without network."""

from __future__ import annotations

import importlib.util
import subprocess
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import FAST

from tclightning.errors import RecipeError
from tclightning.logging import build_loggers, own_loggers
from tclightning.recipes.loader import load_recipe, resolve_callback_class, to_dataclass

HAS_WANDB = importlib.util.find_spec("wandb") is not None
HAS_MLFLOW = importlib.util.find_spec("mlflow") is not None


@pytest.mark.parametrize(("override", "message"), [
    ("logging.loggers=[wandbb]", "unknown logger 'wandbb' (did you mean 'wandb'?)"),
    ("logging.loggers=[{class_path: x.y.Z, init_args: {}, extra: 1}]", "unknown key(s) ['extra']"),
    ("logging.loggers=[{init_args: {project: p}}]", "class_path must be a logger name"),
    ("logging.loggers=[{class_path: csv, init_args: {name: x}}]", "the run's own csv logger takes no init_args"),
    ("logging.loggers=[{class_path: lightning.pytorch.callbacks.Timer}]", "is not a Lightning logger"),
    ("logging.loggers=[{class_path: nowhere.Logger}]", "no module 'nowhere'"),
    ("logging.loggers=wandb", "expected a list, e.g. [a, b]"),
])
def test_bad_logger_entries_are_one_line_errors(override, message):
    with pytest.raises(RecipeError) as err:
        load_recipe("tiny", [override])
    text = str(err.value)
    assert message in text and "logging.loggers" in text and "\n" not in text


def test_a_logger_among_the_callbacks_gets_a_hint():
    with pytest.raises(RecipeError, match="is a Lightning logger, not a callback: list it under logging.loggers"):
        resolve_callback_class("lightning.pytorch.loggers.CSVLogger", "r.yaml", "callbacks[0].class_path")


def test_missing_package_names_the_install(monkeypatch):
    import tclightning.recipes.loader as loader

    real = loader._find_module
    monkeypatch.setattr(loader, "_find_module", lambda name: False if name == "neptune" else real(name))
    with pytest.raises(RecipeError, match=r"logger 'neptune' needs the 'neptune' package: pip install neptune"):
        load_recipe("tiny", ["logging.loggers=[neptune]"])


def test_own_loggers_by_name_and_constructor_errors(tmp_path):
    cfg = to_dataclass(load_recipe("tiny", ["logging.loggers=[csv,tensorboard]"]))
    assert own_loggers(cfg.logging.loggers) == {"csv", "tensorboard"}
    assert build_loggers(cfg.logging.loggers, tmp_path / "run", "tiny") == []
    entry = {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"no_such_arg": 1}}
    with pytest.raises(RecipeError, match=r"logging\.loggers\[0\]\.init_args"):
        build_loggers([entry], tmp_path / "run", "tiny")


def test_a_logger_pointed_at_a_folder_of_yours_is_refused_before_it_writes(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "metrics.csv").write_text("precious\n")
    for init_args in ({"save_dir": str(mine), "name": "", "version": ""},
                      {"save_dir": str(tmp_path), "name": "mine", "version": ""},
                      # `mine` once the logger has made `new`: the check is of where the files land
                      {"save_dir": str(mine / "new" / ".."), "name": "", "version": ""},
                      {"save_dir": str(tmp_path), "name": "x/../", "version": "mine/"},
                      {"save_dir": f"file://{mine}", "name": "", "version": ""},  # fsspec's URL of it
                      {"save_dir": f"local://{mine}", "name": "", "version": ""}):  # and its other name
        for logger in ("CSVLogger", "TensorBoardLogger"):
            entry = {"class_path": f"lightning.pytorch.loggers.{logger}", "init_args": init_args}
            with pytest.raises(RecipeError, match=r"logging\.loggers\[0\]\.init_args.*already holds files"):
                build_loggers([entry], tmp_path / "run", "tiny")
    entry = {"class_path": "lightning.pytorch.loggers.CSVLogger",
             "init_args": {"save_dir": f"simplecache::file://{mine}", "name": "", "version": ""}}
    with pytest.raises(RecipeError, match="a chained fsspec URL is not checked"):  # writes through to mine
        build_loggers([entry], tmp_path / "run", "tiny")
    assert (mine / "metrics.csv").read_text() == "precious\n"
    # a new version folder each run (version unset), or an empty folder: built
    entry = {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(tmp_path), "name": "mine"}}
    assert len(build_loggers([entry], tmp_path / "run", "tiny")) == 1


@pytest.mark.parametrize("logger", ["CSVLogger", "TensorBoardLogger"])
@pytest.mark.timeout(120)  # a regression waits on the server: fail instead
def test_a_logger_whose_remote_store_never_answers_is_refused(logger, tmp_path, monkeypatch):
    """Lightning's loggers write through fsspec: a ``save_dir`` on a server that accepts and never
    answers was waited on without end before training; one that answers is used."""
    import socket

    import tclightning.network

    monkeypatch.setattr(tclightning.network, "REMOTE_SETUP_S", 1.0)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        url = f"http://127.0.0.1:{server.getsockname()[1]}/logs"
        entry = {"class_path": f"lightning.pytorch.loggers.{logger}", "init_args": {"save_dir": url}}
        with pytest.raises(RecipeError, match=r"logging\.loggers\[0\]\.init_args.*gave no answer within 1 s"):
            build_loggers([entry], tmp_path / "run", "tiny")
    entry = {"class_path": f"lightning.pytorch.loggers.{logger}", "init_args": {"save_dir": "memory://logs"}}
    assert len(build_loggers([entry], tmp_path / "run", "tiny")) == 1


@pytest.mark.skipif(not HAS_WANDB, reason="wandb is not installed (pip install 'tclightning[loggers]')")
@pytest.mark.parametrize("folder", ["tb", "checkpoints"])
def test_a_wandb_logger_in_the_run_s_own_folders_is_refused(tmp_path, monkeypatch, folder):
    """W&B's offline files (and its links) in the run's tb/ or checkpoints/ made every later resume
    in place refuse the run; its default, the run folder itself, is fine."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    run = tmp_path / "run"
    (run / folder).mkdir(parents=True)
    entry = {"class_path": "wandb", "init_args": {"save_dir": str(run / folder)}}
    with pytest.raises(RecipeError, match=f"{folder} lies in the run's"):
        build_loggers([entry], run, "tiny")
    assert len(build_loggers(["wandb"], run, "tiny")) == 1
    # another run's folders too: its next resume would meet W&B's files there
    from tclightning.run import RUN_MARKER

    (run / RUN_MARKER).write_text("")
    with pytest.raises(RecipeError, match=f"{folder} lies in the run's"):
        build_loggers([entry], tmp_path / "another-run", "tiny")


@pytest.mark.skipif(not HAS_MLFLOW, reason="mlflow is not installed (pip install 'tclightning[loggers]')")
@pytest.mark.parametrize("spelling", ["plain-path", "file-localhost", "file-127.0.0.1", "file-LOCALHOST-with-a-port",
                                      "percent-encoded", "environment", "null-uri-and-a-save-dir"])
def test_an_mlflow_store_in_the_run_s_own_folders_is_refused_before_it_is_written(tmp_path, monkeypatch, spelling):
    """Other spellings of the run's checkpoints/ passed the check, and the store was opened (and
    written into the run) before it: a refused resume left an mlruns folder in the run."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    store = run / "checkpoints" / "mlruns"
    uri = {"plain-path": str(store), "file-localhost": f"file://localhost{store}",
           "file-127.0.0.1": f"file://127.0.0.1{store}", "file-LOCALHOST-with-a-port": f"file://LOCALHOST:5000{store}",
           "percent-encoded": f"file:{str(store).replace('checkpoints', 'check%70oints')}",
           "environment": f"file:{store}", "null-uri-and-a-save-dir": None}[spelling]
    if spelling == "environment":
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    init_args = {"environment": {}, "null-uri-and-a-save-dir": {"tracking_uri": None, "save_dir": str(store)}}.get(
        spelling, {"tracking_uri": uri})
    if spelling == "null-uri-and-a-save-dir":  # MLflow then uses file:<save_dir>, whatever the variable says
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'elsewhere'}")
    entry = {"class_path": "mlflow", "init_args": init_args}
    with pytest.raises(RecipeError, match="lies in the run's"):
        build_loggers([entry], run, "tiny")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


@pytest.mark.skipif(not HAS_WANDB, reason="wandb is not installed (pip install 'tclightning[loggers]')")
@pytest.mark.parametrize("spelling", ["a-folder-named-like-a-url", "a-bind-mount", "none-and-WANDB_DIR",
                                      "a-bind-mount-of-the-run-s-parent"])
def test_a_wandb_folder_that_is_the_run_s_own_by_another_name_is_refused(tmp_path, monkeypatch, spelling):
    """W&B takes ``save_dir`` as a local folder whatever it spells: one holding ``://`` was not
    checked, and a bind mount of the run's checkpoints/ is that folder under another name."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    run = tmp_path / "run"
    (run / "checkpoints" / "x:").mkdir(parents=True)
    save_dir: str | None = None
    if spelling == "a-folder-named-like-a-url":
        save_dir = f"{run}/checkpoints/x://y"
    elif spelling == "none-and-WANDB_DIR":  # wandb.init takes WANDB_DIR then
        monkeypatch.setenv("WANDB_DIR", str(run / "checkpoints"))
    else:
        from tests.test_hostile_state import _bind_mount

        alias = tmp_path.parent / f"{tmp_path.name}-alias"
        if spelling == "a-bind-mount":
            _bind_mount(run / "checkpoints", alias)
            save_dir = str(alias / "wandb-files")
        else:  # the run's trajectory/ through the alias, a folder not made yet
            _bind_mount(tmp_path, alias)
            save_dir = str(alias / "run" / "trajectory" / "wandb-files")
    try:
        entry = {"class_path": "wandb", "init_args": {"save_dir": save_dir}}
        with pytest.raises(RecipeError, match="lies in the run's"):
            build_loggers([entry], run, "tiny")
    finally:
        if spelling.startswith("a-bind-mount"):
            subprocess.run(["umount", str(alias)], check=False)


@pytest.mark.parametrize("logger", ["CSVLogger", "TensorBoardLogger"])
def test_a_logger_pointed_at_the_run_s_folder_through_a_bind_mount_is_refused(tmp_path, logger):
    """Compared by real path only, a CSV or TensorBoard logger wrote into the run's trajectory/
    through a bind mount of the run (W&B's and MLflow's folders were already compared by identity)."""
    from tests.test_hostile_state import _bind_mount

    run = tmp_path / "run"
    (run / "trajectory").mkdir(parents=True)
    alias = tmp_path.parent / f"{tmp_path.name}-alias"
    _bind_mount(run, alias)
    try:
        for name in ("trajectory", ""):
            entry = {"class_path": f"lightning.pytorch.loggers.{logger}",
                     "init_args": {"save_dir": str(alias), "name": name, "version": ""}}
            with pytest.raises(RecipeError, match="the run's own folder"):
                build_loggers([entry], run, "tiny")
    finally:
        subprocess.run(["umount", str(alias)], check=False)


def test_a_logger_pointed_at_the_run_s_own_folders_is_refused(tmp_path):
    """A resume with a CSVLogger whose folder was the run directory replaced its metrics.csv: the
    rows of every step before the resume were gone."""
    run = tmp_path / "run"
    (run / "tb").mkdir(parents=True)
    (run / "metrics.csv").write_text("step\n0\n")
    for save_dir, name in ((run, ""), (run, "tb"), (run / "checkpoints", "")):
        for logger in ("CSVLogger", "TensorBoardLogger"):
            entry = {"class_path": f"lightning.pytorch.loggers.{logger}",
                     "init_args": {"save_dir": str(save_dir), "name": name, "version": ""}}
            with pytest.raises(RecipeError, match="is the run's own folder"):
                build_loggers([entry], run, "tiny")
    entry = {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(run), "name": "mine"}}
    assert len(build_loggers([entry], run, "tiny")) == 1  # a new version folder of its own
    assert (run / "metrics.csv").read_text() == "step\n0\n"
    # a fixed folder in the run that holds its earlier rows: a resume's logger replaced them
    (run / "extra").mkdir()
    (run / "extra" / "metrics.csv").write_text("step\n0\n")
    entry = {"class_path": "lightning.pytorch.loggers.CSVLogger",
             "init_args": {"save_dir": str(run), "name": "extra", "version": ""}}
    with pytest.raises(RecipeError, match="already holds files"):
        build_loggers([entry], run, "tiny")


def test_a_resume_refused_for_its_loggers_rewrites_no_record(run_root, capsys):
    """The record (recipe.yaml, and the earlier one kept beside it) was written before the loggers
    were built and refused: exit 2, yet the run's record said the refused recipe."""
    from tclightning.cli.main import main

    base = ["run", "--recipe", "tiny", *FAST, "trainer.val_every=0", "trainer.checkpoint_every=1"]
    assert main([*base, "trainer.steps=2", "--quiet"]) == 0
    (run_dir,) = (run_root / "tiny").iterdir()
    before = {p.name: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    own = "{class_path: lightning.pytorch.loggers.CSVLogger, init_args: {save_dir: " + str(run_dir) + ", name: '', version: ''}}"
    capsys.readouterr()
    assert main([*base, "trainer.steps=4", "grpo.lr=1e-4", f"logging.loggers=[tensorboard, csv, {own}]", "--quiet",
                 "--resume", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # no note of a kept record that is not kept
    assert len(err) == 1 and "is the run's own folder" in err[0], err
    assert {p.name: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


def test_a_resume_that_leaves_the_run_s_csv_out_is_refused(run_root, capsys):
    """Steps trained without rows (loggers=[tensorboard]) were past the last row for the next
    resume, which went back and trained over their checkpoints."""
    from tclightning.cli.main import main

    base = ["run", "--recipe", "tiny", *FAST, "trainer.val_every=0", "trainer.checkpoint_every=1"]
    assert main([*base, "trainer.steps=2", "--quiet"]) == 0
    (run_dir,) = (run_root / "tiny").iterdir()
    before = {p.name: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main([*base, "trainer.steps=4", "logging.loggers=[tensorboard]", "--quiet", "--resume", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "keep csv in logging.loggers" in err[0], err
    assert {p.name: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


def test_class_path_logger_logs_every_step(run_root):
    from tclightning.run import run

    entry = "{class_path: lightning.pytorch.loggers.CSVLogger, init_args: {save_dir: extra, name: mine}}"
    summary = run("tiny", [*FAST, "trainer.steps=3", f"logging.loggers=[tensorboard, csv, {entry}]"], quiet=True)
    files = list((run_root.parent / "extra" / "mine").glob("version_*/metrics.csv"))
    assert len(files) == 1 and "reward/mean" in files[0].read_text().splitlines()[0]
    assert (Path(summary["run_dir"]) / "metrics.csv").is_file()  # the run's own CSV is still there


def test_a_logger_passed_with_the_callbacks_logs(run_root):
    from lightning.pytorch.loggers import CSVLogger

    from tclightning.run import run

    run("tiny", [*FAST, "trainer.steps=2"], quiet=True, extra_callbacks=[CSVLogger(str(run_root.parent / "py"))])
    assert list((run_root.parent / "py").rglob("metrics.csv"))


@pytest.mark.skipif(not HAS_WANDB, reason="wandb is not installed (pip install 'tclightning[loggers]')")
def test_wandb_offline(run_root, monkeypatch):
    from tclightning.run import run

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(run_root.parent / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(run_root.parent / "wandb-cache"))
    summary = run("tiny", [*FAST, "trainer.steps=3", "logging.loggers=[wandb]"], quiet=True)
    runs = list((Path(summary["run_dir"]) / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


@pytest.mark.skipif(not HAS_MLFLOW, reason="mlflow is not installed (pip install 'tclightning[loggers]')")
def test_mlflow_local_file_store(run_root, monkeypatch):
    from mlflow.tracking import MlflowClient

    from tclightning.run import run

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")  # recorded, so the run's setdefault is undone after
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    summary = run("tiny", [*FAST, "trainer.steps=3", "logging.loggers=[mlflow]"], quiet=True)
    run_dir = Path(summary["run_dir"])
    client = MlflowClient(tracking_uri=f"file:{run_dir.parent / 'mlruns'}")
    experiment = client.get_experiment_by_name("tiny")
    (found,) = client.search_runs([experiment.experiment_id])
    assert found.info.run_name == run_dir.name
    history = client.get_metric_history(found.info.run_id, "reward/mean")
    assert sorted(m.step for m in history) == [0, 1, 2]


@pytest.mark.skipif(not HAS_MLFLOW, reason="mlflow is not installed (pip install 'tclightning[loggers]')")
@pytest.mark.parametrize("scheme", ["file:", ""], ids=["file-uri", "plain-path"])
def test_mlflow_file_store_the_recipe_names(run_root, monkeypatch, scheme):
    """A ``tracking_uri`` naming a local store is a file store too (MLflow refuses one unless
    allowed)."""
    from mlflow.tracking import MlflowClient

    from tclightning.run import run

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")  # recorded, so the run's setdefault is undone after
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    store = run_root.parent / "my-store"
    entry = f"{{class_path: mlflow, init_args: {{tracking_uri: '{scheme}{store}'}}}}"
    summary = run("tiny", [*FAST, "trainer.steps=2", f"logging.loggers=[{entry}]"], quiet=True)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # this test's own read (the run's opt-out was the run's)
    client = MlflowClient(tracking_uri=f"file:{store}")
    (found,) = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    assert found.info.run_name == Path(summary["run_dir"]).name


@pytest.mark.skipif(not HAS_MLFLOW, reason="mlflow is not installed (pip install 'tclightning[loggers]')")
@pytest.mark.parametrize("store", ["damaged-experiment", "database-uri"])
def test_an_mlflow_store_mlflow_cannot_use_is_one_line_before_training(run_root, monkeypatch, capsys, store):
    """A file store whose experiment record is not a mapping, or a database URI without its driver,
    ended the run in MLflow's traceback once training started."""
    from tclightning.cli.main import main

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    damaged = run_root.parent / "store"
    (damaged / "0").mkdir(parents=True)
    (damaged / "0" / "meta.yaml").write_text("mine\n")
    uri = f"file:{damaged}" if store == "damaged-experiment" else f"sqlite:///{run_root.parent / 'runs.db'}"
    entry = f"{{class_path: mlflow, init_args: {{tracking_uri: '{uri}'}}}}"
    capsys.readouterr()
    assert main(["run", "--recipe", "tiny", *FAST, "trainer.steps=1", f"logging.loggers=[{entry}]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "Traceback" not in "\n".join(err) and "logging.loggers[0]" in err[-1] \
        and "MLflow cannot" in err[-1], err


@pytest.mark.skipif(not HAS_WANDB, reason="wandb is not installed (pip install 'tclightning[loggers]')")
def test_wandb_without_a_key_and_not_offline_is_one_line(run_root, monkeypatch, capsys):
    from tclightning.cli.main import main

    for name in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(run_root.parent / "no-netrc"))
    capsys.readouterr()
    assert main(["run", "--recipe", "tiny", *FAST, "trainer.steps=1", "logging.loggers=[wandb]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "logging.loggers[0]" in err[0] and "no API key" in err[0], err
    assert not run_root.exists()


def test_a_netrc_that_is_a_fifo_is_no_key_and_is_never_opened(tmp_path, monkeypatch):
    """W&B's key lookup reads the netrc only when it is a small regular file: a FIFO there (at
    ``$NETRC`` or ``~/.netrc``) would be waited on without end."""
    import threading

    from tclightning.recipes.loader import wandb_can_log

    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai login user password k3y\n")
    monkeypatch.setenv("NETRC", str(netrc))
    assert wandb_can_log({})
    netrc.unlink()
    os.mkfifo(netrc)
    answers: list[bool] = []
    for env in ({"NETRC": str(netrc)}, {"NETRC": "", "HOME": str(tmp_path)}):
        if env.get("HOME"):
            os.mkfifo(tmp_path / ".netrc")
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        asker = threading.Thread(target=lambda: answers.append(wandb_can_log({})), daemon=True)
        asker.start()
        asker.join(60)  # a stat and no open: at once on any machine; the FIFO's open would never return
        assert not asker.is_alive(), f"waited on the FIFO at {env}"
    assert answers == [False, False]


@pytest.mark.timeout(120)  # a regression waits on the server: fail instead
def test_a_checkpoint_callback_whose_remote_dirpath_never_answers_is_refused(run_root, monkeypatch, capsys):
    """A recipe's ModelCheckpoint writing to a server that never answers was waited on without end
    (Lightning asks its dirpath at setup); it is one line, and the run folder goes with nothing in it."""
    import socket

    import tclightning.network
    from tclightning.cli.main import main

    monkeypatch.setattr(tclightning.network, "REMOTE_SETUP_S", 1.0)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        url = f"http://127.0.0.1:{server.getsockname()[1]}/checkpoints"
        callback = f"callbacks=[{{class_path: lightning.pytorch.callbacks.ModelCheckpoint, init_args: {{dirpath: '{url}'}}}}]"
        assert main(["run", "--recipe", "tiny", *FAST, "trainer.steps=1", callback, "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and f"dirpath {url} gave no answer within 1 s" in err[-1], err
    assert not any((run_root / "tiny").glob("*/checkpoints/*"))


@pytest.mark.skipif(importlib.util.find_spec("s3fs") is not None, reason="s3fs is installed: the store opens")
def test_a_logger_store_fsspec_cannot_open_is_one_line(tmp_path):
    """A store whose package is missing was an ImportError traceback from the logger's constructor,
    and a folder whose name spells a protocol fsspec does not know a traceback at the first write."""
    entry = {"class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": {"save_dir": "s3://bucket/tb"}}
    with pytest.raises(RecipeError, match=r"logging\.loggers\[0\]\.init_args.*cannot open its store: ImportError: "
                                          "Install s3fs"):
        build_loggers([entry], tmp_path / "run", "tiny")
    entry = {"class_path": "lightning.pytorch.loggers.CSVLogger",
             "init_args": {"save_dir": str(tmp_path / "mine"), "name": "file:///tmp/x"}}
    with pytest.raises(RecipeError, match=r"logging\.loggers\[0\]\.init_args.*not a folder a logger or checkpoint can "
                                          "write"):
        build_loggers([entry], tmp_path / "run", "tiny")


@pytest.mark.timeout(60)  # a regression sleeps out the stall: fail instead
def test_each_call_of_a_logger_writing_to_a_remote_store_has_a_time_limit(tmp_path, monkeypatch):
    """After the setup, a store that answers a byte at a time, or one whose library sets no request
    limit (webhdfs, ftp), held a logger's call for ever: each call it makes has a limit in all."""
    import time

    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    import tclightning.logging as logging_module
    from tclightning.errors import TclightningError
    from tclightning.logging import ask_remote_stores

    monkeypatch.setattr(logging_module, "REMOTE_CALL_S", 0.5)
    logger = CSVLogger(save_dir="memory://bounded-logs")
    trainer = pl.Trainer(logger=logger, default_root_dir=str(tmp_path), enable_progress_bar=False,
                         enable_model_summary=False)
    ask_remote_stores(trainer)
    assert logger.log_metrics.remote_call_bounded
    ask_remote_stores(trainer)  # asked again (a recipe's loggers, then the trainer's): bounded once
    stalled = logger.log_metrics.__defaults__  # noqa: F841 - the wrapper keeps the method it bounds
    monkeypatch.setattr(logger.experiment, "log_metrics", lambda *args, **kwargs: time.sleep(30))
    started = time.monotonic()
    with pytest.raises(TclightningError, match="memory://bounded-logs.*gave no answer within 0.5 s"):
        logger.log_metrics({"reward/mean": 1.0}, step=0)
    assert time.monotonic() - started < 10


@pytest.fixture
def read_only_server(tmp_path) -> Iterator[str]:
    """A plain http server over an empty folder: it answers every read and takes no files."""
    import functools
    import threading
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    (tmp_path / "served").mkdir()
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(tmp_path / "served")))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.parametrize("writer", ["csv", "tensorboard", "checkpoint"])
def test_a_remote_store_that_takes_no_files_is_one_line_before_the_fit(writer, read_only_server, tmp_path, capsys):
    """A plain http server answers the logger's setup: a CSV logger's first write (its
    hyper-parameters) was a traceback, a TensorBoard writer's thread printed one, and a checkpoint
    callback would fail after the first steps. A file is written there, and removed, first."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    from tclightning.errors import TclightningError
    from tclightning.logging import ask_remote_stores

    store = f"{read_only_server}/logs"
    logger = {"csv": CSVLogger(save_dir=store), "tensorboard": TensorBoardLogger(save_dir=store)}.get(writer, False)
    callbacks = [ModelCheckpoint(dirpath=store)] if writer == "checkpoint" else []
    trainer = pl.Trainer(logger=logger, callbacks=callbacks, default_root_dir=str(tmp_path), enable_progress_bar=False,
                         enable_model_summary=False)
    with pytest.raises(TclightningError, match=f"{store}.* cannot be written: NotImplementedError"):
        ask_remote_stores(trainer)
    assert "Traceback" not in capsys.readouterr().err


def test_a_remote_store_that_takes_files_keeps_none_of_the_check_s(tmp_path):
    import fsspec
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    from tclightning.logging import ask_remote_stores

    trainer = pl.Trainer(logger=CSVLogger(save_dir="memory://checked-logs"), default_root_dir=str(tmp_path),
                         enable_progress_bar=False, enable_model_summary=False)
    ask_remote_stores(trainer)
    store = fsspec.filesystem("memory")
    assert not [path for path in store.find("/checked-logs") if "write-check" in path]


def test_a_remote_store_that_fails_a_logger_s_call_is_one_line(tmp_path, monkeypatch):
    """A store that took the check's file and then keeps none (an ftp server answering every command
    with success): Lightning's "Missing folder" at the first hyper-parameters was a traceback."""
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    from tclightning.errors import TclightningError
    from tclightning.logging import ask_remote_stores

    logger = CSVLogger(save_dir="memory://forgetful-logs")
    trainer = pl.Trainer(logger=logger, default_root_dir=str(tmp_path), enable_progress_bar=False,
                         enable_model_summary=False)
    ask_remote_stores(trainer)

    def forgotten(params):
        raise RuntimeError("Missing folder: memory://forgetful-logs/lightning_logs/version_0.")

    monkeypatch.setattr(logger.experiment, "log_hparams", forgotten)
    with pytest.raises(TclightningError, match="memory://forgetful-logs.* failed: RuntimeError: Missing folder"):
        logger.log_hyperparams({"lr": 1e-3})


def test_a_remote_folder_s_write_check_removes_only_its_own_file(tmp_path):
    """The check's file was named after the process (a file of yours of that name was written over
    and removed) and removed by ``rm``, which read ``[ab]`` in a folder's name as a pattern: ``ua``'s
    file went, the check's stayed."""
    import fsspec

    from tclightning.logging import _takes_a_file

    store = fsspec.filesystem("memory")
    for folder in ("/u[ab]", "/ua"):
        store.pipe(f"{folder}/.tclightning-write-check-{os.getpid()}", b"yours")
    _takes_a_file("memory://u[ab]")
    assert sorted(store.find("/ua") + store.find("/u[ab]")) == sorted(
        [f"/u[ab]/.tclightning-write-check-{os.getpid()}", f"/ua/.tclightning-write-check-{os.getpid()}"])


@pytest.mark.timeout(60)  # a regression sleeps out the stall: fail instead
def test_every_writer_into_a_remote_store_has_a_time_limit_once_any_store_is_remote(tmp_path, monkeypatch):
    """With only the logger's folder remote, LightningCLI's config writer and Lightning's default
    checkpoint callback (which write into it), an exception checkpoint's and a profiler's remote
    folders were waited on without end (webhdfs sets no request limit)."""
    import time

    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.profilers import SimpleProfiler

    import fsspec
    import tclightning.logging as logging_module
    from tclightning.errors import TclightningError
    from tclightning.logging import ask_remote_stores

    monkeypatch.setattr(logging_module, "REMOTE_CHECKPOINT_S", 0.5)
    on_exception, checkpoint = OnExceptionCheckpoint(dirpath="memory://on-exception"), ModelCheckpoint()
    trainer = pl.Trainer(logger=CSVLogger(save_dir="memory://remote-logs"), callbacks=[on_exception, checkpoint],
                         profiler=SimpleProfiler(dirpath="memory://profiles", filename="p"),
                         default_root_dir=str(tmp_path), enable_progress_bar=False, enable_model_summary=False)
    ask_remote_stores(trainer)
    store = fsspec.filesystem("memory")
    assert store.isdir("/on-exception") and store.isdir("/profiles")  # asked, and a file written there
    for bounded in (checkpoint.setup, checkpoint.on_train_batch_end, on_exception.on_exception,
                    trainer.profiler.describe):  # the checkpoint's folder: the logger's, at setup
        assert bounded.remote_call_bounded
    monkeypatch.setattr(checkpoint, "setup", lambda *args: time.sleep(30))
    ask_remote_stores(trainer)  # bounded again, the stall within
    started = time.monotonic()
    with pytest.raises(TclightningError, match="ModelCheckpoint writes to gave no answer within 0.5 s"):
        checkpoint.setup(trainer, None, "fit")
    assert time.monotonic() - started < 10


def test_w_and_b_that_never_finishes_sending_is_one_line_not_a_wait_at_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    """At the interpreter's exit W&B waits for its service to send the run without a limit: a
    server that took the run and then dripped held the finished command for ever. Its runs are
    finished within a time limit instead, and past it the command says so."""
    import sys
    import threading
    from types import SimpleNamespace

    import tclightning.logging as logging_module
    from tclightning.logging import finish_wandb

    released = threading.Event()
    fake = SimpleNamespace(sdk=SimpleNamespace(wandb_setup=SimpleNamespace(_singleton=object())),
                           teardown=lambda: released.wait(60))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    ended: list[bool] = []  # (the real one would end this process's own W&B service, an earlier test's)
    monkeypatch.setattr(logging_module, "_end_wandb_service", lambda: ended.append(True))
    try:
        late = finish_wandb(limit_s=0.5)
    finally:
        released.set()
    assert late is not None and late.startswith("W&B did not finish sending the run to its server within 0.5 s")
    assert ended == [True]
    fake.teardown = lambda: None
    assert finish_wandb(limit_s=0.5) is None
    fake.sdk.wandb_setup._singleton = None  # W&B imported, no run: nothing waited for
    fake.teardown = lambda: pytest.fail("no run: nothing to finish")
    assert finish_wandb(limit_s=0.5) is None


@pytest.mark.parametrize("writer", ["csv", "tensorboard"])
def test_hparams_go_into_the_folder_checked_whatever_its_name_leads_to(writer: str, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """hparams.yaml was written by name after the folder's check (TensorBoard's: with no check at
    all): a link swapped in between had someone's hparams.yaml replaced."""
    import tclightning.logging as logging_module
    from tclightning.logging import AtomicExperimentWriter, LayoutTensorBoardLogger

    folder, user = tmp_path / "run", tmp_path / "user"
    folder.mkdir()
    user.mkdir()
    (user / "hparams.yaml").write_text("mine")
    write = logging_module.write_hparams

    def swapped_then_written(path: Path, hparams: Any) -> None:
        folder.rename(tmp_path / "moved-away")
        folder.symlink_to(user)
        write(path, hparams)

    monkeypatch.setattr(logging_module, "write_hparams", swapped_then_written)
    if writer == "csv":
        AtomicExperimentWriter(log_dir=str(folder)).log_hparams({"lr": 0.1})
    else:
        logger = LayoutTensorBoardLogger(tmp_path, name="run", version="")
        logger.log_hyperparams({"lr": 0.1})
        logger.save()
    assert (user / "hparams.yaml").read_text() == "mine"
    assert "lr" in (tmp_path / "moved-away" / "hparams.yaml").read_text()
