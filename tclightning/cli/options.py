"""Bounds of the subcommands' numeric options, checked before anything is loaded or allocated: a
value past them would hang the command or exhaust the machine, never measure anything."""

from __future__ import annotations

from tclightning.errors import TclightningError

MAX_THREADS = 4096
"""The most intra-op threads any command takes (as ``trainer.num_threads``)."""


def within(command: str, flag: str, value: int | float | None, low: int | float, high: int | float) -> None:
    """Refuse (one line naming ``command`` and ``flag``) a ``value`` outside ``[low, high]``; ``None``
    (the option's default) passes."""
    if value is not None and not low <= value <= high:
        raise TclightningError(f"{command}: {flag} must be in [{low}, {high}], got {value}")
