"""``model.lora``: PEFT LoRA adapters injected into the policy in place.

``peft.inject_adapter_in_model`` keeps the Hugging Face module tree (``model.model.layers`` and
the model's own forward), so the pipeline split and the one-process cut hooks find the decoder
layers as before; only the adapters train (every other weight is frozen), so the optimizer, built
from trainable parameters, holds adapter state alone, and a checkpoint leaves the frozen base out
(:func:`frozen_parameter_names`), recording its :func:`base_fingerprint` instead.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tclightning.errors import TclightningError
from tclightning.models.config import LoraConfig

ADAPTER_MARK = "lora_"
"""What every adapter parameter's name holds (``...q_proj.lora_A.default.weight``)."""

BASE_LAYER = ".base_layer."
"""Where PEFT moves a wrapped layer's own weight: ``q_proj.weight`` becomes ``q_proj.base_layer.weight``."""


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

    layers = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    if not set(cfg.target_modules) & layers:
        raise TclightningError(f"model.lora.target_modules {list(cfg.target_modules)}: the model has no such linear "
                               f"layer (its own: {', '.join(sorted(layers - {'lm_head'}))})")
    dtype = next(model.parameters()).dtype
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inject_adapter_in_model(peft_config(cfg), model)
    for name, p in model.named_parameters():
        p.requires_grad_(ADAPTER_MARK in name)
        if ADAPTER_MARK in name and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return model


def frozen_parameter_names(model: nn.Module) -> set[str]:
    """The names of ``model``'s frozen parameters, every alias of a tied one included (what a LoRA
    checkpoint leaves out of the policy's state dict)."""
    return {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def base_fingerprint(model: nn.Module) -> dict[str, Any]:
    """``{"sha256": hex digest, "parameters": count}`` of ``model``'s base weights: every parameter
    but the adapters, under its name in the plain model (``base_layer`` dropped), so the value is the
    same before and after :func:`apply_lora`. Each distinct tensor once (a tied embedding is one), in
    name order, by name, dtype, shape and raw bytes: equal bytes give an equal digest in any process,
    and one changed bit another. 0.32 s for SmolLM2-135M in float32 (538 MB of SHA-256, a 2-core CPU)."""
    tensors: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():  # named_parameters lists a tied tensor once
        if ADAPTER_MARK not in name:
            tensors[name.replace(BASE_LAYER, ".")] = p
    hasher = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        hasher.update(f"{name}:{t.dtype}:{tuple(t.shape)}:".encode())
        if t.numel():
            hasher.update(memoryview(t.view(torch.uint8).numpy()))
    return {"sha256": hasher.hexdigest(), "parameters": sum(t.numel() for t in tensors.values())}


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
