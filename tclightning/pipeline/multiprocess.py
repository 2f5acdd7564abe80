"""The ``pipeline`` Strategy across processes: one stage per rank (Lightning glue, kept thin).

A ``DDPStrategy`` subclass, so Lightning's launchers and cluster environments apply unchanged
(``devices=S`` spawns S local processes; torchrun and SLURM set the ranks; ``num_nodes``), but the
module is never wrapped in ``DistributedDataParallel``: the parallelism is the pipeline, built at
``setup`` as a :class:`~tclightning.pipeline.distributed.PipelineEngine` on the module's policy.

What it offers the ``GRPOModule`` (looked up by name, so the module imports nothing from here):
``cuts`` (the one-process ``CutSet`` knobs, backed by the engine), ``share_rollouts`` (rank 0
samples and scores, every rank receives the result), ``pipelined_update`` (the update of
``grpo_step.py``) and, for the anchor circuit, ``owned_parameters`` / ``anchor_gradient`` /
``gather_per_rank`` (each rank snapshots, computes ``M`` for and merges its own stage).
Checkpoints hold the whole policy (rank 0's dense copy, synced after every update), every rank's
optimizer state merged into one, every cut's receiver codec state and each rank's anchor state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy

from tclightning.errors import TclightningError
from tclightning.pipeline.config import PipelineConfig
from tclightning.pipeline.distributed import PipelineEngine
from tclightning.pipeline.strategy import _as_config

ROLLOUT_TENSORS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "logp_sampler", "truncated")


def _move(result: tuple[Any, ...], device: torch.device) -> tuple[Any, ...]:
    """Tensors and ``Rollouts`` tensors of a ``collect`` result on ``device`` (others as they are)."""
    moved = []
    for item in result:
        if isinstance(item, torch.Tensor):
            item = item.to(device)
        elif all(hasattr(item, name) for name in ROLLOUT_TENSORS):
            for name in ROLLOUT_TENSORS:
                setattr(item, name, getattr(item, name).to(device))
        moved.append(item)
    return tuple(moved)


class EngineCuts:
    """The ``CutSet`` interface the training loop uses, backed by this rank's engine.

    ``metrics()`` and ``state_dict()`` are collective: every rank calls them at the same point
    (the loop does: after the update; in ``on_save_checkpoint``)."""

    def __init__(self, engine: PipelineEngine) -> None:
        self.engine = engine
        self.dim = engine.dim
        self.specs = engine.specs

    @property
    def compressed(self) -> bool:
        return any(spec.compressed for spec in self.specs)

    def set_step(self, step: int) -> None:
        self.engine.set_step(step)

    @contextlib.contextmanager
    def bypassed(self) -> Iterator[None]:
        """Rank 0's dense copy has no codecs installed: sampling is dense as it is."""
        yield

    def set_token_mask(self, mask: torch.Tensor | None) -> None:
        """Real tokens are the attention mask's, always (what the stages pack)."""

    def reset_stats(self) -> None:
        self.engine.reset_stats()

    def metrics(self) -> dict[str, float]:
        return self.engine.metrics()

    def state_dict(self) -> dict[str, Any] | None:
        return self.engine.cut_state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.engine.load_cut_state_dict(state)


