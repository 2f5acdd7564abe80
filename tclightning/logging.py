"""Run loggers: TensorBoard (with a custom-scalars layout) and ``metrics.csv``, both resumable.

On resume from RL step ``S``, rows and events at steps ``>= S`` (written after the checkpoint,
before the kill) are dropped, so the continued run leaves no duplicated or missing step.
"""

from __future__ import annotations

import contextlib
import csv
import io
import os
import re
import secrets
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import IO, Any

from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.core.saving import save_hparams_to_yaml
from lightning.pytorch.utilities import rank_zero_only

from tclightning.errors import TclightningError, one_line
from tclightning.files import SameFolder, current_umask, note_made, own_file, rename_over, replace_file
from tclightning.health.io import cut_short, metrics_rows
from tclightning.network import is_http, remote_setup

# Grouped charts for TensorBoard's "Custom Scalars" tab; tags are the canonical metric names. One
# chart holds one unit (a share in [0, 1] never shares axes with bytes or nats), and held-out
# accuracy has a chart of its own: its few points are outliers in a chart of per-step rewards and
# TensorBoard's default outlier clipping would hide them. The first two categories put the two
# couplings a collapse shows up in side by side, on the same steps (different units, so two charts).
SCALAR_LAYOUT: dict[str, dict[str, list]] = {
    "collapse signs: reward and length": {
        "reward (mean)": ["Multiline", ["reward/mean"]],
        "response length (tokens)": ["Multiline", ["response/length_mean", "response/length_max"]],
        "truncated share": ["Multiline", ["response/truncated_frac"]],
    },
    "collapse signs: gap and reward": {
        "log-prob gap (nats)": ["Multiline", ["gap/abs_mean", "gap/k3"]],
        "reward (mean)": ["Multiline", ["reward/mean"]],
        "health state (0 healthy, 1 warning, 2 collapsing, -1 no data)": ["Multiline", ["health/state"]],
    },
    "learning": {
        "reward": ["Multiline", ["reward/mean"]],
        "reward spread (std)": ["Multiline", ["reward/std"]],
        "held-out accuracy (greedy)": ["Multiline", ["val/accuracy"]],
        "agentic success and validity (share)": ["Multiline", ["agentic/success_rate", "agentic/valid_frac",
                                                               "agentic/unfinished_frac"]],
    },
    "optimisation": {
        "policy loss": ["Multiline", ["loss/policy"]],
        "KL to the reference (k3)": ["Multiline", ["loss/kl"]],
        "entropy (nats per token)": ["Multiline", ["policy/entropy"]],
        "clipped and kept tokens (share)": ["Multiline", ["policy/clip_frac", "policy/kept_frac"]],
        "gradient norm": ["Multiline", ["policy/grad_norm"]],
    },
    "gap": {
        "largest log-prob gap (nats)": ["Multiline", ["gap/max"]],
        "tokens off the sampler (share, |Δp|)": ["Multiline", ["gap/outside_5x_frac", "gap/prob_abs_mean"]],
        "log-prob correlation": ["Multiline", ["gap/logp_corr"]],
    },
    "wire": {
        "bytes per step": ["Multiline", ["wire/bytes_fwd", "wire/bytes_bwd", "anchor/bytes"]],
        "dense bytes / sent bytes": ["Multiline", ["wire/ratio"]],
        "energy the low-rank bases keep (share)": ["Multiline", ["wire/energy_kept"]],
    },
    "anchor": {
        "sign agreement (share)": ["Multiline", ["anchor/sign_agreement"]],
        "latency and cadence (ticks)": ["Multiline", ["anchor/latency", "anchor/cadence"]],
        "anchor vs fast gradient (cosine) and the anchor term's strength": [
            "Multiline", ["anchor/fast_cosine", "anchor/strength"]],
        "anchor controller mode (0 full strength, 1 partial, 2 off, 3 probe)": [
            "Multiline", ["anchor/controller_mode"]],
    },
    "health": {
        "state per monitor (0 healthy, 1 warning, 2 collapsing, -1 no data)": [
            "Multiline", ["health/length", "health/gap", "health/collapse"]],
        "rollbacks so far": ["Multiline", ["health/length_rollbacks", "health/gap_rollbacks",
                                           "health/collapse_rollbacks"]],
    },
    "time": {
        "seconds per step": ["Multiline", ["time/sample_s", "time/train_s", "time/anchor_s"]],
        "throughput (tokens/s)": ["Multiline", ["throughput/tokens_per_s"]],
    },
}


# Tags first logged some steps into a run, each with a tag logged from the first step whenever it
# will be: the anchor's sign agreement needs a delivered anchor gradient (K ticks in), a low-rank
# basis's energy its first fit (after the dense first step).
LATE_TAGS: dict[str, str] = {"anchor/sign_agreement": "anchor/latency", "anchor/fast_cosine": "anchor/latency",
                             "wire/energy_kept": "wire/basis_bytes"}


