"""The embedded synthetic task: ``"37+48="`` -> ``"85"``. Needs no files, runs offline.

Made for a tiny character-level model: with the default template and no instruction,
prompts use only ``ALPHABET`` (digits, ``+-*=``, space, lowercase letters, ``.,:?!()``).
Operands are drawn from ``[0, 10**digits)``; for ``-`` the larger operand comes first, so
every answer is a non-negative integer (a character-level model never has to emit a sign).

Determinism and disjointness: the problems form one seeded stream of *distinct* prompts;
the first ``eval_size`` are the held-out set and the next ones the training set. The
stream depends only on (seed, digits, operations), so the eval set does not move when
``num_train`` / ``train_size`` change.

``reverse_answer`` writes answers least-significant digit first (``"37+48="`` -> ``"58"``):
the order carries are computed in, which a tiny transformer learns far faster.
"""

from __future__ import annotations

import operator
import random
import re
from collections.abc import Callable, Iterator, Sequence

from tclightning.errors import TclightningError
from tclightning.tasks.base import Example, Task
from tclightning.tasks.config import ANSWER_AT, TaskConfig
from tclightning.tasks.data import build_prompt, check_template
from tclightning.tasks.rewards import NUMBER_PATTERN, number_text

ALPHABET = frozenset("0123456789+-*= abcdefghijklmnopqrstuvwxyz.,:?!()")
OPERATIONS: dict[str, Callable[[int, int], int]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
}
# Up to this many distinct problems the whole space is enumerated and shuffled; above it,
# problems are drawn with rejection of repeats (the space is then too big to list).
_ENUMERATE_LIMIT = 200_000
_MAX_DIGITS = 9
# ASCII digits only: int() would also read other scripts' digits, which the answers never use.
# Digit runs are capped before int() (first_integer), so no completion makes int() slow.
# A numeral is read whole, as the gsm8k reward reads it (``NUMBER_PATTERN``): one with a fraction or
# an exponent ("85.9", "85e3") or one an expression continues ("85²", "85/2", "3×85", "10^85") is not
# the integer of its first or last digits; "85,000" is 85000 (groups of three).
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+", re.ASCII)
_INTEGER = re.compile(r"-?[0-9]+")  # not str.isdigit, which takes "85²" for digits
# reverse_answer: the digit string the completion starts with, whatever follows it (a character-level
# model writes on until its token limit; the documented runs of the embedded recipes were scored so).
_FIRST_DIGITS = re.compile(r"\s*(\d+)", re.ASCII)


def first_integer(text: str) -> int | None:
    """The first integer in ``text`` (a leading ``-`` counts, or any minus sign ``normalize_minus``
    reads, also spaced off: "- 85"), or None. A first numeral with a fraction or an exponent ("85.9"), one an
    expression continues ("85²", "85/2") or a giant digit run -> None."""
    match = NUMBER_PATTERN.search(number_text(text.strip()))
    return _as_integer(match.group()) if match else None


def last_integer(text: str) -> int | None:
    """The last integer in ``text`` (a leading ``-`` counts, or any minus sign ``normalize_minus``
    reads, also spaced off), or None. A last numeral with a fraction or an exponent, one an expression
    continues ("2/85", "3×85") or a giant digit run -> None."""
    last = None
    for last in NUMBER_PATTERN.finditer(number_text(text)):
        pass
    return _as_integer(last.group()) if last else None


def _as_integer(numeral: str) -> int | None:
    """A numeral as an int; None for a fraction, an exponent or an expression ("85.9", "85/2"), or a
    giant digit run. Thousands commas in groups of three are dropped ("85,000" is 85000)."""
    if _THOUSANDS.fullmatch(numeral):
        numeral = numeral.replace(",", "")
    if len(numeral) > 30 or not _INTEGER.fullmatch(numeral):
        return None
    return int(numeral)


