"""Side by side with TRL's ``GRPOTrainer`` on one CPU machine, then what compression costs.

    python benchmarks/vs_trl.py                        # or: make bench-peers (installs trl first)
    python benchmarks/vs_trl.py --steps 60 --reps 1 --systems trl dense

The `tiny` recipe's supervised warm-up (500 steps by default) runs once and is saved as a
Hugging Face directory (`two_circuits.warm_start`: the warm-started model and its character
tokenizer); every run starts from it. Systems:

* ``trl``: ``trl.GRPOTrainer`` with HF ``generate`` on the CPU, configured from the `dense`
  recipe: the same prompts (rendered by the same formatter), reward (``task.rewards``), group
  size, prompts per step (TRL's batch = P x G completions, one generation batch per step, one
  optimizer tick), completion length, sampling temperature, clip range (0.2 / 0.28), loss
  aggregation (``dapo`` = token mean over the batch), group-std advantages, no KL, gradient
  clipping, and the very same AdamW + linear warm-up schedule (passed in as ``optimizers``).
* ``dense`` and ``shallow-compressed``: tclightning's recipes through the normal ``run`` path
  (pipeline Strategy, four stages; the second compresses its shallowest cut with the 5 % PRF
  codec and runs the dense anchor at 5/5).

Each run is its own subprocess (so peak RSS is per run and no run warms another's caches), and
the runs alternate (trl, dense, shallow, trl, dense, shallow, ...) so load on a shared machine
hits every system alike. Per step the wall time is the interval between consecutive step ends
(everything the training loop does: sampling, reward, update, logging, callbacks); the first
``--skip`` steps are dropped. Writes ``docs/img/vs_trl_reward.png`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SYSTEMS = ["trl", "dense", "shallow-compressed"]
BASE_RECIPE = "dense"  # the hyperparameters both trainers use


def rss_mb() -> float:
    """Current resident set size of this process, MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def peak_rss_mb() -> float:
    """Peak resident set size of this process image, MiB. VmHWM, not ``ru_maxrss``: Linux carries
    ``ru_maxrss`` across ``execve``, so a worker would inherit the driver's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def intervals(ends: list[float], start: float) -> list[float]:
    """Per-step wall times from the step-end timestamps (the first from the loop's start)."""
    return [b - a for a, b in zip([start, *ends[:-1]], ends)]


# ----------------------------------------------------------------------------- workers
def run_tclightning(recipe: str, model_dir: str, steps: int, seed: int, threads: int) -> dict[str, Any]:
    import lightning as L

    from two_circuits import from_warm_start  # this script's folder: sys.path[0]

    from tclightning.grpo.summary import read_metrics
    from tclightning.run import run

    class StepClock(L.Callback):
        def __init__(self) -> None:
            self.start, self.ends, self.rss_start = 0.0, [], 0.0

        def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
            self.rss_start, self.start = rss_mb(), time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            self.ends.append(time.perf_counter())

    clock = StepClock()
    with tempfile.TemporaryDirectory() as tmp:
        summary = run(recipe, from_warm_start(model_dir, steps, seed, tmp, f"trainer.num_threads={threads}"),
                      quiet=True, extra_callbacks=[clock])
        rows = [r for _, r in sorted(read_metrics(Path(summary["run_dir"]) / "metrics.csv").items())]
    # Completion tokens of a step = throughput x (sample + train) seconds, as the module logged it.
    tokens = [r["throughput/tokens_per_s"] * (r["time/sample_s"] + r["time/train_s"]) for r in rows]
    return {"step_s": intervals(clock.ends, clock.start), "tokens": tokens,
            "reward": [r["reward/mean"] for r in rows], "sample_s": [r["time/sample_s"] for r in rows],
            "anchor_s": [r.get("time/anchor_s", 0.0) for r in rows],
            "train_s": [r["time/train_s"] - r.get("time/anchor_s", 0.0) for r in rows],
            "rss_start_mb": clock.rss_start, "peak_rss_mb": peak_rss_mb()}


def run_trl(model_dir: str, steps: int, seed: int, threads: int) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tclightning.recipes.loader import load_recipe, to_dataclass
    from tclightning.sampling.base import PromptFormatter
    from tclightning.tasks import build_task

    recipe = to_dataclass(load_recipe(BASE_RECIPE, [f"trainer.seed={seed}"]))
    g, s = recipe.grpo, recipe.sampler
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    task = build_task(recipe.task)
    examples = list(task.train_examples())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    formatter = PromptFormatter(tokenizer, task.system_prompt, recipe.model.chat_template)
    # Prompts pre-rendered exactly as tclightning's sampler renders them (same token ids).
    data = Dataset.from_list([{"prompt": formatter.render(e.prompt), "index": i} for i, e in enumerate(examples)])

    def reward(prompts: list[str], completions: list[str], index: list[int], **_: Any) -> list[float]:
        return task.rewards(completions, [examples[i] for i in index])

    optimizer = torch.optim.AdamW(model.parameters(), lr=g.lr, betas=tuple(g.betas), weight_decay=g.weight_decay)
    warmup = max(g.warmup_steps, 0)  # tclightning's schedule, not HF's (which starts at lr 0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda tick: min(1.0, (tick + 1) / (warmup + 1)))

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.start, self.ends, self.rewards, self.lengths, self.rss_start = 0.0, [], [], [], 0.0

        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            self.rss_start, self.start = rss_mb(), time.perf_counter()

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            self.ends.append(time.perf_counter())

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kw: Any) -> None:
            if logs and "reward" in logs:
                self.rewards.append(logs["reward"])
                self.lengths.append(logs["completions/mean_length"])

    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(
            output_dir=tmp, use_cpu=True, seed=seed, max_steps=steps, logging_steps=1, report_to="none",
            save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
            per_device_train_batch_size=g.prompts_per_step * s.group_size, gradient_accumulation_steps=1,
            num_generations=s.group_size, steps_per_generation=1, num_iterations=g.epochs,
            max_completion_length=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p, top_k=0,
            learning_rate=g.lr, max_grad_norm=g.max_grad_norm, epsilon=g.clip_low, epsilon_high=g.clip_high,
            beta=g.kl_coef, loss_type="dapo", scale_rewards=g.scale_rewards, mask_truncated_completions=False,
        )
        clock = StepClock()
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=data,
                              processing_class=tokenizer, optimizers=(optimizer, schedule), callbacks=[clock])
        sample_s: list[float] = []
        generate = trainer._generate_and_score_completions

        def timed_generate(*args: Any, **kwargs: Any) -> Any:  # sampling + reward + advantages
            started = time.perf_counter()
            out = generate(*args, **kwargs)
            sample_s.append(time.perf_counter() - started)
            return out

        trainer._generate_and_score_completions = timed_generate
        trainer.train()
    batch = g.prompts_per_step * s.group_size
    return {"step_s": intervals(clock.ends, clock.start), "tokens": [n * batch for n in clock.lengths],
            "reward": clock.rewards, "sample_s": sample_s, "anchor_s": [0.0] * len(sample_s),
            "rss_start_mb": clock.rss_start, "peak_rss_mb": peak_rss_mb()}


