"""GRPO hyperparameters (the ``grpo`` section of a recipe), TRL-style: every knob with its range and help."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tclightning.grpo.loss import AGGREGATIONS
from tclightning.settings import flag, integer, list_of, number, one_of, positive, setting

SCALE_REWARDS = ("group", "none")
"""``grpo.scale_rewards``: (r - mean)/std in the group (GRPO), or r - mean (Dr.GRPO)."""

OVERLONG = ("none", "mask", "penalty")
"""``grpo.overlong``: what a truncated completion gets."""


@dataclass
class GRPOConfig:
    """Knobs of the GRPO update. Defaults follow DAPO/TRL practice unless docs/concepts.md says otherwise."""

    prompts_per_step: int = setting(8, positive(2**20), "P prompts per RL step; the step trains on P x G completions")
    lr: float = setting(1.0e-5, number(0.0, low_open=True), "AdamW learning rate")
    weight_decay: float = setting(0.0, number(0.0), "AdamW weight decay")
    betas: list[float] = setting([0.9, 0.99], list_of(number(0.0, 1.0, high_open=True), 2), "AdamW betas")
    warmup_steps: int = setting(0, integer(0), "linear LR warm-up, in optimizer ticks")
    epochs: int = setting(1, positive(1000), "mu: passes over the step's rollouts")
    minibatches: int = setting(1, positive(1 << 16), "optimizer ticks per pass; tick count per step = epochs x minibatches")
    clip_low: float = setting(0.2, number(0.0, 1.0),
                              'ratio clipped to [1 - clip_low, 1 + clip_high] ("clip-higher"); the floor stays in [0, 1]')
    clip_high: float = setting(0.28, number(0.0), "the ratio's ceiling is 1 + clip_high")
    loss_aggregation: str = setting("token-mean", one_of(AGGREGATIONS), " | ".join(AGGREGATIONS))
    scale_rewards: str = setting("group", one_of(SCALE_REWARDS),
                                 "group: (r - mean)/std in the group; none: r - mean (Dr.GRPO)")
    kl_coef: float = setting(0.0, number(0.0), "k3 KL to the frozen initial policy; 0 disables (no reference kept)")
    max_grad_norm: float = setting(1.0, number(0.0), "0 disables clipping; the pre-clip norm is logged either way")
    drop_zero_variance_groups: bool = setting(False, flag, "drop groups whose rewards are all equal (no signal)")
    overlong: str = setting("none", one_of(OVERLONG), "none | mask (truncated completions get no loss) | penalty")
    overlong_penalty: float = setting(1.0, number(0.0),
                                      "reward subtracted from truncated completions when overlong=penalty")
    tis_cap: float = setting(0.0, number(0.0), "token-level truncated importance sampling vs the sampler; 0 disables")
    mask_ratio_low: float = setting(0.0, number(0.0), "mask tokens with sampler ratio outside [low, high]; 0/0 disables")
    mask_ratio_high: float = setting(0.0, number(0.0), "the upper end of that band (> 0 turns masking on)")

    eps: ClassVar[float] = 1.0e-4
    """Std floor in the advantage normalisation (TRL's constant; not a recipe key)."""


RETIRED_KEYS = ("eps",)
"""Keys of the ``grpo`` section an earlier version saved that no option reads now: ``eps`` is the
constant :attr:`GRPOConfig.eps`."""