def scalar_layout(
    tags: Iterable[str] | None = None,
    layout: Mapping[str, Mapping[str, list]] = SCALAR_LAYOUT,
    late: Mapping[str, str] = LATE_TAGS,
) -> dict[str, dict[str, list]]:
    """The Custom Scalars ``layout`` restricted to what a run logs.

    A chart is kept when one of its tags (a regular expression, as TensorBoard reads it) matches
    one of ``tags`` whole; a tag of ``late`` counts as logged when its companion is (so the
    anchor's sign-agreement chart is there from the first step). A dense run thus gets no
    ``wire`` or ``anchor`` charts, and a category left without charts is dropped. ``tags=None``
    keeps every chart. The result is what ``SummaryWriter.add_custom_scalars`` takes.
    """
    logged = None if tags is None else set(tags)
    if logged is not None:
        logged |= {tag for tag, companion in late.items() if companion in logged}
    result: dict[str, dict[str, list]] = {}
    for category, charts in layout.items():
        kept = {
            title: [kind, list(chart_tags)]
            for title, (kind, chart_tags) in charts.items()
            if logged is None or any(re.fullmatch(p, t) for p in chart_tags for t in logged)
        }
        if kept:
            result[category] = kept
    return result


class _HeldEventFile:
    """The write end of a TensorBoard event file TensorBoard has just created, opened once as the
    run's own file (:func:`~tclightning.files.own_file`), in place of its reopen-by-name writer."""

    def __init__(self, path: Path) -> None:
        self._handle = own_file(path, "ab")
        note_made(self._handle.fileno())  # (TensorBoard made it a moment ago)

    def write(self, data: bytes) -> None:
        self._handle.write(data)

    def flush(self) -> None:
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()

    @property
    def closed(self) -> bool:
        return self._handle.closed


