"""Where task rows come from (local files, the shared data copy, the Hugging Face hub) and
how they become deterministic, disjoint train / eval ``Example`` lists.

Local ``.jsonl`` is read directly (fast, no cache). Every other format, and hub datasets, go
through one function, ``load_with_datasets``, so the code the offline tests run on a local
parquet file is the code an online user runs on ``openai/gsm8k``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from abc import abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import IO, Any

from tclightning.console import shown
from tclightning.errors import TclightningError
from tclightning.files import open_regular, pinned_file, regular_file
from tclightning.network import (HUB_DOWNLOAD_MIN_BYTES_S, host_of, hub_answer, hub_offline, hub_url, keeps_pace,
                                  refuse_hub_paths, remote_setup)
from tclightning.processes import child_environment
from tclightning.tasks.base import Example, Task
from tclightning.tasks.config import TaskConfig

Row = Mapping[str, Any]
# Local formats, in the order preferred when a directory holds several files of one split.
LOCAL_EXTENSIONS = (".jsonl", ".parquet", ".json", ".csv")
_DATASETS_BUILDERS = {".csv": "csv"}


def shared_data_dir() -> Path:
    """The shared data copy: ``$TCLIGHTNING_DATA`` if set, else ``<repo>/../shared/data``.

    (``<repo>`` is the checkout holding this package; an installed wheel has no such
    sibling, so installed users set ``$TCLIGHTNING_DATA``, ``path`` or ``hf_name``.)
    """
    env = os.environ.get("TCLIGHTNING_DATA")
    if env:
        return Path(env).expanduser()
    return Path(__file__).resolve().parents[2].parent / "shared" / "data"


def load_with_datasets(
    name: str, config: str | None = None, *, split: str, data_files: str | None = None, cache_dir: str | None = None,
    named: str | None = None, config_kwargs: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Rows of one split as ``datasets.load_dataset`` gives them (hub name, or a builder such as
    ``"parquet"`` with ``data_files``; ``named``: the file as you named it, for a refusal, where
    ``data_files`` is a private view of it; ``config_kwargs``: the builder's options). Imported
    lazily: ``datasets`` costs a second to import."""
    import datasets

    refuse_hub_paths()  # its README and scripts come through huggingface_hub too
    try:
        # a hub dataset's files are resolved under a time limit (a hub that answered the run's first
        # question and then stalls was waited on for minutes, request after request)
        builder = remote_setup(f"the Hugging Face dataset {name}'s files" if data_files is None else data_files,
                               lambda: datasets.load_dataset_builder(name, config, data_files=data_files,
                                                                     cache_dir=cache_dir, **(config_kwargs or {})))
        if data_files is None:
            _paced_download(builder, name, config, cache_dir)
        builder.download_and_prepare()  # a local file, or a hub dataset prepared by now: nothing downloaded
        ds = builder.as_dataset(split=split)
        # Rows are values, never files: a feature a file declares an Image (Audio, Video...), at any
        # depth (a list of them, a struct holding one), would be opened, fetched or decoded per row
        # by the dataset's formatter (a FIFO, a URL, an 8000x8000 PNG). to_list reads the table as it is.
        return ds.to_list()
    except TclightningError:
        raise
    except Exception as exc:  # turn any loader failure into one clear line
        where = named or data_files or f"{name}" + (f" ({config})" if config else "")
        cause = exc.__cause__ if exc.__cause__ is not None and str(exc.__cause__) else None
        detail = f"{exc}" + (f" ({type(cause).__name__}: {cause})" if cause is not None else "")
        raise TclightningError(f"cannot load split '{split}' of {where}: {detail}") from exc


_HUB_DOWNLOAD = """
import sys
from tclightning.processes import die_with_parent
die_with_parent(int(sys.argv[4]))
try:
    import datasets
    from tclightning.network import refuse_hub_paths
    refuse_hub_paths()
    name, config, cache_dir = sys.argv[1], sys.argv[2] or None, sys.argv[3] or None
    datasets.load_dataset_builder(name, config, cache_dir=cache_dir).download_and_prepare()
except Exception as err:
    sys.stderr.write(f"\\n{type(err).__name__}: {' '.join(str(err).split())[:300]}\\n")
    sys.exit(1)
"""
"""Downloads and prepares a hub dataset (``name config cache_dir parent-pid``) in a process of its own."""


