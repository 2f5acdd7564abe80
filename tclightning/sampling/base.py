"""The sampler interface: prompts in, completions with per-token log-probs out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tclightning.errors import TclightningError


class NonFiniteError(TclightningError):
    """The policy diverged: its weights, or the logits it gives, hold NaN or Inf.

    Raised before anything is sampled from such a policy (never a traceback inside
    ``generate``). The CLI prints it as one line and exits 3: a diverged run, not a bad input.
    """

    exit_code = 3


def nonfinite_parameters(model: torch.nn.Module) -> list[str]:
    """Names of the parameters of ``model`` holding NaN or Inf (empty when all are finite).

    One max-abs norm per parameter and a single host sync: cheap next to a forward pass, and a
    max (unlike a sum of squares) does not overflow on large finite weights.
    """
    named = list(model.named_parameters())
    if not named:
        return []
    norms = [torch.linalg.vector_norm(p.detach(), ord=float("inf")).float() for _, p in named]
    finite = torch.isfinite(torch.stack([n.to(norms[0].device) for n in norms]))
    if bool(finite.all()):
        return []
    return [name for (name, _), ok in zip(named, finite.tolist()) if not ok]


TENSOR_FIELDS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "logp_sampler", "truncated")
"""The tensor fields of :class:`Rollouts` (what :meth:`Rollouts.to` moves)."""


@dataclass
class Rollouts:
    """A batch of ``B = prompts x group_size`` completions, rows of one prompt contiguous.

    Token layout (what the trainer recomputes over): ``[left-padded prompt | right-padded
    completion]``. ``completion_mask`` is 1 for generated tokens up to and including the first
    eos; ``logp_sampler`` is 0 where the mask is 0.
    """

    prompt_ids: torch.Tensor  # [B, Lp] long, left padded
    prompt_mask: torch.Tensor  # [B, Lp] long
    completion_ids: torch.Tensor  # [B, Lc] long, right padded
    completion_mask: torch.Tensor  # [B, Lc] float
    logp_sampler: torch.Tensor  # [B, Lc] float32
    texts: list[str]  # decoded completions (special tokens stripped)
    truncated: torch.Tensor  # [B] bool: hit max_new_tokens without eos
    group_size: int

    @property
    def num_sequences(self) -> int:
        return self.completion_ids.shape[0]

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.completion_mask.long()], dim=1)

    @property
    def position_ids(self) -> torch.Tensor:
        """Positions counted over real tokens only, as HF ``generate`` does for left padding."""
        mask = self.attention_mask
        return (mask.cumsum(-1) - 1).clamp(min=0)

    @property
    def lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(-1)

    def to(self, device: torch.device | str) -> Rollouts:
        """The same batch with every tensor on ``device`` (a new ``Rollouts``; ``texts`` shared)."""
        return replace(self, **{name: getattr(self, name).to(device) for name in TENSOR_FIELDS})

    def select(self, rows: torch.Tensor) -> Rollouts:
        """The sub-batch of ``rows`` (a 1-D index tensor), trimmed to its longest completion."""
        mask = self.completion_mask[rows]
        width = max(int(mask.sum(-1).max().item()) if len(rows) else 0, 1)
        return Rollouts(
            prompt_ids=self.prompt_ids[rows],
            prompt_mask=self.prompt_mask[rows],
            completion_ids=self.completion_ids[rows, :width],
            completion_mask=mask[:, :width],
            logp_sampler=self.logp_sampler[rows, :width],
            texts=[self.texts[i] for i in rows.tolist()],
            truncated=self.truncated[rows],
            group_size=self.group_size,
        )


class Sampler(Protocol):
    """Generates ``group_size`` completions per prompt with the *dense* (uncompressed) policy."""

    def generate(
        self,
        model: PreTrainedModel,
        prompts: Sequence[str],  # task prompts (user text); the sampler's formatter renders them
        *,
        group_size: int,
        seed: int,
        greedy: bool = False,
        max_new_tokens: int | None = None,
    ) -> Rollouts: ...


@dataclass
class PromptFormatter:
    """Turns task prompts (user text) into the token ids the model is conditioned on.

    With ``use_chat_template`` and a tokenizer that has one, the prompt is a chat with an
    optional system message and the generation prompt appended; otherwise it is the raw text
    (and the tokenizer adds its usual special tokens, e.g. BOS).
    """

    tokenizer: PreTrainedTokenizerBase
    system_prompt: str | None = None
    use_chat_template: bool = True

    @property
    def templated(self) -> bool:
        return self.use_chat_template and bool(getattr(self.tokenizer, "chat_template", None))

    def render(self, user_text: str) -> str:
        if self.templated:
            messages = [{"role": "user", "content": user_text}]
            if self.system_prompt:
                messages.insert(0, {"role": "system", "content": self.system_prompt})
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return f"{self.system_prompt}\n{user_text}" if self.system_prompt else user_text

    def lengths(self, user_texts: Sequence[str]) -> list[int]:
        """How many tokens :meth:`encode` gives each prompt, without padding."""
        if not user_texts:
            return []
        ids = self.tokenizer([self.render(t) for t in user_texts], add_special_tokens=not self.templated)["input_ids"]
        return [len(row) for row in ids]

    def encode(self, user_texts: Sequence[str]) -> dict[str, torch.Tensor]:
        """Left-padded ``input_ids``/``attention_mask`` for a batch of prompts."""
        return self.tokenizer(
            [self.render(t) for t in user_texts],
            return_tensors="pt",
            padding=True,
            padding_side="left",
            add_special_tokens=not self.templated,
        )


def sequence_seed(seed: int, step: int, salt: int = 0) -> int:
    """A 63-bit seed for (run seed, step, salt): each step's sampling is reproducible on its own."""
    mixed = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + salt * 0x94D049BB133111EB) % (1 << 63)
    return mixed
