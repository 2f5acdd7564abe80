"""The ``lightning`` command: ``lightning run --recipe ...`` trains a recipe, and ``lightning fit``
(``validate``, ``test``, ``predict``) runs Lightning's ``LightningCLI`` for your own module, so the
callback presets' ``--trainer.callbacks=callbacks/monitoring.yaml`` works on any project
(Lightning 2.6 ships only ``fabric`` as a command)."""

from __future__ import annotations

import argparse
import importlib.util
import io
import os
import re
import signal
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, redirect_stderr
from typing import Any
from pathlib import Path

from tclightning.cli import run as run_cli
from tclightning.cli.formatting import HelpFormatter
from tclightning.cli.main import dispatch, finish_loggers_or_exit, load_torch_holding_interrupts
from tclightning.console import exit_at_late_interrupt, ignore_interrupts_at_teardown, shown, sigterm_interrupts
from tclightning.limits import interrupt
from tclightning.errors import TclightningError

CLI_COMMANDS = ("fit", "validate", "test", "predict")
"""``LightningCLI``'s subcommands: everything after one of them goes to ``LightningCLI`` as is."""
LIGHTNING_CKPT_NAMES = ("last", "best", "hpc")
"""``--ckpt_path`` values Lightning resolves itself, to the checkpoints of this run's own callbacks."""

REMOTE_PATH = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://\S*|\S*::\S*")
"""A URL or an fsspec chain (``simplecache::s3://...``), as opposed to a local path or YAML text."""

