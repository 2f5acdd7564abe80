"""The RL step as Lightning counts it (shared by callbacks that act per step)."""

from __future__ import annotations

import lightning as L


def completed_steps(trainer: L.Trainer) -> int:
    """RL steps whose ``training_step`` has finished (valid inside ``on_train_batch_end`` too).

    With manual optimisation ``trainer.global_step`` counts optimizer ticks, several per RL
    step; the batch counter is the unit users set in recipes and see in TensorBoard.
    """
    return trainer.fit_loop.epoch_loop.batch_progress.total.processed


def rl_step(trainer: L.Trainer) -> int:
    """The RL step being logged now: the row number loggers give the current step's metrics."""
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)
