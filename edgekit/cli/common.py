"""Pieces every `edgekit` subcommand shares, so all of them behave alike.

- `JsonOption`: the `--json` flag; `emit(data, as_json)` prints JSON to stdout or a readable table.
- `progress(...)`: a progress bar on stderr, silent when stderr is not a terminal or output is JSON, so
  piped and scripted runs get clean output.
- `console` (stdout) and `err_console` (stderr); `state.debug` mirrors the global `--debug` flag.

Subcommand modules (`edgekit/cli/<name>_cmd.py`) define `app = typer.Typer(...)`, raise `EdgekitError` for bad
input (the frame prints it as one line, exit 2) and import from here, never from `edgekit.cli.app`.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)

JsonOption = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")]


@dataclass
class _State:
    debug: bool = False


state = _State(debug=os.environ.get("EDGEKIT_DEBUG", "") not in ("", "0", "false", "False"))


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


def emit(data: Any, as_json: bool, *, title: str | None = None) -> None:
    """Print a result: JSON on stdout with `--json`, else a rich table (dict: key/value; list of dicts: rows)."""
    if as_json:
        sys.stdout.write(to_json(data) + "\n")
        sys.stdout.flush()
        return
    if isinstance(data, Mapping):
        table = Table(title=title, show_header=False, box=None, pad_edge=False)
        table.add_column(style="bold")
        table.add_column(overflow="fold")
        for key, value in _flatten(data):
            table.add_row(key, Text(_cell(value)))  # values are data, never rich markup
        console.print(table)
    elif isinstance(data, Sequence) and not isinstance(data, (str, bytes)) and data and all(
        isinstance(row, Mapping) for row in data
    ):
        columns: list[str] = []
        for row in data:
            columns.extend(k for k in row if k not in columns)
        table = Table(title=title)
        for col in columns:
            table.add_column(col, overflow="fold")
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
