"""How a failed `edgekit` run ends, the same in every subcommand: one line, an exit status, no traceback.

- An `EdgekitError` (bad input) is one stderr line naming the file and the reason, exit 2; with `--json` the same
  error is also printed on stdout as `{"error": {"code", "message", "file"}}` (`error_json`).
- Library errors name parameters (`overwrite`); on the command line the user knows them by their flags
  (`--force`): `cli_message` rewrites them through `PARAM_FLAGS`.
- An `OSError` on a path the user named on the command line (or one inside or above it: `-o /proc/nope/x` fails on
  `/proc/nope`) is one line too, exit 1, code `io_error`: the disk, not the input.
- A usage error is click's own message, exit 2 (and the JSON object with `--json`); Ctrl-C exits 130.
- Any other exception is a bug and keeps its traceback. `--debug` (or EDGEKIT_DEBUG=1) prints the traceback of
  the ones above too; `state.debug` mirrors the global flag.

`exit_status` is the one place these rules live; the frame (`app.main`) hands it whatever a run raised.
"""

from __future__ import annotations

import json
import os
import re
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import typer

from edgekit.errors import EdgekitError

if TYPE_CHECKING:
    from typing_extensions import TypeIs  # typing's own from Python 3.13

# typer >= 0.2x vendors its own click; take click's class from typer so either kind works.
_ClickException = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


class _UsageError(Protocol):
    """What `exit_status` uses of click's ClickException; which click defines it depends on typer's version."""

    exit_code: int

    def format_message(self) -> str: ...

    def show(self) -> None: ...


def _is_usage_error(err: object) -> TypeIs[_UsageError]:
    """True for click's usage errors; `_ClickException` is found at run time, so the checker needs the guard."""
    return isinstance(err, _ClickException)


# Library errors name parameters; on the command line the user knows them by their flags.
PARAM_FLAGS: dict[str, str] = {
    "overwrite": "--force",
    "passes": "--pass",
    "recipe": "--recipe",
    "strict": "--strict",
    "head_sparsity": "--head-sparsity",
    "max_new_tokens": "--max-new-tokens",
    "top_p": "--top-p",
    "temperature": "--temperature",
    "model_dir": "MODEL",
    "eval_data": "--eval",
    "image_size": "--image-size",
    "engine": "--engine",
}
_NAMES = "|".join(PARAM_FLAGS)
_PARAM_RE = re.compile(rf"`({_NAMES})(=[^`]*)?`|\b({_NAMES})=True\b")


def _as_flag(m: re.Match) -> str:
    flag = PARAM_FLAGS[m.group(1) or m.group(3)]
    value = (m.group(2) or "=True")[1:]
    return flag if value in ("True", "False") else f"{flag} {value}"


def cli_message(message: str) -> str:
    """Rewrite the parameters a library error names, in backquotes (`passes`, `overwrite=True`, `engine=onnxruntime`)
    or as a bare `name=True`, as their CLI flags (a value other than True/False stays: `--engine onnxruntime`)."""
    return _PARAM_RE.sub(_as_flag, message)


def error_json(err: BaseException, message: str, code: str = "usage_error") -> dict:
    """An error as `--json` prints it on stdout: a stable code, the one-line message and the file it names."""
    path = getattr(err, "path", None)
    return {"error": {"code": getattr(err, "code", code), "message": message, **({"file": path} if path else {})}}


@dataclass
class _State:
    debug: bool = False


def env_debug() -> bool:
    """EDGEKIT_DEBUG set to anything but empty, 0 or false: show tracebacks."""
    return os.environ.get("EDGEKIT_DEBUG", "") not in ("", "0", "false", "False")


state = _State(debug=env_debug())


def flag_given(argv: list[str], flag: str) -> bool:
    """`flag` is on the command line, before any `--`."""
    args = argv[: argv.index("--")] if "--" in argv else argv
    return flag in args


def _debug_requested(argv: list[str]) -> bool:
    return env_debug() or state.debug or flag_given(argv, "--debug")


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


def _line(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def _input_error(err: EdgekitError, argv: list[str], as_json: bool) -> int:
    if _debug_requested(argv):
        traceback.print_exc()
    if as_json:
        _json_error(err, cli_message(err.reason))
    _line(f"error: {cli_message(str(err))}")
    return 2


def _disk_error(err: OSError, argv: list[str], as_json: bool) -> int | None:
    filename = _user_path(err, argv)
    if filename is None:
        return None  # not about a path the user gave: a bug, with its traceback
    if _debug_requested(argv):
        traceback.print_exc()
    reason = err.strerror or str(err)
    if as_json:
        _json_error(_PathError(filename), reason, "io_error")
    _line(f"error: {filename}: {reason}")
    return 1


def _aborted(err: BaseException) -> int:
    if isinstance(err.__context__, KeyboardInterrupt) or isinstance(err.__cause__, KeyboardInterrupt):
        _line("interrupted")
        return 130
    _line("aborted")
    return 1


def exit_status(err: BaseException, argv: list[str]) -> int | None:
    """Print what a run that raised `err` ends with (one stderr line; the JSON object on stdout with `--json`; the
    traceback with --debug) and return its exit status; None for an exception that is a bug, which the caller
    re-raises with its traceback. Called inside the `except` block, so `--debug` prints the traceback."""
    as_json = flag_given(argv, "--json")
    if isinstance(err, EdgekitError):
        return _input_error(err, argv, as_json)
    if isinstance(err, OSError):
        return _disk_error(err, argv, as_json)
    if isinstance(err, KeyboardInterrupt):
        _line("interrupted")
        return 130
    if isinstance(err, typer.Abort):
        return _aborted(err)
    if isinstance(err, typer.Exit):
        return int(err.exit_code)
    if _is_usage_error(err):  # usage errors: click's own message, exit 2
        if as_json:
            _json_error(err, err.format_message())
        err.show()
        return int(err.exit_code)
    return None
