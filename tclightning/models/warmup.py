"""Supervised warm-up: a few steps of SFT on reference solutions before RL."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

import torch
from transformers import PreTrainedModel

from tclightning.models.config import WarmupConfig
from tclightning.sampling.base import PromptFormatter


def sft_batch(formatter: PromptFormatter, prompts: Sequence[str], solutions: Sequence[str]) -> dict[str, torch.Tensor]:
    """Right-padded ``prompt + solution + eos`` with labels only on the solution (and eos)."""
    tok = formatter.tokenizer
    rows, labels = [], []
    for prompt, solution in zip(prompts, solutions, strict=True):
        p = tok(formatter.render(prompt), add_special_tokens=not formatter.templated)["input_ids"]
        s = tok(solution, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        rows.append(p + s)
        labels.append([-100] * len(p) + s)
    width = max(map(len, rows))
    pad = tok.pad_token_id
    return {
        "input_ids": torch.tensor([r + [pad] * (width - len(r)) for r in rows]),
        "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]),
        "labels": torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels]),
    }


def supervised_warmup(
    model: PreTrainedModel,
    formatter: PromptFormatter,
    prompts: Sequence[str],
    solutions: Sequence[str],
    cfg: WarmupConfig,
    progress: bool = False,
    accuracy: Callable[[], float] | None = None,
) -> dict[str, float]:
    """Train ``model`` in place for ``cfg.steps`` AdamW steps on random (prompt, solution) pairs.

    With ``cfg.label_noise = q`` each target is, with probability q, the solution of another
    random example (a wrong demonstration in the task's own format).

    With ``cfg.target_accuracy > 0`` and an ``accuracy`` callback (greedy accuracy of the model
    as it stands), training stops at the first check (every ``cfg.check_every`` steps) that
    reaches the target. Returns ``warmup/loss_first``, ``warmup/loss_last``, ``warmup/seconds``,
    ``warmup/steps`` and, when checked, ``warmup/accuracy``. Deterministic for a given
    ``cfg.seed`` (its own generator; the global RNG is left untouched).
    """
    if cfg.steps <= 0:
        return {}
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: min(1.0, (t + 1) / 20))
    was_training = model.training
    model.train()
    started, losses, stats = time.perf_counter(), [], {}
    steps: Iterable[int] = range(cfg.steps)
    if progress:
        from rich.progress import track

        steps = track(steps, description="supervised warm-up", transient=True)
    for step in steps:
        picks = torch.randint(len(prompts), (cfg.batch_size,), generator=gen).tolist()
        noisy = torch.rand(cfg.batch_size, generator=gen) < cfg.label_noise
        targets = torch.where(noisy, torch.randint(len(prompts), (cfg.batch_size,), generator=gen), torch.tensor(picks))
        batch = sft_batch(formatter, [prompts[i] for i in picks], [solutions[i] for i in targets.tolist()])
        loss = model(**{k: v.to(device) for k, v in batch.items()}).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if accuracy is not None and cfg.target_accuracy > 0 and (step + 1) % cfg.check_every == 0:
            stats["warmup/accuracy"] = accuracy()
            model.train()
            if stats["warmup/accuracy"] >= cfg.target_accuracy:
                break
    model.train(was_training)
    tail = max(1, len(losses) // 10)
    return {
        **stats,
        "warmup/steps": float(len(losses)),
        "warmup/loss_first": sum(losses[:tail]) / tail,
        "warmup/loss_last": sum(losses[-tail:]) / tail,
        "warmup/seconds": time.perf_counter() - started,
    }
