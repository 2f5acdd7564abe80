"""The ``pipeline`` Strategy across processes: one stage per rank (Lightning glue, kept thin).

A ``DDPStrategy`` subclass, so Lightning's launchers and cluster environments apply unchanged
(``devices=S`` spawns S local processes; torchrun and SLURM set the ranks; ``num_nodes``), but the
module is never wrapped in ``DistributedDataParallel``: the parallelism is the pipeline, built at
``setup`` as a :class:`~tclightning.pipeline.engine.PipelineEngine` on the module's policy.

It is a :class:`~tclightning.backend.BackendProvider`: a module asks it for its backend (a
:class:`~tclightning.pipeline.backends.PipelineBackend` over the engine) and runs its update
through it. Checkpoints hold the whole policy (rank 0's dense copy, synced after every update, or
with ``sampler.dtype``, whose sync after an update is sparse, by a full sync before the
checkpoint; what of it the module keeps is its own choice: with LoRA the adapters alone), every
rank's optimizer state merged into one, and what the module saves through the backend (every
cut's receiver codec state, each rank's anchor state).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher

from tclightning.backend import BackendRequest
from tclightning.errors import TclightningError
from tclightning.pipeline.backends import PipelineBackend
from tclightning.pipeline.config import PipelineConfig
from tclightning.pipeline.engine import PipelineEngine
from tclightning.pipeline.launch import StageLauncher
from tclightning.pipeline.mesh import ReplicaMesh
from tclightning.pipeline.strategy import _as_config

_RENDEZVOUS_GRACE_S = 10.0
"""How long past ``pipeline.timeout_s`` a rendezvous that has not failed is waited for."""


class _HeldStream:
    keep = False


@contextlib.contextmanager
def _stderr_held() -> Iterator[_HeldStream]:
    """What the process writes to stderr (fd 2, C++ logs included) held in a file until the block
    ends, then written out when ``keep`` was set (dropped otherwise)."""
    held = _HeldStream()
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as spool:
        os.dup2(spool.fileno(), 2)
        try:
            yield held
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if held.keep:
                spool.seek(0)
                sys.stderr.buffer.write(spool.read(1 << 20))
                sys.stderr.flush()


class MultiProcessPipelineStrategy(DDPStrategy):
    """``trainer.strategy: pipeline`` with ``devices x num_nodes = S x R > 1``: rank i runs stage i
    (R = ``pipeline.replicas`` = 1), or stage ``i // R`` of replica ``i % R`` on a ``("dp", "pp")``
    mesh (:mod:`~tclightning.pipeline.mesh`).

    ``config``: the recipe's ``pipeline`` section (stages x replicas must equal the processes); ``timeout`` comes from
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
        self.mesh: ReplicaMesh | None = None  # pipeline.replicas > 1

    # -- setup -----------------------------------------------------------------------------------

    def _configure_launcher(self) -> None:
        """Lightning's launcher for ``devices`` > 1, made to stop every rank when one fails
        (:mod:`~tclightning.pipeline.launch`)."""
        super()._configure_launcher()
        if isinstance(self._launcher, _SubprocessScriptLauncher):
            self._launcher = StageLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_distributed(self) -> None:
        """Lightning's rendezvous on a thread of its own. The store waits for its peers in C++ and
        retries on an interrupted call, so on the main thread a Ctrl-C or SIGTERM would wait as
        long as it does (``pipeline.timeout_s``); the main thread keeps taking signals instead. A
        rendezvous that times out is one line naming where it waited; so is one that outlasts its
        timeout (a host at MASTER_ADDR that accepts the connection and never answers: the store's
        own timeout never starts)."""
        failed: list[BaseException] = []

        def rendezvous() -> None:
            try:
                super(MultiProcessPipelineStrategy, self).setup_distributed()
            except BaseException as err:  # noqa: BLE001 -- handed to the main thread
                failed.append(err)

        thread = threading.Thread(target=rendezvous, name="tclightning-rendezvous", daemon=True)
        deadline = time.monotonic() + self.config.timeout_s + _RENDEZVOUS_GRACE_S
        with _stderr_held() as held:  # the store logs each retry with its C++ stack: shown only if it succeeds
            thread.start()
            while thread.is_alive() and time.monotonic() < deadline:
                thread.join(0.1)
            met = not failed and not thread.is_alive()
            held.keep = met
        if met:
            return
        err = failed[0] if failed else None
        if isinstance(err, torch.distributed.DistError) and "EADDRINUSE" in str(err):
            raise TclightningError(
                f"MASTER_PORT={os.environ.get('MASTER_PORT', '?')}: the port is in use on this machine (another "
                "program or run holds it), so rank 0 cannot take it; set MASTER_PORT to a free port, or unset it "
                "and the run picks one") from None
        if err is None or isinstance(err, torch.distributed.DistError):
            where = f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ.get('MASTER_PORT', '?')}"
            detail = ("no answer from there" if err is None else
                      " ".join(str(err).splitlines()[0].split())[:160])
            raise TclightningError(
                f"trainer.num_nodes={self.num_nodes} trainer.devices={self.num_processes}: the ranks did not all "
                f"meet at {where} within pipeline.timeout_s={self.config.timeout_s:g} s ({detail}); start every "
                "node's command, with the same MASTER_ADDR and MASTER_PORT") from None
        raise err

    def configure_ddp(self) -> None:
        """No DDP wrapper: build this rank's stage instead (after the module's ``setup``)."""
        module = self.lightning_module
        policy = getattr(module, self.policy_attr, None)
        if not isinstance(policy, torch.nn.Module):
            raise TclightningError(f"strategy 'pipeline' needs the LightningModule's HF decoder as '{self.policy_attr}'")
        if self.config.replicas > 1:  # a ("dp", "pp") mesh; the engine runs on this replica's pipeline
            self.mesh = ReplicaMesh(self.config.replicas, device=self.root_device, timeout_s=self.config.timeout_s)
            self.engine = PipelineEngine(policy, self.config, device=self.root_device, link_mbit=self.link_mbit,
                                         group=self.mesh.pp_group, tie_group=self.mesh.tie_group)
            self.mesh.broadcast_weights(policy)
        else:
            self.engine = PipelineEngine(policy, self.config, device=self.root_device, link_mbit=self.link_mbit)
            self.engine.broadcast_weights()

    def backend(self, request: BackendRequest) -> PipelineBackend:
        """``BackendProvider``: the module's backend over this rank's stage (after ``setup``)."""
        if self.engine is None or request.policy is not self.engine.model:
            raise TclightningError(
                f"strategy 'pipeline' split the module's '{self.policy_attr}'; ask for its backend after setup, "
                "with that policy"
            )
        return PipelineBackend(request, self.engine, self.mesh)

    # -- checkpoints -----------------------------------------------------------------------------

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's state dict, from rank 0's dense copy of the policy. Collective (Lightning
        takes it on every rank): with ``sampler.dtype`` a full sync brings that copy up to date first."""
        if self.engine is not None:
            self.engine.sync_before_checkpoint()
        return super().lightning_module_state_dict()

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
        if self.mesh is not None and self.mesh.replica != 0:  # replicas step alike: replica 0's is saved
            return {"state": own_state, "param_groups": local["param_groups"]}
        gathered = self.engine.comm.gather_objects(own_state, "gathering optimizer states for a checkpoint")
        merged: dict[Any, Any] = {}
        for state in gathered or [own_state]:
            merged.update(state)
        return {"state": merged, "param_groups": local["param_groups"]}

    def teardown(self) -> None:
        self.engine = None
        self.mesh = None
        super().teardown()