class LayoutTensorBoardLogger(TensorBoardLogger):
    """Lightning's ``TensorBoardLogger`` that also writes a Custom Scalars layout built from the
    tags the run logs (:func:`scalar_layout`), and leaves out Lightning's ``epoch`` scalar (with
    one pass over a prompt stream it is always 0, and the Scalars tab would open on it).

    The layout is written once every tag of the first logged step is known: at the first
    ``log_metrics`` call of a later step, or when the run ends. ``layout`` replaces
    :data:`SCALAR_LAYOUT` (for a project that logs other names). Arguments otherwise as
    ``TensorBoardLogger``.
    """

    def __init__(self, *args: Any, layout: Mapping[str, Mapping[str, list]] = SCALAR_LAYOUT, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._layout = layout
        self._seen: set[str] = set()
        self._first_step: int | None = None
        self._layout_written = False

    @property
    def experiment(self) -> Any:
        """Lightning's ``SummaryWriter``, whose event files are then written through descriptors
        held from the start (TensorBoard's own writer reopens each file by name at every write, so
        a link or a FIFO put at the name during the run would be written through or waited on)."""
        fresh = self._experiment is None
        experiment = super().experiment
        if fresh:
            for writer in getattr(experiment, "all_writers", {}).values():
                records = writer.event_writer._async_writer._writer  # RecordWriter(GFile)
                records._writer = _HeldEventFile(Path(writer.event_writer._file_name))
        return experiment

    @rank_zero_only
    def save(self) -> None:
        # TensorBoardLogger.save, with hparams.yaml written by replace (it opens the name: a FIFO
        # put there would be waited on, a dangling link written through)
        super(TensorBoardLogger, self).save()
        folder = Path(self.log_dir)
        if not folder.is_dir():
            return
        with SameFolder(folder).held() as held:  # the run's tb/ (taken with the run folder), never a link put there
            path = held / self.NAME_HPARAMS_FILE
            if path.is_symlink() or not path.is_file():
                write_hparams(path, self.hparams)

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        metrics = {k: v for k, v in metrics.items() if k != "epoch"}
        if not self._layout_written:
            if self._first_step is None:
                self._first_step = step
            elif step != self._first_step:
                self.write_layout()
            self._seen.update(metrics)
        super().log_metrics(metrics, step)

    @rank_zero_only
    def write_layout(self) -> None:
        """Write the layout for the tags logged so far (once; later calls do nothing)."""
        if self._layout_written or not self._seen:
            return
        self._layout_written = True
        self.experiment.add_custom_scalars(scalar_layout(self._seen, self._layout))

    @rank_zero_only
    def finalize(self, status: str) -> None:
        self.write_layout()
        super().finalize(status)

def write_hparams(path: Path, hparams: Any) -> None:
    """Lightning's ``save_hparams_to_yaml`` into a new temporary file beside ``path``, renamed over
    it: never through a link or into a FIFO at the name, and whole or not at all."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    note_made(fd)
    os.fchmod(fd, 0o666 & ~current_umask())  # as the file Lightning would have made
    os.close(fd)
    try:
        save_hparams_to_yaml(tmp, hparams)
        rename_over(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_csv_atomically(path: Path, fieldnames: list[str], rows: list[dict[str, str]]) -> None:
    """Replace ``path`` by a CSV of ``rows`` in one atomic rename: a kill or a full disk at any
    moment leaves either the old file or the new one, never a file cut short."""

    def write(handle: IO[str]) -> None:
        out = csv.DictWriter(handle, fieldnames=fieldnames)
        out.writeheader()
        out.writerows(rows)

    replace_file(path, write)


class AtomicExperimentWriter(ExperimentWriter):
    """Lightning's CSV writer (appends each step's rows), except that it never deletes an
    existing ``metrics.csv`` (the logger decides what a resumed run keeps), rewrites the file
    atomically when a new column appears (Lightning truncates it in place first), and opens it
    only as the run's own file (:func:`~tclightning.files.own_file`: a link or a FIFO put in its
    place during the run stops the run, never written through or waited on).

    ``cut_from``: the rows of the file from this step on belong to a history the run replaces;
    they go in the same atomic rewrite that adds the run's first new rows, so a run killed before
    it logged anything leaves the file as it found it."""

    cut_from: int | None = None
    _identity: tuple[int, int] | None = None  # metrics.csv's (st_dev, st_ino) as the run last wrote it

    def _check_log_dir_exists(self) -> None:
        pass

    def log_hparams(self, params: dict[str, Any]) -> None:
        self.hparams.update(params)
        with self._held_folder() as folder:  # into the folder checked, whatever its name leads to meanwhile
            write_hparams(folder / self.NAME_HPARAMS_FILE, self.hparams)

    def save(self) -> None:
        if not self.metrics:
            return
        self._check_folder()
        path = Path(self.metrics_file_path)
        exists = os.path.lexists(path)
        keys_written = list(self.metrics_keys)
        new_keys = self._record_new_keys()
        if exists and (self.cut_from is not None or new_keys):
            try:
                with self._own(path, "r") as handle:
                    text = handle.read()
                reader = metrics_rows(io.StringIO(text, newline=""))
                records = list(reader)
                if text and not text.endswith(("\n", "\r")) and records and cut_short(records[-1], reader.fieldnames):
                    records.pop()  # a last row a crash cut short (its step may be cut too: 10 read as 1)
                rows = [row for row in records if self.cut_from is None
                        or row.get("step") and int(float(row["step"])) < self.cut_from]
                write_csv_atomically(path, self.metrics_keys, [*rows, *self.metrics])
            except BaseException:  # the file keeps its header: a later save must not append under it
                self.metrics_keys = keys_written
                raise
            info = os.stat(path)
            self._identity = (info.st_dev, info.st_ino)  # the file the rewrite put in place
        else:
            with self._own(path, "a" if exists else "x") as handle:
                writer = csv.DictWriter(handle, fieldnames=self.metrics_keys)
                if not exists:
                    writer.writeheader()
                writer.writerows(self.metrics)
        self.metrics, self.cut_from = [], None

    def _check_folder(self) -> None:
        """The run folder itself replaced: its records would land in another run, or someone's folder."""
        if getattr(self, "_folder", None) is None:
            self._folder = SameFolder(Path(self.log_dir))
        self._folder.check()

    def _held_folder(self) -> Any:
        """The run folder, checked and held (:meth:`~tclightning.files.SameFolder.held`)."""
        self._check_folder()
        return self._folder.held()

    def _own(self, path: Path, mode: str) -> IO[str]:
        """``own_file(path, mode)``, and the same file (device and inode) as the last time: another
        regular file renamed or hard-linked into its place is someone's, never appended to."""
        handle = own_file(path, mode)
        info = os.fstat(handle.fileno())
        if self._identity is not None and (info.st_dev, info.st_ino) != self._identity:
            handle.close()
            raise TclightningError(f"{path}: is no longer the run's own file (another file was put in its place); "
                                   "nothing was written to it")
        self._identity = (info.st_dev, info.st_ino)
        return handle


class ResumableCSVLogger(CSVLogger):
    """``CSVLogger`` writing ``<run_dir>/metrics.csv``; on resume keeps only rows with
    ``step < resume_step`` and continues with the same header. Every rewrite of the file is an
    atomic replace, and the rows past the resume point go only with the first new row, so a
    kill never loses rows already on disk."""

    def __init__(self, run_dir: str | Path, resume_step: int | None = None) -> None:
        # Flushed every step (a row is tiny), so a killed run keeps every row it logged.
        super().__init__(save_dir=str(run_dir), name="", version="", flush_logs_every_n_steps=1)
        path = Path(run_dir) / "metrics.csv"
        header: list[str] = []
        if resume_step is not None and path.is_file():
            with path.open(newline="") as handle:
                header = list(metrics_rows(handle).fieldnames or [])
        writer = self.experiment
        if path.is_file():  # a fresh run in a directory of ours keeps none (RUN_DIR_ENV)
            writer.cut_from = resume_step if header else 0
        if header:
            writer.metrics_keys = sorted(header)

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        """The :class:`AtomicExperimentWriter` (created on first use, global rank 0 only)."""
        if self._experiment is None:
            os.makedirs(self.root_dir, exist_ok=True)
            self._experiment = AtomicExperimentWriter(log_dir=self.log_dir)
        return self._experiment


