"""Read a run's metrics for offline replay: ``metrics.csv`` (Lightning's CSVLogger or any CSV with a
``step`` column) or TensorBoard event files. Returns ``(step, {name: value})`` rows merged by step.
"""

from __future__ import annotations

import csv
from collections.abc import Mapping
from pathlib import Path

from tclightning.errors import TclightningError
from tclightning.files import regular_file, tree
from tclightning.settings import MAX_STEPS

Row = tuple[int, dict[str, float]]

METRICS_MAX_BYTES = 2**30
"""The largest metrics file read (a million steps of a hundred metrics is about this)."""

#: Columns that are bookkeeping, not metrics.
_SKIP_COLUMNS = {"step", "epoch", "wall_time", "time", "timestamp"}


def read_metrics_csv(path: str | Path, names: Mapping[str, str] | None = None) -> list[Row]:
    """Rows of a CSV with a ``step`` column, merged by step (last non-empty value wins).

    Lightning's CSVLogger writes one row per logging call with only that call's columns filled
    (train rows and validation rows for the same step), so empty cells are skipped and rows with
    the same step are merged. ``names`` maps the file's column names to canonical names
    (``{"train/reward": "reward/mean"}``); unmapped columns keep their names.
    """
    path = regular_file(path, "metrics", METRICS_MAX_BYTES)  # a FIFO named metrics.csv would wait forever
    try:
        return _read_metrics_csv(path, dict(names or {}))
    except UnicodeDecodeError as err:
        raise TclightningError(f"{path}: not a CSV text file (byte 0x{err.object[err.start]:02x} at offset "
                               f"{err.start} is not UTF-8)") from None
    except csv.Error as err:
        raise TclightningError(f"{path}: not a readable CSV file ({err})") from None
    except OSError as err:
        raise TclightningError(f"{path}: cannot read: {err.strerror or err}") from None


def _read_metrics_csv(path: Path, names: dict[str, str]) -> list[Row]:
    merged: dict[int, dict[str, float]] = {}
    # utf-8-sig: a byte-order mark before the header (Excel writes one) is not part of the first name
    with path.open(newline="", encoding="utf-8-sig") as fh:
        reader = csv.DictReader(fh)
        if not reader.fieldnames or "step" not in reader.fieldnames:
            raise TclightningError(f"{path}: no 'step' column (columns: {', '.join(reader.fieldnames or [])})")
        twice = next((name for i, name in enumerate(reader.fieldnames) if name in reader.fieldnames[:i]), None)
        if twice is not None:  # which of the two columns would be the metric?
            raise TclightningError(f"{path}: the column {twice!r} appears twice in its header")
        for line_no, record in enumerate(reader, start=2):
            if None in record:  # more cells than the header names: the columns no longer line up
                raise TclightningError(f"{path}:{line_no}: {len(reader.fieldnames) + len(record[None])} cells where "
                                       f"the header names {len(reader.fieldnames)} columns")
            raw_step = (record.get("step") or "").strip()
            if not raw_step:
                continue
            try:
                number = float(raw_step)
                step = int(number)
            except (ValueError, OverflowError) as err:  # "abc", "inf", "nan"
                raise TclightningError(f"{path}:{line_no}: step {raw_step!r} is not a number") from err
            if step < 0 or step != number or step > MAX_STEPS:
                raise TclightningError(f"{path}:{line_no}: step {raw_step!r} is not a whole number in [0, {MAX_STEPS}]")
            row = merged.setdefault(step, {})
            for column, cell in record.items():
                if column is None or column in _SKIP_COLUMNS or cell is None or not cell.strip():
                    continue
                try:
                    value = float(cell)
                except ValueError:
                    continue
                row[names.get(column, column)] = value
    return [(step, merged[step]) for step in sorted(merged)]


EVENT_PREFIX = "events.out.tfevents."
"""How a TensorBoard event file's name starts."""


def read_tensorboard(path: str | Path, names: Mapping[str, str] | None = None) -> list[Row]:
    """Scalars from every TensorBoard event file under ``path``, merged by step."""
    from tensorboard.backend.event_processing import event_accumulator

    root = Path(path)
    files = sorted(f for f in tree(root) if f.name.startswith(EVENT_PREFIX)) if root.is_dir() else [root]
    if not files:
        raise TclightningError(f"{root}: no TensorBoard event files found")
    names = dict(names or {})
    merged: dict[int, dict[str, float]] = {}
    for file in files:
        regular_file(file, "event file")
        acc = event_accumulator.EventAccumulator(str(file), size_guidance={event_accumulator.SCALARS: 0})
        try:
            acc.Reload()
        except Exception as err:  # noqa: BLE001 - a corrupt event file is the user's input, not a bug
            raise TclightningError(f"{file}: not a readable TensorBoard event file ({type(err).__name__})") from None
        for tag in acc.Tags().get("scalars", []):
            if tag in _SKIP_COLUMNS:
                continue
            for event in acc.Scalars(tag):
                merged.setdefault(int(event.step), {})[names.get(tag, tag)] = float(event.value)
    return [(step, merged[step]) for step in sorted(merged)]


def read_run(path: str | Path, names: Mapping[str, str] | None = None) -> list[Row]:
    """Metrics of a run: ``path`` is a CSV file, an event file, or a run directory.

    In a directory: ``metrics.csv`` at its top, else the newest ``metrics.csv`` below it (Lightning's
    ``lightning_logs/version_N/``), else TensorBoard event files below it.
    """
    p = Path(path)
    if not p.exists():
        raise TclightningError(f"{p}: no such file or directory")
    if not p.is_dir():  # a file (a FIFO or a device is refused by the readers, never opened)
        if p.name.startswith(EVENT_PREFIX):
            return read_tensorboard(p, names)
        return read_metrics_csv(p, names)
    if p.resolve().parts[1:2] in (("proc",), ("sys",)):  # entries vanish while searched, reads may block
        raise TclightningError(f"{p}: is a kernel interface, not a run directory")
    direct = p / "metrics.csv"
    if direct.is_file():
        return read_metrics_csv(direct, names)
    try:
        below = list(tree(p))
        nested = sorted((f for f in below if f.name == "metrics.csv"), key=lambda f: f.stat().st_mtime)
        events = not nested and any(f.name.startswith(EVENT_PREFIX) for f in below)
    except FileNotFoundError as err:  # a folder below went away while it was searched (a run tidying up)
        raise TclightningError(f"{p}: changed while it was searched ({err.filename} went away); run it again, "
                               "or name the metrics.csv") from None
    if nested:
        return read_metrics_csv(nested[-1], names)
    if events:
        return read_tensorboard(p, names)
    raise TclightningError(f"{p}: no metrics.csv or TensorBoard event files in this directory")
