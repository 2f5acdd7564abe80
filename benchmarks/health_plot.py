"""Draw docs/img/health_late_collapse.png and docs/img/health_ratchet.png: a synthetic collapse trace
and where the health detector fired.

    PYTHONPATH=. python benchmarks/health_plot.py
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from tclightning.health.detector import HealthDetector
from tclightning.health.rules import HealthState
from tclightning.health.traces import Trace, late_length_collapse, stale_anchor_ratchet

OUT = Path(__file__).resolve().parents[1] / "docs" / "img"


def plot(trace: Trace, path: Path, first_step: int = 0) -> None:
    detector = HealthDetector()
    states = np.array([int(detector.update(step, metrics).state) for step, metrics in trace.rows])
    steps = np.array([s for s, _ in trace.rows])
    fig, axes = plt.subplots(4, 1, figsize=(9, 9), sharex=True, gridspec_kw={"height_ratios": [3, 2, 2, 1]})
    ax = axes[0]
    vs, va = trace.series("val/accuracy")
    rs, rv = trace.series("reward/mean")
    ax.plot(rs, rv, color="0.75", lw=0.8, label="reward/mean (per step)")
    ax.plot(vs, va, "o-", ms=3, color="C0", label="val/accuracy")
    ax.plot(steps, trace.accuracy_true, color="C0", lw=0.8, ls="--", label="true accuracy")
    ax.axhline(trace.start_accuracy, color="k", lw=0.6, ls=":", label="starting accuracy")
    ax.set_ylabel("reward / accuracy")
    ax.legend(loc="lower left", fontsize=8)
    ls, lv = trace.series("response/length_mean")
    axes[1].plot(ls, lv, color="C1", label="response/length_mean")
    ts, tv = trace.series("response/truncated_frac")
    twin = axes[1].twinx()
    twin.plot(ts, tv, color="C3", lw=0.8, label="response/truncated_frac")
    twin.set_ylabel("truncated share", color="C3")
    axes[1].set_ylabel("tokens", color="C1")
    gs, gv = trace.series("gap/abs_mean")
    axes[2].plot(gs, gv, color="C2", label="gap/abs_mean")
    axes[2].axhline(0.5, color="C2", lw=0.6, ls=":", label="gap band 0.5")
    axes[2].set_ylabel("gap (nats)")
    axes[2].legend(loc="upper left", fontsize=8)
    axes[3].step(steps, states, where="post", color="k")
    axes[3].set_yticks([0, 1, 2], ["healthy", "warning", "collapsing"])
    axes[3].set_ylabel("health/state")
    axes[3].set_xlabel("RL step")
    marks = [(detector.first_warning_step, "C1", "first warning"),
             (trace.collapse_step, "k", "accuracy below start"),
             (detector.first_collapse_step, "C3", "first collapsing verdict")]
    for step, colour, label in marks:
        if step is None:
            continue
        for a in axes:
            a.axvline(step, color=colour, lw=1.0, ls="--")
        axes[0].annotate(f"{label} (step {step})", (step, axes[0].get_ylim()[1]), rotation=90, va="top", ha="right",
                         fontsize=8, color=colour)
    fired = [e for e in detector.events if e.kind in ("fired", "escalated")]
    text = "\n".join(f"step {e.step}: {e.severity} {e.rule}" for e in fired[:8])
    axes[3].text(1.01, 1.0, text, transform=axes[3].transAxes, fontsize=7, va="top", family="monospace")
    axes[0].set_xlim(first_step, steps[-1])
    lead = (trace.collapse_step - detector.first_warning_step) if detector.first_warning_step is not None else None
    fig.suptitle(f"{trace.name}: {trace.description}\nfirst warning {lead} steps before accuracy falls below its start",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {path} (first warning {detector.first_warning_step}, below start {trace.collapse_step}, "
          f"collapsing {detector.first_collapse_step}; state counts {np.bincount(states, minlength=3).tolist()} "
          f"{[s.label for s in HealthState]})")


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    plot(late_length_collapse(0), OUT / "health_late_collapse.png", first_step=80)
    plot(stale_anchor_ratchet(0), OUT / "health_ratchet.png")


if __name__ == "__main__":
    main()
