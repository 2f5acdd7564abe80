"""The ``run`` verb: recipe -> validated config -> ``Trainer.fit`` -> summary.

Everything that can fail on user input (recipe, overrides, callbacks, resume target) fails
before the run directory is created.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from tclightning.errors import TclightningError
from tclightning.recipes.loader import instantiate_callbacks, load_recipe, to_dataclass, to_yaml
from tclightning.recipes.schema import RecipeConfig

RUN_DIR_ENV = "TCLIGHTNING_RUN_DIR"
"""Multi-process runs: the run directory every rank uses (set by rank 0 before Lightning launches
the others; set it yourself on every node for torchrun / SLURM launches)."""


@dataclass
class RunPlan:
    """Where a run writes and what it resumes from (decided before anything is written)."""

    run_dir: Path
    ckpt_path: Path | None
    resume_step: int | None


def plan_run(recipe: RecipeConfig, resume: str | None) -> RunPlan:
    root = Path(recipe.logging.root) / (recipe.logging.name or recipe.name)
    if resume is None:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        run_dir, n = root / stamp, 1
        while run_dir.exists():
            run_dir, n = root / f"{stamp}-{n}", n + 1
        return RunPlan(run_dir, None, None)
    if resume == "last":
        candidates = sorted(root.glob("*/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime)
        if not candidates:
            raise TclightningError(f"--resume last: no checkpoint under {root}/*/checkpoints/last.ckpt")
        ckpt = candidates[-1]
    else:
        ckpt = Path(resume).expanduser()
        if ckpt.is_dir():
            ckpt = ckpt / "checkpoints" / "last.ckpt"
        if not ckpt.is_file():
            raise TclightningError(f"--resume: no such checkpoint: {ckpt}")
    return RunPlan(ckpt.resolve().parent.parent, ckpt.resolve(), checkpoint_step(ckpt))


def checkpoint_step(path: Path) -> int:
    """The number of completed RL steps recorded in a tclightning checkpoint."""
    import torch

    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as err:  # noqa: BLE001 - any unreadable file is the same user error
        raise TclightningError(f"--resume: cannot read checkpoint {path}: {err}") from None
    state = ckpt.get("tclightning")
    if not state:
        raise TclightningError(f"--resume: {path} is not a tclightning checkpoint")
    return int(state["rl_step"])


def require_hardware(recipe: RecipeConfig) -> None:
    """Refuse, before anything is written, a GPU-scale recipe on a machine without CUDA."""
    import torch

    wants_gpu = recipe.trainer.accelerator in ("gpu", "cuda") or recipe.sampler.backend == "vllm"
    if wants_gpu and not torch.cuda.is_available():
        raise TclightningError(
            f"recipe '{recipe.name}' needs a CUDA GPU (trainer.accelerator={recipe.trainer.accelerator}, "
            f"sampler.backend={recipe.sampler.backend}) and none is visible; on a CPU run 'tiny' "
            "or 'gsm8k-shallow' instead"
        )


def require_pipeline_for_processes(recipe: RecipeConfig) -> None:
    """More than one process means one pipeline stage per process: refuse anything else early."""
    t = recipe.trainer
    processes = t.devices * t.num_nodes
    if processes > 1 and t.strategy != "pipeline":
        raise TclightningError(
            f"trainer.devices x trainer.num_nodes = {processes} needs trainer.strategy=pipeline "
            f"(one pipeline stage per process, pipeline.stages={processes}); there is no data-parallel mode"
        )


def build_trainer(recipe: RecipeConfig, plan: RunPlan, user_callbacks: list[Any]) -> Any:
    import lightning as L

    from tclightning.callbacks.anchor_merge import AnchorMerge
    from tclightning.callbacks.checkpointing import GracefulStop, StepCheckpoint
    from tclightning.callbacks.progress import GRPORichProgressBar, GRPOTQDMProgressBar
    from tclightning.logging import ResumableCSVLogger, build_tensorboard

    t = recipe.trainer
    loggers: list[Any] = []
    if recipe.logging.tensorboard:
        loggers.append(build_tensorboard(plan.run_dir, plan.resume_step))
    if recipe.logging.csv:
        loggers.append(ResumableCSVLogger(plan.run_dir, plan.resume_step))
    callbacks: list[Any] = [
        StepCheckpoint(plan.run_dir / "checkpoints", t.checkpoint_every, t.keep_checkpoints),
        GracefulStop(),
        *user_callbacks,
    ]
    a = recipe.anchor
    if a.merger == "signed_ema" and not any(isinstance(c, AnchorMerge) for c in callbacks):
        options = {"gamma": a.projector_gamma, **({"window": a.projector_window} if a.projector == "rank1" else {})}
        callbacks.append(AnchorMerge(a.merger, a.alpha, a.beta, a.projector,
                                     options if a.projector != "none" else None))
    progress = {"rich": GRPORichProgressBar, "tqdm": GRPOTQDMProgressBar}.get(recipe.logging.progress)
    if progress is not None:
        callbacks.append(progress())
    strategy: Any = t.strategy
    if t.strategy == "pipeline" and t.devices * t.num_nodes > 1:
        from tclightning.pipeline.multiprocess import MultiProcessPipelineStrategy

        strategy = MultiProcessPipelineStrategy(config=recipe.pipeline)
    elif t.strategy == "pipeline":
        from tclightning.pipeline import PipelineStrategy

        strategy = PipelineStrategy(config=recipe.pipeline)
    return L.Trainer(
        max_epochs=1,  # one pass over the prompt stream = trainer.steps RL steps
        max_steps=-1,
        accelerator=t.accelerator,
        devices=t.devices,
        num_nodes=t.num_nodes,
        strategy=strategy,
        precision=t.precision,
        logger=loggers or False,
        callbacks=callbacks,
        enable_checkpointing=True,  # with StepCheckpoint (RL steps) in place of ModelCheckpoint (ticks)
        enable_progress_bar=progress is not None,
        enable_model_summary=False,
        log_every_n_steps=1,
        val_check_interval=t.val_every if t.val_every > 0 else None,
        check_val_every_n_epoch=None if t.val_every > 0 else 1,
        limit_val_batches=None if t.val_every > 0 else 0,
        num_sanity_val_steps=0,
        default_root_dir=str(plan.run_dir),
    )


def build_module(recipe: RecipeConfig) -> Any:
    from tclightning.grpo.module import GRPOModule

    return GRPOModule(
        model=recipe.model,
        task=recipe.task,
        sampler=recipe.sampler,
        grpo=recipe.grpo,
        anchor=recipe.anchor,
        total_steps=recipe.trainer.steps,
        seed=recipe.trainer.seed,
        val_batch_size=recipe.trainer.val_batch_size,
    )


def run(
    recipe_ref: str,
    overrides: Sequence[str] = (),
    resume: str | None = None,
    quiet: bool = False,
    extra_callbacks: Sequence[Any] = (),
) -> dict[str, Any]:
    """Train one recipe; returns the run summary (also written to ``<run_dir>/summary.json``).

    ``extra_callbacks`` are added after the recipe's (for programmatic use and tests).
    """
    cfg: DictConfig = load_recipe(recipe_ref, overrides)
    recipe = to_dataclass(cfg)
    user_callbacks = [*instantiate_callbacks(cfg), *extra_callbacks]
    require_hardware(recipe)
    require_pipeline_for_processes(recipe)
    plan = plan_run(recipe, resume)
    multiprocess = recipe.trainer.devices * recipe.trainer.num_nodes > 1
    if multiprocess and os.environ.get(RUN_DIR_ENV):  # a rank Lightning (or the user) launched
        plan = RunPlan(Path(os.environ[RUN_DIR_ENV]), plan.ckpt_path, plan.resume_step)

    import lightning as L
    import torch

    from tclightning.grpo.summary import summarize

    quiet_lightning()
    if recipe.trainer.num_threads:
        torch.set_num_threads(recipe.trainer.num_threads)
    L.seed_everything(recipe.trainer.seed, workers=True, verbose=False)
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    (plan.run_dir / "recipe.yaml").write_text(to_yaml(cfg))
    started = time.perf_counter()
    module = build_module(recipe)
    trainer = build_trainer(recipe, plan, user_callbacks)
    launched_here = multiprocess and RUN_DIR_ENV not in os.environ
    if launched_here:  # the ranks Lightning starts inherit this environment: one run directory
        os.environ[RUN_DIR_ENV] = str(plan.run_dir)
    try:
        # Our own checkpoints carry RNG states (numpy arrays), so they are not weights-only.
        trainer.fit(module, ckpt_path=str(plan.ckpt_path) if plan.ckpt_path else None, weights_only=False)
    finally:
        if launched_here:
            os.environ.pop(RUN_DIR_ENV, None)
    for logger in trainer.loggers:
        logger.finalize("success")
    if trainer.global_rank != 0:  # rank 0 logs, checkpoints and summarises
        return {}
    summary = summarize(plan.run_dir, wall_time_s=time.perf_counter() - started, extra=module.warmup_stats)
    if not quiet:
        from tclightning.grpo.summary import print_summary

        print_summary(summary)
    return summary


def quiet_lightning() -> None:
    """Keep the console for the progress bar and the summary: no hardware banners, tips, or
    deprecation notices Lightning raises against newer torch."""
    import logging
    import warnings

    from tclightning.callbacks.health_actions import HealthWarning

    logging.getLogger("lightning.pytorch.utilities.rank_zero").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
    plain = warnings.formatwarning
    if getattr(plain, "tclightning", False):  # installed by an earlier run in this process
        return

    def health_first(message: Any, category: type[Warning], *args: Any, **kwargs: Any) -> str:
        # Health warnings are for the person watching the run: the message alone, no file:line.
        return f"health: {message}\n" if issubclass(category, HealthWarning) else plain(message, category, *args, **kwargs)

    health_first.tclightning = True  # type: ignore[attr-defined]
    warnings.formatwarning = health_first


def resolved_yaml(recipe_ref: str, overrides: Sequence[str] = ()) -> str:
    return OmegaConf.to_yaml(load_recipe(recipe_ref, overrides))
