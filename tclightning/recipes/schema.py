"""The recipe schema: one typed dataclass per section, composed here.

Each section's dataclass lives beside the code it configures (``grpo/config.py``,
``sampling/config.py``, ...), TRL-style, every key with its range and help beside its field
(:func:`tclightning.settings.setting`); this module only assembles them and holds the two
sections no subpackage owns (``trainer``, ``logging``). OmegaConf turns the composition into a
structured config, so unknown keys and wrong types fail at load time.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any, Optional

from tclightning.anchor import config as anchor_config
from tclightning.anchor.config import AnchorConfig
from tclightning.grpo import config as grpo_config
from tclightning.grpo.config import GRPOConfig
from tclightning.models import config as model_config
from tclightning.models.config import ModelConfig
from tclightning.pipeline import config as pipeline_config
from tclightning.pipeline.config import PipelineConfig
from tclightning.pipeline.strategy import STRATEGY_NAME
from tclightning.sampling import config as sampler_config
from tclightning.sampling.config import SamplerConfig
from tclightning.settings import MAX_STEPS, anything, integer, local_folder, one_of, positive, seed, setting, text
from tclightning.tasks import config as task_config
from tclightning.tasks.config import TaskConfig

PRECISIONS = ("32-true", "32", "bf16-mixed", "bf16-true", "16-mixed")
"""``trainer.precision``: the Lightning precisions a run accepts."""

ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps")
"""``trainer.accelerator``: the Lightning accelerators a run accepts."""

STRATEGIES = ("auto", STRATEGY_NAME)
"""``trainer.strategy``: Lightning's default, or the pipeline Strategy (the ``pipeline`` section)."""

PROGRESS_BARS = ("rich", "tqdm", "none")
"""``logging.progress``: the progress display."""

LOGGERS: dict[str, tuple[str, str | None]] = {
    "tensorboard": ("lightning.pytorch.loggers.TensorBoardLogger", None),
    "csv": ("lightning.pytorch.loggers.CSVLogger", None),
    "wandb": ("lightning.pytorch.loggers.WandbLogger", "wandb"),
    "mlflow": ("lightning.pytorch.loggers.MLFlowLogger", "mlflow"),
    "comet": ("lightning.pytorch.loggers.CometLogger", "comet_ml"),
    "neptune": ("lightning.pytorch.loggers.NeptuneLogger", "neptune"),
}
"""``logging.loggers`` short names: the Lightning logger class and the package it needs.
``tensorboard`` and ``csv`` are the run's own loggers (events in ``<run_dir>/tb``, ``<run_dir>/metrics.csv``),
the two a run has by default."""


