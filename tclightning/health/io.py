"""Read a run's metrics for offline replay: ``metrics.csv`` (Lightning's CSVLogger or any CSV with a
``step`` column) or TensorBoard event files. Returns ``(step, {name: value})`` rows merged by step.
"""

from __future__ import annotations

import csv
import io
import itertools
import os
import re
from collections.abc import Collection, Mapping, Sequence
from typing import IO
from pathlib import Path

from tclightning.errors import TclightningError
from tclightning.files import open_regular, regular_file, tree
from tclightning.settings import MAX_STEPS

Row = tuple[int, dict[str, float]]

METRICS_MAX_BYTES = 2**30
"""The largest metrics file read (a million steps of a hundred metrics is about this)."""

MAX_REPLAY_ROWS = 250_000
"""The most rows ``analyze health`` replays (a long RL run logs tens of thousands; the replay takes
about 0.2 ms a step, so a file at :data:`METRICS_MAX_BYTES` would take hours): counted before the
file is parsed."""

MAX_REPLAY_CELLS = 10_000_000
"""The most cells (rows times header columns) ``analyze health`` parses: 250,000 steps of 40 metrics
(parsing takes about 3 s a million cells)."""

EVENTS_MAX_BYTES = 32 * 2**20
"""The most TensorBoard event bytes read (about 650,000 scalars; TensorBoard's reader takes about
150 s a million): a larger run's ``metrics.csv`` says the same, faster."""

#: Columns that are bookkeeping, not metrics.
_SKIP_COLUMNS = {"step", "epoch", "wall_time", "time", "timestamp"}


def read_metrics_csv(path: str | Path, names: Mapping[str, str] | None = None, *, numbers: Collection[str] = (),
                     max_rows: int | None = None, cut_last_row: bool = False) -> list[Row]:
    """Rows of a CSV with a ``step`` column, merged by step (last non-empty value wins).

    Lightning's CSVLogger writes one row per logging call with only that call's columns filled
    (train rows and validation rows for the same step), so empty cells are skipped and rows with
    the same step are merged. ``names`` maps the file's column names to canonical names
    (``{"train/reward": "reward/mean"}``); unmapped columns keep their names. A cell that is not a
    number is skipped, except in a column whose canonical name is in ``numbers`` (one line naming
    it). A file of more than ``max_rows`` lines is refused before it is parsed. ``cut_last_row``: a
    last row with no line break after it (an append a crash cut short) is left out, unchecked.
    """
    path = regular_file(path, "metrics", METRICS_MAX_BYTES)  # a FIFO named metrics.csv would wait forever
    try:
        with open_regular(path, "metrics", METRICS_MAX_BYTES) as handle:  # both passes read this one file
            if max_rows is not None:
                _require_rows_at_most(path, handle, max_rows)
                handle.seek(0)
            cut = cut_last_row and _ends_without_line_break(handle)
            return _read_metrics_csv(path, handle, dict(names or {}), frozenset(numbers), cut)
    except UnicodeDecodeError as err:
        raise TclightningError(f"{path}: not a CSV text file (byte 0x{err.object[err.start]:02x} at offset "
                               f"{err.start} is not UTF-8)") from None
    except csv.Error as err:
        raise TclightningError(f"{path}: not a readable CSV file ({err})") from None
    except OSError as err:
        raise TclightningError(f"{path}: cannot read: {err.strerror or err}") from None


def cut_short(record: Mapping[str | None, object], header: Sequence[str] | None) -> bool:
    """Whether a last row with no line break after it is one a crash cut short: fewer cells than the
    header names, or cut at its ``step`` when that is the last column (``10`` read as ``1`` cannot be
    told from a whole row). A whole row saved without its line break (an editor's) is no such row."""
    names = list(header or ())
    return not names or record.get(names[-1]) is None or names[-1] == "step"


def _ends_without_line_break(handle: IO[bytes]) -> bool:
    """Whether the open file's last byte is no line break (left at its start)."""
    size = handle.seek(0, os.SEEK_END)
    last = handle.read(1) if size and handle.seek(size - 1) >= 0 else b"\n"
    handle.seek(0)
    return last not in (b"\n", b"\r")


def _require_rows_at_most(path: Path, fh: IO[bytes], max_rows: int) -> None:
    lines, columns, header_commas, in_header = 0, None, 0, False
    for chunk in iter(lambda: fh.read(1 << 20), b""):
        # a row ends at \n, \r\n or a bare \r, as the csv reader reads them (a \r\n cut by the
        # chunk counts twice: an upper bound)
        breaks = chunk.count(b"\n") + chunk.count(b"\r") - chunk.count(b"\r\n")
        if columns is None:  # the header's width, over as many chunks as it spans (a quoted comma may
            # count twice: an upper bound); the header is the first line that is not blank
            part = chunk if in_header else chunk.removeprefix(b"\xef\xbb\xbf").lstrip(b" \t\r\n")
            in_header = in_header or bool(part)
            head, *rest = re.split(rb"[\r\n]", part, maxsplit=1)
            header_commas += head.count(b",")
            columns = header_commas + 1 if rest else None
        lines += breaks
        if lines > max_rows + 1:  # the header is not a row
            raise TclightningError(f"{path}: more than {max_rows} rows, more than a replay takes (about 0.2 ms "
                                   "a step); give it the rows of the steps you want to look at")
        if columns is not None and columns * lines > MAX_REPLAY_CELLS:
            raise TclightningError(f"{path}: {columns} columns of more than {lines - 1} rows, more than the "
                                   f"{MAX_REPLAY_CELLS:,} cells a replay parses; give it the columns (and rows) "
                                   "you want to look at")


