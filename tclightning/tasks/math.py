"""MATH-style competition problems with LaTeX answers, verified by math-verify.

Accepted row shapes (the question is ``question`` or ``problem``):

* local MATH-500 copy: ``answer`` = worked solution ending ``The answer is: <ans>``;
* ``HuggingFaceH4/MATH-500``, Big-Math: a plain ``answer`` (plus an optional ``solution``);
* Hendrycks MATH: only a ``solution`` with a ``\\boxed{}``.

MATH-500 ships one split ("test"): the held-out set is then a seeded cut of it (see
``DatasetTask``).
"""

from __future__ import annotations

import math

from tclightning.errors import TclightningError
from tclightning.tasks.base import Example
from tclightning.tasks.config import TaskConfig
from tclightning.tasks.data import DatasetTask, Row, first_field
from tclightning.tasks.rewards import extract_boxed, verify_math

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
_ANSWER_MARKER = "The answer is:"


def math_gold(row: Row) -> tuple[str, str] | None:
    """(answer, solution) of a row, or None when no answer can be found."""
    answer = first_field(row, "answer")
    solution = first_field(row, "solution")
    if answer is not None and _ANSWER_MARKER in answer:
        worked, marked = (part.strip() for part in answer.rsplit(_ANSWER_MARKER, 1))
        if not marked:
            return None
        if extract_boxed(worked) is None:
            worked = f"{worked}\nThe answer is $\\boxed{{{marked}}}$."
        return marked, worked
    if answer is not None and "\\boxed" in answer:
        boxed = extract_boxed(answer)
        return (boxed, answer) if boxed else None
    if answer is not None:
        gold = answer.strip()
        if solution is None or extract_boxed(solution) is None:
            solution = f"The answer is $\\boxed{{{gold}}}$."
        return gold, solution
    if solution is not None:
        boxed = extract_boxed(solution)
        return (boxed, solution) if boxed else None
    return None


class MathTask(DatasetTask):
    """MATH / MATH-500 / Big-Math; reward = ``rewards.verify_math`` within
    ``cfg.reward_timeout_s`` (last ``\\boxed{}`` of the completion vs the answer)."""

    name = "math"
    default_subdir = "math500"
    default_instruction = INSTRUCTION

    def __init__(self, cfg: TaskConfig) -> None:
        super().__init__(cfg)
        if cfg.reward_timeout_s is not None and math.isnan(cfg.reward_timeout_s):  # every reward would be 0.0
            raise TclightningError("task.reward_timeout_s is NaN; give the seconds one completion's verification "
                                   "may take")
        self.reward_timeout_s = cfg.reward_timeout_s

    def parse_row(self, row: Row) -> tuple[str, str, str] | None:
        question = first_field(row, "question", "problem")
        gold = math_gold(row)
        if question is None or gold is None:
            return None
        return question, gold[0], gold[1]

    def score(self, completion: str, example: Example) -> float:
        return verify_math(completion, example.answer, self.reward_timeout_s)
