"""Shared fixtures: tiny, fast settings on top of the shipped `tiny` recipe."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

# A run small enough for unit tests (~0.1 s a step on a 2-core CPU).
FAST = [
    "model.warmup.steps=0",
    "model.tiny.hidden_size=32",
    "model.tiny.num_layers=2",
    "model.tiny.intermediate_size=64",
    "sampler.group_size=4",
    "sampler.max_new_tokens=4",
    "grpo.prompts_per_step=4",
    "trainer.num_threads=1",
    "task.eval_size=8",
    "task.num_train=64",
    "logging.progress=none",
]


def two_step_run(root: Path) -> Path:
    """The run directory of a finished two-step tiny run under ``root``, a checkpoint each step:
    what the hostile-input tests copy and then damage."""
    from tclightning.run import run

    summary = run("tiny", [*FAST, "trainer.steps=2", "trainer.val_every=0", "trainer.checkpoint_every=1",
                           f"logging.root={root}"], quiet=True)
    return Path(summary["run_dir"])


def _global(dotted: str) -> bytes:
    module, _, name = dotted.rpartition(".")
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _text(value: str) -> bytes:
    data = value.encode("utf-8", "surrogatepass")
    return b"X" + len(data).to_bytes(4, "little") + data


def _int(value: int) -> bytes:  # LONG1: any size
    data = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(data)]) + data


def _shared_tuples(levels: int) -> bytes:
    """A tuple holding the one before it twice, ``levels`` deep: a few bytes per level, 2^levels to hash."""
    ops = _text("x") + b"q\x00"
    for _ in range(levels):
        ops += b"h\x00\x86q\x00"  # t (on the stack) and t again: (t, t), memoised as the next t
    return ops


def _colliding_pairs(count: int) -> list[tuple[int, int]]:
    """Pairs of small ints (each hashing to itself) whose 2-tuples all share one hash: CPython's
    tuple hash (xxHash's lanes) solved for the second item."""
    mod, p1, p2, p5 = 2**64, 11400714785074694791, 14029467366897019727, 2870177450012600261

    def rotate_left(x: int, r: int) -> int:
        return ((x << r) | (x >> (64 - r))) % mod

    before_second = rotate_left(0x123456789ABCDEF * pow(p1, -1, mod) % mod, 64 - 31)  # the lane it must reach
    undo_p2 = pow(p2, -1, mod)
    pairs, first = [], 1
    while len(pairs) < count:
        after_first = rotate_left((p5 + first * p2) % mod, 31) * p1 % mod
        second = (before_second - after_first) * undo_p2 % mod
        second = second - mod if second >= mod // 2 else second
        if abs(second) <= 2**61 - 2 and second != -1:
            pairs.append((first, second))
        first += 1
    return pairs


PICKLE_BOMBS: dict[str, bytes] = {
    # each calls only what torch.load(weights_only=True) allows, and runs for hours or allocates without end
    "set-over-a-stride-0-array": (
        _global("builtins.set") + _global("numpy.ndarray") + b"(" + _int(10**12) + b"\x85" + _text("u1")
        + _global("_codecs.encode") + _text("\x00") + _text("latin1") + b"\x86R" + _int(0) + _int(0) + b"\x85"
        + b"tR\x85R"),
    "punycode": _global("_codecs.encode") + _text("".join(map(chr, range(0x4E00, 0x9E00)))) + _text("punycode") + b"\x86R",
    "bytearray-of-a-terabyte": _global("builtins.bytearray") + _int(10**12) + b"\x85R",
    "dict-key-of-shared-tuples": b"}" + _shared_tuples(60) + b"Ns",
    "dict-keys-that-collide": b"}(" + b"".join(_int(k * (2**61 - 1) + 7) + b"N" for k in range(1, 200_000)) + b"u",
    "set-of-shared-tuples": _global("builtins.set") + _shared_tuples(60) + b"\x85\x85R",
    "dict-keys-of-colliding-tuples": b"}(" + b"".join(_int(a) + _int(b) + b"\x86N" for a, b in _colliding_pairs(60_000))
                                     + b"u",
}
"""Pickles of under 2 MB for ``data.pkl``, by what they do to ``torch.load(weights_only=True)``."""


def with_pickle(path: Path, bomb: str) -> Path:
    """Write a torch file at ``path`` whose ``data.pkl`` is :data:`PICKLE_BOMBS` ``[bomb]`` (every
    other record as ``torch.save`` writes it)."""
    import zipfile

    torch.save({"step": 0}, path)
    with zipfile.ZipFile(path) as archive:
        records = [(info.filename, archive.read(info)) for info in archive.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for name, data in records:
            archive.writestr(name, b"\x80\x02" + PICKLE_BOMBS[bomb] + b"." if name.endswith("data.pkl") else data)
    return path


def require_shared_data(path: Path) -> None:
    """Tests on the real GSM8K/MATH-500 files need ``../shared/data`` (or ``$TCLIGHTNING_DATA``).
    Outside CI a missing copy skips them; in CI (``CI`` set) it fails, so CI never skips them."""
    if path.exists():
        return
    message = f"shared data not found: {path} (set TCLIGHTNING_DATA or place shared/ beside the repo)"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="session", autouse=True)
def _private_warmup_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Warm-ups are cached in a folder of this test session (subprocesses inherit it), never in the
    user's ~/.cache."""
    os.environ.setdefault("TCLIGHTNING_CACHE", str(tmp_path_factory.mktemp("tclightning-cache")))


@pytest.fixture(scope="session", autouse=True)
def _single_thread_session() -> None:
    """One intra-op thread before any module fixture builds or trains a model: a count that
    followed the machine's cores would change float reduction order from machine to machine."""
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _single_thread() -> None:
    """Each test starts on one thread (a run may have set more) from the same global seed, so no
    verdict depends on test order, `-k` selection or the machine's core count."""
    torch.set_num_threads(1)
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _signal_handlers_restored() -> Iterator[None]:
    """Each test starts with the signal handlers the session had, and with Ctrl-C and SIGTERM
    delivered as a terminal delivers them: a Ctrl-C handler a run left behind (stopping after the
    step instead of raising), or a signal mask the test runner was started with (a background job
    of some shells, CI scripts), would otherwise change a test's verdict. A signal the runner was
    started ignoring (SIGHUP under ``nohup``, SIGINT in a background job) is taken as usual during
    the test, so the processes a test starts do not inherit the ignore."""
    kept = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    for sig, handler in kept.items():
        if handler is signal.SIG_IGN:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    yield
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    for sig, handler in kept.items():
        if handler is not None and signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)


