"""Layouts, cuts and the pipeline Strategy.

* :class:`PipelineConfig` (``config.py``) -- the recipe's ``pipeline:`` section
* :func:`resolve_layout` (``layout.py``) -- config + model depth -> cuts, which compressed, codecs
* :class:`Boundary`, :class:`Wire` (``boundary.py``) -- the autograd cut and its transport seam
* :class:`CutSet` (``cuts.py``) -- cuts installed as hooks on a HF decoder
* :class:`PipelineStrategy` (``strategy.py``) -- registered as ``"pipeline"`` on import
* :class:`LocalBackend` (``backends.py``) -- the update's backend in one process (cuts in-graph)

Across processes: ``stage.py`` (one stage as a module), ``engine.py`` (the schedule),
``comm.py`` (collectives, counted sends, failures), ``backends.py`` (``PipelineBackend``) and
``multiprocess.py`` (the Strategy). Nothing here imports the algorithm that uses it.
"""

from __future__ import annotations

from tclightning.pipeline.backends import LocalBackend
from tclightning.pipeline.boundary import Boundary, LoopbackWire, Wire, WireMeter
from tclightning.pipeline.config import LAYOUTS, PipelineConfig
from tclightning.pipeline.cuts import CutSet, find_decoder_layers, hook_free_copy, install_cuts, strip_cut_hooks
from tclightning.pipeline.layout import CutSpec, even_split_cuts, resolve_layout
from tclightning.pipeline.strategy import STRATEGY_NAME, PipelineStrategy, register

register()

__all__ = [
    "LAYOUTS",
    "STRATEGY_NAME",
    "Boundary",
    "CutSet",
    "CutSpec",
    "LocalBackend",
    "LoopbackWire",
    "PipelineConfig",
    "PipelineStrategy",
    "Wire",
    "WireMeter",
    "even_split_cuts",
    "find_decoder_layers",
    "hook_free_copy",
    "install_cuts",
    "register",
    "resolve_layout",
    "strip_cut_hooks",
]
