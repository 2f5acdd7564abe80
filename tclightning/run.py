"""The ``run`` verb: recipe -> validated config -> ``Trainer.fit`` -> summary.

Everything that can fail on user input (recipe, overrides, callbacks, resume target) fails
before the run directory is created.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import re
import signal
import stat
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from tclightning.console import interrupts_held
from tclightning.errors import StorageError, TclightningError
from tclightning.files import (HeldFolder, SameFolder, by_descriptor, copy_file, forget_made_files, hold_lock,
                              made_file, own_file, own_folder, owned_identity, refused_by_storage, regular_file,
                              remove_tree, replace_file, replace_text, require_writable, storage_reason, tree,
                              unused_name)
from tclightning.health.io import METRICS_MAX_BYTES
from tclightning.logging import (RUN_FOLDER_FILES, RUN_FOLDERS, RUN_MARKER, ask_remote_stores,
                                 mlflow_logs_in_background, mlflow_tracking_uri)
from tclightning.network import remote_requests_bounded
from tclightning.pipeline.config import PipelineConfig
from tclightning.recipes.loader import (
    find_recipe,
    instantiate_callbacks,
    load_recipe,
    read_record,
    same_state_message,
    state_key_clash,
    to_dataclass,
    to_yaml,
    wandb_offline,
)
from tclightning.recipes.schema import RETIRED_KEYS, RecipeConfig, upgrade_sections

RUN_DIR_ENV = "TCLIGHTNING_RUN_DIR"
"""Multi-process runs: the run directory every rank uses (set by rank 0 before Lightning launches
the others; set it yourself on every node for torchrun / SLURM launches). Rank 0 refuses one that
holds an earlier run (:func:`require_run_dir_for_rank_0`)."""


RUN_FILES = (*RUN_FOLDERS, "recipe.yaml", "metrics.csv", "hparams.yaml", "summary.json", ".lock", RUN_MARKER,
             "tb/hparams.yaml")
"""What a resume in place writes in its run directory (each a file or folder of the run's own)."""

RECORD_MAX_BYTES = 2**26
"""The largest record file a resume reads back whole (a recipe or hyper-parameters are kilobytes)."""


@dataclass
class RunPlan:
    """Where a run writes and what it resumes from (decided before anything is written)."""

    run_dir: Path
    ckpt_path: Path | None
    resume_step: int | None
    notices: tuple[str, ...] = ()  # one line each for the user, printed before training
    new_dir: bool = True  # run_dir is created by this run (not an earlier run's, resumed in place)


def _modified_or_never(path: Path) -> float:
    """``path``'s modification time; -inf for one gone since it was listed (a run pruning its step
    files while ``--resume last`` looks: a FileNotFoundError traceback)."""
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return float("-inf")


def plan_run(recipe: RecipeConfig, resume: str | None) -> RunPlan:
    """Decide where the run writes and which checkpoint it continues from; reads, never writes.

    ``resume``: ``None`` (a fresh run), ``"last"`` (the run directory under
    ``<logging.root>/<name>`` with the newest checkpoint; a run folder that is a link is never
    picked), a run directory, or a checkpoint file. The checkpoint is ``last.ckpt`` or, when that is
    unreadable or past the rows of ``metrics.csv``, the newest readable ``step-*.ckpt`` beside it
    that ``metrics.csv`` reaches (with a notice). The run continues in
    place only when the checkpoint is ``<run_dir>/checkpoints/<file>`` and ``run_dir`` holds
    :data:`RUN_MARKER`; any other checkpoint starts a new run directory under ``logging.root``
    that continues from it, and nothing beside the checkpoint is touched. Raises
    ``TclightningError`` for a missing, unreadable or refused checkpoint.
    """
    root = Path(recipe.logging.root).expanduser() / (recipe.logging.name or recipe.name)
    if resume is None:
        return RunPlan(new_run_dir(root), None, None)
    if resume == "last":
        # the run folders themselves: a link among them is someone's pointer elsewhere, never "the last run"
        files = [p for p in root.glob("*/checkpoints/*.ckpt") if p.is_file()
                 and not p.parent.parent.is_symlink() and not p.parent.is_symlink()]
        if not files:
            raise TclightningError(f"--resume last: no checkpoint under {root}/*/checkpoints/")
        newest = max(files, key=_modified_or_never).parent
        requested = newest / "last.ckpt"
    else:
        requested = Path(resume).expanduser()
        if requested.is_dir():
            requested = requested / "checkpoints" / "last.ckpt"
        if not requested.is_file() and not (requested.name == "last.ckpt" and requested.parent.is_dir()):
            raise TclightningError(f"--resume: no such checkpoint: {requested}")
    # the run folder as the path you gave leads to it now (a link to your run folder is that folder,
    # whose own entries a resume in place never follows: checked below)
    requested = requested.absolute()  # a bare name is in the working folder (its parent's name is "")
    requested = Path(os.path.realpath(requested.parent.parent)) / requested.parent.name / requested.name
    run_dir = requested.parent.parent
    in_place = requested.parent.name == "checkpoints" and (run_dir / RUN_MARKER).is_file() and _own_file(requested)
    if in_place:
        require_readable_rows(run_dir / "metrics.csv")
    ckpt, step, notices = readable_checkpoint(requested, _last_logged_step(run_dir / "metrics.csv") if in_place else None)
    if in_place:
        for path in _run_entries(run_dir):  # a link would carry the resume's writes out of the run directory
            if path.is_symlink():
                raise TclightningError(f"--resume: {path} is a symbolic link; a resume in place writes "
                                       "only the run's own files, so nothing was written (start a new run from "
                                       "the checkpoint: copy it out of the run directory)")
            if not path.exists() or path.relative_to(run_dir).as_posix() not in RUN_FILES:
                continue
            if path.name in RUN_FOLDERS and not path.is_dir():
                raise TclightningError(f"--resume: {path} is not a folder, where the run keeps its {path.name}; "
                                       "nothing was written (move it away to resume)")
            if path.name not in RUN_FOLDERS:  # the run writes it: a FIFO would block, 8 GiB of rows fill memory
                regular_file(path, "--resume: the run's own file",
                             METRICS_MAX_BYTES if path.name == "metrics.csv" else RECORD_MAX_BYTES)
        return RunPlan(run_dir, ckpt, step, notices, new_dir=False)
    fresh = new_run_dir(root)
    return RunPlan(fresh, ckpt, step, (*notices, _new_dir_note(ckpt, fresh)))


def _run_entries(run_dir: Path) -> list[Path]:
    """The paths a resume in place may write: :data:`RUN_FILES`, and everything inside its
    :data:`RUN_FOLDERS` (a link is listed, never followed)."""
    entries = [run_dir / name for name in RUN_FILES]
    for name in RUN_FOLDERS:
        folder = run_dir / name
        if folder.is_dir() and not folder.is_symlink():
            entries += tree(folder)
    return entries


def _own_file(ckpt: Path) -> bool:
    """Whether ``ckpt`` is a file of its own ``checkpoints/`` folder, not a link to another run's
    (a resume in place rewrites the folder the file really lies in)."""
    try:
        return ckpt.resolve().parent.samefile(ckpt.parent)
    except OSError:
        return False


def _new_dir_note(ckpt: Path, fresh: Path) -> str:
    """The notice of a resume from a checkpoint outside a run directory (the plan's last notice)."""
    return (f"{ckpt} is not inside a run directory tclightning created; continuing from it in a new "
            f"run directory {fresh} (nothing beside the checkpoint is touched)")


def new_run_dir(root: Path) -> Path:
    """``root/<timestamp>`` (suffixed ``-1``, ``-2``... when taken); not created here: a plan only
    names it, and :func:`mark_run_dir` claims it (or the next free suffix, when another run started
    in the same second took it in between)."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir, n = root / stamp, 1
    while run_dir.exists():
        run_dir, n = root / f"{stamp}-{n}", n + 1
    return run_dir


# A name new_run_dir picks: the timestamp, then an optional -N suffix.
_RUN_NAME = re.compile(r"(\d{8}-\d{6})(?:-(\d+))?")


def claim_run_dir(planned: Path) -> Path:
    """Create ``planned`` (a name from :func:`new_run_dir`) and return it; when it exists by now
    (another run took the name since it was planned), the next free suffix of the same timestamp
    instead. Each try is one ``mkdir`` that fails if the name exists, so two runs never share a
    directory, however close together they start."""
    match = _RUN_NAME.fullmatch(planned.name)
    stamp, n = (match.group(1), int(match.group(2) or 0) + 1) if match else (planned.name, 1)
    planned.parent.mkdir(parents=True, exist_ok=True)
    run_dir = planned
    while True:
        try:
            run_dir.mkdir(exist_ok=False)
            return run_dir
        except FileExistsError:
            run_dir, n = planned.parent / f"{stamp}-{n}", n + 1


def readable_checkpoint(requested: Path, bound: int | None = None) -> tuple[Path, int, tuple[str, ...]]:
    """``(checkpoint, its RL step, notices)``: ``requested`` if it reads; for an unreadable
    (missing, truncated, corrupted; not refused) ``last.ckpt``, the newest readable ``step-S.ckpt`` beside it
    with ``S`` at most one past ``bound``, the last row of its run's ``metrics.csv`` (older runs' files past
    a resume point hold another history). Raises ``TclightningError`` when there is none.

    With a ``bound``, a checkpoint past it belongs to a history a resume from an earlier step has
    replaced (its rows are gone, and continuing it would leave a gap in ``metrics.csv``): a
    ``last.ckpt`` there falls back like an unreadable one, any other file is refused."""
    from tclightning.callbacks.checkpointing import STEP_FILE, CheckpointRefused

    try:
        step = checkpoint_step(requested)
    except CheckpointRefused:
        raise  # a crafted file is a reason to stop, not to quietly resume from another one
    except TclightningError as err:
        if requested.name != "last.ckpt":
            raise
        failure, why = err, "missing" if not requested.exists() else "unreadable"
    else:
        if bound is None or step <= bound + 1:
            return requested, step, ()
        failure, why = TclightningError(
            f"--resume: {requested} is at step {step}, past the last row of metrics.csv (step {bound}): a resume "
            "from an earlier step replaced that history"), "past the last row of metrics.csv"
        if requested.name != "last.ckpt":
            raise TclightningError(f"{failure}; resume from a checkpoint at step {bound + 1} or earlier")
    steps = [(int(path.name[5:-5]), path) for path in requested.parent.glob("step-*.ckpt")
             if STEP_FILE.fullmatch(path.name)]
    for step_in_name, path in sorted(steps, reverse=True):
        if bound is not None and step_in_name > bound + 1:
            continue
        try:
            step = checkpoint_step(path)
        except CheckpointRefused:
            raise
        except TclightningError:
            continue
        return path, step, (f"{requested} is {why}; resuming from {path.name} (step {step}), the newest "
                            "readable step checkpoint",)
    raise TclightningError(f"{failure}; and no readable step-*.ckpt beside it to fall back to") from None


def require_readable_rows(metrics: Path) -> None:
    """Refuse (one line) to resume a run whose ``metrics.csv`` its rows cannot be continued from: no
    ``step`` column (a byte-order mark or a spreadsheet's separator moved it), a damaged row, a step
    that is no whole number. The resume rewrote such a file keeping none of its rows, or trained a
    step and then ended in a traceback. A last row a crash cut short is dropped by the resume, as
    ever."""
    from tclightning.health.io import read_metrics_csv

    if metrics.is_file():
        try:
            read_metrics_csv(metrics, cut_last_row=True)
        except TclightningError as err:
            raise TclightningError(f"--resume: {err}; the resume continues the rows of metrics.csv: put the file "
                                   "right (or move it away) and resume again; nothing was written") from None


def _last_logged_step(metrics: Path) -> int | None:
    """The largest ``step`` in a ``metrics.csv`` (``None`` when there is no such file, no row, or
    the file cannot be read: then no step file is ruled out)."""
    import csv

    from tclightning.grpo.summary import read_metrics

    if not metrics.is_file():
        return None
    try:
        return max(read_metrics(metrics), default=None)
    except (OSError, KeyError, ValueError, csv.Error, UnicodeDecodeError, TclightningError):
        return None


def checkpoint_step(path: Path) -> int:
    """The number of completed RL steps recorded in a tclightning checkpoint, read as data only
    (``load_checkpoint``); ``TclightningError`` for an unreadable, refused or foreign file."""
    from tclightning.callbacks.checkpointing import CheckpointRefused, load_checkpoint

    try:
        ckpt = load_checkpoint(path, map_location="meta")
    except TclightningError as err:
        raise type(err)(f"--resume: {err}") from None
    state = ckpt.get("tclightning")
    step = state.get("rl_step") if isinstance(state, dict) else None
    if type(step) is not int or step < 0:  # a bool is an int to isinstance
        # it read whole, so it is not damaged: someone else's file, which no older file may replace
        raise CheckpointRefused(f"--resume: {path} is not a tclightning checkpoint (no RL step recorded); "
                                "nothing was loaded")
    try:  # the step Lightning's loops restore (the step the checkpoint was written at)
        fit_loop = ckpt["loops"]["fit_loop"]
        total = fit_loop["epoch_loop.batch_progress"]["total"]
        looped = total["processed"]
        counted = (total["ready"], total["started"], total["completed"])
        stepped = fit_loop["epoch_loop.state_dict"]["_batches_that_stepped"]
    except (KeyError, TypeError):
        looped, counted, stepped = None, None, None
    # a resume would misalign the run's rows with its steps, or drop them; the batch of the step
    # is completed or not yet (a checkpoint of the end of training, or of its batch's end), and
    # the step counter Lightning logs by (`_batches_that_stepped`) counts the completed batches
    if (looped != step or counted not in ((step, step, step), (step, step, step - 1))
            or type(stepped) is not int or stepped != counted[2]):
        raise CheckpointRefused(f"--resume: {path} records RL step {step} but its training loops are at "
                                f"{looped!r} (ready, started, completed: {counted!r}; batches stepped: {stepped!r}): "
                                "not a checkpoint tclightning wrote; nothing was loaded")
    return step


RESUME_FIXED = ("model", "task", "pipeline", "anchor", "sampler.group_size", "trainer.strategy", "trainer.devices",
                "trainer.num_nodes", "trainer.seed")
"""What a resumed run keeps from its first part: a checkpoint of another model, codec layout or
strategy cannot continue the same run (other keys, a learning rate say, may change)."""

RESUME_RETIRED = RETIRED_KEYS
"""Keys an earlier version's record may hold that no option reads now (each section's
``RETIRED_KEYS``; a moved key's value is compared where it lives now): left out of the comparison,
so a run recorded with them resumes."""


def resume_changes(run_dir: Path, cfg: DictConfig, resume_step: int, ckpt: Path | None = None) -> tuple[str, ...]:
    """Compare the run's record ``recipe.yaml`` with the recipe a resume in place would run.

    Raises ``TclightningError`` (one line, before anything is written) when a key of
    :data:`RESUME_FIXED` differs; returns the other changed keys, for which the earlier record is
    kept as ``recipe.before-step-<S>.yaml`` (``trainer.steps`` aside: extending a run is what a
    resume is for). A run without a readable record is compared with the hyper-parameters of
    its checkpoint ``ckpt`` instead (:func:`checkpoint_changes`), and returns ()."""
    before = read_record(run_dir / "recipe.yaml")
    if before is None:
        if ckpt is not None:
            checkpoint_changes(ckpt, cfg, resume_step)
        return ()
    # an earlier version's record in today's keys: a moved key's value is compared where it lives now
    return _changed_keys(_leaves(upgrade_sections(before)), _leaves(OmegaConf.to_container(cfg)), f"in {run_dir}",
                         resume_step)


def checkpoint_changes(ckpt: Path, cfg: DictConfig, resume_step: int) -> None:
    """Refuse (``TclightningError``, one line) a recipe that changes a key of :data:`RESUME_FIXED`
    that the checkpoint's hyper-parameters record (the model, task, anchor, group size, seed): a
    resume from a checkpoint outside its run directory, or from a run without its record."""
    from tclightning.callbacks.checkpointing import load_checkpoint

    saved = load_checkpoint(ckpt, map_location="meta").get("hyper_parameters")
    if not isinstance(saved, dict):
        return
    record = {section: saved[section] for section in ("model", "task", "sampler", "anchor") if section in saved}
    if "seed" in saved:
        record["trainer"] = {"seed": saved["seed"]}
    old_leaves = _leaves(upgrade_sections(record))
    new_leaves = {key: value for key, value in _leaves(OmegaConf.to_container(cfg)).items()
                  if key in old_leaves or key.split(".", 1)[0] in record and key != "trainer.steps"
                  and not key.startswith("trainer.")}
    _changed_keys(old_leaves, new_leaves, f"of {ckpt}", resume_step)


def require_the_run_s_rows(run_dir: Path, recipe: RecipeConfig) -> None:
    """A run that keeps ``metrics.csv`` keeps it through every resume: a later resume reads its
    last row to tell which checkpoints are this run's history, and would go back past steps that
    have none, training over their checkpoints. ``TclightningError`` (one line) otherwise."""
    from tclightning.logging import own_loggers

    if (run_dir / "metrics.csv").is_file() and "csv" not in own_loggers(recipe.logging.loggers):
        raise TclightningError(f"--resume: {run_dir} records its steps in metrics.csv, which a resume reads to tell "
                               "its checkpoints from those of a replaced history; logging.loggers leaves csv out, so "
                               "the steps of this resume would have no rows and a later resume would train over "
                               "them: keep csv in logging.loggers; nothing was written")


def _changed_keys(old_leaves: dict[str, Any], new_leaves: dict[str, Any], where: str, resume_step: int) -> tuple[str, ...]:
    changed = [key for key in sorted(old_leaves.keys() | new_leaves.keys())
               if old_leaves.get(key, _MISSING) != new_leaves.get(key, _MISSING) and key != "trainer.steps"
               and not (key in RESUME_RETIRED and key not in new_leaves)]
    for key in changed:
        if any(key == fixed or key.startswith(fixed + ".") for fixed in RESUME_FIXED):
            old, new = old_leaves.get(key, "unset"), new_leaves.get(key, "unset")
            raise TclightningError(
                f"--resume: key '{key}' was {old!r} for the {resume_step} steps {where}, the recipe now says "
                f"{new!r}: a resumed run keeps its {', '.join(RESUME_FIXED)} (start a new run for the change)")
    return tuple(changed)


_MISSING = object()


def _leaves(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict):
        out: dict[str, Any] = {}
        for key, value in data.items():
            out.update(_leaves(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): data}


def mark_run_dir(run_dir: Path, recipe: RecipeConfig, new: bool = False,
                 locked: tuple[int, int] | None = None) -> Path:
    """Create ``run_dir`` with its :data:`RUN_MARKER` (kept if there already); returns the directory.

    ``new``: ``run_dir`` is a planned new run directory, claimed with :func:`claim_run_dir` (the
    returned directory is then the one this run got, a later suffix if the planned name was
    taken meanwhile). Otherwise ``run_dir`` may exist already (a resume in place, a launched rank).
    ``locked``: a resume's run folder as it locked it (``(st_dev, st_ino)``): another folder at
    its name now is refused, one line, nothing written (it would be resumed instead).
    """
    made = new or not run_dir.exists()
    if made:
        forget_made_files()  # the files this run makes from here on are its own (an earlier run's are not)
    if new:
        run_dir = claim_run_dir(run_dir)
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
    # it and its checkpoints/ are taken as they are now: their writers check they still are, so a
    # link put in place of either (at once, or later) stops the run instead of carrying its writes
    own_folder(run_dir, made=made)
    if locked is not None and owned_identity(run_dir) != locked:
        raise TclightningError(f"--resume: {run_dir} changed while this resume started (another folder was put at its "
                               "name); nothing was written, run the resume again")
    try:
        held = HeldFolder(run_dir)
    except OSError:
        SameFolder(run_dir).check()  # a link put in its place since: one line
        raise
    with held:
        marker = held.path / RUN_MARKER
        if not marker.exists():
            try:
                with own_file(marker, "x") as written:
                    written.write(f"tclightning run directory (recipe {recipe.name}); --resume may write here\n")
            except OSError:
                if new:  # the directory this run just claimed holds nothing else
                    marker.unlink(missing_ok=True)
                    held.remove_at(run_dir)
                raise
        for folder in ("checkpoints", "tb"):  # the run's own, made with it (trajectory/: at its first point)
            try:
                (held.path / folder).mkdir(exist_ok=True)
            except FileExistsError:
                raise TclightningError(f"{run_dir / folder} is not a folder (a file of yours?), where the run keeps its "
                                       f"{folder}; nothing was written there") from None
            own_folder(run_dir / folder)
    return run_dir


RANK_ENV = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK")
"""The global rank each launcher sets (torchrun, SLURM, MPI); Lightning's own ranks have
``NODE_RANK`` and ``LOCAL_RANK`` instead."""


def launch_rank(recipe: RecipeConfig) -> int:
    """This process's global rank in a multi-process run, from what its launcher set; 0 for the
    process a user started (the one that launches Lightning's other ranks)."""
    for name in RANK_ENV:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    local, node = (os.environ.get(name, "0") for name in ("LOCAL_RANK", "NODE_RANK"))
    return (int(node) if node.isdigit() else 0) * recipe.trainer.devices + (int(local) if local.isdigit() else 0)


def require_run_dir_for_rank_0(given: Path, plan: RunPlan, recipe_yaml: str) -> None:
    """Refuse a :data:`RUN_DIR_ENV` folder rank 0 would write over: a new run (or one continued
    from a checkpoint outside its run) needs a new folder, one holding only what its own peers
    write before rank 0 gets there (the marker, this very recipe); a resume in place needs the
    checkpoint's own run directory."""
    if not plan.new_dir:
        if not given.exists() or not given.samefile(plan.run_dir):
            raise TclightningError(f"{RUN_DIR_ENV}={given}: --resume continues {plan.run_dir}, its checkpoint's run "
                                   f"directory; nothing was written: set {RUN_DIR_ENV} to it (or leave it unset)")
        return
    if not given.is_dir():
        if given.exists() or given.is_symlink():
            raise TclightningError(f"{RUN_DIR_ENV}={given}: not a folder; nothing was written: point it at a new folder")
        return
    for entry in given.iterdir():
        peers = entry.name == RUN_MARKER or entry.name.startswith(".recipe.yaml.") or (
            entry.name == "recipe.yaml" and entry.is_file() and not entry.is_symlink()
            and entry.stat().st_size <= RECORD_MAX_BYTES and entry.read_text(errors="replace") == recipe_yaml)
        if not peers:
            raise TclightningError(f"{RUN_DIR_ENV}={given}: already holds a run ({entry.name}); nothing was written: "
                                   "a new run goes into a new folder (continue that one with --resume)")


def require_hardware(recipe: RecipeConfig) -> None:
    """Refuse, before anything is written, a GPU-scale recipe on a machine without CUDA, and an MPS run
    where there is no MPS."""
    import torch

    wants_gpu = recipe.trainer.accelerator in ("gpu", "cuda") or recipe.sampler.backend == "vllm"
    if wants_gpu and not torch.cuda.is_available():
        raise TclightningError(
            f"recipe '{recipe.name}' needs a CUDA GPU (trainer.accelerator={recipe.trainer.accelerator}, "
            f"sampler.backend={recipe.sampler.backend}) and none is visible; on a CPU run 'tiny' "
            "or 'gsm8k-shallow' instead"
        )
    if recipe.trainer.accelerator == "mps" and not torch.backends.mps.is_available():
        raise TclightningError("trainer.accelerator=mps needs Apple's Metal (MPS), which this machine does not have; "
                               "use trainer.accelerator=cpu or auto")


def require_writable_root(recipe: RecipeConfig) -> None:
    """Refuse, before anything is written, a ``logging.root`` that is a file or cannot be written:
    the nearest folder that exists on the way to ``<root>/<name>`` must be a writable directory."""
    target = Path(recipe.logging.root).expanduser() / (recipe.logging.name or recipe.name)
    existing = target
    while not existing.exists() and existing != existing.parent:
        if existing.is_symlink():  # a dangling link: mkdir would fail on it
            raise TclightningError(f"logging.root: {existing} is a broken symbolic link")
        existing = existing.parent
    if not existing.is_dir():
        raise TclightningError(f"logging.root: {existing} is a file, expected a directory for run folders")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise TclightningError(f"logging.root: cannot create run folders in {existing} (not writable)")
    require_writable(existing, "logging.root", TclightningError)  # /proc, a read-only mount: access() lets root in


LAUNCHER_ENV = ("TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "NODE_RANK", "GROUP_RANK", "OMPI_COMM_WORLD_SIZE")
"""Variables one of which a multi-node launcher (torchrun, SLURM, Lightning's NODE_RANK, MPI) sets."""


def require_launcher(nodes: int, key: str) -> None:
    """Refuse ``nodes > 1`` (the option ``key``) started by hand on one node: no launcher variable
    (:data:`LAUNCHER_ENV`) is set, and the ranks would wait for peers that never come."""
    if nodes > 1 and not any(os.environ.get(name) for name in LAUNCHER_ENV):
        raise TclightningError(
            f"{key}={nodes}: start it on every node with a launcher that tells each node its rank "
            "(torchrun --nnodes ... --node_rank ..., SLURM srun, or NODE_RANK/MASTER_ADDR set): "
            "none is set here, and the ranks would wait for peers that never come (docs/distributed.md)")


def require_launcher_for_nodes(recipe: RecipeConfig) -> None:
    """Refuse ``trainer.num_nodes > 1`` started by hand on one node: with no launcher the ranks
    would wait for peers that never come (300 s, then a traceback); and, for any run of several
    processes, a ``MASTER_PORT`` that is no port or a ``NODE_RANK`` past the nodes."""
    nodes = recipe.trainer.num_nodes
    require_launcher(nodes, "trainer.num_nodes")
    if recipe.trainer.devices * nodes <= 1:
        return
    for name, low, high in (("MASTER_PORT", 1, 65535), ("NODE_RANK", 0, nodes - 1)):
        given = os.environ.get(name)
        if given is not None and not (given.strip().isascii() and given.strip().isdigit()
                                      and low <= int(given) <= high):
            raise TclightningError(f"{name}={given!r}: expected a whole number in [{low}, {high}] for "
                                   f"trainer.num_nodes={nodes}; nothing was started")


def require_logger_servers(recipe: RecipeConfig) -> None:
    """A W&B logger that logs online, or an MLflow logger with an http(s) tracking server, needs
    its server to answer now: each retries a silent or closed one for minutes (MLflow waited
    without end on one that accepts and never answers), with the run folder made and nothing trained."""
    from tclightning.network import WANDB_URL, host_of, is_http, no_answer
    from tclightning.recipes.loader import logger_kind, resolve_logger_class

    for i, entry in enumerate(recipe.logging.loggers):
        class_path = entry if isinstance(entry, str) else entry.get("class_path")
        init_args = {} if isinstance(entry, str) else dict(entry.get("init_args") or {})
        kind = logger_kind(resolve_logger_class(class_path, "recipe", f"logging.loggers[{i}]"))
        if kind == "mlflow":  # a local file store unless an http(s) server is named
            url = mlflow_tracking_uri(init_args)
            background = mlflow_logs_in_background(init_args.get("synchronous"), url)
            if background is not None:
                raise TclightningError(f"logging.loggers[{i}]: the MLflow logger {background}")
            server, advice = "MLflow", "start it, or leave tracking_uri unset to log to a local file store"
        elif kind == "wandb" and not wandb_offline(init_args):
            settings = init_args.get("settings")  # wandb.init(settings=...) names the server before the environment
            url = str((settings.get("base_url") if isinstance(settings, Mapping) else None)
                      or os.environ.get("WANDB_BASE_URL") or WANDB_URL)
            server, advice = "W&B", "set WANDB_MODE=offline to log locally and `wandb sync` later"
        else:
            continue
        silent = no_answer(url.strip()) if is_http(url) else None
        if silent is not None:
            raise TclightningError(f"logging.loggers: the {server} server {host_of(url)} does not answer "
                                   f"({silent.reason}); {advice}")


def require_pipeline_for_processes(recipe: RecipeConfig) -> None:
    """More than one process means one pipeline stage per process (``pipeline.replicas`` copies of
    each): refuse anything else early, naming the keys."""
    t = recipe.trainer
    processes = t.devices * t.num_nodes
    if processes > 1 and t.strategy != "pipeline":
        raise TclightningError(
            f"trainer.devices x trainer.num_nodes = {processes} needs trainer.strategy=pipeline "
            f"(one pipeline stage per process, pipeline.stages={processes}); data parallelism is "
            "pipeline.replicas copies of each stage"
        )
    replicas = recipe.pipeline.replicas
    if replicas > 1:
        stages = len(recipe.pipeline.cuts) + 1 if recipe.pipeline.cuts is not None else recipe.pipeline.stages
        if t.strategy != "pipeline" or processes != stages * replicas:
            raise TclightningError(
                f"pipeline.replicas={replicas} x pipeline.stages={stages} needs trainer.strategy=pipeline and "
                f"trainer.devices x trainer.num_nodes = {stages * replicas} processes (got {processes})"
            )


def require_pipeline_strategy_for_its_keys(recipe: RecipeConfig) -> None:
    """The ``pipeline`` section is read by ``trainer.strategy: pipeline`` only: a key of it set for
    another strategy would do nothing, so it is refused, naming the first."""
    strategy = recipe.trainer.strategy
    if strategy == "pipeline":
        return
    default = PipelineConfig()
    changed = [f.name for f in fields(PipelineConfig) if getattr(recipe.pipeline, f.name) != getattr(default, f.name)]
    if changed:
        raise TclightningError(
            f"pipeline.{changed[0]}={getattr(recipe.pipeline, changed[0])} is read by trainer.strategy=pipeline only: "
            f"with trainer.strategy={strategy} the run makes no cut. Set trainer.strategy=pipeline, or leave the "
            "pipeline section out")


def build_trainer(recipe: RecipeConfig, plan: RunPlan, user_callbacks: list[Any], logs: bool = True) -> Any:
    """The Lightning trainer of a run; ``logs``: whether this process logs into the run directory
    (rank 0; a rank a launcher started into it knows its rank only once the trainer is set up, and
    a logger made there before that would write as rank 0)."""
    import lightning as L

    from tclightning.callbacks.checkpointing import GracefulStop, StepCheckpoint
    from tclightning.callbacks.progress import progress_callback
    from lightning.pytorch.loggers import Logger

    from tclightning.logging import ResumableCSVLogger, build_loggers, build_tensorboard, own_loggers

    t = recipe.trainer
    loggers: list[Any] = []
    own = own_loggers(recipe.logging.loggers) if logs else ()
    if "tensorboard" in own:
        loggers.append(build_tensorboard(plan.run_dir, plan.resume_step))
    if "csv" in own:
        loggers.append(ResumableCSVLogger(plan.run_dir, plan.resume_step))
    if logs:
        loggers += build_loggers(recipe.logging.loggers, plan.run_dir, recipe.logging.name or recipe.name,
                                 source=f"recipe '{recipe.name}'")
    # a Lightning logger handed in with the callbacks (run(extra_callbacks=[WandbLogger()])) logs
    loggers += [cb for cb in user_callbacks if isinstance(cb, Logger)]
    user_callbacks = [cb for cb in user_callbacks if not isinstance(cb, Logger)]
    callbacks: list[Any] = [
        StepCheckpoint(plan.run_dir / "checkpoints", t.checkpoint_every, t.keep_checkpoints),
        GracefulStop(),
        *user_callbacks,
    ]
    progress = progress_callback(recipe.logging.progress)  # plain lines when stdout is not a terminal
    if progress is not None:
        callbacks.append(progress)
    strategy: Any = t.strategy
    if t.strategy == "pipeline" and t.devices * t.num_nodes > 1:
        from tclightning.pipeline.multiprocess import MultiProcessPipelineStrategy

        strategy = MultiProcessPipelineStrategy(config=recipe.pipeline)
    elif t.strategy == "pipeline":
        from tclightning.pipeline import PipelineStrategy

        strategy = PipelineStrategy(config=recipe.pipeline)
    return L.Trainer(
        max_epochs=1,  # one pass over the prompt stream = trainer.steps RL steps
        max_steps=-1,
        accelerator=t.accelerator,
        devices=t.devices,
        num_nodes=t.num_nodes,
        strategy=strategy,
        precision=t.precision,
        logger=loggers or False,
        callbacks=callbacks,
        enable_checkpointing=True,  # with StepCheckpoint (RL steps) in place of ModelCheckpoint (ticks)
        enable_progress_bar=progress is not None,
        enable_model_summary=False,
        log_every_n_steps=1,
        val_check_interval=t.val_every if t.val_every > 0 else None,
        check_val_every_n_epoch=None if t.val_every > 0 else 1,
        limit_val_batches=None if t.val_every > 0 else 0,
        num_sanity_val_steps=0,
        default_root_dir=str(plan.run_dir),
    )


def build_module(recipe: RecipeConfig) -> Any:
    from tclightning.grpo.module import GRPOModule

    return GRPOModule(
        model=recipe.model,
        task=recipe.task,
        sampler=recipe.sampler,
        grpo=recipe.grpo,
        anchor=recipe.anchor,
        total_steps=recipe.trainer.steps,
        seed=recipe.trainer.seed,
        val_batch_size=recipe.trainer.val_batch_size,
    )


def resume_module(recipe: RecipeConfig, ckpt_path: Path) -> Any:
    """For a resume from a ``model.lora`` checkpoint, which holds the adapters alone: the module
    with the frozen base rebuilt from ``recipe`` (the model, then any supervised warm-up) and checked
    against the fingerprint the checkpoint records, before the run writes anything; a base that does
    not match is refused (``TclightningError``, one line naming the checkpoint). ``None`` for a
    checkpoint that holds its whole state dict, and on a process Lightning numbers other than rank
    0: those take rank 0's weights once the pipeline is built (``setup`` rebuilds their base)."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    from tclightning.callbacks.checkpointing import load_checkpoint
    from tclightning.callbacks.progress import progress_callback
    from tclightning.grpo.module import BASE_KEY

    record = (load_checkpoint(ckpt_path, map_location="meta").get("tclightning") or {}).get(BASE_KEY)
    if record is None:
        return None
    if recipe.model.lora_settings.r <= 0:
        raise TclightningError(f"--resume: checkpoint {ckpt_path}: holds LoRA adapters without their base, and the "
                               "recipe has model.lora.r=0; nothing was loaded")
    if getattr(rank_zero_only, "rank", 0) != 0:
        return None
    module = build_module(recipe)
    module.prepare_base(progress=progress_callback(recipe.logging.progress) is not None)
    module.verify_base(record, ckpt_path)
    return module


def run(
    recipe_ref: str,
    overrides: Sequence[str] = (),
    resume: str | None = None,
    quiet: bool = False,
    extra_callbacks: Sequence[Any] = (),
) -> dict[str, Any]:
    """Train one recipe; returns the run summary (also written to ``<run_dir>/summary.json``).

    ``extra_callbacks`` are added after the recipe's (for programmatic use and tests). The run
    holds its run directory's lock (:func:`~tclightning.files.hold_lock`) until it returns, so a
    second resume of a run that is still going is refused instead of writing beside it.
    """
    with contextlib.ExitStack() as held:
        held.enter_context(_signal_handlers_kept())
        held.enter_context(_process_settings_kept())
        return _run(recipe_ref, overrides, resume, quiet, extra_callbacks, held)


@contextlib.contextmanager
def _process_settings_kept() -> Any:
    """What the run changes of its process, put back however it ends, so that a program of yours
    that calls :func:`run` keeps its own: the environment variables the run set, in its thread or in
    threads started meanwhile (an MLflow tracking URI left set sent the program's next run's logs to
    another store; what a thread the program had before the run set stays:
    :func:`~tclightning.environment.own_writes_undone`), torch's thread count, the threads' exception hook,
    the random number generators the run seeds (Python's, NumPy's, torch's) and the console's
    quieting (:func:`quiet_lightning`)."""
    import threading

    import torch

    from tclightning.environment import own_writes_undone

    threads, hook = torch.get_num_threads(), threading.excepthook
    with own_writes_undone(), torch.random.fork_rng(devices=[]), _python_random_kept(), quiet_lightning():
        try:
            yield
        finally:
            torch.set_num_threads(threads)
            threading.excepthook = hook


@contextlib.contextmanager
def _python_random_kept() -> Any:
    """Python's and NumPy's global random state as they were (``seed_everything`` seeds both)."""
    import random

    import numpy as np

    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


def _run(recipe_ref: str, overrides: Sequence[str], resume: str | None, quiet: bool,
         extra_callbacks: Sequence[Any], held: contextlib.ExitStack) -> dict[str, Any]:
    cfg: DictConfig = load_recipe(recipe_ref, overrides)
    recipe = to_dataclass(cfg)
    user_callbacks = [*instantiate_callbacks(cfg, str(find_recipe(recipe_ref)), overrides), *extra_callbacks]
    clash = state_key_clash(user_callbacks)
    if clash is not None:  # only extra_callbacks can still clash: the recipe's own were checked as it was read
        first, second = (i - (len(user_callbacks) - len(extra_callbacks)) for i in clash)
        other = f"extra_callbacks[{first}]" if first >= 0 else f"the recipe's callbacks[{clash[0]}]"
        raise TclightningError(f"extra_callbacks[{second}]: {same_state_message(user_callbacks[clash[1]], other)}")
    from tclightning.callbacks.checkpointing import SigtermBeforeTraining

    signals = held.enter_context(SigtermBeforeTraining())
    user_callbacks.append(signals)
    require_hardware(recipe)
    require_pipeline_for_processes(recipe)
    require_launcher_for_nodes(recipe)
    from tclightning.models.loading import check_hub_model

    check_hub_model(recipe.model)  # an uncached hub name offline: one line now, not a minute of retries
    require_logger_servers(recipe)
    held.enter_context(remote_requests_bounded())  # a server that answers now and stalls later: each request
    # has a time limit, for this run (a program of yours that called it keeps its own settings)
    if resume is None:  # a resumed run writes into the checkpoint's run directory instead
        require_pipeline_strategy_for_its_keys(recipe)
        require_writable_root(recipe)
    plan = plan_run(recipe, resume)
    if resume is not None and plan.new_dir:  # a checkpoint outside a run directory: a new one
        require_writable_root(recipe)
    kept_record: Path | None = None  # where a resume in place keeps the earlier record it replaces
    if plan.resume_step is not None and plan.resume_step >= recipe.trainer.steps:
        raise TclightningError(f"--resume: {plan.ckpt_path} is at step {plan.resume_step}, and trainer.steps="
                               f"{recipe.trainer.steps} leaves nothing to train; raise trainer.steps to continue the run")
    if plan.new_dir and plan.ckpt_path is not None:  # outside its run: its own record is the checkpoint's
        checkpoint_changes(plan.ckpt_path, cfg, plan.resume_step)
    multiprocess = recipe.trainer.devices * recipe.trainer.num_nodes > 1
    named_by_env = multiprocess and bool(os.environ.get(RUN_DIR_ENV))  # a rank Lightning or the user launched
    follower = named_by_env and launch_rank(recipe) != 0  # rank 0 owns the run directory; the others only run
    locked_folder: tuple[int, int] | None = None  # a resume in place: the run folder it locked
    if not plan.new_dir and plan.resume_step is not None:
        changed = resume_changes(plan.run_dir, cfg, plan.resume_step, plan.ckpt_path)
        require_the_run_s_rows(plan.run_dir, recipe)
        require_pipeline_strategy_for_its_keys(recipe)  # after: a changed key is named as the resume's change
        for folder in (plan.run_dir, plan.ckpt_path.parent):  # a read-only or full disk: one line now
            require_writable(folder, "--resume")
        if not follower:  # a rank launched into the run: its rank 0 holds the lock
            lock = hold_lock(plan.run_dir, "--resume")
            held.callback(os.close, lock)
            locked = os.fstat(lock)
            locked_folder = (locked.st_dev, locked.st_ino)
            again = plan_run(recipe, resume)  # planned before the lock: the run may have moved on since
            if (again.ckpt_path, again.resume_step) != (plan.ckpt_path, plan.resume_step):
                raise TclightningError(f"--resume: {plan.run_dir} changed while this resume started (its run was "
                                       f"still going: now at step {again.resume_step}); nothing was written, "
                                       "run the resume again")
        unreadable = not changed and (plan.run_dir / "recipe.yaml").is_file() \
            and read_record(plan.run_dir / "recipe.yaml") is None  # notes of yours, or damage: kept, not replaced
        if changed or unreadable:
            kept_record = unused_name(plan.run_dir / f"recipe.before-step-{plan.resume_step}.yaml")
            why = (f"the recipe changed since step {plan.resume_step} ({', '.join(changed[:6])}"
                   f"{', ...' if len(changed) > 6 else ''})" if changed else "the run's recipe.yaml is not a record "
                   "it can read")
            plan = replace(plan, notices=(*plan.notices, f"{why}; the earlier record is kept as {kept_record.name}"))
    if named_by_env:
        given = Path(os.path.realpath(os.environ[RUN_DIR_ENV]))  # `mine/new/..` is mine
        if given.is_dir() and not (given / RUN_MARKER).is_file() and any(given.iterdir()):
            raise TclightningError(f"{RUN_DIR_ENV}={given}: a folder of yours, not a run directory (no {RUN_MARKER}); "
                                   "nothing was written: point it at a new folder")
        if not follower:
            require_run_dir_for_rank_0(given, plan, to_yaml(cfg))
        plan = RunPlan(given, plan.ckpt_path, plan.resume_step, new_dir=plan.new_dir)

    import lightning as L
    import torch

    from tclightning.models.warmup import WarmupInterrupted

    torch.set_num_threads(intra_op_threads(recipe))  # before any warm-up: its float sums depend on it
    L.seed_everything(recipe.trainer.seed, workers=True, verbose=False)
    started = time.perf_counter()
    try:  # the model and the task before the run directory: what they refuse leaves nothing behind
        module = resume_module(recipe, plan.ckpt_path) if plan.ckpt_path is not None else None
        module = module if module is not None else build_module(recipe)
        if module.task.skipped:  # a data file's unusable rows: said, not dropped silently
            plan = replace(plan, notices=(*plan.notices, module.task.skipped))
    except (WarmupInterrupted, KeyboardInterrupt) as err:
        what = str(err) if isinstance(err, WarmupInterrupted) else "interrupted before training started"
        raise RunInterrupted(f"{what}; nothing was written") from None
    # only a directory this run made is ever removed (a named one its peers may have made first)
    created = plan.new_dir and not follower and not (named_by_env and plan.run_dir.exists())
    run_dir = plan.run_dir
    try:  # rank 0 makes and records the run directory; the other ranks write nothing there
        with interrupts_held():  # made and taken whole (a Ctrl-C between the two left it behind): said after
            run_dir = plan.run_dir if follower else mark_run_dir(plan.run_dir, recipe,
                                                                 new=plan.new_dir and not named_by_env,
                                                                 locked=locked_folder)
    except OSError as err:
        if not refused_by_storage(err):
            raise
        raise StorageError(f"cannot create the run directory {plan.run_dir}: {err.strerror}; nothing was saved") from None
    except KeyboardInterrupt:
        _interrupted_before_training("interrupted before training started", run_dir, created, follower)
    if run_dir != plan.run_dir:  # another run took the planned name since plan_run: this run's is next
        notices = plan.notices
        if plan.ckpt_path is not None:  # the resume's notice names the directory it continues in
            old, new = _new_dir_note(plan.ckpt_path, plan.run_dir), _new_dir_note(plan.ckpt_path, run_dir)
            notices = tuple(new if n == old else n for n in notices)
        plan = replace(plan, run_dir=run_dir, notices=notices)
    trainer = None
    before = None
    try:  # from here on, whatever stops the run (a Ctrl-C while a slow console prints) tidies its directory
        if plan.new_dir and not follower:  # a new run's folder (a resume in place took its lock before its checks)
            held.callback(os.close, hold_lock(run_dir, "run"))
        if not follower:
            print(f"run directory: {plan.run_dir}", flush=True)
        trainer = build_trainer(recipe, plan, user_callbacks, logs=not follower)  # its loggers refused: no record rewritten
        ask_remote_stores(trainer)  # a callback's remote dirpath that never answers: before anything is written
        for notice in plan.notices:  # once the loggers are built: a refusal is the one line said
            print(f"note: {notice}", file=sys.stderr, flush=True)
        if not follower:
            before = RecordSnapshot.take(plan.run_dir) if plan.resume_step is not None and not created else None
            record = plan.run_dir / "recipe.yaml"
            if kept_record is not None:  # the earlier steps' record stays beside the new one; each file is
                copy_file(record, kept_record)  # replaced whole
            SameFolder(plan.run_dir).check()
            replace_text(record, to_yaml(cfg))
        launched_here = multiprocess and RUN_DIR_ENV not in os.environ
        if launched_here:  # the ranks Lightning starts inherit this environment: one run directory
            os.environ[RUN_DIR_ENV] = str(plan.run_dir)
        try:
            _fit(trainer, module, plan.ckpt_path)
        except Exception as err:
            if before is not None and _restoring(trainer, plan):
                _finish_loggers(trainer)  # nothing of a refused resume stays in the run's record
                with contextlib.suppress(OSError) if refused_by_storage(err) else contextlib.nullcontext():
                    before.put_back(kept_record)  # (where the storage refuses that too, its own error is said)
            if not _failed_restoring(err, trainer, plan):
                raise
            detail = " ".join(str(err).split())[:200] or "no detail"
            raise TclightningError(f"--resume: {plan.ckpt_path} could not be restored ({type(err).__name__}: "
                                   f"{detail}): its state does not fit this run; nothing was trained or "
                                   "written") from err
        finally:
            if launched_here:
                os.environ.pop(RUN_DIR_ENV, None)
    except (WarmupInterrupted, KeyboardInterrupt) as err:
        if not isinstance(err, WarmupInterrupted) and trainer is not None and trainer.global_step > 0:
            _interrupted_in_training(plan, created, started, module, trainer, follower)  # (a second SIGTERM)
        what = str(err) if isinstance(err, WarmupInterrupted) else "interrupted before training started"
        _interrupted_before_training(what, plan.run_dir, created, follower)
    except SystemExit:
        if trainer is None or not trainer.interrupted:
            raise
        # Lightning turns a Ctrl-C it did not see coming (before the first step, or a second one
        # during a step) into exit 1 after its own graceful shutdown: say so, and exit 130
        _interrupted_in_training(plan, created, started, module, trainer, follower)
    except BaseException as err:
        if isinstance(err, OSError) and not (plan.run_dir / RUN_MARKER).is_file():
            raise TclightningError(f"the run directory {plan.run_dir} went away during the run (removed, moved or "
                                   f"replaced: {storage_reason(err)}); nothing more was saved") from None
        gone = discard_unfinished_run(plan.run_dir, created)
        if refused_by_storage(err):  # full, read-only, over quota: the machine's state, not a bug
            where = "" if getattr(err, "filename", None) else f" in {plan.run_dir}"  # a callback's folder is named
            raise StorageError(f"the storage refused a write{where} ({storage_reason(err)}); "
                               + (f"removed {plan.run_dir} (nothing was saved yet)" if gone else
                                  f"what {plan.run_dir} saved is kept: once the storage takes writes again (space, "
                                  "permissions), resume with "
                                  f"`tclightning run --resume {plan.run_dir}`")) from None
        if gone:
            print(f"note: removed {plan.run_dir}: the run failed before it logged or saved anything",
                  file=sys.stderr, flush=True)
        raise
    summary: dict[str, Any] | None = None
    try:
        late = signals.fit_over()  # a Ctrl-C or SIGTERM from here stops the command (one was swallowed) ...
        with interrupts_held():  # ... once the loggers' last rows and the summary are on disk
            if late is not None:  # (one taken as the fit ended too)
                signal.raise_signal(late)
            for logger in trainer.loggers:
                logger.finalize("success")
            if trainer.global_rank == 0:  # rank 0 logs, checkpoints and summarises
                summary = _finished_summary(plan.run_dir, started, module, trainer)
    except KeyboardInterrupt:
        kept = "its checkpoints" + (" and summary.json" if summary is not None else "")
        raise RunInterrupted(f"interrupted as the run finished; {plan.run_dir} keeps {kept}") from None
    if summary is None:
        return {}
    if not quiet:
        from tclightning.grpo.summary import print_summary

        print_summary(summary)
    return summary


def _finished_summary(run_dir: Path, started: float, module: Any, trainer: Any) -> dict[str, Any]:
    """:func:`_write_summary` of a finished run; a refusal of the storage is one line."""
    try:
        return _write_summary(run_dir, started, module, trainer)
    except OSError as err:
        if not refused_by_storage(err):
            raise
        raise StorageError(f"the run finished, but the storage refused its summary ({storage_reason(err)}); "
                           "its checkpoints and metrics.csv are kept") from None


def _interrupted_before_training(what: str, run_dir: Path, created: bool, follower: bool) -> None:
    """Raise :class:`RunInterrupted` for a run stopped before its fit began: ``what`` stopped it, and
    (rank 0) what became of its run directory, removed if it holds nothing of anyone's."""
    if follower:  # rank 0 says what became of the run directory
        raise RunInterrupted(what) from None
    gone = discard_unfinished_run(run_dir, created)
    raise RunInterrupted(f"{what}; " + (f"removed {run_dir} (nothing was saved yet)" if gone
                                        else f"{run_dir} is kept")) from None


def _interrupted_in_training(plan: RunPlan, created: bool, started: float, module: Any, trainer: Any,
                             follower: bool) -> None:
    """Raise :class:`RunInterrupted` for a run interrupted once its fit began, saying what became of
    its run directory (rank 0; the others say "interrupted")."""
    if follower:  # rank 0 says what became of the run directory, once its checkpoint is in
        raise RunInterrupted("interrupted") from None
    if discard_unfinished_run(plan.run_dir, created):
        kept = f"removed {plan.run_dir} (nothing was saved yet)"
    elif any((plan.run_dir / "checkpoints").glob("*.ckpt")):
        kept = f"{plan.run_dir} keeps its checkpoints (`--resume` continues it)"
        # the record of the steps it made (a resumed run's summary.json told of the earlier run's)
        with contextlib.suppress(OSError):
            _write_summary(plan.run_dir, started, module, trainer)
    else:
        kept = f"{plan.run_dir} keeps the steps it logged; no checkpoint was saved yet, so a resume cannot continue it"
    raise RunInterrupted(f"interrupted; {kept}") from None


def _write_summary(run_dir: Path, started: float, module: Any, trainer: Any) -> dict[str, Any]:
    """``summary.json`` of the run so far (its steps, rewards, health verdict), written whole: a
    Ctrl-C or SIGTERM meanwhile waits for it."""
    from tclightning.grpo.summary import summarize

    with interrupts_held():
        return summarize(run_dir, wall_time_s=time.perf_counter() - started, extra=module.warmup_stats,
                         monitors=trainer.callbacks)  # health callbacks: the rules behind the verdict


def _fit(trainer: Any, module: Any, ckpt_path: Path | None) -> None:
    """``trainer.fit``, its checkpoint read as data only: Lightning's load sees the same allow-list
    as plan_run's (numpy RNG state, the anchor replay); anything else in the file is refused, never
    run. A rank this process started that failed stops the run as :class:`RankStopped`, naming it,
    in place of the error its absence left here."""
    from tclightning.callbacks.checkpointing import checkpoint_allow_list
    from tclightning.pipeline.launch import rank_exit

    try:
        with checkpoint_allow_list():
            trainer.fit(module, ckpt_path=str(ckpt_path) if ckpt_path else None, weights_only=True)
    except BaseException as err:
        exited = rank_exit(trainer)
        if exited is not None and not (exited.interrupted and isinstance(err, (KeyboardInterrupt, SystemExit))):
            raise RankStopped(exited.describe(), exit_code=exited.code if 0 < exited.code < 256 else 1) from None
        unlogged = _unlogged_monitor(err)
        if unlogged is None:
            raise
        raise TclightningError(f"callbacks: {unlogged[0]}(monitor='{unlogged[1]}') watches a metric this run does not "
                               "log; the run stopped at the callback's first check. Set monitor to a metric the run "
                               "logs (docs/metrics.md), e.g. reward/mean or val/accuracy") from None


def _unlogged_monitor(err: BaseException) -> tuple[str, str] | None:
    """(callback, metric) when ``err`` is Lightning's refusal of a monitoring callback (EarlyStopping,
    ModelCheckpoint) whose metric the run never logs."""
    text = str(err) if isinstance(err, Exception) else ""
    if (found := re.match(r"Early stopping conditioned on metric `([^`]*)`", text)) is not None:
        return "EarlyStopping", found[1]
    if (found := re.match(r"`ModelCheckpoint\(monitor='([^']*)'\)` could not find", text)) is not None:
        return "ModelCheckpoint", found[1]
    return None


class RankStopped(TclightningError):
    """A rank the run started failed, and the run stopped with it: one line naming the rank (what
    it printed says why), with the rank's own exit code (1 for a signal)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@contextlib.contextmanager
def _signal_handlers_kept() -> Any:
    """The SIGINT, SIGTERM and SIGHUP handlers as they were before the run, put back however it
    ends (a callback's handler must never outlive its run in the caller's process). Meanwhile a
    SIGHUP (the terminal closed) stops the run as SIGTERM does, unless the caller set its own
    handler for it (``nohup``: ignored)."""
    import signal

    from tclightning.console import hangup_is_sigterm

    hangup = getattr(signal, "SIGHUP", None)
    kept = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, hangup) if sig is not None}
    if hangup is not None and kept[hangup] is signal.SIG_DFL:
        with contextlib.suppress(ValueError):  # not the main thread: signals are the caller's
            signal.signal(hangup, hangup_is_sigterm)
    try:
        yield
    finally:
        for sig, handler in kept.items():
            if handler is not None:
                with contextlib.suppress(ValueError):  # not the main thread: nothing was set there
                    signal.signal(sig, handler)


@dataclass(frozen=True)
class RecordSnapshot:
    """A run directory's record (recipe.yaml, hparams.yaml, metrics.csv, summary.json and the
    TensorBoard files) as it was before a resume in place wrote to it, so that a resume refused
    while restoring its checkpoint leaves the run as it found it."""

    run_dir: SameFolder
    tb: SameFolder
    files: dict[str, bytes | None]
    tb_files: frozenset[str]

    RECORDS = ("recipe.yaml", "hparams.yaml", "tb/hparams.yaml", "metrics.csv", "summary.json")

    @classmethod
    def take(cls, run_dir: Path) -> RecordSnapshot:
        files = {name: (run_dir / name).read_bytes() if (run_dir / name).is_file() else None for name in cls.RECORDS}
        tb = run_dir / "tb"
        return cls(SameFolder(run_dir), SameFolder(tb), files,
                   frozenset(p.name for p in tb.iterdir()) if tb.is_dir() else frozenset())

    def put_back(self, extra: Path | None = None) -> None:
        """Each record file as it was (replaced whole, and only where it changed); the files the
        resume added (TensorBoard events, ``extra``) removed. Nowhere but in the folders snapshotted:
        where a link or another folder was put in place of the run's folder or its ``tb/`` since,
        what is there is someone else's and is left as it is."""
        try:
            with self.run_dir.held() as folder:  # through the folder checked, whatever its name leads to meanwhile
                for name, data in self.files.items():
                    if not name.startswith("tb/"):
                        _put_back_file(folder / name, data)
        except (TclightningError, OSError):  # a link or another folder in its place: someone else's, left as it is
            return
        with contextlib.ExitStack() as opened:
            try:
                tb = opened.enter_context(self.tb.opened())
            except (TclightningError, OSError):  # gone, or a link or another folder in its place: not the run's
                tb = None
            for added in set(os.listdir(tb)) - self.tb_files if tb is not None else ():
                with contextlib.suppress(FileNotFoundError):
                    if stat.S_ISREG(os.stat(added, dir_fd=tb, follow_symlinks=False).st_mode):
                        os.unlink(added, dir_fd=tb)
            for name, data in self.files.items() if tb is not None else ():
                if name.startswith("tb/"):  # through the descriptor: into the folder checked, whatever its name
                    _put_back_file(by_descriptor(tb, self.tb.folder) / name.removeprefix("tb/"), data)
        if extra is not None:
            extra.unlink(missing_ok=True)


def _put_back_file(path: Path, data: bytes | None) -> None:
    """``path`` as it was: ``data``, or no file."""
    if data is None:
        path.unlink(missing_ok=True)
    elif not path.is_file() or path.read_bytes() != data:
        replace_file(path, lambda handle: handle.write(data), binary=True)


def _finish_loggers(trainer: Any) -> None:
    """Close the trainer's loggers, so a record put back is not written over by a late flush."""
    for logger in getattr(trainer, "loggers", ()):
        with contextlib.suppress(Exception):
            logger.finalize("failed")


def _failed_restoring(err: Exception, trainer: Any, plan: RunPlan) -> bool:
    """Whether ``err`` came while a resume restored its checkpoint (weights, optimizer, loops, RNG,
    callback and codec states), before its first new step began: the checkpoint's state, not a bug
    of the run (``--debug`` still shows the traceback)."""
    return not isinstance(err, TclightningError) and not refused_by_storage(err) and _restoring(trainer, plan)


def _restoring(trainer: Any, plan: RunPlan) -> bool:
    """Whether a resume has not begun its first new step yet (it is still restoring its checkpoint)."""
    if plan.ckpt_path is None or plan.resume_step is None:
        return False
    return trainer.fit_loop.epoch_loop.batch_progress.total.started <= plan.resume_step


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C before the run saved anything; the message says what happened to its run directory.
    ``tclightning run`` prints it as one line and exits 130."""


def discard_unfinished_run(run_dir: Path, created: bool) -> bool:
    """Remove ``run_dir`` when this run ``created`` it and it holds nothing worth keeping: no
    checkpoint and no logged step in ``metrics.csv`` (a run stopped after a few logged steps, by a
    NaN say, keeps its metrics for the diagnosis), and nothing but the run's own files (another
    run whose ``logging.root`` lies inside it, a user's file, a folder where the run writes a file,
    a bind mount, a file the run did not make under a name the run writes: all kept, and the
    directory with them). Only the entries checked are removed, as they were when checked: one
    renamed in meanwhile stays, and the folder with it. A directory resumed into is never
    touched. Returns whether it was removed."""
    if not created or not run_dir.is_dir() or any((run_dir / "checkpoints").glob("*.ckpt")):
        return False
    if _last_logged_step(run_dir / "metrics.csv") is not None:
        return False
    entries = _run_own_entries(run_dir)
    return entries is not None and remove_tree(run_dir, identity=owned_identity(run_dir), only=entries)


def _run_own_entries(run_dir: Path) -> dict[str, tuple[int, int]] | None:
    """The entries of a new run folder this process made (``(st_dev, st_ino)`` by path relative to
    it) when every one is the run's own: its files by name, each one this process made, and
    :data:`RUN_FOLDERS` as the run took them holding only the files it writes there. None when
    anything is not (someone's file, folder, link or mount, or a folder it never took)."""
    own = {name.split("/", 1)[0] for name in RUN_FILES}
    entries: dict[str, tuple[int, int]] = {}

    def take(path: Path, name: str) -> bool:
        try:
            info = os.lstat(path)
        except OSError:
            return False  # gone meanwhile: the removal leaves whatever is there now
        if stat.S_ISDIR(info.st_mode):  # a folder moved (or mounted) there that the run refused, never took, or lost
            ours = name in RUN_FOLDERS and owned_identity(path) == (info.st_dev, info.st_ino)
        else:  # the run writes no links; a file it never made was moved in, under whatever name
            ours = made_file(path) == (info.st_dev, info.st_ino)
        if ours:
            entries[name] = (info.st_dev, info.st_ino)
        return ours

    try:
        for entry in run_dir.iterdir():
            if entry.name not in own or not take(entry, entry.name):
                return None
        for folder in RUN_FOLDERS:
            if folder not in entries:
                continue
            for inner in (run_dir / folder).iterdir():
                written_there = any(fnmatch.fnmatchcase(inner.name, pattern) for pattern in RUN_FOLDER_FILES[folder])
                if not written_there or not take(inner, f"{folder}/{inner.name}"):
                    return None  # the run's folders hold the files it writes there, and nothing else (no folder)
    except OSError:
        return None
    return entries


def intra_op_threads(recipe: RecipeConfig) -> int:
    """``trainer.num_threads`` when set; otherwise 1 on a CPU with at most 4 cores, else the cores
    less one. Tiny models gain little from a second thread, and on a small machine shared with
    other work a thread per core makes every thread wait (the `tiny` warm-up took 7 minutes with one
    thread and over 20 with two on a loaded 2-core machine); on a GPU torch's default stays."""
    import torch

    if recipe.trainer.num_threads:
        return int(recipe.trainer.num_threads)
    if recipe.trainer.accelerator != "cpu" and torch.cuda.is_available():
        return torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return 1 if cores <= 4 else cores - 1


@contextlib.contextmanager
def quiet_lightning() -> Any:
    """Keep the console for the progress bar and the summary: no hardware banners, tips, or
    deprecation notices Lightning raises against newer torch, for the block (the level of
    Lightning's logger and the warnings filter are put back after it)."""
    import logging
    import warnings

    from tclightning.console import install_warning_format

    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    before = list(warnings.filters)
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
    added = warnings.filters[0] if warnings.filters[0] not in before else None  # a program's own is its
    install_warning_format()  # health warnings as "health: ...", no file:line (once per process, as on import)
    try:
        yield
    finally:
        logger.setLevel(level)
        if added in warnings.filters:  # the filter this block added, if still there (the list is the process's)
            warnings.filters.remove(added)
            getattr(warnings, "_filters_mutated", lambda: None)()  # else a call site's cached verdict stays


def resolved_yaml(recipe_ref: str, overrides: Sequence[str] = ()) -> str:
    return OmegaConf.to_yaml(load_recipe(recipe_ref, overrides))
