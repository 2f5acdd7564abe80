"""GRPO hyperparameters (the ``grpo`` section of a recipe), TRL-style: every knob documented."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GRPOConfig:
    """Knobs of the GRPO update. Defaults follow DAPO/TRL practice unless docs/concepts.md says otherwise."""

    prompts_per_step: int = 8  # P prompts per RL step; the step trains on P x G completions
    lr: float = 1.0e-5
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    warmup_steps: int = 0  # linear LR warm-up, in optimizer ticks
    epochs: int = 1  # mu: passes over the step's rollouts
    minibatches: int = 1  # optimizer ticks per pass; tick count per step = epochs x minibatches
    clip_low: float = 0.2  # ratio clipped to [1 - clip_low, 1 + clip_high] ("clip-higher")
    clip_high: float = 0.28
    loss_aggregation: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum-norm
    scale_rewards: str = "group"  # group: (r - mean)/std in the group; none: r - mean (Dr.GRPO)
    kl_coef: float = 0.0  # k3 KL to the frozen initial policy; 0 disables (no reference kept)
    max_grad_norm: float = 1.0  # 0 disables clipping; the pre-clip norm is logged either way
    drop_zero_variance_groups: bool = False  # drop groups whose rewards are all equal (no signal)
    overlong: str = "none"  # none | mask (truncated completions get no loss) | penalty
    overlong_penalty: float = 1.0  # reward subtracted from truncated completions when overlong=penalty
    tis_cap: float = 0.0  # token-level truncated importance sampling vs the sampler; 0 disables
    mask_ratio_low: float = 0.0  # mask tokens with sampler ratio outside [low, high]; 0/0 disables
    mask_ratio_high: float = 0.0
    eps: float = 1.0e-4  # std floor in advantage normalisation
