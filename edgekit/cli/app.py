"""The `edgekit` command: a thin frame that finds subcommands and turns user errors into one clear line.

Modelled on Polygraphy: each subcommand lives in its own small module, `edgekit/cli/<name>_cmd.py`, exposing
`app = typer.Typer(...)`. Modules are imported only when their subcommand runs (or help is shown), so a slow
import (onnxruntime, torch) never slows down another subcommand. Every name in `SUBCOMMANDS` must have its module:
one that is missing is a packaging mistake and fails loudly (tests/test_cli_frame.py imports them all).

Errors: whatever a run raises goes to `errors.exit_status`, which prints an `EdgekitError` as one line naming
the file and the reason (exit 2; a JSON object too with `--json`), an `OSError` on a path the user named as one
line (exit 1), and lets any other exception, a bug, keep its traceback.
"""

from __future__ import annotations

import importlib
import sys
from typing import Annotated, Any, Protocol, TypeGuard

import typer
from typer.core import TyperGroup

from edgekit import __version__
from edgekit.cli.errors import env_debug, exit_status, state
from edgekit.ingest.decode_threads import decode_threads, set_threads

# typer >= 0.2x vendors its own click; take click's class from typer so either kind works.
_Command = next(c for c in TyperGroup.__mro__ if c.__name__ == "Command")


class _Subcommand(Protocol):
    """What `_load` sets on click's Command; which click defines it depends on typer's version."""

    name: str | None
    params: list[Any]
    help: str | None


def _is_command(obj: object) -> TypeGuard[_Subcommand]:
    """True for a click Command; `_Command` is found at run time, so the checker needs the guard."""
    return isinstance(obj, _Command)


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
    command: _Subcommand
    if isinstance(sub, typer.Typer):
        command = typer.main.get_command(sub)
    elif _is_command(sub):
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


def main(argv: list[str] | None = None) -> int:
    """Console-script entry: run the app; what it raises ends as `errors.exit_status` says (one stderr line, exit 2
    for bad input), unless it is a bug."""
    argv = list(sys.argv[1:] if argv is None else argv)
    state.debug = env_debug()  # a fresh run: earlier in-process calls must not leave --debug on
    set_threads(decode_threads())  # a study decoded here has every CPU; set before any command starts a thread
    try:
        result: Any = app(args=argv, prog_name="edgekit", standalone_mode=False)
    except (Exception, KeyboardInterrupt) as err:
        status = exit_status(err, argv)
        if status is None:
            raise  # a bug: its traceback
        return status
    if isinstance(result, int) and not isinstance(result, bool):
        return result
    return 0


if __name__ == "__main__":
    sys.exit(main())
