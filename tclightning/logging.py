"""Run loggers: TensorBoard (with a custom-scalars layout) and ``metrics.csv``, both resumable.

On resume from RL step ``S``, rows and events at steps ``>= S`` (written after the checkpoint,
before the kill) are dropped, so the continued run leaves no duplicated or missing step.
"""

from __future__ import annotations

import csv
import warnings
from pathlib import Path

from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

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


class ResumableCSVLogger(CSVLogger):
    """``CSVLogger`` writing ``<run_dir>/metrics.csv``; on resume keeps only rows with
    ``step < resume_step`` and continues with the same header."""

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
        # Lightning's writer deletes an existing metrics.csv when it is created (and warns that
        # it will, since the run directory already holds recipe.yaml); write the kept rows back.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Experiment logs directory")
            writer = self.experiment
        if header:
            with path.open("w", newline="") as handle:
                out = csv.DictWriter(handle, fieldnames=header)
                out.writeheader()
                out.writerows(rows)
            writer.metrics_keys = sorted(header)


def build_tensorboard(run_dir: str | Path, resume_step: int | None = None) -> TensorBoardLogger:
    """Events under ``<run_dir>/tb``; ``purge_step`` drops events logged after the checkpoint."""
    kwargs = {"purge_step": resume_step} if resume_step is not None else {}
    logger = TensorBoardLogger(save_dir=str(run_dir), name="tb", version="", default_hp_metric=False, **kwargs)
    logger.experiment.add_custom_scalars(SCALAR_LAYOUT)
    return logger
