"""Side by side with TRL's ``GRPOTrainer`` on one CPU machine, then what compression costs.

    python benchmarks/vs_trl.py                        # or: make bench-peers (installs trl first)
    python benchmarks/vs_trl.py --steps 60 --reps 1 --systems trl dense
    python benchmarks/vs_trl.py --base-recipe smollm2-dense --steps 12 --skip 2 --reps 1   # make smollm2 first

Two bases (``--base-recipe``): ``dense`` (the default, the embedded tiny model, below) and
``smollm2-dense`` (the real model, at the end).

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

``--base-recipe smollm2-dense``: SmolLM2-135M-Instruct (``make smollm2``). The recipe's GGUF model
is loaded once by tclightning's own loader (``load_model``: de-quantized to float32), saved as a
Hugging Face directory with its tokenizer and chat template, and every run starts from it (no
warm-up: ``--warmup-steps`` does not apply). Systems ``trl`` and ``smollm2-dense`` (tclightning,
the pipeline Strategy with four dense stages), configured from that recipe as above: chat prompts
rendered by tclightning's formatter and handed to TRL as plain text (TRL does not template a
plain-string prompt again; the worker checks that TRL tokenizes them to the same ids), the
last-integer reward, 8 prompts x 4 completions, 12 new tokens, temperature 0.8, lr 1e-5 constant.
TRL runs in float32 without gradient checkpointing here (its defaults are bf16 autocast and
checkpointing), as tclightning does. Prints the same table and tclightning step / TRL step;
writes ``docs/img/vs_trl_smollm2_reward.png``.
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
BASES = {  # base recipe (the hyperparameters both trainers use) -> the systems that can run on it
    "dense": ["trl", "dense", "shallow-compressed"],
    "smollm2-dense": ["trl", "smollm2-dense"],
}
SYSTEMS = sorted({name for names in BASES.values() for name in names})
PLOTS = {"dense": "vs_trl_reward.png", "smollm2-dense": "vs_trl_smollm2_reward.png"}
TITLES = {"dense": "TRL GRPOTrainer vs tclightning on the embedded task (same warm start)",
          "smollm2-dense": "TRL GRPOTrainer vs tclightning, SmolLM2-135M-Instruct on 2-digit sums (same start)"}


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


def real_start(directory: Path, base: str) -> str:
    """The ``base`` recipe's model as tclightning loads it (GGUF de-quantized to its dtype), saved
    once as a Hugging Face directory with its tokenizer (chat template included)."""
    from tclightning.models.loading import load_model
    from tclightning.recipes.loader import load_recipe, to_dataclass

    recipe = to_dataclass(load_recipe(base))
    model, tokenizer = load_model(recipe.model)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:  # a GGUF load marks the model quantized although its weights are plain tensors now
        quantizer.remove_quantization_config(model)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return f"{recipe.model.source} {recipe.model.gguf_file or recipe.model.name} -> {directory} ({model.dtype}, " \
           f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f} M parameters, chat template " \
           f"{'yes' if getattr(tokenizer, 'chat_template', None) else 'no'})"


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


def run_trl(base: str, model_dir: str, steps: int, seed: int, threads: int) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tclightning.recipes.loader import load_recipe, to_dataclass
    from tclightning.sampling.base import PromptFormatter
    from tclightning.tasks import build_task

    recipe = to_dataclass(load_recipe(base, [f"trainer.seed={seed}"]))
    g, s = recipe.grpo, recipe.sampler
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    task = build_task(recipe.task)
    examples = list(task.train_examples())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    formatter = PromptFormatter(tokenizer, task.system_prompt, recipe.model.chat_template)
    # Prompts pre-rendered exactly as tclightning's sampler renders them (same token ids). Plain strings:
    # TRL applies no chat template to them and tokenizes them with the tokenizer's defaults.
    data = Dataset.from_list([{"prompt": formatter.render(e.prompt), "index": i} for i, e in enumerate(examples)])
    if base != "dense":  # the tiny path is left as it was measured
        probe = [e.prompt for e in examples[:64]]
        ours = formatter.encode(probe)
        theirs = tokenizer(text=[formatter.render(p) for p in probe])["input_ids"]
        for row, ids, mask in zip(theirs, ours["input_ids"], ours["attention_mask"]):
            if list(row) != ids[mask.bool()].tolist():
                raise SystemExit(f"TRL would tokenize the rendered prompt to other ids than tclightning: {row} vs "
                                 f"{ids[mask.bool()].tolist()}")

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

    # The SmolLM2 path: float32 and no gradient checkpointing, as tclightning trains (TRL's defaults are bf16
    # autocast, also on the CPU, and checkpointing). The tiny path keeps TRL's defaults, as it was measured.
    # (transformers 5 names it activation_checkpointing; gradient_checkpointing is its deprecated alias)
    checkpointing = "activation_checkpointing" if "activation_checkpointing" in GRPOConfig.__dataclass_fields__ \
        else "gradient_checkpointing"
    exact = {} if base == "dense" else {"bf16": False, "fp16": False, checkpointing: False}
    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(
            output_dir=tmp, use_cpu=True, seed=seed, max_steps=steps, logging_steps=1, report_to="none",
            save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
            per_device_train_batch_size=g.prompts_per_step * s.group_size, gradient_accumulation_steps=1,
            num_generations=s.group_size, steps_per_generation=1, num_iterations=g.epochs,
            max_completion_length=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p, top_k=0,
            learning_rate=g.lr, max_grad_norm=g.max_grad_norm, epsilon=g.clip_low, epsilon_high=g.clip_high,
            beta=g.kl_coef, loss_type="dapo", scale_rewards=g.scale_rewards, mask_truncated_completions=False,
            **exact,
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
        print(f"trl: {torch.get_num_threads()} torch threads, mixed precision {trainer.accelerator.mixed_precision}, "
              f"{checkpointing} {getattr(config, checkpointing)}, max_completion_length "
              f"{config.max_completion_length}, generation {trainer.generation_kwargs}", flush=True)
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
    if "trl" in by and "smollm2-dense" in by:
        trl, ours = by["trl"], by["smollm2-dense"]
        lines.append(f"\ntclightning smollm2-dense step / TRL step: "
                     f"**{ours['step_median_s'] / trl['step_median_s']:.2f}** (medians of the per-step wall time), "
                     f"{ours['step_mean_s'] / trl['step_mean_s']:.2f} (means); "
                     "below 1.0 = tclightning faster")
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


def plot(curves: dict[str, list[list[float]]], path: Path, title: str, window: int = 10) -> None:
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
    ax.set_title(title)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-recipe", choices=sorted(BASES), default="dense",
                        help="the hyperparameters (and model) every system uses: dense = the embedded tiny model "
                        "after its warm-up; smollm2-dense = SmolLM2-135M-Instruct (make smollm2)")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS,
                        help="what to run, alternated: for dense trl dense shallow-compressed (default all), for "
                        "smollm2-dense trl smollm2-dense (default both)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--reps", type=int, default=2, help="runs of each system, alternated")
    parser.add_argument("--skip", type=int, default=5, help="first steps of each run left out of the timing")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for every run (1: on a busy 2-core machine two threads stall at "
                        "every OpenMP barrier); 0 = the base recipe's")
    parser.add_argument("--warm-dir", type=Path,
                        help="reuse (or create) the starting model here (dense: the warm-started tiny model; "
                        "smollm2-dense: SmolLM2 saved as a Hugging Face directory)")
    parser.add_argument("--warmup-steps", type=int, default=500,
                        help="supervised warm-up steps, exactly (the tiny recipe's adaptive warm-up stopped at "
                        "step 500 on an idle machine); 0 = the recipe's own (up to 3000, stops at 90%% accuracy); "
                        "dense only")
    parser.add_argument("--plot", type=Path, help="default docs/img/vs_trl_reward.png (dense), "
                        "docs/img/vs_trl_smollm2_reward.png (smollm2-dense)")
    parser.add_argument("--json", type=Path, help="also write the raw per-step results here")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile each run; the top functions by cumulative time go to stdout (slows the runs)")
    parser.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    base = args.base_recipe
    systems = args.systems or BASES[base]
    wrong = [name for name in systems if name not in BASES[base]]
    if wrong:
        parser.error(f"--systems {' '.join(wrong)}: not a system of --base-recipe {base} "
                     f"(choose from {' '.join(BASES[base])})")

    if args.worker:  # one run in this process
        profiler = None
        if args.profile:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        work = run_trl(base, args.model, args.steps, args.seed, args.threads) if args.worker == "trl" else \
            run_tclightning(args.worker, args.model, args.steps, args.seed, args.threads)
        if profiler is not None:
            import pstats

            profiler.disable()
            print(f"--- profile of {args.worker} ---")
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(45)
        args.out.write_text(json.dumps(work))
        return
    if args.skip >= args.steps:
        parser.error(f"--skip {args.skip} leaves none of the {args.steps} steps timed")

    import torch
    import transformers
    import trl

    from tclightning.recipes.loader import load_recipe

    threads = args.threads or load_recipe(base).trainer.num_threads or 1
    torch.set_num_threads(threads)  # the warm-up (or the model's load) runs in this process

    print(f"trl {trl.__version__}, transformers {transformers.__version__}, base recipe {base}, {threads} torch "
          f"threads; load average at start {'/'.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    raw: dict[str, list[dict[str, Any]]] = {name: [] for name in systems}
    with tempfile.TemporaryDirectory() as tmp:
        warm = args.warm_dir or Path(tmp) / "warm"
        if not (warm / "config.json").exists():
            if base == "dense":
                sys.path.insert(0, str(Path(__file__).resolve().parent))
                from two_circuits import warm_start

                fixed = [f"model.warmup.steps={args.warmup_steps}", "model.warmup.target_accuracy=0"] \
                    if args.warmup_steps else []
                print(f"warm-up: {warm_start(warm, args.steps, args.seed, fixed)}", flush=True)
            else:
                print(f"start: {real_start(warm, base)}", flush=True)
        for rep in range(args.reps):
            for name in systems:
                out = Path(tmp) / f"{name}-{rep}.json"
                started = time.perf_counter()
                subprocess.run([sys.executable, __file__, "--base-recipe", base, "--worker", name, "--model", str(warm),
                                "--steps", str(args.steps), "--seed", str(args.seed), "--threads", str(threads),
                                "--out", str(out), *(["--profile"] if args.profile else [])], check=True)
                raw[name].append(json.loads(out.read_text()))
                r = raw[name][-1]
                print(f"{name} rep {rep}: {time.perf_counter() - started:.0f} s in all, median step "
                      f"{statistics.median(r['step_s'][args.skip:]):.3f} s, peak RSS {r['peak_rss_mb']:.0f} MiB, "
                      f"load {os.getloadavg()[0]:.2f}", flush=True)
    results = [summarise(name, runs, args.skip) for name, runs in raw.items()]
    print(table(results))
    print(f"\nload average at end {'/'.join(f'{x:.2f}' for x in os.getloadavg())}")
    window = 10 if base == "dense" else max(1, min(10, args.steps // 4))  # a 12-step run: a 3-step average
    plot({name: [r["reward"] for r in runs] for name, runs in raw.items()},
         args.plot or REPO / "docs" / "img" / PLOTS[base], TITLES[base], window)
    if args.json:
        args.json.write_text(json.dumps({"results": results, "raw": raw}))


if __name__ == "__main__":
    main()
