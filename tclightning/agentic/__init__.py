"""Agentic multi-turn training: a trajectory is a conversation with an environment, and each of
its interactions is one training row (prompt = the history so far, completion = the reply),
sharing the trajectory's outcome reward and group-normalised advantage.

``env`` (the contract, transcripts) and ``calculator`` (the shipped tool game) are pure logic;
``rollout`` is the torch side that plays conversations with a sampler and builds the rows.
"""

from __future__ import annotations

from collections.abc import Callable

from tclightning.agentic.calculator import CalculatorEnv, CalculatorTask
from tclightning.agentic.env import (
    AgenticTask,
    Environment,
    Message,
    StepResult,
    Transcript,
    demonstration_pairs,
    replay,
)
from tclightning.errors import TclightningError
from tclightning.tasks.config import TaskConfig

ENVIRONMENTS: dict[str, Callable[[TaskConfig], AgenticTask]] = {"calculator": CalculatorTask}


def is_agentic(name: str) -> bool:
    """Whether ``task.name`` names an agentic (multi-turn) task."""
    return name in ENVIRONMENTS


def build_agentic_task(cfg: TaskConfig) -> AgenticTask:
    """The agentic task named by ``cfg.name``."""
    if cfg.name not in ENVIRONMENTS:
        raise TclightningError(f"unknown agentic task '{cfg.name}'; known: {', '.join(sorted(ENVIRONMENTS))}")
    if cfg.max_turns < 1:
        raise TclightningError(f"task.max_turns must be at least 1, got {cfg.max_turns}")
    return ENVIRONMENTS[cfg.name](cfg)


__all__ = ["ENVIRONMENTS", "AgenticTask", "CalculatorEnv", "CalculatorTask", "Environment", "Message", "StepResult",
           "Transcript", "build_agentic_task", "demonstration_pairs", "is_agentic", "replay"]
