"""The dense sampler circuit (``hf`` here; ``vllm`` on GPU machines).

Attributes load lazily so that reading a recipe (``sampling.config``) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "PromptFormatter": "tclightning.sampling.base",
    "Rollouts": "tclightning.sampling.base",
    "Sampler": "tclightning.sampling.base",
    "sequence_seed": "tclightning.sampling.base",
    "SamplerConfig": "tclightning.sampling.config",
    "build_sampler": "tclightning.sampling.factory",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tclightning.sampling' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
