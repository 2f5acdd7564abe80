"""Supervised warm-up: a few steps of SFT on reference solutions before RL, with a cache of its
result (:func:`cached_supervised_warmup`) and an honest progress display (:class:`WarmupProgress`)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, TextIO

import torch
from transformers import PreTrainedModel

from tclightning.cache import DirectoryCache, cache_disabled_by_env, digest
from tclightning.errors import TclightningError, one_line
from tclightning.files import HeldFolder, exchange, open_regular, regular_file, remove_tree, save_tensors
from tclightning.limits import interrupt
from tclightning.models.config import WarmupConfig
from tclightning.sampling.base import PromptFormatter
from tclightning.tensor_files import RefusedTensorFile, load_checked


def _sigterm_interrupts(received: list[int]) -> Any:
    """Make SIGTERM interrupt the warm-up as Ctrl-C does (nothing is saved before the first RL
    step, so there is nothing to finish), noting it in ``received`` (the loop stops on it even if a
    library swallowed the interrupt): returns the handler to restore, or None off the main thread,
    where no handler can be set."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def stop(signum: int, frame: Any) -> None:
        received.append(signum)
        interrupt(signum, frame)

    return signal.signal(signal.SIGTERM, stop)


class WarmupInterrupted(Exception):
    """Ctrl-C during the warm-up. Deliberately not a ``KeyboardInterrupt``: Lightning turns one of
    those into ``sys.exit(1)``; this one reaches ``run()``, which exits 130 and tidies up."""


def sft_batch(formatter: PromptFormatter, prompts: Sequence[str], solutions: Sequence[str]) -> dict[str, torch.Tensor]:
    """Right-padded ``prompt + solution + eos`` with labels only on the solution (and eos)."""
    tok = formatter.tokenizer
    rows, labels = [], []
    rendered = formatter.tokenize(formatter.render_all(prompts), add_special_tokens=not formatter.templated)["input_ids"]
    for p, solution in zip(rendered, solutions, strict=True):
        s = tok(solution, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        rows.append(p + s)
        labels.append([-100] * len(p) + s)
    width = max(map(len, rows))
    pad = tok.pad_token_id
    return {
        "input_ids": torch.tensor([r + [pad] * (width - len(r)) for r in rows]),
        "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]),
        "labels": torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels]),
    }


