"""Metric names: the canonical ones the health rules read, and the ones other trainers log.

Pure Python (no Lightning). A *mapping* is ``{canonical name: your name}``; a *preset* is a
mapping by name: ``"trl"`` (Hugging Face TRL's ``GRPOTrainer``) and ``"verl"`` (verl's PPO/GRPO
trainer). :func:`resolve_metric_names` turns either into a mapping; :func:`set_metric_names`
sets the one every health monitor uses when it is given none (set it once, not per callback).
:func:`missing_inputs_message` words the warning a monitor gives when none of its metrics
arrived, and :func:`to_user_names` rewrites a message in the names the user logs.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping
from types import MappingProxyType

from tclightning.errors import TclightningError

#: TRL ``GRPOTrainer`` (``self._metrics`` in ``trl/trainer/grpo_trainer.py``, TRL 0.21-0.24) -> canonical.
#: ``sampling/*`` is logged only with vLLM importance-sampling correction on.
TRL: Mapping[str, str] = MappingProxyType({
    "reward/mean": "reward",
    "reward/std": "reward_std",
    "response/length_mean": "completions/mean_length",
    "response/length_max": "completions/max_length",
    "response/truncated_frac": "completions/clipped_ratio",
    "loss/kl": "kl",
    "policy/entropy": "entropy",
    "policy/clip_frac": "clip_ratio/region_mean",
    "policy/grad_norm": "grad_norm",
    "policy/lr": "learning_rate",
    "gap/abs_mean": "sampling/sampling_logp_difference/mean",
    "gap/max": "sampling/sampling_logp_difference/max",
})

#: verl (``compute_data_metrics`` in ``verl/trainer/ppo/metric_utils.py``, the actor's update
#: metrics and ``ray_trainer.py``, verl 0.4-0.6) -> canonical. ``training/rollout_probs_diff_*``
#: is logged with ``actor_rollout_ref.rollout.calculate_log_probs=True``.
VERL: Mapping[str, str] = MappingProxyType({
    "reward/mean": "critic/score/mean",
    "response/length_mean": "response_length/mean",
    "response/length_max": "response_length/max",
    "response/truncated_frac": "response_length/clip_ratio",
    "loss/kl": "actor/kl_loss",
    "policy/entropy": "actor/entropy",
    "policy/clip_frac": "actor/pg_clipfrac",
    "policy/grad_norm": "actor/grad_norm",
    "policy/lr": "actor/lr",
    "gap/prob_abs_mean": "training/rollout_probs_diff_mean",
})

PRESETS: Mapping[str, Mapping[str, str]] = MappingProxyType({"canonical": MappingProxyType({}), "trl": TRL, "verl": VERL})
"""Preset name -> ``{canonical: theirs}``. ``canonical`` is the identity (tclightning's own names)."""

MetricNames = Mapping[str, str] | str | None

_default: dict[str, str] = {}


def resolve_metric_names(spec: MetricNames, where: str = "metric_names") -> dict[str, str]:
    """``{canonical: yours}`` from a preset name (``"trl"``, ``"verl"``, ``"canonical"``), a
    mapping, or None (empty). Raises :class:`TclightningError` naming ``where`` for an unknown
    preset or a mapping with non-string entries or two canonical names on one of yours."""
    if spec is None:
        return {}
    if isinstance(spec, str):
        preset = PRESETS.get(spec.strip().lower())
        if preset is None:
            raise TclightningError(f"{where}: unknown preset {spec!r}; choose from {', '.join(PRESETS)} or give a mapping")
        return dict(preset)
    if not isinstance(spec, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in spec.items()):
        raise TclightningError(f"{where}: expected a preset name or a mapping canonical name -> your name, got {spec!r}")
    yours = list(spec.values())
    twice = sorted({v for v in yours if yours.count(v) > 1})
    if twice:
        raise TclightningError(f"{where}: {', '.join(twice)} is mapped from more than one canonical name")
    return dict(spec)


def set_metric_names(spec: MetricNames) -> dict[str, str]:
    """Set the mapping every health monitor given no ``metric_names`` uses (None clears it),
    read when training starts; returns the resolved mapping."""
    global _default
    _default = resolve_metric_names(spec)
    return dict(_default)


def default_metric_names() -> dict[str, str]:
    """The mapping set by :func:`set_metric_names` (empty: canonical names)."""
    return dict(_default)


def reader_names(spec: MetricNames, where: str = "metric_names") -> dict[str, str]:
    """The readers' direction: ``{your column: canonical}`` (for :func:`~tclightning.health.io.read_run`)."""
    return {yours: canonical for canonical, yours in resolve_metric_names(spec, where).items()}


def closest_names(expected: Iterable[str], logged: Iterable[str], n: int = 3) -> list[str]:
    """Up to ``n`` logged names that look most like any of ``expected`` (best first); compares
    whole names and their last path part, so ``train/reward`` is close to ``reward/mean``."""
    logged = sorted(set(logged))
    scores: dict[str, float] = {}
    for want in expected:
        for have in logged:
            a, b = want.lower(), have.lower()
            parts = [difflib.SequenceMatcher(None, a, b).ratio()]
            parts += [difflib.SequenceMatcher(None, x, y).ratio() for x in re.split(r"[/_]", a) for y in re.split(r"[/_]", b)
                      if len(x) > 2 and len(y) > 2]
            scores[have] = max(scores.get(have, 0.0), max(parts))
    ranked = sorted((s, name) for name, s in scores.items() if s >= 0.6)
    return [name for _, name in sorted(ranked, key=lambda t: (-t[0], t[1]))][:n]


def matching_preset(logged: Iterable[str]) -> str | None:
    """The preset whose names cover the most of ``logged`` (at least two), or None."""
    have = set(logged)
    best = max(((len(have & set(m.values())), name) for name, m in PRESETS.items() if m), default=(0, ""))
    return best[1] if best[0] >= 2 else None


def missing_inputs_message(
    monitor: str, steps: int, expected: Iterable[str], logged: Iterable[str], mapping: Mapping[str, str]
) -> str:
    """The one-line warning of a monitor that saw ``steps`` steps and none of ``expected``
    (canonical names; shown as the user's names where ``mapping`` renames them)."""
    expected = sorted(expected)
    logged = sorted(set(logged))
    shown = [mapping.get(name, name) for name in expected]
    msg = (f"[{monitor}] {steps} steps and none of its metrics arrived, so it cannot judge this run "
           f"(health/{monitor} stays -1, no data): it reads {', '.join(shown)}")
    near = closest_names(shown, logged)
    msg += f"; your module logs {', '.join(near)}" if near else f"; your module logs {len(logged)} other names"
    preset = matching_preset(logged)
    if preset is not None:
        msg += f"; these look like {preset} names: metric_names='{preset}'"
    else:
        msg += "; map yours with metric_names={'canonical': 'yours'}"
    return msg


def to_user_names(text: str, mapping: Mapping[str, str]) -> str:
    """``text`` with every canonical name that ``mapping`` renames replaced by the user's name
    (whole names only: ``gap/max`` inside ``gap/max_x`` is left alone)."""
    renames = {c: y for c, y in mapping.items() if c != y}
    if not renames:
        return text
    pattern = re.compile(r"(?<![\w/])(" + "|".join(re.escape(c) for c in sorted(renames, key=len, reverse=True)) + r")(?![\w/])")
    return pattern.sub(lambda m: renames[m.group(1)], text)
