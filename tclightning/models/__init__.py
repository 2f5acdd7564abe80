"""Policy models: tiny random (tests, embedded default), Hugging Face, GGUF; supervised warm-up.

Attributes load lazily so that reading a recipe (``models.config``) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ModelConfig": "tclightning.models.config",
    "TinyModelConfig": "tclightning.models.config",
    "WarmupConfig": "tclightning.models.config",
    "decoder_layers": "tclightning.models.loading",
    "load_model": "tclightning.models.loading",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tclightning.models' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
