"""The range of every recipe value, and the checks that tie values together.

``RANGES`` holds one rule per leaf key of :class:`~tclightning.recipes.schema.RecipeConfig`
(``tests/test_bad_inputs.py`` fails if a key is missing). A rule takes the value and returns
``None`` when it is acceptable, else what was expected (``"expected a number > 0, got -1.0"``).
``CROSS_CHECKS`` hold what one value cannot say alone (heads dividing the width, a completion
fitting the tiny model's positions, the task's own settings). Everything here is pure and cheap:
nothing is built, downloaded or written, so a recipe is refused before its run starts.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from tclightning.errors import TclightningError

Rule = Callable[[Any], "str | None"]

SEED_MAX = 2**32 - 1  # numpy and Lightning seed with unsigned 32-bit integers
MAX_STEPS = 10**9  # RL steps: far beyond any run, far below the int64 arithmetic of the prompt stream
MAX_TOKENS = 2**20  # a completion or context length no decoder in reach has
MAX_WIDTH = 2**16  # tiny-model sizes (hidden, intermediate, heads, layers)


@dataclass(frozen=True)
class Problem:
    """A value outside its range: the keys involved (first = the one reported) and what was expected."""

    keys: tuple[str, ...]
    message: str


def _show(bound: float) -> str:
    return str(bound) if isinstance(bound, int) else f"{bound:g}"


def _interval(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{_show(low)}, {_show(high)}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {_show(low)}"
    if high is not None:
        return f"{'<' if high_open else '<='} {_show(high)}"
    return ""


def _bounded(kind: str, accepts: Callable[[Any], bool], low: float | None, high: float | None,
             low_open: bool, high_open: bool, optional: bool) -> Rule:
    """A value ``accepts`` takes, within the bounds (``*_open``: the bound itself is excluded)."""
    expected = " ".join(p for p in (kind, _interval(low, high, low_open, high_open)) if p)
    if optional:
        expected += " or null"

    def rule(value: Any) -> str | None:
        if value is None:
            return None if optional else f"expected {expected}, got null"
        ok = (accepts(value) and (low is None or (value > low if low_open else value >= low))
              and (high is None or (value < high if high_open else value <= high)))
        return None if ok else f"expected {expected}, got {value!r}"

    return rule


def number(low: float | None = None, high: float | None = None, *, low_open: bool = False,
           high_open: bool = False, optional: bool = False) -> Rule:
    """A finite float within the bounds (``*_open``: the bound itself is excluded)."""

    def finite(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    return _bounded("a finite number", finite, low, high, low_open, high_open, optional)


def integer(low: int | None = None, high: int | None = None, *, optional: bool = False) -> Rule:
    """An int within ``[low, high]``."""

    def whole(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    return _bounded("an integer", whole, low, high, False, False, optional)


def one_of(*options: str) -> Rule:
    """One of the named strings."""

    def rule(value: Any) -> str | None:
        return None if value in options else f"expected one of {', '.join(options)}, got {value!r}"

    return rule


def optional_one_of(*options: str) -> Rule:
    """One of the named strings, or null."""
    named = one_of(*options)
    return lambda value: None if value is None else named(value)


def text(*, nonempty: bool = False, optional: bool = False) -> Rule:
    """A string (non-blank with ``nonempty``); null only with ``optional``."""

    def rule(value: Any) -> str | None:
        if value is None:
            return None if optional else "expected a string, got null"
        if not isinstance(value, str):
            return f"expected a string, got {value!r}"
        if nonempty and not value.strip():
            return "expected a non-empty string"
        return None

    return rule


def flag(value: Any) -> str | None:
    """true or false (the schema's type already guarantees it; listed so every key has a rule)."""
    return None if isinstance(value, bool) else f"expected true or false, got {value!r}"


def anything(value: Any) -> str | None:
    """Free-form (names, descriptions, lists checked elsewhere)."""
    return None


def number_list(length: int | None, item: Rule, *, optional: bool = False) -> Rule:
    """A list of ``length`` values (any length when None), each passing ``item``."""

    def rule(value: Any) -> str | None:
        if value is None:
            return None if optional else "expected a list, got null"
        items = list(value)
        if length is not None and len(items) != length:
            return f"expected a list of {length} values, got {len(items)}: {items}"
        for i, entry in enumerate(items):
            problem = item(entry)
            if problem is not None:
                return f"entry {i}: {problem}"
        return None

    return rule


LOGGERS: dict[str, tuple[str, str | None]] = {
    "tensorboard": ("lightning.pytorch.loggers.TensorBoardLogger", None),
    "csv": ("lightning.pytorch.loggers.CSVLogger", None),
    "wandb": ("lightning.pytorch.loggers.WandbLogger", "wandb"),
    "mlflow": ("lightning.pytorch.loggers.MLFlowLogger", "mlflow"),
    "comet": ("lightning.pytorch.loggers.CometLogger", "comet_ml"),
    "neptune": ("lightning.pytorch.loggers.NeptuneLogger", "neptune"),
}
"""``logging.loggers`` short names: the Lightning logger class and the package it needs.
``tensorboard`` and ``csv`` are the run's own loggers (``logging.tensorboard`` / ``logging.csv``)."""


def logger_list(value: Any) -> str | None:
    """``logging.loggers``: a list of short names (:data:`LOGGERS`) or ``{class_path, init_args}``
    mappings (``class_path`` a short name or an import path); the classes are checked on load."""
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
            return (f"entry {i}: the run's own {path} logger takes no init_args (it is logging.{path}); for "
                    f"another one use class_path {LOGGERS[path][0]}")
    return None


def seed() -> Rule:
    return integer(0, SEED_MAX)


def positive(high: int | None = None, *, optional: bool = False) -> Rule:
    return integer(1, high, optional=optional)


def share() -> Rule:
    """A fraction in [0, 1]."""
    return number(0.0, 1.0)


# One rule per leaf key, in schema order. Probabilities, rates and learning rates are finite;
# sizes and counts are integers with the bound the code relies on.
RANGES: dict[str, Rule] = {
    "name": text(nonempty=True),
    "description": text(),
    "defaults": anything,
    "callback_presets": anything,
    # model
    "model.source": one_of("tiny", "hf", "gguf"),
    "model.name": text(nonempty=True, optional=True),
    "model.gguf_file": text(nonempty=True, optional=True),
    "model.dtype": one_of("float32", "bfloat16", "float16"),
    "model.chat_template": flag,
    "model.trust_remote_code": flag,
    "model.tiny.architecture": one_of("llama", "qwen2"),
    "model.tiny.hidden_size": positive(MAX_WIDTH),
    "model.tiny.num_layers": positive(1024),
    "model.tiny.num_heads": positive(MAX_WIDTH),
    "model.tiny.num_kv_heads": positive(MAX_WIDTH),
    "model.tiny.intermediate_size": positive(MAX_WIDTH * 8),
    "model.tiny.max_positions": integer(2, MAX_TOKENS),
    "model.warmup.steps": integer(0, MAX_STEPS),
    "model.warmup.batch_size": positive(),
    "model.warmup.lr": number(0.0, low_open=True),
    "model.warmup.seed": seed(),
    "model.warmup.target_accuracy": share(),
    "model.warmup.check_every": positive(),
    "model.warmup.check_examples": positive(),
    "model.warmup.label_noise": share(),
    "model.warmup.cache": flag,
    # task
    "task.name": one_of("arithmetic", "gsm8k", "math", "bigmath", "calculator"),
    "task.path": text(nonempty=True, optional=True),
    "task.hf_name": text(nonempty=True, optional=True),
    "task.hf_config": text(optional=True),
    "task.split": text(nonempty=True),
    "task.eval_split": text(nonempty=True, optional=True),
    "task.train_size": positive(optional=True),
    "task.eval_size": integer(0),
    "task.seed": seed(),
    "task.system_prompt": text(optional=True),
    "task.prompt_template": text(nonempty=True),
    "task.instruction": text(optional=True),
    "task.reward_timeout_s": number(0.0, 3600.0, low_open=True),
    "task.digits": positive(),
    "task.operations": text(nonempty=True),
    "task.num_train": positive(),
    "task.reverse_answer": flag,
    "task.fixed_width": flag,
    "task.answer_at": one_of("first", "last"),
    "task.max_turns": positive(),
    "task.chain": positive(),
    "task.min_solve_rate": number(0.0, 1.0, optional=True),
    "task.max_solve_rate": number(0.0, 1.0, optional=True),
    "task.sources": anything,
    # sampler
    "sampler.backend": one_of("hf", "vllm"),
    "sampler.group_size": integer(2),  # GRPO compares completions of one prompt: at least 2
    "sampler.temperature": number(0.0, low_open=True),
    "sampler.top_p": number(0.0, 1.0, low_open=True),
    "sampler.max_new_tokens": positive(MAX_TOKENS),
    "sampler.batch_size": positive(),
    "sampler.seed": seed(),
    "sampler.eval_max_new_tokens": positive(MAX_TOKENS, optional=True),
    "sampler.gpu_memory_utilization": number(0.0, 1.0, low_open=True),
    "sampler.vllm_max_model_len": positive(MAX_TOKENS, optional=True),
    "sampler.vllm_enforce_eager": flag,
    "sampler.vllm_sleep": flag,
    # grpo
    "grpo.prompts_per_step": positive(),
    "grpo.lr": number(0.0, low_open=True),
    "grpo.weight_decay": number(0.0),
    "grpo.betas": number_list(2, number(0.0, 1.0, high_open=True)),
    "grpo.warmup_steps": integer(0),
    "grpo.epochs": positive(),
    "grpo.minibatches": positive(),
    "grpo.clip_low": number(0.0, 1.0),  # the ratio's floor 1 - clip_low must stay in [0, 1]
    "grpo.clip_high": number(0.0),
    "grpo.loss_aggregation": one_of("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
    "grpo.scale_rewards": one_of("group", "none"),
    "grpo.kl_coef": number(0.0),
    "grpo.max_grad_norm": number(0.0),
    "grpo.drop_zero_variance_groups": flag,
    "grpo.overlong": one_of("none", "mask", "penalty"),
    "grpo.overlong_penalty": number(0.0),
    "grpo.tis_cap": number(0.0),
    "grpo.mask_ratio_low": number(0.0),
    "grpo.mask_ratio_high": number(0.0),
    "grpo.eps": number(0.0, low_open=True),
    # pipeline (names and budgets are checked by PipelineConfig.validate, see CROSS_CHECKS)
    "pipeline.layout": text(nonempty=True),
    "pipeline.stages": positive(1024),
    "pipeline.cuts": number_list(None, integer(0), optional=True),
    "pipeline.compressed": anything,
    "pipeline.cut_codecs": anything,
    "pipeline.shallow_count": positive(),
    "pipeline.codec": text(nonempty=True),
    "pipeline.backward_codec": text(nonempty=True, optional=True),
    "pipeline.rate": number(0.0, 1.0, low_open=True),
    "pipeline.k": positive(optional=True),
    "pipeline.fill": one_of("zero", "mean", "conditional"),  # = tclightning.codecs.FILLS (tested)
    "pipeline.fill_momentum": number(0.0, 1.0, low_open=True),
    "pipeline.fill_rank": positive(),
    "pipeline.fill_tokens": integer(0),
    "pipeline.fill_pairs": integer(0),
    "pipeline.payload_dtype": optional_one_of("float16", "bfloat16"),  # = tclightning.codecs.base.WIRE_DTYPES (tested)
    "pipeline.rescale": flag,
    "pipeline.rank": positive(optional=True),
    "pipeline.refresh_every": integer(0),
    "pipeline.refresh_tolerance": share(),
    "pipeline.basis_tokens": integer(0),
    "pipeline.seed": seed(),
    "pipeline.microbatches": positive(),
    "pipeline.schedule": one_of("gpipe", "1f1b"),
    "pipeline.timeout_s": number(0.0, low_open=True),
    "pipeline.replicas": positive(1024),
    # anchor
    "anchor.merger": one_of("none", "signed_ema", "dense", "control_variate", "masked", "trust"),
    "anchor.alpha": share(),
    "anchor.beta": number(0.0, 1.0, high_open=True),
    "anchor.latency": integer(0),
    "anchor.cadence": positive(),
    "anchor.projector": one_of("none", "damped_linear", "rank1"),
    "anchor.projector_gamma": number(0.0),
    "anchor.projector_window": integer(2),
    "anchor.warmup": one_of("none", "la_warmup"),
    "anchor.warmup_ticks": integer(0),
    "anchor.warmup_shape": one_of("geometric", "linear"),
    "anchor.warmup_stages": integer(2),
    "anchor.cv_weight": number(0.0),
    "anchor.cv_clip": number(0.0),
    "anchor.mask_kappa": number(0.0),
    "anchor.trust_floor": number(0.0, 1.0, high_open=True),
    # trainer
    "trainer.steps": positive(MAX_STEPS),
    "trainer.seed": seed(),
    "trainer.precision": one_of("32-true", "32", "bf16-mixed", "bf16-true", "16-mixed"),
    "trainer.accelerator": one_of("auto", "cpu", "gpu", "cuda", "mps"),
    "trainer.devices": positive(1024),
    "trainer.num_nodes": positive(),
    "trainer.strategy": one_of("auto", "pipeline"),
    "trainer.num_threads": positive(4096, optional=True),
    "trainer.val_every": integer(0),
    "trainer.val_batch_size": positive(),
    "trainer.checkpoint_every": integer(0),
    "trainer.keep_checkpoints": integer(0),
    # logging
    "logging.root": text(nonempty=True),
    "logging.name": text(nonempty=True, optional=True),
    "logging.tensorboard": flag,
    "logging.csv": flag,
    "logging.progress": one_of("rich", "tqdm", "none"),
    "logging.loggers": logger_list,  # each class_path is checked on load (loader.resolve_logger_class)
    "callbacks": anything,  # each class_path is checked on its own (loader.resolve_callback_class)
}


def leaf_keys(cfg: DictConfig, prefix: str = "") -> list[str]:
    """Every leaf key of a structured config (sections recursed into, lists and dicts are leaves)."""
    keys = []
    for key in cfg.keys():
        node = cfg._get_node(key)
        full = f"{prefix}{key}"
        is_section = isinstance(node, DictConfig) and OmegaConf.get_type(node) not in (dict, None)
        keys.extend(leaf_keys(node, full + ".") if is_section else [full])  # type: ignore[arg-type]
    return keys


def _get(cfg: DictConfig, key: str) -> Any:
    value = OmegaConf.select(cfg, key)
    return OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value


# ------------------------------------------------------------------------------ cross checks
def _tiny_shape(cfg: DictConfig) -> Iterator[Problem]:
    if cfg.model.source != "tiny":
        return
    t = cfg.model.tiny
    if t.hidden_size % t.num_heads:
        yield Problem(("model.tiny.num_heads", "model.tiny.hidden_size"),
                      f"{t.num_heads} heads do not divide hidden_size {t.hidden_size}")
    elif (t.hidden_size // t.num_heads) % 2:
        yield Problem(("model.tiny.num_heads", "model.tiny.hidden_size"),
                      f"head width hidden_size / num_heads = {t.hidden_size // t.num_heads} must be even (rotary "
                      "positions rotate channel pairs)")
    if t.num_heads % t.num_kv_heads:
        yield Problem(("model.tiny.num_kv_heads", "model.tiny.num_heads"),
                      f"{t.num_kv_heads} key/value heads do not divide num_heads {t.num_heads}")


def _lengths(cfg: DictConfig) -> Iterator[Problem]:
    s = cfg.sampler
    if cfg.model.source == "tiny":
        # the prompt needs at least one position: a completion must leave room for it
        limit = cfg.model.tiny.max_positions
        for key in ("max_new_tokens", "eval_max_new_tokens"):
            value = s[key]
            if value is not None and value >= limit:
                yield Problem((f"sampler.{key}", "model.tiny.max_positions"),
                              f"{value} tokens do not fit the tiny model's {limit} positions "
                              "(model.tiny.max_positions) beside the prompt")
    if s.backend == "vllm" and s.vllm_max_model_len is not None and s.max_new_tokens >= s.vllm_max_model_len:
        yield Problem(("sampler.max_new_tokens", "sampler.vllm_max_model_len"),
                      f"{s.max_new_tokens} tokens leave no room for the prompt in vllm_max_model_len "
                      f"{s.vllm_max_model_len}")


def _model_source(cfg: DictConfig) -> Iterator[Problem]:
    m = cfg.model
    if m.source == "hf" and not m.name:
        yield Problem(("model.name", "model.source"), "required for source 'hf' (a hub name or a local directory)")
    if m.source == "gguf":
        if not m.gguf_file:
            yield Problem(("model.gguf_file", "model.source"), "required for source 'gguf' (a path or package:file)")
        elif ":" not in m.gguf_file and not Path(m.gguf_file).expanduser().is_file():
            yield Problem(("model.gguf_file",), f"no such file: {m.gguf_file}")


MAX_COMPLETIONS = 2**20
"""Completions one RL step may sample (prompts x group size): large GRPO steps sample ~16k; the
bound keeps a typo from allocating before the first step says anything."""


def _grpo(cfg: DictConfig) -> Iterator[Problem]:
    g = cfg.grpo
    completions = g.prompts_per_step * cfg.sampler.group_size
    if completions > MAX_COMPLETIONS:
        yield Problem(("grpo.prompts_per_step", "sampler.group_size"),
                      f"{g.prompts_per_step} prompts x {cfg.sampler.group_size} completions = {completions} per step, "
                      f"more than {MAX_COMPLETIONS} (a step samples every one of them at once)")
    if g.mask_ratio_high > 0 and g.mask_ratio_low >= g.mask_ratio_high:
        yield Problem(("grpo.mask_ratio_low", "grpo.mask_ratio_high"),
                      f"mask_ratio_low {g.mask_ratio_low} must be below mask_ratio_high {g.mask_ratio_high}")
    if g.mask_ratio_high == 0 and g.mask_ratio_low > 0:
        yield Problem(("grpo.mask_ratio_low", "grpo.mask_ratio_high"),
                      "masking is on only with mask_ratio_high > 0; set both or neither")


def _task(cfg: DictConfig) -> Iterator[Problem]:
    t = cfg.task
    if t.min_solve_rate is not None and t.max_solve_rate is not None and t.min_solve_rate > t.max_solve_rate:
        yield Problem(("task.min_solve_rate", "task.max_solve_rate"),
                      f"min_solve_rate {t.min_solve_rate} exceeds max_solve_rate {t.max_solve_rate}")
    if cfg.trainer.val_every > 0 and t.eval_size < 1:
        yield Problem(("task.eval_size", "trainer.val_every"),
                      f"validation every {cfg.trainer.val_every} steps needs held-out prompts (eval_size >= 1)")
    if t.path and not t.hf_name and not Path(t.path).expanduser().exists():
        yield Problem(("task.path",), f"task data not found: {t.path}")
    # The task's own checks (digits, operations, template, ...): building one reads no data.
    from tclightning.agentic import build_agentic_task, is_agentic
    from tclightning.tasks import build_task
    from tclightning.tasks.config import TaskConfig

    task_cfg = TaskConfig(**OmegaConf.to_container(t))  # type: ignore[arg-type]
    try:
        build_agentic_task(task_cfg) if is_agentic(t.name) else build_task(task_cfg)
    except TclightningError as err:
        yield Problem(("task",), str(err))


def _pipeline(cfg: DictConfig) -> Iterator[Problem]:
    if cfg.trainer.strategy != "pipeline":
        return  # the section is read by the pipeline strategy only
    from tclightning.pipeline.config import PipelineConfig
    from tclightning.pipeline.layout import compressed_flags, cut_layers

    config = PipelineConfig(**OmegaConf.to_container(cfg.pipeline))  # type: ignore[arg-type]
    try:
        config.validate()
    except TclightningError as err:
        yield Problem(("pipeline",), str(err))
        return
    if cfg.model.source == "tiny":  # the layer count is known before the model exists
        try:
            compressed_flags(config, len(cut_layers(config, cfg.model.tiny.num_layers)))
        except TclightningError as err:
            yield Problem(("pipeline", "model.tiny.num_layers"), str(err))


def _run_name(cfg: DictConfig) -> Iterator[Problem]:
    name = cfg.logging.name or cfg.name
    key = "logging.name" if cfg.logging.name else "name"
    if "/" in name or "\\" in name or name.strip() in (".", ".."):
        yield Problem((key,), f"the run folder's name must be one plain folder name, got {name!r}")


def _anchor(cfg: DictConfig) -> Iterator[Problem]:
    if cfg.anchor.merger in ("signed_ema", "control_variate", "masked", "trust") and cfg.trainer.strategy != "pipeline":
        yield Problem(("anchor.merger", "trainer.strategy"),
                      f"{cfg.anchor.merger} merges a compressed trainer's gradient with the dense anchor's: set "
                      "trainer.strategy: pipeline with a compressed pipeline.layout")
    processes = cfg.trainer.devices * cfg.trainer.num_nodes
    if cfg.anchor.merger == "control_variate" and processes > 1:
        # The anchor job reruns the fast circuit at the snapshot; only the one-process backend can.
        yield Problem(("anchor.merger", "trainer.devices"),
                      "'control_variate' runs the compressed circuit at the anchor's snapshot, which only the "
                      "one-process pipeline does: use anchor.merger=trust, masked or signed_ema across processes, "
                      "or trainer.devices x trainer.num_nodes = 1")
    if cfg.anchor.merger in ("signed_ema", "masked", "trust") and cfg.anchor.projector == "rank1" and processes > 1:
        # Each rank merges its own stage; rank1's trajectory direction spans every stage's weights.
        yield Problem(("anchor.projector", "trainer.devices"),
                      "'rank1' is not supported across processes (its trajectory direction spans every stage's "
                      "weights; the merger and the other projectors work per coordinate, so each rank merges its "
                      "own stage): use anchor.projector=none or damped_linear, or trainer.devices x "
                      "trainer.num_nodes = 1")


CROSS_CHECKS: tuple[Callable[[DictConfig], Iterator[Problem]], ...] = (
    _tiny_shape, _lengths, _model_source, _grpo, _anchor, _run_name, _task, _pipeline,
)


def problems(cfg: DictConfig, keys: Sequence[str] | None = None) -> Iterator[Problem]:
    """Every value of ``cfg`` outside its range, then every failed cross check, in order."""
    for key in keys if keys is not None else RANGES:
        message = RANGES[key](_get(cfg, key))
        if message is not None:
            yield Problem((key,), message)
    for check in CROSS_CHECKS:
        yield from check(cfg)
