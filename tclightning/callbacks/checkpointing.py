"""Checkpoints every N RL steps, at the end, and on a clean stop (Ctrl-C, SIGTERM)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from tclightning.callbacks.steps import completed_steps


class StepCheckpoint(Checkpoint):
    """Writes ``step-{S:06d}.ckpt`` every ``every_n_steps`` RL steps (keeping the newest
    ``keep``), and ``last.ckpt`` whenever it saves, at the end of training, and when a run stops
    early at a step boundary. A checkpoint holds everything to continue: weights, optimizer,
    scheduler, loop counters, callback states and the module's RNG/sampler state.

    ``last.ckpt`` is replaced atomically, so a kill during a save never leaves it broken. As a
    ``Checkpoint`` subclass Lightning runs it after every other callback, so the states it saves
    include what they did at the end of the step.
    """

    def __init__(self, dirpath: str | os.PathLike, every_n_steps: int = 0, keep: int = 2) -> None:
        self.dirpath = Path(dirpath)
        self.every_n_steps = every_n_steps
        self.keep = keep
        self.saved_step = -1

    @property
    def last_path(self) -> Path:
        return self.dirpath / "last.ckpt"

    def save(self, trainer: L.Trainer) -> Path:
        step = completed_steps(trainer)
        if step == self.saved_step:
            return self.last_path
        self.dirpath.mkdir(parents=True, exist_ok=True)
        # Metrics logged up to this step must be on disk before a checkpoint claims the step:
        # a kill after the save then loses nothing a resume will not redo.
        for logger in trainer.loggers:
            logger.save()
        tmp = self.dirpath / ".last.ckpt.tmp"
        trainer.save_checkpoint(tmp, weights_only=False)  # every rank takes part; rank 0 writes
        if not trainer.is_global_zero:
            self.saved_step = step
            return self.last_path
        if self.every_n_steps and self.keep > 0:
            # A resumed run replaces the step files its earlier run wrote past the resume point:
            # `step-S` is always the newest state for step S (what metrics.csv now shows).
            periodic = self.dirpath / f"step-{step:06d}.ckpt"
            link = self.dirpath / ".step.ckpt.tmp"
            link.unlink(missing_ok=True)
            os.link(tmp, link)
            os.replace(link, periodic)
            # Prune among steps up to this one: files further on (from before a resume) are
            # replaced when the run gets there, and must not push out the one just written.
            done = [p for p in sorted(self.dirpath.glob("step-*.ckpt")) if p.name <= periodic.name]
            for old in done[: -self.keep]:
                old.unlink()
        os.replace(tmp, self.last_path)
        self.saved_step = step
        return self.last_path

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.every_n_steps and completed_steps(trainer) % self.every_n_steps == 0:
            self.save(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.save(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # Lightning raises SIGTERMException only between steps, so the state is consistent.
        if isinstance(exception, SIGTERMException):
            self.save(trainer)

    def state_dict(self) -> dict[str, Any]:
        return {"saved_step": self.saved_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.saved_step = state_dict.get("saved_step", -1)


class GracefulStop(L.Callback):
    """First Ctrl-C: finish the current RL step, then stop (``StepCheckpoint`` saves on the way
    out). A second Ctrl-C interrupts at once."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            signal.signal(signal.SIGINT, self._previous or signal.default_int_handler)
            raise KeyboardInterrupt
        self.requested = True
        print("\nstopping after this step (Ctrl-C again to abort now)", flush=True)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        try:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        except ValueError:  # not the main thread: leave signals alone
            self._previous = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.requested:
            trainer.should_stop = True

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
