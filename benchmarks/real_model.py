"""The SmolLM2 side by side: dense GRPO and the compressed recipes from the same start, seed and steps.

    make smollm2
    python benchmarks/real_model.py run                    # start each run, or continue it where it stopped
    python benchmarks/real_model.py run --parallel 2       # two runs at once (one thread each)
    python benchmarks/real_model.py run --only smollm2-dense --steps 60
    python benchmarks/real_model.py report                 # docs/real-model-table.md and the curves, from the runs so far

Each run is `tclightning run --recipe RECIPE` in its own process under ``--root`` (default
``runs/real-model``), one thread, checkpoints every 5 steps: ``run`` again after an interruption
(a killed session, Ctrl-C) continues every unfinished run from its last checkpoint with
``--resume`` and leaves finished ones alone. The runs are the recipes of :data:`RUNS`, all
overridden to the same ``trainer.steps`` and validated on the same 256 held-out sums (greedy) at
step 0 and every ``trainer.val_every`` steps.

``report`` reads each run's ``metrics.csv``: held-out greedy accuracy at step 0 and at the last
evaluation, the reward over the first and last 10% of steps, the boundary bytes (fast circuit and
anchor, shipped bases included) against what dense sends for the same tokens, and the training
time (sampling + update, summed over steps, so an interrupted run counts only its work). It
writes ``docs/real-model-table.md``, ``docs/img/smollm2_reward.png`` and
``docs/img/smollm2_accuracy.png``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tclightning.grpo.summary import read_metrics

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class SideBySideRun:
    """One run of the side by side: ``recipe`` with its own ``overrides``, logged as ``label``."""

    label: str
    recipe: str
    overrides: tuple[str, ...] = ()


RUNS: tuple[SideBySideRun, ...] = (
    SideBySideRun("smollm2-dense", "smollm2-dense"),
    SideBySideRun("smollm2-fast-only-lowrank", "smollm2-fast-only-lowrank"),
    SideBySideRun("smollm2-robust-5-5", "smollm2-robust-5-5"),
    SideBySideRun("smollm2-shallow", "smollm2-shallow"),
    SideBySideRun("smollm2-shallow+controller", "smollm2-shallow", ("callback_presets=[monitoring,anchor-controller]",)),
)


def latest_run_dir(root: Path, label: str) -> Path | None:
    """The newest run directory of ``label`` under ``root`` that has a metrics.csv."""
    dirs = sorted(d for d in (root / label).glob("*") if (d / "metrics.csv").is_file())
    return dirs[-1] if dirs else None


def steps_done(run_dir: Path) -> int:
    """How many RL steps the run's metrics record (the last training step + 1)."""
    rows = read_metrics(run_dir / "metrics.csv")
    trained = [step for step, row in rows.items() if "reward/mean" in row]
    return max(trained) + 1 if trained else 0


def command(item: SideBySideRun, root: Path, steps: int, val_every: int) -> list[str]:
    """The `tclightning run` command line of ``item``: a fresh run, or a resume of its newest."""
    cmd = [sys.executable, "-m", "tclightning", "run", "--recipe", item.recipe, "--quiet",
           *item.overrides, f"trainer.steps={steps}", f"trainer.val_every={val_every}", "trainer.checkpoint_every=5",
           f"logging.root={root}", f"logging.name={item.label}", "logging.progress=none"]
    previous = latest_run_dir(root, item.label)
    if previous is not None and any((previous / "checkpoints").glob("*.ckpt")):
        cmd[4:4] = ["--resume", str(previous)]
    return cmd


def run_all(items: list[SideBySideRun], root: Path, steps: int, val_every: int, parallel: int) -> int:
    """Run (or continue) every unfinished run, ``parallel`` at a time; each logs to ``<root>/<label>.log``."""
    todo = []
    for item in items:
        previous = latest_run_dir(root, item.label)
        if previous is not None and steps_done(previous) >= steps:
            print(f"{item.label}: done ({previous})", flush=True)
        else:
            todo.append(item)
    root.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    running: list[tuple[SideBySideRun, subprocess.Popen, IO[bytes]]] = []
    failed = 0
    while todo or running:
        while todo and len(running) < parallel:
            item = todo.pop(0)
            cmd = command(item, root, steps, val_every)
            print(f"{item.label}: {' '.join(cmd[1:])}", flush=True)
            log = (root / f"{item.label}.log").open("ab")
            running.append((item, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO), log))
        time.sleep(5)
        for entry in list(running):
            item, proc, log = entry
            if proc.poll() is not None:
                running.remove(entry)
                log.close()
                failed += proc.returncode != 0
                print(f"{item.label}: exit {proc.returncode} (log {root / (item.label + '.log')})", flush=True)
    return 1 if failed else 0