# ----------------------------------------------------------------------------- driver
def summarise(name: str, runs: list[dict[str, Any]], skip: int) -> dict[str, Any]:
    """Pool the timed steps of every repetition of one system. Per step: sampling (generate +
    reward), the anchor circuit's dense gradient, and the rest (update, logging, callbacks)."""
    def pooled(key: str) -> list[float]:
        return [x for r in runs for x in r[key][skip:]]

    step, sample, anchor = pooled("step_s"), pooled("sample_s"), pooled("anchor_s")
    tenth = max(len(runs[0]["reward"]) // 10, 1)
    out = {
        "system": name, "reps": len(runs), "steps_timed": len(step),
        "step_median_s": statistics.median(step), "step_mean_s": statistics.fmean(step),
        "per_rep_median_s": [statistics.median(r["step_s"][skip:]) for r in runs],
        "sample_mean_s": statistics.fmean(sample), "anchor_mean_s": statistics.fmean(anchor),
        "tokens_per_s": sum(pooled("tokens")) / sum(step), "tokens_per_step": statistics.fmean(pooled("tokens")),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in runs), "rss_start_mb": max(r["rss_start_mb"] for r in runs),
        "reward_first": statistics.fmean(x for r in runs for x in r["reward"][:tenth]),
        "reward_last": statistics.fmean(x for r in runs for x in r["reward"][-tenth:]),
    }
    out["rest_mean_s"] = out["step_mean_s"] - out["sample_mean_s"] - out["anchor_mean_s"]
    if "train_s" in runs[0]:  # tclightning: the module's own update time (the rest is Lightning + callbacks)
        out["update_mean_s"] = statistics.fmean(pooled("train_s"))
    return out


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| system | step s (median) | step s (mean) | sampling s (mean) | anchor s (mean) | rest s (mean) | "
             "completion tokens/s | peak RSS MiB | RSS at train start MiB | reward first 10% | last 10% |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        lines.append(f"| {r['system']} | {r['step_median_s']:.3f} | {r['step_mean_s']:.3f} | {r['sample_mean_s']:.3f} | "
                     f"{r['anchor_mean_s']:.3f} | {r['rest_mean_s']:.3f} | {r['tokens_per_s']:.0f} | "
                     f"{r['peak_rss_mb']:.0f} | {r['rss_start_mb']:.0f} | {r['reward_first']:.3f} | {r['reward_last']:.3f} |")
    by = {r["system"]: r for r in results}
    if "trl" in by and "dense" in by:
        trl, dense = by["trl"], by["dense"]
        lines.append(f"\nTRL step / tclightning dense step: **{trl['step_median_s'] / dense['step_median_s']:.2f}** "
                     f"(medians), {trl['step_mean_s'] / dense['step_mean_s']:.2f} (means); target >= 1.0")
    if "shallow-compressed" in by and "dense" in by:
        shallow, dense = by["shallow-compressed"], by["dense"]
        total = shallow["step_mean_s"] / dense["step_mean_s"] - 1
        codec = (shallow["step_mean_s"] - shallow["anchor_mean_s"]) / dense["step_mean_s"] - 1
        lines.append(f"\nshallow-compressed over dense: **{total:+.1%}** of step time (means; target <= +5%), "
                     f"{codec:+.1%} without the anchor circuit, {shallow['step_median_s'] / dense['step_median_s'] - 1:+.1%} "
                     "(medians: most steps have no anchor work)")
    return "\n".join(lines)


