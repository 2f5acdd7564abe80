"""Checkpoints every N RL steps, at the end, and on a clean stop (Ctrl-C, SIGTERM); and the one
safe way to read them back (:func:`load_checkpoint`, :func:`checkpoint_allow_list`)."""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import signal
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import lightning as L
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from tclightning.callbacks.steps import completed_steps
from tclightning.console import shown as printable
from tclightning.errors import StorageError, TclightningError
from tclightning.files import (SameFolder, copy_file, open_regular, regular_file, save_tensors,
                              unused_name)
from tclightning.limits import interrupt
from tclightning.tensor_files import BrokenTensorFile, RefusedTensorFile, contents, load_checked, thin_tensor


def checkpoint_globals() -> list[Any]:
    """The only non-builtin objects a tclightning checkpoint holds, allowed while unpickling:
    numpy arrays and dtypes (the numpy RNG state) and ``Rollouts`` (the anchor circuit's replay).
    Everything else (tensors, dicts, lists, numbers, strings) ``weights_only`` allows already."""
    import numpy as np

    from tclightning.sampling.base import Rollouts

    try:  # numpy >= 2 pickles arrays through numpy._core, numpy 1 through numpy.core
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # pragma: no cover - numpy 1
        from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]
    uint32 = type(np.dtype(np.uint32))  # numpy >= 1.25 dtype classes (e.g. numpy.dtypes.UInt32DType)
    return [np.ndarray, np.dtype, uint32, _reconstruct, Rollouts]


class _AllowList:
    """torch's allow-list is one per process: the blocks open in any thread share one addition,
    made by the first and taken away by the last (a block ending in one thread took the globals
    away from another thread's load, and a genuine checkpoint was refused as crafted)."""

    lock = threading.Lock()
    open_blocks = 0
    held = contextlib.ExitStack()


@contextmanager
def checkpoint_allow_list() -> Iterator[None]:
    """Allow exactly :func:`checkpoint_globals` for ``torch.load(..., weights_only=True)`` inside
    the block: wrap Lightning's own load (``trainer.fit(ckpt_path=..., weights_only=True)``).
    Nests, in one thread or across threads: what an outer block or the caller allows stays."""
    with _AllowList.lock:
        if _AllowList.open_blocks == 0:
            allowed = torch.serialization.get_safe_globals()
            _AllowList.held.enter_context(torch.serialization.safe_globals(
                [g for g in checkpoint_globals() if g not in allowed]))
        _AllowList.open_blocks += 1
    try:
        yield
    finally:
        with _AllowList.lock:
            _AllowList.open_blocks -= 1
            if _AllowList.open_blocks == 0:
                _AllowList.held.close()


class CheckpointRefused(TclightningError):
    """A checkpoint that asks to load something a tclightning checkpoint never holds: possibly
    crafted, so it is never loaded and never silently replaced by another file."""


STEP_FILE = re.compile(r"step-([0-9]{6}|[1-9][0-9]{6,})\.ckpt")
"""The name of a periodic checkpoint this callback writes, ``step-{S:06d}.ckpt`` (and the only
files it prunes: a ``step-0000001.ckpt`` is never one of them)."""


def own_step_files(folder: Path, up_to: int) -> list[Path]:
    """The periodic checkpoints in ``folder`` of steps up to ``up_to``, oldest first by step
    (``step-1000000`` after ``step-999999``); never a link or a name the callback does not write."""
    steps = {path: int(path.name[5:-5]) for path in folder.glob("step-*.ckpt") if STEP_FILE.fullmatch(path.name)}
    return sorted((path for path, step in steps.items() if step <= up_to and path.is_file() and not path.is_symlink()),
                  key=steps.__getitem__)