def metrics_rows(handle: IO[str]) -> csv.DictReader:
    """The rows of a metrics CSV open as text, by the names of its header: its first line that is
    not blank, without a byte-order mark (the csv module took a blank first line for a header of no
    names, so every row was read as nameless cells, and a resume kept none of them)."""
    lines = iter(handle)
    for number, line in enumerate(lines):
        line = line.removeprefix("\ufeff") if number == 0 else line  # a byte-order mark (Excel's), read as UTF-8
        if line.strip():
            return csv.DictReader(itertools.chain([line], lines))
    return csv.DictReader(iter(()))


def _read_metrics_csv(path: Path, handle: IO[bytes], names: dict[str, str], numbers: frozenset[str],
                      cut: bool = False) -> list[Row]:
    merged: dict[int, dict[str, float]] = {}
    # utf-8-sig: a byte-order mark before the header (Excel writes one) is not part of the first name
    with io.TextIOWrapper(handle, newline="", encoding="utf-8-sig") as fh:
        reader = metrics_rows(fh)
        if not reader.fieldnames or "step" not in reader.fieldnames:
            raise TclightningError(f"{path}: no 'step' column (columns: {', '.join(reader.fieldnames or [])})")
        header = reader.fieldnames
        seen: set[str] = set()
        twice = None
        for name in header:
            if name in seen:
                twice = name
                break
            seen.add(name)
        if twice is not None:  # which of the two columns would be the metric?
            raise TclightningError(f"{path}: the column {twice!r} appears twice in its header")
        records = enumerate(reader, start=2)
        ahead = next(records, None)
        while ahead is not None:
            (line_no, record), ahead = ahead, next(records, None)
            if cut and ahead is None and cut_short(record, header):  # the row a crash cut short: left out
                break
            if None in record:  # more cells than the header names: the columns no longer line up
                raise TclightningError(f"{path}:{line_no}: {len(header) + len(record[None])} cells where "
                                       f"the header names {len(header)} columns")
            if record[header[-1]] is None:  # fewer cells: which column each one belongs to is a guess
                cells = sum(value is not None for value in record.values())
                raise TclightningError(f"{path}:{line_no}: {cells} cells where the header names {len(header)} "
                                       "columns")
            raw_step = (record.get("step") or "").strip()
            if not raw_step:
                continue
            try:
                number = _number(raw_step)
                step = int(number)
            except (ValueError, OverflowError) as err:  # "abc", "inf", "nan"
                raise TclightningError(f"{path}:{line_no}: step {raw_step!r} is not a number") from err
            if step < 0 or step != number or step > MAX_STEPS:
                raise TclightningError(f"{path}:{line_no}: step {raw_step!r} is not a whole number in [0, {MAX_STEPS}]")
            row = merged.setdefault(step, {})
            for column, cell in record.items():
                if column is None or column in _SKIP_COLUMNS or cell is None or not cell.strip():
                    continue
                name = names.get(column, column)
                try:
                    value = _number(cell)
                except ValueError:
                    if name in numbers:  # a metric a rule reads: dropping it would leave a verdict without it
                        raise TclightningError(f"{path}:{line_no}: {column} {cell.strip()[:40]!r} is not a number") from None
                    continue
                row[name] = value
    return [(step, merged[step]) for step in sorted(merged)]


_NUMERAL = re.compile(r"\s*[+-]?(?:(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?|inf|infinity|nan)\s*", re.ASCII | re.IGNORECASE)


def _number(cell: str) -> float:
    """A cell as a float, written as a CSV writer writes one; ``float()`` also reads other scripts'
    digits ("\uff11" is 1) and underscores ("1_0" is 10), which no metrics file holds."""
    if not _NUMERAL.fullmatch(cell):
        raise ValueError(cell)
    return float(cell)


EVENT_PREFIX = "events.out.tfevents."
"""How a TensorBoard event file's name starts."""