def quiet_event_writer_errors() -> None:
    """TensorBoard writes events from a thread of its own: a write the file system refuses (a full
    disk, a run folder removed) is raised again in the run's thread at the next log or flush (and
    reported there in one line), so the thread's own traceback is left out. Any other exception of
    any thread goes to the hook there was."""
    from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread

    previous = threading.excepthook
    if getattr(previous, "quiet_event_writes", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if not isinstance(args.thread, _AsyncWriterThread) or not isinstance(args.exc_value, OSError):
            previous(args)

    hook.quiet_event_writes = True  # type: ignore[attr-defined]
    threading.excepthook = hook


def build_tensorboard(run_dir: str | Path, resume_step: int | None = None) -> LayoutTensorBoardLogger:
    """Events under ``<run_dir>/tb``, with the Custom Scalars layout of the tags the run logs;
    ``purge_step`` drops events logged after the checkpoint."""
    quiet_event_writer_errors()
    kwargs = {"purge_step": resume_step} if resume_step is not None else {}
    return LayoutTensorBoardLogger(save_dir=str(run_dir), name="tb", version="", default_hp_metric=False, **kwargs)


def own_loggers(entries: Iterable[Any]) -> set[str]:
    """Which of the run's own loggers (``tensorboard``, ``csv``: events in ``<run_dir>/tb``,
    ``<run_dir>/metrics.csv``) ``logging.loggers`` lists by name."""
    paths = (e if isinstance(e, str) else e.get("class_path") for e in entries)
    return {p for p in paths if p in ("tensorboard", "csv")}


def build_loggers(entries: Iterable[Any], run_dir: str | Path, project: str, source: str = "recipe") -> list[Any]:
    """The loggers ``logging.loggers`` lists beside the run's own, built (nothing is sent or written yet).

    ``entries``: short names or ``{"class_path", "init_args"}`` dicts (validated on load). The
    run's own ``tensorboard``/``csv`` are skipped (see :func:`own_loggers`). Defaults the user's
    ``init_args`` override: W&B gets ``project`` = ``project``, ``name`` = the run folder's name
    and ``save_dir`` = ``run_dir`` (``WANDB_MODE=offline`` or ``offline: true`` keeps it off the
    network); MLflow gets ``experiment_name`` = ``project``, ``run_name`` = the run folder's name,
    and, when neither ``tracking_uri`` nor ``MLFLOW_TRACKING_URI`` is set, a local file store in
    ``<run_dir>/../mlruns`` (one store for every run of the recipe; for it, or a ``file:`` or plain
    path ``tracking_uri``, ``MLFLOW_ALLOW_FILE_STORE`` is set to ``true`` unless set already, as
    MLflow 3.7+ requires for a file store). A constructor refusing its
    arguments is a :class:`~tclightning.errors.RecipeError` naming ``logging.loggers[i].init_args``.
    """
    from tclightning.errors import RecipeError
    from tclightning.recipes.loader import logger_kind, resolve_logger_class

    run_dir = Path(run_dir)
    loggers = []
    for i, entry in enumerate(entries):
        path = entry if isinstance(entry, str) else entry["class_path"]
        if path in ("tensorboard", "csv"):
            continue
        init_args = {} if isinstance(entry, str) else dict(entry.get("init_args") or {})
        cls = resolve_logger_class(path, source, f"logging.loggers[{i}]")
        name = logger_kind(cls)
        defaults: dict[str, Any] = {}
        if name == "wandb":
            defaults = {"project": project, "name": run_dir.name, "save_dir": str(run_dir)}
        elif name == "mlflow":
            defaults = {"experiment_name": project, "run_name": run_dir.name}
            uri = mlflow_tracking_uri(init_args)
            if not uri:
                defaults["save_dir"] = str(run_dir.parent / "mlruns")
            if not uri or uri.startswith("file:") or "://" not in uri:
                # MLflow >= 3.7 refuses its file store unless this opt-out is set; a local store
                # needs no server or database package (mlflow-skinny has no SQLAlchemy)
                os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        arguments = {**defaults, **init_args}
        store = _local_store(name, arguments)
        if store is not None and (_lies_in_run_folders(store, Path(os.path.realpath(run_dir)))  # before it is made
                                  or _another_run_s_folder(store) is not None):
            raise RecipeError(f"{store} lies in the run's {'/'.join(RUN_FOLDERS)} folders, which the run writes and a "
                              "resume reads (links and folders of another logger there stop it): give the logger "
                              "the run folder itself (its default) or a folder of its own", file=source,
                              key=f"logging.loggers[{i}].init_args")
        key = f"logging.loggers[{i}].init_args"
        try:  # a store or server that stalls (an ftp:// store connects in the constructor) is bounded
            loggers.append(remote_setup(f"logging.loggers[{i}]: its store or server",
                                        lambda: _built_logger(cls, name, arguments, run_dir, source, key)))
        except TclightningError as err:
            if isinstance(err, RecipeError):
                raise
            raise RecipeError(str(err), file=source, key=key) from None
    return loggers


def _built_logger(cls: type, name: str | None, arguments: dict[str, Any], run_dir: Path, source: str,
                  key: str) -> Any:
    """``cls(**arguments)``, checked before anything is written: its folder (:func:`_refuse_a_folder_of_yours`)
    and an MLflow store opened now. One :class:`RecipeError` naming ``key`` otherwise."""
    from tclightning.errors import RecipeError

    try:
        logger = cls(**arguments)
    except (TypeError, ValueError) as err:
        reason = (str(err).splitlines() or [type(err).__name__])[0]
        raise RecipeError(reason, file=source, key=key) from None
    except TimeoutError:
        raise
    except Exception as err:  # noqa: BLE001 - a store it cannot open (no package for it, a host that refuses,
        # a protocol fsspec does not know), MLflow's store URI it cannot use: the logger's own refusal, one line
        what = "MLflow cannot use its tracking store" if name == "mlflow" else "the logger cannot open its store"
        raise RecipeError(f"{what}: {type(err).__name__}: {one_line(err)}", file=source, key=key) from None
    _refuse_a_folder_of_yours(logger, run_dir, source, key)
    if name == "mlflow":
        try:  # opens the store now (a damaged one is one line here, not a traceback once training starts)
            logger.experiment  # noqa: B018
        except TimeoutError:
            raise
        except Exception as err:  # noqa: BLE001 - whatever MLflow raises reading a store it cannot use
            raise RecipeError(f"MLflow cannot open its tracking store: {type(err).__name__}: {one_line(err)}",
                              file=source, key=key) from None
    return logger


RUN_MARKER = ".tclightning-run"
"""A file in every run directory tclightning creates. A resume writes only into a directory that
holds one; a checkpoint anywhere else continues in a new run directory under ``logging.root``."""

RUN_FOLDERS = ("checkpoints", "tb", "trajectory")
"""The folders of a run directory the run writes itself (beside its files: ``metrics.csv``, ...)."""

RUN_FOLDER_FILES: dict[str, tuple[str, ...]] = {
    "checkpoints": ("*.ckpt", ".*.tmp"),  # step-*.ckpt, last.ckpt, .last.ckpt.tmp, a replace's .NAME.*.tmp
    "tb": ("events.out.tfevents.*", "hparams.yaml"),
    "trajectory": ("point-*.pt", ".*.tmp"),
}
"""The names of the files the run writes into each of :data:`RUN_FOLDERS` (glob patterns): any other
file there is someone else's."""


def mlflow_tracking_uri(init_args: Mapping[str, Any]) -> str:
    """The tracking URI an ``MLFlowLogger`` built with ``init_args`` uses ("" for its ``save_dir``):
    the argument when given, even as null, else its default, ``MLFLOW_TRACKING_URI``."""
    if "tracking_uri" in init_args:
        return str(init_args["tracking_uri"] or "")
    return os.environ.get("MLFLOW_TRACKING_URI", "")


def mlflow_logs_in_background(synchronous: Any, tracking_uri: str) -> str | None:
    """Why an MLflow logger built with ``synchronous`` and ``tracking_uri`` may not log to its
    server from MLflow's background threads, or None: its asynchronous logging (``synchronous:
    false``, or unset with ``MLFLOW_ENABLE_ASYNC_LOGGING`` on) runs where no time limit reaches,
    and a server that stalls held the command's exit for ever. Any store MLflow does not take for a
    local file store is a server (http(s), ``databricks``, a database)."""
    from mlflow.utils.uri import is_local_uri

    if synchronous is None:
        in_background = os.environ.get("MLFLOW_ENABLE_ASYNC_LOGGING", "").strip().lower() in ("true", "1")
    else:  # MLflow logs in the background for any false value (0, "")
        in_background = not synchronous
    if not in_background:
        return None
    try:
        local = not is_http(tracking_uri) and is_local_uri(tracking_uri.strip())
    except ValueError:  # a malformed URL (http://[::1): no file store either
        local = False
    if local:  # a file store: no server to stall
        return None
    return ("logs to its server from MLflow's background threads (synchronous: false, or "
            "MLFLOW_ENABLE_ASYNC_LOGGING), which no time limit reaches: a server that stalls would hold the "
            "command's exit for ever; log synchronously (synchronous: true)")


def _local_store(name: str | None, arguments: dict[str, Any]) -> Path | None:
    """The folder on this machine a W&B or MLflow logger built with ``arguments`` writes into, or
    None (another logger, a server, a database): W&B's ``save_dir`` (a local folder, whatever it
    spells; none: ``WANDB_DIR``, else the working folder, as ``wandb.init`` takes them); MLflow's
    tracking URI (its argument, else ``MLFLOW_TRACKING_URI``, else its ``save_dir``), read by
    MLflow's own ``is_local_uri`` and ``local_file_uri_to_path`` (``file://127.0.0.1/``, ``%70``)."""
    if name == "wandb":
        return Path(str(arguments.get("save_dir") or arguments.get("dir") or os.environ.get("WANDB_DIR")
                        or os.getcwd())).expanduser()
    if name != "mlflow":
        return None
    from mlflow.utils.file_utils import local_file_uri_to_path
    from mlflow.utils.uri import is_local_uri

    uri = mlflow_tracking_uri(arguments) or f"file:{arguments.get('save_dir', './mlruns')}"
    try:
        return Path(local_file_uri_to_path(uri)).expanduser() if is_local_uri(uri) else None
    except Exception:  # noqa: BLE001 - a URI MLflow refuses itself (a remote host's file:), when it is built
        return None


def _same_folder(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` are one folder (a bind mount of it included); False where one is missing."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _another_run_s_folder(path: Path) -> Path | None:
    """The run directory (any tclightning run: it holds the run marker) whose tb/, checkpoints/ or
    trajectory/ ``path`` lies in, by its real path; else None."""
    real = Path(os.path.realpath(path))
    return next((above.parent for above in (real, *real.parents)
                 if above.name in RUN_FOLDERS and (above.parent / RUN_MARKER).is_file()), None)


def _lies_in_run_folders(path: Path, run: Path) -> bool:
    """Whether ``path`` (made or yet to be made) lies in one of the run's :data:`RUN_FOLDERS`: by
    its real path, or through a folder above it that is the run directory or one of its folders
    under another name (a bind mount), whether that folder is made yet or not."""
    real = Path(os.path.realpath(path))
    if any(real.is_relative_to(run / folder) for folder in RUN_FOLDERS):
        return True

    def identity(folder: Path) -> tuple[int, int] | None:
        try:
            found = os.stat(folder)
        except OSError:
            return None
        return found.st_dev, found.st_ino

    run_identity = identity(run)
    own = {identity(run / folder) for folder in RUN_FOLDERS} - {None}
    for above in (real, *real.parents):
        found = identity(above)
        if found is None:
            continue
        below = real.relative_to(above).parts
        if found in own or (found == run_identity and below and below[0] in RUN_FOLDERS):
            return True
    return False


def remote_store(path: str | None) -> bool:
    """Whether ``path`` (a folder a logger or checkpoint writes into) lies on a remote fsspec store
    (``s3://``, ``http://``, ``ftp://``), read from its protocol alone: nothing is connected."""
    from fsspec.core import split_protocol
    from fsspec.implementations.local import LocalFileSystem
    from fsspec.registry import get_filesystem_class

    protocol, _ = split_protocol(str(path or ""))
    if protocol is None:
        return False
    try:
        return not issubclass(get_filesystem_class(protocol), LocalFileSystem)
    except ImportError:  # a store without its package: not this machine's (its logger names the package)
        return True
    except ValueError as err:  # `mine/file:///x`: Lightning's writes would fail on it at the first step
        raise TclightningError(f"{path}: not a folder a logger or checkpoint can write ({one_line(err)})") from None


def remote_root(logger: Any) -> str | None:
    """The folder a CSV or TensorBoard logger writes under when it lies on a remote fsspec store,
    else None. Read from its ``root_dir``: its ``log_dir`` would already ask the store for the
    next version."""
    if not isinstance(logger, (CSVLogger, TensorBoardLogger)):
        return None
    root = str(logger.root_dir)
    return root if remote_store(root) else None


def ask_remote_stores(trainer: Any) -> None:
    """Ask each remote store ``trainer`` will write into, once, under
    :func:`~tclightning.network.remote_setup`'s time limit: its ``default_root_dir``, each
    callback's remote ``dirpath`` (``ModelCheckpoint``, ``OnExceptionCheckpoint``), its profiler's,
    each CSV or TensorBoard logger's folder (listed for its next version), an MLflow or W&B logger's
    server (its experiment opened). A store or server that never answers is one
    ``TclightningError`` naming it, before the fit (Lightning would wait on it without end). Once
    any store is remote, every writing call of the loggers on one, of the callbacks that write to
    one or may (a checkpoint callback's default folder is the logger's, and LightningCLI's config
    writer writes into it) and of the profiler has a time limit in all: one that stalls later, or
    fails, is one line too."""
    from tclightning.recipes.loader import logger_kind

    profiler = getattr(trainer, "profiler", None)
    folders = [("trainer.default_root_dir", trainer.default_root_dir)]
    folders += [(f"the {type(callback).__name__}'s dirpath", callback.dirpath) for callback in trainer.callbacks
                if isinstance(getattr(callback, "dirpath", None), (str, os.PathLike))]
    if isinstance(getattr(profiler, "dirpath", None), (str, os.PathLike)):
        folders.append((f"the {type(profiler).__name__}'s dirpath", profiler.dirpath))
    remote = False
    for what, folder in folders:
        if remote_store(folder):
            remote = True
            _set_up_remote(f"{what} {folder}", lambda folder=str(folder): _takes_a_file(folder))
    for logger in trainer.loggers:
        root = remote_root(logger)
        if root is not None:  # a file written, its folder listed and made, its writer opened: now, bounded
            remote = True
            what = f"the logger's store {root}"
            _set_up_remote(what, lambda logger=logger, root=root: (_takes_a_file(root), logger.log_dir,
                                                                   logger.experiment))
            _bound_calls(logger, LOGGER_CALLS, what, REMOTE_CALL_S)
        elif logger_kind(type(logger)) in ("mlflow", "wandb"):
            # Lightning's MLFlowLogger keeps both only as these attributes
            background = (mlflow_logs_in_background(getattr(logger, "_log_batch_kwargs", {}).get("synchronous"),
                                                    str(getattr(logger, "_tracking_uri", "") or ""))
                          if logger_kind(type(logger)) == "mlflow" else None)
            if background is not None:
                raise TclightningError(f"the {type(logger).__name__} {background}")
            remote_setup(f"the {type(logger).__name__}'s server", lambda logger=logger: logger.experiment)
            _bound_calls(logger, LOGGER_CALLS, f"the {type(logger).__name__}'s server", REMOTE_CALL_S)
    if remote:
        from lightning.pytorch.plugins.io import AsyncCheckpointIO

        if isinstance(getattr(trainer.strategy, "checkpoint_io", None), AsyncCheckpointIO):
            # its writes run on a thread of its own, past every time limit on the callbacks' calls,
            # and the process waits for that thread at its exit: a store that drips held it for ever
            raise TclightningError("AsyncCheckpointIO writes checkpoints from a thread no time limit reaches, and a "
                                   "store of this fit is remote: leave the plugin out (nothing was trained)")
        for callback in trainer.callbacks:
            folder = getattr(callback, "dirpath", False)  # None: the logger's or default_root_dir's, at setup
            if folder is None or (folder is not False and remote_store(folder)) \
                    or type(callback).__name__ == "SaveConfigCallback":  # LightningCLI's: into the logger's folder
                _bound_calls(callback, CALLBACK_CALLS, f"the remote store {type(callback).__name__} writes to",
                             REMOTE_CHECKPOINT_S)
        if profiler is not None:
            _bound_calls(profiler, PROFILER_CALLS, f"the remote store {type(profiler).__name__} writes to",
                         REMOTE_CHECKPOINT_S)


def open_store(what: str, folder: str | os.PathLike | None) -> None:
    """Where ``folder`` lies on a remote fsspec store, make its filesystem now, bounded, as
    Lightning's ``Trainer`` will (its default logger under ``default_root_dir``): a store whose
    constructor fails (dbfs:// without its token, an ftp:// server that refuses) or never answers
    is one line naming ``what`` instead of a traceback. fsspec keeps the instance, so Lightning's
    own ``url_to_fs`` of the same folder takes it without connecting again."""
    if not remote_store(str(folder or "")):
        return

    def made() -> None:
        from fsspec.core import url_to_fs

        url_to_fs(str(folder))

    _set_up_remote(f"{what} {folder}", made)


def finish_wandb(limit_s: float | None = None) -> str | None:
    """Finish W&B's runs of this process (``wandb.teardown``: its last records sent to its server)
    within ``limit_s``, where W&B is in use. At the interpreter's exit W&B waits for its service
    to send them without a limit: a server that took the run and then dripped held the finished
    command for ever. Returns why it was not finished in time (its service is then ended, and what
    it had not sent stays in its run folder for ``wandb sync``), else None. ``limit_s``: default
    :data:`REMOTE_CALL_S`."""
    import sys

    wandb = sys.modules.get("wandb")
    if wandb is None or getattr(getattr(wandb, "sdk", None), "wandb_setup", None) is None \
            or wandb.sdk.wandb_setup._singleton is None:
        return None
    from tclightning.limits import watched

    limit_s = REMOTE_CALL_S if limit_s is None else limit_s
    try:
        watched(wandb.teardown, lambda waited: limit_s - waited)
    except TimeoutError:
        _end_wandb_service()
        return (f"W&B did not finish sending the run to its server within {limit_s:g} s; what it had not sent "
                "stays in its run folder (`wandb sync` sends it)")
    except Exception as err:  # noqa: BLE001 - the service's own failure: the run itself is done
        return f"W&B could not finish the run: {type(err).__name__}: {one_line(err)}"
    return None


def _end_wandb_service() -> None:
    """SIGKILL this process's W&B service (``wandb-core``), which takes no SIGTERM while it retries."""
    import signal

    processes = Path("/proc")
    for entry in processes.iterdir() if processes.is_dir() else ():
        try:
            parent = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            command = (entry / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if parent == os.getpid() and b"wandb-core" in command:
            with contextlib.suppress(OSError):
                os.kill(int(entry.name), signal.SIGKILL)


def _set_up_remote(what: str, work: Callable[[], Any]) -> None:
    """``work`` under :func:`~tclightning.network.remote_setup`; what the store raises (one that
    answers but takes no files: a plain http server) is one line naming ``what``."""
    try:
        remote_setup(what, work)
    except TclightningError:
        raise
    except Exception as err:  # noqa: BLE001 - the store's answer, whatever its library makes of it
        raise TclightningError(f"{what} cannot be written: {type(err).__name__}: {one_line(err)}") from None


def _takes_a_file(folder: str) -> None:
    """Write a byte to a new file in the remote ``folder`` (made if missing) and remove it: a store
    that answers but takes no files fails here, before the fit, not at the run's first write
    (Lightning's hyper-parameters, a checkpoint after the first steps)."""
    from fsspec.core import url_to_fs

    store, path = url_to_fs(folder)
    if not store.isdir(path):  # asked first: a store that never answers is named so
        store.makedirs(path, exist_ok=True)
    probe = f"{path.rstrip('/')}/.tclightning-write-check-{secrets.token_hex(8)}"  # a name no file of yours has
    with store.open(probe, "wb") as file:
        file.write(b"\0")
    store.rm_file(probe)  # that one file (``rm`` reads ``[ab]`` or ``*`` in a folder's name as a pattern)


REMOTE_CALL_S = 120.0
"""How long one call of a logger that writes to a remote store or server may take, in all: each
request has its own limit where the library sets one, but a server that answers a byte at a time,
or a library with none (webhdfs, ftp), would hold a call for ever."""

REMOTE_CHECKPOINT_S = 600.0
"""The same for one hook of a checkpoint callback writing to a remote store (a checkpoint of a
billion-parameter model and its optimizer state is gigabytes to upload)."""

LOGGER_CALLS = ("log_metrics", "log_hyperparams", "log_graph", "save", "finalize", "after_save_checkpoint")
"""The calls with which Lightning has a logger write to its store or server."""

CALLBACK_CALLS = ("setup", "on_train_start", "on_train_batch_end", "on_train_epoch_end", "on_validation_end",
                  "on_fit_end", "on_exception", "teardown")
"""The hooks at which a checkpoint callback (or LightningCLI's config writer) writes its files."""

PROFILER_CALLS = ("setup", "describe", "teardown")
"""The calls at which a profiler with a ``dirpath`` writes its report."""


def _bound_calls(owner: Any, names: Iterable[str], what: str, limit_s: float) -> None:
    """Give each of ``owner``'s methods ``names`` ``limit_s`` seconds (in any thread), after which it is
    one ``TclightningError`` naming ``what``; what the store raises in one (a store that took a file
    and then keeps none: Lightning's "Missing folder") is one line naming ``what`` too."""
    from tclightning.limits import waited_on

    for name in names:
        method = getattr(owner, name, None)
        if method is None or getattr(method, "remote_call_bounded", False):
            continue

        def bounded(*args: Any, _method: Any = method, **kwargs: Any) -> Any:
            try:
                return waited_on(lambda: _method(*args, **kwargs), limit_s)
            except TimeoutError:
                raise TclightningError(f"{what} gave no answer within {limit_s:g} s") from None
            except TclightningError:
                raise
            except Exception as err:  # noqa: BLE001 - the store's failure, whatever its library makes of it
                raise TclightningError(f"{what} failed: {type(err).__name__}: {one_line(err)}") from err

        bounded.remote_call_bounded = True  # type: ignore[attr-defined]
        setattr(owner, name, bounded)


def _refuse_a_folder_of_yours(logger: Any, run_dir: Path, source: str, key: str) -> None:
    """A CSV or TensorBoard logger writes its files into its ``log_dir`` and replaces a
    ``metrics.csv`` there: one pointed (by a fixed ``version``) at a folder outside the run that
    already holds files, or at the run directory or a folder of the run's own (its ``metrics.csv``,
    events, checkpoints), is refused, before it writes."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    from tclightning.errors import RecipeError

    run = Path(os.path.realpath(run_dir))
    if not isinstance(logger, (CSVLogger, TensorBoardLogger)):  # W&B, MLflow: checked before they were built
        return
    from fsspec.core import url_to_fs

    if "::" in str(logger.root_dir):  # a chain (simplecache::file://...) writes through to where it ends: unchecked
        raise RecipeError(f"{logger.root_dir}: a chained fsspec URL is not checked for files of yours it would write "
                          "over; give the logger a plain folder or a remote store", file=source, key=key)
    if remote_root(logger) is not None:  # a remote store holds none of this machine's files
        logger.log_dir  # noqa: B018 - lists the store for the next version now, under the caller's time limit
        return
    # Where the files will land: `..` after a folder the logger is yet to make (`mine/new/..`) is
    # mine, and so are `file://mine` and `local://mine` (Lightning's loggers write through fsspec)
    where = str(logger.log_dir)
    try:
        log_dir = Path(os.path.realpath(url_to_fs(where if "://" in where else str(Path(where).expanduser()))[1]))
    except (ValueError, ImportError, OSError) as err:  # a name or version that spells a protocol fsspec refuses
        raise RecipeError(f"{where}: not a folder the logger can write ({type(err).__name__}: {one_line(err)})",
                          file=source, key=key) from None
    if log_dir == run or _same_folder(log_dir, run) or _lies_in_run_folders(log_dir, run):  # bind mounts too
        raise RecipeError(f"{log_dir} is the run's own folder (its metrics.csv, events and checkpoints), which this "
                          "logger would write over: leave its version unset (a new version folder each run), or "
                          "give it a folder of its own", file=source, key=key)
    if not log_dir.is_dir() or not any(log_dir.iterdir()):  # in the run too: a resume's logger would replace its rows
        return
    raise RecipeError(f"{log_dir} already holds files, which this logger would write over: leave its version unset "
                      "(a new version folder each run), or give it a folder of its own", file=source, key=key)
