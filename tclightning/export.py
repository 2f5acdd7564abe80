"""Take the trained policy out of a run: a Hugging Face ``save_pretrained`` folder (model and
tokenizer) that ``transformers.AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained`` load
with no tclightning installed (and so vLLM and TRL).

The policy is rebuilt from the checkpoint's hyper-parameters (the recipe's ``model`` section, as
a run would build it: the tiny model with its character tokenizer, a hub model, or a GGUF file
de-quantised by transformers) and given the checkpoint's ``policy.*`` weights. A ``model.lora``
checkpoint holds the adapters alone: its frozen base is rebuilt as the run built it (the model, then
the supervised warm-up from its cache or trained again) and must match the fingerprint the
checkpoint records. Checkpoints are read as data only
(:func:`~tclightning.callbacks.checkpointing.load_checkpoint`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import tempfile
from glob import escape as glob_escape
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tclightning.errors import StorageError, TclightningError
from tclightning.files import (HeldFolder, current_umask, entry_identity, exchange, in_the_way, open_regular, own_file,
                              refused_by_storage, require_writable, storage_reason)
from tclightning.processes import process_running

POLICY_PREFIX = "policy."
PROVENANCE_FILE = "tclightning_export.json"
"""Written beside the model files: which checkpoint (and RL step) the weights come from, and the
``model`` section they were built with. Loaders ignore it."""


@dataclass(frozen=True)
class ExportSource:
    """The checkpoint an export reads, its RL step, and notes for the user (a fallback taken)."""

    checkpoint: Path
    rl_step: int
    notices: tuple[str, ...] = ()


def _plain(err: TclightningError) -> TclightningError:
    """The run-resume helpers word their errors for ``--resume``; an export is not a resume."""
    return type(err)(str(err).replace("--resume: ", ""))


def find_checkpoint(path: str | os.PathLike, step: int | None = None) -> ExportSource:
    """The checkpoint to export from ``path``: a checkpoint file, a run directory (its
    ``checkpoints/``), or a ``checkpoints/`` folder. From a folder, ``step=None`` takes
    ``last.ckpt`` or, when that is missing or unreadable, the newest readable ``step-*.ckpt``
    (with a notice; the rule ``--resume`` uses); ``step=N`` takes ``step-00000N.ckpt``.
    Raises ``TclightningError`` (one line naming the path) when there is no such checkpoint or
    it cannot be read."""
    from tclightning.run import checkpoint_step, readable_checkpoint

    given = Path(path).expanduser()
    if step is not None and step < 0:
        raise TclightningError(f"--step {step}: expected a completed RL step, 0 or more")
    if given.is_file():
        if step is not None:
            raise TclightningError(f"--step {step}: {given} is a checkpoint file; --step picks a file in a run directory")
        try:
            return ExportSource(given, checkpoint_step(given))
        except TclightningError as err:
            raise _plain(err) from None
    if not given.is_dir():
        raise TclightningError(f"no such run directory or checkpoint: {given}")
    folder = given / "checkpoints" if (given / "checkpoints").is_dir() else given
    files = sorted(p.name for p in folder.glob("*.ckpt") if p.is_file())
    if not files:
        raise TclightningError(f"{given}: no checkpoint (no *.ckpt in {folder}); is it a run directory?")
    if step is not None:
        wanted = folder / f"step-{step:06d}.ckpt"
        if not wanted.is_file():
            steps = [str(int(name[5:-5])) for name in files if name[5:-5].isdigit()]
            have = f"step checkpoints there: {', '.join(steps)}" if steps else "no step-*.ckpt there"
            raise TclightningError(f"--step {step}: no {wanted.name} in {folder} ({have})")
        try:
            return ExportSource(wanted, checkpoint_step(wanted))
        except TclightningError as err:
            raise _plain(err) from None
    try:
        found, rl_step, notices = readable_checkpoint((folder / "last.ckpt").absolute())  # a link loop too
    except TclightningError as err:
        raise _plain(err) from None
    notices = tuple(note.replace("resuming from", "exporting") for note in notices)
    return ExportSource(found, rl_step, notices)


def policy_from_checkpoint(checkpoint: dict[str, Any], source: str | os.PathLike = "checkpoint") -> tuple[Any, Any]:
    """``(model, tokenizer)``: the policy a loaded tclightning checkpoint holds, rebuilt from its
    ``hyper_parameters["model"]`` and given its ``policy.*`` weights (strictly: every weight must
    fit). ``source`` names the file in errors. A ``model.lora`` checkpoint that holds the adapters
    alone is loaded through :meth:`~tclightning.grpo.module.GRPOModule.from_checkpoint_data`, which
    rebuilds the base from the whole recipe (its warm-up needs the task) and refuses one that does
    not match the checkpoint's fingerprint. A policy with adapters keeps them (and a GGUF model its
    marker, see :func:`without_gguf_marker`): :func:`~tclightning.models.lora.merged` folds them in."""
    import torch

    from tclightning.grpo.module import BASE_KEY, GRPOModule, as_config
    from tclightning.models.config import RETIRED_KEYS, ModelConfig
    from tclightning.models.loading import check_weights, load_model
    from tclightning.models.lora import apply_lora, has_adapters
    from tclightning.settings import without_keys

    hparams = checkpoint.get("hyper_parameters")
    model_hparams = hparams.get("model") if isinstance(hparams, dict) else None
    if not isinstance(model_hparams, dict):
        raise TclightningError(f"checkpoint {source}: not a tclightning checkpoint (no model hyper-parameters)")
    weights = checkpoint.get("state_dict", {})
    if not isinstance(weights, dict):
        raise TclightningError(f"checkpoint {source}: its state_dict is a {type(weights).__name__}, not weights by name")
    state = {key[len(POLICY_PREFIX):]: value for key, value in weights.items()
             if isinstance(key, str) and key.startswith(POLICY_PREFIX) and isinstance(value, torch.Tensor)}
    if not state:
        raise TclightningError(f"checkpoint {source}: holds no policy weights (no 'policy.*' in its state_dict)")
    check_checkpoint_hparams(checkpoint, source)
    try:
        cfg = as_config(ModelConfig, without_keys(model_hparams, RETIRED_KEYS), "model")  # an earlier version's keys
    except TclightningError as err:
        raise TclightningError(f"checkpoint {source}: model hyper-parameters: {err}") from None
    adapters_alone = BASE_KEY in (checkpoint.get("tclightning") or {})
    # The seed only picks the random initial weights of a tiny model; the checkpoint's replace them
    # (not so with the adapters alone: the module rebuilds the base with the run's seed).
    try:
        if adapters_alone:
            module = GRPOModule.from_checkpoint_data(checkpoint, source)
            return module.policy.eval(), module.tokenizer
        model, tokenizer = load_model(cfg, seed=0)
    except (OSError, ValueError) as err:  # not cached nor reachable, a moved folder, one needing its own code
        where = cfg.name if cfg.source == "hf" else cfg.gguf_file
        raise TclightningError(f"checkpoint {source}: cannot build its model (model.source={cfg.source}, {where}): "
                               f"{' '.join(str(err).split())[:160]}") from None
    apply_lora(model, cfg.lora_settings)  # model.lora, a checkpoint an earlier version wrote: adapters and frozen base
    missing, unexpected = _mismatch(model.state_dict(), state)
    if missing or unexpected:
        raise TclightningError(
            f"checkpoint {source}: its policy weights do not fit the model its hyper-parameters describe "
            f"(missing: {', '.join(missing[:3]) or 'none'}; unexpected: {', '.join(unexpected[:3]) or 'none'})")
    check_weights(model.state_dict(), state, f"checkpoint {source}")
    model.load_state_dict(state, strict=True)
    # a plain model of the same config cannot take the adapters' weights: export strips it after merging
    return (model if has_adapters(model) else without_gguf_marker(model)).eval(), tokenizer


def _lora_config(checkpoint: Mapping[str, Any]) -> Any:
    from tclightning.grpo.module import as_config
    from tclightning.models.config import LoraConfig

    return as_config(LoraConfig, checkpoint["hyper_parameters"]["model"].get("lora"))


def check_checkpoint_hparams(checkpoint: Mapping[str, Any], source: str | os.PathLike = "checkpoint") -> None:
    """Before any model is built from a checkpoint: it asks for no remote code and no model
    larger than its weights (:func:`~tclightning.models.loading.check_checkpoint_model`), and its
    hyper-parameters pass a recipe's validation
    (:func:`~tclightning.recipes.loader.validate_checkpoint_hparams`). One line otherwise."""
    from tclightning.models.loading import check_checkpoint_model
    from tclightning.recipes.loader import validate_checkpoint_hparams

    where = f"checkpoint {source}"
    check_checkpoint_model(checkpoint, where, POLICY_PREFIX)
    validate_checkpoint_hparams(checkpoint.get("hyper_parameters"), where)


def without_gguf_marker(model: Any) -> Any:
    """The same model without the GGUF "quantisation" transformers records when it reads a GGUF
    file: the weights are already de-quantised to ``model.dtype``, but the marker makes
    ``save_pretrained`` refuse the model. A plain model of the same config takes the weights."""
    config = getattr(model, "config", None)
    if getattr(model, "hf_quantizer", None) is None or getattr(config, "quantization_config", None) is None:
        return model
    import copy

    from transformers import AutoModelForCausalLM

    method = getattr(config.quantization_config, "quant_method", None)
    if str(getattr(method, "value", method)) != "gguf":  # a real quantisation (bitsandbytes...): not ours to undo
        raise TclightningError(f"export: the model is quantised ({method}); export supports full-precision "
                               "and GGUF-sourced models")
    plain_config = copy.deepcopy(config)
    del plain_config.quantization_config
    plain = AutoModelForCausalLM.from_config(plain_config, dtype=model.dtype)
    plain.load_state_dict(model.state_dict(), strict=True)
    plain.generation_config = model.generation_config
    return plain


def _mismatch(expected: dict[str, Any], given: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Names missing from ``given`` and names it has that ``expected`` lacks, or of another shape."""
    missing = sorted(set(expected) - set(given))
    unexpected = sorted(k for k in given if k not in expected or tuple(given[k].shape) != tuple(expected[k].shape))
    return missing, unexpected


