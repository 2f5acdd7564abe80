"""PRF codec benchmark: ``python benchmarks/codec.py --json`` == ``tclightning bench codec --json``.

Times ``clone()``, PRF encode (index generation included) and PRF decode of a [tokens x d]
activation in one process; see benchmarks/README.md ("Codec") for recorded figures.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from tclightning.cli.bench import main_codec

if __name__ == "__main__":
    sys.exit(main_codec())