def summarise(run_dir: Path) -> dict[str, float]:
    """The table's numbers for one run directory."""
    rows = read_metrics(run_dir / "metrics.csv")
    trained = [(s, r) for s, r in rows.items() if "reward/mean" in r]
    rewards = [r["reward/mean"] for _, r in trained]
    tenth = max(1, len(rewards) // 10)
    evals = [(s, r["val/accuracy"]) for s, r in rows.items() if "val/accuracy" in r]
    fast = sum(r.get("wire/bytes_fwd", 0.0) + r.get("wire/bytes_bwd", 0.0) for _, r in trained)
    anchor = sum(r.get("anchor/bytes", 0.0) for _, r in trained)
    dense = sum(r.get("wire/dense_bytes_fwd", 0.0) + r.get("wire/dense_bytes_bwd", 0.0) for _, r in trained)
    seconds = sum(r.get("time/sample_s", 0.0) + r.get("time/train_s", 0.0) for _, r in trained)
    return {
        "steps": len(trained),
        "acc_start": evals[0][1] if evals else float("nan"),
        "acc_end": evals[-1][1] if len(evals) > 1 else float("nan"),
        "acc_end_step": evals[-1][0] if len(evals) > 1 else -1,
        "reward_first": sum(rewards[:tenth]) / tenth if rewards else float("nan"),
        "reward_last": sum(rewards[-tenth:]) / tenth if rewards else float("nan"),
        "fast_share": fast / dense if dense else float("nan"),
        "anchor_share": anchor / dense if dense else float("nan"),
        "megabytes": (fast + anchor) / 1e6,
        "train_minutes": seconds / 60.0,
    }


def report(items: list[SideBySideRun], root: Path, out: Path) -> int:
    """Write the table and the two PNGs from the runs under ``root``."""
    found = {item.label: latest_run_dir(root, item.label) for item in items}
    found = {label: d for label, d in found.items() if d is not None}
    if not found:
        print(f"no runs under {root}: `python benchmarks/real_model.py run` first", file=sys.stderr)
        return 1
    stats = {label: summarise(d) for label, d in found.items()}
    dense = stats.get("smollm2-dense")
    dense_gain = dense["acc_end"] - dense["acc_start"] if dense else float("nan")
    lines = ["| run | steps | held-out start | held-out end | gain | gain vs dense | reward first 10% | last 10% | "
             "boundary bytes vs dense (fast + anchor) | MB sent | train min |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    for label, s in stats.items():
        gain = s["acc_end"] - s["acc_start"]
        if s["acc_end_step"] < 0:  # not evaluated again yet: a run still going (or cut off)
            end, gain_cell, share = "--", "--", "--"
        else:
            end, gain_cell = f"{s['acc_end']:.3f} (step {s['acc_end_step']})", f"{gain:+.3f}"
            share = f"{gain / dense_gain:.0%}" if dense and dense_gain > 0 else "n/a"
        lines.append(f"| {label} | {s['steps']} | {s['acc_start']:.3f} | {end} | "
                     f"{gain_cell} | {share} | {s['reward_first']:.3f} | {s['reward_last']:.3f} | "
                     f"{s['fast_share'] + s['anchor_share']:.1%} ({s['fast_share']:.1%} + {s['anchor_share']:.1%}) | "
                     f"{s['megabytes']:.1f} | {s['train_minutes']:.0f} |")
    table = "\n".join(lines)
    print(table)
    (out / "img").mkdir(parents=True, exist_ok=True)
    (out / "real-model-table.md").write_text(table + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window = 5
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, d in found.items():
        rows = read_metrics(d / "metrics.csv")
        curve = [(s, r["reward/mean"]) for s, r in rows.items() if "reward/mean" in r]
        smooth = [sum(v for _, v in curve[max(0, i - window + 1): i + 1]) / len(curve[max(0, i - window + 1): i + 1])
                  for i in range(len(curve))]
        ax.plot([s for s, _ in curve], smooth, label=label)
    ax.set_xlabel("RL step")
    ax.set_ylabel(f"reward/mean ({window}-step moving average)")
    ax.set_title("SmolLM2-135M-Instruct, two-digit sums: training reward")
    ax.legend()
    fig.savefig(out / "img" / "smollm2_reward.png", dpi=120, bbox_inches="tight")

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, d in found.items():
        rows = read_metrics(d / "metrics.csv")
        evals = [(s, r["val/accuracy"]) for s, r in rows.items() if "val/accuracy" in r]
        ax.plot([s for s, _ in evals], [v for _, v in evals], marker="o", label=label)
    ax.set_xlabel("RL step")
    ax.set_ylabel("val/accuracy (256 held-out sums, greedy)")
    ax.set_title("SmolLM2-135M-Instruct, two-digit sums: held-out accuracy")
    ax.legend()
    fig.savefig(out / "img" / "smollm2_accuracy.png", dpi=120, bbox_inches="tight")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("run", "report"))
    parser.add_argument("--only", nargs="*", default=None, help="labels of RUNS to run or report (default: all)")
    parser.add_argument("--root", type=Path, default=REPO / "runs" / "real-model")
    parser.add_argument("--steps", type=int, default=60, help="RL steps of every run (default 60)")
    parser.add_argument("--val-every", type=int, default=20, help="held-out evaluation every N steps (default 20)")
    parser.add_argument("--parallel", type=int, default=1,
                        help="runs at once, one thread each (default 1; each peaks at 7.5-9.5 GiB resident)")
    parser.add_argument("--out", type=Path, default=REPO / "docs")
    args = parser.parse_args(argv)
    labels = {r.label for r in RUNS}
    unknown = sorted(set(args.only or ()) - labels)
    if unknown:
        parser.error(f"--only: unknown {', '.join(unknown)}; one of {', '.join(sorted(labels))}")
    items = [r for r in RUNS if args.only is None or r.label in args.only]
    if args.action == "run":
        return run_all(items, args.root, args.steps, args.val_every, args.parallel)
    return report(items, args.root, args.out)


if __name__ == "__main__":
    sys.exit(main())