def checkpoint_error(path: str | os.PathLike, err: BaseException) -> TclightningError:
    """The one-line error for a checkpoint ``torch.load`` could not read (refused or broken)."""
    text = " ".join(str(err).split())
    # torch's message advises loading with weights_only=False, exactly what must not be done:
    # keep only the part that says what is wrong with the file.
    unsafe = re.search(r"GLOBAL ([\w.]+)", text)
    if unsafe:
        return CheckpointRefused(f"checkpoint {path}: refused: it asks to load {unsafe.group(1)}, which a "
                                "tclightning checkpoint never holds (loading it could run code); nothing was loaded")
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1].split(" Check the documentation", 1)[0].strip()
    elif isinstance(err, pickle.UnpicklingError) or "Weights only load failed" in text:
        text = "not a torch checkpoint"
    detail = text.split(". ", 1)[0][:160]  # the first sentence says it; the rest is torch's advice
    return TclightningError(f"checkpoint {path}: cannot read it (truncated or corrupted?): {detail}")


def load_checkpoint(path: str | os.PathLike | IO[bytes], map_location: str = "cpu", *,
                    name: str | None = None) -> dict[str, Any]:
    """Load a tclightning/Lightning checkpoint as data only (``weights_only=True`` with
    :func:`checkpoint_allow_list`): a file that would run code when unpickled is refused.

    Raises ``TclightningError`` (one line: the path and why) for a missing, unreadable,
    truncated or corrupted file or one whose top level is not a dict, and its subclass
    ``CheckpointRefused`` for one holding anything outside the allow-list; ``name`` is what the
    errors call the file (default: ``path``). ``map_location="meta"`` reads no tensor's bytes
    (cheap to peek at a checkpoint of any size: its tensors come back on the meta device).
    """
    shown = name or path  # what the errors call it (an open file has no name of its own)
    if not isinstance(path, (str, os.PathLike)):  # an open file (the caller's) is read where it stands
        return _loaded(path, shown, map_location)
    regular_file(path, "checkpoint")  # a FIFO or a device would make torch.load wait forever
    with open_regular(path, "checkpoint") as handle:  # and one swapped in after that look is refused too
        return _loaded(handle, shown, map_location)


LIGHTNING_VERSION_KEY = "pytorch-lightning_version"


def require_lightning_checkpoint(ckpt: Mapping[str, Any], shown: str) -> None:
    """Refuse (one line starting with ``shown``) a checkpoint without the key every checkpoint
    Lightning writes has: Lightning's own load reads it first, a bare ``KeyError``."""
    if LIGHTNING_VERSION_KEY not in ckpt:
        raise CheckpointRefused(f"{shown} has no '{LIGHTNING_VERSION_KEY}', which every checkpoint Lightning "
                                "writes has; nothing was loaded")


def _lightning_2_or_later(version: Any) -> bool:
    """Whether ``version`` (a checkpoint's Lightning version) reads as 2.0 or later."""
    from packaging.version import InvalidVersion, Version

    try:
        return isinstance(version, str) and len(version) < 64 and Version(version) >= Version("2.0")
    except InvalidVersion:
        return False


