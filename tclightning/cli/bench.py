"""`tclightning bench ...` (subcommands are added by the features that own them).

* ``bench codec`` -- PRF encode/decode time against ``clone()`` and bytes per token
  (``tclightning.bench.codec.bench_codec``; ``benchmarks/codec.py`` runs the same).
* ``bench link`` -- 2 pipeline stages in their own processes over a tc-shaped link (network
  namespace), step time and bytes for dense / shallow / all-compressed layouts
  (``tclightning.bench.link.run_link_bench``; ``benchmarks/slow_link.py`` runs the same).
* ``bench traffic`` -- bytes per RL step per traffic class (boundary, anchor, weight sync, tied
  embedding, rollouts) for dense / compressed / + sparse sync / + LoRA, from a recipe and a model's
  ``config.json`` alone (``tclightning.bench.traffic.step_traffic``).
* ``bench step-link`` -- whole RL steps (``tclightning run``, one stage per node) over a
  tc-shaped switch, dense against compressed with and without the sparse sync
  (``tclightning.bench.step_link``).
* ``bench two-node`` -- a real two-node torchrun launch of ``tclightning run`` on one machine:
  two network namespaces on a switch with tc-shaped ports (``tclightning.bench.nodes``).

The options and output live here; the measurements in ``tclightning/bench/`` (which does not
import this module).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from tclightning.cli.options import MAX_THREADS, within


def add_codec_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``bench codec`` (shared with ``benchmarks/codec.py``)."""
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens in the boundary tensor (default 8192)")
    parser.add_argument("--dim", type=int, default=1536, help="boundary width d (default 1536)")
    parser.add_argument("--k", type=int, default=77, help="values kept per token (default 77 = 5%% of 1536)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--repeats", type=int, default=25, help="timed rounds; medians are reported (default 25)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default 3)")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (default cpu)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--codec", default="prf", choices=("prf", "lowrank", "lowrank-4bit", "lowrank-entropy"),
                        metavar="CODEC",
                        help="prf (default), lowrank (float coefficients), lowrank-4bit (4 bits "
                             "and a 16-bit lead) and lowrank-entropy (entropy-coded) are timed beside the "
                             "zero-fill prf decode")


def _require_device(command: str, device: str) -> None:
    """Refuse, before anything is built there, a device torch does not know or this machine lacks."""
    import torch

    from tclightning.errors import TclightningError

    try:
        target = torch.device(device)
    except (RuntimeError, ValueError):
        raise TclightningError(f"{command}: --device {device!r} is not a torch device (cpu, cuda, cuda:N)") from None
    if target.type == "cuda" and (not torch.cuda.is_available() or (target.index or 0) >= torch.cuda.device_count()):
        raise TclightningError(f"{command}: --device {device}: this machine has {torch.cuda.device_count()} CUDA devices")
    if target.type not in ("cpu", "cuda"):
        raise TclightningError(f"{command}: --device {device}: only cpu and cuda are timed")


