"""Recipes: an ordered list of passes in TOML, so a model variant is a reviewed file, not a shell history.

    name = "int4-awq"
    description = "..."
    [[pass]]
    name = "int4"
    method = "awq"
    block = 32
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edgekit.errors import ConfigError

from .base import GraphPass, load_toml
from .registry import get_pass_class, make_pass

RECIPE_DIR = Path(__file__).resolve().parents[2] / "models" / "radreport_tiny" / "recipes"


@dataclass
class Recipe:
    name: str
    description: str
    passes: list[GraphPass]


def load_recipe(path: str | Path) -> Recipe:
    """Parse and validate a recipe; every error names the file and the `pass[i].field` at fault."""
    path = Path(path)
    if not path.is_file() and (RECIPE_DIR / f"{path}.toml").is_file():  # `--recipe int4-awq`
        path = RECIPE_DIR / f"{path}.toml"
    data = load_toml(path)
    entries = data.get("pass")
    if not isinstance(entries, list) or not entries:
        raise ConfigError("a recipe needs at least one [[pass]] table", path)
    passes = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise ConfigError(f"pass[{i}]: needs a string `name`", path)
        params = {k: v for k, v in entry.items() if k != "name"}
        try:
            cls = get_pass_class(entry["name"])
            passes.append(cls(cls.Config.from_mapping(params, where=f"pass[{i}] {entry['name']}")))
        except ConfigError as err:
            raise ConfigError(err.reason, path) from err
    return Recipe(name=str(data.get("name", path.stem)), description=str(data.get("description", "")),
                  passes=passes)


def parse_pass_options(specs: list[str]) -> list[GraphPass]:
    """`--pass int4:block=32,method=awq --pass fp16` -> passes."""
    return [make_pass(s) for s in specs]
