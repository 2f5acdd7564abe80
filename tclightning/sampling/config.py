"""Sampler section of a recipe: each key with its range and help (:func:`tclightning.settings.setting`)."""

from __future__ import annotations

from dataclasses import dataclass

from tclightning.settings import MAX_TOKENS, flag, integer, number, one_of, positive, seed, setting

BACKENDS = ("hf", "vllm")
"""``sampler.backend``: transformers ``generate`` (CPU or GPU) or vLLM (GPU, optional extra)."""

DTYPES = ("float32", "bfloat16", "float16")
"""``sampler.dtype``: the dtypes the sampler's own copy of the policy may hold (names: no torch here)."""


@dataclass
class SamplerConfig:
    """The dense sampler circuit: how completions are generated.

    Log-probs recorded for each sampled token are ``log_softmax(logits / temperature)`` at that
    token (TRL's convention), the same definition the trainer uses, so the gap is comparable.
    """

    backend: str = setting("hf", one_of(BACKENDS), "hf (transformers generate; CPU or GPU) | vllm (GPU, optional extra)")
    group_size: int = setting(8, integer(2), "G completions per prompt (GRPO compares them: at least 2)")
    temperature: float = setting(1.0, number(0.0, low_open=True), "sampling temperature")
    top_p: float = setting(1.0, number(0.0, 1.0, low_open=True), "nucleus sampling: the smallest set of tokens of this mass")
    max_new_tokens: int = setting(64, positive(MAX_TOKENS), "most tokens a completion may have")
    batch_size: int = setting(64, positive(1 << 16), "sequences per generate call (memory knob, not a semantics knob)")
    seed: int = setting(0, seed(), "each step samples with seed (seed, step): resumable without RNG state")
    eval_max_new_tokens: int | None = setting(None, positive(MAX_TOKENS, optional=True),
                                              "greedy validation length (default: max_new_tokens)")
    dtype: str | None = setting(
        None, one_of(DTYPES, optional=True),
        "null (sample from the policy itself) | float32 | bfloat16 | float16: the sampler generates from its own copy "
        "of the policy in this dtype, bit-identical to the trainer's weights cast to it; across processes only the "
        "entries that changed in this dtype are sent after each update (docs/distributed.md)")
    # --- vllm backend only (see docs/vllm.md) ---
    gpu_memory_utilization: float = setting(
        0.3, number(0.0, 1.0, low_open=True),
        "vllm: share of the GPU's memory the engine may take (weights + KV cache). The engine is colocated with "
        "the trainer on the same GPU, so leave the rest for training")
    vllm_max_model_len: int | None = setting(None, positive(MAX_TOKENS, optional=True),
                                             "vllm: prompt + completion tokens per sequence (None: the model's limit)")
    vllm_enforce_eager: bool = setting(False, flag, "vllm: skip CUDA-graph capture (faster start, slower decoding)")
    vllm_sleep: bool = setting(False, flag,
                               "vllm: offload the engine (weights to CPU, KV cache freed) between sampling calls")