def _require_intact(file: Path) -> None:
    """Refuse an event file with a damaged record: TensorBoard's reader stops at it without a word,
    and the replay would judge the steps before it alone. A last record cut short is one still being
    written (a live run), and the steps before it are read."""
    from tensorboard.compat.tensorflow_stub import errors, pywrap_tensorflow

    reader = pywrap_tensorflow.PyRecordReader_New(str(file).encode(), 0, b"", None)
    records = 0
    try:
        while True:
            reader.GetNext()
            records += 1
    except errors.OutOfRangeError:
        return
    except errors.DataLossError as err:
        if "truncated record" in str(err):
            return
        why = "a checksum does not match"
    except (MemoryError, OverflowError):  # a length field whose checksum holds, of exabytes
        why = "a record claims more bytes than can be read"
    raise TclightningError(f"{file}: damaged after its first {records} records ({why}): the steps after them cannot "
                           "be read; give analyze health the run's metrics.csv")


def read_tensorboard(path: str | Path, names: Mapping[str, str] | None = None) -> list[Row]:
    """Scalars from every TensorBoard event file under ``path``, merged by step."""
    from tensorboard.backend.event_processing import event_accumulator

    root = Path(path)
    files = sorted(f for f in tree(root) if f.name.startswith(EVENT_PREFIX)) if root.is_dir() else [root]
    if not files:
        raise TclightningError(f"{root}: no TensorBoard event files found")
    total = sum(regular_file(file, "event file").stat().st_size for file in files)
    if total > EVENTS_MAX_BYTES:
        raise TclightningError(f"{root}: {total / 2**20:.0f} MiB of TensorBoard events, more than the "
                               f"{EVENTS_MAX_BYTES // 2**20} MiB read here (TensorBoard's reader takes minutes a "
                               "million scalars); give analyze health the run's metrics.csv")
    names = dict(names or {})
    merged: dict[int, dict[str, float]] = {}
    for file in files:
        _require_intact(file)
        acc = event_accumulator.EventAccumulator(str(file), size_guidance={event_accumulator.SCALARS: 0})
        try:
            acc.Reload()
        except Exception as err:  # noqa: BLE001 - a corrupt event file is the user's input, not a bug
            raise TclightningError(f"{file}: not a readable TensorBoard event file ({type(err).__name__})") from None
        for tag in acc.Tags().get("scalars", []):
            if tag in _SKIP_COLUMNS:
                continue
            for event in acc.Scalars(tag):
                if not 0 <= event.step <= MAX_STEPS:  # as a metrics.csv's: a replay over 2^62 steps never ends
                    raise TclightningError(f"{file}: {tag} at step {event.step}, not a whole number in "
                                           f"[0, {MAX_STEPS}]")
                merged.setdefault(int(event.step), {})[names.get(tag, tag)] = float(event.value)
    return [(step, merged[step]) for step in sorted(merged)]


def read_run(path: str | Path, names: Mapping[str, str] | None = None, *, numbers: Collection[str] = (),
             max_rows: int | None = MAX_REPLAY_ROWS) -> list[Row]:
    """Metrics of a run: ``path`` is a CSV file, an event file, or a run directory.

    In a directory: ``metrics.csv`` at its top, else the newest ``metrics.csv`` below it (Lightning's
    ``lightning_logs/version_N/``), else TensorBoard event files below it. ``numbers`` and
    ``max_rows``: as :func:`read_metrics_csv` takes them.
    """
    def read_csv(csv_path: Path) -> list[Row]:
        return read_metrics_csv(csv_path, names, numbers=numbers, max_rows=max_rows)

    p = Path(path)
    if not p.exists():
        raise TclightningError(f"{p}: no such file or directory")
    if not p.is_dir():  # a file (a FIFO or a device is refused by the readers, never opened)
        if p.name.startswith(EVENT_PREFIX):
            return read_tensorboard(p, names)
        return read_csv(p)
    if p.resolve().parts[1:2] in (("proc",), ("sys",)):  # entries vanish while searched, reads may block
        raise TclightningError(f"{p}: is a kernel interface, not a run directory")
    direct = p / "metrics.csv"
    if direct.is_file():
        return read_csv(direct)
    if direct.is_symlink() and not direct.exists():  # to nowhere, or to itself (a loop)
        raise TclightningError(f"{direct}: is a link that leads to no file")
    try:
        below = list(tree(p))
        nested = sorted((f for f in below if f.name == "metrics.csv"), key=lambda f: f.lstat().st_mtime)
        events = not nested and any(f.name.startswith(EVENT_PREFIX) for f in below)
    except FileNotFoundError as err:  # a folder below went away while it was searched (a run tidying up)
        raise TclightningError(f"{p}: changed while it was searched ({err.filename} went away); run it again, "
                               "or name the metrics.csv") from None
    except OSError as err:
        raise TclightningError(f"{p}: cannot be searched ({err.filename}: {err.strerror})") from None
    if nested:
        if nested[-1].is_symlink() and not nested[-1].exists():  # the newest: never an older one in its place
            raise TclightningError(f"{nested[-1]}: is a link that leads to no file (the newest metrics.csv here)")
        return read_csv(nested[-1])
    if events:
        return read_tensorboard(p, names)
    raise TclightningError(f"{p}: no metrics.csv or TensorBoard event files in this directory")
