"""Policy models: tiny random (tests, embedded default), Hugging Face, GGUF; supervised warm-up.

Attributes load lazily so that reading a recipe (``models.config``) does not import torch.
"""

from __future__ import annotations

from tclightning._lazy import lazy_attributes

_EXPORTS = {
    "ModelConfig": "tclightning.models.config",
    "TinyModelConfig": "tclightning.models.config",
    "WarmupConfig": "tclightning.models.config",
    "decoder_layers": "tclightning.models.loading",
    "load_model": "tclightning.models.loading",
}

__getattr__ = lazy_attributes(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