@pytest.fixture()
def run_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Runs write under a temporary directory (cwd-relative `runs/` in recipes)."""
    monkeypatch.chdir(tmp_path)
    return tmp_path / "runs"


class CrashAt(L.Callback):
    """Raises inside training at a given RL step, like a crash mid-run."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if batch.step == self.step:
            raise RuntimeError("simulated crash")


class SigtermAt(L.Callback):
    """Sends this process SIGTERM (or ``signum``) from a Lightning hook (``hook``: ``setup``, before
    Lightning holds SIGTERM; ``on_fit_start``, while a resume restores its checkpoint; or
    ``on_train_batch_start`` as RL step ``step`` begins), like a scheduler's kill."""

    def __init__(self, hook: str = "setup", signum: str = "SIGTERM", step: int = 0) -> None:
        self.hook, self.signum, self.step = hook, getattr(signal, signum), step

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.hook == "setup":
            os.kill(os.getpid(), self.signum)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.hook == "on_fit_start":
            os.kill(os.getpid(), self.signum)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if self.hook == "on_train_batch_start" and batch.step == self.step:  # RL step ``step`` begins
            os.kill(os.getpid(), self.signum)


class LongStepAfterTwoSigterms(L.Callback):
    """At step ``step``: sends this process SIGTERM twice, then makes the step last ``seconds``
    (a long generation a scheduler's second kill should not wait for)."""

    def __init__(self, step: int = 1, seconds: float = 600.0) -> None:
        self.step, self.seconds = step, seconds

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step != self.step:
            return
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + self.seconds
        while time.monotonic() < deadline:
            time.sleep(0.1)


class FailOnRankAt(L.Callback):
    """Raises on one rank of a multi-process run, in ``setup`` or at the start of RL step ``step``."""

    def __init__(self, rank: int, step: int | None = None) -> None:
        self.rank, self.step = rank, step

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.step is None and trainer.global_rank == self.rank:
            raise RuntimeError(f"simulated failure of rank {self.rank}")

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if batch.step == self.step and trainer.global_rank == self.rank:
            raise RuntimeError(f"simulated failure of rank {self.rank} at step {self.step}")


class BusyOnRankAt(L.Callback):
    """Keeps one rank busy in Python for ``seconds`` at the start of RL step ``step`` (a long
    sampling stage, say), touching no other rank."""

    def __init__(self, rank: int, step: int, seconds: float) -> None:
        self.rank, self.step, self.seconds = rank, step, seconds

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if batch.step == self.step and trainer.global_rank == self.rank:
            deadline = time.monotonic() + self.seconds
            while time.monotonic() < deadline:
                time.sleep(0.05)


class SlowStopOnRank(L.Callback):
    """Keeps one rank ``seconds`` longer on its way out of a stopped run (a slow disk, a loaded
    machine), then writes ``done``: Lightning calls ``on_exception`` for a SIGTERM's stop too."""

    def __init__(self, rank: int, seconds: float, done: str) -> None:
        self.rank, self.seconds, self.done = rank, seconds, Path(done)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if trainer.global_rank == self.rank:
            time.sleep(self.seconds)
            self.done.write_text("ended on its own\n")


class SlowExitAfterClosingLinks(L.Callback):
    """On one rank of a failed run: closes its links to the other ranks, then stays ``seconds``
    longer before it exits (a loaded machine tearing a large process down)."""

    def __init__(self, rank: int, seconds: float) -> None:
        self.rank, self.seconds = rank, seconds

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if trainer.global_rank == self.rank:
            torch.distributed.destroy_process_group()
            time.sleep(self.seconds)