def _loaded(source: IO[bytes], shown: object, map_location: str) -> dict[str, Any]:
    from tclightning.sampling.base import Rollouts

    try:  # checked before torch.load runs a single call of its pickle
        with checkpoint_allow_list():
            ckpt = load_checked(source, map_location, classes=[Rollouts], numpy_arrays=True)
    except RefusedTensorFile as err:
        raise CheckpointRefused(f"checkpoint {shown}: refused: {err}; nothing was loaded") from None
    except BrokenTensorFile as err:
        raise TclightningError(f"checkpoint {shown}: cannot read it (truncated or corrupted?): {err}") from None
    except Exception as err:  # noqa: BLE001 - every unreadable file is the same user error
        raise checkpoint_error(shown, err) from None
    if not isinstance(ckpt, dict):  # it read whole: not damage, another kind of file (never replaced by an older one)
        raise CheckpointRefused(f"checkpoint {shown}: not a checkpoint (holds a {type(ckpt).__name__}, not a dict)")
    for section in ("hyper_parameters", "tclightning", "state_dict", "loops", "callbacks"):
        if section in ckpt and not isinstance(ckpt[section], dict):  # each reader takes it as a mapping
            raise CheckpointRefused(f"checkpoint {shown}: not a checkpoint tclightning wrote (its '{section}' "
                                    f"is a {type(ckpt[section]).__name__}, not a dict)")
    if LIGHTNING_VERSION_KEY in ckpt and not _lightning_2_or_later(ckpt[LIGHTNING_VERSION_KEY]):
        # Lightning would run its 1.x migrations on it (and fail on a key they expect)
        raise CheckpointRefused(f"checkpoint {shown}: its '{LIGHTNING_VERSION_KEY}' is "
                                f"{printable(repr(ckpt[LIGHTNING_VERSION_KEY])[:64])}, where a checkpoint tclightning wrote "
                                "names Lightning 2 or later; nothing was loaded")
    if not _fewer_values_than(ckpt, MAX_CHECKPOINT_VALUES, MAX_CHECKPOINT_DEPTH):
        raise CheckpointRefused(f"checkpoint {shown}: holds more than {MAX_CHECKPOINT_VALUES} values once its shared "
                                f"references are followed, or nests deeper than {MAX_CHECKPOINT_DEPTH} (a structure "
                                "built to expand without end); nothing was loaded")
    thin = thin_tensor(ckpt)
    if thin is not None:
        raise CheckpointRefused(f"checkpoint {shown}: {thin}, which torch.save never writes for a tensor of its own "
                                "(a small file that would expand to gigabytes once copied?); nothing was loaded")
    return ckpt


LEGACY_HPARAMS_KEYS = ("hparams", "module_arguments", "hparams_name")
"""Where Lightning also looks for a module's arguments (older checkpoints; ``hparams_name`` wraps
them all as one argument): a tclightning checkpoint keeps them in ``hyper_parameters`` only, and
Lightning writes ``hparams_name: None``."""


def legacy_hparams(checkpoint: Mapping[str, Any]) -> str | None:
    """The first of :data:`LEGACY_HPARAMS_KEYS` that ``checkpoint`` fills in, or None."""
    return next((key for key in LEGACY_HPARAMS_KEYS if checkpoint.get(key) not in (None, {}, "")), None)


CLASS_KEYS = ("class_path", "_class_path", "init_args", "_instantiator", "__path__", "dict_kwargs",
              "__default_config__")
"""Keys with which a structure asks LightningCLI (jsonargparse) or Lightning to build a class, or
(jsonargparse's own ``__path__``, ``dict_kwargs``, ``__default_config__``) to read another file or
replace what the command line gave."""


def names_a_class(obj: Any) -> str | None:
    """The first of :data:`CLASS_KEYS` held anywhere in ``obj`` (a loaded checkpoint's bounded
    structure), or None: such a key would make a parser import the module it names."""
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            found = next((key for key in CLASS_KEYS if key in item), None)
            if found is not None:
                return found
            stack.extend(dict.values(item))  # not an attribute a BUILD could set
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return None


MAX_CHECKPOINT_VALUES = 2_000_000
"""The most values (containers and leaves, tensors counted once each) a checkpoint may hold when
every shared reference is followed: a run's holds tens of thousands; a list that holds itself twice
at each of 60 levels would be 2^60 to every reader that walks it."""


MAX_CHECKPOINT_DEPTH = 64
"""The deepest a checkpoint's containers may nest (a run's nest a few levels; every reader that
recurses, OmegaConf's included, would fail on a list a million levels deep)."""


