"""The ``pipeline`` Lightning Strategy: train a policy split at compressed cuts.

One process (this module): every stage lives in this process and each cut's codec runs in-graph
exactly as it would on the wire (the numerics reference); bytes are counted per cut and direction.
The multi-process version (one stage per rank over ``torch.distributed.pipelining``) is
:class:`~tclightning.pipeline.multiprocess.MultiProcessPipelineStrategy` (``run.py`` picks it when
``trainer.devices x num_nodes > 1``; docs/distributed.md): the same codecs and byte accounting,
with real sends between stage processes instead of hooks in one graph.

Inference stays dense: the sampler (and any dense probe) must run under ``strategy.cuts.bypassed()``.

Both strategies are :class:`~tclightning.backend.BackendProvider`: a module that asks for its
backend (the GRPO module does) runs its forward/backward through it and steps it; any other
module trains with the cuts as installed, and this strategy steps a backend of its own for it,
once per optimizer tick. Either way the PRF key's step is set in one place,
:meth:`Backend.begin_step <tclightning.backend.Backend.begin_step>`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

import torch
from lightning.pytorch.strategies import SingleDeviceStrategy, StrategyRegistry
from omegaconf import DictConfig, OmegaConf

from tclightning.backend import BackendRequest
from tclightning.errors import TclightningError
from tclightning.models.logprobs import completion_logps
from tclightning.pipeline.backends import LocalBackend
from tclightning.pipeline.boundary import Wire
from tclightning.pipeline.config import PipelineConfig
from tclightning.pipeline.cuts import CutSet

STRATEGY_NAME = "pipeline"


def _as_config(config: PipelineConfig | Mapping[str, Any] | None, overrides: dict[str, Any]) -> PipelineConfig:
    """A validated ``PipelineConfig`` from a dataclass, a mapping (plain or OmegaConf) or None, plus overrides."""
    if config is None:
        values: dict[str, Any] = {}
    elif isinstance(config, PipelineConfig):
        values = {f.name: getattr(config, f.name) for f in fields(PipelineConfig)}
    elif isinstance(config, DictConfig):
        values = OmegaConf.to_container(config, resolve=True)  # type: ignore[assignment]
    elif isinstance(config, Mapping):
        values = dict(config)
    else:
        raise TclightningError(
            f"strategy 'pipeline': config must be a PipelineConfig or a mapping, got {type(config).__name__}"
        )
    values.update(overrides)
    unknown = sorted(set(values) - {f.name for f in fields(PipelineConfig)})
    if unknown:
        raise TclightningError(f"unknown pipeline option(s): {', '.join(unknown)}")
    result = PipelineConfig(**values)
    result.validate()
    return result


class PipelineStrategy(SingleDeviceStrategy):
    """Single-process pipeline Strategy (``Trainer(strategy="pipeline")`` or an instance).

    At ``setup`` it installs the layout's cuts on ``lightning_module.<policy_attr>`` (a HF decoder)
    and exposes them as ``strategy.cuts``; ``teardown`` removes them. ``wire`` replaces the
    in-process loopback (the multi-process seam).

    The PRF key's step has one setter, ``Backend.begin_step``. A module that asked for its
    :meth:`backend` calls it (once per RL step); for any other module, with ``auto_step``, the
    strategy calls it on a backend of its own over the same cuts, at ``trainer.global_step``
    before each ``training_step`` (so, as in a GRPO step, the wire counters start from zero there).
    """

    strategy_name = STRATEGY_NAME

    def __init__(
        self,
        config: PipelineConfig | Mapping[str, Any] | None = None,
        *,
        policy_attr: str = "policy",
        device: str | torch.device | None = None,
        wire: Wire | None = None,
        auto_step: bool = True,
        accelerator: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        **config_overrides: Any,
    ) -> None:
        super().__init__(
            device=device if device is not None else "cpu",
            accelerator=accelerator,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._device_given = device is not None
        self.config = _as_config(config, config_overrides)
        self.policy_attr = policy_attr
        self.wire = wire
        self.auto_step = auto_step
        self.cuts: CutSet | None = None
        self._module_backend: LocalBackend | None = None  # the one the module asked for: it steps it
        self._own_backend: LocalBackend | None = None  # for a module that never asks: stepped here

    def setup_environment(self) -> None:
        if not self._device_given and self.accelerator is not None:
            # no explicit device: take the accelerator's (cuda:<current> on GPU, else cpu)
            accelerator = type(self.accelerator).__name__
            if accelerator == "CUDAAccelerator":
                self._root_device = torch.device("cuda", torch.cuda.current_device())
            elif accelerator == "MPSAccelerator":
                self._root_device = torch.device("mps", 0)
        super().setup_environment()

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        self.install()

    def install(self) -> CutSet:
        """Install the cuts on the module's policy (idempotent)."""
        if self.cuts is not None:
            return self.cuts
        module = self.lightning_module
        policy = getattr(module, self.policy_attr, None) if module is not None else None
        if not isinstance(policy, torch.nn.Module):
            raise TclightningError(
                f"strategy 'pipeline' needs the LightningModule to hold its HF decoder as "
                f"'{self.policy_attr}' (got {type(policy).__name__}); pass policy_attr=... otherwise"
            )
        self.cuts = CutSet(policy, self.config, wire=self.wire)
        return self.cuts

    def backend(self, request: BackendRequest) -> LocalBackend:
        """``BackendProvider``: the module's backend, with this strategy's cuts in-graph (after
        ``setup``); from now on the module steps it (``begin_step``) and the strategy no longer does."""
        cuts = self.install()
        policy = getattr(self.lightning_module, self.policy_attr, None)
        if request.policy is not policy:
            raise TclightningError(f"strategy 'pipeline' cut the module's '{self.policy_attr}'; ask for its backend "
                                   "with that policy")
        self._module_backend = LocalBackend(request, cuts)
        return self._module_backend

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        if self.auto_step and self._module_backend is None and self.cuts is not None and module is not None:
            self._backend_of_plain_module(module).begin_step(module.trainer.global_step)
        return super().training_step(*args, **kwargs)

    def _backend_of_plain_module(self, module: Any) -> LocalBackend:
        """The backend over the cuts of a module that never asks for one, built once. Only its
        ``begin_step`` runs: the module's own forward goes through the installed cuts."""
        if self._own_backend is None:
            request = BackendRequest(getattr(module, self.policy_attr), 1.0, completion_logps, module.manual_backward)
            self._own_backend = LocalBackend(request, self.install())
        return self._own_backend

    def teardown(self) -> None:
        if self.cuts is not None:
            self.cuts.remove()
            self.cuts = None
        self._module_backend = self._own_backend = None
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            STRATEGY_NAME,
            cls,
            description="Pipeline cuts with boundary codecs (one process; layout from PipelineConfig)",
            override=True,
        )


def register() -> None:
    """Register ``pipeline`` in Lightning's StrategyRegistry (done on ``import tclightning.pipeline``)."""
    PipelineStrategy.register_strategies(StrategyRegistry)