def portable_tokenizer_config(folder: Path, padding_side: str = "left", pad_token: str | None = None) -> None:
    """Name the generic fast-tokenizer class in ``tokenizer_config.json``: transformers 5 writes
    ``TokenizersBackend`` for a tokenizer built in memory (the tiny model's), a name transformers
    4 (which many vLLM and TRL installs pin) does not know; ``PreTrainedTokenizerFast`` is the
    same tokenizer under a name both read. Also records the run's ``padding_side`` and ``pad_token``."""
    config_path = folder / "tokenizer_config.json"
    if not config_path.is_file():
        return
    config = json.loads(config_path.read_text())
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    # The run pads on the left (decoder-only generation); transformers saves only the padding
    # side a tokenizer was created with, so one set afterwards (hub, GGUF tokenizers) is kept here.
    config["padding_side"] = padding_side
    if pad_token is not None:
        config["pad_token"] = pad_token
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def export_policy(path: str | os.PathLike, out: str | os.PathLike, step: int | None = None,
                  *, overwrite: bool = False, adapter_only: bool = False) -> Path:
    """Write the policy of a run (or checkpoint) ``path`` to the folder ``out`` as Hugging Face
    ``save_pretrained`` files of the model and its tokenizer, plus :data:`PROVENANCE_FILE`;
    returns ``out``. ``step`` picks ``checkpoints/step-00000N.ckpt`` of a run directory
    (default: the newest readable checkpoint, see :func:`find_checkpoint`).

    ``out`` must not exist or be empty, unless ``overwrite`` (then it is replaced if it holds an
    earlier export's own files alone: those its :data:`PROVENANCE_FILE` lists), and must not hold
    the checkpoint. The folder is written beside ``out`` first and moved into place at the
    end (an existing ``out`` is swapped with it in one step, then deleted): a failed export leaves
    nothing, a killed one leaves either export whole, and a staging folder that the next export
    of the same ``out`` removes. Raises ``TclightningError`` (one line) for a missing or unreadable checkpoint, one
    that is not tclightning's, or a model source (a GGUF package, a hub name) that cannot be
    loaded here: the model is rebuilt from its source before the trained weights replace it.

    A ``model.lora`` policy is written merged (the adapters folded into the base weights: a plain
    model); ``adapter_only`` writes the adapters alone in PEFT's ``save_pretrained`` format (with the
    tokenizer) instead, and is refused for a policy without adapters.
    """
    from tclightning.callbacks.checkpointing import load_checkpoint

    target = Path(out).expanduser()
    if target.is_symlink():  # a swap would replace the link, not the folder it names
        raise TclightningError(f"export: {target} is a symbolic link; give the folder itself "
                               f"({os.path.realpath(target)}) or a new path")
    if ".." in target.parts:  # `yours/new/..` is yours: every check below is of where the files land
        target = Path(os.path.realpath(target))
    blocking = in_the_way(target)
    if blocking is not None and blocking[0] == target:
        raise TclightningError(f"export: {target} {blocking[1]}, expected a folder to write the model to")
    if blocking is not None:  # the folder would be created under it
        raise TclightningError(f"export: cannot create {target}: {blocking[0]} {blocking[1]}")
    if target.is_dir() and any(target.iterdir()):
        if not overwrite:
            raise TclightningError(f"export: {target} is not empty (choose a new folder, or --overwrite to replace it)")
        _require_only_an_export(target, target)
    # the folder as checked: the one swapped out later must be it (one renamed to its name while the
    # checkpoint loaded was swapped away to a hidden name, without a word)
    checked = entry_identity(target, folder=True)
    require_writable(next(p for p in target.absolute().parents if p.is_dir()), "export", TclightningError)
    found = find_checkpoint(path, step)
    source = found.checkpoint.resolve()
    if source.is_relative_to(target.resolve()):
        raise TclightningError(f"export: {target} holds the checkpoint it would export ({found.checkpoint}); "
                               "writing there would replace it: choose a folder outside the run's checkpoints")
    if source.parent.name == "checkpoints" and target.resolve().is_relative_to(source.parent):  # named last.ckpt?
        raise TclightningError(f"export: {target} lies in the folder of the checkpoint it exports "
                               f"({source.parent}), a run's checkpoints, whose names its resume reads: choose a "
                               "folder outside it")
    clear_abandoned_staging(target)
    checkpoint = load_checkpoint(found.checkpoint)
    model, tokenizer = policy_from_checkpoint(checkpoint, found.checkpoint)
    from tclightning.models.lora import has_adapters, merged

    if adapter_only and not has_adapters(model):
        raise TclightningError(f"export: --adapter-only: {found.checkpoint} holds no LoRA adapters (model.lora.r=0)")
    if not adapter_only:
        model = without_gguf_marker(merged(model, _lora_config(checkpoint)))
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=_staging_prefix(target, os.getpid()), dir=target.parent))
    # written through its descriptor: a link put at the staging name meanwhile is never written
    # through, nor anything removed through it; renamed into place only while the name is still it
    try:
        held = HeldFolder(staging, empty=True)
    except OSError as err:  # a link or a folder of someone's put at its name already
        raise TclightningError(f"export: its folder {staging} was replaced as soon as made ({err.strerror or err}); "
                               f"nothing was written to {target}") from None
    with held as new:
        _write_staged_export(new, staging, target, model, tokenizer, checkpoint, found, overwrite, adapter_only,
                             checked)
    return target