def _fewer_values_than(obj: Any, limit: int, depth: int) -> bool:
    """Whether walking ``obj`` (lists, tuples, dicts, dataclass instances: :func:`contents`;
    anything else a leaf) visits fewer than ``limit`` values, following every reference, a shared
    one once per place it appears, and never goes more than ``depth`` containers deep."""
    stack, seen = [(obj, 0)], 0
    while stack:
        value, level = stack.pop()
        seen += 1
        if seen >= limit or level > depth:
            return False
        stack.extend((item, level + 1) for item in contents(value))
    return True


FAULT_ENV = "TCLIGHTNING_TEST_KILL"
"""Test-only fault injection: ``POINT@STEP`` kills this process (SIGKILL) when the checkpoint
code reaches ``POINT`` with ``STEP`` RL steps completed. Points, in order: ``step-start`` (the next
step begins), ``written`` (checkpoint written to its temporary file, nothing committed),
``half-written`` (the same, with the temporary file cut in half), ``step-file`` (``step-S.ckpt``
committed, ``last.ckpt`` not yet), ``committed`` (both committed)."""


def fault_point(point: str, step: int) -> None:
    """Kill this process here if :data:`FAULT_ENV` asks for ``point`` at ``step`` (tests only)."""
    if os.environ.get(FAULT_ENV) == f"{point}@{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def reopen_completed_batch(checkpoint: dict[str, Any]) -> bool:
    """Make a checkpoint whose last batch Lightning already counted as completed look like one
    saved at the end of that step's batch, the form every other checkpoint has (Lightning adds the
    step back when it restarts from that form). Two such checkpoints exist: one saved at the end of
    training (the epoch counted as finished too: resumed with a larger ``trainer.steps`` it would
    end at once), and one saved by a SIGTERM that arrived after the step, during its validation
    (resumed as is, the run would log the next step one row too far). Returns whether it changed
    anything (checkpoints of the batch-end form are left as they are)."""
    loops = checkpoint.get("loops", {}).get("fit_loop")
    if not loops:
        return False
    batches, epochs = loops.get("epoch_loop.batch_progress"), loops.get("epoch_progress")
    if not batches or not epochs:
        return False
    if batches["total"]["completed"] != batches["total"]["processed"] or batches["total"]["processed"] < 1:
        return False
    finished_epoch = epochs["total"].get("completed", 0) >= 1
    for part in ("total", "current"):
        batches[part]["completed"] = batches[part]["processed"] - 1
        if finished_epoch:
            epochs[part]["completed"] = epochs[part]["processed"] = epochs[part]["started"] - 1
    batches["is_last_batch"] = False
    state = loops.setdefault("epoch_loop.state_dict", {})
    state["_batches_that_stepped"] = max(int(state.get("_batches_that_stepped", 1)) - 1, 0)
    if finished_epoch:
        checkpoint["epoch"] = max(int(checkpoint.get("epoch", 1)) - 1, 0)
    return True


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class OwnFileCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` with its writes done by :func:`~tclightning.files.save_tensors`:
    a new temporary file beside the checkpoint, renamed over it. Lightning's own write stages the
    file in ``$TMPDIR`` and, when that is another filesystem, copies it onto the name, following a
    link planted there (and needing the whole checkpoint's size free in ``$TMPDIR``). Its reads go
    through :func:`load_checkpoint`, every check included: Lightning resolves ``ckpt_path="hpc"``,
    ``"last"`` or ``"best"`` to a file itself, and would otherwise unpickle it unchecked."""

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        if weights_only is False:
            raise TclightningError(f"checkpoint {path}: loading it with weights_only=False could run code; tclightning "
                                   "reads checkpoints as data only")
        checkpoint = load_checkpoint(path)
        require_lightning_checkpoint(checkpoint, f"checkpoint {path}")
        return checkpoint

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options")
        Path(path).parent.mkdir(parents=True, exist_ok=True)  # as Lightning's own writer does
        save_tensors(checkpoint, Path(path))


class StepCheckpoint(Checkpoint):
    """Writes ``step-{S:06d}.ckpt`` every ``every_n_steps`` RL steps (keeping the newest
    ``keep``), and ``last.ckpt`` whenever it saves: every ``every_n_steps`` steps, after the
    last step, and when a run stops early at a step boundary (Ctrl-C, SIGTERM, a health stop).
    A checkpoint holds everything to continue: weights, optimizer, scheduler, loop counters,
    callback states and the module's RNG/sampler state. With ``model.lora`` the weights are the
    adapters alone; the frozen base is rebuilt from the recipe on resume
    (:meth:`~tclightning.grpo.module.GRPOModule.on_save_checkpoint`).

    Every checkpoint is taken at the end of its step's batch, so a resume (with the same or a
    larger ``trainer.steps``) continues with the next step. It is written to a temporary file and
    committed (renamed to ``step-S.ckpt``, then ``last.ckpt``) only once the step's metrics row is
    on disk: a checkpoint never claims a step whose row a kill could still lose. ``step-S.ckpt``
    and ``last.ckpt`` are separate files, each replaced atomically, so a kill during a save
    leaves the previous ones whole. As a ``Checkpoint`` subclass Lightning runs it after every
    other callback, so the states it saves include what they did at the end of the step. Each
    file is written by a rename of a new temporary file beside it (the strategy's default
    checkpoint writer becomes :class:`OwnFileCheckpointIO`), never through a link planted at a name.
    """

    def __init__(self, dirpath: str | os.PathLike, every_n_steps: int = 0, keep: int = 2) -> None:
        self.dirpath = Path(dirpath)
        self.every_n_steps = every_n_steps
        self.keep = keep
        self.saved_step = -1
        self._pending: int | None = None  # step written to the temporary file, not yet committed
        self.committed_step: int | None = None  # step of the last checkpoint this process published
        self._folders: tuple[SameFolder, SameFolder] | None = None  # checkpoints/ and the run folder, as first seen
        self._written: tuple[int, int] | None = None  # (st_dev, st_ino) of the temporary file last written

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # Lightning's default: ours writes by rename
            trainer.strategy.checkpoint_io = OwnFileCheckpointIO()

    @property
    def last_path(self) -> Path:
        return self.dirpath / "last.ckpt"

    @property
    def _tmp_path(self) -> Path:
        return self.dirpath / ".last.ckpt.tmp"

    def save(self, trainer: L.Trainer) -> Path:
        """Write the state after the completed steps to the temporary file (every rank takes
        part; rank 0 writes); :meth:`commit` publishes it once its metrics row is on disk."""
        step = completed_steps(trainer)
        if step == self.saved_step:
            return self.last_path
        self.dirpath.mkdir(parents=True, exist_ok=True)
        self._check_folders()
        self.saved_step = step  # first: the checkpoint records that it holds this step
        with self._refused_writes(step):
            trainer.save_checkpoint(self._tmp_path, weights_only=False)
        if trainer.is_global_zero:
            info = os.stat(self._tmp_path)
            self._written = (info.st_dev, info.st_ino)
            self._pending = step
            fault_point("written", step)
            if os.environ.get(FAULT_ENV) == f"half-written@{step}":
                os.truncate(self._tmp_path, self._tmp_path.stat().st_size // 2)
                fault_point("half-written", step)
        return self.last_path

    def commit(self, trainer: L.Trainer) -> None:
        """Publish the pending checkpoint: flush every logger (the step's row reaches the disk
        first), then ``step-S.ckpt`` (a copy) and ``last.ckpt``, each by an atomic rename."""
        if self._pending is None:
            return
        step, self._pending = self._pending, None
        for logger in trainer.loggers:
            logger.save()
        with self._refused_writes(step):
            self._publish(step)

    def _check_folders(self) -> None:
        """Stop (one line) when ``checkpoints/`` or the run folder was replaced during the run: a
        checkpoint written by name would land in the folder put in its place (another run's)."""
        if self._folders is None:
            self._folders = (SameFolder(self.dirpath), SameFolder(self.dirpath.parent))
        for folder in self._folders:
            folder.check()

    def _held_folder(self) -> Any:
        """``checkpoints/`` through its descriptor, once checked to be the folder first taken."""
        assert self._folders is not None
        return self._folders[0].held()

    def _publish(self, step: int) -> None:
        try:
            self._check_folders()
        except TclightningError:  # the file just written went into the folder put in place: take it back
            with contextlib.suppress(OSError):
                info = os.stat(self._tmp_path)
                if (info.st_dev, info.st_ino) == self._written:
                    os.unlink(self._tmp_path)
            raise
        # on disk already: written by a rename, after an fsync (OwnFileCheckpointIO). Everything from
        # here goes through the folder checked: a link swapped in since never receives nor loses a file.
        with self._held_folder() as folder:
            tmp = folder / self._tmp_path.name
            if self.every_n_steps and self.keep > 0:
                # A resumed run replaces the step files its earlier run wrote past the resume point:
                # `step-S` is always the newest state for step S (what metrics.csv now shows).
                copy_file(tmp, folder / f"step-{step:06d}.ckpt")  # a copy, not a link: damage to one never reaches the other
                # Prune among steps up to this one: files further on (from before a resume) are
                # replaced when the run gets there, and must not push out the one just written.
                for old in own_step_files(folder, step)[: -self.keep]:
                    old.unlink()
                fault_point("step-file", step)
            os.replace(tmp, folder / self.last_path.name)
            _fsync(folder)
        self._check_folders()  # moved meanwhile: the checkpoint is in the folder moved, and the run stops here
        self.committed_step = step
        fault_point("committed", step)

    @contextmanager
    def _refused_writes(self, step: int) -> Iterator[None]:
        """A write the storage refuses (full, read-only, quota) becomes one line: the temporary files
        are removed, the committed checkpoints stay as they were, and the run stops."""
        try:
            yield
        except OSError as err:
            self._pending = None
            with contextlib.suppress(OSError):
                self._tmp_path.unlink()
            kept = (f"{self.last_path} (step {self.committed_step})" if self.committed_step is not None
                    else str(self.last_path) if self.last_path.is_file() else None)  # a resumed run's
            then = (f"{kept} is kept: once the storage takes writes again (space, permissions), resume with "
                    f"`tclightning run --resume {self.dirpath.parent}`"
                    if kept else "no checkpoint of this run was written, so there is nothing to resume")
            raise StorageError(f"cannot write the checkpoint of step {step} in {self.dirpath}: "
                               f"{err.strerror or err}; {then}") from None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A resume in place from an earlier file than last.ckpt continues that file's history:
        # last.ckpt becomes its state before the first new step (the one it replaces is kept as
        # last.before-step-S.ckpt), so a kill from here on resumes this history, never a mix.
        resumed = Path(trainer.ckpt_path) if trainer.ckpt_path else None
        if (not trainer.is_global_zero or resumed is None or resumed.name == self.last_path.name
                or not self.last_path.is_file() or not resumed.parent.samefile(self.dirpath)):
            return
        kept = unused_name(self.dirpath / f"last.before-step-{completed_steps(trainer)}.ckpt")
        try:  # a second name for the old state, then the new state under last.ckpt: never a moment without one
            os.link(self.last_path, kept)
        except OSError:  # a filesystem without hard links
            copy_file(self.last_path, kept)
        copy_file(resumed, self.last_path)
        _fsync(self.dirpath)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        # The previous step's row was logged and flushed when its batch ended.
        self.commit(trainer)
        if trainer.is_global_zero:
            fault_point("step-start", completed_steps(trainer))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        step = completed_steps(trainer)
        periodic = bool(self.every_n_steps) and step % self.every_n_steps == 0
        last = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch or step >= trainer.num_training_batches
        # Saved here, not in on_train_end, also at the last step and on a stop: Lightning then
        # records the step as the end of a batch, not the epoch as finished, so the checkpoint
        # resumes (with a larger trainer.steps too) instead of ending the run at once.
        if periodic or last or trainer.should_stop or trainer.received_sigterm:
            self.save(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.commit(trainer)
        if self.saved_step != completed_steps(trainer):  # stopped by a hook that runs after this one
            self.save(trainer)
            self.commit(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # A pending checkpoint is published only if its step's row reached the loggers (Lightning
        # logs it right after counting the batch completed); otherwise it is dropped.
        if self._pending is not None:
            if trainer.fit_loop.epoch_loop.batch_progress.total.completed >= self._pending:
                self.commit(trainer)
            else:
                self._pending = None
        # Lightning raises SIGTERMException only between steps, so the state is consistent.
        if isinstance(exception, SIGTERMException):
            self.save(trainer)
            self.commit(trainer)

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        # Runs before Lightning restores its loops: a checkpoint written at the end of training
        # by an earlier version, or by a SIGTERM during a validation, resumes like any other.
        reopen_completed_batch(checkpoint)

    def state_dict(self) -> dict[str, Any]:
        return {"saved_step": self.saved_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.saved_step = state_dict.get("saved_step", -1)


class SigtermBeforeTraining(L.Callback):
    """Until training starts, SIGTERM stops a run as Ctrl-C does (one line; a run folder that saved
    nothing is removed): there is no step to finish yet; and either signal is remembered, so one a
    library's bare ``except:`` swallowed (while the model loads, the trainer sets up, a checkpoint
    is restored) stops the run at the next hook instead of being lost. Used as a context manager
    around the whole run and passed to the trainer, whose ``on_train_start`` hands SIGTERM over to
    Lightning (finish the step, checkpoint, stop) and Ctrl-C back to :class:`GracefulStop`'s
    handling; a second SIGTERM during training stops at once, as a second Ctrl-C does (a long step
    is not waited for). Off the main thread no handler can be set: it does nothing."""

    def __init__(self) -> None:
        self.armed = False
        self.received = False
        self.training = False
        self.over = False  # the fit has ended
        self.late: int | None = None  # a Ctrl-C or SIGTERM taken as the fit ended
        self._in_training = 0  # SIGTERMs since training started (Lightning calls this handler after its own)
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> SigtermBeforeTraining:
        try:
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handle)
            self.armed = True
        except ValueError:  # not the main thread
            self._restore(signal.SIGTERM)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.armed or self.over:
            self.received = True
            interrupt(signum, frame)
        elif not self.training:  # the fit is ending (its last checkpoint, Lightning's teardown): said once
            self.late = signum  # the run's record is written (it was lost here)
        elif signum == signal.SIGINT:  # after training started (its handler is back by then, but a race)
            interrupt(signum, frame)
        else:  # Lightning, holding SIGTERM, called it after its own: it stops after the step
            self._in_training += 1
            if self._in_training > 1:
                interrupt(signum, frame)
            print("\nSIGTERM: stopping after this step (SIGTERM again to stop now)", flush=True)

    def _restore(self, signum: int) -> None:
        previous = self._previous.pop(signum, None)
        if previous is not None:
            signal.signal(signum, previous)

    def _stop_if_received(self) -> None:
        """The interrupt again, at a hook: a library's bare ``except:`` may have swallowed the first."""
        if self.armed and self.received:
            raise KeyboardInterrupt

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._stop_if_received()

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop_if_received()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop_if_received()
        self.armed = False
        self.training = True
        previous = self._previous.pop(signal.SIGINT, None)  # Ctrl-C during training: finish the step (GracefulStop)
        if previous is not None and signal.getsignal(signal.SIGINT) == self._handle:  # not yet taken over
            signal.signal(signal.SIGINT, previous)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.training = False  # the last checkpoint is being committed: SIGTERM only asks to stop

    def fit_over(self) -> int | None:
        """From now on a Ctrl-C or SIGTERM stops the command as it does before training (one after the
        fit, while the run wrote its summary, was swallowed here). Returns the signal taken as the fit
        ended, if any, for the run to raise again once its record is written."""
        self.over = True
        return self.late

    def __exit__(self, *exc: object) -> None:
        self.armed = False
        self.training = False
        for signum in list(self._previous):
            self._restore(signum)


class GracefulStop(L.Callback):
    """First Ctrl-C: finish the current RL step, then stop (``StepCheckpoint`` saves on the way
    out). A second Ctrl-C interrupts at once. Across processes a Ctrl-C or SIGTERM one rank alone
    took stops every rank after the same step (agreed at the end of each step).

    The stop ends the run as SIGTERM does: the validation the schedule (``trainer.val_every``)
    has at that step runs, and no other. Lightning validates on any ``trainer.should_stop``
    (meant for early stopping), so a stop at a step without a scheduled validation turns
    validation off for the few hooks left in this run: an interrupted-then-resumed run then logs
    exactly the validations of one that never stopped."""

    def __init__(self) -> None:
        self.requested = False
        self.sigterm = False  # across processes: a SIGTERM this rank took, not yet agreed
        self._previous: Any = None
        self._limit_val_batches: Any = None  # restored at the end of training when the stop changed it

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            signal.signal(signal.SIGINT, self._previous or signal.default_int_handler)
            raise KeyboardInterrupt
        self.requested = True
        print("\nstopping after this step (Ctrl-C again to abort now)", flush=True)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._previous is not None:  # installed already (a fit restarted): keep the handler from before it
            return
        try:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        except ValueError:  # not the main thread: leave signals alone
            self._previous = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.world_size > 1:  # before Lightning registers its handlers (after on_fit_start)
            # Its SIGTERM notifier broadcasts from inside the handler, a collective the other ranks
            # are not in at that moment: a pipeline's ranks then wait on each other until the
            # timeout. Noted here instead, and agreed at the end of the step.
            trainer._signal_connector._sigterm_notifier_fn = self._note_sigterm

    def _note_sigterm(self, signum: int, frame: Any) -> None:
        self.sigterm = True

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        stop = self.requested
        if trainer.world_size > 1:  # a Ctrl-C or SIGTERM one rank alone took: all stop after this same step
            agreed = trainer.strategy.reduce(torch.tensor([float(self.requested), float(self.sigterm)]), reduce_op="max")
            # What every rank decides for this step is the agreed value alone. A signal this rank
            # takes while it waits in the reduce is kept for the next step's agreement (written
            # over by the agreed "no", it was lost: the run trained on to its last step).
            stop = bool(agreed[0])
            self.requested = self.requested or stop  # a Ctrl-C after the agreed stop aborts at once
            if bool(agreed[1]):  # Lightning stops every rank at the end of this step, checkpoint first
                self.sigterm = True
                trainer._signal_connector.received_sigterm = True
        if not stop or trainer.should_stop:
            return
        # Lightning's own decision, asked before the stop is set (it then reads `should_stop` as
        # "validate now"): is a validation due at this step anyway?
        try:
            scheduled = trainer.fit_loop.epoch_loop._should_check_val_fx(trainer.fit_loop._data_fetcher)
        except AttributeError:  # a Lightning without these internals: its own stop (one more validation)
            scheduled = True
        trainer.should_stop = True
        if not scheduled:
            self._limit_val_batches = trainer.limit_val_batches
            trainer.limit_val_batches = 0  # no validation on the way out (enable_validation is False)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._limit_val_batches is not None:
            trainer.limit_val_batches, self._limit_val_batches = self._limit_val_batches, None

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # After every on_train_end (the last checkpoint is committed there): a Ctrl-C until then
        # still only asks to stop, and the run ends as it would have.
        self._restore()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._restore()

    def _restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