FIT_EPILOG = """\
examples (LightningCLI, for your own LightningModule):
  lightning fit --config cfg.yaml --trainer.callbacks=callbacks/monitoring.yaml
  lightning fit --model=my_pkg.MyModule --data=my_pkg.MyData
  lightning fit --help     # every --model, --data and --trainer option
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning",
        description="Run tclightning recipes with PyTorch Lightning, or LightningCLI's fit/validate/test/predict "
        "for your own LightningModule. For Fabric scripts use the `fabric` command; for everything else "
        "(recipes, probes, analysis) use `tclightning`.",
        epilog=FIT_EPILOG,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--debug", action="store_true", help="show full tracebacks for errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = sub.add_parser(
        "run",
        help="train a recipe (same as `tclightning run`)",
        epilog=run_cli.RUN_EPILOG.replace("tclightning run", "lightning run"),
        formatter_class=HelpFormatter,
    )
    run_cli.add_run_arguments(run)
    run.set_defaults(func=run_cli.handle_run)
    for command in CLI_COMMANDS:  # listed for --help; main() hands their arguments to LightningCLI
        sub.add_parser(command, help=f"LightningCLI {command} for your LightningModule (--model=..., --config=...)")
    return parser


@contextmanager
def _configuration_bounded() -> Iterator[None]:
    """Within the block jsonargparse reads its configuration as a recipe is read. Every file a value
    names (``--config X``, ``-cX``, and inside a config ``trainer: {callbacks: x.yaml}`` or
    ``model: x.yaml``), read through ``jsonargparse.Path.read_text``, is a regular file of 1 MiB of
    UTF-8 (a FIFO or a device would be waited on forever); every YAML text it loads, a file's or a
    value's (``--config '{...}'``, ``--trainer.callbacks='[...]'``), expands to at most 20,000
    values (an alias bomb of a few hundred bytes expanded for ever) and holds integers Python
    converts. Only local files are read: Lightning turns on jsonargparse's fsspec reading, which
    waits for ever on a server that never answers (``--config http://...``, or a URL a config names)."""
    from jsonargparse import Path as ConfigPath
    from jsonargparse import set_parsing_settings
    from jsonargparse._loaders_dumpers import get_yaml_default_loader
    from jsonargparse._optionals import _get_config_read_mode

    from tclightning.recipes.loader import bounded_yaml_data, bounded_yaml_text

    read_text, loader = ConfigPath.read_text, get_yaml_default_loader()
    own_single_data = loader.__dict__.get("get_single_data")  # None: PyYAML's, inherited
    read_mode = _get_config_read_mode()

    def checked(path: ConfigPath) -> str:
        if path.relative == "-":  # stdin is the caller's to give
            return read_text(path)
        return bounded_yaml_text(Path(path.absolute), "lightning: a file the configuration names")

    ConfigPath.read_text = checked  # type: ignore[method-assign]
    loader.get_single_data = lambda self: bounded_yaml_data(self, "lightning: a configuration value")
    set_parsing_settings(config_read_mode_urls_enabled=False, config_read_mode_fsspec_enabled=False)
    try:
        yield
    finally:
        set_parsing_settings(config_read_mode_urls_enabled="u" in read_mode,
                             config_read_mode_fsspec_enabled="s" in read_mode)
        ConfigPath.read_text = read_text  # type: ignore[method-assign]
        if own_single_data is None:
            del loader.get_single_data
        else:
            loader.get_single_data = own_single_data


def _remote_configs(argv: Sequence[str]) -> list[str]:
    """The ``--config`` / ``-c`` values in ``argv`` that name a URL or an fsspec chain."""
    values = []
    for i, arg in enumerate(argv):
        if arg in ("--config", "-c") and i + 1 < len(argv):
            values.append(argv[i + 1])
        elif arg.startswith("--config="):
            values.append(arg.partition("=")[2])
        elif arg.startswith("-c") and not arg.startswith("--"):
            values.append(arg[2:].removeprefix("="))
    return [value for value in values if REMOTE_PATH.fullmatch(value) and not value.startswith("file://")]


def lightning_cli(argv: Sequence[str]) -> int:
    """``LightningCLI`` on ``argv`` (``fit ...`` etc.): any ``LightningModule`` / ``LightningDataModule``
    by ``--model`` / ``--data`` class path or in ``--config`` files, exactly as a script calling
    ``LightningCLI(subclass_mode_model=True, subclass_mode_data=True)`` would parse them.
    ``TclightningError`` when jsonargparse (``lightning[pytorch-extra]``) is not installed."""
    if importlib.util.find_spec("jsonargparse") is None:
        raise TclightningError(
            f"lightning {argv[0]} runs LightningCLI, which needs jsonargparse: pip install 'lightning[pytorch-extra]'"
        )
    remote = _remote_configs(argv)
    if remote:
        raise TclightningError(f"--config {remote[0]}: only a local file is read (a remote configuration is "
                               "waited on with no time limit); copy it here first (nothing was built)")
    from lightning.pytorch import LightningDataModule, LightningModule
    from lightning.pytorch.cli import LightningCLI

    from tclightning.callbacks.checkpointing import checkpoint_allow_list
    from tclightning.network import remote_failure, remote_requests_bounded

    class CheckedCheckpointCLI(LightningCLI):
        """LightningCLI, whose ``--ckpt_path`` hyper-parameters (which it merges into the model's
        arguments) are read as tclightning reads a checkpoint: as data only, never naming the
        class to build anywhere in them (``class_path``, ``_class_path``, ``init_args``: jsonargparse
        would import any module they name), never turning on remote code."""

        def instantiate_trainer(self, **kwargs: Any) -> Any:
            from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

            from tclightning.callbacks.checkpointing import OwnFileCheckpointIO
            from tclightning.logging import ask_remote_stores, open_store
            from tclightning.recipes.loader import same_state_message, state_key_clash
            from tclightning.run import require_launcher

            given = self._get(self.config_init, "trainer", default={}).get("callbacks") or []
            given = given if isinstance(given, list) else [given]
            clash = state_key_clash(given)
            if clash is not None:  # else Lightning's RuntimeError traceback as the Trainer is made
                first, second = clash
                raise TclightningError(f"--trainer.callbacks[{second}]: "
                                       f"{same_state_message(given[second], f'--trainer.callbacks[{first}]')}")
            # the Trainer builds its default logger there: a store that cannot be made would be a traceback
            open_store("trainer.default_root_dir", self._get(self.config_init, "trainer", default={}).get("default_root_dir"))
            trainer = super().instantiate_trainer(**kwargs)
            require_launcher(trainer.num_nodes, "--trainer.num_nodes")  # else the ranks wait for peers without end
            if self.save_config_callback is not None:
                _require_config_folder(trainer)
            ask_remote_stores(trainer)
            if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # Lightning's default: ours checks each read
                trainer.strategy.checkpoint_io = OwnFileCheckpointIO()  # (--ckpt_path hpc|last|best resolve there)
            if signal.getsignal(signal.SIGTERM) is interrupt:  # the fit's SIGTERM is Lightning's (its handler
                signal.signal(signal.SIGTERM, signal.SIG_DFL)  # would call this one too: a stop without a checkpoint)
            return trainer

        def _parse_ckpt_path(self) -> None:
            from tclightning.callbacks.checkpointing import load_checkpoint, names_a_class, require_lightning_checkpoint
            from tclightning.models.loading import check_checkpoint_model

            subcommand = self.config.get("subcommand")
            ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
            if ckpt_path and str(ckpt_path) in LIGHTNING_CKPT_NAMES:
                # Lightning finds these among its own callbacks' checkpoints; LightningCLI would read a
                # file of that name in the working folder for the model's arguments, unchecked
                return
            if ckpt_path:
                if "://" in str(ckpt_path) or "::" in str(ckpt_path):
                    raise TclightningError(f"--ckpt_path {ckpt_path}: only a local checkpoint file is read (a URL "
                                           "or fsspec chain is not checked before Lightning loads it); copy it here "
                                           "first (nothing was built)")
                if not Path(ckpt_path).is_file():  # a FIFO, a device or a folder: torch.load would wait or fail
                    raise TclightningError(f"--ckpt_path {ckpt_path}: no regular file is there (nothing was built)")
                checkpoint = load_checkpoint(ckpt_path)
                hparams = dict(checkpoint.get("hyper_parameters") or {})
                # LightningCLI records the class it built as _class_path (and _instantiator, which it
                # never reads back): the class given with --model is no class the checkpoint names
                recorded = hparams.get("_class_path") == self._model_class_path(subcommand)
                if recorded:
                    del hparams["_class_path"]
                    hparams.pop("_instantiator", None)
                named = names_a_class(hparams)  # all LightningCLI merges
                if named is not None:
                    raise TclightningError(f"--ckpt_path {ckpt_path}: the checkpoint asks the parser to build or read "
                                           f"something by name ({named}), which would import any module or read any "
                                           "file; give the model with --model yourself (nothing was built)")
                check_checkpoint_model(checkpoint, f"--ckpt_path {ckpt_path}")
                require_lightning_checkpoint(checkpoint, f"--ckpt_path {ckpt_path}")
                text = _a_text(hparams)
                if text is not None:  # jsonargparse reads a text as a file to read, a config or a class to import
                    raise TclightningError(f"--ckpt_path {ckpt_path}: its hyper-parameter {shown(text)[:80]!r} is a "
                                           "text, which the parser may read as a file or a module to import; give it "
                                           "with --model yourself (nothing was built)")
                # Lightning reads any path that starts with "http" (http_runs/last.ckpt) as a URL and
                # loads the file of that name in torch's download cache unchecked: hand it the file checked
                self.config[subcommand]["ckpt_path"] = os.path.abspath(ckpt_path)
                self._merge_hparams(subcommand, hparams, ckpt_path, recorded)

        def _model_class_path(self, subcommand: str) -> str | None:
            """The class ``--model`` (or the configuration) names for the fit, or None."""
            model = self.config[subcommand].get("model")
            return model.get("class_path") if hasattr(model, "get") else None

        def _merge_hparams(self, subcommand: str, hparams: dict[str, Any], ckpt_path: str, recorded: bool) -> None:
            """LightningCLI's own merge of the checkpoint's hyper-parameters into the model's
            arguments, from the checkpoint read and checked above: Lightning's would load the path
            again, unchecked, and a file renamed over it in between would be what it unpickles.
            ``recorded``: the checkpoint recorded ``--model``'s class as LightningCLI does (another
            class was refused), and its arguments are merged as LightningCLI merges them then."""
            if not hparams:
                return
            model = {"class_path": self._model_class_path(subcommand), "dict_kwargs": hparams} if recorded else hparams
            try:
                with redirect_stderr(io.StringIO()):  # the parser's usage text and its many-line error
                    self.config = self.parser.parse_object({subcommand: {"model": model}}, self.config)
            except SystemExit:
                names = ", ".join(shown(str(key)) for key in hparams)
                raise TclightningError(f"--ckpt_path {ckpt_path}: its hyper-parameters ({names[:160]}) are no "
                                       f"arguments of --model {self._model_class_path(subcommand)}; nothing was "
                                       "built") from None

    # args=None when argv is the command line itself: LightningCLI warns when given both
    args = None if list(argv) == sys.argv[1:] else list(argv)
    try:  # LightningCLI's own default: a config.yaml already there (yours, with no logger) is never overwritten
        # a tclightning checkpoint's few data objects (the RNG states), for Lightning too; a store or
        # server that stalls mid-fit: each request has a time limit
        with checkpoint_allow_list(), _configuration_bounded(), remote_requests_bounded():
            CheckedCheckpointCLI(LightningModule, LightningDataModule, subclass_mode_model=True,
                                 subclass_mode_data=True, args=args)
    except TclightningError:
        raise
    except Exception as err:
        failure = _fit_failure(err)
        if failure is None:  # not an expected failure: shown in full
            raise
        raise failure from None
    return 0


def _fit_failure(err: Exception) -> TclightningError | None:
    """The one line for a failure of the fit that is the input's, not a bug: a checkpoint that does
    not fit this fit (any error Lightning's restore raised: weights only, other weights, loops or
    schedulers of another form), an HPC checkpoint not found, a class of the configuration that
    could not be built, an unknown storage protocol, a remote store or server that failed mid-fit.
    None for anything else."""
    text = " ".join(str(err).split())
    if _in_checkpoint_restore(err):
        return TclightningError(f"--ckpt_path: the checkpoint cannot be restored into this fit ({type(err).__name__}: "
                                f"{text[:200]}); nothing was trained")
    if isinstance(err, (KeyError, RuntimeError)):
        return TclightningError(text[:300]) if "SaveConfigCallback" in str(err) else None
    if isinstance(err, ValueError):
        # Lightning: `.fit(ckpt_path="hpc")` is set but no HPC checkpoint was found. ... (raised by
        # Lightning: your own ValueError that says ckpt_path= is yours, shown as it is)
        if "ckpt_path=" in text and _raised_in_lightning(err):
            return TclightningError(f"--ckpt_path: {text.split('. ', 1)[0][:200]} (nothing was trained)")
        built = _class_not_built(str(err))
        if built is not None:
            return TclightningError(f"the configuration's {built} (nothing was trained)")
        unknown = re.search(r"Protocol not known: (\S+)", str(err))
        if unknown is not None:  # a folder fsspec reads as a URL of a protocol it does not know
            return TclightningError(f"a folder of the configuration names the storage protocol "
                                    f"'{unknown.group(1)[:80]}', which fsspec does not know (nothing was trained)")
    from tclightning.network import remote_failure

    reason = remote_failure(err)
    return None if reason is None else TclightningError(reason)


def _a_text(obj: Any) -> str | None:
    """The first text in ``obj`` (a checkpoint's hyper-parameters), or None: jsonargparse reads a
    text as a file path, a configuration or a class or callable to import, by the argument's type
    (``planted.fn``, ``plantéd.fn``, ``sub.yaml`` each ran code), so none is merged."""
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(dict.values(item))
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, str):
            return item
    return None