def _write_staged_export(new: HeldFolder, staging: Path, target: Path, model: Any, tokenizer: Any,
                         checkpoint: Mapping[str, Any], found: ExportSource, overwrite: bool,
                         adapter_only: bool, checked: tuple[int, int] | None) -> None:
    """Write the export into the staging folder ``new`` (made at ``staging``) and move it into place
    at ``target`` (where ``checked`` is the folder found there and checked, if any): see
    :func:`export_policy`."""
    from tclightning.models.lora import save_adapter

    umask = current_umask()
    os.chmod(new.path, 0o777 & ~umask)  # mkdtemp's folder is private; the export is an ordinary folder
    (new.path / STAGING_MARKER).write_text(f"{os.getpid()}\n")  # what a later export may remove as abandoned
    old: HeldFolder | None = None  # the old export, held before it is swapped out to the staging name
    try:
        if adapter_only:
            save_adapter(model, _lora_config(checkpoint), new.path)
        else:
            model.save_pretrained(new.path)
        tokenizer.save_pretrained(new.path)
        portable_tokenizer_config(new.path, tokenizer.padding_side, tokenizer.pad_token)
        for written in new.path.iterdir():  # some writers leave their files private (0600)
            os.chmod(written, 0o666 & ~umask)
        provenance = {"checkpoint": str(found.checkpoint.resolve()), "rl_step": found.rl_step,
                      "model": checkpoint["hyper_parameters"]["model"],
                      "files": sorted(p.name for p in new.path.iterdir() if p.name != STAGING_MARKER)}
        (new.path / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2, default=str) + "\n")
        if not new.is_at(staging):
            raise TclightningError(f"export: its folder {staging} was replaced while written (moved, or a link or "
                                   f"another folder put in its place); nothing was written to {target}")
        # The staging marker stays until the swap: a kill before it leaves a staging folder the
        # next export removes; one after it, a stray marker in the new export that the next
        # --overwrite counts as the export's own.
        if overwrite and target.exists():
            # swap in one step, then delete the old export: a kill in between leaves the new export
            # in place and the old one under the staging name, marked for the next export to remove
            try:
                old = HeldFolder(target)
            except OSError as err:
                raise TclightningError(f"export: {target} was replaced meanwhile ({err.strerror or err}); nothing "
                                       "was replaced") from None
            if old.identity != checked:  # (held: closed below with the rest)
                raise TclightningError(f"export: {target} was replaced while the export was made (another folder is "
                                       "at its name now); nothing was replaced or written there")
            if any(os.listdir(old.fd)):  # checked again, as held: a file of yours added while the export was made
                _require_only_an_export(old.path, target)
            replaced = target / REPLACED_MARKER
            with contextlib.suppress(FileNotFoundError):  # one a killed export left (or a link, a FIFO of that
                replaced.unlink()                          # name): replaced, never written through or waited on
            with own_file(replaced, "x") as marker:
                marker.write(f"{os.getpid()}\n")
            try:
                exchange(staging, target)
                if not new.is_at(target):  # someone's folder was renamed to the staging name as it swapped
                    exchange(staging, target)  # both as they were
                    raise _MovedIn(staging)
            except BaseException as err:
                if new.is_at(target):  # swapped, the interrupt inside the call
                    raise
                with contextlib.suppress(OSError):  # a refusal, or Ctrl-C/SIGTERM before the swap: as it was
                    replaced.unlink()
                if not isinstance(err, OSError) or refused_by_storage(err):
                    raise
                raise TclightningError(f"export: cannot replace {target}: {err.strerror or err} (a mount point, or "
                                       "on another filesystem?); nothing was replaced") from None
            _remove_old_export(old, staging)
        else:
            try:  # a rename onto a folder that is not empty fails: nothing is ever replaced unasked
                os.rename(staging, target)
                if not new.is_at(target):  # someone's folder was renamed to the staging name as it moved: put back
                    os.rename(target, staging if not os.path.lexists(staging) else
                              tempfile.mkdtemp(prefix=_staging_prefix(target, os.getpid()), dir=target.parent))
                    raise _MovedIn(staging)
            except OSError as err:
                if refused_by_storage(err) or not target.is_dir():
                    raise
                if err.errno == errno.EBUSY:  # an empty folder a volume is mounted on: nothing moves onto it
                    raise TclightningError(f"export: {target} is a mount point, which the export cannot be moved "
                                           f"onto; export into a new folder inside it ({target / 'policy'})") from None
                raise TclightningError(f"export: {target} was written by another export meanwhile; nothing was "
                                       "replaced (--overwrite replaces it)") from None
        with contextlib.suppress(OSError):
            (new.path / STAGING_MARKER).unlink()  # a whole export from here on
    except BaseException as err:
        if old is not None and old.is_at(staging):  # swapped (the interrupt perhaps inside the swap call): the
            _remove_old_export(old, staging)       # old export's own files go, one put in it meanwhile stays
        elif new.is_at(staging):  # the new export, not yet (or never) in place; one in place is kept
            remove_export(new.path)
            new.remove_at(staging)
        if refused_by_storage(err):
            kept = f"; the export already in {target} is kept" if target.exists() else ""
            raise StorageError(f"export: the storage refused a write in {target.parent} ({storage_reason(err)}); "
                               f"nothing was written{kept}") from None
        raise
    finally:
        if old is not None:
            old.__exit__()


