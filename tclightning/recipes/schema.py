"""The recipe schema: one typed dataclass per section, composed here.

Each section's dataclass lives beside the code it configures (``grpo/config.py``,
``sampling/config.py``, ...), TRL-style; this module only assembles them. OmegaConf turns the
composition into a structured config, so unknown keys and wrong types fail at load time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from tclightning.anchor.config import AnchorConfig
from tclightning.grpo.config import GRPOConfig
from tclightning.models.config import ModelConfig
from tclightning.pipeline.config import PipelineConfig
from tclightning.sampling.config import SamplerConfig
from tclightning.tasks.config import TaskConfig


@dataclass
class TrainerConfig:
    """How long and where to train (maps onto ``lightning.Trainer``)."""

    steps: int = 100  # RL steps (one = P prompts x G completions, then the update)
    seed: int = 0  # seeds Lightning (python, numpy, torch), sampling and the prompt order
    precision: str = "32-true"  # 32-true | bf16-mixed | bf16-true
    accelerator: str = "auto"  # auto | cpu | gpu
    devices: int = 1  # processes per node; > 1 with strategy pipeline: one pipeline stage per process
    num_nodes: int = 1  # machines (torchrun / SLURM set the ranks; see docs/distributed.md)
    strategy: str = "auto"  # auto | pipeline (cuts from the `pipeline` section)
    num_threads: Optional[int] = None  # torch.set_num_threads; None keeps torch's default
    val_every: int = 0  # validate on the held-out split every N RL steps; 0 = never
    val_batch_size: int = 32  # held-out prompts per greedy generate call
    checkpoint_every: int = 0  # RL steps between checkpoints; 0 = only at the end / on Ctrl-C
    keep_checkpoints: int = 2  # periodic step-*.ckpt files kept (last.ckpt is always kept)


@dataclass
class LoggingConfig:
    """Where runs go and what records them."""

    root: str = "runs"  # run directories are <root>/<name>/<timestamp>/
    name: Optional[str] = None  # default: the recipe's name
    tensorboard: bool = True  # TensorBoard events in <run_dir>/tb, with a Custom Scalars layout
    csv: bool = True  # metrics.csv in the run directory (columns = metric names, plus `step`)
    progress: str = "rich"  # rich | tqdm | none
    # more Lightning loggers: short names (wandb, mlflow, comet, neptune; tensorboard and csv are
    # the two above) or {class_path, init_args} as LightningCLI writes them (docs/recipes.md)
    loggers: list[Any] = field(default_factory=list)


@dataclass
class CallbackSpec:
    """A Lightning callback as LightningCLI writes it: import path plus constructor arguments."""

    class_path: str = "???"  # import path of a lightning Callback subclass (required)
    init_args: dict[str, Any] = field(default_factory=dict)  # keyword arguments of its constructor


@dataclass
class RecipeConfig:
    """A whole run. ``defaults`` lists recipes merged underneath this one (by name or path, in
    order); ``callback_presets`` names YAML files in the top-level ``callbacks/`` folder whose
    callbacks come before the recipe's own ``callbacks``."""

    name: str = ""  # what `--recipe NAME` finds; also the default run directory name
    description: str = ""  # one line for `tclightning recipes list`
    defaults: list[str] = field(default_factory=list)  # recipes merged underneath, in order
    callback_presets: list[str] = field(default_factory=list)  # callbacks/<name>.yaml lists, before `callbacks`
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    anchor: AnchorConfig = field(default_factory=AnchorConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    callbacks: list[CallbackSpec] = field(default_factory=list)
