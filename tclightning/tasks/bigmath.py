"""Big-Math: ~251k math problems with closed-form, verifiable answers, curated for RL (Apache-2.0).

Source: ``SynthLabsAI/Big-Math-RL-Verified`` on the Hugging Face hub (one ``train`` split), loaded
by name through ``datasets`` when neither ``task.path`` nor ``task.hf_name`` is set; offline, point
``task.path`` at a local ``.parquet`` / ``.jsonl`` (file or directory) with the same columns:

* ``problem`` -- the question text;
* ``answer`` -- the closed-form final answer (no worked solution);
* ``source`` -- the collection it came from (``orca_math``, ``cn_k12``, ``olympiads``, ``MATH``, ...);
* ``domain`` -- a list of topic labels;
* ``llama8b_solve_rate`` -- the share of Llama-3.1-8B samples that solved it (may be missing).

Rewards are MATH's: the last ``\\boxed{}`` of a completion (else math-verify's own extraction)
against ``answer``, by :func:`tclightning.tasks.rewards.verify_math`. With one split, the
held-out set is a seeded cut of it (see ``DatasetTask``); ``solve_rate`` (``[low, high]``)
and ``sources`` filter rows before that cut.
"""

from __future__ import annotations

import copy
import math
import re
from typing import Any

from tclightning.console import shown as printable
from tclightning.errors import TclightningError
from tclightning.tasks.base import Example
from tclightning.tasks.config import TaskConfig
from tclightning.tasks.math import MathTask

HF_NAME = "SynthLabsAI/Big-Math-RL-Verified"
_PLAIN_RATE = re.compile(r"\s*[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?\s*", re.ASCII)

COLUMNS = ("problem", "answer", "source", "domain", "llama8b_solve_rate")


def solve_rate_bounds(cfg: TaskConfig) -> tuple[float | None, float | None]:
    """``task.solve_rate`` as ``(low, high)``; None where there is no bound."""
    if cfg.solve_rate is None:
        return None, None
    low, high = cfg.solve_rate
    return low, high


class BigMathTask(MathTask):
    """Big-Math problems; reward 1.0 iff the completion's final answer equals ``answer`` (math-verify)."""

    name = "bigmath"
    default_subdir = "bigmath"  # only read if someone sets hf_name and path to None explicitly

    def __init__(self, cfg: TaskConfig) -> None:
        low, high = solve_rate_bounds(cfg)
        for value in (low, high):
            if value is not None and not 0.0 <= value <= 1.0:
                raise TclightningError(f"task.solve_rate: each bound must be in [0, 1] or null, got {value}")
        if low is not None and high is not None and low > high:
            raise TclightningError(f"task.solve_rate: low {low} exceeds high {high}")
        self.from_hub_default = not cfg.hf_name and not cfg.path
        if self.from_hub_default:
            cfg = copy.copy(cfg)
            cfg.hf_name = HF_NAME
        super().__init__(cfg)
        self.sources = set(cfg.sources) if cfg.sources else None

    def keep(self, row: dict[str, Any]) -> bool:
        """The row passes the source and solve-rate filters; a filter column of another type (a
        list, a text) is one line naming it."""
        source = row.get("source")
        if self.sources is not None:
            if source is not None and not isinstance(source, str):
                raise TclightningError(f"task data: a row's source is {printable(repr(source))[:80]}, not a name "
                                       "(task.sources filters on it)")
            if source not in self.sources:
                return False
        low, high = solve_rate_bounds(self.cfg)
        if low is None and high is None:
            return True
        rate = row.get("llama8b_solve_rate")
        if isinstance(rate, str) and _PLAIN_RATE.fullmatch(rate):  # a .csv task file's cells are read as text
            rate = float(rate)
        if rate is None or rate == "":
            return False
        try:
            if isinstance(rate, bool) or not isinstance(rate, (int, float)):
                raise TypeError
            rate = float(rate)  # an int past any float: OverflowError
        except (TypeError, OverflowError):
            raise TclightningError(f"task data: a row's llama8b_solve_rate is {printable(repr(rate))[:80]}, not a "
                                   "number (task.solve_rate filters on it)") from None
        if math.isnan(rate):
            return False
        return (low is None or rate >= low) and (high is None or rate <= high)

    def select_rows(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [row for row in rows if self.keep(row)]

    def _load(self) -> tuple[tuple[Example, ...], tuple[Example, ...]]:
        try:
            return super()._load()
        except TclightningError as err:
            if self.from_hub_default:
                raise TclightningError(
                    f"{err}\n(bigmath loads {HF_NAME} from the Hugging Face hub; offline, set task.path to a "
                    f"local .parquet/.jsonl with columns {', '.join(COLUMNS[:2])}, ...)"
                ) from err
            raise
