"""vLLM sampler check, for a machine with a CUDA GPU and vLLM installed (it installs nothing).

    python benchmarks/vllm_check.py                       # GPU-friendly tiny random model, no files
    python benchmarks/vllm_check.py --model Qwen/Qwen2.5-0.5B-Instruct   # or a local dir / .gguf

What it checks, on the same weights in one process (see docs/vllm.md):

1. **log-probs**: vLLM samples completions (``sampler.backend=vllm``); the HF forward re-scores
   exactly those tokens (``completion_logps``, the trainer's definition) -> the six ``gap/*``
   numbers between the two (dense engines sit near 0.005 nats);
2. **greedy**: vLLM's and HF ``generate``'s greedy completions, token for token;
3. **seeds**: the same seed gives the same completions, another seed other ones;
4. **weight update**: one real optimizer step on the policy, then sampling again pushes the new
   weights into the running engine (no restart) -- its log-probs must match the *new* weights and
   not the old ones.

Prints a markdown report and exits 1 if a check fails. ``run_check`` is what tests/test_vllm.py's
GPU test calls.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch

from tclightning.models.logprobs import completion_logps
from tclightning.grpo.loss import gap_metrics
from tclightning.sampling.base import PromptFormatter, Rollouts
from tclightning.sampling.config import SamplerConfig
from tclightning.sampling.hf import HFSampler

PROMPTS = ["12+34=", "7+8=", "60+25=", "3+99="]
GAP_LIMIT = 0.05  # mean |logp_hf - logp_vllm| in nats above which the check fails (bf16 noise is ~0.01)
_FIELDS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "logp_sampler", "truncated")


def on_device(rollouts: Rollouts, device: torch.device) -> Rollouts:
    return dataclasses.replace(rollouts, **{name: getattr(rollouts, name).to(device) for name in _FIELDS})


@torch.no_grad()
def hf_gap(model: torch.nn.Module, rollouts: Rollouts, temperature: float) -> dict[str, float]:
    """gap/* between the HF forward of ``model`` and the log-probs vLLM recorded for the same tokens."""
    batch = on_device(rollouts, next(model.parameters()).device)
    logp, _ = completion_logps(model, batch, temperature)
    return gap_metrics(logp.float(), batch.logp_sampler.float(), batch.completion_mask)


def optimizer_step(model: torch.nn.Module, rollouts: Rollouts, lr: float) -> None:
    """One AdamW step on the NLL of the sampled completions (a real, in-place parameter update)."""
    batch = on_device(rollouts, next(model.parameters()).device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    logp, _ = completion_logps(model, batch, 1.0)
    loss = -(logp * batch.completion_mask).sum() / batch.completion_mask.sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.eval()


def same_completions(a: Rollouts, b: Rollouts) -> float:
    """Share of rows whose completion tokens (up to the mask) are identical."""
    rows = [
        a.completion_ids[i][a.completion_mask[i].bool()].tolist() == b.completion_ids[i][b.completion_mask[i].bool()].tolist()
        for i in range(a.num_sequences)
    ]
    return sum(rows) / len(rows)


def run_check(
    model: torch.nn.Module,
    formatter: PromptFormatter,
    prompts: list[str],
    *,
    group_size: int = 4,
    max_new_tokens: int = 32,
    temperature: float = 1.0,
    gpu_memory_utilization: float = 0.3,
    lr: float = 1e-3,
) -> dict[str, Any]:
    """Every number of the report plus ``checks`` (name -> passed)."""
    from tclightning.sampling.vllm import VLLMSampler

    model.eval()
    cfg = SamplerConfig(backend="vllm", group_size=group_size, temperature=temperature,
                        max_new_tokens=max_new_tokens,
                        vllm={"gpu_memory_utilization": gpu_memory_utilization, "enforce_eager": True})
    sampler = VLLMSampler(cfg, formatter)
    timings: dict[str, float] = {}
    started = time.perf_counter()
    sampled = sampler.generate(model, prompts, group_size=group_size, seed=1)
    timings["start + first generate (s)"] = time.perf_counter() - started
    gap_before = hf_gap(model, sampled, temperature)

    greedy_vllm = sampler.generate(model, prompts, group_size=1, seed=0, greedy=True)
    greedy_hf = HFSampler(cfg, formatter).generate(model, prompts, group_size=1, seed=0, greedy=True)
    again = sampler.generate(model, prompts, group_size=group_size, seed=1)
    other = sampler.generate(model, prompts, group_size=group_size, seed=2)

    stale = copy.deepcopy(model)
    optimizer_step(model, sampled, lr)
    started = time.perf_counter()
    after = sampler.generate(model, prompts, group_size=group_size, seed=3)
    timings["weight push + generate (s)"] = time.perf_counter() - started
    gap_after = hf_gap(model, after, temperature)
    gap_stale = hf_gap(stale, after, temperature)
    sampler.close()

    checks = {
        "vLLM log-probs match the HF forward (mean |Δ| < 0.05)": gap_before["gap/abs_mean"] < GAP_LIMIT,
        "same seed, same completions": same_completions(sampled, again) == 1.0,
        "other seed, other completions": same_completions(sampled, other) < 1.0,
        "one weight push after the optimizer step": sampler.weight_syncs == 1,
        "after the push, log-probs match the new weights": gap_after["gap/abs_mean"] < GAP_LIMIT,
        "... and not the old ones": gap_stale["gap/abs_mean"] > 2 * gap_after["gap/abs_mean"],
    }
    return {
        "sequences": sampled.num_sequences,
        "completion_tokens": int(sampled.completion_mask.sum()),
        "gap_before": gap_before,
        "gap_after_update": gap_after,
        "gap_stale_weights": gap_stale,
        "greedy_same_as_hf": same_completions(greedy_vllm, greedy_hf),
        "timings": timings,
        "checks": checks,
    }


def report(result: dict[str, Any], header: str) -> str:
    keys = ("gap/abs_mean", "gap/k3", "gap/max", "gap/outside_5x_frac", "gap/logp_corr", "gap/prob_abs_mean")
    lines = [header, "", "| comparison | " + " | ".join(keys) + " |", "| --- |" + " ---: |" * len(keys)]
    for name, key in (("vLLM vs HF, same weights", "gap_before"), ("after the weight push: vs new weights", "gap_after_update"),
                      ("after the weight push: vs old weights", "gap_stale_weights")):
        lines.append(f"| {name} | " + " | ".join(f"{result[key][k]:.4g}" for k in keys) + " |")
    lines += ["", f"Greedy completions identical to HF generate: {result['greedy_same_as_hf']:.2f} of rows.", ""]
    lines += [f"- {name}: {value:.1f}" for name, value in result["timings"].items()]
    lines += [""] + [f"- [{'x' if ok else ' '}] {name}" for name, ok in result["checks"].items()]
    return "\n".join(lines)


def load(args: argparse.Namespace) -> tuple[torch.nn.Module, PromptFormatter, list[str], str]:
    from tclightning.models.config import ModelConfig, TinyModelConfig
    from tclightning.models.loading import load_model

    if args.model == "tiny":  # head_dim 64: every vLLM attention backend takes it
        cfg = ModelConfig(source="tiny", dtype=args.dtype,
                          tiny=TinyModelConfig(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                                               intermediate_size=512, max_positions=256))
        prompts = PROMPTS
    elif args.model.endswith(".gguf"):
        cfg = ModelConfig(source="gguf", gguf_file=args.model, dtype=args.dtype)
        prompts = ["What is 12 + 34?", "Name a prime number greater than 10.", "Write one sentence about the sea."]
    else:
        cfg = ModelConfig(source="hf", name=args.model, dtype=args.dtype)
        prompts = ["What is 12 + 34?", "Name a prime number greater than 10.", "Write one sentence about the sea."]
    model, tokenizer = load_model(cfg, seed=0)
    return model.cuda(), PromptFormatter(tokenizer, None, True), prompts, cfg.gguf_file or cfg.name or "tiny random llama"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="'tiny', a HF name / local directory, or a .gguf file")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    args = parser.parse_args()
    import vllm

    model, formatter, prompts, name = load(args)
    result = run_check(model, formatter, prompts, group_size=args.group_size, max_new_tokens=args.max_new_tokens,
                       temperature=args.temperature, gpu_memory_utilization=args.gpu_memory_utilization)
    header = (f"vLLM {vllm.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}: {name} ({args.dtype}), "
              f"{result['sequences']} sequences, {result['completion_tokens']} completion tokens, "
              f"temperature {args.temperature}.")
    print(report(result, header))
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
