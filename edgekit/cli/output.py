"""What a subcommand prints, so every one prints alike: stdout is the result, stderr the rest.

- `emit(data, as_json)` prints the result: JSON on stdout with `--json`, else a readable table. When stdout is not
  a terminal (a log, a pipe) tables are laid out `LOG_WIDTH` wide (`COLUMNS` if set) and cells never fold
  mid-word, so a line can be grepped.
- `progress(...)` draws a bar on stderr, silent when stderr is not a terminal or output is JSON, so piped and
  scripted runs get clean output.
- `warn(message)`: a warning the library returned (ingest, capped options), one `warning: ...` line on stderr.
- `console` (stdout) and `err_console` (stderr), for the lines a table does not hold.

This module imports nothing heavy (rich only), so `--help` stays fast.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console, OverflowMethod
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

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


def _overflow() -> OverflowMethod:
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
