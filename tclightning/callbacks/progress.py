"""A progress bar that counts RL steps (not optimizer ticks) and shows what matters."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar


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