class _MovedIn(TclightningError):
    """Another folder was at the staging name as it moved into place: put back, nothing exported."""

    def __init__(self, staging: Path) -> None:
        super().__init__(f"export: another folder was renamed to its folder's name {staging} as it moved into place; "
                         "that folder is left as it was, and nothing was exported")


def _remove_old_export(old: HeldFolder, staging: Path) -> None:
    """Remove the old export, swapped out to the ``staging`` name: its own files, through its
    descriptor, and then its folder where that name still leads to it."""
    remove_export(old.path, export_files(old.path) | {REPLACED_MARKER, STAGING_MARKER})
    old.remove_at(staging)


STAGING_MARKER = ".tclightning-export-staging"
"""The file in an export's staging folder while it is written (holding the writer's pid)."""

REPLACED_MARKER = ".tclightning-export-replaced"
"""The file an ``--overwrite`` puts in the old export just before swapping it out (holding the
writer's pid): under the staging name, it is the old export, for the next export to remove."""


def _staging_prefix(target: Path, pid: int) -> str:
    return f".{target.name}.export-{pid}-"


def _require_only_an_export(folder: Path, target: Path) -> None:
    """Refuse (one line naming ``target``, nothing touched) to replace the folder at ``folder`` (the
    target, or the target held open) unless it holds an earlier export's own files alone: those its
    :data:`PROVENANCE_FILE` lists (a run, its ``tb/``, another run, a model card you added: never
    replaced)."""
    if not (folder / PROVENANCE_FILE).is_file():  # a run, its tb/, another run: never replaced
        raise TclightningError(f"export: {target} is not an export (no {PROVENANCE_FILE}); --overwrite replaces only "
                               "an earlier export, so nothing was touched: choose a new folder")
    foreign = next((p for p in folder.iterdir() if p.is_dir()), None)
    if foreign is not None:  # an export is flat files: a folder in it (a run?) is someone's
        raise TclightningError(f"export: {target} holds {foreign.name}/, which no export writes (a run?); "
                               "--overwrite replaces only an earlier export's own files, so nothing was touched")
    own = export_files(folder)
    if not own:
        raise TclightningError(f"export: {target}/{PROVENANCE_FILE} lists no files the export wrote, so which "
                               "are yours cannot be told; nothing was touched: remove the folder yourself, or "
                               "choose a new one")
    # an export killed around its swap may leave its own marker in the folder: its own too
    added = sorted(p.name for p in folder.iterdir() if p.name not in own | {REPLACED_MARKER, STAGING_MARKER})
    if added:  # a model card, notes: the user's, and an export never deletes what it did not write
        raise TclightningError(f"export: {target} holds {added[0]}"
                               f"{f' (and {len(added) - 1} more)' if len(added) > 1 else ''}, which the earlier "
                               "export did not write; --overwrite replaces only an export's own files, so "
                               "nothing was touched: move it out first, or choose a new folder")


