"""`edgekit pareto --knob NAME=VALUE`: any knob a target's plug-in declares, from the command line.

Why: the named flags (`--max-new-tokens`, `--sparsity-target`, ...) cover the core's knobs and the shipped targets';
a new target's `pareto_knobs` reach the CLI through this one flag with no edit outside its package. A value is
typed like the knob's default-grid values (an int grid takes ints, a float grid floats); a knob without a grid
takes an int, else a float, else the text as given. The core's knobs take a positive int, as their flags do.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from edgekit.errors import ConfigError
from edgekit.pareto.configs import CORE_KNOBS, knobs_of, target_knobs


def _guess(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _typed(name: str, text: str, targets: Iterable[str]) -> Any:
    """`text` as the knob's type: the type of its default-grid values on any of `targets`, else a guess."""
    if name in CORE_KNOBS:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise ConfigError(f"--knob {name}={text}: {name} takes a whole number >= 1")
        return value
    for target in targets:
        knob = target_knobs(target).get(name)
        if knob is not None and knob.grid:
            kind = type(knob.grid[0])
            try:
                return kind(text)
            except ValueError:
                raise ConfigError(f"--knob {name}={text}: {name} takes a {kind.__name__}") from None
    return _guess(text)


def parse_knob_flags(flags: Sequence[str] | None, targets: Sequence[str]) -> dict[str, list[Any]]:
    """`NAME=VALUE` flags as `{knob: [values in the order given]}`, each NAME a knob of one of `targets` (the
    loaded bundles' targets); a repeated NAME varies it. Refused in one line: no `=`, or a knob none of them has."""
    known = sorted({k for t in targets for k in knobs_of(t)})
    out: dict[str, list[Any]] = {}
    for flag in flags or ():
        name, sep, text = flag.partition("=")
        name, text = name.strip(), text.strip()
        if not sep or not name or not text:
            raise ConfigError(f"--knob {flag!r}: expected NAME=VALUE (knobs of these bundles: {', '.join(known)})")
        if name not in known:
            raise ConfigError(f"--knob {name}: not a knob of these bundles' targets (they have: {', '.join(known)})")
        out.setdefault(name, []).append(_typed(name, text, targets))
    return out


def merge_knobs(named: dict[str, list[Any] | None], extra: dict[str, list[Any]]) -> dict[str, list[Any] | None]:
    """The named flags' lists with the `--knob` values appended (a knob given both ways is varied over both)."""
    merged = dict(named)
    for name, values in extra.items():
        merged[name] = [*(merged.get(name) or []), *values]
    return merged
