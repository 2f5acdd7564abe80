"""Sampler section of a recipe: each key with its range and help (:func:`tclightning.settings.setting`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from tclightning.settings import (
    MAX_TOKENS,
    flag,
    grouped,
    integer,
    moved_keys,
    number,
    one_of,
    options_of,
    positive,
    setting,
)

BACKENDS = ("hf", "vllm")
"""``sampler.backend``: transformers ``generate`` (CPU or GPU) or vLLM (GPU, optional extra)."""

DTYPES = ("float32", "bfloat16", "float16")
"""``sampler.dtype``: the dtypes the sampler's own copy of the policy may hold (names: no torch here)."""


@dataclass
class VllmOptions:
    """``sampler.vllm``: how the vLLM engine runs (docs/vllm.md); read only with ``backend: vllm``."""

    gpu_memory_utilization: float = setting(
        0.3, number(0.0, 1.0, low_open=True),
        "share of the GPU's memory the engine may take (weights + KV cache). The engine is colocated with the "
        "trainer on the same GPU, so leave the rest for training")
    max_model_len: int | None = setting(None, positive(MAX_TOKENS, optional=True),
                                        "prompt + completion tokens per sequence (null: the model's limit)")
    enforce_eager: bool = setting(False, flag, "skip CUDA-graph capture (faster start, slower decoding)")
    sleep: bool = setting(False, flag, "offload the engine (weights to CPU, KV cache freed) between sampling calls")


@dataclass
class SamplerConfig:
    """The dense sampler circuit: how completions are generated.

    Log-probs recorded for each sampled token are ``log_softmax(logits / temperature)`` at that
    token (TRL's convention), the same definition the trainer uses, so the gap is comparable.
    """

    backend: str = setting("hf", one_of(BACKENDS), "hf (transformers generate; CPU or GPU) | vllm (GPU, optional extra)")
    group_size: int = setting(8, integer(2), "G completions per prompt (GRPO compares them: at least 2)")
    temperature: float = setting(1.0, number(1e-3), "sampling temperature (at least 0.001: far below it the "
                                 "logits divided by it overflow and sampling fails; 0.001 is already greedy)")
    top_p: float = setting(1.0, number(0.0, 1.0, low_open=True), "nucleus sampling: the smallest set of tokens of this mass")
    max_new_tokens: int = setting(64, positive(MAX_TOKENS), "most tokens a completion may have")
    batch_size: int = setting(64, positive(1 << 16), "sequences per generate call (memory knob, not a semantics knob)")
    dtype: str | None = setting(
        None, one_of(DTYPES, optional=True),
        "null (sample from the policy itself) | float32 | bfloat16 | float16: the sampler generates from its own copy "
        "of the policy in this dtype, bit-identical to the trainer's weights cast to it; across processes only the "
        "entries that changed in this dtype are sent after each update (docs/distributed.md)")
    vllm: dict[str, Any] = grouped(
        VllmOptions, "vllm backend only (docs/vllm.md): the engine's options, e.g. {gpu_memory_utilization: 0.5, "
        "sleep: true}; an option left out keeps its default")

    seed: ClassVar[int] = 0
    """Added to ``trainer.seed``: each step samples with seed (trainer.seed + seed, step), resumable
    without RNG state (a constant: ``trainer.seed`` is the run's one seed; not a recipe key)."""

    @property
    def vllm_options(self) -> VllmOptions:
        """``vllm`` as :class:`VllmOptions` (the options it leaves out at their defaults)."""
        return options_of(VllmOptions, self.vllm)


MOVED_KEYS: dict[str, str] = {
    "gpu_memory_utilization": "vllm.gpu_memory_utilization",
    "vllm_max_model_len": "vllm.max_model_len",
    "vllm_enforce_eager": "vllm.enforce_eager",
    "vllm_sleep": "vllm.sleep",
}
"""Keys of the ``sampler`` section an earlier version read, and the option that holds each now: a
recipe that sets one is refused naming its replacement; a checkpoint or run record that holds one
is read with its value moved (:func:`upgrade`)."""


RETIRED_KEYS = ("seed", "eval_max_new_tokens")
"""Keys of the ``sampler`` section an earlier version saved that no option reads now: ``seed`` is the
constant :attr:`SamplerConfig.seed` (every shipped recipe left it at 0); ``eval_max_new_tokens`` (a
validation length of its own, which no shipped recipe set) is ``max_new_tokens``."""

REPLACED_BY: dict[str, str] = {"seed": "set trainer.seed (the run's one seed; it seeds sampling)",
                               "eval_max_new_tokens": "validation decodes up to sampler.max_new_tokens"}
"""What a recipe that sets a retired key is pointed to."""


def upgrade(section: Mapping[str, Any]) -> dict[str, Any]:
    """A ``sampler`` section as an earlier version saved it, in today's keys."""
    return moved_keys(section, MOVED_KEYS)