def _paced_download(builder: Any, name: str, config: str | None, cache_dir: str | None) -> None:
    """Download and prepare hub dataset ``name`` into ``builder``'s cache, over HTTP, in a child
    process ended (one line) once the download falls below
    :data:`~tclightning.network.HUB_DOWNLOAD_MIN_BYTES_S` or passes :data:`TASK_FILE_MAX_BYTES`,
    counted on the bytes its folders gain (the dataset's folder in the Hugging Face cache,
    ``datasets``' downloads and the prepared dataset), or on a Ctrl-C or SIGTERM: a hub dripping a
    data file's body held the run for ever, an endless compressed one would fill the disk, and
    ``datasets``' own download threads, once given up on, held the exit of whichever program had
    called tclightning (they are joined when Python ends). A process is ended; a thread is not."""
    from huggingface_hub import constants

    prepared = Path(builder.cache_dir) / "dataset_info.json"
    if prepared.is_file():  # prepared by an earlier run: nothing to download
        return
    folders = [Path(constants.HF_HUB_CACHE) / f"datasets--{name.replace('/', '--')}",
               Path(builder._cache_downloaded_dir), Path(builder.cache_dir).parent]
    before, started = _bytes_under(folders), time.monotonic()
    print(f"note: downloading the Hugging Face dataset {name}", file=sys.stderr, flush=True)
    with tempfile.TemporaryFile() as said:
        # its own session: a Ctrl-C at the terminal reaches this process, which ends it; HTTP only
        # (hf_xet's native writer ignores any size or pace)
        child = subprocess.Popen([sys.executable, "-c", _HUB_DOWNLOAD, name, config or "", cache_dir or "",
                                  str(os.getpid())], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=said,
                                 env=child_environment(HF_HUB_DISABLE_XET="1", HF_DATASETS_DISABLE_PROGRESS_BARS="1"),
                                 start_new_session=True)
        try:
            while True:
                try:
                    child.wait(2.0)
                    break
                except subprocess.TimeoutExpired:
                    gained = _bytes_under(folders) - before
                    if gained > TASK_FILE_MAX_BYTES:  # a compressed stream expands at disk speed
                        raise TclightningError(
                            f"the Hugging Face dataset {name}: its download and preparation passed {gained} bytes, "
                            f"more than a task's data may be ({TASK_FILE_MAX_BYTES} bytes); nothing more was "
                            "downloaded") from None
                    if not keeps_pace(gained, started):
                        raise TclightningError(
                            f"the Hugging Face dataset {name}: its download fell below "
                            f"{HUB_DOWNLOAD_MIN_BYTES_S / 2**20:g} MiB/s ({gained} bytes in "
                            f"{time.monotonic() - started:.0f} s); on a slower link, download it first "
                            f"(hf download --repo-type dataset {name})") from None
        finally:
            if child.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGKILL)
                child.wait()
        if child.returncode != 0:
            said.seek(0)
            last = [line for line in said.read().decode(errors="replace").splitlines() if line.strip()]
            raise TclightningError(f"cannot load {name}" + (f" ({config})" if config else "")
                                   + f": {last[-1] if last else f'its download ended with exit code {child.returncode}'}")
    if not prepared.is_file():  # prepared elsewhere: never downloaded in this process
        raise TclightningError(f"the Hugging Face dataset {name}: its download ended without preparing it in "
                               f"{builder.cache_dir}")


def _bytes_under(folders: Sequence[Path]) -> int:
    """The bytes of every file under ``folders`` (links not followed; a folder missing holds none)."""
    total = 0
    for folder in folders:
        for parent, _, names in os.walk(folder):
            for file in names:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(parent, file)).st_size
    return total


TASK_FILE_MAX_BYTES = 4 * 2**30
"""The largest local task file read (a prompt set is megabytes; past this, a hub dataset)."""

ROW_MAX_BYTES = 16 * 2**20
"""The longest ``.jsonl`` row read: a file without line breaks is refused, not read whole."""

