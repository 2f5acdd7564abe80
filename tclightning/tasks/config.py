"""``TaskConfig``: every knob of a task, with its meaning (recipes set these under ``task:``).

A plain dataclass so that OmegaConf can use it as a structured config
(``OmegaConf.structured(TaskConfig)``); ``Optional[...]`` rather than ``X | None`` because
that is the spelling every OmegaConf version accepts.
"""

# ruff: noqa: UP045
from dataclasses import dataclass
from typing import List, Optional


@dataclass
class TaskConfig:
    """Which task, where its data comes from, and how prompts are built.

    Data source, in order of precedence: ``hf_name`` (Hugging Face hub, needs network),
    then ``path`` (local file or directory), then the shared data copy
    (``$TCLIGHTNING_DATA`` or ``<repo>/../shared/data``). ``arithmetic`` needs no data.
    """

    # Task name: "arithmetic" (synthetic, no files), "gsm8k" or "math" (MATH-500 / MATH-style);
    # agentic (multi-turn, tclightning.agentic): "calculator".
    name: str = "arithmetic"
    # Local data: a .jsonl / .json / .parquet / .csv file, or a directory holding
    # "<split>.<ext>" files (e.g. train.jsonl, test.jsonl). A single file, or a directory with
    # only one split, is cut into a deterministic train / held-out pair.
    path: Optional[str] = None
    # Hugging Face `datasets` name, e.g. "openai/gsm8k" (with hf_config "main"),
    # "HuggingFaceH4/MATH-500", "SynthLabsAI/Big-Math-RL-Verified". Overrides `path`.
    hf_name: Optional[str] = None
    # `datasets` configuration name (the second argument of load_dataset), e.g. "main".
    hf_config: Optional[str] = None
    # Split used for training. If the source lacks it but holds exactly one split (MATH-500
    # ships only "test"), that split is used and the held-out set is carved from it.
    split: str = "train"
    # Split used for evaluation. None: "test" when the source has it (and it is not `split`),
    # otherwise a deterministic held-out slice of the training split.
    eval_split: Optional[str] = None
    # Cap on the number of training examples (None: all). Applied after the held-out cut.
    train_size: Optional[int] = None
    # Number of held-out examples (a seeded sample when the eval split is larger).
    eval_size: int = 64
    # Seed for every random choice a task makes (held-out cut, eval sample, arithmetic problems).
    seed: int = 0
    # System message for chat models (None: no system message).
    system_prompt: Optional[str] = None
    # User-message template; the literal "{question}" is replaced by the question. Other braces
    # are left alone (no str.format), so LaTeX like "\boxed{}" is safe in templates.
    prompt_template: str = "{question}"
    # Answer-format instruction appended after the templated question (blank line between).
    # None: the task's default (gsm8k: "... The answer is N."; math: "... \boxed{}";
    # arithmetic: none, its tiny character-level model never sees instructions). "": none.
    instruction: Optional[str] = None
    # Wall-clock limit (seconds) for verifying one completion (math-verify / sympy can hang on
    # adversarial output); past it the completion scores 0.
    reward_timeout_s: float = 2.0
    # arithmetic: operands are drawn from [0, 10**digits).
    digits: int = 2
    # arithmetic: operators to draw from, any of "+-*" (e.g. "+-"). "-" keeps results >= 0.
    operations: str = "+"
    # arithmetic: number of training problems (capped by the number of distinct problems).
    num_train: int = 5000
    # arithmetic: write answers least-significant digit first ("37+48=" -> "58"), the order
    # in which carries are computed; tiny models learn it in hundreds of steps, not thousands.
    reverse_answer: bool = False
    # arithmetic: zero-pad operands to `digits` and answers to the widest result ("07+48=" ->
    # "055"), so every problem has the same character layout (positions carry meaning).
    fixed_width: bool = False
    # arithmetic: which integer of the completion is the answer, "first" or "last". A chat model
    # tends to restate the problem ("3 + 4 = 7"), so its answer is the last integer it writes.
    answer_at: str = "first"
    # agentic tasks (calculator): most interactions (model replies) per trajectory; a
    # conversation still going after this many is cut off unfinished, with no reward.
    max_turns: int = 4
    # calculator: binary operations per problem ("(12+34)*56" has 2); the tool does one per call.
    # It also reads `digits`, `operations`, `num_train`, `eval_size` and `seed` as arithmetic does.
    chain: int = 2
    # bigmath: keep problems whose `llama8b_solve_rate` (share of Llama-3.1-8B samples that solved
    # them) lies in [min_solve_rate, max_solve_rate]; None = no bound. With a bound set, rows
    # without a solve rate are dropped.
    min_solve_rate: Optional[float] = None
    max_solve_rate: Optional[float] = None
    # bigmath: keep only these `source` values (e.g. ["olympiads", "MATH"]); None = all sources.
    sources: Optional[List[str]] = None