def _raised_in_lightning(err: BaseException) -> bool:
    """Whether ``err`` was raised in Lightning's own code (its innermost frame is Lightning's)."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and str(tb.tb_frame.f_globals.get("__name__", "")).startswith("lightning.")


def _in_checkpoint_restore(err: BaseException) -> bool:
    """Whether ``err`` was raised while Lightning restored a checkpoint into the fit (its checkpoint
    connector, or a ``load_state_dict`` it called): what the checkpoint holds does not fit."""
    import traceback

    frames = traceback.extract_tb(err.__traceback__)
    return any("checkpoint_connector" in frame.filename for frame in frames)


def _require_config_folder(trainer: Any) -> None:
    """LightningCLI saves its configuration (``config.yaml``) into the folder of the trainer's first
    logger (``trainer.log_dir``), and asserts there is one: a logger that writes to a server alone
    (MLflow on a tracking server) has none, which was an ``AssertionError`` traceback at setup."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    first = trainer.loggers[0] if trainer.loggers else None
    if first is None or isinstance(first, (CSVLogger, TensorBoardLogger)) or first.save_dir is not None:
        return
    raise TclightningError(f"LightningCLI saves its configuration into the first logger's folder, and the "
                           f"{type(first).__name__} writes to a server and has none: put a CSVLogger or "
                           "TensorBoardLogger first in --trainer.logger (nothing was trained)")


