"""The Python processes tclightning starts never import from the working folder: ``python -c``
and ``python -m`` put it first on the import path, where a ``json.py`` of a cloned repository
would run inside them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tclightning.processes import child_environment, safe_import_path

REPO = Path(__file__).resolve().parents[1]
SHADOWS = ("json", "resource", "tokenizers", "multiprocessing", "numpy", "yaml")


def _shadowing_modules(folder: Path) -> Path:
    """A module file in ``folder`` for each name a child imports, each leaving a marker if it runs."""
    marker = folder / "MARKER"
    for name in SHADOWS:
        (folder / f"{name}.py").write_text(f"open({str(marker)!r}, 'a').write({name!r} + '\\n')\n")
    return marker


@pytest.mark.skipif(sys.version_info < (3, 11), reason="PYTHONSAFEPATH is Python 3.11's")
def test_a_python_child_started_with_the_child_environment_ignores_the_working_folder(tmp_path: Path) -> None:
    marker = _shadowing_modules(tmp_path)
    command = [sys.executable, "-c", "import json, multiprocessing; print(json.dumps([1]))"]
    done = subprocess.run(command, cwd=tmp_path, env=child_environment(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[1]" and not marker.exists(), done.stderr
    bare = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    plain = subprocess.run(command, cwd=tmp_path, env=bare, capture_output=True, text=True, timeout=60)
    assert marker.exists(), plain  # what a bare `python -c` there does


def test_the_tokenizer_measure_runs_nothing_from_the_working_folder(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from tclightning.models.char_tokenizer import build_char_tokenizer
    from tclightning.sampling.base import measure_in_child

    marker = _shadowing_modules(tmp_path)
    monkeypatch.chdir(tmp_path)
    spec = build_char_tokenizer().backend_tokenizer.to_str()
    assert measure_in_child(spec, ["12+3", "7"], add_special_tokens=False) == [4, 1]
    assert not marker.exists()


@pytest.mark.skipif(sys.version_info < (3, 11), reason="PYTHONSAFEPATH is Python 3.11's")
def test_a_spawned_process_runs_nothing_from_the_working_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """multiprocessing's spawn (the reward workers, the benchmark ranks) starts ``python -c``."""
    import multiprocessing

    marker = _shadowing_modules(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONSAFEPATH", "")  # empty: unset, for Python; put back after the test
    process = multiprocessing.get_context("spawn").Process(target=os.getpid)
    with safe_import_path():
        process.start()
    process.join(120)
    assert process.exitcode == 0 and not marker.exists()
    assert os.environ["PYTHONSAFEPATH"] == ""  # put back as it was


def test_the_command_hands_the_safe_path_to_every_child(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The console command sets it for its process; ``main([...])`` from a program of yours puts the
    program's environment and standard streams back (it left ``PYTHONSAFEPATH=1`` for every
    ``python`` the program started later)."""
    from tclightning.cli.main import main

    console = ("import os, sys; os.environ['PYTHONSAFEPATH'] = ''; sys.argv = ['tclightning', 'recipes', 'list']\n"
               "from tclightning.cli.main import main\nmain(); print(repr(os.environ.get('PYTHONSAFEPATH')))")
    done = subprocess.run([sys.executable, "-c", console], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=tmp_path)
    assert done.stdout.strip().splitlines()[-1] == "'1'", done.stderr[-2000:]
    monkeypatch.setenv("PYTHONSAFEPATH", "")
    streams = sys.stdout, sys.stderr
    assert main(["recipes", "list"]) == 0
    assert os.environ.get("PYTHONSAFEPATH") == "" and (sys.stdout, sys.stderr) == streams


def test_a_launcher_pid_that_is_not_the_parent_is_one_line(tmp_path: Path) -> None:
    """A rank whose launcher is gone exits 1 at once: it said nothing, for every command."""
    from tclightning.processes import LAUNCHER_PID_ENV

    done = subprocess.run([sys.executable, "-m", "tclightning.cli.main", "recipes", "list"], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, LAUNCHER_PID_ENV: "12345678", "PYTHONPATH": str(REPO)})
    assert done.returncode == 1 and done.stderr.strip().splitlines() == [
        f"error: the process that started this one ({LAUNCHER_PID_ENV}=12345678) is no longer its parent; exiting"]
