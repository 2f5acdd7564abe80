"""What a small torch file can hide from ``torch.load(weights_only=True)``: a tensor that expands
to gigabytes once used (a stride of 0) and a compressed zip record. Checked before a file written
by someone else is used: checkpoints, trajectory points."""

from __future__ import annotations

import dataclasses
import os
import zipfile
from collections.abc import Iterator
from typing import IO, Any

import torch


def contents(value: Any) -> Iterator[Any]:
    """What a loaded container holds: a dict's keys and values, a list's, tuple's or set's items, a
    dataclass instance's fields (the allow-listed objects a checkpoint may hold, such as the
    anchor circuit's ``Rollouts``); nothing for anything else."""
    if isinstance(value, dict):
        yield from value.keys()
        yield from value.values()
    elif isinstance(value, (list, tuple, set, frozenset)):
        yield from value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        yield from vars(value).values()


def thin_tensor(obj: Any) -> str | None:
    """Why a tensor in ``obj`` is not one torch.save writes for state of its own, or None: a
    strided tensor whose storage holds fewer bytes than its shape covers (a stride of 0 makes one
    stored number a weight of any size, and copying it into a model or an optimizer allocates all
    of it), or a tensor of another layout. Walks all of ``obj``: bound it first."""
    stack = [obj]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            if value.layout != torch.strided:
                return f"it holds a tensor of layout {value.layout}, not a dense one"
            covered = value.numel() * value.element_size()
            stored = value.untyped_storage().nbytes()
            if covered > stored:
                return (f"it holds a tensor of shape {tuple(value.shape)} over {stored} stored bytes, where its "
                        f"shape covers {covered}")
        else:
            stack.extend(contents(value))
    return None


def compressed_record(path: str | os.PathLike | IO[bytes]) -> str | None:
    """The name of a compressed record of the zip file ``path``, if any: ``torch.save`` stores
    every record as it is, and a deflated one is how a small file asks for gigabytes. A file that
    is no zip is torch.load's to judge. An open file is read from and left where it was."""
    start = path.tell() if not isinstance(path, (str, os.PathLike)) else None
    try:
        with zipfile.ZipFile(path) as archive:
            return next((info.filename for info in archive.infolist() if info.compress_type != zipfile.ZIP_STORED),
                        None)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return None
    finally:
        if start is not None:
            path.seek(start)

