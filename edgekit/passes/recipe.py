"""Recipes: an ordered list of passes in TOML, so a model variant is a reviewed file, not a shell history.

    name = "int4-awq"
    description = "..."
    [[pass]]
    name = "int4"
    method = "awq"
    block = 32

A recipe is a file path, or the name of one a model family ships (`int4-awq`); the family plug-in says where its
recipes are (`ModelFamily.recipe_path`), so this works from a checkout and from an installed wheel alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edgekit.errors import ConfigError
from edgekit.plugins import DEFAULT_MODEL, get_model_family

from .base import GraphPass
from .config import load_toml
from .registry import get_pass_class, make_pass


@dataclass
class Recipe:
    name: str
    description: str
    passes: list[GraphPass]


def resolve_recipe(recipe: str | Path, family: str = DEFAULT_MODEL) -> Path:
    """A recipe file, else the recipe of that name the model family ships (`int4-awq`)."""
    path = Path(recipe)
    if path.is_file():
        return path
    shipped = get_model_family(family).recipe_path(str(recipe))
    return shipped if shipped is not None else path  # not found: `load_toml` names the path asked for


def load_recipe(recipe: str | Path, *, family: str = DEFAULT_MODEL) -> Recipe:
    """Parse and validate a recipe; every error names the file and the `pass[i].field` at fault."""
    path = resolve_recipe(recipe, family)
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
    return Recipe(name=str(data.get("name", path.stem)), description=str(data.get("description", "")), passes=passes)


def parse_pass_options(specs: list[str]) -> list[GraphPass]:
    """Pass specs (`["int4:block=32,method=awq", "fp16"]`) -> passes, in order."""
    return [make_pass(s) for s in specs]
