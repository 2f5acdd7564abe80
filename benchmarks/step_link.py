"""Whole RL steps over a slow link: ``python benchmarks/step_link.py`` == ``tclightning bench step-link``.

``tclightning run`` itself, one pipeline stage per node, each node in its own network namespace on
a switch whose ports are shaped with ``tc ... tbf rate <R>mbit`` (root, ``ip`` and ``tc`` needed):
sampling, the update, the weight sync to the sampler and every exchange cross the link. Dense
against compressed with and without the sparse sync and tied rows, each also unshaped; see
benchmarks/README.md ("Whole RL steps over a slow link") for the recorded table.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from tclightning.cli.bench import main_step_link

if __name__ == "__main__":
    sys.exit(main_step_link())
