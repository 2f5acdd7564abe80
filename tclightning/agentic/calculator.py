"""The calculator game: an offline, verifiable tool-using environment.

The model is given a chained problem and a calculator that does one binary operation per call::

    user:      (37*48)+12          <- the problem (evaluated as written: innermost first)
    assistant: calc:37*48          <- a tool call
    user:      =1776               <- the tool's result
    assistant: calc:1776+12
    user:      =1788
    assistant: answer:1788         <- ends the episode: reward 1 if right, else 0

Actions: ``calc:<int><op><int>`` (``op`` in ``+-*``) or ``answer:<int>`` (spaces allowed around
the parts). Anything else is answered ``invalid`` and costs a turn. The tool is what makes the
game learnable by a tiny character-level model: it never multiplies, it copies digits from the
problem and from the tool's answers into the right places. With ``chain: 1`` the game has two
interactions (call, answer), with ``chain: 2`` three.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

from tclightning.agentic.env import AgenticTask, Environment, StepResult
from tclightning.errors import TclightningError
from tclightning.tasks.arithmetic import OPERATIONS
from tclightning.tasks.base import Example
from tclightning.tasks.config import TaskConfig

_INT = r"(-?\d{1,30})"  # bounded, so a runaway digit string cannot make the tool slow
# ASCII digits only (re.ASCII): int() would also read other scripts' digits.
_CALL = re.compile(rf"calc:\s*{_INT}\s*([-+*])\s*{_INT}", re.ASCII)
_ANSWER = re.compile(rf"answer:\s*{_INT}", re.ASCII)
INVALID = "invalid"


def parse_action(action: str) -> tuple[str, int, str, int] | tuple[str, int] | None:
    """``("calc", x, op, y)``, ``("answer", n)`` or None for a malformed action (any text,
    or a non-string). Operands are at most 30 digits, so the tool's arithmetic stays cheap."""
    if not isinstance(action, str):
        return None
    text = action.strip()
    if (call := _CALL.fullmatch(text)) is not None:
        return "calc", int(call.group(1)), call.group(2), int(call.group(3))
    if (answer := _ANSWER.fullmatch(text)) is not None:
        return "answer", int(answer.group(1))
    return None


class CalculatorEnv(Environment):
    """One problem. ``step`` rewards only the final answer: 1.0 iff it equals ``answer``.

    ``info``: ``valid`` (well-formed action), ``tool`` (a ``calc:`` call), ``success`` (on the
    answer). Observations end in a newline, which separates them from the next action.
    """

    def __init__(self, question: str, answer: int) -> None:
        self.question = question
        self.answer = answer

    def reset(self) -> str:
        return f"{self.question}\n"

    def step(self, action: str) -> StepResult:
        parsed = parse_action(action)
        if parsed is None:
            return StepResult(f"{INVALID}\n", 0.0, False, {"valid": False, "tool": False})
        if parsed[0] == "calc":
            _, x, op, y = parsed
            return StepResult(f"={OPERATIONS[op](x, y)}\n", 0.0, False, {"valid": True, "tool": True})
        correct = parsed[1] == self.answer
        return StepResult("right\n" if correct else "wrong\n", float(correct), True,
                          {"valid": True, "tool": False, "success": correct})


def chain_problem(operands: Sequence[int], ops: Sequence[str]) -> tuple[str, int, list[str]]:
    """``(question, answer, expert actions)`` for ``((a op1 b) op2 c) ...``."""
    question, value = str(operands[0]), operands[0]
    actions = []
    for i, (op, x) in enumerate(zip(ops, operands[1:], strict=True)):
        actions.append(f"calc:{value}{op}{x}")
        question = f"{question}{op}{x}" if i == 0 else f"({question}){op}{x}"
        value = OPERATIONS[op](value, x)
    return question, value, [*actions, f"answer:{value}"]


class CalculatorTask(AgenticTask):
    """Distinct seeded problems of ``chain`` operations on ``digits``-digit operands; the first
    ``eval_size`` are held out, the next ``num_train`` train (the same stream for a given seed,
    digits, operations and chain, so the eval set does not move with ``num_train``)."""

    name = "calculator"
    reads_data = False

    def __init__(self, cfg: TaskConfig) -> None:
        ops = [op for op in dict.fromkeys(cfg.operations)]
        if not ops or any(op not in OPERATIONS for op in ops):
            raise TclightningError(f"task.operations must be a non-empty string of +-*, got {cfg.operations!r}")
        if not 1 <= cfg.digits <= 6 or not 1 <= cfg.chain <= 4:
            raise TclightningError(f"calculator: task.digits must be in 1..6 and task.chain in 1..4, "
                                   f"got {cfg.digits} and {cfg.chain}")
        if cfg.max_turns < cfg.chain + 1:
            raise TclightningError(f"calculator: task.max_turns={cfg.max_turns} leaves no room for the "
                                   f"{cfg.chain} tool calls and the answer a problem needs")
        self.cfg, self.ops = cfg, ops
        self.system_prompt = cfg.system_prompt
        self.max_turns = cfg.max_turns
        self._split: tuple[list[Example], list[Example]] | None = None
        self._actions: dict[str, list[str]] = {}

    def _load(self) -> tuple[list[Example], list[Example]]:
        if self._split is not None:
            return self._split
        cfg, rng = self.cfg, random.Random(self.cfg.seed)
        space = (10**cfg.digits) ** (cfg.chain + 1) * len(self.ops) ** cfg.chain
        wanted = max(cfg.eval_size, 0) + cfg.num_train
        if wanted > space // 2:  # rejection sampling of distinct problems needs room to spare
            raise TclightningError(f"calculator: {wanted} problems asked of a space of {space}; raise digits or chain")
        seen: set[tuple[tuple[int, ...], tuple[str, ...]]] = set()
        examples: list[Example] = []
        while len(examples) < wanted:
            operands = tuple(rng.randrange(10**cfg.digits) for _ in range(cfg.chain + 1))
            ops = tuple(rng.choice(self.ops) for _ in range(cfg.chain))
            if (operands, ops) in seen:
                continue
            seen.add((operands, ops))
            split, index = ("eval", len(examples)) if len(examples) < cfg.eval_size else ("train", len(examples) - cfg.eval_size)
            question, answer, actions = chain_problem(operands, ops)
            uid = f"calculator/{split}/{index}"
            self._actions[uid] = actions
            examples.append(Example(uid, question, str(answer), actions[-1]))
        self._split = (examples[cfg.eval_size :], examples[: cfg.eval_size])
        return self._split

    def train_examples(self) -> Sequence[Example]:
        return self._load()[0]

    def eval_examples(self) -> Sequence[Example]:
        return self._load()[1]

    def make_env(self, example: Example) -> CalculatorEnv:
        return CalculatorEnv(example.prompt, int(example.answer))

    def demonstration(self, example: Example) -> list[str]:
        self._load()
        return list(self._actions[example.uid])
