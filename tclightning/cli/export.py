"""`tclightning export RUN_DIR_OR_CKPT OUT [--step N] [--adapter-only]`: the trained policy as a Hugging Face
``save_pretrained`` folder (model and tokenizer), see :func:`tclightning.export.export_policy`."""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export",
        help="write a run's trained policy as a Hugging Face folder",
        description=(
            "Write the policy of a run as a Hugging Face save_pretrained folder (model and tokenizer) that "
            "transformers' AutoModelForCausalLM / AutoTokenizer.from_pretrained, vLLM and TRL load directly. "
            "RUN_DIR_OR_CKPT is a run directory (its newest readable checkpoint, or --step N) or a checkpoint file."
        ),
    )
    parser.add_argument("path", metavar="RUN_DIR_OR_CKPT", help="run directory (runs/<name>/<stamp>) or a .ckpt file")
    parser.add_argument("out", metavar="OUT", help="folder to write (must not exist or be empty)")
    parser.add_argument("--step", type=int, default=None, metavar="N",
                        help="export checkpoints/step-00000N.ckpt (the policy after N RL steps) instead of the newest")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it holds files")
    parser.add_argument("--adapter-only", action="store_true",
                        help="model.lora: write the LoRA adapters alone in PEFT's format (default: the merged model)")
    parser.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    """Handler of ``export``: 0 once the folder is written; user errors raise (exit 2)."""
    from tclightning.cli.options import refuse_url
    from tclightning.export import export_policy, find_checkpoint

    refuse_url("export: OUT", str(args.out))  # a local folder named webhdfs: was made
    source = find_checkpoint(args.path, args.step)
    for notice in source.notices:
        print(f"note: {notice}", file=sys.stderr, flush=True)
    out = export_policy(source.checkpoint, args.out, overwrite=args.overwrite, adapter_only=args.adapter_only)
    print(f"wrote {out} (policy after RL step {source.rl_step}, from {source.checkpoint})")
    return 0
