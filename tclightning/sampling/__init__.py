"""The dense sampler circuit (``hf`` here; ``vllm`` on GPU machines).

Attributes load lazily so that reading a recipe (``sampling.config``) does not import torch.
"""

from __future__ import annotations

from tclightning._lazy import lazy_attributes

_EXPORTS = {
    "NonFiniteError": "tclightning.sampling.base",
    "nonfinite_parameters": "tclightning.sampling.base",
    "PromptFormatter": "tclightning.sampling.base",
    "Rollouts": "tclightning.sampling.base",
    "Sampler": "tclightning.sampling.base",
    "sequence_seed": "tclightning.sampling.base",
    "SamplerConfig": "tclightning.sampling.config",
    "build_sampler": "tclightning.sampling.factory",
}

__getattr__ = lazy_attributes(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
