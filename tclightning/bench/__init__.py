"""Measurement tooling, never imported by training: what ``tclightning bench`` runs, and the
launcher that tests and benchmarks use to start ranks.

* ``codec``  -- PRF encode/decode time against ``clone()`` (``tclightning bench codec``)
* ``link``   -- pipelined steps of S stage processes over a shaped slow link (``tclightning bench link``)
* ``launch`` -- :func:`run_ranks`: a function on S local ranks, each rank's outcome reported apart

The command-line options live in ``tclightning/cli/bench.py``, which imports these modules;
they import nothing from ``tclightning.cli``.
"""
