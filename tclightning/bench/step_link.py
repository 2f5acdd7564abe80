"""Whole RL steps over a slow link: sampling, the update, the weight sync and every exchange.

``bench link`` times the pipelined forward/backward alone. This benchmark times what a user's step
costs: ``tclightning run`` itself, one pipeline stage per node, each node in its own network
namespace on a switch whose ports are shaped to R Mbit/s (:func:`tclightning.bench.nodes.run_nodes`),
so every byte between stages (boundary, weight sync to the sampler on the first node, the tied
embedding, the rollouts, the anchor) crosses an R Mbit/s link. Each (stages, config) pair also runs
once unshaped (the same switch, no shaper): the step without the link.

Configurations (the names of :data:`tclightning.bench.traffic.CONFIGS`):

* ``dense`` -- the dense recipe;
* ``compressed`` -- the compressed recipe (its layout and codec), dense weight sync and tied exchange;
* ``compressed+sparse-sync`` -- the same with ``sampler.dtype=bfloat16`` (the exact sparse sync) and
  ``pipeline.tied_rows=true`` (only the batch's token rows of a tied embedding cross).

Per row: the median over the timed steps (every step but the first, which carries the first full
weight sync and a codec's first fit) of the step's wall time on the sampling rank
(``time/sample_s + time/train_s``), the same unshaped, the link's share of the step
(``1 - unshaped / shaped``: the time spent waiting on the link), the bytes per class from the
run's own ``wire/*`` counters, and dense ÷ this configuration's step time at the same bandwidth.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

CONFIGS = ("dense", "compressed", "compressed+sparse-sync")
SPARSE = ("sampler.dtype=bfloat16", "pipeline.tied_rows=true")
"""What ``compressed+sparse-sync`` adds to the compressed recipe."""
CLASSES = {
    "boundary": ("wire/bytes_fwd", "wire/bytes_bwd"),
    "weight_sync": ("wire/sync_bytes",),
    "tied_embedding": ("wire/tied_bytes",),
    "rollouts": ("wire/rollout_bytes",),
    "anchor": ("anchor/bytes",),
}
"""Traffic classes as :mod:`tclightning.bench.traffic` names them, from the run's metrics."""
RUN_SETTINGS = ("trainer.val_every=0", "trainer.checkpoint_every=0", "logging.progress=none", "trainer.num_threads=1",
                "trainer.accelerator=cpu")


def config_args(config: str, dense_recipe: str, compressed_recipe: str, stages: int, steps: int,
                overrides: Sequence[str]) -> list[str]:
    """The ``tclightning run`` arguments of one configuration at ``stages`` stages."""
    recipe = dense_recipe if config == "dense" else compressed_recipe
    extra = list(SPARSE) if config == "compressed+sparse-sync" else []
    return ["--recipe", recipe, "--quiet", *RUN_SETTINGS, "trainer.strategy=pipeline", f"pipeline.stages={stages}",
            f"trainer.steps={steps}", *extra, *overrides]


def summarise(metrics: dict[int, dict[str, float]]) -> dict[str, Any]:
    """Median step time and mean bytes per class over every logged step but the first."""
    timed = [values for step, values in sorted(metrics.items()) if step > 0 and "time/train_s" in values]
    if not timed:
        raise RuntimeError("the run logged no step after its first: raise --steps")
    out: dict[str, Any] = {
        "step_s": statistics.median(v["time/sample_s"] + v["time/train_s"] for v in timed),
        "timed_steps": len(timed),
    }
    for name, keys in CLASSES.items():
        out[f"{name}_bytes"] = statistics.fmean(sum(v.get(k, 0.0) for k in keys) for v in timed)
    out["total_bytes"] = statistics.fmean(v.get("wire/total_bytes", 0.0) for v in timed)
    return out


def check_options(*, stages: Sequence[int], bandwidths: Sequence[float], configs: Sequence[str], steps: int) -> None:
    """Refuse, before any process starts, options the benchmark cannot measure (``TclightningError``)."""
    from tclightning.bench.link import link_rate_problem
    from tclightning.errors import TclightningError

    rate = link_rate_problem(bandwidths)
    problems = [
        (not stages or any(s < 2 for s in stages),
         f"--stages: every layout needs at least 2 stages, got {list(stages)}"),
        (rate is not None, rate or ""),
        (not configs or any(c not in CONFIGS for c in configs),
         f"--configs: expected some of {', '.join(CONFIGS)}, got {list(configs)}"),
        (steps < 2, f"--steps: the first step is not timed, so at least 2, got {steps}"),
    ]
    for failed, message in problems:
        if failed:
            raise TclightningError(f"bench step-link {message}")