MAX_COLUMNS = 1024
"""The most columns a ``.csv`` or ``.parquet`` task file may have (a task reads a few): 160,000 of
them in a 2 MB file held the reader for many minutes."""


def read_rows(path: Path) -> list[dict[str, Any]]:
    """All rows of one local file (.jsonl, .json, .parquet, .csv); a FIFO, a device, a file over
    :data:`TASK_FILE_MAX_BYTES` or a ``.jsonl`` row over :data:`ROW_MAX_BYTES` is refused (reading
    one would wait or fill memory), as is a name ``datasets`` would take for a glob pattern. The
    file is opened once and read from that open file (``datasets`` through a private link to it):
    a FIFO renamed over it meanwhile is never opened."""
    regular_file(path, "task data", TASK_FILE_MAX_BYTES)
    if path.suffix in (".jsonl", ".json", ".parquet"):
        with open_regular(path, "task data", TASK_FILE_MAX_BYTES) as handle:
            if path.suffix == ".parquet":
                return _parquet_rows(path, handle)
            if path.suffix == ".json" and _first_byte(handle) == b"[":
                return _json_array_rows(path, handle)
            return _jsonl_rows(path, handle)  # datasets reads any other .json as JSON lines too
    builder = _DATASETS_BUILDERS.get(path.suffix)
    if builder is None:
        raise TclightningError(f"{path}: unsupported file type (use one of {LOCAL_EXTENSIONS})")
    if any(char in str(path) for char in "*?[]{}"):  # datasets expands data_files patterns
        raise TclightningError(f"task data {path}: its name holds a glob character (* ? [ ] {{ }}), which "
                               "datasets would read as a pattern for other files; rename it")
    if "::" in str(path):  # fsspec chains filesystems on it: "a.json::/b" reads a.json, checked nowhere
        raise TclightningError(f"task data {path}: its name holds '::', which datasets would read as a chain of "
                               "filesystems naming another file; rename it")
    with pinned_file(path, "task data", TASK_FILE_MAX_BYTES) as pinned, \
            tempfile.TemporaryDirectory(prefix="tclightning-rows-") as cache:  # a cache for this one read
        with _datasets_quiet():  # a file it cannot read is the one line below, not its log and bars too
            # a csv's cells are read as text: pandas' type inference goes through float64 when a column has
            # an empty cell, and an integer answer past 2**53 lost its last digits (9007199254740993 -> ...992.0)
            options = _csv_as_text(pinned, path) if builder == "csv" else None
            return load_with_datasets(builder, split="train", data_files=str(pinned), cache_dir=cache, named=str(path),
                                      config_kwargs=options)


