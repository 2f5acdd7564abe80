"""Token log-probs of completions under a model's forward (whatever cuts it carries, or one
pipeline stage's share of it)."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


class CompletionBatch(Protocol):
    """Prompts and completions as one ``[B, L]`` sequence (a ``Rollouts``, a ``StageInputs``)."""

    @property
    def input_ids(self) -> torch.Tensor: ...
    @property
    def attention_mask(self) -> torch.Tensor: ...
    @property
    def position_ids(self) -> torch.Tensor: ...
    @property
    def completion_ids(self) -> torch.Tensor: ...
    @property
    def completion_mask(self) -> torch.Tensor: ...


def completion_logps(
    model: nn.Module, rollouts: CompletionBatch, temperature: float = 1.0, with_entropy: bool = False,
    *, inputs_embeds: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(logits / T)`` at each completion token, ``[B, Lc]`` (0 on padding).

    Uses the same positions as the sampler (cumulative over real tokens) and asks the model
    only for the last ``Lc + 1`` positions' logits (``logits_to_keep``), so memory scales with
    the completion, not the prompt. Entropy (no grad) is of the same tempered distribution.
    ``inputs_embeds`` [B, L, d] replaces the ids as the model's input (a pipeline's last stage).
    """
    width = rollouts.completion_ids.shape[1]
    tokens = {"input_ids": rollouts.input_ids} if inputs_embeds is None else {"inputs_embeds": inputs_embeds}
    logits = model(
        **tokens,
        attention_mask=rollouts.attention_mask,
        position_ids=rollouts.position_ids,
        use_cache=False,
        logits_to_keep=width + 1,
    ).logits[:, :-1]
    logits = logits.float() / temperature
    log_probs = F.log_softmax(logits, dim=-1)
    mask = rollouts.completion_mask
    logp = torch.gather(log_probs, 2, rollouts.completion_ids.unsqueeze(-1)).squeeze(-1) * mask
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(log_probs.exp() * log_probs).sum(-1) * mask
    return logp, entropy
