"""Pick the sampler backend a recipe names."""

from __future__ import annotations

from tclightning.errors import TclightningError
from tclightning.sampling.base import PromptFormatter, Sampler
from tclightning.sampling.config import BACKENDS, SamplerConfig


def build_sampler(cfg: SamplerConfig, formatter: PromptFormatter) -> Sampler:
    """The sampler backend named by ``cfg.backend``."""
    if cfg.backend == "hf":
        from tclightning.sampling.hf import HFSampler

        return HFSampler(cfg, formatter)
    if cfg.backend == "vllm":
        # vllm itself is imported by the sampler, which fails with one clear line without CUDA or vllm
        from tclightning.sampling.vllm import VLLMSampler

        return VLLMSampler(cfg, formatter)
    raise TclightningError(f"sampler.backend: unknown backend '{cfg.backend}', expected {' | '.join(BACKENDS)}")
