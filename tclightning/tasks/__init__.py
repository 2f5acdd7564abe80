"""Tasks: prompts plus verifiable rewards (arithmetic, GSM8K, MATH, Big-Math).

``build_task(TaskConfig(name=...))`` is the one entry point the trainer needs; see
``base.Task`` for the contract and ``rewards`` for the verifiers. Pure logic: no torch.
"""

from __future__ import annotations

from collections.abc import Callable

from tclightning.errors import TclightningError
from tclightning.tasks.arithmetic import ArithmeticTask
from tclightning.tasks.base import Example, Task
from tclightning.tasks.bigmath import BigMathTask
from tclightning.tasks.config import TaskConfig
from tclightning.tasks.data import shared_data_dir
from tclightning.tasks.gsm8k import GSM8KTask
from tclightning.tasks.math import MathTask

TASKS: dict[str, Callable[[TaskConfig], Task]] = {
    "arithmetic": ArithmeticTask,
    "bigmath": BigMathTask,
    "gsm8k": GSM8KTask,
    "math": MathTask,
}


def build_task(cfg: TaskConfig) -> Task:
    """The task named by ``cfg.name``. Cheap: data is loaded on first use, not here.

    Accepts a ``TaskConfig`` or anything with the same attributes (an OmegaConf node).
    Raises ``TclightningError`` for an unknown name or invalid settings.
    """
    factory = TASKS.get(cfg.name)
    if factory is None:
        raise TclightningError(
            f"unknown task '{cfg.name}'; known tasks: {', '.join(sorted(TASKS))}"
        )
    return factory(cfg)


__all__ = ["TASKS", "Example", "Task", "TaskConfig", "build_task", "shared_data_dir"]
