"""Multi-turn rollouts: play P x G conversations with the sampler, one training row per interaction.

Interaction ``i`` of a trajectory is the row ``[history before reply i | reply i]``: its prompt is
the conversation so far rendered by the sampler's prompt formatter (chat template included), its
completion the reply with the sampler's per-token log-probs. Every row of a trajectory carries the
trajectory's outcome reward, and so its advantage, normalised over the G trajectories of the same
task instance (GRPO's group). The rows are a plain ``Rollouts`` batch (left-padded prompts of
different lengths), so the GRPO update, the compressed cuts and the anchor circuit take them as
they take single-turn completions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from tclightning.agentic.env import (
    AgenticTask,
    Message,
    Transcript,
    demonstration_pairs,
)
from tclightning.sampling.base import PromptFormatter, Rollouts, Sampler, sequence_seed
from tclightning.tasks.base import Example


@dataclass
class ConversationFormatter(PromptFormatter):
    """A ``PromptFormatter`` that also renders a conversation (a list of messages).

    With a chat template: the system prompt first, then the messages, then the generation
    prompt. Without one: the contents concatenated, each assistant message closed by eos (the
    token that ended it when it was sampled). A plain string renders as in ``PromptFormatter``.
    """

    def render(self, prompt: str | Sequence[Message]) -> str:  # type: ignore[override]
        return self.render_all([prompt])[0]

    def _render_one(self, prompt: str | Sequence[Message]) -> str:  # type: ignore[override]
        if isinstance(prompt, str):
            return super()._render_one(prompt)
        messages = list(prompt)
        if self.templated:
            if self.system_prompt:
                messages.insert(0, {"role": "system", "content": self.system_prompt})
            return self._apply_template(messages)
        eos = self.tokenizer.eos_token or ""
        text = "".join(m["content"] + (eos if m["role"] == "assistant" else "") for m in messages)
        return f"{self.system_prompt}\n{text}" if self.system_prompt else text


def cat_rows(parts: Sequence[Rollouts], pad_id: int) -> Rollouts:
    """Stack batches of rows with different prompt/completion widths: prompts re-padded on the
    left, completions on the right (``group_size`` 1: rows are not grouped by prompt)."""
    prompt_width = max(p.prompt_ids.shape[1] for p in parts)
    width = max(p.completion_ids.shape[1] for p in parts)

    def left(t: torch.Tensor, value: float) -> torch.Tensor:
        return F.pad(t, (prompt_width - t.shape[1], 0), value=value)

    def right(t: torch.Tensor, value: float) -> torch.Tensor:
        return F.pad(t, (0, width - t.shape[1]), value=value)

    return Rollouts(
        prompt_ids=torch.cat([left(p.prompt_ids, pad_id) for p in parts]),
        prompt_mask=torch.cat([left(p.prompt_mask, 0) for p in parts]),
        completion_ids=torch.cat([right(p.completion_ids, pad_id) for p in parts]),
        completion_mask=torch.cat([right(p.completion_mask, 0.0) for p in parts]),
        logp_sampler=torch.cat([right(p.logp_sampler, 0.0) for p in parts]),
        texts=[t for p in parts for t in p.texts],
        truncated=torch.cat([p.truncated for p in parts]),
        group_size=1,
    )


@dataclass
class Episodes:
    """The trajectories of one batch and their rows.

    ``T = prompts x group_size`` trajectories, those of one task instance contiguous. ``rows``
    holds one row per interaction, ordered by (trajectory, turn); ``trajectory[b]`` / ``turn[b]``
    say whose and which interaction row ``b`` is. ``rewards[k]`` is trajectory k's outcome reward
    (the sum of its step rewards); the advantage of row b is that of ``trajectory[b]``.
    """

    rows: Rollouts
    trajectory: torch.Tensor  # [B] long
    turn: torch.Tensor  # [B] long
    rewards: torch.Tensor  # [T] float
    transcripts: list[Transcript]
    group_size: int

    def metrics(self) -> dict[str, float]:
        """``agentic/*``: success, interactions, rewards and action validity of the batch."""
        ts = self.transcripts
        infos = [info for t in ts for info in t.infos]
        step_rewards = [r for t in ts for r in t.rewards]
        interactions = torch.tensor([t.turns for t in ts], dtype=torch.float32)
        return {
            "agentic/success_rate": sum(t.success for t in ts) / len(ts),
            "agentic/interactions_mean": float(interactions.mean()),
            "agentic/interactions_max": float(interactions.max()),
            "agentic/unfinished_frac": sum(not t.done for t in ts) / len(ts),
            "agentic/reward_trajectory": float(self.rewards.mean()),
            "agentic/reward_interaction": sum(step_rewards) / max(len(step_rewards), 1),
            "agentic/valid_frac": sum(bool(i.get("valid", True)) for i in infos) / max(len(infos), 1),
            "agentic/tool_calls_mean": sum(bool(i.get("tool", False)) for i in infos) / len(ts),
        }


class MultiTurnRollout:
    """Plays conversations of up to ``task.max_turns`` interactions through a ``Sampler``.

    Each turn, the still-running conversations are handed to ``sampler.generate`` as prompts (the
    sampler's ``ConversationFormatter`` renders each history) with ``group_size=1``: the G copies of
    an instance are already separate conversations from the first turn on. Turn ``t`` samples with
    seed ``sequence_seed(seed, t)``, so a batch depends only on (weights, instances, seed).
    """

    def __init__(self, task: AgenticTask, sampler: Sampler, pad_id: int, max_turns: int | None = None) -> None:
        self.task = task
        self.sampler = sampler
        self.pad_id = pad_id
        self.max_turns = max_turns or task.max_turns

    def play(self, model: PreTrainedModel, examples: Sequence[Example], *, group_size: int, seed: int,
             greedy: bool = False, max_new_tokens: int | None = None) -> Episodes:
        envs = [self.task.make_env(e) for e in examples for _ in range(group_size)]
        transcripts = [Transcript(env.reset()) for env in envs]
        parts: list[Rollouts] = []
        owners: list[torch.Tensor] = []
        turns: list[torch.Tensor] = []
        for turn in range(self.max_turns):
            active = [k for k, t in enumerate(transcripts) if not t.done]
            if not active:
                break
            part = self.sampler.generate(
                model, [transcripts[k].history(turn) for k in active], group_size=1,
                seed=sequence_seed(seed, turn), greedy=greedy, max_new_tokens=max_new_tokens,
            )
            for row, k in enumerate(active):
                transcripts[k].record(part.texts[row], envs[k].step(part.texts[row]))
            parts.append(part)
            owners.append(torch.tensor(active))
            turns.append(torch.full((len(active),), turn))
        trajectory, turn_index = torch.cat(owners), torch.cat(turns)
        order = torch.argsort(trajectory * self.max_turns + turn_index)  # (trajectory, turn) order
        rows = cat_rows(parts, self.pad_id).select(order)
        rewards = torch.tensor([t.total_reward for t in transcripts], dtype=torch.float32)
        return Episodes(rows, trajectory[order], turn_index[order], rewards, transcripts, group_size)

    def demonstrations(self, examples: Sequence[Example]) -> tuple[list[list[Message]], list[str]]:
        """Warm-up pairs: ``(history, expert action)`` for each interaction of each expert conversation."""
        return demonstration_pairs(self.task, examples)
