"""Token log-probs of completions under the trainer's forward (whatever cuts it carries)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from tclightning.sampling.base import Rollouts


def completion_logps(
    model: PreTrainedModel, rollouts: Rollouts, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(logits / T)`` at each completion token, ``[B, Lc]`` (0 on padding).

    Uses the same positions as the sampler (cumulative over real tokens) and asks the model
    only for the last ``Lc + 1`` positions' logits (``logits_to_keep``), so memory scales with
    the completion, not the prompt. Entropy (no grad) is of the same tempered distribution.
    """
    width = rollouts.completion_ids.shape[1]
    logits = model(
        input_ids=rollouts.input_ids,
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
