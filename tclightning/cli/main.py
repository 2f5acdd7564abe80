"""The ``tclightning`` command: one verb per subcommand (run, recipes, analyze, probe, bench, export).

Each subcommand lives in its own module exposing ``register(subparsers)``; the handler it sets
as ``func`` receives the parsed namespace and returns an exit code. Heavy imports (torch,
transformers) happen inside handlers so ``--help`` and ``recipes list`` stay fast.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import sys
from collections.abc import Sequence

from tclightning import __version__
from tclightning.console import (exit_at_late_interrupt, ignore_interrupts_at_teardown, interrupts_held,
                                 outlive_console, refused_output, shown, sigterm_interrupts)
from tclightning.environment import own_writes_undone
from tclightning.errors import StorageError, TclightningError
from tclightning.files import refused_by_storage, storage_reason
from tclightning.network import remote_failure
from tclightning.processes import follow_launcher, keep_children_off_the_working_folder


def build_parser() -> argparse.ArgumentParser:
    from tclightning.cli import analyze, bench, export, probe, recipes, run

    parser = argparse.ArgumentParser(
        prog="tclightning",
        description="Communication-efficient GRPO on PyTorch Lightning: run recipes, list them, probe and analyse runs.",
    )
    parser.add_argument("--version", action="version", version=f"tclightning {__version__}")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks for errors")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in (run, recipes, analyze, probe, bench, export):
        module.register(subparsers)
    return parser


def load_torch_holding_interrupts() -> None:
    """Import torch (the commands' parser loads it) with Ctrl-C, SIGTERM and SIGHUP held until it is done:
    raised inside its C++ start-up, an interrupt aborts the process with a C++ stack, or is swallowed
    and leaves a module half imported."""
    with interrupts_held():
        import torch  # noqa: F401


def dispatch(parser: argparse.ArgumentParser, argv: Sequence[str] | None, console: bool = False) -> int:
    """Parse ``argv``, run the chosen handler, and turn user errors into one line + exit code 2.
    ``console``: the console command, whose signals are its own: once the handler is done, a
    Ctrl-C or SIGTERM ends the process at once (a second SIGTERM while the first one's line was
    said was a traceback)."""
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        try:
            return int(args.func(args) or 0)
        except Exception as err:  # a remote store or server that failed mid-run: one line; anything else as it is
            reason = None if args.debug else remote_failure(err)
            if reason is None:
                raise
            raise TclightningError(reason) from err
        finally:
            if console:
                exit_at_late_interrupt()
    except TclightningError as err:
        if args.debug:
            raise
        # one line, whatever the message: a user error is never a wall of text
        print("error: " + shown(" ".join(line.strip() for line in str(err).splitlines() if line.strip())),
              file=sys.stderr)
        return err.exit_code
    except OSError as err:
        if not args.debug and err.errno == errno.ENAMETOOLONG:  # a path the user gave that no filesystem holds
            print(f"error: {shown(str(err.filename))[:200]}: a name in this path is longer than the filesystem "
                  "allows (255 bytes a name); nothing was written", file=sys.stderr)
            return 2
        if args.debug or not refused_by_storage(err):  # a bug, or a file the command names: in full
            raise
        # the backstop for a write the storage refused (full, read-only, quota, permissions) that no
        # command words itself: the machine's state, one line; writes that matter replace files whole
        denied = err.errno in (errno.EACCES, errno.EPERM)  # a read too may be denied
        print(f"error: {storage_reason(err)}" if denied else f"error: the storage refused a write ({storage_reason(err)})",
              file=sys.stderr)
        return StorageError.exit_code
    except KeyboardInterrupt as err:  # a handler may say what the interrupt stopped
        print(shown(str(err)) or "interrupted", file=sys.stderr)
        return 130


def main(argv: Sequence[str] | None = None) -> int:
    """The ``tclightning`` command (``argv`` None: the console's, from ``sys.argv``). Called from a
    program of yours with ``argv``, it leaves the program's environment variables and standard
    streams as they were (the command sets ``PYTHONSAFEPATH`` for the processes it starts)."""
    if argv is None:
        return _command(None)
    streams = sys.stdout, sys.stderr
    with own_writes_undone():
        try:
            return _command(argv)
        finally:
            sys.stdout, sys.stderr = streams


def _command(argv: Sequence[str] | None) -> int:
    # One tokenizer thread: a Rust tokenizer that panics on a prompt (a regex past its backtracking
    # limit) deadlocks its thread pool; on one thread the panic is an error the run reports.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    keep_children_off_the_working_folder()
    follow_launcher()  # a rank a run started (trainer.devices > 1) ends with that run's process
    if argv is None:  # the console command: a Ctrl-C while the interpreter is torn down leaves the exit code
        ignore_interrupts_at_teardown()
        sigterm_interrupts()
    outlive_console()  # `| head -1`, stdout or stderr closed or full: the command goes on, never a traceback
    try:
        if argv is None:
            load_torch_holding_interrupts()
        parser = build_parser()
    except KeyboardInterrupt:  # Ctrl-C while the subcommands import
        print("interrupted", file=sys.stderr)
        return 130
    code = dispatch(parser, argv, console=argv is None)  # (then Ctrl-C must not undo the console command's result)
    if argv is None:
        code = finish_loggers_or_exit(code)
    lost = refused_output()
    if lost is not None:  # `> /dev/full`: what the command printed is incomplete, so it did not succeed
        print(f"error: standard output refused a write ({lost}); what the command printed is incomplete", file=sys.stderr)
        code = code or 1
    return code


def finish_loggers_or_exit(code: int) -> int:
    """The console command's end: W&B's runs finished within a time limit
    (:func:`~tclightning.logging.finish_wandb`), else one line and the process ends here with
    ``code`` (1 if it was 0): at the interpreter's exit W&B would wait for its server for ever.
    Where the command gave up on a download (:func:`~tclightning.limits.abandoned_work`), the
    process ends here too: the interpreter would join the library's threads still reading it."""
    from tclightning.limits import abandoned_work

    late = None
    if "wandb" in sys.modules:  # used: its runs are finished (not imported otherwise)
        from tclightning.logging import finish_wandb

        late = finish_wandb()
        if late is not None:
            print(f"error: {late}", file=sys.stderr, flush=True)
            code = code or 1
    if late is None and not abandoned_work():
        return code
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed or refusing: what it got is what it holds
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
