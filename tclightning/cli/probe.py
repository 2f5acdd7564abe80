"""`tclightning probe ...`: diagnostic probes on a recipe's model.

* ``probe cuts`` -- price each pipeline cut: the sampler-trainer gap and the forward bytes per
  token when one cut, the shallowest n, or all cuts are compressed, on one fixed sampled batch
  (:func:`tclightning.probes.cuts.price_cuts`). Writes ``cuts.csv``, ``cuts.md``, ``cuts.png``.
* ``probe inference`` -- apply a codec at the cuts while a frozen model generates, per budget:
  accuracy, reference log-likelihood, continuations of a shared prompt
  (:func:`tclightning.probes.inference.inference_sweep`). Writes ``inference.csv``,
  ``inference.md``, ``inference.png``, ``generations.jsonl``.
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from pathlib import Path
from typing import Any

from tclightning.cli.options import MAX_THREADS, output_claimed, output_folder, within
from tclightning.errors import TclightningError
from tclightning.files import replace_file, replace_text, save_figure
from tclightning.settings import MAX_STEPS


CUTS_FILES = ("cuts.csv", "cuts.md", "cuts.png")
INFERENCE_FILES = ("inference.csv", "generations.jsonl", "inference.md", "inference.png")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("probe", help="probe tools")
    tools = parser.add_subparsers(dest="probe_command", metavar="TOOL")
    cuts = tools.add_parser(
        "cuts",
        help="price each pipeline cut: gap and bytes per token, solo / shallow-first / all",
        description=(
            "Sample one fixed batch with the dense policy, then re-score it with the recipe's pipeline cuts "
            "compressed one at a time (solo:i), shallow-first (first:n) and all together; report the gap/* "
            "metrics and the forward bytes per token of each. The recipe's model, task, sampler and pipeline "
            "sections are used (pipeline.layout is ignored: the probe sweeps it)."
        ),
    )
    cuts.add_argument("--recipe", required=True, help="recipe name or path (its pipeline section gives cuts and codec)")
    cuts.add_argument("--prompts", type=int, default=2, help="task prompts in the batch (default 2)")
    cuts.add_argument("--group-size", type=int, default=None,
                      help="completions per prompt (default: the recipe's sampler.group_size)")
    cuts.add_argument("--warmup-prompts", type=int, default=128,
                      help="other task prompts whose completions warm codecs with state (bases) "
                           "before the measured batch, as earlier steps of a run would (default 128: about "
                           "28k tokens of GSM8K references, what ten steps of a SmolLM2 run give a refit)")
    cuts.add_argument("--warmup-from", choices=("references", "samples"), default="references",
                      help="the warm-up completions: the task's reference solutions, teacher-forced (no "
                           "sampling), or completions the "
                           "policy samples, as a run's first steps would (slow on a CPU) (default references)")
    cuts.add_argument("--warmup-steps", type=int, default=1,
                      help="steps the warm-up prompts are folded in over, one share per step as in a run "
                           "(default 1: the bases are fitted on all of them, as a refit on a run's window is)")
    cuts.add_argument("--out", default=None, help="output folder (default runs/probes/<recipe>-cuts/)")
    cuts.add_argument("--overwrite", action="store_true", help="replace the files of an earlier probe in --out")
    cuts.add_argument("--step", type=int, default=0, help="PRF key step used for every configuration (default 0)")
    cuts.add_argument("--threads", type=int, default=None,
                      help="torch.set_num_threads (default: the recipe's trainer.num_threads, else torch's)")
    cuts.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides, e.g. pipeline.rate=0.1")
    cuts.set_defaults(func=run_cuts)
    register_inference(tools)
    from tclightning.cli.probe_coherence import register_coherence

    register_coherence(tools)


def run_cuts(args: argparse.Namespace) -> int:
    """Handler of ``probe cuts``: writes the three files, prints the table; exit code 0."""
    from tclightning.recipes.loader import load_recipe, to_dataclass

    within("probe cuts", "--threads", args.threads, 1, MAX_THREADS)
    within("probe cuts", "--prompts", args.prompts, 1, 1 << 16)
    within("probe cuts", "--group-size", args.group_size, 1, 1 << 10)
    within("probe cuts", "--step", args.step, 0, MAX_STEPS)
    within("probe cuts", "--warmup-prompts", args.warmup_prompts, 1, 1 << 16)
    within("probe cuts", "--warmup-steps", args.warmup_steps, 1, 10000)
    recipe = to_dataclass(load_recipe(args.recipe, args.overrides))
    out = output_folder("probe cuts", Path(args.out or Path("runs") / "probes" / f"{recipe.name}-cuts"),
                        CUTS_FILES, named=args.out is not None, overwrite=args.overwrite)


    from tclightning.pipeline.cuts import find_decoder_layers
    from tclightning.probes.cuts import is_stateful, price_cuts
    from tclightning.probes.inference import reference_batch
    from tclightning.sampling import PromptFormatter, build_sampler
    from tclightning.sampling.base import sequence_seed

    started = time.perf_counter()
    model, tokenizer, task = load_for_probe(recipe, args.threads)
    examples = list(task.train_examples())[: args.prompts]
    if len(examples) < args.prompts:
        raise TclightningError(f"--prompts {args.prompts}: the task has only {len(examples)} training prompts")
    formatter = PromptFormatter(tokenizer, task.system_prompt, recipe.model.chat_template)
    sampler = build_sampler(recipe.sampler, formatter)
    group_size = args.group_size or recipe.sampler.group_size
    loaded = time.perf_counter()
    # Seeded like the trainer's step 0, so the batch is the one a run would start from.
    rollouts = sampler.generate(
        model,
        [e.prompt for e in examples],
        group_size=group_size,
        seed=sequence_seed(recipe.sampler.seed + recipe.trainer.seed, 0),
    )
    # Codecs with state learn from earlier traffic in a run: warm them on the next prompts'
    # completions (seeded like step 1), never on the batch they are measured on.
    warmup = None
    if is_stateful(recipe.pipeline):
        held_out = list(task.train_examples())[args.prompts : args.prompts + args.warmup_prompts]
        if not held_out:
            raise TclightningError(f"--prompts {args.prompts}: no training prompts left to warm the "
                                   f"{recipe.pipeline.codec} codec's state on (lower --prompts)")
        if args.warmup_from == "samples":
            warmup = sampler.generate(model, [e.prompt for e in held_out], group_size=group_size,
                                      seed=sequence_seed(recipe.sampler.seed + recipe.trainer.seed, 1))
        else:
            warmup = reference_batch(formatter, [e.prompt for e in held_out], [e.solution for e in held_out])
    sampled = time.perf_counter()
    rows = price_cuts(model, rollouts, recipe.pipeline, recipe.sampler.temperature, step=args.step, warmup=warmup,
                      warmup_steps=args.warmup_steps)
    scored = time.perf_counter()

    meta = {
        "recipe": recipe.name,
        "model": recipe.model.gguf_file or recipe.model.name or f"tiny {recipe.model.tiny.architecture}",
        "layers": len(find_decoder_layers(model)[1]),
        "d": int(model.config.hidden_size),
        "codec": recipe.pipeline.codec,
        "k": rows[0]["k"],
        "cut_layers": [r["compressed_layers"][0] for r in rows if r["kind"] == "solo"],
        "sequences": rollouts.num_sequences,
        "completion_tokens": rows[0]["completion_tokens"],
        "tokens": rows[0]["tokens"],
        "dtype": recipe.model.dtype,
        "temperature": recipe.sampler.temperature,
        "step": args.step,
        "warmup_sequences": warmup.num_sequences if warmup is not None else 0,
        "warmup_steps": args.warmup_steps if warmup is not None else 0,
        "warmup_from": args.warmup_from,
        "warmup_tokens": int(warmup.attention_mask.sum()) if warmup is not None else 0,
        "timing": f"load {loaded - started:.0f} s, sample {sampled - loaded:.0f} s, score {scored - sampled:.0f} s",
    }
    table = markdown_table(rows)
    with output_claimed("probe cuts", out, CUTS_FILES, named=args.out is not None, overwrite=args.overwrite):
        write_csv(rows, out / "cuts.csv")
        replace_text(out / "cuts.md", markdown_header(meta) + "\n" + table)
        plot(rows, out / "cuts.png", title=f"{meta['recipe']}: {meta['codec']} k={meta['k']}/{meta['d']}")
    print(markdown_header(meta))
    print(table)
    print(f"wrote {out / 'cuts.csv'}, {out / 'cuts.md'}, {out / 'cuts.png'}")
    return 0


def load_for_probe(recipe: Any, threads: int | None) -> tuple[Any, Any, Any]:
    """``(model, tokenizer, task)`` of a recipe, with torch's thread count set first."""
    import torch

    from tclightning.models.loading import load_model
    from tclightning.tasks import build_task

    threads = threads or recipe.trainer.num_threads
    if threads:
        torch.set_num_threads(threads)
    model, tokenizer = load_model(recipe.model, seed=recipe.trainer.seed)
    if recipe.model.warmup.steps > 0:
        # A probe measures the model as loaded; a tiny recipe's supervised warm-up is not run.
        print(f"note: model.warmup.steps={recipe.model.warmup.steps} is ignored (the probe does not train)")
    return model, tokenizer, build_task(recipe.task)