def _parquet_rows(path: Path, handle: IO[bytes]) -> list[dict[str, Any]]:
    """The rows of a ``.parquet`` file, read by pyarrow one row at a time from the open file: its
    compression (or a dictionary repeating one long value) expands in memory, so a row past
    :data:`ROW_MAX_BYTES` or rows past :data:`TASK_FILE_MAX_BYTES` in all are refused as they are
    decoded (eight rows of a 105 KB file held 3.2 GB, and the run was killed without a word)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows: list[dict[str, Any]] = []
    total = 0
    try:
        parquet = pq.ParquetFile(handle)
        names = parquet.schema_arrow.names
        if len(names) > MAX_COLUMNS:
            raise TclightningError(f"task data {path}: {len(names)} columns, more than the {MAX_COLUMNS} read here")
        twice = next((name for i, name in enumerate(names) if name in names[:i]), None)
        if twice is not None:  # a row keeps one of the two: which one is meant is a guess
            raise TclightningError(f"task data {path}: the column {shown(twice)[:80]!r} appears twice")
        for batch in parquet.iter_batches(batch_size=1):
            size = batch.nbytes
            if size > ROW_MAX_BYTES:
                raise TclightningError(f"task data {path}: row {len(rows) + 1} holds {size} bytes decoded, more than "
                                       f"a row may ({ROW_MAX_BYTES})")
            total += size
            if total > TASK_FILE_MAX_BYTES:
                raise TclightningError(f"task data {path}: its rows hold more than {TASK_FILE_MAX_BYTES} bytes "
                                       "decoded, more than a task's data may")
            rows.extend(batch.to_pylist())
    except (pa.ArrowException, OSError, ValueError, OverflowError) as err:  # not parquet, cut short, a
        # codec it lacks, a date past Python's range
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise TclightningError(f"task data {path}: not a readable parquet file ({shown(reason)[:120]})") from None
    return rows


def _csv_as_text(path: Path | str, named: Path) -> dict[str, Any] | None:
    """``datasets``' csv options that read every column of the file at ``path`` (``named`` as you
    named it) as text (its header names them; only an empty cell is missing, ``NA`` or ``None`` is
    text), or None (the builder's own inference, and its one line) when the header cannot be read.
    A column named twice is refused (pandas took the first and renamed the second, ``answer.1``),
    and so is a row of more cells than the header (pandas made its first cells an index and read
    the rest shifted a column)."""
    import csv

    import datasets

    header: list[str] | None = None
    try:
        with open(path, encoding="utf-8-sig", newline="") as handle:
            rows = (row for row in csv.reader(handle) if any(cell.strip() for cell in row))  # pandas skips
            # lines of nothing but white space, and names an empty header cell "Unnamed: <column>"
            header = next(rows, None)
            header = header and [name or f"Unnamed: {i}" for i, name in enumerate(header)]
            if not header:
                return None
            if len(header) > MAX_COLUMNS:
                raise TclightningError(f"task data {named}: {len(header)} columns, more than the {MAX_COLUMNS} read "
                                       "here")
            twice = next((name for i, name in enumerate(header) if name in header[:i]), None)
            if twice is not None:  # which of the two is meant is a guess, as for a .jsonl row's field given twice
                raise TclightningError(f"task data {named}: the column {shown(twice)[:80]!r} appears twice in its "
                                       "header")
            longer = next((number for number, row in enumerate(rows, 1) if len(row) > len(header)), None)
    except (OSError, UnicodeDecodeError):  # datasets' own line says what it is
        return None
    except csv.Error as err:  # a field past the csv module's limit: the columns would be guessed
        where = "a row" if header else "its header"
        raise TclightningError(f"task data {named}: {where} is no CSV line read here ({err})") from None
    if longer is not None:
        raise TclightningError(f"task data {named}: row {longer} has more cells than its header has columns "
                               f"({len(header)})")
    return {"features": datasets.Features({name: datasets.Value("string") for name in header}),
            "keep_default_na": False, "na_values": [""]}


@contextlib.contextmanager
def _datasets_quiet() -> Iterator[None]:
    """``datasets``' log (critical only) and its progress bars off for the block, as they were after."""
    import datasets
    from datasets.utils import logging as datasets_logging

    verbosity, bars = datasets_logging.get_verbosity(), datasets.is_progress_bar_enabled()
    datasets_logging.set_verbosity(datasets_logging.CRITICAL)  # its "Failed to read file" is an error
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets_logging.set_verbosity(verbosity)
        if bars:
            datasets.enable_progress_bars()


def _first_byte(handle: IO[bytes]) -> bytes:
    """The first byte of the open file that is not white space or a byte order mark (b"" for
    none); the file is left at its start."""
    chunk = handle.read(1 << 16).removeprefix(b"\xef\xbb\xbf")
    try:
        while chunk:
            if stripped := chunk.lstrip():
                return stripped[:1]
            chunk = handle.read(1 << 16)
        return b""
    finally:
        handle.seek(0)


def _json_array_rows(path: Path, handle: IO[bytes]) -> list[dict[str, Any]]:
    """The rows of a ``.json`` file that is one JSON array of objects, read by Python's own parser:
    datasets' (ujson) overflows the C stack on deep nesting, ending the process without a word."""
    try:
        text = handle.read().decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise TclightningError(f"{path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset "
                               f"{exc.start})") from None
    rows = _parsed_json(text, str(path))
    if not all(isinstance(row, dict) for row in rows):
        raise TclightningError(f"{path}: a JSON array whose items are not all objects (one object a row)")
    return rows


def _parsed_json(text: str, where: str) -> Any:
    """``text`` parsed as JSON, text and fields given once; one line naming ``where`` otherwise."""
    try:
        value = json.loads(text, object_pairs_hook=_fields_once)
        json.dumps(value, ensure_ascii=False).encode("utf-8")  # an escaped lone surrogate is no text
    except json.JSONDecodeError as exc:
        raise TclightningError(f"{where}: not valid JSON ({exc})") from None
    except RecursionError:
        raise TclightningError(f"{where}: nested too deeply to be a row") from None
    except _FieldTwice as exc:
        raise TclightningError(f"{where}: {exc}; which one is meant is a guess") from None
    except UnicodeEncodeError:
        raise TclightningError(f"{where}: holds a lone surrogate (\\ud800-\\udfff), which is not text") from None
    except ValueError as exc:  # an integer past Python's 4300-digit conversion limit
        raise TclightningError(f"{where}: not a row ({exc})") from None
    return value


class _FieldTwice(ValueError):
    pass


def _fields_once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's fields; one given twice (JSON keeps the last, silently) is refused."""
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise _FieldTwice(f"field {key!r} given twice")
        seen.add(key)
    return dict(pairs)


def _jsonl_rows(path: Path, handle: IO[bytes]) -> list[dict[str, Any]]:
    """The rows of a ``.jsonl`` file, open as ``handle``: UTF-8 text, one JSON object a line; one
    line naming the line of anything else."""
    rows = []
    line_no = 0
    while True:
        line_no += 1
        raw = handle.readline(ROW_MAX_BYTES + 1)
        if not raw:
            return rows
        if len(raw) > ROW_MAX_BYTES:
            raise TclightningError(f"{path}:{line_no}: a row longer than {ROW_MAX_BYTES // 2**20} MiB "
                                   "(is the file one JSON object a line?)")
        try:
            line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
        except UnicodeDecodeError as exc:
            raise TclightningError(f"{path}:{line_no}: not UTF-8 text (byte {raw[exc.start]:#04x})") from None
        if not line.strip():
            continue
        row = _parsed_json(line, f"{path}:{line_no}")
        if not isinstance(row, dict):
            raise TclightningError(f"{path}:{line_no}: a row is a JSON object of fields, not "
                                   f"{type(row).__name__ if row is not None else 'null'}")
        rows.append(row)


@dataclass(frozen=True)
class DataSource:
    """A hub dataset (``hf_name``) or a local file / directory (``path``)."""

    hf_name: str | None = None
    hf_config: str | None = None
    path: Path | None = None

    @classmethod
    def from_config(cls, cfg: TaskConfig, default_subdir: str) -> DataSource:
        """``hf_name`` > ``path`` > ``shared_data_dir() / default_subdir``. A hub that keeps
        silent is refused here, in one line (``datasets`` would retry it for minutes)."""
        if cfg.hf_name:
            from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES

            if "://" in cfg.hf_name:  # hf://datasets/json is datasets' json reader too
                raise TclightningError(f"task.hf_name {cfg.hf_name}: a URL; give the dataset's name (org/name), or "
                                       "local data as task.path")
            if cfg.hf_name.lower() in _PACKAGED_DATASETS_MODULES:  # a file format: it reads the working folder
                raise TclightningError(f"task.hf_name {cfg.hf_name}: is the name of datasets' {cfg.hf_name} reader, "
                                       "which would read the files of the working folder, unchecked; give local "
                                       "data as task.path")
            if os.path.lexists(cfg.hf_name):  # datasets reads a local path of that name first, unchecked
                raise TclightningError(f"task.hf_name {cfg.hf_name}: names {os.path.abspath(cfg.hf_name)}, which "
                                       "datasets would read instead of the Hugging Face dataset: give local data "
                                       "as task.path, or run from another folder")
            silent = None if hub_offline() else hub_answer(f"api/datasets/{cfg.hf_name}")
            if silent is not None and silent.timed_out:  # unreachable at once: datasets falls back to its cache
                raise TclightningError(f"task.hf_name {cfg.hf_name}: the Hugging Face Hub ({host_of(hub_url())}) "
                                       f"gives no answer ({silent.reason}); set HF_HUB_OFFLINE=1 to use a copy in "
                                       "the datasets cache, or task.path for a local file")
            return cls(hf_name=cfg.hf_name, hf_config=cfg.hf_config)
        path = Path(cfg.path).expanduser() if cfg.path else shared_data_dir() / default_subdir
        if not path.exists():
            hint = "" if cfg.path else " (set task.path, task.hf_name or $TCLIGHTNING_DATA)"
            raise TclightningError(f"task data not found: {path}{hint}")
        if not path.is_dir():  # one file: a FIFO or a device is named as such, not "no splits"
            regular_file(path, "task data", TASK_FILE_MAX_BYTES)
        return cls(path=path)

    def _split_files(self) -> dict[str, Path]:
        assert self.path is not None
        if self.path.is_file():
            return {self.path.stem: self.path}
        files: dict[str, Path] = {}
        for ext in reversed(LOCAL_EXTENSIONS):  # preferred extension written last, wins
            for file in sorted(self.path.glob(f"*{ext}")):
                files[file.name[: -len(ext)]] = file
        return files

    def splits(self) -> list[str]:
        """Split names available (a local file is one split named after its stem)."""
        if self.hf_name:
            import datasets

            refuse_hub_paths()  # listing them reads the repository's info and card through huggingface_hub
            try:
                return list(remote_setup(f"the Hugging Face dataset {self.hf_name}'s splits",
                                         lambda: datasets.get_dataset_split_names(self.hf_name, self.hf_config)))
            except TclightningError:
                raise
            except Exception as exc:
                raise TclightningError(f"cannot list splits of {self.hf_name}: {exc}") from exc
        return sorted(self._split_files())

    def rows(self, split: str) -> list[dict[str, Any]]:
        if self.hf_name:
            return load_with_datasets(self.hf_name, self.hf_config, split=split)
        files = self._split_files()
        if split not in files:  # listed by splits() a moment ago
            raise TclightningError(f"task data {self.path}: its split '{split}' is gone (the folder changed while the "
                                   "run read it)")
        return read_rows(files[split])

    def __str__(self) -> str:
        return self.hf_name or str(self.path)


def resolve_splits(cfg: TaskConfig, available: Sequence[str]) -> tuple[str, str | None]:
    """(train split, eval split or None = carve the held-out set from the train split).

    The train split is ``cfg.split``, or the only split when there is just one (MATH-500).
    The eval split is ``cfg.eval_split``, else ``"test"`` when present, else None.
    """
    if cfg.split in available:
        train = cfg.split
    elif len(available) == 1:
        train = available[0]
    else:
        raise TclightningError(f"split '{cfg.split}' not found; available: {sorted(available)}")
    if cfg.eval_split:
        if cfg.eval_split not in available:
            raise TclightningError(
                f"eval_split '{cfg.eval_split}' not found; available: {sorted(available)}"
            )
        return train, (None if cfg.eval_split == train else cfg.eval_split)
    return train, ("test" if "test" in available and train != "test" else None)


def held_out_indices(n: int, eval_size: int, seed: int) -> list[int]:
    """A seeded sample of ``min(eval_size, n)`` indices out of ``n``, sorted."""
    rng = random.Random(seed)
    return sorted(rng.sample(range(n), min(max(eval_size, 0), n)))


def build_prompt(question: str, template: str, instruction: str | None) -> str:
    """``template`` with ``{question}`` replaced, then the instruction after a blank line."""
    prompt = template.replace("{question}", question)
    return f"{prompt}\n\n{instruction}" if instruction else prompt


def check_template(template: str) -> None:
    if "{question}" not in template:
        raise TclightningError(f"task.prompt_template must contain '{{question}}': {template!r}")


class DatasetTask(Task):
    """A task backed by rows of a dataset; subclasses say how a row becomes an answer.

    Loading is lazy (constructing a task touches no file) and cached. Train and eval come
    from different splits when the source has a ``test`` split, else from a seeded cut of
    one split; either way train examples whose prompt also appears in eval are dropped, so
    the two are disjoint by content.
    """

    default_subdir: str = ""
    default_instruction: str = ""

    def __init__(self, cfg: TaskConfig) -> None:
        check_template(cfg.prompt_template)
        self.cfg = cfg
        self.system_prompt = cfg.system_prompt
        self.instruction = self.default_instruction if cfg.instruction is None else cfg.instruction
        self._examples: tuple[tuple[Example, ...], tuple[Example, ...]] | None = None

    def select_rows(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Rows kept before the train / held-out cut (a task's filters); all rows by default."""
        return rows

    @abstractmethod
    def parse_row(self, row: Row) -> tuple[str, str, str] | None:
        """(question, answer, solution) of a dataset row, or None to skip an unusable row."""

    def _to_examples(
        self, rows: Sequence[Row], split: str, indices: Sequence[int], skipped: list[int]
    ) -> list[Example]:
        examples = []
        for i in indices:
            parsed = self.parse_row(rows[i])
            if parsed is None:
                skipped.append(i)
                continue
            question, answer, solution = parsed
            prompt = build_prompt(question, self.cfg.prompt_template, self.instruction)
            examples.append(Example(f"{self.name}/{split}/{i}", prompt, answer, solution))
        return examples

    def _load(self) -> tuple[tuple[Example, ...], tuple[Example, ...]]:
        if self._examples is not None:
            return self._examples
        cfg = self.cfg
        source = DataSource.from_config(cfg, self.default_subdir)
        train_split, eval_split = resolve_splits(cfg, source.splits())
        train_rows = self.select_rows(source.rows(train_split))
        skipped: list[int] = []
        if eval_split is None:
            if cfg.eval_size >= len(train_rows):
                raise TclightningError(
                    f"{source}: eval_size {cfg.eval_size} leaves no training rows "
                    f"out of {len(train_rows)}"
                )
            eval_idx = held_out_indices(len(train_rows), cfg.eval_size, cfg.seed)
            held = set(eval_idx)
            train_idx = [i for i in range(len(train_rows)) if i not in held]
            evals = self._to_examples(train_rows, train_split, eval_idx, skipped)
        else:
            eval_rows = self.select_rows(source.rows(eval_split))
            eval_idx = held_out_indices(len(eval_rows), cfg.eval_size, cfg.seed)
            train_idx = list(range(len(train_rows)))
            evals = self._to_examples(eval_rows, eval_split, eval_idx, skipped)
        eval_prompts = {e.prompt for e in evals}
        train = [
            e
            for e in self._to_examples(train_rows, train_split, train_idx, skipped)
            if e.prompt not in eval_prompts
        ]
        if cfg.train_size is not None:
            train = train[: cfg.train_size]
        if not train:
            raise TclightningError(f"{source}: no usable training rows for task '{self.name}'")
        if cfg.eval_size > 0 and not evals:  # validation would have nothing to score
            raise TclightningError(f"{source}: no usable held-out rows for task '{self.name}' (its split "
                                   f"'{eval_split or train_split}'); give the split rows, or set task.eval_size=0 and "
                                   "trainer.val_every=0")
        if skipped:
            self.skipped = (f"{source}: {len(skipped)} of the rows read had no usable question or answer for task "
                            f"'{self.name}' and were left out")
        self._examples = (tuple(train), tuple(evals))
        return self._examples

    def train_examples(self) -> Sequence[Example]:
        return self._load()[0]

    def eval_examples(self) -> Sequence[Example]:
        return self._load()[1]


def first_field(row: Row, *keys: str) -> str | None:
    """The first of ``keys`` that holds a non-empty string in ``row``, or a number (a JSON
    ``"answer": 42`` is the text ``"42"``, ``1e16`` is ``"10000000000000000"``; a boolean is neither)."""
    for key in keys:
        value = row.get(key)
        if isinstance(value, str) and value.strip():
            return value
        if isinstance(value, int) and not isinstance(value, bool):  # any size: math.isfinite overflowed past 1e308
            return str(value)
        if isinstance(value, float) and math.isfinite(value):
            # written out in digits: "1e+16" is e + 16 to math-verify (Euler's e)
            return format(Decimal(repr(value)), "f")
    return None
