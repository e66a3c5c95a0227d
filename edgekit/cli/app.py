"""The `edgekit` command: a thin frame that finds subcommands and turns user errors into one clear line.

Modelled on Polygraphy: each subcommand lives in its own small module, `edgekit/cli/<name>_cmd.py`, exposing
`app = typer.Typer(...)`. Modules are imported only when their subcommand runs (or help is shown), so a slow
import (onnxruntime, torch) never slows down another subcommand. Every name in `SUBCOMMANDS` must have its module:
one that is missing is a packaging mistake and fails loudly (tests/test_cli_frame.py imports them all).

Errors: an `EdgekitError` is one stderr line naming the file and the reason, exit 2; with `--json` the same error
is also printed on stdout as `{"error": {"code", "message", "file"}}`. Parameters a library error names are shown
as their flags (`common.cli_message`). An `OSError` on a path the user named on the command line (or one inside or
above it: `-o /proc/nope/x` fails on `/proc/nope`) is one line too, exit 1, code `io_error`: the disk, not the
input. Any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from edgekit import __version__
from edgekit.cli.common import cli_message, env_debug, error_json, state
from edgekit.errors import EdgekitError

# typer >= 0.2x vendors its own click; take click's classes from typer so either kind works.
_Command = next(c for c in TyperGroup.__mro__ if c.__name__ == "Command")
_ClickException = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
_COMPLETION_PARAMS = {"install_completion", "show_completion"}

# name -> one-line help shown before the module is imported. Order is the order of `edgekit --help`.
SUBCOMMANDS: dict[str, str] = {
    "data": "Generate and inspect synthetic studies and datasets.",
    "convert": "Convert a trained model to ONNX graphs.",
    "optimize": "Apply optimisation passes (quantisation, fusion) to ONNX graphs.",
    "finetune": "Fine-tune a Hugging Face model with LoRA and learned head gates (train extra).",
    "build": "Build a deployable bundle for a target.",
    "run": "Generate a report for a study with a bundle.",
    "eval": "Evaluate a bundle's reports against references.",
    "profile": "Measure latency and memory of a bundle on a target.",
    "pareto": "Profile variants: energy, quality and latency, and their Pareto front.",
    "bundle": "Inspect, verify, pack and unpack bundles.",
    "engine": "TensorRT engines for Jetson Orin: build, check, capability.",
    "x1": "The X1 edge NPU: cost estimates, compiling and disassembling programs.",
}


def _module_name(name: str) -> str:
    return f"edgekit.cli.{name}_cmd"


def _load(name: str) -> Any:
    """The click command of subcommand `name`; an import error (a missing module included) propagates."""
    module_name = _module_name(name)
    module = importlib.import_module(module_name)
    sub = getattr(module, "app", None)
    if isinstance(sub, typer.Typer):
        command = typer.main.get_command(sub)
    elif isinstance(sub, _Command):
        command = sub
    else:
        raise RuntimeError(f"{module_name} defines no `app` (a typer.Typer)")
    command.name = name
    # shell completion belongs to the top-level command only
    command.params = [p for p in command.params if p.name not in _COMPLETION_PARAMS]
    if not command.help and not getattr(command, "short_help", None):
        command.help = SUBCOMMANDS.get(name)
    return command


class LazyGroup(TyperGroup):
    """A group whose subcommands are imported on first use from `edgekit.cli.<name>_cmd`."""

    def list_commands(self, ctx: Any) -> list[str]:
        eager = super().list_commands(ctx)
        return eager + [n for n in SUBCOMMANDS if n not in eager]

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        command = super().get_command(ctx, cmd_name)
        if command is None and cmd_name in SUBCOMMANDS:
            command = _load(cmd_name)
            self.add_command(command, cmd_name)
        return command


app = typer.Typer(
    name="edgekit",
    cls=LazyGroup,
    help="Compress, compile and serve vision-language report models on edge devices.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        sys.stdout.write(f"edgekit {__version__}\n")
        raise typer.Exit(0)


@app.callback()
def _root(
    debug: Annotated[
        bool, typer.Option("--debug", help="Show full tracebacks for errors (also EDGEKIT_DEBUG=1).")
    ] = False,
    version: Annotated[
        bool,
        typer.Option("--version", help="Print the version and exit.", callback=_print_version, is_eager=True),
    ] = False,
) -> None:
    """Compress, compile and serve vision-language report models on edge devices."""
    if debug:
        state.debug = True


def _flag_given(argv: list[str], flag: str) -> bool:
    args = argv[: argv.index("--")] if "--" in argv else argv
    return flag in args


def _debug_requested(argv: list[str]) -> bool:
    return env_debug() or state.debug or _flag_given(argv, "--debug")


def _json_error(err: BaseException, message: str, code: str = "usage_error") -> None:
    sys.stdout.write(json.dumps(error_json(err, message, code), ensure_ascii=False) + "\n")
    sys.stdout.flush()


def _absolute(path: str) -> Path | None:
    try:
        return Path(os.path.abspath(os.path.expanduser(path)))
    except (TypeError, ValueError):
        return None


def _user_path(err: OSError, argv: list[str]) -> str | None:
    """The file an OSError names when it is one the user named, or lies inside or above one; else None."""
    given = [a.split("=", 1)[1] if a.startswith("--") and "=" in a else a for a in argv]
    named = [p for p in (_absolute(a) for a in given if a and not a.startswith("-")) if p is not None]
    for filename in (err.filename, err.filename2):
        if not isinstance(filename, (str, os.PathLike)):
            continue
        failed = _absolute(os.fspath(filename))
        if failed is not None and any(
            failed == p or failed.is_relative_to(p) or (p.is_relative_to(failed) and failed != Path(failed.anchor))
            for p in named
        ):
            return os.fspath(filename)
    return None


class _PathError(Exception):
    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.path = path


def main(argv: list[str] | None = None) -> int:
    """Console-script entry: run the app, map user errors to one stderr line (and a JSON object on stdout with
    --json) and exit 2; Ctrl-C exits 130."""
    argv = list(sys.argv[1:] if argv is None else argv)
    state.debug = env_debug()  # a fresh run: earlier in-process calls must not leave --debug on
    as_json = _flag_given(argv, "--json")
    try:
        result: Any = app(args=argv, prog_name="edgekit", standalone_mode=False)
    except EdgekitError as err:
        if _debug_requested(argv):
            traceback.print_exc()
        if as_json:
            _json_error(err, cli_message(err.reason))
        sys.stderr.write(f"error: {cli_message(str(err))}\n")
        sys.stderr.flush()
        return 2
    except OSError as err:
        filename = _user_path(err, argv)
        if filename is None:
            raise  # not about a path the user gave: a bug, with its traceback
        if _debug_requested(argv):
            traceback.print_exc()
        reason = err.strerror or str(err)
        if as_json:
            _json_error(_PathError(filename), reason, "io_error")
        sys.stderr.write(f"error: {filename}: {reason}\n")
        sys.stderr.flush()
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130
    except typer.Abort as err:
        if isinstance(err.__context__, KeyboardInterrupt) or isinstance(err.__cause__, KeyboardInterrupt):
            sys.stderr.write("interrupted\n")
            return 130
        sys.stderr.write("aborted\n")
        return 1
    except typer.Exit as err:
        return int(err.exit_code)
    except _ClickException as err:  # usage errors: click's own message, exit 2
        if as_json:
            _json_error(err, err.format_message())
        err.show()
        return int(err.exit_code)
    if isinstance(result, int) and not isinstance(result, bool):
        return result
    return 0


if __name__ == "__main__":
    sys.exit(main())
