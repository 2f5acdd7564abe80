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
    # --- vllm backend only (see docs/vllm.md) ---
    # Share of the GPU's memory the vLLM engine may take (weights + KV cache). The engine is
    # colocated with the trainer on the same GPU, so leave the rest for training.
    gpu_memory_utilization: float = 0.3
    vllm_max_model_len: int | None = None  # prompt + completion tokens per sequence (None: the model's limit)
    vllm_enforce_eager: bool = False  # skip CUDA-graph capture (faster start, slower decoding)
    vllm_sleep: bool = False  # offload the engine (weights to CPU, KV cache freed) between sampling calls
