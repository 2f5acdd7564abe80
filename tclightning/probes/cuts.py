"""Cut pricing: what each compressed cut costs in sampler-trainer gap, and what it saves in bytes.

One fixed batch of completions, sampled once by the dense policy, is re-scored by the trainer's
forward under several layouts of the same cuts:

* ``dense``      -- every cut carries the identity codec (sanity: gap ~0, ratio 1);
* ``solo:i``     -- only cut ``i`` compressed (one row per cut);
* ``first:n``    -- the ``n`` shallowest cuts compressed (n = 1 .. N-1; ``first:1`` == ``solo:0``);
* ``all``        -- every cut compressed (== ``first:N``).

For each, the six ``gap/*`` numbers of :func:`tclightning.grpo.loss.gap_metrics` and the forward
bytes per real token as counted by the :class:`~tclightning.pipeline.cuts.CutSet` itself.
Pure function: no Lightning, no files; the CLI (``tclightning probe cuts``) does the I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from tclightning.errors import TclightningError
from tclightning.models.logprobs import completion_logps
from tclightning.grpo.loss import gap_metrics
from tclightning.pipeline.config import PipelineConfig
from tclightning.pipeline.cuts import install_cuts
from tclightning.sampling.base import Rollouts

GAP_KEYS = (
    "gap/abs_mean",
    "gap/k3",
    "gap/max",
    "gap/outside_5x_frac",
    "gap/logp_corr",
    "gap/prob_abs_mean",
)
BYTE_KEYS = ("bytes_fwd_per_token", "dense_bytes_fwd_per_token", "wire/ratio")
"""Per-row byte columns: forward payload bytes per real token summed over all cuts (what one
forward sends), what the dense boundary would send, and ``wire/ratio`` (dense / sent)."""


@dataclasses.dataclass(frozen=True)
class ProbeConfig:
    """One configuration of the sweep: its row name, kind and the layout that realises it."""

    name: str  # dense | solo:i | first:n | all
    kind: str  # dense | solo | cumulative | all
    pipeline: PipelineConfig


def probe_configurations(base: PipelineConfig, n_cuts: int) -> list[ProbeConfig]:
    """The sweep, in row order: dense, solo:0..N-1, first:1..N-1, all.

    Cut positions, codec and budget come from ``base``; its ``layout`` (and any
    ``explicit`` lists) are replaced, so every compressed cut uses ``base.codec``."""
    if n_cuts < 1:
        raise TclightningError("probe cuts: the pipeline has no cut (set pipeline.stages >= 2 or pipeline.cuts)")

    def layout(name: str) -> PipelineConfig:
        return dataclasses.replace(base, layout=name, cut_codecs=None)

    configs = [ProbeConfig("dense", "dense", layout("dense"))]
    configs += [ProbeConfig(f"solo:{i}", "solo", layout(f"solo:{i}")) for i in range(n_cuts)]
    configs += [
        ProbeConfig(f"first:{n}", "cumulative", layout(f"shallow:{n}")) for n in range(1, n_cuts)
    ]
    configs.append(ProbeConfig("all", "all", layout("all")))
    return configs


@torch.no_grad()
def price_cuts(
    model: nn.Module,
    rollouts: Rollouts,
    base: PipelineConfig,
    temperature: float = 1.0,
    *,
    step: int = 0,
    warmup: Rollouts | None = None,
    warmup_steps: int = 1,
) -> list[dict[str, Any]]:
    """Gap and bytes per token of each configuration of :func:`probe_configurations`.

    Contract:

    * ``rollouts`` were sampled once by the dense policy (``logp_sampler`` at ``temperature``);
      every configuration re-scores exactly these tokens with :func:`completion_logps`.
    * Each configuration installs its own :class:`CutSet`, sets the PRF key's step to ``step``
      (the same for all rows, so a cut sees the same kept coordinates in ``solo`` and ``all``),
      and removes every hook before the next one: the model is left hook-free and in its
      original train/eval mode. The weights are not touched.
    * Codecs with state (the ``lowrank``/``svd`` bases) are warmed first on ``warmup`` -- other
      completions, as a run's codecs learn from earlier steps -- or, without it, on the measured batch itself (in-sample, optimistic).
      ``warmup``'s rows are split into ``warmup_steps`` consecutive steps, each folded in as a run
      folds a step: its dense activations at each cut (what an anchor's dense pass hands the
      codecs; computed once, then handed to every row's codecs), the step change to key
      ``step + 1 + i`` that folds them in, then one compressed forward at that key (skipped after
      the last share unless a codec calibrates on it or still crosses dense: nothing else reads
      it before the measured batch). That warming is not counted.
    * Bytes: the CutSet's own meter (real tokens of the forward's ``attention_mask``), divided
      by the number of real tokens in the batch; forward only (no backward runs here).

    Returns one dict per row with ``config``, ``kind``, ``compressed_cuts`` (ordinals),
    ``compressed_layers``, ``n_compressed``, ``depth`` (deepest compressed layer, -1 for dense),
    the six ``gap/*`` keys, :data:`BYTE_KEYS`, ``codec``, ``k``, ``tokens`` (real tokens counted
    per forward) and ``completion_tokens``.
    """
    device = next(model.parameters()).device
    rollouts = rollouts.to(device)
    tokens = int(rollouts.attention_mask.sum())  # the mask the CutSet counts bytes over
    completion_tokens = int(rollouts.completion_mask.sum())
    if completion_tokens == 0:
        raise TclightningError("probe cuts: the sampled batch has no completion tokens")
    was_training = model.training
    model.eval()  # no dropout: the gap must come from the cuts alone
    rows: list[dict[str, Any]] = []
    cache: dict[tuple[bool, ...], dict[str, Any]] = {}  # first:1 == solo:0: score it once
    dense_taps: dict[int, list[tuple[int, torch.Tensor, torch.Tensor | None]]] = {}  # the same for every row
    try:
        probe_cuts = install_cuts(model, dataclasses.replace(base, layout="dense", cut_codecs=None))
        specs = probe_cuts.specs
        probe_cuts.remove()
        for probe in probe_configurations(base, len(specs)):
            cuts = install_cuts(model, probe.pipeline)
            try:
                flags = tuple(spec.compressed for spec in cuts.specs)
                if flags not in cache:
                    cache[flags] = _score(model, rollouts, cuts, temperature, step, tokens,
                                          warmup.to(device) if warmup is not None else rollouts, warmup_steps,
                                          dense_taps)
                measured = cache[flags]
                compressed = [spec for spec in cuts.specs if spec.compressed]
            finally:
                cuts.remove()
            rows.append(
                {
                    "config": probe.name,
                    "kind": probe.kind,
                    "compressed_cuts": [spec.ordinal for spec in compressed],
                    "compressed_layers": [spec.layer for spec in compressed],
                    "n_compressed": len(compressed),
                    "depth": max((spec.layer for spec in compressed), default=-1),
                    **measured,
                    "codec": base.codec,
                    "k": specs[0].k,
                    "tokens": tokens,
                    "completion_tokens": completion_tokens,
                }
            )
    finally:
        model.train(was_training)
    return rows


STATEFUL_CODECS = ("lowrank", "svd")


def is_stateful(config: PipelineConfig) -> bool:
    """Whether the compressed cuts of ``config`` learn state from traffic (a basis)."""
    return config.codec in STATEFUL_CODECS


def _score(model: nn.Module, rollouts: Rollouts, cuts: Any, temperature: float, step: int, tokens: int,
           warmup: Rollouts, warmup_steps: int, dense_taps: dict[int, list[Any]]) -> dict:
    """One compressed re-score of the batch under installed ``cuts``: gap/* and bytes per token
    (stateful codecs warmed on ``warmup`` first, see :func:`price_cuts`). ``dense_taps``: each
    warm-up step's dense activations at the cuts, recorded by the first row that warms and handed
    to the next rows' codecs as they were (the dense forward is the same for every row)."""
    if cuts.compressed and is_stateful(cuts.config):
        rows = torch.arange(warmup.num_sequences)
        shares = torch.tensor_split(rows, min(warmup_steps, len(rows)))
        for offset, part in enumerate(shares):
            chunk = warmup.select(part)
            if offset not in dense_taps:
                seen: list[Any] = []
                with cuts.bypassed(), cuts.observing_dense(model, chunk.attention_mask, chunk.input_ids,
                                                           sink=lambda *tap: seen.append(tap)):
                    completion_logps(model, chunk, temperature)
                dense_taps[offset] = seen
            for ordinal, dense, ids in dense_taps[offset]:
                cuts.observe_dense(ordinal, dense, ids)
            cuts.set_step(step + 1 + offset)  # folds the step before
            # the share's compressed forward feeds what the codecs learn at the next step change
            # (and calibrates a codec fitted on its first message); after the last share no check
            # comes before the measured batch, so it changes nothing unless a codec calibrates on
            # it or still crosses dense (and would fold it in)
            learning = any(b.codec.needs_calibration or b.codec.crosses_dense for b in cuts.boundaries)
            if offset < len(shares) - 1 or learning:
                completion_logps(model, chunk, temperature)
        cuts.set_step(step)  # folds the last warm-up step into the codecs' state
    cuts.reset_stats()
    logp_trainer, _ = completion_logps(model, rollouts, temperature)
    wire = cuts.metrics()
    gaps = gap_metrics(logp_trainer, rollouts.logp_sampler, rollouts.completion_mask)
    return {
        **{key: gaps[key] for key in GAP_KEYS},
        "bytes_fwd_per_token": wire["wire/bytes_fwd"] / tokens,
        "dense_bytes_fwd_per_token": wire["wire/dense_bytes_fwd"] / tokens,
        "wire/ratio": wire["wire/ratio"],
    }


def cumulative_series(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The shallow-first curve: ``first:1 .. first:N-1`` then ``all`` (= ``first:N``), in order."""
    return [row for row in rows if row["kind"] in ("cumulative", "all")]


__all__ = ["BYTE_KEYS", "GAP_KEYS", "ProbeConfig", "cumulative_series", "price_cuts", "probe_configurations"]
