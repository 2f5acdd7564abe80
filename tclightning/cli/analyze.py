"""`tclightning analyze ...`: offline analysis tools. ``analyze health PATH`` replays a run's metrics
through the health detector and prints the verdict timeline (``--json`` for machines).
``analyze trajectory RUN_DIR`` runs the rank-1 analysis of the run's saved weight trajectory
(docs/trajectory.md) and writes JSON, markdown and a PNG."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tclightning.errors import TclightningError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("analyze", help="offline analysis of runs")
    tools = parser.add_subparsers(dest="analyze_command", metavar="TOOL")
    health = tools.add_parser(
        "health",
        help="replay a run's metrics through the collapse detector",
        description=(
            "Replay a run's metrics through the health detector (the rules of the CollapseDetector callback) "
            "and print when it warned and when it saw a collapse. PATH is a run directory (its metrics.csv, "
            "else TensorBoard event files under it), a metrics.csv, any CSV with a 'step' column and canonical "
            "metric names, or an event file."
        ),
    )
    health.add_argument("path", metavar="PATH", help="run directory, CSV file or TensorBoard event file")
    health.add_argument("--json", action="store_true",
                        help='print {"first_warning_step": ..., "first_collapse_step": ..., "events": [...]}')
    health.add_argument("--name", action="append", default=[], metavar="CANONICAL=YOURS",
                        help="read the canonical metric CANONICAL from your column YOURS (repeatable), "
                             "e.g. --name reward/mean=train/reward")
    health.add_argument("--names", metavar="PRESET", default=None,
                        help="read another trainer's metric names: trl or verl (docs/metrics.md has the tables); "
                             "--name entries override it")
    health.add_argument("--all-events", action="store_true", help="also list 'cleared' and 'recovered' events")
    health.set_defaults(func=run_health)

    trajectory = tools.add_parser(
        "trajectory",
        help="rank-1 analysis of a run's saved weight trajectory",
        description=(
            "Rank-1 analysis of the weight trajectory a run saved with the TrajectoryRecorder callback "
            "(RUN_DIR/trajectory/point-*.pt): EVR1, share of the move off the top line, |cos| of early vs late "
            "top directions, per-step update alignment and forward linear projectability (op ratio). Writes "
            "trajectory.json, trajectory.md and trajectory.png to --out (default RUN_DIR/analysis) and prints "
            "the markdown table (the JSON with --json). See docs/trajectory.md."
        ),
    )
    trajectory.add_argument("run_dir", metavar="RUN_DIR", help="run directory (or a folder of point-*.pt files)")
    trajectory.add_argument("--json", action="store_true", help="print the JSON report instead of the table")
    trajectory.add_argument("--out", metavar="DIR", default=None, help="output folder (default RUN_DIR/analysis)")
    trajectory.add_argument("--overwrite", action="store_true", help="replace the files of an earlier analysis in --out")
    trajectory.set_defaults(func=run_trajectory)


def run_trajectory(args: argparse.Namespace) -> int:
    """Handler of ``analyze trajectory``: writes the three outputs, prints the table or JSON."""
    from tclightning.cli.options import output_claimed, output_folder
    from tclightning.probes.trajectory import to_markdown, write_report

    out = Path(args.out) if args.out is not None else Path(args.run_dir) / "analysis"
    writes = ("trajectory.json", "trajectory.md", "trajectory.png")
    out = output_folder("analyze trajectory", out, writes, named=args.out is not None, overwrite=args.overwrite)
    with output_claimed("analyze trajectory", out, writes, named=args.out is not None, overwrite=args.overwrite):
        report, paths = write_report(args.run_dir, out)
    if args.json:
        print(json.dumps(report, allow_nan=False))
        return 0
    print(to_markdown(report), end="")
    print(f"wrote {paths['json']}, {paths['markdown']}, {paths['png']}")
    return 0


def _names(pairs: list[str]) -> dict[str, str]:
    """``--name canonical=yours`` -> ``{yours: canonical}`` (the readers' column -> canonical map)."""
    out: dict[str, str] = {}
    for pair in pairs:
        canonical, sep, yours = pair.partition("=")
        if not sep or not canonical or not yours:
            raise TclightningError(f"--name expects CANONICAL=YOURS, got {pair!r}")
        # two mappings of one name: one of them would be dropped, and which one is a guess
        if out.get(yours, canonical) != canonical:
            raise TclightningError(f"--name {pair}: {yours!r} is already read as {out[yours]!r}")
        if (other := next((y for y, c in out.items() if c == canonical and y != yours), None)) is not None:
            raise TclightningError(f"--name {pair}: {canonical!r} is already read from {other!r}")
        out[yours] = canonical
    return out


def run_health(args: argparse.Namespace) -> int:
    """Handler of ``analyze health``: 0 when the replay ran (whatever its verdict)."""
    from tclightning.health.detector import HealthDetector, replay
    from tclightning.health.io import read_run

    from tclightning.health.names import reader_names

    names = {**reader_names(getattr(args, "names", None), "--names"), **_names(args.name)}
    detector = HealthDetector()
    rows = read_run(args.path, names, numbers=detector.metrics_read())
    if not rows:
        raise TclightningError(f"{args.path}: no metric rows")
    if args.name:  # each YOURS among the file's own names: its canonical column may be there too
        _require_names_read(args.path, read_run(args.path, numbers=()), detector, _names(args.name))
    _require_read_metrics(args.path, rows, detector, {c: y for y, c in names.items()})
    result = replay(rows, detector)
    if args.json:
        print(json.dumps(result.summary(), allow_nan=False, default=str))
        return 0
    _print_timeline(args.path, rows, result, args.all_events, {c: y for y, c in names.items()})
    return 0


def _require_names_read(path: str, rows: list, detector, yours_to_canonical: dict[str, str]) -> None:
    """Refuse a ``--name CANONICAL=YOURS`` that maps nothing: a CANONICAL no rule reads (a typo would
    leave that rule without data, and the replay "healthy"), or a YOURS the file does not have
    (``rows`` read under the file's own names: a typo replayed its canonical column instead)."""
    reads = detector.metrics_read()
    logged = {name for _, metrics in rows for name in metrics}  # the file's own names
    for yours, canonical in yours_to_canonical.items():
        if canonical not in reads:
            raise TclightningError(f"--name {canonical}={yours}: no health rule reads {canonical!r} (they read "
                                   f"{', '.join(sorted(reads))})")
        if yours not in logged:
            raise TclightningError(f"--name {canonical}={yours}: {path} has no metric {yours!r} with a value")


def _require_read_metrics(path: str, rows: list, detector, shown: dict[str, str]) -> None:
    """Refuse a file none of whose metrics a rule reads: its replay would say "healthy" for want of
    data. ``shown``: canonical -> the column name the file has, for the message."""
    from tclightning.health.names import matching_preset

    reads = detector.metrics_read()
    logged = sorted({name for _, metrics in rows for name in metrics})
    if reads.intersection(logged):
        return
    has = [shown.get(name, name) for name in logged]
    what = (f"it has {', '.join(has[:8])}" + (f" and {len(has) - 8} more" if len(has) > 8 else "")
            if has else "it has no metric values, only step")
    preset = matching_preset(has)
    hint = (f"these look like {preset} names: add --names {preset}" if preset is not None else
            "map yours with --name CANONICAL=YOURS; the rules read reward/mean, response/length_mean, "
            "gap/abs_mean and the others in docs/metrics.md")
    raise TclightningError(f"{path}: no metric columns the health rules read ({what}; {hint})")


def _print_timeline(path: str, rows: list, result, all_events: bool, shown: dict[str, str] | None = None) -> None:
    """``shown``: canonical -> the column name the file has, for the messages."""
    from rich.console import Console
    from rich.markup import escape

    from tclightning.health.names import to_user_names

    console = Console(file=sys.stdout, highlight=False, soft_wrap=True)
    steps = [step for step, _ in rows]
    names = sorted({name for _, metrics in rows for name in metrics})
    console.print(f"[bold]{escape(str(path))}[/bold]: {len(rows)} steps ({steps[0]}..{steps[-1]}), {len(names)} metrics")
    colour = {"healthy": "green", "info": "cyan", "warning": "yellow", "collapsing": "red"}
    width = max((len(e.rule) for e in result.events), default=8)
    for event in result.events:
        if not all_events and event.kind in ("cleared", "recovered"):
            continue
        sev = event.severity
        console.print(
            f"  step {event.step:>6}  [{colour.get(sev, 'white')}]{sev:<10}[/] {event.kind:<9} "
            f"{event.rule:<{width}}  {escape(to_user_names(event.message, shown or {}))}"
        )
    final = result.verdicts[-1].state.label
    fw, fc = result.first_warning_step, result.first_collapse_step
    console.print(
        f"first warning: {_first(result.events, fw, ('warning', 'collapsing'))}; "
        f"first collapse: {_first(result.events, fc, ('collapsing',))}; "
        f"state at the last step: [{colour[final]}]{final}[/]"
    )


def _first(events: tuple, step: int | None, severities: tuple[str, ...]) -> str:
    """``step N (rule, ...)``: the rules that fired or escalated to ``severities`` at ``step``."""
    if step is None:
        return "none"
    rules = dict.fromkeys(e.rule for e in events
                          if e.step == step and e.kind in ("fired", "escalated") and e.severity in severities)
    return f"step {step} ({', '.join(rules)})" if rules else f"step {step}"
