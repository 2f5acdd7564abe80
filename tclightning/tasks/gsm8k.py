"""GSM8K: grade-school word problems with an integer answer (MIT licence).

Rows: ``{"question", "answer"}`` where ``answer`` is the worked solution with calculator
annotations (``<<2+3=5>>``) and a final ``#### N`` line (local copy and ``openai/gsm8k``
alike). A plain ``answer`` without ``####`` is taken as the number itself.
"""

from __future__ import annotations

import re

from tclightning.tasks.base import Example
from tclightning.tasks.data import DatasetTask, Row, first_field
from tclightning.tasks.rewards import extract_gsm8k_answer, last_number, numbers_equal, verify_gsm8k

INSTRUCTION = (
    "Solve the problem step by step. End with the final number in the form: The answer is N."
)
_CALCULATOR = re.compile(r"<<[^<>]*>>")


def gsm8k_solution(answer_text: str, gold: str) -> str:
    """The dataset's worked solution as a completion: annotations removed and the ``#### N``
    line replaced by ``The answer is N.`` (the form the prompt asks for)."""
    steps = _CALCULATOR.sub("", answer_text.rsplit("####", 1)[0]).strip()
    return f"{steps}\nThe answer is {gold}." if steps else f"The answer is {gold}."


class GSM8KTask(DatasetTask):
    """GSM8K with the reward of ``rewards.verify_gsm8k``: the completion's final number
    (``\\boxed{N}`` > ``#### N`` > ``The answer is N`` > last number) equals the answer."""

    name = "gsm8k"
    default_subdir = "gsm8k"
    default_instruction = INSTRUCTION

    def parse_row(self, row: Row) -> tuple[str, str, str] | None:
        question = first_field(row, "question", "problem")
        answer_text = first_field(row, "answer")
        if question is None or answer_text is None:
            return None
        gold = extract_gsm8k_answer(answer_text)
        if gold is None:  # no "####": accept a bare number as the answer itself
            bare = answer_text.strip()
            gold = last_number(bare) if last_number(bare) in (bare, bare.replace(",", "")) else None
        # an answer read whole that is no number ("#### 3×10^3", "#### 1,5") is an unusable row, not
        # a gold no completion can match (it was read as 3 or 1)
        if gold is None or not numbers_equal(gold, gold):
            return None
        return question, gold, gsm8k_solution(answer_text, gold)

    def score(self, completion: str, example: Example) -> float:
        return verify_gsm8k(completion, example.answer)
