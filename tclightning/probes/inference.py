"""Inference-time compression sweep: what a codec at the pipeline cuts does to a frozen model's generations.

The training circuit keeps ``k`` of ``d`` boundary channels per token; this probe applies the same
codec, at the same cuts, while a *frozen* model generates, for several budgets:

* ``dense``   -- no codec (the reference row);
* ``prf@r``   -- exact-k PRF with ``k = round(r * d)`` at every compressed cut (zero fill);
* ``svd@r``   -- a static rank-``k`` basis per cut, fitted on calibration activations (dense forward
  of reference solutions from the task's *training* split, never the evaluated problems).

Per point: greedy accuracy on the task split (the task's verifier), the mean log-likelihood of the
reference solutions under the compressed forward (teacher forcing, nats per token), agreement with
the dense generations (exact match, and the share of the dense completion reproduced before the
first differing token), and the continuation of one shared prompt.

``rate = 1.0`` reproduces the dense output exactly: PRF with ``k = d`` sends every channel and
decodes it unchanged; a full-rank SVD basis is the identity map, so it is run as the identity codec
(its float32 projection ``U U^T`` would only add rounding noise).

PRF key during generation: HF ``generate`` feeds one new token per forward after the prompt, so the
cut sees a ``[B, 1]`` tensor whose column is always 0. To give every generated token its own kept
set, the key's ``step`` is set to ``step + (tokens already in the KV cache)`` before each forward
(the prompt forward keeps ``step`` and keys its tokens by column, as in training). Pure functions
and a context manager: no Lightning, no files; ``tclightning probe inference`` does the I/O.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from tclightning.codecs import SVDCodec, budget_k
from tclightning.errors import TclightningError
from tclightning.models.logprobs import completion_logps
from tclightning.pipeline.config import PipelineConfig
from tclightning.pipeline.cuts import CutSet, find_decoder_layers, install_cuts
from tclightning.pipeline.layout import compressed_flags, cut_layers
from tclightning.sampling.base import PromptFormatter, Rollouts
from tclightning.sampling.config import SamplerConfig
from tclightning.sampling.hf import HFSampler
from tclightning.tasks.base import Example, Task

CODECS = ("prf", "svd")


@dataclasses.dataclass(frozen=True)
class SweepPoint:
    """One generation setting: ``codec`` (``dense`` | ``prf`` | ``svd``) at budget ``rate`` (share of d)."""

    codec: str
    rate: float

    @property
    def name(self) -> str:
        return "dense" if self.codec == "dense" else f"{self.codec}@{self.rate:g}"


def sweep_points(codecs: Sequence[str], rates: Sequence[float]) -> list[SweepPoint]:
    """``dense`` first, then every codec at every rate (rates in the order given, duplicates dropped)."""
    unknown = [c for c in codecs if c not in CODECS]
    if not codecs or unknown:
        raise TclightningError(f"probe inference: --codec must name some of {', '.join(CODECS)}, got {list(codecs)}")
    bad = [r for r in rates if not 0.0 < r <= 1.0]
    if not rates or bad:
        raise TclightningError(f"probe inference: every rate must be in (0, 1], got {list(rates)}")
    unique_rates = list(dict.fromkeys(float(r) for r in rates))
    return [SweepPoint("dense", 1.0)] + [SweepPoint(c, r) for c in dict.fromkeys(codecs) for r in unique_rates]


def point_pipeline(base: PipelineConfig, point: SweepPoint, layout: str) -> PipelineConfig:
    """The cuts of ``base`` (positions, PRF seed) with ``point``'s codec and budget under ``layout``.

    ``dense`` and full-rank ``svd`` resolve to layout ``dense`` (identity codec at every cut)."""
    full_rank_svd = point.codec == "svd" and point.rate >= 1.0
    if point.codec == "dense" or full_rank_svd:
        return dataclasses.replace(base, layout="dense", cut_codecs=None)
    return dataclasses.replace(base, layout=layout, codec=point.codec, rate=point.rate, k=None, cut_codecs=None)


# ------------------------------------------------------------------------------ compressed forward
@contextlib.contextmanager
def compressed(
    model: nn.Module,
    pipeline: PipelineConfig,
    *,
    calibration: dict[int, Tensor] | None = None,
    step: int = 0,
) -> Iterator[CutSet]:
    """Install ``pipeline``'s cuts for generation; the model is hook-free again on exit.

    * svd cuts are calibrated on ``calibration[layer]`` (``[tokens, d]`` dense activations after
      that layer); without them an svd cut would fit itself to the first batch it sees, so they are
      required;
    * before every forward the PRF key's step is set to ``step + past length`` (see the module
      docstring), so prompt tokens are keyed by column and each generated token by its position.
    """
    cuts = install_cuts(model, pipeline)
    handle = None
    try:
        for spec, boundary in zip(cuts.specs, cuts.boundaries):
            codec = boundary.codec
            if isinstance(codec, SVDCodec):
                if calibration is None or spec.layer not in calibration:
                    raise TclightningError(f"probe inference: no calibration activations for the svd cut after layer {spec.layer}")
                codec.calibrate(calibration[spec.layer])

        def key_by_position(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
            # the KV cache travels as ``past_key_values`` (transformers 4) or ``cache`` (5)
            past = kwargs.get("past_key_values", kwargs.get("cache"))
            seen = past.get_seq_length() if past is not None and hasattr(past, "get_seq_length") else 0
            cuts.set_step(step + int(seen))

        handle = model.register_forward_pre_hook(key_by_position, with_kwargs=True)
        cuts.set_step(step)
        yield cuts
    finally:
        if handle is not None:
            handle.remove()
        cuts.remove()


@torch.no_grad()
def collect_activations(model: nn.Module, batch: Rollouts, layers: Sequence[int]) -> dict[int, Tensor]:
    """Dense hidden states after each of ``layers`` on the real tokens of ``batch``: ``{layer: [N, d]}``
    float32 on the CPU (the svd calibration set)."""
    _, blocks = find_decoder_layers(model)
    mask = batch.attention_mask.bool()
    captured: dict[int, Tensor] = {}
    handles = []

    def capture(layer: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            hidden = output[0] if isinstance(output, tuple) else output
            captured[layer] = hidden[mask.to(hidden.device)].float().cpu()

        return hook

    for layer in layers:
        handles.append(blocks[layer].register_forward_hook(capture(layer)))
    try:
        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
              use_cache=False, logits_to_keep=1)
    finally:
        for handle in handles:
            handle.remove()
    return captured


def reference_batch(formatter: PromptFormatter, prompts: Sequence[str], solutions: Sequence[str]) -> Rollouts:
    """``[left-padded prompt | solution + eos, right padded]`` as :class:`Rollouts`, so that
    :func:`completion_logps` scores the reference solutions exactly like sampled completions."""
    tok = formatter.tokenizer
    encoded = formatter.encode(list(prompts))
    answers = [tok(s, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for s in solutions]
    width = max(map(len, answers))
    ids = torch.tensor([a + [tok.pad_token_id] * (width - len(a)) for a in answers])
    mask = torch.tensor([[1.0] * len(a) + [0.0] * (width - len(a)) for a in answers])
    return Rollouts(
        prompt_ids=encoded["input_ids"],
        prompt_mask=encoded["attention_mask"],
        completion_ids=ids,
        completion_mask=mask,
        logp_sampler=torch.zeros_like(mask),
        texts=list(solutions),
        truncated=torch.zeros(len(answers), dtype=torch.bool),
        group_size=1,
    )


@torch.no_grad()
def reference_loglik(model: nn.Module, batch: Rollouts, batch_size: int) -> tuple[float, list[float]]:
    """Teacher-forced log-likelihood of the reference completions under the model as it stands
    (cuts included): ``(token mean over all reference tokens, per-example token means)``."""
    total, tokens, per_example = 0.0, 0.0, []
    for start in range(0, batch.num_sequences, batch_size):
        part = batch.select(torch.arange(start, min(start + batch_size, batch.num_sequences)))
        logp, _ = completion_logps(model, part, 1.0)
        mask = part.completion_mask
        total += float((logp * mask).sum())
        tokens += float(mask.sum())
        per_example += (logp.sum(-1) / mask.sum(-1).clamp_min(1)).tolist()
    return total / max(tokens, 1.0), per_example


def completion_agreement(rollouts: Rollouts, dense: Rollouts) -> tuple[float, float]:
    """(share of rows whose completion equals the dense one token for token, mean share of each dense
    completion reproduced before the first differing token)."""
    exact, prefix = [], []
    for i in range(rollouts.num_sequences):
        ours = rollouts.completion_ids[i][rollouts.completion_mask[i].bool()].tolist()
        ref = dense.completion_ids[i][dense.completion_mask[i].bool()].tolist()
        same = 0
        while same < min(len(ours), len(ref)) and ours[same] == ref[same]:
            same += 1
        exact.append(float(ours == ref))
        prefix.append(same / max(len(ref), 1))
    return sum(exact) / len(exact), sum(prefix) / len(prefix)


# ------------------------------------------------------------------------------------- the sweep
@dataclasses.dataclass
class SweepResult:
    """Rows (one per point, in order), the shared prompt, its continuation per point, and the setup."""

    rows: list[dict[str, Any]]
    shared_prompt: str
    continuations: dict[str, str]
    meta: dict[str, Any]


def inference_sweep(
    model: nn.Module,
    formatter: PromptFormatter,
    task: Task,
    examples: Sequence[Example],
    base: PipelineConfig,
    points: Sequence[SweepPoint],
    *,
    calibration_examples: Sequence[Example] = (),
    layout: str = "all",
    max_new_tokens: int = 128,
    batch_size: int = 16,
    step: int = 0,
    on_point: Callable[[dict[str, Any]], None] | None = None,
) -> SweepResult:
    """Run every point of ``points`` on ``examples`` with the frozen ``model``.

    Contract: the weights are not touched and the model is left hook-free, in its original mode.
    Generation is greedy (HF ``generate`` through :class:`HFSampler`, the trainer's sampler path) and
    the shared prompt is ``examples[0].prompt``, so its continuation is row 0 of each point's batch.
    Row keys: ``point``, ``codec``, ``rate``, ``k`` (values per token at a compressed cut),
    ``compressed_layers``, ``wire/ratio`` (dense bytes / sent bytes over all cuts in the reference
    forward), ``accuracy``, ``correct``, ``n``, ``ref_loglik`` (nats per reference token),
    ``ref_loglik_seq`` (mean over examples of per-example token means), ``exact_match`` and
    ``prefix_agree`` (against the ``dense`` point), ``length_mean``, ``truncated_frac``,
    ``energy_kept`` (svd: mean share of centred calibration variance the bases keep; else None)
    and ``seconds``. ``on_point`` (if given) receives each row as soon as it is measured.
    """
    if not examples:
        raise TclightningError("probe inference: no examples to evaluate")
    if not points or points[0].codec != "dense":
        raise TclightningError("probe inference: the first point must be dense (the reference)")
    width = int(model.config.hidden_size)
    _, blocks = find_decoder_layers(model)
    compressed_flags(dataclasses.replace(base, layout=layout), len(cut_layers(base, len(blocks))))  # before any pass
    sampler = HFSampler(SamplerConfig(max_new_tokens=max_new_tokens, batch_size=batch_size), formatter)
    prompts = [e.prompt for e in examples]
    reference = reference_batch(formatter, prompts, [e.solution for e in examples])
    calibration: dict[int, Tensor] | None = None
    if any(p.codec == "svd" and p.rate < 1.0 for p in points):
        if not calibration_examples:
            raise TclightningError("probe inference: svd needs calibration examples (the task's training split)")
        layers = cut_layers(base, len(blocks))
        calib = reference_batch(formatter, [e.prompt for e in calibration_examples],
                                [e.solution for e in calibration_examples])
        calibration = collect_activations(model, calib, layers)
    was_training = model.training
    model.eval()
    rows: list[dict[str, Any]] = []
    continuations: dict[str, str] = {}
    dense: Rollouts | None = None
    measured: dict[str, tuple] = {}  # full-rank svd resolves to the dense cuts: run once
    try:
        for point in points:
            started = time.perf_counter()
            pipeline = point_pipeline(base, point, layout)
            key = repr(pipeline)
            if key not in measured:
                with compressed(model, pipeline, calibration=calibration, step=step) as cuts:
                    generated = sampler.generate(model, prompts, group_size=1, seed=0, greedy=True)
                    cuts.set_step(step)
                    cuts.reset_stats()
                    scored = reference_loglik(model, reference, batch_size)
                    kept = [b.codec.energy_kept for b in cuts.boundaries if isinstance(b.codec, SVDCodec)]
                    layers_hit = [spec.layer for spec in cuts.specs if spec.compressed]
                    measured[key] = (generated, scored, cuts.metrics(), kept, layers_hit)
            rollouts, (loglik, per_example), wire, kept, compressed_layers = measured[key]
            if dense is None:
                dense = rollouts
            rewards = task.rewards(rollouts.texts, list(examples))
            exact, prefix = completion_agreement(rollouts, dense)
            rows.append(
                {
                    "point": point.name,
                    "codec": point.codec,
                    "rate": point.rate,
                    "k": width if not compressed_layers else budget_k(width, rate=point.rate),
                    "compressed_layers": compressed_layers,
                    "wire/ratio": wire["wire/ratio"],
                    "accuracy": sum(rewards) / len(rewards),
                    "correct": int(sum(r >= 1.0 for r in rewards)),
                    "n": len(rewards),
                    "ref_loglik": loglik,
                    "ref_loglik_seq": sum(per_example) / len(per_example),
                    "exact_match": exact,
                    "prefix_agree": prefix,
                    "length_mean": float(rollouts.lengths.mean()),
                    "truncated_frac": float(rollouts.truncated.float().mean()),
                    "energy_kept": sum(kept) / len(kept) if kept else None,
                    "seconds": time.perf_counter() - started,
                    "texts": rollouts.texts,
                }
            )
            continuations[point.name] = rollouts.texts[0]
            if on_point is not None:
                on_point(rows[-1])
    finally:
        model.train(was_training)
    meta = {
        "layers": len(blocks),
        "d": width,
        "cut_layers": cut_layers(base, len(blocks)),
        "layout": layout,
        "max_new_tokens": max_new_tokens,
        "n": len(examples),
        "calibration_examples": len(calibration_examples) if calibration is not None else 0,
        "calibration_tokens": int(next(iter(calibration.values())).shape[0]) if calibration else 0,
        "reference_tokens": int(reference.completion_mask.sum()),
    }
    return SweepResult(rows, examples[0].prompt, continuations, meta)


# ------------------------------------------------------------------------------------ rendering
def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """One line per point: budget, bytes ratio, accuracy, reference log-likelihood, agreement with dense."""
    head = (
        "| point | k per token | wire ratio | accuracy | ref log-lik (nats/token) | same as dense | dense prefix kept "
        "| mean length | svd energy kept |\n"
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n"
    )
    lines = []
    for r in rows:
        energy = "" if r["energy_kept"] is None else f"{r['energy_kept']:.3f}"
        lines.append(
            f"| {r['point']} | {r['k']} | {r['wire/ratio']:.2f} | {r['accuracy']:.3f} ({r['correct']}/{r['n']}) "
            f"| {r['ref_loglik']:.3f} | {r['exact_match']:.3f} | {r['prefix_agree']:.3f} | {r['length_mean']:.1f} "
            f"| {energy} |"
        )
    return head + "\n".join(lines) + "\n"


def markdown_continuations(result: SweepResult) -> str:
    """The shared prompt, then each point's greedy continuation in a fenced block."""
    quoted = "\n".join(f"> {line}" if line else ">" for line in result.shared_prompt.splitlines())
    parts = [f"Shared prompt (user message):\n\n{quoted}\n"]
    for name, text in result.continuations.items():
        body = text.strip().replace("```", "'''") or "(empty)"
        parts.append(f"**{name}**\n\n```text\n{body}\n```\n")
    return "\n".join(parts)


__all__ = [
    "CODECS",
    "SweepPoint",
    "SweepResult",
    "collect_activations",
    "completion_agreement",
    "compressed",
    "inference_sweep",
    "markdown_continuations",
    "markdown_table",
    "point_pipeline",
    "reference_batch",
    "reference_loglik",
    "sweep_points",
]