def logger_list(value: Any) -> str | None:
    """``logging.loggers``: a list of short names (:data:`LOGGERS`) or ``{class_path, init_args}``
    mappings (``class_path`` a short name or an import path); the classes are checked on load
    (``loader.resolve_logger_class``)."""
    if not isinstance(value, list):
        return f"expected a list of loggers, got {value!r}"
    names = ", ".join(sorted(LOGGERS))
    for i, entry in enumerate(value):
        if isinstance(entry, str):
            if entry not in LOGGERS:
                close = difflib.get_close_matches(entry, list(LOGGERS), n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                return (f"entry {i}: unknown logger '{entry}'{hint}; use one of {names}, or "
                        "{class_path: package.module.Logger, init_args: {...}}")
            continue
        if not isinstance(entry, dict):
            return f"entry {i}: expected a logger name or {{class_path, init_args}}, got {entry!r}"
        extra = set(entry) - {"class_path", "init_args"}
        if extra:
            return f"entry {i}: unknown key(s) {sorted(extra)}; a logger entry has class_path and init_args"
        path = entry.get("class_path")
        if not isinstance(path, str) or not path:
            return f"entry {i}: class_path must be a logger name ({names}) or an import path"
        if not isinstance(entry.get("init_args", {}), dict):
            return f"entry {i}: init_args must be a mapping of constructor arguments"
        if path in ("tensorboard", "csv") and entry.get("init_args"):
            return (f"entry {i}: the run's own {path} logger takes no init_args (it writes into the run folder); "
                    f"for another one use class_path {LOGGERS[path][0]}")
    return None


@dataclass
class TrainerConfig:
    """How long and where to train (maps onto ``lightning.Trainer``)."""

    steps: int = setting(100, positive(MAX_STEPS), "RL steps (one = P prompts x G completions, then the update)")
    seed: int = setting(0, seed(), "seeds Lightning (python, numpy, torch), sampling and the prompt order")
    precision: str = setting("32-true", one_of(PRECISIONS), "Lightning precision: 32-true | bf16-mixed | bf16-true")
    accelerator: str = setting("auto", one_of(ACCELERATORS), "auto | cpu | gpu")
    devices: int = setting(1, positive(1024),
                           "processes per node; > 1 with strategy pipeline: one pipeline stage per process")
    num_nodes: int = setting(1, positive(65536), "machines (torchrun / SLURM set the ranks; see docs/distributed.md)")
    strategy: str = setting("auto", one_of(STRATEGIES), "auto | pipeline (cuts from the `pipeline` section)")
    num_threads: Optional[int] = setting(None, positive(4096, optional=True),
                                         "torch.set_num_threads; None keeps torch's default")
    val_every: int = setting(0, integer(0), "validate on the held-out split every N RL steps; 0 = never")
    val_batch_size: int = setting(32, positive(), "held-out prompts per greedy generate call")
    checkpoint_every: int = setting(0, integer(0), "RL steps between checkpoints; 0 = only at the end / on Ctrl-C")
    keep_checkpoints: int = setting(2, integer(0), "periodic step-*.ckpt files kept (last.ckpt is always kept)")


@dataclass
class LoggingConfig:
    """Where runs go and what records them."""

    root: str = setting("runs", local_folder, "run directories are <root>/<name>/<timestamp>/, on this machine")
    name: Optional[str] = setting(None, text(nonempty=True, optional=True, printable=True),
                                  "default: the recipe's name")
    progress: str = setting("rich", one_of(PROGRESS_BARS), "rich | tqdm | none")
    loggers: list[Any] = setting(
        ["tensorboard", "csv"], logger_list,
        "every logger of the run, as Lightning's Trainer(logger=[...]) takes them: short names or {class_path, "
        "init_args} as LightningCLI writes them (docs/recipes.md). tensorboard: events in <run_dir>/tb with a Custom "
        "Scalars layout; csv: <run_dir>/metrics.csv (columns = metric names, plus `step`), which a resume and "
        "`tclightning summary` read; also wandb, mlflow, comet, neptune. To add one, list the two defaults too")


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

    name: str = setting("", text(nonempty=True, printable=True),
                        "what `--recipe NAME` finds; also the default run directory name")
    description: str = setting("", text(printable=True, lines=True), "one line for `tclightning recipes list`")
    defaults: list[str] = setting([], anything, "recipes merged underneath, in order")
    callback_presets: list[str] = setting([], anything, "callbacks/<name>.yaml lists, before `callbacks`")
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    anchor: AnchorConfig = field(default_factory=AnchorConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    callbacks: list[CallbackSpec] = setting(
        [], anything, "Lightning callbacks {class_path, init_args}; each class_path is checked on its own "
        "(loader.resolve_callback_class)")


SECTION_MODULES = (("model", model_config), ("task", task_config), ("sampler", sampler_config),
                   ("grpo", grpo_config), ("pipeline", pipeline_config), ("anchor", anchor_config))
"""The config module of each section; each may list ``RETIRED_KEYS`` (read by no option now),
``MOVED_KEYS`` (``{old key: the key holding its value now}``), ``REPLACED_BY`` (``{retired key: what
its recipe is told}``) and ``upgrade`` (an earlier version's section in today's keys)."""

LOGGING_MOVED_KEYS: dict[str, str] = {
    "tensorboard": "loggers (the run's loggers, [tensorboard, csv] by default: leave tensorboard out to turn it off)",
    "csv": "loggers (the run's loggers, [tensorboard, csv] by default: leave csv out to turn it off)",
}
"""Keys of the ``logging`` section an earlier version read: ``logging.loggers`` lists the run's own two now."""


def upgrade_logging(section: Mapping[str, Any]) -> dict[str, Any]:
    """A ``logging`` section as an earlier version recorded it, in today's keys: the run's own
    loggers it had on (``tensorboard``, ``csv``: true by default) lead ``loggers``."""
    out = dict(section)
    if "tensorboard" not in out and "csv" not in out:
        return out
    own = [name for name in ("tensorboard", "csv") if out.pop(name, True)]
    listed = list(out.get("loggers") or [])
    out["loggers"] = [*(name for name in own if name not in listed), *listed]
    return out


MOVED_KEYS: dict[str, str] = {
    f"{section}.{old}": f"{section}.{new}"
    for section, module in SECTION_MODULES
    for old, new in getattr(module, "MOVED_KEYS", {}).items()
} | {f"logging.{old}": f"logging.{new}" for old, new in LOGGING_MOVED_KEYS.items()}
"""Keys an earlier version read that another key holds now, each with its replacement as a recipe
writes it."""

RETIRED_HINTS: dict[str, str] = {key: f"use {new}" for key, new in MOVED_KEYS.items()} | {
    f"{section}.{old}": hint for section, module in SECTION_MODULES for old, hint in getattr(module, "REPLACED_BY", {}).items()
}
"""What a recipe or override that sets a moved or retired key is told (one line, with the file and the key)."""

RETIRED_KEYS: tuple[str, ...] = tuple(
    f"{section}.{key}" for section, module in SECTION_MODULES for key in getattr(module, "RETIRED_KEYS", ())
) + tuple(MOVED_KEYS)
"""Keys an earlier version wrote into a checkpoint's hyper-parameters or a run's record that no
option reads now (each section module's ``RETIRED_KEYS``, and the moved keys once
:func:`upgrade_sections` has carried their values over): read without them."""


def upgrade_sections(data: Mapping[str, Any]) -> dict[str, Any]:
    """Recipe sections as an earlier version saved them (a checkpoint's hyper-parameters, a run's
    record), each moved key's value carried to the key that holds it now (each section module's
    ``upgrade``); anything else is passed on as it was."""
    out = dict(data)
    for section, module in SECTION_MODULES:
        upgrade = getattr(module, "upgrade", None)
        if upgrade is not None and isinstance(out.get(section), Mapping):
            out[section] = upgrade(out[section])
    if isinstance(out.get("logging"), Mapping):
        out["logging"] = upgrade_logging(out["logging"])
    return out
