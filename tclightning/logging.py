"""Run loggers: TensorBoard (with a custom-scalars layout) and ``metrics.csv``, both resumable.

On resume from RL step ``S``, rows and events at steps ``>= S`` (written after the checkpoint,
before the kill) are dropped, so the continued run leaves no duplicated or missing step.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment

# Grouped charts for TensorBoard's "Custom Scalars" tab; tags are the canonical metric names.
SCALAR_LAYOUT: dict[str, dict[str, list]] = {
    "learning": {
        "reward and accuracy": ["Multiline", ["reward/mean", "val/accuracy"]],
        "reward spread": ["Multiline", ["reward/std"]],
    },
    "responses": {
        "length": ["Multiline", ["response/length_mean", "response/length_max"]],
        "truncated": ["Multiline", ["response/truncated_frac"]],
    },
    "optimisation": {
        "losses": ["Multiline", ["loss/policy", "loss/kl"]],
        "policy": ["Multiline", ["policy/entropy", "policy/clip_frac"]],
        "grad norm": ["Multiline", ["policy/grad_norm"]],
    },
    "gap": {
        "log-prob gap": ["Multiline", ["gap/abs_mean", "gap/k3", "gap/max"]],
        "tokens": ["Multiline", ["gap/outside_5x_frac", "gap/prob_abs_mean", "gap/logp_corr"]],
    },
    "wire and anchor": {
        "bytes": ["Multiline", ["wire/bytes_fwd", "wire/bytes_bwd", "anchor/bytes"]],
        "ratio": ["Multiline", ["wire/ratio", "anchor/sign_agreement"]],
    },
    "time": {
        "seconds": ["Multiline", ["time/sample_s", "time/train_s", "time/anchor_s"]],
        "throughput": ["Multiline", ["throughput/tokens_per_s"]],
        "health": ["Multiline", ["health/state"]],
    },
}


def write_csv_atomically(path: Path, fieldnames: list[str], rows: list[dict[str, str]]) -> None:
    """Replace ``path`` by a CSV of ``rows`` in one atomic rename: a kill at any moment leaves
    either the old file or the new one, never a file cut short."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # every rank of a run may rewrite it
    with tmp.open("w", newline="") as handle:
        out = csv.DictWriter(handle, fieldnames=fieldnames)
        out.writeheader()
        out.writerows(rows)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


class AtomicExperimentWriter(ExperimentWriter):
    """Lightning's CSV writer (appends each step's rows), except that it never deletes an
    existing ``metrics.csv`` (the logger decides what a resumed run keeps) and rewrites the file
    atomically when a new column appears (Lightning truncates it in place first)."""

    def _check_log_dir_exists(self) -> None:
        pass

    def _rewrite_with_new_header(self, fieldnames: list[str]) -> None:
        path = Path(self.metrics_file_path)
        with path.open(newline="") as handle:
            rows = list(csv.DictReader(handle))
        write_csv_atomically(path, fieldnames, rows)


class ResumableCSVLogger(CSVLogger):
    """``CSVLogger`` writing ``<run_dir>/metrics.csv``; on resume keeps only rows with
    ``step < resume_step`` and continues with the same header. Every rewrite of the file is an
    atomic replace, so a kill never loses rows already on disk."""

    def __init__(self, run_dir: str | Path, resume_step: int | None = None) -> None:
        # Flushed every step (a row is tiny), so a killed run keeps every row it logged.
        super().__init__(save_dir=str(run_dir), name="", version="", flush_logs_every_n_steps=1)
        path = Path(run_dir) / "metrics.csv"
        header: list[str] = []
        rows: list[dict[str, str]] = []
        if resume_step is not None and path.is_file():
            with path.open(newline="") as handle:
                reader = csv.DictReader(handle)
                header = list(reader.fieldnames or [])
                rows = [row for row in reader if row.get("step") and int(float(row["step"])) < resume_step]
        if header:
            write_csv_atomically(path, header, rows)
        elif path.is_file():  # a fresh run in a directory of ours that already has one (RUN_DIR_ENV)
            path.unlink()
        writer = self.experiment
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


def build_tensorboard(run_dir: str | Path, resume_step: int | None = None) -> TensorBoardLogger:
    """Events under ``<run_dir>/tb``; ``purge_step`` drops events logged after the checkpoint."""
    kwargs = {"purge_step": resume_step} if resume_step is not None else {}
    logger = TensorBoardLogger(save_dir=str(run_dir), name="tb", version="", default_hp_metric=False, **kwargs)
    logger.experiment.add_custom_scalars(SCALAR_LAYOUT)
    return logger