def clear_abandoned_staging(target: Path) -> None:
    """Remove the staging folders beside ``target`` that an export killed part-way left behind:
    named after a process that is no longer running, and holding :data:`STAGING_MARKER` (a new
    export being written) or :data:`REPLACED_MARKER` (the old export swapped out), or empty (killed
    before its marker): a folder of yours that is only named like one (an export too) and holds
    anything stays."""
    parent = target.parent
    if not parent.is_dir():
        return
    marker = f".{target.name}.export-"
    # as mkdtemp names it; never the staging folder of an export into `a.export-77-z` beside `a`
    staging_name = re.compile(re.escape(marker) + r"([0-9]+)-[a-z0-9_]+")
    for folder in parent.glob(f"{glob_escape(marker)}*"):
        named = staging_name.fullmatch(folder.name)
        if not (named and folder.is_dir() and not folder.is_symlink() and not process_running(int(named[1]))):
            continue
        if (folder / REPLACED_MARKER).is_file():  # an old export swapped out (a stray staging marker in it
            # too, left by an export killed after its swap): only the files its record lists are its own
            remove_export(folder, export_files(folder) | {REPLACED_MARKER, STAGING_MARKER})
        elif (folder / STAGING_MARKER).is_file():
            remove_export(folder)
        else:  # killed between making it and marking it: empty, nothing to lose
            with contextlib.suppress(OSError):  # another export tidied it first, or it
                if not any(folder.iterdir()):  # holds something now: either way, not this one's to remove
                    folder.rmdir()


