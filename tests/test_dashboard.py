"""The TensorBoard dashboard: the Custom Scalars layout written to the event file, built from the
tags a run logs, and no always-zero ``epoch`` scalar."""

from __future__ import annotations

from pathlib import Path

import pytest

from tclightning.logging import SCALAR_LAYOUT, LayoutTensorBoardLogger, scalar_layout
from tclightning.run import run
from tests.conftest import FAST

DENSE_TAGS = {
    "reward/mean", "reward/std", "response/length_mean", "response/length_max", "response/truncated_frac",
    "loss/policy", "loss/kl", "policy/entropy", "policy/clip_frac", "policy/grad_norm", "gap/abs_mean",
    "gap/k3", "gap/max", "gap/outside_5x_frac", "gap/logp_corr", "gap/prob_abs_mean", "time/sample_s",
    "time/train_s", "throughput/tokens_per_s", "val/accuracy", "val/length_mean",
}
COMPRESSED_TAGS = DENSE_TAGS | {"wire/bytes_fwd", "wire/ratio", "anchor/latency", "anchor/cadence", "anchor/bytes",
                                "time/anchor_s", "health/state", "health/gap"}


def read_layout(tb_dir: Path) -> dict[str, dict[str, list[str]]]:
    """{category: {chart title: [tags]}} from the layout proto in the event files under ``tb_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2, metadata
    from tensorboard.util import tensor_util

    events = EventAccumulator(str(tb_dir)).Reload()
    (point,) = events.Tensors(metadata.CONFIG_SUMMARY_TAG)
    layout = layout_pb2.Layout()
    layout.ParseFromString(tensor_util.make_ndarray(point.tensor_proto).item())
    return {c.title: {chart.title: list(chart.multiline.tag) for chart in c.chart} for c in layout.category}


def charts_of(layout: dict) -> list[tuple[str, str, list[str]]]:
    return [(category, title, tags) for category, charts in layout.items() for title, (_, tags) in charts.items()]


def test_layout_shows_the_collapse_couplings_and_files_health_under_health() -> None:
    layout = scalar_layout(COMPRESSED_TAGS)
    by_category = {c: {t for _, (_, tags) in charts.items() for t in tags} for c, charts in layout.items()}
    # the two couplings: reward beside length, gap beside reward, each in one category
    assert any({"reward/mean", "response/length_mean"} <= tags for tags in by_category.values())
    assert any({"gap/abs_mean", "reward/mean"} <= tags for tags in by_category.values())
    assert not any("health/state" in tags for c, tags in by_category.items() if c == "time")
    for category, title, tags in charts_of(layout):
        # held-out accuracy is alone in its chart (outlier clipping would hide it beside rewards)
        assert "val/accuracy" not in tags or tags == ["val/accuracy"], (category, title)
        # one unit per chart: shares never share axes with bytes, ratios or nats
        assert not ({"wire/ratio", "anchor/sign_agreement"} <= set(tags)), (category, title)
        assert not ({"loss/policy", "loss/kl"} <= set(tags)), (category, title)


def test_dense_run_gets_no_empty_charts() -> None:
    layout = scalar_layout(DENSE_TAGS)
    for category, title, tags in charts_of(layout):  # every chart draws at least one line
        assert set(tags) & DENSE_TAGS, (category, title)
    assert "wire" not in layout and "anchor" not in layout and "health" not in layout
    compressed = scalar_layout(COMPRESSED_TAGS)
    assert "wire" in compressed and "anchor" in compressed and "health" in compressed
    # the anchor's sign agreement arrives K ticks late: its chart is there from the first step on
    assert any("anchor/sign_agreement" in tags for _, _, tags in charts_of(compressed))
    assert not any("health/gap_rollbacks" in tags for _, _, tags in charts_of(compressed))  # no rollback action
    assert scalar_layout(None) == {c: {t: [k, list(v)] for t, (k, v) in ch.items()} for c, ch in SCALAR_LAYOUT.items()}


def test_logger_in_a_plain_project_writes_the_layout_of_its_own_tags(tmp_path: Path) -> None:
    own = {"mine": {"reward": ["Multiline", ["train/reward"]], "unused": ["Multiline", ["other/x"]]}}
    logger = LayoutTensorBoardLogger(tmp_path, name="tb", version="", layout=own)
    logger.log_metrics({"train/reward": 0.1, "epoch": 0}, step=0)
    logger.log_metrics({"train/reward": 0.2, "epoch": 0}, step=1)
    logger.finalize("success")
    assert read_layout(tmp_path / "tb") == {"mine": {"reward": ["train/reward"]}}


@pytest.mark.parametrize("recipe", ["tiny", "shallow-compressed"])
def test_run_event_file_has_the_layout_of_its_tags_and_no_epoch(run_root: Path, recipe: str) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    extra = ["pipeline.stages=2", "anchor.latency=3", "anchor.cadence=3"] if recipe != "tiny" else []
    summary = run(recipe, [*FAST, "trainer.steps=2", "trainer.val_every=1", *extra], quiet=True)
    tb = Path(summary["run_dir"]) / "tb"
    layout = read_layout(tb)
    compressed = recipe != "tiny"
    assert ("wire" in layout) == compressed and ("anchor" in layout) == compressed  # dense: no empty charts
    if compressed:  # logged from step 3 on only, but charted from the start
        assert layout["anchor"]["sign agreement (share)"] == ["anchor/sign_agreement"]
    assert layout["learning"]["held-out accuracy (greedy)"] == ["val/accuracy"]
    scalars = set(EventAccumulator(str(tb)).Reload().Tags()["scalars"])
    assert "reward/mean" in scalars and "epoch" not in scalars


def test_trajectory_figure_has_a_title_and_labelled_axes(tmp_path: Path, monkeypatch) -> None:
    import matplotlib.figure
    import torch

    from tclightning.probes.trajectory import analyze_points, plot

    saved = []
    original = matplotlib.figure.Figure.savefig

    def keep(self, *args, **kwargs):
        saved.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    x = torch.stack([k * torch.ones(6) + 0.1 * torch.sin(torch.arange(6.0) * k) for k in range(6)])
    plot({**analyze_points(x), "steps": list(range(0, 12, 2))}, x, tmp_path / "t.png", name="20261130-101500")
    (fig,) = saved
    assert fig._suptitle is not None
    assert "20261130-101500" in fig._suptitle.get_text() and "6 points, steps 0-10" in fig._suptitle.get_text()
    for ax in fig.axes:
        assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title(), ax.get_title()
