"""Pick the sampler backend a recipe names."""

from __future__ import annotations

from tclightning.errors import TclightningError
from tclightning.sampling.base import PromptFormatter, Sampler
from tclightning.sampling.config import SamplerConfig


def build_sampler(cfg: SamplerConfig, formatter: PromptFormatter) -> Sampler:
    """The sampler backend named by ``cfg.backend``."""
    if cfg.backend == "hf":
        from tclightning.sampling.hf import HFSampler

        return HFSampler(cfg, formatter)
    if cfg.backend == "vllm":
        raise TclightningError("sampler.backend: 'vllm' is not available yet in this version; use 'hf'")
    raise TclightningError(f"sampler.backend: unknown backend '{cfg.backend}', expected hf | vllm")