def export_files(folder: Path) -> frozenset[str]:
    """The names of the files the export in ``folder`` wrote, from its :data:`PROVENANCE_FILE`
    (which lists them, and itself); empty when it lists none (unreadable, or not an export)."""
    try:
        with open_regular(folder / PROVENANCE_FILE, "export record") as handle:  # never a FIFO's wait
            listed = json.loads(handle.read(1 << 20)).get("files")
    except (TclightningError, OSError, ValueError, AttributeError, RecursionError):
        return frozenset()
    if not isinstance(listed, list) or not all(isinstance(name, str) for name in listed):
        return frozenset()
    return frozenset({*listed, PROVENANCE_FILE})


def remove_export(folder: Path, own: frozenset[str] | None = None) -> None:
    """Remove an export (or its staging folder): its own files, which are flat (``own``: only
    these names; ``None``: a staging folder this export made, all of it); a file or folder
    someone put inside it meanwhile (a run, a bind mount) stays, and with it the export's folder.
    Nothing to do where ``folder`` is gone (renamed into place just before an interrupt)."""
    try:
        entries = list(folder.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return
    # the record, then the markers, go last: a removal killed part-way leaves a folder the next
    # export still knows as an abandoned one of its own (a marker) and whose files it can still name
    last = {PROVENANCE_FILE: 1, REPLACED_MARKER: 2, STAGING_MARKER: 2}
    entries.sort(key=lambda entry: last.get(entry.name, 0))
    for entry in entries:
        if (own is None or entry.name in own) and (entry.is_symlink() or not entry.is_dir()):
            with contextlib.suppress(OSError):
                entry.unlink()
    with contextlib.suppress(OSError):
        folder.rmdir()


__all__ = ["ExportSource", "export_policy", "find_checkpoint", "policy_from_checkpoint"]