class MultiProcessPipelineStrategy(DDPStrategy):
    """``trainer.strategy: pipeline`` with ``devices x num_nodes = S > 1``: rank i runs stage i.

    ``config``: the recipe's ``pipeline`` section (stages must equal S); ``timeout`` comes from
    ``pipeline.timeout_s`` (a rank waiting longer on a peer stops with an error naming it)."""

    strategy_name = "pipeline_multiprocess"

    def __init__(
        self,
        config: PipelineConfig | Mapping[str, Any] | None = None,
        *,
        policy_attr: str = "policy",
        link_mbit: float | None = None,
        **kwargs: Any,
    ) -> None:
        self.config = _as_config(config, {})
        kwargs.setdefault("timeout", timedelta(seconds=self.config.timeout_s))
        super().__init__(**kwargs)
        self.policy_attr = policy_attr
        self.link_mbit = link_mbit
        self.engine: PipelineEngine | None = None
        self.cuts: EngineCuts | None = None

    # -- setup -----------------------------------------------------------------------------------

    def configure_ddp(self) -> None:
        """No DDP wrapper: build this rank's stage instead (after the module's ``setup``)."""
        module = self.lightning_module
        policy = getattr(module, self.policy_attr, None)
        if not isinstance(policy, torch.nn.Module):
            raise TclightningError(f"strategy 'pipeline' needs the LightningModule's HF decoder as '{self.policy_attr}'")
        anchor_cfg = getattr(module, "anchor_cfg", None)
        if getattr(module, "circuit", None) is not None and getattr(anchor_cfg, "projector", "none") == "rank1":
            raise TclightningError(
                "anchor.projector 'rank1' is not supported across processes (its trajectory direction spans "
                "every stage's weights; the merger and the other projectors work per coordinate, so each rank "
                "merges its own stage); use anchor.projector=none or damped_linear, or trainer.devices=1"
            )
        sampler_cfg = getattr(module, "sampler_cfg", None)
        self.engine = PipelineEngine(
            policy, self.config, device=self.root_device,
            temperature=getattr(sampler_cfg, "temperature", 1.0), link_mbit=self.link_mbit,
        )
        self.engine.broadcast_weights()
        self.cuts = EngineCuts(self.engine)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.cuts is not None and self.lightning_module is not None:
            self.cuts.set_step(self.lightning_module.trainer.global_step)
        return super().training_step(*args, **kwargs)

    # -- what the GRPO module asks for -----------------------------------------------------------

    def share_rollouts(self, make: Callable[[], tuple[Any, ...]]) -> tuple[Any, ...]:
        """Rank 0 runs ``make()`` (sample + score: ``(rollouts, rewards, ...)``); every rank gets
        the result, tensors on its own device (they travel through CPU pickles)."""
        assert self.engine is not None
        payload = _move(make(), torch.device("cpu")) if self.engine.is_first else None
        result = self.engine.broadcast_object(payload, 0, "receiving the step's rollouts")
        return _move(result, self.root_device)

    def pipelined_update(
        self, module: Any, rollouts: Any, advantages: torch.Tensor, rows: torch.Tensor, step: int
    ) -> dict[str, float]:
        """The GRPO update on the split policy (see ``grpo_step.pipelined_update``)."""
        from tclightning.grpo.logprobs import completion_logps
        from tclightning.pipeline.grpo_step import pipelined_update

        assert self.engine is not None
        ref_logp = None
        if getattr(module, "reference", None) is not None:  # dense reference on rank 0, sent once
            if self.engine.is_first:
                with torch.no_grad():
                    ref_logp, _ = completion_logps(module.reference, rollouts, module.sampler_cfg.temperature)
                ref_logp = ref_logp.cpu()
            ref_logp = self.engine.broadcast_object(ref_logp, 0, "receiving the reference log-probs")
        return pipelined_update(module, self.engine, rollouts, advantages, rows, step, ref_logp)

    # -- the anchor circuit: each rank keeps and merges its own stage ----------------------------

    def owned_parameters(self) -> list[torch.nn.Parameter]:
        """This rank's stage's parameters: what the anchor snapshots, its ``M`` and the merge cover."""
        assert self.engine is not None
        return self.engine.owned_parameters()

    def anchor_gradient(self, module: Any, job: Any) -> tuple[list[torch.Tensor], float]:
        """``M`` of ``job`` for this rank's stage, from a dense pipelined pass at the job's
        snapshot (``grpo_step.pipelined_anchor_gradient``), and the boundary bytes it sent."""
        from tclightning.pipeline.grpo_step import pipelined_anchor_gradient

        assert self.engine is not None
        return pipelined_anchor_gradient(
            self.engine, job, aggregation=module.cfg.loss_aggregation, norm_length=module.sampler_cfg.max_new_tokens
        )

    def gather_per_rank(self, state: Any, what: str) -> dict[str, Any] | None:
        """Collective: ``{"per_rank": [state of rank 0, rank 1, ...]}`` on rank 0 (None elsewhere),
        for per-rank checkpoint entries (the anchor's snapshots, replay and ``M_bar``)."""
        assert self.engine is not None
        gathered = self.engine.gather_objects(state, what)
        return None if gathered is None else {"per_rank": gathered}

    # -- checkpoints -----------------------------------------------------------------------------

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """Every rank's optimizer state for its own stage's parameters, merged (parameter indices
        are global, so the union is the whole optimizer). Collective.

        Only owned entries are sent: after a resume every rank has loaded the whole merged state,
        and its copies of other stages' entries stay frozen at the resume step (it never steps
        them); sent along, they would overwrite the owner's in the next checkpoint."""
        inner = getattr(optimizer, "_optimizer", optimizer)
        local = inner.state_dict()
        if self.engine is None:
            return local
        owned = {id(p) for p in self.engine.owned_parameters()}
        mine = {
            index
            for saved, group in zip(local["param_groups"], inner.param_groups)
            for index, param in zip(saved["params"], group["params"])
            if id(param) in owned
        }
        own_state = {index: state for index, state in local["state"].items() if index in mine}
        gathered = self.engine.gather_objects(own_state, "gathering optimizer states for a checkpoint")
        merged: dict[Any, Any] = {}
        for state in gathered or [own_state]:
            merged.update(state)
        return {"state": merged, "param_groups": local["param_groups"]}

    def teardown(self) -> None:
        self.engine = None
        self.cuts = None
        super().teardown()
