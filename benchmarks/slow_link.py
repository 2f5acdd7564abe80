"""Slow-link benchmark: ``python benchmarks/slow_link.py`` == ``tclightning bench link``.

2 pipeline stages, each in its own process, inside a fresh network namespace whose loopback is
shaped with ``tc ... tbf rate <R>mbit`` (root, ``ip`` and ``tc`` needed; otherwise a software-paced
link, said so in the output); a d=1536 model with thin layers. Reports step time and boundary
bytes for the dense, shallow-compressed and all-compressed layouts; see benchmarks/README.md
("Slow link") for the recorded table.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from tclightning.cli.bench import main_link

if __name__ == "__main__":
    sys.exit(main_link())
