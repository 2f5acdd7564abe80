"""Sampler section of a recipe."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SamplerConfig:
    """The dense sampler circuit: how completions are generated.

    Log-probs recorded for each sampled token are ``log_softmax(logits / temperature)`` at that
    token (TRL's convention), the same definition the trainer uses, so the gap is comparable.
    """

    backend: str = "hf"  # hf (transformers generate; CPU or GPU) | vllm (GPU, optional extra)
    group_size: int = 8  # G completions per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    batch_size: int = 64  # sequences per generate call (memory knob, not a semantics knob)
    seed: int = 0  # each step samples with seed (seed, step): resumable without RNG state
    eval_max_new_tokens: int | None = None  # greedy validation length (default: max_new_tokens)
