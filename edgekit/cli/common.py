"""Pieces every `edgekit` subcommand shares, so all of them behave alike.

As in Polygraphy's argument groups, a flag is defined once, here, and every subcommand that takes it imports it, so
`-s` or `--force` mean the same thing everywhere:

- `BundleArgument`, `ModelArgument`: the positional input (a bundle; a model directory, default the embedded one).
- `StudyOption` (`--study/-s`; `OptionalStudyOption` where a text model's bundle may take none), `PromptOption`
  (`--prompt/-p`), `ThreadsOption` (`--threads`), `EngineOption` (`--engine default|onnxruntime`, for the
  commands that run a bundle: `engine_name` turns it into `RuntimeOptions.engine`, `runs_on` names what ran),
  `MachineOption` (`--machine`), `JsonOption` (`--json`), `ImageSizeOption` (`--image-size`: pins a Hugging Face
  Qwen2-VL's dynamic resolution; `build` and `convert` hand it to the library's `image_size`).
- `out_option(what)` (`--out/-o`) with `ForceOption` (`--force`): an output that already exists is refused, naming
  it, unless `--force` is given; so is one that cannot be created (under a file, in a folder not writable). Both
  before the command body runs. Every command that writes an output takes both flags.
- The sampling flags (`--max-new-tokens`, `--temperature`, `--top-p`, `--seed`), handed to `Reporter.options(...)`
  (the one merge with a bundle's generation config). Their bounds are the library's
  (`edgekit.generate.MAX_NEW_TOKENS`, `MAX_TEMPERATURE`), read when a flag is given, so `--help` does not import
  numpy.
- `examples(...)`: the Examples epilog every subcommand's `--help` ends with (tests/test_cli_help_examples.py runs
  each line).
- `emit(data, as_json)` prints JSON to stdout or a readable table; `progress(...)` draws a bar on stderr, silent
  when stderr is not a terminal or output is JSON, so piped and scripted runs get clean output. When stdout is
  not a terminal (a log, a pipe) tables are laid out `LOG_WIDTH` wide (`COLUMNS` if set) and cells never fold
  mid-word.
- `warn(message)`: a warning the library returned (ingest, capped options), one `warning: ...` line on stderr.
- `console` (stdout) and `err_console` (stderr); `state.debug` mirrors the global `--debug` flag.
- `PARAM_FLAGS` / `cli_message(...)`: library errors name parameters (`overwrite`), the CLI prints the flag
  (`--force`).

Subcommand modules (`edgekit/cli/<name>_cmd.py`) define `app = typer.Typer(...)`, raise `EdgekitError` for bad
input (the frame prints it as one line and exits 2, or as a JSON object with `--json`) and import from here, never
from `edgekit.cli.app`. This module imports nothing heavy, so `--help` stays fast.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from edgekit.errors import ConfigError

LOG_WIDTH = 200  # columns of a table written to a log or pipe (rich would use 80 and fold cells)


def _width(stream: Any) -> int | None:
    """None (rich's own, the terminal's width) on a terminal; else COLUMNS or LOG_WIDTH."""
    try:
        if stream.isatty():
            return None
    except (AttributeError, ValueError):
        pass
    columns = os.environ.get("COLUMNS", "")
    return int(columns) if columns.isdigit() and int(columns) > 0 else LOG_WIDTH


console = Console(highlight=False, width=_width(sys.stdout))
err_console = Console(stderr=True, highlight=False, width=_width(sys.stderr))

# --- the shared arguments and flags -------------------------------------------------------------------------------

BundleArgument = Annotated[Path, typer.Argument(help="Bundle directory or .ekb file.", show_default=False)]
ModelArgument = Annotated[
    Path | None,
    typer.Argument(
        help="Model directory (model.safetensors, config.json, tokenizer.json, ...). Default: the embedded "
        "radreport-tiny.",
        show_default=False,
    ),
]
STUDY_HELP = "The study: a DICOM file, a folder holding one series, a .zip of one series, or a video file."
StudyOption = Annotated[Path, typer.Option("--study", "-s", help=STUDY_HELP, show_default=False)]
# `edgekit run`: a text model's bundle (a decoder alone) reads the prompt only, so there the study is optional
OptionalStudyOption = Annotated[
    Path | None,
    typer.Option(
        "--study", "-s", help=STUDY_HELP + " Required, unless the bundle is a text model's.", show_default=False
    ),
]
PromptOption = Annotated[str, typer.Option("--prompt", "-p", help="Clinical indication / request text.")]
ThreadsOption = Annotated[
    int | None, typer.Option("--threads", min=1, help="Intra-op threads (default: physical cores).")
]


class Engine(str, Enum):
    """`--engine`: the bundle's target's own engine, or its ONNX graphs in ONNX Runtime (the library checks that
    the target has it: `edgekit.plugins.resolve_engine`)."""

    default = "default"
    onnxruntime = "onnxruntime"


EngineOption = Annotated[
    Engine,
    typer.Option(
        "--engine",
        help="What runs the bundle: default, its target's own engine (cpu: ONNX Runtime; x1: the emulator; orin: "
        "TensorRT, on the Jetson), or onnxruntime, its ONNX graphs in ONNX Runtime on this machine's CPU: an orin "
        "bundle off the Jetson, with latency and energy estimated by the Orin cost model (labelled estimated, "
        "not measured).",
    ),
]


def engine_name(engine: Engine | str) -> str | None:
    """`RuntimeOptions.engine` for `--engine`: None for the target's own."""
    value = engine.value if isinstance(engine, Engine) else str(engine)
    return None if value == Engine.default.value else value