def plot(curves: dict[str, list[list[float]]], path: Path, window: int = 10) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, reps in curves.items():
        mean = [statistics.fmean(step) for step in zip(*reps)]
        smooth = [statistics.fmean(mean[max(0, i - window + 1): i + 1]) for i in range(len(mean))]
        ax.plot(smooth, label=f"{name} (mean of {len(reps)} runs)")
    ax.set_xlabel("RL step")
    ax.set_ylabel(f"reward/mean ({window}-step moving average)")
    ax.set_title("TRL GRPOTrainer vs tclightning on the embedded task (same warm start)")
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--reps", type=int, default=2, help="runs of each system, alternated")
    parser.add_argument("--skip", type=int, default=5, help="first steps of each run left out of the timing")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for every run (1: on a busy 2-core machine two threads stall at "
                        "every OpenMP barrier); 0 = the dense recipe's")
    parser.add_argument("--warm-dir", type=Path, help="reuse (or create) the warm-started model here")
    parser.add_argument("--warmup-steps", type=int, default=500,
                        help="supervised warm-up steps, exactly (the tiny recipe's adaptive warm-up stopped at "
                        "step 500 on an idle machine); 0 = the recipe's own (up to 3000, stops at 90%% accuracy)")
    parser.add_argument("--plot", type=Path, default=REPO / "docs" / "img" / "vs_trl_reward.png")
    parser.add_argument("--json", type=Path, help="also write the raw per-step results here")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile each run; the top functions by cumulative time go to stdout (slows the runs)")
    parser.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:  # one run in this process
        profiler = None
        if args.profile:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        work = run_trl(args.model, args.steps, args.seed, args.threads) if args.worker == "trl" else \
            run_tclightning(args.worker, args.model, args.steps, args.seed, args.threads)
        if profiler is not None:
            import pstats

            profiler.disable()
            print(f"--- profile of {args.worker} ---")
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(45)
        args.out.write_text(json.dumps(work))
        return

    import torch
    import transformers
    import trl

    from tclightning.recipes.loader import load_recipe

    threads = args.threads or load_recipe(BASE_RECIPE).trainer.num_threads or 1
    torch.set_num_threads(threads)  # the warm-up runs in this process

    print(f"trl {trl.__version__}, transformers {transformers.__version__}, {threads} torch threads; load average at start "
          f"{'/'.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    raw: dict[str, list[dict[str, Any]]] = {name: [] for name in args.systems}
    with tempfile.TemporaryDirectory() as tmp:
        warm = args.warm_dir or Path(tmp) / "warm"
        if not (warm / "config.json").exists():
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from two_circuits import warm_start

            fixed = [f"model.warmup.steps={args.warmup_steps}", "model.warmup.target_accuracy=0"] \
                if args.warmup_steps else []
            print(f"warm-up: {warm_start(warm, args.steps, args.seed, fixed)}", flush=True)
        for rep in range(args.reps):
            for name in args.systems:
                out = Path(tmp) / f"{name}-{rep}.json"
                started = time.perf_counter()
                subprocess.run([sys.executable, __file__, "--worker", name, "--model", str(warm), "--steps",
                                str(args.steps), "--seed", str(args.seed), "--threads", str(threads), "--out", str(out),
                                *(["--profile"] if args.profile else [])], check=True)
                raw[name].append(json.loads(out.read_text()))
                r = raw[name][-1]
                print(f"{name} rep {rep}: {time.perf_counter() - started:.0f} s in all, median step "
                      f"{statistics.median(r['step_s'][args.skip:]):.3f} s, peak RSS {r['peak_rss_mb']:.0f} MiB, "
                      f"load {os.getloadavg()[0]:.2f}", flush=True)
    results = [summarise(name, runs, args.skip) for name, runs in raw.items()]
    print(table(results))
    print(f"\nload average at end {'/'.join(f'{x:.2f}' for x in os.getloadavg())}")
    plot({name: [r["reward"] for r in runs] for name, runs in raw.items()}, args.plot)
    if args.json:
        args.json.write_text(json.dumps({"results": results, "raw": raw}))


if __name__ == "__main__":
    main()