def run_codec(args: argparse.Namespace) -> int:
    """Handler of ``bench codec``: prints the result; exit code 0."""
    from tclightning.bench.codec import bench_codec
    from tclightning.errors import TclightningError

    if not 1 <= args.k <= args.dim or args.tokens < 1:
        raise TclightningError(
            f"bench codec: need 1 <= k <= dim and tokens >= 1 (got k={args.k}, dim={args.dim}, tokens={args.tokens})"
        )
    within("bench codec", "--threads", args.threads, 1, MAX_THREADS)
    within("bench codec", "--repeats", args.repeats, 1, 10000)
    within("bench codec", "--warmup", args.warmup, 0, 10000)
    within("bench codec", "--tokens x --dim", args.tokens * args.dim, 1, 1 << 30)  # 4 GiB of float32 at most
    if args.codec.startswith("lowrank"):  # a basis codec holds [dim, dim] matrices (the covariance, its eigenvectors)
        within(f"bench codec --codec {args.codec}", "--dim", args.dim, 1, 16384)
    _require_device("bench codec", args.device)
    try:
        result = bench_codec(
            tokens=args.tokens,
            dim=args.dim,
            k=args.k,
            dtype=args.dtype,
            repeats=args.repeats,
            warmup=args.warmup,
            device=args.device,
            threads=args.threads,
            codec_name=args.codec,
        )
    except ValueError as err:  # the codec's refusal of the settings (a budget that buys no coefficient)
        raise TclightningError(f"bench codec --codec {args.codec}: {' '.join(str(err).split())[:300]}") from None
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"{result['codec']} codec, [{result['tokens']} x {result['dim']}] {result['dtype']}, "
        f"k={result['k']}, {result['device']}, {result['threads']} threads, median of {result['repeats']}"
    )
    print(f"  clone    {result['clone_ms']:9.3f} ms")
    prf = result["codec"] == "prf"  # the targets are the PRF codec's (a basis codec is a matmul)
    print(f"  encode   {result['encode_ms']:9.3f} ms  ({result['encode_over_clone']:.2f} x clone"
          + ("; target <= 0.3)" if prf else ")"))
    print(
        f"  decode   {result['decode_ms']:9.3f} ms  "
        f"(encode+decode {result['roundtrip_over_clone']:.2f} x clone" + ("; target <= 1.5)" if prf else ")")
    )
    print(
        f"  decode at a separate receiver (regenerates the indices) {result['receiver_decode_ms']:.3f} ms "
        f"(encode+decode {result['receiver_roundtrip_over_clone']:.2f} x clone); "
        f"index generation alone {result['index_ms']:.3f} ms"
    )
    print(
        f"  bytes/token  payload {result['payload_bytes_per_token']}  dense {result['dense_bytes_per_token']}  "
        f"({result['compression']:.2f}x)"
    )
    if "decode_over_zero_fill" in result:
        print(f"  decode vs the zero-fill prf decode in the same rounds: {result['decode_over_zero_fill']:.2f}x "
              f"({result['zero_decode_ms']:.3f} ms)")
    return 0


