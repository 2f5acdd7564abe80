"""Group-relative advantages (pure functions)."""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group", eps: float = 1e-4) -> torch.Tensor:
    """Advantage of each completion relative to its group of ``group_size`` siblings.

    ``rewards`` is ``[P * G]`` with each group contiguous. For group ``g``:
    ``A_i = (r_i - mean_g)`` divided by ``std_g + eps`` when ``scale == "group"`` (GRPO) or not at
    all when ``scale == "none"`` (Dr.GRPO). ``std`` is the unbiased sample std, as in TRL.
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.float().view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale == "group":
        std = grouped.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(grouped[:, :1])
        centred = centred / (std + eps)
    elif scale != "none":
        raise ValueError(f"scale must be 'group' or 'none', got {scale!r}")
    return centred.reshape(-1)


def zero_variance_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[P]`` bool: groups whose rewards are all equal (their advantages carry no signal)."""
    grouped = rewards.view(-1, group_size)
    return grouped.eq(grouped[:, :1]).all(dim=1)


def reward_sem(rewards: torch.Tensor, group_size: int) -> float:
    """Standard error of the batch's mean reward, with each group of ``group_size`` as one cluster.

    Completions of one prompt share its difficulty, so they are not independent draws: the
    mean of ``P`` groups has variance ``var(group means) / P`` (the cluster-robust estimate, which
    counts the prompt term and the within-group term ``sigma^2 / G`` together). With a single
    group it falls back to ``std / sqrt(n)``; 0.0 for one completion. The health rules test
    each step's reward against this error (``reward/sem``).
    """
    flat = rewards.double().reshape(-1)
    if flat.numel() < 2:
        return 0.0
    if group_size < 1 or flat.numel() % group_size:
        raise ValueError(f"{flat.numel()} rewards do not split into groups of {group_size}")
    groups = flat.numel() // group_size
    if groups < 2:
        return float(flat.std() / flat.numel() ** 0.5)
    means = flat.view(groups, group_size).mean(dim=1)
    return float(means.std() / groups**0.5)