def run_step_link_bench(
    *,
    dense_recipe: str,
    compressed_recipe: str,
    stages: Sequence[int] = (2, 4),
    bandwidths: Sequence[float] = (50.0, 200.0, 1000.0),
    configs: Sequence[str] = CONFIGS,
    steps: int = 3,
    overrides: Sequence[str] = (),
    workdir: Path | None = None,
    timeout_s: float = 3600.0,
    env: dict[str, str] | None = None,
    echo: Callable[[str], Any] = print,
) -> dict[str, Any]:
    """Run every (stages, config) unshaped and at every bandwidth; the rows of the table.

    Each run is a fresh ``tclightning run`` in ``workdir`` (a temporary folder by default); a run
    that fails raises ``TclightningError`` naming its nodes' logs."""
    from tclightning.bench.link import netns_problem

    check_options(stages=stages, bandwidths=bandwidths, configs=configs, steps=steps)
    problem = netns_problem()
    if problem is not None:
        raise RuntimeError(f"bench step-link needs tc-shaped network namespaces: {problem}")
    root = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="tcl-step-link-"))
    try:
        rows, load = _measure(root, dense_recipe, compressed_recipe, stages, bandwidths, configs, steps, overrides,
                              timeout_s, env, echo)
    except KeyboardInterrupt:  # a Ctrl-C or SIGTERM: nothing measured is kept, nor the folder made for it
        if workdir is None:
            shutil.rmtree(root, ignore_errors=True)
        raise
    return {"dense_recipe": dense_recipe, "compressed_recipe": compressed_recipe, "steps": steps,
            "overrides": list(overrides), "rows": rows, "load_average": load, "workdir": str(root)}


def _measure(root: Path, dense_recipe: str, compressed_recipe: str, stages: Sequence[int], bandwidths: Sequence[float],
             configs: Sequence[str], steps: int, overrides: Sequence[str], timeout_s: float,
             env: dict[str, str] | None, echo: Callable[[str], Any]) -> tuple[list[dict[str, Any]], list[float]]:
    from tclightning.bench.nodes import run_nodes
    from tclightning.errors import TclightningError
    from tclightning.grpo.summary import read_metrics

    load = [os.getloadavg()[0]]
    rows = []
    for count in stages:
        for config in configs:
            args = config_args(config, dense_recipe, compressed_recipe, count, steps, overrides)
            unshaped = None
            for mbit in (None, *bandwidths):
                label = f"{count}-stages-{config}-{'unshaped' if mbit is None else f'{mbit:g}mbit'}"
                where = root / label
                where.mkdir(parents=True, exist_ok=True)
                echo(f"{label}: tclightning run {' '.join(args)}")
                result = run_nodes(args, nodes=count, mbit=mbit, run_dir=where / "run", cwd=where,
                                   timeout_s=timeout_s, env=env, echo=lambda line: None)
                if result["returncodes"] != [0] * count:
                    raise TclightningError(f"bench step-link: the {label} run failed (exit codes "
                                           f"{result['returncodes']}); its nodes' output is in {where}/node*.log")
                row = {"stages": count, "config": config, "mbit": mbit, **summarise(read_metrics(where / "run" /
                                                                                               "metrics.csv"))}
                row["link_tx_bytes"] = sum(result["link"]["tx_bytes"])
                if mbit is None:
                    unshaped = row["step_s"]
                row["unshaped_s"] = unshaped
                row["link_share"] = 1.0 - unshaped / row["step_s"] if mbit is not None else 0.0
                rows.append(row)
    for row in rows:  # dense / this at the same stages and bandwidth
        dense = next((r["step_s"] for r in rows if r["config"] == "dense" and r["stages"] == row["stages"]
                      and r["mbit"] == row["mbit"]), None)
        row["dense_over_this"] = dense / row["step_s"] if dense else None
    load.append(os.getloadavg()[0])
    return rows, load


def format_table(result: dict[str, Any]) -> str:
    """Markdown table of :func:`run_step_link_bench`'s result."""
    lines = [
        (f"whole RL steps, one stage per node; dense = {result['dense_recipe']}, compressed = "
         f"{result['compressed_recipe']}, overrides {' '.join(result['overrides']) or '(none)'}; median of steps "
         f"1..{result['steps'] - 1}; 1-min load average {result['load_average'][0]:.1f} at the start, "
         f"{result['load_average'][-1]:.1f} at the end"),
        "",
        "| stages | config | Mbit/s | step (s) | unshaped (s) | waiting on the link | boundary MB | sync MB | tied MB "
        "| rollouts MB | anchor MB | total MB | dense / this |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        ratio = f"{r['dense_over_this']:.2f}x" if r["dense_over_this"] else "-"
        mbit = "unshaped" if r["mbit"] is None else f"{r['mbit']:g}"
        lines.append(
            f"| {r['stages']} | {r['config']} | {mbit} | {r['step_s']:.2f} | {r['unshaped_s']:.2f} | "
            f"{r['link_share']:.0%} | " + " | ".join(f"{r[f'{c}_bytes'] / 1e6:.2f}" for c in CLASSES)
            + f" | {r['total_bytes'] / 1e6:.2f} | {ratio} |"
        )
    return "\n".join(lines)
