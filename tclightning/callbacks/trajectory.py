"""``TrajectoryRecorder``: save a light-weight point of the weight trajectory every N steps.

Each point is the flattened trainable parameters (in ``named_parameters`` order) mapped to ``dim``
numbers by a fixed, seeded count sketch (a sparse random projection): coordinate ``i`` is added
with sign ``s(i)`` into bucket ``h(i)``, where ``h`` and ``s`` are seeded multiply-mod hashes of
``i``. It is computed chunk by chunk on the parameters' device, never building a ``d x dim``
matrix, costs ``O(d)`` per point, and preserves inner products in expectation
(``E[<Sx, Sy>] = <x, y>``), so the trajectory geometry (EVR₁, cosines, ratios) of the sketch
approximates that of the full weights. When the model has at most ``dim`` parameters the point is
the exact flattened weights (``method: exact``).

Files: ``<run_dir>/trajectory/point-<step:08d>.pt`` (a dict: ``step``, ``unit``, ``point`` (float32,
CPU), ``method``, ``dim``, ``seed``, ``num_params``), one per point, so a resumed run simply
rewrites the points it recomputes. Point ``k`` holds the weights after ``k`` RL steps (``unit="step"``,
the default, recorded from ``on_train_batch_end``; point 0 from ``on_train_start``) or after ``k``
optimizer ticks (``unit="tick"``, recorded from ``on_before_optimizer_step``, before the update
of tick ``k``). Written on global rank 0 only (parameters replicated across ranks; sharded models
are not supported). Analyse with ``tclightning analyze trajectory RUN_DIR`` (docs/trajectory.md).
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor

from tclightning.callbacks.steps import completed_steps
from tclightning.errors import TclightningError
from tclightning.files import HeldFolder, SameFolder, made_here, own_folder, save_tensors
from tclightning.settings import check_arguments, integer, list_of, one_of, positive, read_once, text
from tclightning.settings import seed as seed_rule

_P = 2_147_483_647  # the Mersenne prime 2^31 - 1: hash modulus
_CHUNK = 1 << 20


_POINT_NAME = re.compile(r"point-([0-9]{8,})\.pt")  # as the recorder names its points


def _hash_params(seed: int) -> tuple[int, int, int, int]:
    g = torch.Generator().manual_seed(int(seed))
    a, b, c, e = (int(v) for v in torch.randint(1, _P - 1, (4,), generator=g))
    return a, b, c, e


def sketch(tensors: Iterable[Tensor], dim: int = 4096, seed: int = 0) -> Tensor:
    """Count sketch of the concatenation of ``tensors`` flattened: a float32 CPU vector of ``dim``.

    ``out[h(i)] += s(i) x_i`` with ``h(i) = ((a i' + b) mod P) mod dim``,
    ``s(i) = 1 - 2 (((c i' + e) mod P) >> 16 & 1)``, ``i' = i mod P``, ``P = 2^31 - 1`` and
    ``(a, b, c, e)`` drawn from ``seed``.
    """
    a, b, c, e = _hash_params(seed)
    out: Tensor | None = None
    offset = 0
    for tensor in tensors:
        flat = tensor.detach().reshape(-1)
        if out is None:
            out = torch.zeros(dim, dtype=torch.float32, device=flat.device)
        for start in range(0, flat.numel(), _CHUNK):
            values = flat[start : start + _CHUNK].float().to(out.device)
            idx = torch.arange(offset + start, offset + start + values.numel(), device=out.device, dtype=torch.int64)
            idx = idx % _P
            bucket = ((idx * a + b) % _P) % dim
            sign = 1.0 - 2.0 * (((idx * c + e) % _P) >> 16 & 1).float()
            out.index_add_(0, bucket, values * sign)
        offset += flat.numel()
    if out is None:
        raise TclightningError("sketch: no parameters to record")
    return out.cpu()


def trajectory_point(tensors: Iterable[Tensor], dim: int = 4096, seed: int = 0) -> tuple[Tensor, str, int]:
    """``(point, method, num_params)``: exact flattened weights when they fit in ``dim``, else the sketch."""
    tensors = [t.detach() for t in tensors]
    num = sum(t.numel() for t in tensors)
    if num <= dim:
        return torch.cat([t.reshape(-1).float().cpu() for t in tensors]), "exact", num
    return sketch(tensors, dim, seed), "count_sketch", num


class TrajectoryRecorder(Callback):
    """Save a trajectory point of the weights every ``every`` RL steps (or optimizer ticks).

    Args:
        every: points are recorded when the step (or tick) count is a multiple of ``every``.
        unit: ``"step"`` (RL steps, default) or ``"tick"`` (optimizer steps).
        dim: size of a point (4096); the model's own size if smaller (exact points).
        seed: seed of the sketch's hashes (keep it fixed within a run).
        dirpath: where the points go (default ``<trainer.default_root_dir>/trajectory``).
        parameters: names (prefixes) of the parameters to record; default every trainable one.
    """

    def __init__(
        self, every: int = 1, unit: str = "step", dim: int = 4096, seed: int = 0,
        dirpath: str | os.PathLike[str] | None = None, parameters: list[str] | None = None,
    ) -> None:
        parameters = read_once(parameters)
        check_arguments("TrajectoryRecorder", {
            "every": (every, positive()), "unit": (unit, one_of(("step", "tick"))),
            "dim": (dim, integer(2)), "seed": (seed, seed_rule()),
            "parameters": (parameters, list_of(text(nonempty=True), optional=True, nonempty=True)),
        })
        self.every, self.unit, self.dim, self.seed = int(every), unit, int(dim), int(seed)
        self.dirpath = None if dirpath is None else Path(dirpath)
        self.parameters = None if parameters is None else list(parameters)
        self._folder: SameFolder | None = None  # the points' folder as first seen
        self._held: HeldFolder | None = None  # ... held open: every point is written into it
        self._resumed_at: int | None = None  # a resume's first step, until its first point is written

    def directory(self, trainer: pl.Trainer) -> Path:
        return self.dirpath if self.dirpath is not None else Path(trainer.default_root_dir) / "trajectory"

    def _tensors(self, pl_module: pl.LightningModule) -> list[Tensor]:
        chosen: list[Tensor] = [
            p for name, p in pl_module.named_parameters()
            if p.requires_grad and (self.parameters is None or any(name.startswith(x) for x in self.parameters))
        ]
        if not chosen:
            raise TclightningError(f"TrajectoryRecorder: no trainable parameter matches {self.parameters}")
        return chosen

    def save(self, trainer: pl.Trainer, pl_module: pl.LightningModule, index: int) -> Path | None:
        """Write point ``index`` now (rank 0); returns its path."""
        if not trainer.is_global_zero:
            return None
        with torch.no_grad():
            point, method, num = trajectory_point(self._tensors(pl_module), self.dim, self.seed)
        folder = self._hold(trainer, index)
        if self._resumed_at is not None:  # the new history's first point: the later ones go aside now
            self._set_aside_points_after(trainer, self._resumed_at)
            self._resumed_at = None
        name = f"point-{index:08d}.pt"
        record: dict[str, Any] = {
            "step": int(index), "unit": self.unit, "point": point, "method": method,
            "dim": int(point.numel()), "seed": self.seed, "num_params": int(num),
        }
        save_tensors(record, self._held.path / name)  # replaced whole: a killed run never leaves half a point
        return folder / name

    def _hold(self, trainer: pl.Trainer, index: int) -> Path:
        """The points' folder, held (see :meth:`_take`) from the first point written at ``index`` on."""
        folder = self.directory(trainer)
        if self._folder is None or self._folder.folder != folder:
            # a new run's, or one whose run folder this process made (a resume from a copied checkpoint)
            self._take(folder, fresh=index == 0 or (self.dirpath is None and made_here(folder.parent)))
        self._folder.check()  # a link or folder swapped in mid-run: said, the points never carried there
        return folder

    def _set_aside_points_after(self, trainer: pl.Trainer, index: int) -> None:
        """Move the points past ``index`` (a resume's first) into ``replaced-after-<index>/`` in the
        points' folder: a later history's (a resume from an earlier step), or those a killed run
        wrote after its last checkpoint. Left there, they were read as this run's, two histories
        mixed (the new one writes over only the points it reaches)."""
        folder = self.directory(trainer)
        assert self._held is not None
        names = os.listdir(self._held.fd)
        later = sorted(n for n in names if (m := _POINT_NAME.fullmatch(n)) is not None and int(m.group(1)) > index)
        if not later:
            return
        aside = next(name for k in range(len(names) + 1)
                     if (name := f"replaced-after-{index:08d}" + (f"-{k}" if k else "")) not in names)
        try:
            os.mkdir(aside, dir_fd=self._held.fd)
            into = os.open(aside, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=self._held.fd)
            try:
                for name in later:
                    os.rename(name, name, src_dir_fd=self._held.fd, dst_dir_fd=into)
            finally:
                os.close(into)
        except OSError as err:
            raise TclightningError(f"TrajectoryRecorder: the points of {folder} past step {index} (another history) "
                                   f"could not be moved into {aside}/ ({err.strerror or err}); the run stopped before "
                                   "writing its own there") from None
        rank_zero_info(f"trajectory: {len(later)} points past step {index} (another history, or written after the "
                       f"last checkpoint) moved to {folder / aside}")

    def _take(self, folder: Path, fresh: bool) -> None:
        """Hold the points' folder open (made if missing, never through a link) and write every
        point through it. At a new run's first point the folder (the run's own ``trajectory/``, or
        ``dirpath``) holding files already is someone's (another run's points would be written over),
        refused in one line; so is the run's own ``trajectory/`` in a run folder this process made (a
        resume from a checkpoint copied out of its run), and one that is a mount point."""
        self.teardown()
        own = self.dirpath is None
        try:
            folder.mkdir(parents=True, exist_ok=True)
            held = HeldFolder(folder, empty=fresh)
        except OSError as err:
            reason = ("holds files a new run did not write (another run's points? a new run needs an empty folder)"
                      if err.errno == errno.ENOTEMPTY else "is a link, a file or no longer a folder")
            raise TclightningError(f"TrajectoryRecorder: {folder} {reason}; no point was written there") from None
        if own and held.mount_point:
            held.close()
            raise TclightningError(f"TrajectoryRecorder: {folder} is a mount point (someone's folder mounted where the "
                                   "run keeps its points); no point was written there")
        import fcntl

        try:  # held for the fit: two fits that found it empty together never both write into it
            fcntl.flock(held.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held.close()
            raise TclightningError(f"TrajectoryRecorder: another fit is writing its points into {folder}; no point was "
                                   "written there") from None
        if own:  # the run's own trajectory/ is the folder held, whatever its name leads to later
            own_folder(folder, identity=held.identity)
        self._held, self._folder = held, SameFolder(folder)

    def teardown(self, trainer: pl.Trainer | None = None, pl_module: pl.LightningModule | None = None,
                 stage: str | None = None) -> None:
        if self._held is not None:
            self._held.close()
        self._held, self._folder = None, None

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.teardown()  # Lightning calls no teardown on a failed fit: the folder (and its lock) is let go here

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        index = completed_steps(trainer) if self.unit == "step" else int(trainer.global_step)
        # a resume: the points past it go aside with its first point, as metrics.csv's rows go with
        # its first row (a resume that stops before then leaves the run as it was)
        self._resumed_at = index or None
        if index == 0:
            self.save(trainer, pl_module, 0)  # the start of the trajectory

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.unit != "step":
            return
        step = completed_steps(trainer)
        if step % self.every == 0:
            self.save(trainer, pl_module, step)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        tick = int(trainer.global_step)
        if self.unit == "tick" and tick > 0 and tick % self.every == 0:
            self.save(trainer, pl_module, tick)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        done = completed_steps(trainer) if self.unit == "step" else int(trainer.global_step)
        if self._resumed_at is not None and done > self._resumed_at and trainer.is_global_zero:
            self._hold(trainer, done)  # a resume that trained but wrote no point: its history is this one
            self._set_aside_points_after(trainer, self._resumed_at)
            self._resumed_at = None
        tick = int(trainer.global_step)  # the weights after the last tick: no later hook sees them
        if self.unit == "tick" and tick > 0 and tick % self.every == 0:
            self.save(trainer, pl_module, tick)