def _class_not_built(text: str) -> str | None:
    """``"<class path> could not be built: <its error>"`` from jsonargparse's message for a class of
    the configuration whose constructor failed (a logger whose store needs a package), else None."""
    lines = [line.strip() for line in text.splitlines()]
    for i, line in enumerate(lines):
        if line.startswith(("- Problem with given class_path", "Problem with given class_path")) and i + 1 < len(lines):
            class_path = line.split("class_path", 1)[1].strip(" ':")
            return f"{class_path} could not be built: {lines[i + 1][:200]}"
    given = re.search(r"Given value: \[?Namespace\(class_path='([^']+)'", text)  # a union's first subtype failed
    reasons = [line[2:] for line in lines if line.startswith("- ")]
    if text.startswith("Does not validate against any of the Union subtypes") and given and reasons:
        return f"{given.group(1)} could not be built: {reasons[0][:200]}"
    return None


def _hangup_is_sigterm() -> None:
    """A closed terminal (SIGHUP) stops a LightningCLI command as SIGTERM does (Lightning's own
    handler: the fit stops after the step), where its default would end it without a word. Leaves
    a handler someone else set alone (``nohup``'s ignored SIGHUP)."""
    import signal

    from tclightning.console import hangup_is_sigterm

    hangup = getattr(signal, "SIGHUP", None)
    if hangup is not None and signal.getsignal(hangup) is signal.SIG_DFL:
        signal.signal(hangup, hangup_is_sigterm)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    debug = bool(args) and args[0] == "--debug"
    rest = args[1:] if debug else args
    if argv is None:  # the console command: while it starts, a SIGTERM or SIGHUP is a Ctrl-C (one line, 130)
        ignore_interrupts_at_teardown()
        sigterm_interrupts()
        try:
            load_torch_holding_interrupts()
        except KeyboardInterrupt:  # Ctrl-C while the command starts
            print("interrupted", file=sys.stderr)
            return 130
    if rest and rest[0] in CLI_COMMANDS:  # LightningCLI parses its own options (argparse would refuse them)
        _hangup_is_sigterm()
        try:
            code = lightning_cli(rest)
        except TclightningError as err:
            if debug:
                raise
            print(f"error: {shown(str(err))}", file=sys.stderr)
            code = err.exit_code
        except KeyboardInterrupt:  # a Ctrl-C before Lightning's fit holds it (while the command starts)
            if debug:
                raise
            print("interrupted", file=sys.stderr)
            code = 130
    else:
        code = dispatch(build_parser(), args, console=argv is None)
    if argv is None:  # the console command: Ctrl-C during Python's shutdown must not undo its result
        exit_at_late_interrupt()
        code = finish_loggers_or_exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
