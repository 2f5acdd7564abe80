"""Lightning callbacks: monitoring (length feedback, gap, collapse), the anchor's merge and
controller, checkpoints, progress.

Each monitoring callback works in any Lightning project that logs the canonical metric names
(or maps its own names in the constructor); see ``docs/health.md``.
"""

from tclightning.callbacks.anchor_controller import AnchorController
from tclightning.callbacks.anchor_merge import AnchorMerge
from tclightning.callbacks.checkpointing import GracefulStop, StepCheckpoint
from tclightning.callbacks.collapse import CollapseDetector
from tclightning.callbacks.gap_monitor import GapMonitor
from tclightning.callbacks.health_actions import HealthMonitor, HealthWarning
from tclightning.callbacks.steps import completed_steps, rl_step
from tclightning.callbacks.length_feedback import LengthFeedbackMonitor
from tclightning.callbacks.trajectory import TrajectoryRecorder
from tclightning.console import install_warning_format

install_warning_format()  # else each health warning reads ".../rank_zero.py:42: ..." in any Lightning project

__all__ = [
    "AnchorController",
    "AnchorMerge",
    "CollapseDetector",
    "GapMonitor",
    "GracefulStop",
    "HealthMonitor",
    "HealthWarning",
    "LengthFeedbackMonitor",
    "StepCheckpoint",
    "TrajectoryRecorder",
    "completed_steps",
    "rl_step",
]
