"""The environment contract of agentic (multi-turn) tasks, and the transcript of one conversation.

An environment is one task instance played as a conversation: ``reset()`` gives the first
observation (the user message), ``step(action)`` takes the model's reply and answers with the
next observation, a reward and whether the episode is over (gym's contract, with text on both
sides). Pure logic: no torch, no Lightning.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tclightning.tasks.base import Example

Message = dict[str, str]  # {"role": "user" | "assistant" | "system", "content": ...}, as chat templates take them


@dataclass(frozen=True)
class StepResult:
    """What the environment answers to one action.

    ``info`` keys the rollout reads (all optional): ``valid`` (the action was well formed; default
    True), ``tool`` (the action was a tool call; default False), ``success`` (on the last step: the
    task was solved; default ``reward > 0``).
    """

    observation: str
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


class Environment(ABC):
    """One task instance as a conversation: ``reset() -> observation``, then
    ``step(action) -> StepResult`` until ``done``. Must never raise on model text."""

    @abstractmethod
    def reset(self) -> str:
        """Start (or restart) the episode; returns the first observation."""

    @abstractmethod
    def step(self, action: str) -> StepResult:
        """Apply the model's reply ``action``."""


class AgenticTask(ABC):
    """Task instances (``Example``) plus the environment that plays each and an expert for it.

    ``train_examples`` / ``eval_examples`` follow the ``tasks.base.Task`` contract (deterministic,
    disjoint), so the trainer's prompt stream and validation index them the same way.
    ``max_turns`` caps the interactions of one trajectory (the rollout stops there, unfinished).
    """

    name: str = "agentic"
    system_prompt: str | None = None
    reads_data: bool = True
    """False for a task that generates its problems (``task.path`` and ``task.hf_name`` are refused)."""
    skipped: str | None = None
    """Once the data is loaded: how many rows had no usable question or answer, and where (one
    line for the user), or None when every row was used."""
    max_turns: int = 4

    @abstractmethod
    def train_examples(self) -> Sequence[Example]:
        """Training instances, in a fixed order for a given config."""

    @abstractmethod
    def eval_examples(self) -> Sequence[Example]:
        """Held-out instances, disjoint from the training ones."""

    @abstractmethod
    def make_env(self, example: Example) -> Environment:
        """A fresh environment for ``example``."""

    @abstractmethod
    def demonstration(self, example: Example) -> list[str]:
        """An expert's actions for ``example``, which solve it when replayed (warm-up data)."""


class Transcript:
    """One conversation: ``messages`` alternate user observations and assistant actions.

    ``messages[: 2 i + 1]`` is the history the model saw before its ``i``-th action (``history``),
    i.e. the prompt of interaction ``i``; ``rewards[i]`` and ``infos[i]`` are the environment's
    answer to it. The trajectory's outcome reward is ``sum(rewards)``.
    """

    def __init__(self, observation: str) -> None:
        self.messages: list[Message] = [{"role": "user", "content": observation}]
        self.rewards: list[float] = []
        self.infos: list[dict[str, Any]] = []
        self.done = False

    @property
    def turns(self) -> int:
        return len(self.rewards)

    @property
    def total_reward(self) -> float:
        return float(sum(self.rewards))

    @property
    def success(self) -> bool:
        if not self.done or not self.infos:
            return False
        return bool(self.infos[-1].get("success", self.rewards[-1] > 0))

    def history(self, turn: int) -> list[Message]:
        """The conversation before action ``turn`` (0-based)."""
        return [dict(m) for m in self.messages[: 2 * turn + 1]]

    def record(self, action: str, result: StepResult) -> None:
        self.messages.append({"role": "assistant", "content": action})
        self.messages.append({"role": "user", "content": result.observation})
        self.rewards.append(float(result.reward))
        self.infos.append(dict(result.info))
        self.done = bool(result.done)


def replay(env: Environment, actions: Sequence[str], max_turns: int | None = None) -> Transcript:
    """Play ``actions`` in ``env`` (stopping at ``done`` or after ``max_turns``)."""
    transcript = Transcript(env.reset())
    for action in actions[:max_turns]:
        if transcript.done:
            break
        transcript.record(action, env.step(action))
    return transcript


def demonstration_pairs(task: AgenticTask, examples: Sequence[Example]) -> tuple[list[list[Message]], list[str]]:
    """Supervised pairs from the expert's conversations: one ``(history, action)`` per interaction,
    the same rows the RL update trains on. Raises if an expert fails its own environment."""
    histories: list[list[Message]] = []
    actions: list[str] = []
    for example in examples:
        transcript = replay(task.make_env(example), task.demonstration(example), task.max_turns)
        if not transcript.success:
            raise ValueError(f"{task.name}: the demonstration of {example.uid} does not solve it")
        for turn in range(transcript.turns):
            histories.append(transcript.history(turn))
            actions.append(transcript.messages[2 * turn + 1]["content"])
    return histories, actions
