"""A recipe checked against every key's range, then the checks that tie values together.

Each key's range is declared once, beside its dataclass field (:func:`tclightning.settings.setting`);
:data:`RULES` is the schema walked into ``{key: rule}``. :data:`CROSS_CHECKS` hold what one value
cannot say alone (heads dividing the width, a completion fitting the tiny model's positions, the
task's own settings, the pipeline's layout), each with the sections it reads, so a checkpoint (which
stores only some sections) runs the checks it can. Everything here is pure and cheap: nothing is
built, downloaded or written, so a recipe is refused before its run starts.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from tclightning.errors import TclightningError
from tclightning.pipeline.strategy import STRATEGY_NAME
from tclightning.recipes.schema import RecipeConfig
from tclightning.settings import Problem, Rule, one_of, settings

RULES: dict[str, Rule] = {s.key: s.rule for s in settings(RecipeConfig)}
"""Every leaf key of :class:`RecipeConfig`, in schema order, with its range (``tests/test_bad_inputs.py``
checks this covers every key OmegaConf sees)."""


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
    if cfg.model.source == "tiny":
        yield from OmegaConf.to_object(cfg.model.tiny).problems()


def _lengths(cfg: DictConfig) -> Iterator[Problem]:
    s = cfg.sampler
    if cfg.model.source == "tiny":
        # the prompt needs at least one position: a completion must leave room for it
        limit = cfg.model.tiny.max_positions
        if s.max_new_tokens >= limit:
            yield Problem(("sampler.max_new_tokens", "model.tiny.max_positions"),
                          f"{s.max_new_tokens} tokens do not fit the tiny model's {limit} positions "
                          "(model.tiny.max_positions) beside the prompt")
    model_len = s.vllm.get("max_model_len")
    if s.backend == "vllm" and model_len is not None and s.max_new_tokens >= model_len:
        yield Problem(("sampler.max_new_tokens", "sampler.vllm"),
                      f"{s.max_new_tokens} tokens leave no room for the prompt in sampler.vllm.max_model_len {model_len}")


def _model_source(cfg: DictConfig) -> Iterator[Problem]:
    m = cfg.model
    if m.source == "hf" and not m.name:
        yield Problem(("model.name", "model.source"), "required for source 'hf' (a hub name or a local directory)")
    if m.source == "gguf":
        if not m.gguf_file:
            yield Problem(("model.gguf_file", "model.source"), "required for source 'gguf' (a path or package:file)")
        else:  # a path or package:file, found as loading finds it (never importing the package)
            from tclightning.models.loading import package_folder, resolve_gguf

            package = m.gguf_file.split(":", 1)[0]
            uninstalled = ":" in m.gguf_file and not Path(m.gguf_file).exists() and package_folder(package) is None
            if not uninstalled:  # a package not installed yet (`make smollm2`) is named when the model loads
                try:
                    resolve_gguf(m.gguf_file)
                except TclightningError as err:
                    yield Problem(("model.gguf_file",), str(err).removeprefix("model.gguf_file: "))
    if m.source == "hf" and m.name and Path(m.name).expanduser().exists():  # a local model, not a hub name
        local = Path(m.name).expanduser()
        if not local.is_dir():
            yield Problem(("model.name",), f"{m.name} is a file, not a model folder (a .gguf file is "
                                           "model.source=gguf with model.gguf_file)")
        elif not (local / "config.json").exists():
            yield Problem(("model.name",), f"{m.name} has no config.json: not a Hugging Face model folder")
        else:
            from tclightning.models.loading import check_model_folder

            try:
                check_model_folder(local)
            except TclightningError as err:
                yield Problem(("model.name",), str(err))


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


def _held_out(cfg: DictConfig) -> Iterator[Problem]:
    if cfg.trainer.val_every > 0 and cfg.task.eval_size < 1:
        yield Problem(("task.eval_size", "trainer.val_every"),
                      f"validation every {cfg.trainer.val_every} steps needs held-out prompts (eval_size >= 1)")


def _task(cfg: DictConfig) -> Iterator[Problem]:
    from tclightning.agentic import ENVIRONMENTS, build_agentic_task, is_agentic
    from tclightning.tasks import TASKS, build_task
    from tclightning.tasks.config import TaskConfig

    t = cfg.task
    unknown = one_of([*TASKS, *ENVIRONMENTS])(t.name)
    if unknown is not None:
        yield Problem(("task.name",), unknown)
        return
    if t.path and not t.hf_name and not Path(t.path).expanduser().exists():
        yield Problem(("task.path",), f"task data not found: {t.path}")
    # The task's own checks (digits, operations, template, ...): building one reads no data.
    task_cfg = TaskConfig(**OmegaConf.to_container(t))  # type: ignore[arg-type]
    try:
        task = build_agentic_task(task_cfg) if is_agentic(t.name) else build_task(task_cfg)
    except TclightningError as err:
        yield Problem(("task",), str(err))
        return
    for key in ("path", "hf_name"):  # a data source the task would never read: the run would train on other data
        if t[key] and not task.reads_data:
            yield Problem((f"task.{key}",), f"task '{t.name}' generates its problems and reads no data; "
                                            "choose a task that reads it (gsm8k, math, bigmath) or remove the key")


def _pipeline(cfg: DictConfig) -> Iterator[Problem]:
    if cfg.trainer.strategy != STRATEGY_NAME:
        return  # the section is read by the pipeline strategy only
    from tclightning.pipeline.config import PipelineConfig
    from tclightning.pipeline.layout import compressed_flags, cut_layers

    config = PipelineConfig(**OmegaConf.to_container(cfg.pipeline))  # type: ignore[arg-type]
    found = list(config.problems())  # each field is in its range already (RULES)
    if found:
        yield from found
        return
    if cfg.model.source == "tiny":  # the layer count is known before the model exists
        try:
            compressed_flags(config, len(cut_layers(config, cfg.model.tiny.num_layers)))
        except TclightningError as err:
            yield Problem(("pipeline", "model.tiny.num_layers"), str(err))


NAME_MAX = 255
"""Bytes in one folder name on the common filesystems (ext4, XFS, APFS, NTFS in UTF-16 units)."""


def _run_name(cfg: DictConfig) -> Iterator[Problem]:
    name = cfg.logging.name or cfg.name
    key = "logging.name" if cfg.logging.name else "name"
    if "/" in name or "\\" in name or name.strip() in (".", ".."):
        yield Problem((key,), f"the run folder's name must be one plain folder name, got {name!r}")
    elif len(name.encode("utf-8", "surrogateescape")) > NAME_MAX:
        yield Problem((key,), f"the run folder's name is {len(name.encode('utf-8', 'surrogateescape'))} bytes; "
                              f"a folder name holds at most {NAME_MAX}")


def _anchor(cfg: DictConfig) -> Iterator[Problem]:
    if cfg.anchor.merger != "none" and cfg.trainer.strategy != STRATEGY_NAME:
        yield Problem(("anchor.merger", "trainer.strategy"),
                      f"{cfg.anchor.merger} merges a compressed trainer's gradient with the dense anchor's: set "
                      f"trainer.strategy: {STRATEGY_NAME} with a compressed pipeline.layout")
    processes = cfg.trainer.devices * cfg.trainer.num_nodes
    if cfg.anchor.merger == "control_variate" and processes > 1:
        # The anchor job reruns the fast circuit at the snapshot; only the one-process backend can.
        yield Problem(("anchor.merger", "trainer.devices"),
                      "'control_variate' runs the compressed circuit at the anchor's snapshot, which only the "
                      "one-process pipeline does: use anchor.merger=signed_ema across processes, "
                      "or trainer.devices x trainer.num_nodes = 1")
    if cfg.anchor.merger == "signed_ema" and cfg.anchor.projector == "rank1" and processes > 1:
        # Each rank merges its own stage; rank1's trajectory direction spans every stage's weights.
        yield Problem(("anchor.projector", "trainer.devices"),
                      "'rank1' is not supported across processes (its trajectory direction spans every stage's "
                      "weights; the merger and the other projectors work per coordinate, so each rank merges its "
                      "own stage): use anchor.projector=none or damped_linear, or trainer.devices x "
                      "trainer.num_nodes = 1")
    yield from _anchor_placement(cfg)


def _anchor_placement(cfg: DictConfig) -> Iterator[Problem]:
    """``anchor.placement: sampler`` sends each stage sign(M_bar) alone: only what reads no more is exact."""
    a = cfg.anchor
    if a.placement != "sampler" or a.merger == "none":  # no anchor runs: nothing to place
        return
    if a.merger != "signed_ema":
        yield Problem(("anchor.placement", "anchor.merger"),
                      f"'sampler' sends each stage only sign(M_bar), but '{a.merger}' needs M itself: use "
                      "anchor.merger=signed_ema or anchor.placement=pipeline")
    elif a.projector != "none":
        yield Problem(("anchor.placement", "anchor.projector"),
                      f"'sampler' sends each stage only sign(M_bar), but the '{a.projector}' projector repairs "
                      "M_bar's magnitudes before the sign: use anchor.projector=none or anchor.placement=pipeline")


def _anchor_replicas(cfg: DictConfig) -> Iterator[Problem]:
    if cfg.anchor.placement == "sampler" and cfg.anchor.merger != "none" and cfg.pipeline.replicas > 1:
        yield Problem(("anchor.placement", "pipeline.replicas"),
                      "'sampler' runs with one pipeline (pipeline.replicas=1): the sampling rank would have to "
                      "send every replica's stages the same signs; use anchor.placement=pipeline with replicas")


def _precision(cfg: DictConfig) -> Iterator[Problem]:
    if cfg.model.dtype == "float16" and cfg.trainer.precision.endswith("-mixed"):
        yield Problem(("model.dtype", "trainer.precision"),
                      f"trainer.precision={cfg.trainer.precision} keeps the weights in float32 and casts each "
                      "operation; float16 weights cannot be autocast. Use model.dtype=float32 with it, or "
                      "trainer.precision=32-true")


@dataclass(frozen=True)
class CrossCheck:
    """A check of values together, and the top-level sections (or keys) it reads."""

    reads: tuple[str, ...]
    run: Callable[[DictConfig], Iterator[Problem]]


CROSS_CHECKS: tuple[CrossCheck, ...] = (
    CrossCheck(("model",), _tiny_shape),
    CrossCheck(("model", "sampler"), _lengths),
    CrossCheck(("model",), _model_source),
    CrossCheck(("model", "trainer"), _precision),
    CrossCheck(("grpo", "sampler"), _grpo),
    CrossCheck(("anchor", "trainer"), _anchor),
    CrossCheck(("anchor", "pipeline"), _anchor_replicas),
    CrossCheck(("name", "logging"), _run_name),
    CrossCheck(("task", "trainer"), _held_out),
    CrossCheck(("task",), _task),
    CrossCheck(("pipeline", "trainer", "model"), _pipeline),
)


def problems(cfg: DictConfig, sections: Collection[str] | None = None) -> Iterator[Problem]:
    """Every value of ``cfg`` outside its range, then every failed cross check, in order.
    ``sections``: only the keys of these top-level sections, and only the cross checks that read
    nothing else (a checkpoint holds some sections; the schema's defaults stand in for the rest)."""
    for key, rule in RULES.items():
        if sections is not None and key.split(".", 1)[0] not in sections:
            continue
        message = rule(_get(cfg, key))
        if message is not None:
            yield Problem((key,), message)
    for check in CROSS_CHECKS:
        if sections is None or set(check.reads) <= set(sections):
            yield from check.run(cfg)
