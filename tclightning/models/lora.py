"""``model.lora``: PEFT LoRA adapters injected into the policy in place.

``peft.inject_adapter_in_model`` keeps the Hugging Face module tree (``model.model.layers`` and
the model's own forward), so the pipeline split and the one-process cut hooks find the decoder
layers as before; only the adapters train (every other weight is frozen), so the optimizer, built
from trainable parameters, holds adapter state alone.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tclightning.models.config import LoraConfig

ADAPTER_MARK = "lora_"
"""What every adapter parameter's name holds (``...q_proj.lora_A.default.weight``)."""


def peft_config(cfg: LoraConfig):  # -> peft.LoraConfig (imported lazily: peft pulls in much)
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                          target_modules=list(cfg.target_modules), bias="none", task_type="CAUSAL_LM")


def has_adapters(model: nn.Module) -> bool:
    return any(ADAPTER_MARK in name for name, _ in model.named_parameters())


def apply_lora(model: nn.Module, cfg: LoraConfig, seed: int = 0) -> nn.Module:
    """Inject ``cfg``'s adapters into ``model`` (in place; once: a model with adapters is left as
    it is) and freeze everything else; the adapters' random init is seeded, so every process
    builds the same ones. With ``cfg.r == 0``: nothing."""
    if cfg.r <= 0 or has_adapters(model):
        return model
    from peft import inject_adapter_in_model

    dtype = next(model.parameters()).dtype
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inject_adapter_in_model(peft_config(cfg), model)
    for name, p in model.named_parameters():
        p.requires_grad_(ADAPTER_MARK in name)
        if ADAPTER_MARK in name and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return model


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' weights by parameter name."""
    return {name: p.detach() for name, p in model.named_parameters() if ADAPTER_MARK in name}


def _wrapped(model: nn.Module, cfg: LoraConfig):
    """A ``peft.PeftModel`` around ``model`` (whose adapters :func:`apply_lora` injected) holding
    the same adapter weights: PEFT sets its adapter up again, so the trained values are copied back."""
    import warnings

    from peft import PeftModel

    config = peft_config(cfg)
    config.base_model_name_or_path = getattr(model.config, "_name_or_path", None) or None
    state = {name: value.clone() for name, value in adapter_state(model).items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Already found a peft_config": the injected adapter is ours
        wrapped = PeftModel(model, config)
    params = dict(wrapped.base_model.model.named_parameters())
    with torch.no_grad():
        for name, value in state.items():
            params[name].copy_(value)
    return wrapped


def merged(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """The plain Hugging Face model with the adapters folded into the base weights."""
    if not has_adapters(model):
        return model
    return _wrapped(model, cfg).merge_and_unload()


def save_adapter(model: nn.Module, cfg: LoraConfig, folder: str | Path) -> None:
    """The adapters alone in PEFT's format (``adapter_config.json``, ``adapter_model.safetensors``):
    ``peft.PeftModel.from_pretrained(base, folder)`` loads them onto the base model."""
    _wrapped(model, cfg).save_pretrained(str(folder))
