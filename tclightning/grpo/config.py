"""GRPO hyperparameters (the ``grpo`` section of a recipe), TRL-style: every knob with its range and help."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from tclightning.grpo.loss import AGGREGATIONS
from tclightning.settings import flag, integer, list_of, number, one_of, positive, setting

SCALE_REWARDS = ("group", "none")
"""``grpo.scale_rewards``: (r - mean)/std in the group (GRPO), or r - mean (Dr.GRPO)."""

OVERLONG = ("none", "mask")
"""``grpo.overlong``'s names (a number is the third choice: a penalty)."""


def _overlong(value: Any) -> str | None:
    """``grpo.overlong``: ``none``, ``mask``, or a finite penalty > 0."""
    if value in OVERLONG:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return None
    return f"expected none, mask or a penalty (a finite number > 0), got {value!r}"


def _clip(value: Any) -> str | None:
    """``grpo.clip``: ``[low, high]``, the floor ``1 - low`` in [0, 1] and the ceiling ``1 + high`` at least 1."""
    problem = list_of(number(0.0), 2)(value)
    if problem is None and value[0] > 1.0:
        return f"expected [low, high] with low in [0, 1] (the floor 1 - low stays >= 0), got {list(value)}"
    return problem


def _band(value: Any) -> str | None:
    """``grpo.mask_ratio``: null, or ``[low, high]`` with ``0 <= low < high``."""
    problem = list_of(number(0.0), 2, optional=True)(value)
    if problem is None and value is not None and not value[0] < value[1]:
        return f"expected [low, high] with low below high, got {list(value)}"
    return problem


@dataclass
class GRPOConfig:
    """Knobs of the GRPO update. Defaults follow DAPO/TRL practice unless docs/concepts.md says otherwise."""

    prompts_per_step: int = setting(8, positive(2**20), "P prompts per RL step; the step trains on P x G completions")
    lr: float = setting(1.0e-5, number(0.0, 1.0e3, low_open=True), "AdamW learning rate")
    weight_decay: float = setting(0.0, number(0.0), "AdamW weight decay")
    betas: list[float] = setting([0.9, 0.99], list_of(number(0.0, 1.0, high_open=True), 2), "AdamW betas")
    warmup_steps: int = setting(0, integer(0), "linear LR warm-up, in optimizer ticks")
    epochs: int = setting(1, positive(1000), "mu: passes over the step's rollouts")
    minibatches: int = setting(1, positive(1 << 16), "optimizer ticks per pass; tick count per step = epochs x minibatches")
    clip: list[float] = setting(
        [0.2, 0.28], _clip,
        '[low, high]: the ratio is clipped to [1 - low, 1 + high] ("clip-higher", DAPO); low in [0, 1], high >= 0')
    loss_aggregation: str = setting("token-mean", one_of(AGGREGATIONS), " | ".join(AGGREGATIONS))
    scale_rewards: str = setting("group", one_of(SCALE_REWARDS),
                                 "group: (r - mean)/std in the group; none: r - mean (Dr.GRPO)")
    kl_coef: float = setting(0.0, number(0.0), "k3 KL to the frozen initial policy; 0 disables (no reference kept)")
    max_grad_norm: float = setting(1.0, number(0.0), "0 disables clipping; the pre-clip norm is logged either way")
    drop_zero_variance_groups: bool = setting(False, flag, "drop groups whose rewards are all equal (no signal)")
    overlong: Any = setting("none", _overlong,
                            "what a truncated completion gets: none | mask (no loss) | a number p > 0 (its reward "
                            "lowered by p, e.g. 1.0)")
    tis_cap: float = setting(0.0, number(0.0), "token-level truncated importance sampling vs the sampler; 0 disables")
    mask_ratio: Optional[list[float]] = setting(
        None, _band, "[low, high]: tokens whose ratio to the sampler's probability lies outside get no loss; null: none")

    eps: ClassVar[float] = 1.0e-4
    """Std floor in the advantage normalisation (TRL's constant; not a recipe key)."""

    @property
    def clip_low(self) -> float:
        """``clip``'s low end: the ratio's floor is ``1 - clip_low``."""
        return float(self.clip[0])

    @property
    def clip_high(self) -> float:
        """``clip``'s high end: the ratio's ceiling is ``1 + clip_high``."""
        return float(self.clip[1])

    @property
    def overlong_penalty(self) -> float:
        """The reward a truncated completion loses (``overlong`` as a number; 0 otherwise)."""
        return 0.0 if self.overlong in OVERLONG else float(self.overlong)


RETIRED_KEYS = ("eps",)
"""Keys of the ``grpo`` section an earlier version saved that no option reads now: ``eps`` is the
constant :attr:`GRPOConfig.eps`."""

MOVED_KEYS: dict[str, str] = {
    "clip_low": "clip: [low, high]",
    "clip_high": "clip: [low, high]",
    "overlong_penalty": "overlong (a number: the penalty itself, e.g. grpo.overlong=1.0)",
    "mask_ratio_low": "mask_ratio: [low, high]",
    "mask_ratio_high": "mask_ratio: [low, high]",
}
"""Keys of the ``grpo`` section an earlier version read, and the key that holds each now (:func:`upgrade`)."""


def upgrade(section: Mapping[str, Any]) -> dict[str, Any]:
    """A ``grpo`` section as an earlier version saved it, in today's keys: ``clip_low/high`` are one
    pair; ``overlong: penalty`` with
    its ``overlong_penalty`` is that number; ``mask_ratio_low/high`` (off while high was 0) are one pair."""
    out = dict(section)
    if "clip_low" in out or "clip_high" in out:
        out["clip"] = [out.pop("clip_low", 0.2), out.pop("clip_high", 0.28)]  # each end's default then
    penalty = out.pop("overlong_penalty", None)
    if out.get("overlong") == "penalty":
        out["overlong"] = 1.0 if penalty is None else penalty
    if "mask_ratio_low" in out or "mask_ratio_high" in out:
        low, high = out.pop("mask_ratio_low", 0.0), out.pop("mask_ratio_high", 0.0)
        out["mask_ratio"] = [low, high] if high else None
    return out
