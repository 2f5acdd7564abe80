"""``TaskConfig``: every knob of a task, with its range and meaning (recipes set these under ``task:``).

A plain dataclass so that OmegaConf can use it as a structured config
(``OmegaConf.structured(TaskConfig)``); ``Optional[...]`` rather than ``X | None`` because
that is the spelling every OmegaConf version accepts. The task's name is checked against the
registered tasks (``tclightning.tasks.TASKS``, ``tclightning.agentic.ENVIRONMENTS``) with the
task's own settings, by building it (``tclightning/recipes/ranges.py``).
"""

# ruff: noqa: UP045
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, List, Optional

from tclightning.settings import flag, integer, list_of, number, one_of, positive, seed, setting, text

def _solve_rate(value: Any) -> Optional[str]:
    """``task.solve_rate``: null, or ``[low, high]``, each in [0, 1] or null (no bound), low <= high."""
    problem = list_of(number(0.0, 1.0, optional=True), 2, optional=True)(value)
    if problem is None and value is not None and None not in value and value[0] > value[1]:
        return f"expected [low, high] with low at most high, got {list(value)}"
    return problem


ANSWER_AT = ("first", "last")
PROMPT_TEXT_CHARS = 32_768
"""The most characters ``system_prompt``, ``prompt_template`` and ``instruction`` may hold (about 8k
tokens; each goes into every prompt, and every prompt is measured before the run)."""
"""``task.answer_at``: which integer of an arithmetic completion is the answer."""


@dataclass
class TaskConfig:
    """Which task, where its data comes from, and how prompts are built.

    Data source, in order of precedence: ``hf_name`` (Hugging Face hub, needs network),
    then ``path`` (local file or directory), then the shared data copy
    (``$TCLIGHTNING_DATA`` or ``<repo>/../shared/data``). ``arithmetic`` needs no data.
    """

    name: str = setting("arithmetic", text(nonempty=True),
                        'task name: "arithmetic" (synthetic, no files), "gsm8k", "math" (MATH-500 / MATH-style), '
                        '"bigmath"; agentic (multi-turn, tclightning.agentic): "calculator"')
    path: Optional[str] = setting(
        None, text(nonempty=True, optional=True),
        'local data: a .jsonl / .json / .parquet / .csv file, or a directory holding "<split>.<ext>" files '
        "(e.g. train.jsonl, test.jsonl). A single file, or a directory with only one split, is cut into a "
        "deterministic train / held-out pair")
    hf_name: Optional[str] = setting(
        None, text(nonempty=True, optional=True),
        'Hugging Face `datasets` name, e.g. "openai/gsm8k" (with hf_config "main"), "HuggingFaceH4/MATH-500", '
        '"SynthLabsAI/Big-Math-RL-Verified". Overrides `path`')
    hf_config: Optional[str] = setting(None, text(optional=True),
                                       '`datasets` configuration name (the second argument of load_dataset), e.g. "main"')
    split: str = setting(
        "train", text(nonempty=True),
        'split used for training. If the source lacks it but holds exactly one split (MATH-500 ships only "test"), '
        "that split is used and the held-out set is carved from it")
    eval_split: Optional[str] = setting(
        None, text(nonempty=True, optional=True),
        'split used for evaluation. None: "test" when the source has it (and it is not `split`), otherwise a '
        "deterministic held-out slice of the training split")
    train_size: Optional[int] = setting(None, positive(optional=True),
                                        "cap on the number of training examples (None: all); applied after the held-out cut")
    eval_size: int = setting(64, integer(0, 10**6),
                             "number of held-out examples (a seeded sample when the eval split is larger)")
    seed: int = setting(0, seed(), "seed for every random choice a task makes (held-out cut, eval sample, arithmetic problems)")
    system_prompt: Optional[str] = setting(None, text(optional=True, max_chars=PROMPT_TEXT_CHARS),
                                           "system message for chat models (None: none)")
    prompt_template: str = setting(
        "{question}", text(nonempty=True, max_chars=PROMPT_TEXT_CHARS),
        'user-message template; the literal "{question}" is replaced by the question. Other braces are left alone '
        '(no str.format), so LaTeX like "\\boxed{}" is safe in templates')
    instruction: Optional[str] = setting(
        None, text(optional=True, max_chars=PROMPT_TEXT_CHARS),
        'answer-format instruction appended after the templated question (blank line between). None: the task\'s '
        'default (gsm8k: "... The answer is N."; math: "... \\boxed{}"; arithmetic: none, its tiny character-level '
        'model never sees instructions). "": none')
    reward_timeout_s: float = setting(
        2.0, number(0.0, 3600.0, low_open=True),
        "wall-clock limit (seconds) for verifying one completion (math-verify / sympy can hang on adversarial "
        "output); past it the completion scores 0")
    digits: int = setting(2, positive(), "arithmetic: operands are drawn from [0, 10**digits)")
    operations: str = setting("+", text(nonempty=True),
                              'arithmetic: operators to draw from, any of "+-*" (e.g. "+-"). "-" keeps results >= 0')
    num_train: int = setting(5000, positive(10**6),
                             "arithmetic: number of training problems (capped by the number of distinct problems)")
    reverse_answer: bool = setting(
        False, flag,
        'arithmetic: write answers least-significant digit first ("37+48=" -> "58"), the order in which carries '
        "are computed; tiny models learn it in hundreds of steps, not thousands")
    answer_at: str = setting(
        "first", one_of(ANSWER_AT),
        'arithmetic: which integer of the completion is the answer, "first" or "last". A chat model tends to '
        'restate the problem ("3 + 4 = 7"), so its answer is the last integer it writes')
    max_turns: int = setting(
        4, positive(),
        "agentic tasks (calculator): most interactions (model replies) per trajectory; a conversation still going "
        "after this many is cut off unfinished, with no reward")
    chain: int = setting(
        2, positive(),
        'calculator: binary operations per problem ("(12+34)*56" has 2); the tool does one per call. It also reads '
        "`digits`, `operations`, `num_train`, `eval_size` and `seed` as arithmetic does")
    solve_rate: Optional[List[Optional[float]]] = setting(
        None, _solve_rate,
        "bigmath: [low, high], keep problems whose `llama8b_solve_rate` (share of Llama-3.1-8B samples that solved "
        "them) lies in it; either end null = no bound on that side (e.g. [0.2, null]); null = every problem. With a "
        "bound set, rows without a solve rate are dropped")
    sources: Optional[List[str]] = setting(
        None, list_of(text(nonempty=True), optional=True),
        'bigmath: keep only these `source` values (e.g. ["olympiads", "MATH"]); None = all sources')


RETIRED_KEYS = ("fixed_width",)
"""Keys of the ``task`` section an earlier version saved that no option reads now: ``fixed_width``
(zero-padded arithmetic operands and answers) was never measured and is gone."""

MOVED_KEYS: dict[str, str] = {"min_solve_rate": "solve_rate: [low, high]", "max_solve_rate": "solve_rate: [low, high]"}
"""Keys of the ``task`` section an earlier version read, and the key that holds each now (:func:`upgrade`)."""


def upgrade(section: Mapping[str, Any]) -> dict[str, Any]:
    """A ``task`` section as an earlier version saved it, in today's keys (the two bounds are one pair)."""
    out = dict(section)
    if "min_solve_rate" in out or "max_solve_rate" in out:
        low, high = out.pop("min_solve_rate", None), out.pop("max_solve_rate", None)
        out["solve_rate"] = None if low is None and high is None else [low, high]
    return out