def supervised_warmup(
    model: PreTrainedModel,
    formatter: PromptFormatter,
    prompts: Sequence[str],
    solutions: Sequence[str],
    cfg: WarmupConfig,
    progress: bool = False,
    accuracy: Callable[[], float] | None = None,
) -> dict[str, float]:
    """Train ``model`` in place for ``cfg.steps`` AdamW steps on random (prompt, solution) pairs.

    With ``cfg.label_noise = q`` each target is, with probability q, the solution of another
    random example (a wrong demonstration in the task's own format).

    With ``cfg.target_accuracy > 0`` and an ``accuracy`` callback (greedy accuracy of the model
    as it stands), training stops at the first check (every ``cfg.check_every`` steps) that
    reaches the target. Returns ``warmup/loss_first``, ``warmup/loss_last``, ``warmup/seconds``,
    ``warmup/steps`` and, when checked, ``warmup/accuracy``. Deterministic for a given
    ``cfg.seed`` (its own generator; the global RNG is left untouched).
    """
    if cfg.steps <= 0:
        return {}
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: min(1.0, (t + 1) / 20))
    was_training = model.training
    model.train()
    started, losses, stats = time.perf_counter(), [], {}
    display = WarmupProgress(cfg) if progress else None
    sigterm: list[int] = []
    previous_sigterm = _sigterm_interrupts(sigterm)
    try:
        for step in range(cfg.steps):
            if sigterm:
                raise KeyboardInterrupt
            _warmup_step(model, formatter, prompts, solutions, cfg, gen, optimizer, schedule, device, losses)
            if accuracy is not None and cfg.target_accuracy > 0 and (step + 1) % cfg.check_every == 0:
                stats["warmup/accuracy"] = accuracy()
                model.train()
            reached = "warmup/accuracy" in stats and stats["warmup/accuracy"] >= cfg.target_accuracy
            if display is not None:
                display.update(step + 1, stats.get("warmup/accuracy"))
            if reached:
                break
    except KeyboardInterrupt:
        raise WarmupInterrupted(f"interrupted during the supervised warm-up (step {len(losses)} of at most "
                                f"{cfg.steps})") from None
    finally:
        if previous_sigterm is not None:
            signal.signal(signal.SIGTERM, previous_sigterm)
        if display is not None:
            display.close()
    model.train(was_training)
    tail = max(1, len(losses) // 10)
    result = {
        **stats,
        "warmup/steps": float(len(losses)),
        "warmup/loss_first": sum(losses[:tail]) / tail,
        "warmup/loss_last": sum(losses[-tail:]) / tail,
        "warmup/seconds": time.perf_counter() - started,
    }
    if display is not None:
        display.finished(result)
    return result


def _warmup_step(model: PreTrainedModel, formatter: PromptFormatter, prompts: Sequence[Any], solutions: Sequence[str],
                 cfg: WarmupConfig, gen: torch.Generator, optimizer: torch.optim.Optimizer,
                 schedule: Any, device: torch.device, losses: list[float]) -> None:
    """One AdamW step on a random batch of demonstrations (noisy as ``cfg.label_noise`` says)."""
    picks = torch.randint(len(prompts), (cfg.batch_size,), generator=gen).tolist()
    noisy = torch.rand(cfg.batch_size, generator=gen) < cfg.label_noise
    targets = torch.where(noisy, torch.randint(len(prompts), (cfg.batch_size,), generator=gen), torch.tensor(picks))
    batch = sft_batch(formatter, [prompts[i] for i in picks], [solutions[i] for i in targets.tolist()])
    loss = model(**{k: v.to(device) for k, v in batch.items()}).loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    schedule.step()
    losses.append(loss.item())


class WarmupProgress:
    """The warm-up's progress as it really is: steps done against the cap and the stopping rule,
    the last accuracy check, and the time so far; no percentage or ETA, since an early stop at the
    target accuracy usually ends it well before the cap.

    On a terminal: one live line (rich), replaced as it goes. Otherwise (a log file, a pipe): a
    plain, flushed line at every accuracy check (every ``check_every`` steps; every tenth of the cap
    without a target), so a log shows the warm-up moving long before the run ends.
    """

    def __init__(self, cfg: WarmupConfig, stream: TextIO | None = None) -> None:
        self.cfg = cfg
        self.stream = stream or sys.stdout
        self.started = time.perf_counter()
        self.every = cfg.check_every if cfg.target_accuracy > 0 else max(1, cfg.steps // 10)
        rule = f"stops at greedy accuracy {cfg.target_accuracy:.2f}" if cfg.target_accuracy > 0 else "no early stop"
        self.rule = f"at most {cfg.steps} steps, {rule}"
        self._live: Any = None
        if self.stream.isatty():
            from rich.console import Console
            from rich.live import Live

            self._live = Live(console=Console(file=self.stream), transient=True, refresh_per_second=2)
            self._live.start()

    def line(self, done: int, accuracy: float | None) -> str:
        """``supervised warm-up: step 400 (at most 3000 steps, stops at ...); accuracy 0.85 at the last check; 41 s``."""
        seen = f"; accuracy {accuracy:.2f} at the last check" if accuracy is not None else ""
        return f"supervised warm-up: step {done} ({self.rule}){seen}; {time.perf_counter() - self.started:.0f} s"

    def update(self, done: int, accuracy: float | None) -> None:
        if self._live is not None:
            self._live.update(self.line(done, accuracy))
        elif done % self.every == 0:
            print(self.line(done, accuracy), file=self.stream, flush=True)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def finished(self, stats: Mapping[str, float]) -> None:
        """One line when the warm-up ends: where it stopped and why."""
        steps = int(stats["warmup/steps"])
        if "warmup/accuracy" in stats and stats["warmup/accuracy"] >= self.cfg.target_accuracy > 0:
            why = f"reached greedy accuracy {stats['warmup/accuracy']:.2f} >= {self.cfg.target_accuracy:.2f}"
        else:
            why = "reached the step cap"
        print(f"supervised warm-up: stopped at step {steps} of at most {self.cfg.steps} ({why}), "
              f"{stats['warmup/seconds']:.0f} s", file=self.stream, flush=True)


def _code_fingerprint() -> str:
    """This package's version and this file's source: a change to the warm-up code is a new key."""
    from tclightning import __version__

    return f"{__version__}:{hashlib.sha256(Path(__file__).read_bytes()).hexdigest()}"


def warmup_key(model: PreTrainedModel, formatter: PromptFormatter, prompts: Sequence[Any], solutions: Sequence[str],
               cfg: WarmupConfig, context: Mapping[str, Any]) -> str:
    """A hash of everything that determines :func:`supervised_warmup`'s result: the initial weights
    (so the model's source, config and seed), the warm-up settings, the
    demonstrations, the tokenizer and chat template, the warm-up code, the torch and transformers
    versions, the device and the intra-op thread count (float sums depend on it), and ``context``
    (what the accuracy check depends on: the task, the sampler settings, the check prompts, the seed)."""
    import transformers

    tok = formatter.tokenizer
    settings = asdict(cfg)
    return digest({
        "code": _code_fingerprint(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(next(model.parameters()).device),
        "threads": torch.get_num_threads(),
        "warmup": settings,
        "weights": model.state_dict(),
        "tokenizer": {
            "class": type(tok).__name__,
            "vocab": tok.get_vocab(),
            "special": list(tok.all_special_tokens),
            "chat_template": getattr(tok, "chat_template", None),
            "padding_side": tok.padding_side,
        },
        "formatter": {"system_prompt": getattr(formatter, "system_prompt", None), "templated": formatter.templated},
        "demonstrations": [list(prompts), list(solutions)],
        "context": dict(context),
    })


WEIGHTS, STATS = "weights.pt", "stats.json"
REQUIRED_STATS = ("warmup/steps", "warmup/loss_first", "warmup/loss_last", "warmup/seconds")


STATS_MAX_BYTES = 2**20
"""The largest statistics (or marker) file of a warm-up cache entry read."""


class UnreadableEntry(Exception):
    """A cache entry that cannot be used as it is; the message says why, on one line."""


def read_warmup_entry(entry: Path, model: PreTrainedModel) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The weights and statistics of the cache entry ``entry`` for ``model``, checked before
    anything touches the model: every file a regular one (a FIFO is never opened: it would wait
    forever), the statistics a JSON object with every field a warm-up writes, the weights loaded
    as data only (``weights_only=True``) and exactly ``model``'s parameter names, shapes and dtypes
    (so ``load_state_dict`` cannot fail half-way and leave the model half-loaded), every value
    finite (a NaN would poison each run that reuses the entry). Raises
    :class:`UnreadableEntry` otherwise."""
    if not entry.is_dir():
        raise UnreadableEntry("not a folder")
    for name in (DirectoryCache.COMPLETE, STATS, WEIGHTS):
        try:  # the statistics are a few hundred bytes: a huge (sparse) file is never read whole
            regular_file(entry / name, name, None if name == WEIGHTS else STATS_MAX_BYTES)
        except TclightningError as err:  # "weights.pt: is a named pipe (FIFO), not a regular file"
            raise UnreadableEntry(str(err).replace(f"{name} {entry / name}", name).split("; nothing was")[0]) from None
    try:  # opened as checked: a FIFO swapped in after the look above is refused, not waited on
        with open_regular(entry / STATS, STATS) as handle:
            stats = json.loads(handle.read(STATS_MAX_BYTES + 1).decode())
    except TclightningError:
        raise UnreadableEntry(f"{STATS}: is no longer a regular file") from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
        raise UnreadableEntry(f"{STATS}: {one_line(err)}") from None
    if not isinstance(stats, dict):
        raise UnreadableEntry(f"{STATS}: not a JSON object")
    missing = [k for k in REQUIRED_STATS if k not in stats]
    if missing:
        raise UnreadableEntry(f"{STATS}: no {', '.join(missing)}")
    bad = [k for k, v in stats.items() if isinstance(v, bool) or not isinstance(v, (int, float))]
    if bad:
        raise UnreadableEntry(f"{STATS}: not a number: {', '.join(bad)}")
    steps = stats["warmup/steps"]
    if not (math.isfinite(steps) and steps >= 1 and steps == int(steps)):
        raise UnreadableEntry(f"{STATS}: warmup/steps is {steps}, not a step count")
    try:
        with open_regular(entry / WEIGHTS, WEIGHTS) as opened:
            state = load_checked(opened)  # checked before torch.load runs a single call of its pickle
    except RefusedTensorFile as err:
        raise UnreadableEntry(f"{WEIGHTS}: {err}") from None
    except Exception:  # noqa: BLE001 - truncated, garbage, refused: all the same to a cache
        # (torch's own message for a cut file can be as unhelpful as "Invalid argument")
        raise UnreadableEntry(f"{WEIGHTS}: truncated, corrupted or not plain tensors") from None
    want = model.state_dict()
    if not isinstance(state, dict) or set(state) != set(want):
        raise UnreadableEntry(f"{WEIGHTS}: not this model's weights")
    for name, tensor in want.items():
        got = state[name]
        if not isinstance(got, torch.Tensor) or got.shape != tensor.shape or got.dtype != tensor.dtype:
            raise UnreadableEntry(f"{WEIGHTS}: {name} is not this model's ({tuple(tensor.shape)}, {tensor.dtype})")
        if got.is_floating_point() and not bool(torch.isfinite(got).all()):  # a warm-up never saves one
            raise UnreadableEntry(f"{WEIGHTS}: {name} holds NaN or infinite values")
    return state, {k: float(v) for k, v in stats.items()}


def _replace_entry(cache: DirectoryCache, key: str, seen: os.stat_result | None,
                   write: Callable[[Path], None]) -> str | None:
    """Write a new entry beside the unreadable one and swap it into place in one step (never
    deleting first: a reader sees the old entry or the new one, never none), then remove the old.
    If another process replaced the entry since it was found unreadable (``seen`` is its
    ``lstat``), its entry is kept. Returns ``None`` once a readable entry is in place, or why the
    cache could not be written (that only costs the saving)."""
    target = cache.path(key)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=cache.directory))
    except OSError as err:
        return err.strerror or str(err)
    why, at_tmp = None, None  # what is at the name tmp once done: ours, the old entry, or someone's
    identity: tuple[int, int] | None = None  # the folder at tmp to remove: only that one is
    try:
        with HeldFolder(tmp, empty=True) as staged:  # written through its descriptor, as DirectoryCache.put does
            at_tmp, identity = "ours", staged.identity
            try:
                write(staged.path)
                (staged.path / DirectoryCache.COMPLETE).write_text("ok\n")
                try:
                    now = os.lstat(target)
                except FileNotFoundError:
                    now = None
                if not staged.is_at(tmp):
                    why = "its folder was replaced while written"
                elif now is None:
                    os.replace(tmp, target)  # gone meanwhile: a plain rename
                    if not staged.is_at(target):  # someone's renamed to tmp as it moved: put back
                        cache.put_back(key, tmp)
                        raise _Replaced
                elif seen is not None and (now.st_ino, now.st_dev, now.st_mtime_ns) == (seen.st_ino, seen.st_dev,
                                                                                          seen.st_mtime_ns):
                    exchange(tmp, target)  # tmp now holds the unreadable entry
                    if not staged.is_at(target):  # someone's was at tmp as it swapped: both put back
                        exchange(tmp, target)
                        raise _Replaced
                    after = os.lstat(tmp)
                    at_tmp = "old" if (after.st_ino, after.st_dev) == (now.st_ino, now.st_dev) else None
                    identity = (now.st_dev, now.st_ino)
            finally:
                if at_tmp == "ours" and not staged.is_at(tmp):  # renamed into place, or someone's put there
                    at_tmp = None
    except _Replaced:
        why, at_tmp = "its folder was replaced while written", None
    except OSError as err:
        why = err.strerror or str(err)
    finally:
        if at_tmp == "old" and tmp.is_dir() and not tmp.is_symlink() and not _cache_entry_layout(tmp):
            at_tmp = None  # not an entry of the cache's own (a folder of yours put at its name): left as it is
            print(f"note: {target} held what a cache entry does not (a folder of yours?); it is kept as {tmp}",
                  file=sys.stderr, flush=True)
        if at_tmp == "ours" or (at_tmp == "old" and tmp.is_dir() and not tmp.is_symlink()):
            # that folder alone, emptied through its descriptor: one renamed to the name meanwhile is
            # someone's (a bind mount someone put inside the old entry is left alone too)
            remove_tree(tmp, identity=identity)
        # an unreadable entry that was a file (or a FIFO) stays at its hidden name: a file can only be
        # unlinked by name, and a file of someone's renamed there meanwhile would be the one removed
    if why is not None:  # the swap failed (a mount point there): the unreadable entry is still in place
        return why
    return None if cache.get(key) is not None else "the entry was not replaced"


class _Replaced(Exception):
    """The entry's folder was not the one written when it was swapped into place."""


def _cache_entry_layout(folder: Path) -> bool:
    """Whether ``folder`` holds only what a warm-up cache entry holds (its weights, stats and
    completion mark, files) and its completion mark as the cache writes it, last, before the entry
    is moved into place (a folder of someone's left at the entry never has one): an unreadable
    entry is removed only then."""
    try:
        entries = list(os.scandir(folder))
        with open_regular(folder / DirectoryCache.COMPLETE, DirectoryCache.COMPLETE, 16) as mark:
            marked = mark.read() == b"ok\n"
    except (OSError, TclightningError):
        return False
    return marked and all(e.name in ("weights.pt", "stats.json", DirectoryCache.COMPLETE)
                          and not e.is_dir(follow_symlinks=False) for e in entries)


def cached_supervised_warmup(
    model: PreTrainedModel,
    formatter: PromptFormatter,
    prompts: Sequence[Any],
    solutions: Sequence[str],
    cfg: WarmupConfig,
    context: Mapping[str, Any],
    *,
    use_cache: bool = True,
    progress: bool = False,
    accuracy: Callable[[], float] | None = None,
    cache: DirectoryCache | None = None,
) -> dict[str, float]:
    """:func:`supervised_warmup`, reusing an earlier identical warm-up when one is cached.

    The key is :func:`warmup_key`; a hit loads the cached weights into ``model`` (bit-identical to
    recomputing them), prints one note to stderr and returns the cached statistics with
    ``warmup/cached = 1`` and this load's ``warmup/seconds``. A miss trains and stores the result
    (atomically, under ``<cache root>/warmup/<key>/``) unless the warm-up moved the global RNG,
    which a reload could not reproduce. ``use_cache=False`` or ``TCLIGHTNING_NO_CACHE=1``
    (``tclightning run --no-cache``) trains without reading or writing the cache. An unreadable entry
    (:func:`read_warmup_entry`: damaged files, a FIFO, a file in place of the folder) is named in
    one ``note:`` line, trained again from the untouched initial weights and replaced atomically
    (:func:`_replace_entry`); a cache that cannot be written only costs the saving.
    """
    if cfg.steps <= 0:
        return {}
    if not use_cache or cache_disabled_by_env():
        return supervised_warmup(model, formatter, prompts, solutions, cfg, progress=progress, accuracy=accuracy)
    started = time.perf_counter()
    cache = cache or DirectoryCache("warmup")
    key = warmup_key(model, formatter, prompts, solutions, cfg, context)
    entry = cache.path(key)
    try:
        seen: os.stat_result | None = os.lstat(entry)
    except OSError:
        seen = None  # a miss
    if seen is not None:
        try:
            state, stats = read_warmup_entry(entry, model)
        except UnreadableEntry as why:
            print(f"note: the cached supervised warm-up {entry} is unreadable ({why}); training it again",
                  file=sys.stderr, flush=True)
        else:
            model.load_state_dict(state, strict=True)
            print(f"note: supervised warm-up reused from the cache ({int(stats['warmup/steps'])} steps, {entry}; "
                  "--no-cache trains it again)", file=sys.stderr, flush=True)
            return {**stats, "warmup/cached": 1.0, "warmup/seconds": time.perf_counter() - started}
    rng = torch.get_rng_state()
    stats = supervised_warmup(model, formatter, prompts, solutions, cfg, progress=progress, accuracy=accuracy)
    if torch.equal(rng, torch.get_rng_state()):

        def write(directory: Path) -> None:
            save_tensors({k: v.detach().cpu() for k, v in model.state_dict().items()}, directory / WEIGHTS)
            (directory / STATS).write_text(json.dumps(stats, indent=1, sort_keys=True))

        unstored = cache.put(key, write) if seen is None else _replace_entry(cache, key, seen, write)
        if unstored is not None:  # said once per run, so that a run that keeps retraining says why
            print(f"note: the supervised warm-up could not be stored in the cache {cache.directory} ({unstored}); "
                  "the next run trains it again (TCLIGHTNING_CACHE names another folder, --no-cache skips the "
                  "cache)", file=sys.stderr, flush=True)
    return stats
