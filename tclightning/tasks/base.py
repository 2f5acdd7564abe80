"""The task contract: examples in, a reward in [0, 1] out.

A task is prompts plus a verifier. The trainer never looks inside: it asks for
``train_examples()`` / ``eval_examples()``, samples completions for ``Example.prompt`` and
scores them with ``reward`` / ``rewards``. Pure logic: no torch, no Lightning.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Example:
    """One prompt with its verifiable answer.

    Attributes:
        uid: stable id, ``"<task>/<split>/<index>"`` (e.g. ``"gsm8k/train/123"``); the same
            config yields the same uids, so logs and replays can refer to examples by it.
        prompt: the user-message text. The sampler applies the model's chat template (and
            ``Task.system_prompt``) when the model has one; otherwise it feeds this text raw.
        answer: the ground-truth final answer only (``"72"``, ``"\\frac{1}{2}"``).
        solution: a correct completion for ``prompt``, ending in a form the task's reward
            accepts (arithmetic ``"85"``; GSM8K ``"... The answer is 72."``; MATH
            ``"... \\boxed{ans} ..."``). Used for supervised warm-up and as a reward self-test.
    """

    uid: str
    prompt: str
    answer: str
    solution: str


class Task(ABC):
    """Prompts plus a verifier.

    Subclasses set ``name`` / ``system_prompt`` and implement ``train_examples``,
    ``eval_examples`` and ``score``. Callers use ``reward`` / ``rewards``, which wrap
    ``score`` so that the contract holds for *any* completion text: a float in [0, 1],
    never an exception (a verifier bug must cost one rollout its reward, not the run).
    """

    name: str = "task"
    system_prompt: str | None = None
    reads_data: bool = True
    """False for a task that generates its problems (``task.path`` and ``task.hf_name`` are refused)."""
    skipped: str | None = None
    """Once the data is loaded: how many rows had no usable question or answer, and where (one
    line for the user), or None when every row was used."""

    @abstractmethod
    def train_examples(self) -> Sequence[Example]:
        """Training examples, in a fixed order for a given config (deterministic)."""

    @abstractmethod
    def eval_examples(self) -> Sequence[Example]:
        """Held-out examples, disjoint from ``train_examples()`` (by content, not only uid)."""

    @abstractmethod
    def score(self, completion: str, example: Example) -> float:
        """The task's verifier. May raise; ``reward`` turns failures into 0.0."""

    def reward(self, completion: str, example: Example) -> float:
        """Reward of one completion, in [0, 1]. Never raises, whatever ``completion`` is."""
        if not isinstance(completion, str):
            return 0.0
        try:
            value = float(self.score(completion, example))
        except Exception:  # noqa: BLE001 -- the contract is "never raises"
            return 0.0
        if math.isnan(value):
            return 0.0
        return min(1.0, max(0.0, value))

    def rewards(self, completions: Sequence[str], examples: Sequence[Example]) -> list[float]:
        """Batch form of ``reward``: ``completions[i]`` is scored against ``examples[i]``.

        Raises ``ValueError`` only for a caller bug (lengths differ), never for the texts.
        """
        if len(completions) != len(examples):
            raise ValueError(
                f"rewards(): {len(completions)} completions but {len(examples)} examples"
            )
        return [self.reward(c, e) for c, e in zip(completions, examples)]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
