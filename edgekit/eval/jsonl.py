"""JSON Lines files as the evaluations read them (a split's `studies.jsonl`, a text model's prompts): one object
per line, blank lines skipped, and a line that is not an object refused in one line naming its number."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from edgekit.errors import EdgekitError


def json_objects(path: Path, *, hint: str = "") -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-blank line of `path`; `hint` follows the refusal of a file that is not
    UTF-8 (what to do instead)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise EdgekitError(f"not UTF-8 text (byte {e.start}){hint}", path) from e
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise EdgekitError(f"line {number}: not a JSON object ({e.msg}, column {e.colno})", path) from e
        if not isinstance(record, dict):
            raise EdgekitError(f"line {number}: not a JSON object (a {type(record).__name__})", path)
        yield number, record