def runs_on(bundle, engine: str | None) -> tuple[str | None, str]:
    """The engine that runs `bundle` (`engine`, checked: one its target has; None: the target's own) and the words
    a title names it with: `orin` on the target's own engine, `orin via onnxruntime (not tensorrt)` on another."""
    from edgekit.plugins import resolve_engine

    used, own = resolve_engine(bundle, engine), resolve_engine(bundle)
    return used, bundle.target if used == own else f"{bundle.target} via {used} (not {own})"


MachineOption = Annotated[
    Path | None, typer.Option("--machine", help="X1 machine description TOML (default: the bundled x1-default.toml).")
]
StateDirOption = Annotated[
    Path | None,
    typer.Option(
        "--state-dir",
        help="Where engines are cached (default: $EDGEKIT_STATE_DIR, else $XDG_STATE_HOME/edgekit or "
        "~/.local/state/edgekit; edgekitd uses its own, /var/lib/edgekit).",
    ),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout (errors too).")]
ImageSizeOption = Annotated[
    int | None,
    typer.Option(
        "--image-size",
        min=1,
        metavar="S",
        help="Hugging Face Qwen2-VL / Qwen2.5-VL: build at one S x S resolution (S a multiple of patch_size * "
        "merge_size, 28 for the released models), pinning the processor's dynamic resolution (min_pixels = "
        "max_pixels = S*S in the output's preprocessor_config.json; the model directory is not modified). "
        "Refused for other models, whose side their own config sets.",
        show_default=False,
    ),
]
# Eager, so its value is known when `--out` is checked, whatever the order on the command line.
ForceOption = Annotated[
    bool, typer.Option("--force", is_eager=True, help="Replace the output (--out) if it already exists.")
]


# The sampling flags: they only override the bundle's generation config when given. The bounds are the library's,
# imported when a flag is checked (edgekit.generate pulls in numpy; --help must stay fast).
def _max_new_tokens(value: int | None) -> int | None:
    from edgekit.generate import MAX_NEW_TOKENS

    if value is not None and not 1 <= value <= MAX_NEW_TOKENS:
        raise typer.BadParameter(f"{value} is not in [1, {MAX_NEW_TOKENS}]")
    return value


def _temperature(value: float) -> float:
    from edgekit.generate import MAX_TEMPERATURE

    if not 0 <= value <= MAX_TEMPERATURE:  # NaN fails too
        raise typer.BadParameter(f"{value:g} is not in [0, {MAX_TEMPERATURE:g}]")
    return value


MaxNewTokensOption = Annotated[
    int | None,
    typer.Option(
        "--max-new-tokens",
        callback=_max_new_tokens,
        help="Most tokens to generate, at least 1 (default: the bundle's generation config; capped at what the "
        "model's context leaves).",
    ),
]
TemperatureOption = Annotated[
    float, typer.Option("--temperature", callback=_temperature, help="Sampling temperature, from 0 (greedy).")
]


def _top_p(value: float) -> float:
    if not 0 < value <= 1:
        raise typer.BadParameter(f"{value:g} is not in (0, 1]")
    return value


TopPOption = Annotated[
    float,
    typer.Option(
        "--top-p", callback=_top_p, help="Nucleus sampling: keep the most likely tokens up to this mass, in (0, 1]."
    ),
]
SeedOption = Annotated[int | None, typer.Option("--seed", help="Seed for sampling (same seed, same report).")]


def output_exists(path: Path) -> bool:
    """A file, or a folder with something in it: what `--out` refuses to replace without `--force`."""
    if path.is_dir():
        return any(path.iterdir())
    return path.exists() or path.is_symlink()


def writable_out(path: Path) -> None:
    """Refuse an output that cannot be created: the nearest existing folder above it is a file, or not writable.

    Checked before any work, so a long build never ends on a traceback from `mkdir`."""
    above = path.parent
    while not (above.exists() or above.is_symlink()) and above.parent != above:
        above = above.parent
    if not above.is_dir():
        raise ConfigError(f"cannot be written: {above} is a file, not a folder", path)
    if not os.access(above, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot be written: no permission to write in {above}", path)


def claim_out(path: Path | None, force: bool) -> None:
    """Refuse to write over an existing output unless `--force` was given, and an output that cannot be written."""
    if path is None:
        return
    if not force and output_exists(path):
        raise ConfigError("already exists; pass --force to replace it", path)
    writable_out(path)


def _check_out(ctx: typer.Context, value: Path | None) -> Path | None:
    if not ctx.resilient_parsing:  # not while completing or showing help
        claim_out(value, bool(ctx.params.get("force", False)))
    return value


def out_option(what: str) -> Any:
    """`--out/-o`: `what` says what is written there. An existing output is refused unless `--force` (ForceOption,
    which the command must also take) is given; the check runs before the command body, so nothing is half done."""
    return typer.Option("--out", "-o", help=f"{what} Refused if it exists, unless --force.", callback=_check_out)


def examples(*commands: str, note: str = "") -> str:
    """The Examples epilog: one runnable command per line (a trailing `# comment` is allowed), then a note.

    Every line must run as written on the embedded model, the bundled samples and the outputs of other examples
    (`out/radreport-tiny-cpu`, `out/radreport-tiny-x1`, `data/test`); tests/test_cli_help_examples.py runs them."""
    text = "Examples:\n\n" + "\n\n".join(f"  {escape(c)}" for c in commands)
    return text + (f"\n\n{escape(note)}" if note else "")


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


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if hasattr(value, "tolist"):  # numpy scalars and arrays
        return value.tolist()
    if hasattr(value, "to_dict"):
        return value.to_dict()
    return str(value)


def to_json(data: Any) -> str:
    return json.dumps(data, indent=2, default=_jsonable, ensure_ascii=False)


def _flatten(data: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = []
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            rows.extend(_flatten(value, name + "."))
        else:
            rows.append((name, value))
    return rows


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (list, tuple)) and all(not isinstance(v, (dict, list)) for v in value):
        return ", ".join(_cell(v) for v in value)
    if isinstance(value, (dict, list, tuple)):
        return to_json(value) if len(str(value)) > 60 else json.dumps(value, default=_jsonable)
    return "" if value is None else str(value)


def _overflow() -> str:
    """On a terminal a cell too wide folds; in a log it is left whole (a word cut in two cannot be grepped)."""
    return "fold" if console.is_terminal else "ignore"


def warn(message: str) -> None:
    """One warning line on stderr (stdout stays the result, JSON included)."""
    err_console.print(f"warning: {message}", markup=False, highlight=False, soft_wrap=True)


def emit(data: Any, as_json: bool, *, title: str | None = None) -> None:
    """Print a result: JSON on stdout with `--json`, else a rich table (dict: key/value; list of dicts: rows)."""
    if as_json:
        sys.stdout.write(to_json(data) + "\n")
        sys.stdout.flush()
        return
    if isinstance(data, Mapping):
        table = Table(title=title, show_header=False, box=None, pad_edge=False)
        table.add_column(style="bold", no_wrap=True)
        table.add_column(overflow=_overflow())
        for key, value in _flatten(data):
            table.add_row(key, Text(_cell(value)))  # values are data, never rich markup
        console.print(table)
    elif (
        isinstance(data, Sequence)
        and not isinstance(data, (str, bytes))
        and data
        and all(isinstance(row, Mapping) for row in data)
    ):
        columns: list[str] = []
        for row in data:
            columns.extend(k for k in row if k not in columns)
        table = Table(title=title)
        for col in columns:
            table.add_column(col, overflow=_overflow())
        for row in data:
            table.add_row(*(Text(_cell(row.get(c))) for c in columns))
        console.print(table)
    else:
        console.print(_cell(data), markup=False)


class _Task:
    def __init__(self, bar: Progress | None, task_id: Any) -> None:
        self._bar, self._id = bar, task_id

    def advance(self, n: float = 1) -> None:
        if self._bar is not None:
            self._bar.advance(self._id, n)

    def update(self, **kwargs: Any) -> None:
        if self._bar is not None:
            self._bar.update(self._id, **kwargs)


@contextmanager
def progress(description: str, total: float | None = None, *, as_json: bool = False) -> Iterator[_Task]:
    """A progress bar on stderr; yields a task with `advance(n)`. A no-op when not a TTY or with --json."""
    if as_json or not err_console.is_terminal:
        yield _Task(None, None)
        return
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=err_console,
        transient=True,
    )
    with bar:
        yield _Task(bar, bar.add_task(description, total=total))