class ArithmeticTask(Task):
    """``a<op>b=`` problems; reward 1.0 iff the first integer of the completion (``task.answer_at:
    last``: the last) is the answer."""

    name = "arithmetic"
    reads_data = False

    def __init__(self, cfg: TaskConfig) -> None:
        if not 1 <= cfg.digits <= _MAX_DIGITS:
            raise TclightningError(f"task.digits must be in 1..{_MAX_DIGITS}, got {cfg.digits}")
        ops = sorted(set(cfg.operations), key=cfg.operations.index)
        unknown = [op for op in ops if op not in OPERATIONS]
        if not ops or unknown:
            raise TclightningError(
                f"task.operations must be a non-empty string of {''.join(OPERATIONS)}, "
                f"got {cfg.operations!r}"
            )
        check_template(cfg.prompt_template)
        if cfg.answer_at not in ANSWER_AT:
            raise TclightningError(f"task.answer_at must be {' or '.join(map(repr, ANSWER_AT))}, got {cfg.answer_at!r}")
        if cfg.answer_at == "last" and cfg.reverse_answer:
            raise TclightningError("task.answer_at 'last' reads a plain integer: it does not combine with "
                                   "task.reverse_answer (a digit string read from the start)")
        self.cfg = cfg
        self.ops = ops
        self.system_prompt = cfg.system_prompt
        self.instruction = cfg.instruction or ""  # the tiny model has no use for instructions
        self._examples: tuple[tuple[Example, ...], tuple[Example, ...]] | None = None

    @property
    def num_problems(self) -> int:
        """How many distinct problems the settings allow."""
        n = 10**self.cfg.digits
        return sum(n * (n + 1) // 2 if op == "-" else n * n for op in self.ops)

    def _stream(self) -> Iterator[tuple[int, str, int]]:
        """Distinct (a, op, b) in a seeded order; ``a >= b`` for ``-``."""
        rng = random.Random(self.cfg.seed)
        n = 10**self.cfg.digits
        if self.num_problems <= _ENUMERATE_LIMIT:
            space = [
                (a, op, b)
                for op in self.ops
                for a in range(n)
                for b in range(a + 1 if op == "-" else n)
            ]
            rng.shuffle(space)
            yield from space
            return
        seen: set[tuple[int, str, int]] = set()
        while True:
            op = self.ops[rng.randrange(len(self.ops))]
            a, b = rng.randrange(n), rng.randrange(n)
            if op == "-" and a < b:
                a, b = b, a
            if (a, op, b) not in seen:
                seen.add((a, op, b))
                yield a, op, b

    def _example(self, split: str, index: int, a: int, op: str, b: int) -> Example:
        answer = str(OPERATIONS[op](a, b))
        question = f"{a}{op}{b}="
        if self.cfg.reverse_answer:
            answer = answer[::-1]
        prompt = build_prompt(question, self.cfg.prompt_template, self.instruction)
        return Example(f"arithmetic/{split}/{index}", prompt, answer, answer)

    def _load(self) -> tuple[tuple[Example, ...], tuple[Example, ...]]:
        if self._examples is not None:
            return self._examples
        cfg = self.cfg
        eval_size = max(cfg.eval_size, 0)
        n_train = cfg.num_train if cfg.train_size is None else min(cfg.num_train, cfg.train_size)
        n_train = min(n_train, self.num_problems - eval_size)
        if n_train <= 0:
            raise TclightningError(
                f"arithmetic: {self.num_problems} distinct problems leave none for training "
                f"after eval_size={eval_size} (raise digits or add operations)"
            )
        stream = self._stream()
        evals = tuple(self._example("eval", i, *next(stream)) for i in range(eval_size))
        train = tuple(self._example("train", i, *next(stream)) for i in range(n_train))
        self._examples = (train, evals)
        return self._examples

    def train_examples(self) -> Sequence[Example]:
        return self._load()[0]

    def eval_examples(self) -> Sequence[Example]:
        return self._load()[1]

    def score(self, completion: str, example: Example) -> float:
        if self.cfg.reverse_answer:  # a digit string: keep leading zeros
            match = _FIRST_DIGITS.match(completion)
            return 1.0 if match is not None and match.group(1) == example.answer else 0.0
        value = last_integer(completion) if self.cfg.answer_at == "last" else first_integer(completion)
        return 1.0 if value is not None and str(value) == example.answer else 0.0
