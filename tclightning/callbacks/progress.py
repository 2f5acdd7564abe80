"""A progress bar that counts RL steps (not optimizer ticks) and shows what matters: a live bar
on a terminal, plain flushed lines every few steps in a log file or pipe."""

from __future__ import annotations

import math
import sys
import time
from typing import Any, TextIO

import lightning as L
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar

from tclightning.callbacks.steps import completed_steps


class _StepsTotal:
    """Shared by both bars: the total is the recipe's RL steps (the prompt stream has no len)."""

    @property
    def total_train_batches(self) -> int | float:  # type: ignore[override]
        module = self.trainer.lightning_module  # type: ignore[attr-defined]
        return getattr(module, "total_steps", float("inf"))

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)  # type: ignore[misc]
        metrics.pop("v_num", None)
        return metrics


class GRPORichProgressBar(_StepsTotal, RichProgressBar):
    """Rich bar: step n/N, reward, len, tok/s, val/accuracy."""


class GRPOTQDMProgressBar(_StepsTotal, TQDMProgressBar):
    """tqdm bar with the same fields (for logs that are not a terminal)."""


class GRPOPlainProgress(_StepsTotal, ProgressBar):
    """For output that is not a terminal (``make run > log``): one flushed line every ``every``
    RL steps and at the last, ``step 50/200  reward 0.61  len 3.2  tok/s 950  elapsed 21 s``
    (by default ``every`` is a twentieth of the run, at least 1 and at most 50)."""

    def __init__(self, every: int | None = None, stream: TextIO | None = None) -> None:
        super().__init__()
        self.every = every
        self.stream = stream
        self._enabled = True
        self._started = time.perf_counter()

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        total = self.total_train_batches
        done = completed_steps(trainer)
        every = self.every or (max(1, min(50, int(total) // 20)) if math.isfinite(total) else 10)
        if not self._enabled or (done % every and done != total):
            return
        parts = [f"step {done}" + (f"/{int(total)}" if math.isfinite(total) else "")]
        for name, value in self.get_metrics(trainer, pl_module).items():
            parts.append(f"{name} {value:.4g}" if isinstance(value, float) else f"{name} {value}")
        parts.append(f"elapsed {time.perf_counter() - self._started:.0f} s")
        print("  ".join(parts), file=self.stream or sys.stdout, flush=True)


def progress_callback(kind: str, stream: TextIO | None = None) -> ProgressBar | None:
    """The progress display for ``logging.progress`` (``rich`` | ``tqdm`` | ``none``): the chosen
    bar on a terminal, :class:`GRPOPlainProgress` lines when ``stream`` (stdout) is not one, since a
    redrawn bar in a log file is either nothing until the end (rich) or carriage-return noise (tqdm)."""
    if kind not in ("rich", "tqdm"):
        return None
    if not (stream or sys.stdout).isatty():
        return GRPOPlainProgress(stream=stream)
    return GRPORichProgressBar() if kind == "rich" else GRPOTQDMProgressBar()
