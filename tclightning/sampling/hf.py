"""The ``hf`` sampler backend: batched ``transformers`` ``generate`` with per-token log-probs."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers import LogitsProcessor, LogitsProcessorList, PreTrainedModel, PreTrainedTokenizerBase

from tclightning.sampling.base import NonFiniteError, PromptFormatter, Rollouts
from tclightning.sampling.config import SamplerConfig


class FiniteLogitsGuard(LogitsProcessor):
    """Raises :class:`NonFiniteError` at the first decoding step whose logits are unusable.

    A policy with large but finite weights can still overflow in its forward (the residual
    stream's square in RMSNorm), and ``torch.multinomial`` then fails deep inside ``generate``.
    Runs after the temperature and top-p processors, where ``-inf`` marks a filtered token, so a
    row is unusable when its maximum is not finite (NaN, ``+inf``, or every token ``-inf``).
    """

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if not bool(torch.isfinite(scores.max(dim=-1).values).all()):
            raise NonFiniteError("the policy gives NaN or Inf logits while sampling: its weights have diverged")
        return scores


class HFSampler:
    """Generates with the dense policy via ``model.generate`` in micro-batches of ``cfg.batch_size``.

    Each call seeds its own RNG from ``seed`` (inside ``fork_rng``), so a step's completions
    depend only on (weights, prompts, seed): resuming a run needs no sampler RNG state.
    """

    def __init__(self, cfg: SamplerConfig, formatter: PromptFormatter) -> None:
        self.cfg = cfg
        self.formatter = formatter
        self.tokenizer = formatter.tokenizer

    @torch.no_grad()
    def generate(
        self,
        model: PreTrainedModel,
        prompts: Sequence[str],
        *,
        group_size: int,
        seed: int,
        greedy: bool = False,
        max_new_tokens: int | None = None,
    ) -> Rollouts:
        cfg = self.cfg
        max_new = max_new_tokens or cfg.max_new_tokens
        expanded = [p for p in prompts for _ in range(group_size)]
        encoded = self.formatter.encode(expanded)
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        chunks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.manual_seed(seed)
                for start in range(0, len(expanded), cfg.batch_size):
                    ids = encoded["input_ids"][start : start + cfg.batch_size].to(device)
                    mask = encoded["attention_mask"][start : start + cfg.batch_size].to(device)
                    # Strip columns that are padding in every row of this micro-batch.
                    keep = int(mask.sum(0).gt(0).long().argmax())
                    ids, mask = ids[:, keep:], mask[:, keep:]
                    out = model.generate(
                        input_ids=ids,
                        attention_mask=mask,
                        do_sample=not greedy,
                        temperature=cfg.temperature if not greedy else None,
                        top_p=cfg.top_p if not greedy else None,
                        top_k=0 if not greedy else None,
                        max_new_tokens=max_new,
                        pad_token_id=self.tokenizer.pad_token_id,
                        eos_token_id=self.tokenizer.eos_token_id,
                        output_logits=True,
                        return_dict_in_generate=True,
                        logits_processor=LogitsProcessorList([FiniteLogitsGuard()]),
                    )
                    completion = out.sequences[:, ids.shape[1] :]
                    logits = torch.stack(out.logits, dim=1).float()  # [b, Lc, V], raw (pre-processor)
                    temperature = 1.0 if greedy else cfg.temperature
                    logp = torch.gather(F.log_softmax(logits / temperature, dim=-1), 2, completion.unsqueeze(-1))
                    chunks.append((ids.cpu(), mask.cpu(), completion.cpu(), logp.squeeze(-1).cpu()))
        finally:
            model.train(was_training)
        return self._assemble(chunks, group_size, max_new)

    def _assemble(self, chunks, group_size: int, max_new: int) -> Rollouts:
        return assemble_rollouts(self.tokenizer, chunks, group_size, max_new)


def assemble_rollouts(
    tokenizer: PreTrainedTokenizerBase,
    chunks: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
    group_size: int,
    max_new: int,
) -> Rollouts:
    """Micro-batches ``(prompt ids, prompt mask, completion ids, per-token logp)`` -> one :class:`Rollouts`.

    Prompts are left padded and completions right padded to the widest chunk; the completion mask
    covers every token up to and including the first eos (shared by every backend)."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id
    prompt_width = max(c[0].shape[1] for c in chunks)
    completion_width = max(c[2].shape[1] for c in chunks)
    prompt_ids, prompt_mask, completion_ids, logps = [], [], [], []
    for ids, mask, completion, logp in chunks:
        left = prompt_width - ids.shape[1]
        prompt_ids.append(F.pad(ids, (left, 0), value=pad))
        prompt_mask.append(F.pad(mask, (left, 0), value=0))
        right = completion_width - completion.shape[1]
        completion_ids.append(F.pad(completion, (0, right), value=pad))
        logps.append(F.pad(logp, (0, right), value=0.0))
    completion = torch.cat(completion_ids)
    is_eos = completion.eq(eos)
    # Real tokens: everything up to and including the first eos (pad may equal eos).
    before_eos = is_eos.long().cumsum(-1) - is_eos.long()
    completion_mask = before_eos.eq(0).float()
    truncated = ~is_eos.any(-1) & completion_mask.sum(-1).ge(max_new)
    texts = tokenizer.batch_decode(completion * completion_mask.long() + pad * (1 - completion_mask.long()),
                                   skip_special_tokens=True)
    return Rollouts(
        prompt_ids=torch.cat(prompt_ids),
        prompt_mask=torch.cat(prompt_mask),
        completion_ids=completion,
        completion_mask=completion_mask,
        logp_sampler=torch.cat(logps) * completion_mask,
        texts=texts,
        truncated=truncated,
        group_size=group_size,
    )