# ------------------------------------------------------------------------------------ outputs
CSV_COLUMNS = (
    "config", "kind", "compressed_layers", "n_compressed", "depth",
    "gap/abs_mean", "gap/k3", "gap/max", "gap/outside_5x_frac", "gap/logp_corr", "gap/prob_abs_mean",
    "bytes_fwd_per_token", "dense_bytes_fwd_per_token", "wire/ratio",
    "codec", "k", "tokens", "completion_tokens",
)  # fmt: skip


def _cell(value: Any) -> Any:
    return " ".join(str(v) for v in value) if isinstance(value, list) else value


def write_csv(rows: list[dict[str, Any]], path: Path, columns: tuple[str, ...] = CSV_COLUMNS) -> None:
    """One row per configuration; list columns are space-separated layer indices."""
    def write(handle: Any) -> None:
        writer = csv.DictWriter(handle, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({key: _cell(row[key]) for key in columns})

    replace_file(path, write)


def markdown_header(meta: dict[str, Any]) -> str:
    return (
        f"Cut pricing, recipe `{meta['recipe']}` ({meta['model']}; {meta['layers']} layers, d={meta['d']}, "
        f"{meta['dtype']}): `{meta['codec']}` k={meta['k']}, cuts after layers "
        f"{', '.join(map(str, meta['cut_layers']))}; {meta['sequences']} sampled completions "
        f"({meta['completion_tokens']} completion tokens, {meta['tokens']} tokens per forward), "
        f"temperature {meta['temperature']}, PRF step {meta['step']}."
        + (f" Codec state warmed on {meta['warmup_sequences']} other "
           f"{'reference solutions' if meta.get('warmup_from') == 'references' else 'sampled completions'} "
           f"({meta.get('warmup_tokens', 0)} tokens) over {meta['warmup_steps']} step{'s' * (meta['warmup_steps'] != 1)}."
           if meta.get("warmup_sequences") else "")
        + f" {meta['timing']}.\n"
    )


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The table of ``docs/cut-pricing.md``: gap/* and forward bytes per token per configuration."""
    head = (
        "| config | compressed after layers | gap/abs_mean | gap/k3 | gap/max | gap/outside_5x_frac "
        "| gap/logp_corr | gap/prob_abs_mean | B/token fwd | dense B/token | ratio |\n"
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n"
    )
    lines = []
    for r in rows:
        layers = ", ".join(map(str, r["compressed_layers"])) or "none"
        lines.append(
            f"| {r['config']} | {layers} | {r['gap/abs_mean']:.4g} | {r['gap/k3']:.4g} | {r['gap/max']:.4g} "
            f"| {r['gap/outside_5x_frac']:.3f} | {r['gap/logp_corr']:.3f} | {r['gap/prob_abs_mean']:.4g} "
            f"| {r['bytes_fwd_per_token']:g} | {r['dense_bytes_fwd_per_token']:g} | {r['wire/ratio']:.2f} |"
        )
    return head + "\n".join(lines) + "\n"


def _save_figure(fig: Any, axes: Any, path: Path, title: str) -> None:
    """Legend on the first panel, optional title, PNG at 120 dpi, figure closed."""
    import matplotlib.pyplot as plt

    axes[0].legend(fontsize=8, loc="best")
    if title:
        fig.suptitle(title)
    save_figure(fig, path, dpi=120)
    plt.close(fig)


def plot(rows: list[dict[str, Any]], path: Path, title: str = "") -> None:
    """gap/abs_mean and gap/k3 against the depth of the compressed cut: solo points, the
    cumulative shallow-first curve (x = deepest compressed cut) and the dense level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tclightning.probes.cuts import cumulative_series

    solo = [r for r in rows if r["kind"] == "solo"]
    cumulative = cumulative_series(rows)
    if cumulative and cumulative[0]["n_compressed"] != 1:  # no first:1 row when there is one cut
        cumulative = [*solo[:1], *cumulative]
    dense = next(r for r in rows if r["kind"] == "dense")
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    for ax, key in zip(axes, ("gap/abs_mean", "gap/k3")):
        ax.plot([r["depth"] for r in solo], [r[key] for r in solo], "o-", label="solo: only this cut compressed")
        ax.plot(
            [r["depth"] for r in cumulative], [r[key] for r in cumulative], "s--",
            label="cumulative: all cuts up to this depth",
        )
        ax.axhline(dense[key], color="grey", linestyle=":", label=f"dense ({dense[key]:.2g})")
        for r in cumulative:
            ax.annotate(str(r["n_compressed"]), (r["depth"], r[key]), textcoords="offset points", xytext=(4, -12),
                        fontsize=8, color="tab:orange")
        ax.set_xlabel("layer the compressed cut follows (cumulative: the deepest)")
        ax.set_ylabel(key + (" (nats)" if key == "gap/abs_mean" else ""))
        ax.set_xticks([r["depth"] for r in solo])
        ax.set_ylim(bottom=min(0.0, ax.get_ylim()[0]))
        ax.grid(alpha=0.3)
    _save_figure(fig, axes, path, title)


# ---------------------------------------------------------------------------------- probe inference
INFERENCE_RECIPE = "smollm2-cut-pricing"


def register_inference(tools: argparse._SubParsersAction) -> None:
    inference = tools.add_parser(
        "inference",
        help="inference-time compression sweep: accuracy and log-likelihood per codec and budget",
        description=(
            "Generate greedily with a frozen model while a codec compresses the pipeline cuts, at several "
            "budgets; report accuracy on a task split, the log-likelihood of the reference solutions, "
            "agreement with the dense generations and the continuation of a shared prompt. Cut positions "
            f"and PRF seed come from the recipe's pipeline section (default recipe: {INFERENCE_RECIPE})."
        ),
    )
    inference.add_argument("--model", default=None,
                           help="model to probe: 'tiny', a .gguf path or package:file.gguf, or a HF name / local "
                                "directory (default: the recipe's model)")
    inference.add_argument("--codec", default="prf,svd", help="prf, svd or both comma-separated (default prf,svd)")
    inference.add_argument("--rates", default="1.0,0.5,0.25,0.1,0.05",
                           help="budgets as shares of d, comma-separated (default 1.0,0.5,0.25,0.1,0.05)")
    inference.add_argument("--recipe", default=INFERENCE_RECIPE, help=f"recipe name or path (default {INFERENCE_RECIPE})")
    inference.add_argument("--task", default=None, help="task name overriding the recipe's (gsm8k, math, bigmath, arithmetic)")
    inference.add_argument("--split", choices=("eval", "train"), default="eval", help="problems to evaluate (default eval)")
    inference.add_argument("--limit", type=int, default=16, help="problems evaluated (default 16)")
    inference.add_argument("--max-new-tokens", type=int, default=None,
                           help="generation limit (default 128, at most half the model's positions)")
    inference.add_argument("--layout", default="all",
                           help="which cuts are compressed: all, shallow, shallow:n, solo:i (default all)")
    inference.add_argument("--calibration", type=int, default=16,
                           help="training-split solutions whose activations fit the svd bases (default 16)")
    inference.add_argument("--batch-size", type=int, default=None, help="sequences per generate call (default: recipe's)")
    inference.add_argument("--step", type=int, default=0, help="PRF key step (default 0)")
    inference.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: recipe's)")
    inference.add_argument("--out", default=None, help="output folder (default runs/probes/<recipe>-inference/)")
    inference.add_argument("--overwrite", action="store_true", help="replace the files of an earlier probe in --out")
    inference.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides, e.g. pipeline.rate=0.1")
    inference.set_defaults(func=run_inference)


def model_override(spec: str) -> dict[str, Any]:
    """``--model`` as ModelConfig fields: ``tiny``, a GGUF file (``.gguf`` path or ``package:file.gguf``),
    else a Hugging Face name or local directory."""
    if spec == "tiny":
        return {"source": "tiny"}
    if spec.endswith(".gguf"):
        return {"source": "gguf", "gguf_file": spec}
    return {"source": "hf", "name": spec}


def _floats(text: str, flag: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise TclightningError(f"{flag}: expected comma-separated numbers, got '{text}'") from None


def run_inference(args: argparse.Namespace) -> int:
    """Handler of ``probe inference``: runs the sweep, writes four files, prints the table; exit code 0."""
    import dataclasses

    from tclightning.probes.inference import sweep_points
    from tclightning.recipes.loader import load_recipe, to_dataclass

    points = sweep_points([c.strip() for c in args.codec.split(",") if c.strip()], _floats(args.rates, "--rates"))
    if args.limit < 1:
        raise TclightningError(f"--limit must be >= 1, got {args.limit}")
    within("probe inference", "--max-new-tokens", args.max_new_tokens, 1, 32768)
    within("probe inference", "--batch-size", args.batch_size, 1, 1 << 16)
    within("probe inference", "--threads", args.threads, 1, MAX_THREADS)
    within("probe inference", "--calibration", args.calibration, 0, 1 << 16)
    within("probe inference", "--step", args.step, 0, MAX_STEPS)
    # --model and --task as overrides: the recipe's checks (a GGUF's magic, a model folder's files) see them
    chosen = {**({f"model.{k}": v for k, v in model_override(args.model).items()} if args.model else {}),
              **({"task.name": args.task} if args.task else {})}
    recipe = to_dataclass(load_recipe(args.recipe, [*args.overrides, *(f"{k}={json.dumps(v)}" for k, v in chosen.items())]))
    dataclasses.replace(recipe.pipeline, layout=args.layout).validate()
    out = output_folder("probe inference", Path(args.out or Path("runs") / "probes" / f"{recipe.name}-inference"),
                        INFERENCE_FILES, named=args.out is not None, overwrite=args.overwrite)


    from tclightning.probes.inference import (
        inference_sweep,
        markdown_continuations,
        markdown_table,
    )
    from tclightning.sampling import PromptFormatter

    started = time.perf_counter()
    model, tokenizer, task = load_for_probe(recipe, args.threads)
    positions = getattr(model.config, "max_position_embeddings", None) or 1 << 30
    max_new_tokens = min(128, positions // 2) if args.max_new_tokens is None else args.max_new_tokens  # half for the prompt
    if max_new_tokens >= positions:  # generating past them never ends well
        raise TclightningError(f"probe inference: --max-new-tokens {args.max_new_tokens} leaves no room for a prompt "
                               f"in the model's {positions} positions")
    pool = task.eval_examples() if args.split == "eval" else task.train_examples()
    examples = list(pool)[: args.limit]
    calibration = list(task.train_examples())[-args.calibration :] if args.calibration > 0 else []
    if args.split == "train":  # never fit the svd bases on the problems being evaluated
        calibration = [e for e in calibration if e not in examples]
    formatter = PromptFormatter(tokenizer, task.system_prompt, recipe.model.chat_template)
    loaded = time.perf_counter()
    result = inference_sweep(
        model, formatter, task, examples, recipe.pipeline, points,
        calibration_examples=calibration, layout=args.layout, max_new_tokens=max_new_tokens,
        batch_size=args.batch_size or recipe.sampler.batch_size, step=args.step, on_point=print_point,
    )  # fmt: skip
    finished = time.perf_counter()
    meta = {
        **result.meta,
        "recipe": recipe.name,
        "model": recipe.model.gguf_file or recipe.model.name or f"tiny {recipe.model.tiny.architecture}",
        "task": task.name,
        "split": args.split,
        "dtype": recipe.model.dtype,
        "timing": f"load {loaded - started:.0f} s, sweep {finished - loaded:.0f} s",
    }
    lines = []
    for row in result.rows:
        rewards = task.rewards(row["texts"], examples)
        for example, text, reward in zip(examples, row["texts"], rewards):
            lines.append(json.dumps({"point": row["point"], "uid": example.uid, "reward": reward, "text": text}) + "\n")
    header = inference_header(meta)
    table = markdown_table(result.rows)
    with output_claimed("probe inference", out, INFERENCE_FILES, named=args.out is not None, overwrite=args.overwrite):
        write_csv(result.rows, out / "inference.csv", INFERENCE_COLUMNS)
        replace_text(out / "generations.jsonl", "".join(lines))
        replace_text(out / "inference.md", header + "\n" + table + "\n" + markdown_continuations(result))
        plot_inference(result.rows, out / "inference.png",
                       title=f"{meta['model']}: {meta['task']}, layout {meta['layout']}")
    print(header)
    print(table)
    print(f"wrote {out / 'inference.csv'}, {out / 'inference.md'}, {out / 'inference.png'}, {out / 'generations.jsonl'}")
    return 0


def print_point(row: dict[str, Any]) -> None:
    print(f"{row['point']:>10}: accuracy {row['accuracy']:.3f}, ref log-lik {row['ref_loglik']:.3f}, "
          f"same as dense {row['exact_match']:.2f} ({row['seconds']:.0f} s)", flush=True)


INFERENCE_COLUMNS = (
    "point", "codec", "rate", "k", "compressed_layers", "wire/ratio", "accuracy", "correct", "n",
    "ref_loglik", "ref_loglik_seq", "exact_match", "prefix_agree", "length_mean", "truncated_frac",
    "energy_kept", "seconds",
)  # fmt: skip


def inference_header(meta: dict[str, Any]) -> str:
    calibration = (
        f"; svd bases fitted on {meta['calibration_examples']} training solutions ({meta['calibration_tokens']} tokens)"
        if meta["calibration_examples"] else ""
    )
    return (
        f"Inference-time compression sweep, `{meta['model']}` ({meta['layers']} layers, d={meta['d']}, {meta['dtype']}): "
        f"cuts after layers {', '.join(map(str, meta['cut_layers']))}, layout `{meta['layout']}`; "
        f"task `{meta['task']}` ({meta['split']} split, first {meta['n']} problems, {meta['reference_tokens']} "
        f"reference tokens), greedy, up to {meta['max_new_tokens']} new tokens{calibration}. {meta['timing']}.\n"
    )


def plot_inference(rows: list[dict[str, Any]], path: Path, title: str = "") -> None:
    """Accuracy, reference log-likelihood and dense-prefix agreement against the budget (log x), one
    line per codec, the dense level dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dense = next(r for r in rows if r["codec"] == "dense")
    panels = (("accuracy", "accuracy"), ("ref_loglik", "reference log-lik (nats/token)"),
              ("prefix_agree", "share of dense completion kept"))
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), constrained_layout=True)
    for ax, (key, label) in zip(axes, panels):
        for codec, marker in (("prf", "o-"), ("svd", "s--")):
            points = sorted((r["rate"], r[key]) for r in rows if r["codec"] == codec)
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker, label=codec)
        ax.axhline(dense[key], color="grey", linestyle=":", label=f"dense ({dense[key]:.3g})")
        ax.set_xscale("log")
        ax.set_xlabel("budget (share of d kept per token)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    _save_figure(fig, axes, path, title)
