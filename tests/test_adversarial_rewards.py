"""Adversarial completions against every reward function: each call returns the right verdict
within a hard wall-clock bound, whatever the text (huge exponents, power towers, factorials,
deep nesting, giant digit runs, other scripts' digits, null bytes, megabyte completions), and
an interrupted import of math-verify never poisons later verdicts.

The bound is generous on purpose (the limit plus 3 s for a loaded CI machine): unbounded, the
worst of these inputs run for minutes (``\\boxed{1e99999999}`` did)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tclightning.agentic.calculator import CalculatorEnv
from tclightning.tasks import TaskConfig, build_task
from tclightning.tasks.base import Example
from tclightning.tasks.rewards import verify_gsm8k, verify_math

REPO = Path(__file__).resolve().parents[1]
LIMIT_S = 0.5  # the math reward's time limit in this module
BOUND_S = LIMIT_S + 3.0  # per call, on the main thread
WORKER_BOUND_S = LIMIT_S + 1.0 + 3.0  # off the main thread: limit + the worker's kill grace + slack
MB = 1_000_000

# Every reward function of the package, scoring a completion against the answer 2 ("1+1").
EXAMPLE = Example("adversarial/test/0", "1+1=", "2", "2")


def _task_reward(name: str, **settings: object) -> Callable[[str], float]:
    cfg = TaskConfig(name=name, path="unused.jsonl", reward_timeout_s=LIMIT_S, **settings)  # type: ignore[arg-type]
    task = build_task(cfg)
    return lambda completion: task.reward(completion, EXAMPLE)


def _calculator_reward(completion: str) -> float:
    return CalculatorEnv("1+1", 2).step(completion).reward


REWARDS: dict[str, Callable[[str], float]] = {
    "verify_math": lambda completion: verify_math(completion, "2", timeout_s=LIMIT_S),
    "verify_gsm8k": lambda completion: verify_gsm8k(completion, "2"),
    "math": _task_reward("math"),
    "bigmath": _task_reward("bigmath"),
    "gsm8k": _task_reward("gsm8k"),
    "arithmetic": _task_reward("arithmetic"),
    "arithmetic_reversed": _task_reward("arithmetic", reverse_answer=True),
    "calculator": _calculator_reward,
}

# None of these answers 2, in any task's format: each must score 0.0.
ADVERSARIAL: dict[str, str] = {
    "exponent-boxed": r"\boxed{1e99999999}",
    "exponent-negative": r"\boxed{1e-99999999}",
    "exponent-7-digits": r"\boxed{1e9999999}",
    "exponent-zero-mantissa": r"\boxed{0e99999999}",
    "exponent-unboxed": "The answer is 1e99999999",
    "exponent-times-ten": r"\boxed{1.5\times 10^{99999999}}",
    "exponent-sum": r"\boxed{1e99999999 + 1}",
    "tower-of-tens": r"\boxed{10^{10^{10}}}",
    "tower-of-nines": r"\boxed{9^{9^{9}}}",
    "tower-unboxed": "So we get $10^{10^{10}}$",
    "python-power": r"\boxed{9**9**9}",
    "python-power-unboxed": "9**9**9",
    "big-power": r"\boxed{3^{10^{9}}}",
    "factorial-of-power": r"\boxed{(10^{10})!}",
    "factorial-literal": r"\boxed{99999999!}",
    "binomial": r"\boxed{\binom{10^{9}}{5\cdot 10^8}}",
    "nested-braces": r"\boxed{" + "{" * 400 + "7" + "}" * 400 + "}",
    "nested-fractions": r"\boxed{" + r"\frac{1}{" * 300 + "3" + "}" * 300 + "}",
    "nested-sqrt": r"\boxed{" + r"\sqrt{" * 200 + "3" + "}" * 200 + "}",
    "digits-boxed-999": r"\boxed{" + "9" * 999 + "}",
    "digits-boxed-5000": r"\boxed{" + "9" * 5000 + "}",
    "digits-past-int-str-limit": "The answer is " + "1" * 4301,
    "digits-100k": "9" * 100_000,
    "decimal-990-places": r"\boxed{0." + "0" * 990 + "7}",
    "calc-huge-operands": "calc:" + "9" * 100_000 + "*" + "9" * 100_000,
    "answer-huge": "answer:" + "3" * 100_000,
    "arabic-indic-digit": "answer:\u0662 The answer is \u0662, \\boxed{\u0662}",
    "fullwidth-digit": "\uff12 \\boxed{\uff12}",
    "superscript-digit": "\u00b2 \\boxed{\u00b2}",
    "null-bytes": "\x00" * 1000 + "\\boxed{\x00}",
    "lone-surrogates": "\ud800 \\boxed{\udfff}",
    "nan": r"\boxed{NaN}",
    "1mb-text": "x" * MB,
    "1mb-digits": "7" * MB,
    "1mb-boxes": "\\boxed{" * (MB // 7),
    "1mb-parens": "(" * MB,
    "1mb-spaces": " " * MB,
    "1mb-commas": "1," * (MB // 2) + "7",
    "1mb-answer-is": "The answer is " * (MB // 14),
    "1mb-hashes": "#### " * (MB // 5),
}

# Right answers, in the formats each reward reads: each must still score 1.0.
LEGITIMATE: dict[str, list[str]] = {
    "math": [
        r"\boxed{2}",
        r"so $\boxed{\frac{4}{2}}$.",
        r"\boxed{2.0}",
        r"\boxed{2e0}",
        r"\boxed{\sqrt{4}}",  # only math-verify sees this one: it still runs after the rest
        "\x00 " + r"\boxed{2}",
        "x" * MB + r" \boxed{2}",
    ],
    "gsm8k": ["The answer is 2.", "#### 2", r"\boxed{2}", "2.00", "x" * MB + " The answer is 2."],
    "arithmetic": ["2", "2 and then some text", "2" + "x" * MB],
    "calculator": ["answer:2", "answer: 2 "],
}
FAMILY = {
    "verify_math": "math",
    "math": "math",
    "bigmath": "math",
    "verify_gsm8k": "gsm8k",
    "gsm8k": "gsm8k",
    "arithmetic": "arithmetic",
    "arithmetic_reversed": "arithmetic",
    "calculator": "calculator",
}


def _timed(reward: Callable[[str], float], completion: str) -> tuple[float, float]:
    start = time.monotonic()
    value = reward(completion)
    return value, time.monotonic() - start


@pytest.fixture(scope="module", autouse=True)
def _math_verify_imported() -> None:
    # The one-time import of math-verify (~1-2 s, outside every limit) is not a per-call cost.
    verify_math(r"\boxed{\sqrt{8}}", r"2\sqrt{2}")


@pytest.mark.parametrize("case", list(ADVERSARIAL))
@pytest.mark.parametrize("reward", list(REWARDS))
def test_adversarial_completion_scores_zero_within_the_bound(reward: str, case: str) -> None:
    value, elapsed = _timed(REWARDS[reward], ADVERSARIAL[case])
    assert value == 0.0
    assert elapsed < BOUND_S, f"{reward} took {elapsed:.1f} s on {case}"


@pytest.mark.parametrize(
    ("reward", "completion"),
    [(reward, text) for reward in REWARDS for text in LEGITIMATE[FAMILY[reward]]],
    ids=lambda value: value[:24] if isinstance(value, str) else None,
)
def test_legitimate_answers_still_score_one(reward: str, completion: str) -> None:
    value, elapsed = _timed(REWARDS[reward], completion)
    assert value == 1.0
    assert elapsed < BOUND_S


def test_the_worker_path_bounds_every_call() -> None:
    """Off the main thread (no SIGALRM there) math-verify runs in a worker process: the same
    inputs are bounded there too, and a legitimate verdict still comes back afterwards."""
    hostile = [
        "exponent-boxed", "tower-of-tens", "tower-of-nines", "factorial-of-power", "nested-braces", "1mb-text"
    ]
    results: dict[str, tuple[float, float]] = {}

    def work() -> None:
        results["warm"] = _timed(REWARDS["math"], r"\boxed{\sqrt{4}}")  # starts the worker
        for case in hostile:
            results[case] = _timed(REWARDS["math"], ADVERSARIAL[case])
        results["after"] = _timed(REWARDS["math"], r"\boxed{\sqrt{4}}")

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(180)
    assert not thread.is_alive()
    assert results["warm"][0] == 1.0 and results["after"][0] == 1.0
    for case in hostile:
        value, elapsed = results[case]
        assert value == 0.0, case
        assert elapsed < WORKER_BOUND_S, f"{case} took {elapsed:.1f} s in the worker"
    assert results["after"][1] < WORKER_BOUND_S


def _fresh_pythons(scripts: list[str]) -> list[dict[str, object]]:
    """Run each script in a new interpreter (nothing imported yet), side by side; each prints
    one JSON line last."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for script in scripts
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