def add_traffic_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``bench traffic``."""
    from tclightning.bench.traffic import TrafficAssumptions

    base = TrafficAssumptions()
    parser.add_argument("--recipe", required=True, help="recipe name or path (its pipeline, grpo, sampler, anchor)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides, e.g. pipeline.layout=all")
    parser.add_argument("--model-config", default=None, metavar="PATH",
                        help="the model's config.json or its folder (default: the recipe's model.name: a local "
                             "folder or a shipped config)")
    parser.add_argument("--tokens-per-row", type=int, default=base.tokens_per_row,
                        help=f"prompt + completion tokens per sampled row (default {base.tokens_per_row})")
    parser.add_argument("--activation-dtype", default=base.activation_dtype, choices=("float32", "bfloat16", "float16"),
                        help=f"dtype of the boundary (default {base.activation_dtype})")
    parser.add_argument("--sampler-dtype", default=base.sampler_dtype, choices=("float32", "bfloat16", "float16"),
                        help=f"dtype of the sampler's weights (default {base.sampler_dtype})")
    parser.add_argument("--sync-density", type=float, default=base.sync_density,
                        help=f"share of entries a sparse sync sends per step (default {base.sync_density})")
    parser.add_argument("--distinct-ids", type=int, default=None,
                        help="distinct token ids per optimizer tick (default: Heaps' law fitted on GSM8K with "
                             "SmolLM2's tokenizer, 7.44 x tokens^0.542, at most the vocabulary)")
    parser.add_argument("--lora-rank", type=int, default=base.lora_rank, help=f"LoRA r (default {base.lora_rank})")
    parser.add_argument("--link", default="1gbit,100mbit", help="link speeds to time the bytes at (default 1gbit,100mbit)")
    parser.add_argument("--json", action="store_true", help="one JSON object per configuration per line")


def run_traffic(args: argparse.Namespace) -> int:
    """Handler of ``bench traffic``: bytes per RL step per class, per configuration."""
    from tclightning.bench.traffic import (
        CLASSES,
        TrafficAssumptions,
        link_seconds,
        parse_links,
        read_model_config,
        step_traffic,
    )
    from tclightning.errors import TclightningError
    from tclightning.recipes.loader import load_recipe, to_dataclass

    if args.tokens_per_row < 1 or not 0.0 <= args.sync_density <= 1.0 or args.lora_rank < 1 or (
            args.distinct_ids is not None and args.distinct_ids < 1):
        raise TclightningError("bench traffic: need --tokens-per-row >= 1, --sync-density in [0, 1], --lora-rank >= 1 "
                               "and --distinct-ids >= 1")
    links = parse_links(args.link)
    recipe = to_dataclass(load_recipe(args.recipe, args.overrides))
    config = read_model_config(args.model_config or recipe.model.name or "")
    positions = config.get("max_position_embeddings")
    if isinstance(positions, int) and args.tokens_per_row > positions:
        raise TclightningError(f"bench traffic: --tokens-per-row {args.tokens_per_row} is past the model's "
                               f"{positions} positions (max_position_embeddings)")
    if args.lora_rank > config["hidden_size"]:
        raise TclightningError(f"bench traffic: --lora-rank {args.lora_rank} is past the model's width "
                               f"{config['hidden_size']} (a LoRA rank is at most the smaller side of a weight)")
    assumptions = TrafficAssumptions(args.tokens_per_row, args.activation_dtype, args.sampler_dtype,
                                     args.sync_density, args.distinct_ids, args.lora_rank)
    rows = step_traffic(recipe, config, assumptions)
    dense = rows[0].total
    if args.json:
        for row in rows:
            print(json.dumps({**row.as_dict(), "share_of_dense": row.total / dense,
                              **{f"seconds_at_{name}": link_seconds(row.total, rate) for name, rate in links}}))
        return 0
    rows_per_step = recipe.grpo.prompts_per_step * recipe.sampler.group_size
    print(f"bytes per RL step, recipe {recipe.name} ({recipe.pipeline.layout} layout, {recipe.pipeline.stages} stages, "
          f"{recipe.pipeline.codec} at {recipe.pipeline.rate:g}), {config.get('model_type')} d={config['hidden_size']}, "
          f"{rows_per_step} rows x {args.tokens_per_row} tokens, {args.activation_dtype} boundary, "
          f"{args.sampler_dtype} sampler, sparse sync at {args.sync_density:g}, LoRA r={args.lora_rank}")
    head = ["config", *CLASSES, "total", "vs dense", *(f"s @ {name}" for name, _ in links)]
    print("| " + " | ".join(head) + " |")
    print("| --- " * len(head) + "|")
    for row in rows:
        cells = [row.config, *(f"{row.classes[c] / 1e9:.3f} GB" for c in CLASSES), f"{row.total / 1e9:.3f} GB",
                 f"{row.total / dense:.1%}", *(f"{link_seconds(row.total, rate):.1f}" for _, rate in links)]
        print("| " + " | ".join(cells) + " |")
    return 0


def add_link_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``bench link`` (shared with ``benchmarks/slow_link.py``)."""
    layouts = ("dense", "shallow", "all")
    parser.add_argument("--bandwidth", type=float, nargs="+", default=[200.0], metavar="MBIT",
                        help="link rates in Mbit/s (default 200; the README table uses 50 200 1000)")
    parser.add_argument("--layouts", nargs="+", default=list(layouts), choices=layouts, metavar="LAYOUT",
                        help="any of dense, shallow, all (default: all three)")
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages = processes (default 2)")
    parser.add_argument("--link", default="auto", choices=("auto", "netns", "paced"),
                        help="tc-shaped network namespace, software pacing, or netns where possible (default)")
    parser.add_argument("--rows", type=int, default=8, help="sequences per step (default 8)")
    parser.add_argument("--length", type=int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument("--dim", type=int, default=1536, help="boundary width d (default 1536)")
    parser.add_argument("--k", type=int, default=77, help="PRF values per token (default 77 = 5%% of 1536)")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedule", default="gpipe", choices=("gpipe", "1f1b"))
    parser.add_argument("--steps", type=int, default=5, help="timed steps per layout (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def run_link(args: argparse.Namespace) -> int:
    """Handler of ``bench link``: the slow-link table (``benchmarks/slow_link.py`` runs the same)."""
    from tclightning.bench.link import format_table, run_link_bench

    for flag, value, high in (("--stages", args.stages, 64), ("--rows", args.rows, 4096), ("--length", args.length, 65536),
                              ("--dim", args.dim, 65536), ("--microbatches", args.microbatches, 4096),
                              ("--steps", args.steps, 10000), ("--warmup", args.warmup, 10000)):
        within("bench link", flag, value, 0 if flag == "--warmup" else 1, high)
    within("bench link", "--rows x --length x --dim", args.rows * args.length * args.dim, 1, 1 << 30)
    result = run_link_bench(
        bandwidths=args.bandwidth, layouts=args.layouts, stages=args.stages, link=args.link, rows=args.rows,
        length=args.length, dim=args.dim, k=args.k, microbatches=args.microbatches, schedule=args.schedule,
        steps=args.steps, warmup=args.warmup,
    )
    print(json.dumps(result) if args.json else format_table(result))
    return 0


def add_step_link_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``bench step-link``."""
    from tclightning.bench.step_link import CONFIGS

    parser.add_argument("--recipe", default="smollm2-dense", help="the dense recipe (default smollm2-dense)")
    parser.add_argument("--compressed-recipe", default="smollm2-fast-only-lowrank",
                        help="the compressed recipe (default smollm2-fast-only-lowrank)")
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4], help="stage counts = nodes (default 2 4)")
    parser.add_argument("--bandwidth", type=float, nargs="+", default=[50.0, 200.0, 1000.0], metavar="MBIT",
                        help="link rates in Mbit/s, each besides an unshaped run (default 50 200 1000)")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS, metavar="CONFIG",
                        help=f"any of {', '.join(CONFIGS)} (default: all)")
    parser.add_argument("--steps", type=int, default=3,
                        help="RL steps per run; all but the first are timed (default 3)")
    parser.add_argument("--dir", default=None, help="working directory of the runs (default: a temporary folder)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds before one run's nodes are stopped")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides for every run")


def run_step_link(args: argparse.Namespace) -> int:
    """Handler of ``bench step-link``: the whole-step table (or JSON)."""
    from tclightning.bench.step_link import format_table, run_step_link_bench

    within("bench step-link", "--timeout", args.timeout, 1, 7 * 86400)  # nan fails the comparison too
    for stages in args.stages:  # a node a stage, each a namespace with an address of one /24
        within("bench step-link", "--stages", stages, 2, 64)
    workdir = None if args.dir is None else work_folder("bench step-link", args.dir)
    result = run_step_link_bench(
        dense_recipe=args.recipe, compressed_recipe=args.compressed_recipe, stages=args.stages,
        bandwidths=args.bandwidth, configs=args.configs, steps=args.steps, overrides=args.overrides,
        workdir=workdir, timeout_s=args.timeout,
        echo=lambda line: print(line, file=sys.stderr if args.json else sys.stdout),
    )
    print(json.dumps(result) if args.json else format_table(result))
    return 0


def work_folder(command: str, folder: str) -> Path:
    """``--dir`` made (with its parents) and written to once, as an absolute path: a file or a
    dangling link on the way, a read-only mount or ``/proc`` is one line before anything starts."""
    from tclightning.cli.options import refuse_url
    from tclightning.errors import TclightningError
    from tclightning.files import in_the_way, require_writable

    refuse_url(f"{command}: --dir", folder)
    blocking = in_the_way(Path(folder))
    if blocking is not None:
        raise TclightningError(f"{command}: --dir {folder}: {blocking[0]} {blocking[1]}")
    where = Path(folder).resolve()
    try:
        where.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise TclightningError(f"{command}: --dir {folder}: cannot make the folder ({err.strerror})") from None
    require_writable(where, f"{command}: --dir {folder}", TclightningError)
    return where


def run_two_node_launch(args: argparse.Namespace) -> int:
    """Handler of ``bench two-node``: both nodes' commands, exit codes and the link's byte counters."""
    from tclightning.bench.link import LINK_MBIT
    from tclightning.bench.nodes import first_error_line, run_nodes
    from tclightning.console import shown
    from tclightning.errors import TclightningError

    within("bench two-node", "--mbit", args.mbit, *LINK_MBIT)  # nan fails the comparison too
    within("bench two-node", "--timeout", args.timeout, 1, 7 * 86400)
    within("bench two-node", "--per-node", args.per_node, 1, 64)
    where = work_folder("bench two-node", args.dir)
    run_args = args.run_args[1:] if args.run_args[:1] == ["--"] else args.run_args
    result = run_nodes(run_args, per_node=args.per_node, mbit=args.mbit, run_dir=where / "run", cwd=where,
                          timeout_s=args.timeout)
    print(json.dumps({key: value for key, value in result.items() if key != "stderr"}, indent=1))
    failed = [node for node, code in enumerate(result["returncodes"]) if code != 0]
    if not failed:
        return 0
    refusal = first_error_line(where / f"node{failed[0]}.log")  # the run refused its arguments: exit 2, as it does
    said = f": {refusal.removeprefix('error: ')}" if refusal else ""
    print(shown(f"error: bench two-node: node {failed[0]} exited with {result['returncodes'][failed[0]]}{said}; "
                f"the nodes' output is in {where}/node*.log"), file=sys.stderr)
    return 2 if refusal else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="bench tools")
    tools = parser.add_subparsers(dest="bench_command", metavar="TOOL")
    codec = tools.add_parser("codec", help="time the PRF codec against clone() and report bytes per token")
    add_codec_arguments(codec)
    codec.set_defaults(func=run_codec)
    link = tools.add_parser(
        "link", help="pipelined steps of 2 stage processes over a tc-shaped slow link: dense vs compressed layouts"
    )
    add_link_arguments(link)
    link.set_defaults(func=run_link)
    traffic = tools.add_parser(
        "traffic", help="bytes per RL step per traffic class from a recipe and a model config (no weights)")
    add_traffic_arguments(traffic)
    traffic.set_defaults(func=run_traffic)
    step_link = tools.add_parser(
        "step-link", help="whole RL steps, one stage per node over a tc-shaped switch: dense vs compressed")
    add_step_link_arguments(step_link)
    step_link.set_defaults(func=run_step_link)
    two = tools.add_parser(
        "two-node", help="tclightning run as 2 torchrun nodes in 2 network namespaces on a switch with tc-shaped ports"
    )
    two.add_argument("--per-node", type=int, default=1, help="processes per node (trainer.devices)")
    two.add_argument("--mbit", type=float, default=100.0,
                     help="link rate in Mbit/s (tc tbf on each node's up- and downlink)")
    two.add_argument("--dir", default="two-node", help="working directory; the run writes into <dir>/run")
    two.add_argument("--timeout", type=float, default=900.0, help="seconds before both nodes are stopped")
    two.add_argument("run_args", nargs=argparse.REMAINDER,
                     help="after --: arguments of tclightning run, e.g. -- --recipe all-compressed pipeline.stages=2")
    two.set_defaults(func=run_two_node_launch)


def main_codec(argv: Sequence[str] | None = None) -> int:
    """``benchmarks/codec.py`` entry point: the same options and output as ``tclightning bench codec``."""
    parser = argparse.ArgumentParser(description="PRF codec benchmark (same as `tclightning bench codec`)")
    add_codec_arguments(parser)
    return run_codec(parser.parse_args(argv))


def main_link(argv: Sequence[str] | None = None) -> int:
    """``benchmarks/slow_link.py`` entry point: the same options and output as ``tclightning bench link``."""
    parser = argparse.ArgumentParser(description="Slow-link pipeline benchmark (same as `tclightning bench link`)")
    add_link_arguments(parser)
    return run_link(parser.parse_args(argv))


def main_step_link(argv: Sequence[str] | None = None) -> int:
    """``benchmarks/step_link.py`` entry point: the same options and output as ``tclightning bench step-link``."""
    parser = argparse.ArgumentParser(
        description="Whole RL steps over a slow link (same as `tclightning bench step-link`)")
    add_step_link_arguments(parser)
    return run_step_link(parser.parse_args(argv))
