"""Typed pass configs: what users type (`block=32,method=awq`, or a TOML table), checked field by field.

Why here and not in each pass: every value arrives as a string or a TOML scalar, and every mistake (a wrong type,
an out-of-range number, an unknown key) should fail the same way, with a `ConfigError` naming `pass.field`.
A pass declares its fields once with `param(...)`; parsing, coercion and range checks live only in this module.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgekit.compat import tomllib
from edgekit.errors import ConfigError


def param(
    default: Any,
    *,
    choices: Sequence[Any] | None = None,
    min: float | None = None,  # noqa: A002
    max: float | None = None,
    help: str = "",
) -> Any:  # noqa: A002
    """A config field with its allowed values; `PassConfig.from_mapping` enforces them and names the field."""
    meta = {"choices": tuple(choices) if choices is not None else None, "min": min, "max": max, "help": help}
    if isinstance(default, (list, dict, set)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def coerce(value: Any, kind: Any, where: str) -> Any:
    """Turn a TOML value or a `key=value` string into `kind` (bool, int, float, str, tuple/list of those)."""
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):  # Optional[X]
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "")):
            return None
        return coerce(value, args[0], where)
    if origin in (list, tuple):
        (item,) = typing.get_args(kind)[:1] or (str,)
        items = value.split(";") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        out = [coerce(v.strip() if isinstance(v, str) else v, item, where) for v in items if v != ""]
        return tuple(out) if origin is tuple else out
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if kind is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        try:
            as_float = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected an integer, got {value!r}") from None
        if not as_float.is_integer():
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return int(as_float)
    if kind is float:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
    if kind is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    return value


def check_range(value: Any, meta: Mapping[str, Any], where: str) -> None:
    """Enforce a field's `choices`, `min` and `max` (on each item of a list)."""
    if value is None:
        return
    items = value if isinstance(value, (list, tuple)) else [value]
    for item in items:
        choices = meta.get("choices")
        if choices is not None and item not in choices:
            raise ConfigError(f"{where}: {item!r} is not one of {', '.join(map(str, choices))}")
        lo, hi = meta.get("min"), meta.get("max")
        if lo is not None and item < lo:
            raise ConfigError(f"{where}: {item!r} is below the minimum {lo}")
        if hi is not None and item > hi:
            raise ConfigError(f"{where}: {item!r} is above the maximum {hi}")


@dataclass
class PassConfig:
    """Base of every pass's config. Subclasses are dataclasses whose fields use `param(...)`."""

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, where: str = "pass") -> PassConfig:
        """Build from TOML values or parsed strings; unknown keys, wrong types and out-of-range values raise
        `ConfigError` naming `where.field`."""
        hints = typing.get_type_hints(cls)
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigError(
                f"{where}: unknown parameter(s) {', '.join(unknown)}; known: {', '.join(known) or '(none)'}"
            )
        kwargs = {}
        for name, raw in values.items():
            here = f"{where}.{name}"
            value = coerce(raw, hints[name], here)
            check_range(value, known[name].metadata, here)
            kwargs[name] = value
        config = cls(**kwargs)
        config.validate(where)
        return config

    @classmethod
    def from_string(cls, text: str, *, where: str = "pass") -> PassConfig:
        """`block=32,method=awq` -> config. List values are separated by `;` (`keep=lm_head;model.layers.0.*`)."""
        values: dict[str, str] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            if "=" not in part:
                raise ConfigError(f"{where}: expected key=value, got {part!r}")
            key, value = (s.strip() for s in part.split("=", 1))
            values[key] = value
        return cls.from_mapping(values, where=where)

    def validate(self, where: str) -> None:
        """Cross-field checks; override and raise `ConfigError(f"{where}.field: ...")`."""

    def to_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self).items()}


def load_toml(path: str | Path) -> dict[str, Any]:
    """A TOML file as a dict; a missing or malformed file is a `ConfigError` naming it."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("recipe not found", path)
    try:
        return tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"not valid TOML ({exc})", path) from exc