_CHECK = r"""
ok = verify_math(r"\boxed{\sqrt{8}}", r"2\sqrt{2}", timeout_s=30)
wrong = verify_math(r"\boxed{\sqrt{8}}", r"3\sqrt{2}", timeout_s=30)
print(json.dumps({"first": first, "ok": ok, "wrong": wrong}))
"""


def test_a_tiny_limit_on_the_first_call_does_not_poison_the_verifier() -> None:
    # The first call used to import math-verify (1-2 s) under its own limit; a limit firing
    # inside that import left sympy half-built and every later verdict 0.0. Limits of several
    # sizes land at different points of the old import; now the import runs before any limit.
    scripts = [
        "import json\nfrom tclightning.tasks.rewards import verify_math\n"
        f'first = verify_math(r"\\boxed{{\\sqrt{{8}}}}", r"2\\sqrt{{2}}", timeout_s={limit})\n' + _CHECK
        for limit in (0.2, 0.6)
    ]
    for result in _fresh_pythons(scripts):
        assert result["ok"] == 1.0 and result["wrong"] == 0.0, result


def test_an_interrupted_import_leaves_nothing_half_built() -> None:
    # An interrupt (Ctrl-C, someone else's alarm) lands inside the import of math-verify, at
    # three points in turn: inside sympy's package init, inside latex2sympy, inside the
    # warm-up's lazy sympy imports. An import hook raises it, so the points are exact.
    script = r'''
import importlib.abc, json, sys
from tclightning.tasks.rewards import verify_math

class CutAt(importlib.abc.MetaPathFinder):
    def __init__(self, name):
        self.name = name
    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name:
            sys.meta_path.remove(self)
            raise KeyboardInterrupt
        return None

first = []
for name in ["sympy.assumptions", "latex2sympy2_extended.latex2sympy2", "sympy.integrals.risch"]:
    sys.meta_path.insert(0, CutAt(name))
    try:
        verify_math(r"\boxed{\sqrt{8}}", r"2\sqrt{2}", timeout_s=30)
        first.append("not cut: " + name)
    except KeyboardInterrupt:
        first.append("cut")
''' + _CHECK
    (result,) = _fresh_pythons([script])
    assert result["first"] == ["cut", "cut", "cut"]  # the interrupt reached the caller each time
    assert result["ok"] == 1.0 and result["wrong"] == 0.0
