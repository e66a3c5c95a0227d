"""The package graph: dependencies point one way (docs/architecture.md).

Every import in every module counts, at module level or inside a function (a lazy import is still a
dependency). Modules are mapped to names with pyproject.toml's `package-dir`, so `targets/x1/backend.py` is
`edgekit.targets.x1.backend`. A unit is a package (`edgekit.passes`, `edgekit.targets.x1`), except that each module
directly in `edgekit/` is a unit of its own (`edgekit.build`, `edgekit.errors`): the core's top-level modules are
layered among themselves, not one blob.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[1]
LAYERS = ("edgekit.cli", "edgekit.daemon", "edgekit.models", "edgekit.targets.")


def _package_dirs() -> dict[str, Path]:
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())
    return {pkg: REPO / d for pkg, d in cfg["tool"]["setuptools"]["package-dir"].items()}


def _modules() -> dict[str, Path]:
    """Module name -> file, for every module the wheel installs (a mapped folder nested in another, like
    `targets/` under `edgekit`, is named by its own mapping only)."""
    dirs = _package_dirs()
    out = {}
    for pkg, root in sorted(dirs.items(), key=lambda kv: -len(kv[0])):
        for f in root.rglob("*.py"):
            rel = f.relative_to(root).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([pkg, *parts])
            out.setdefault(name, f)
    return out


def _is_package(name: str, modules: dict[str, Path]) -> bool:
    return modules[name].name == "__init__.py"


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if _is_package(name, modules) else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:  # `import edgekit.x.y` names the deepest module that exists
                t = t.rpartition(".")[0]
            if t and t.startswith("edgekit"):
                found.add(t)
    return found


def unit(module: str, modules: dict[str, Path]) -> str:
    if _is_package(module, modules):
        return module
    parent = module.rpartition(".")[0]
    return module if parent == "edgekit" else parent


def layer(u: str) -> str:
    return next(
        (
            lay.rstrip(".")
            for lay in LAYERS
            if u == lay.rstrip(".") or u.startswith(lay) or u.startswith(lay.rstrip(".") + ".")
        ),
        "core",
    )


def unit_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        src = unit(name, modules)
        graph[src]
        for dep in _imports(name, path, modules):
            dst = unit(dep, modules)
            if dst != src:
                graph[src].add(dst)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one unit (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def test_the_walk_sees_the_installed_layout():
    modules = _modules()
    assert "edgekit.targets.x1.backend" in modules and "edgekit.models.synth.generator" in modules
    assert "edgekit.daemon.api" in modules and "edgekit.build" in modules
    graph = unit_graph()
    assert "edgekit.errors" in graph["edgekit.build"]  # a real edge, so an empty graph cannot pass


def test_every_package_is_in_the_wheel():
    """pyproject lists packages by hand (the package-dir mapping needs it): a package missing there installs
    editable but is absent from the wheel users get."""
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    modules = _modules()
    packages = {name for name in modules if _is_package(name, modules)}
    assert packages - listed == set()


def test_no_package_cycles():
    assert _cycles(unit_graph()) == []


def module_graph(package: str) -> dict[str, set[str]]:
    """Module-level imports inside `package` (its `__init__` aside: the package's own facade)."""
    modules = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        if name.startswith(package + "."):
            graph[name]
            graph[name] |= {d for d in _imports(name, path, modules) if d.startswith(package + ".") and d != name}
    return graph


@pytest.mark.parametrize("target", ["cpu", "orin", "x1"])
def test_no_module_cycles_inside_a_target(target):
    """A target's modules import one way, type-only imports included: x1's patterns see the walk through
    `LoweringContext`, its binder the emulator through `BindEnv`."""
    graph = module_graph(f"edgekit.targets.{target}")
    assert len(graph) > 3 and _cycles(graph) == []


def test_the_core_imports_no_target_model_daemon_or_cli():
    bad = sorted(
        (src, dst)
        for src, dsts in unit_graph().items()
        for dst in dsts
        if layer(src) == "core" and layer(dst) != "core"
    )
    assert bad == []


def test_targets_and_models_import_only_the_core():
    """A target runs any model family and a model family builds for any target: neither names the other."""
    bad = sorted(
        (src, dst)
        for src, dsts in unit_graph().items()
        for dst in dsts
        if layer(src) in ("edgekit.targets", "edgekit.models")
        and layer(dst) not in ("core", layer(src))
        or (
            layer(src) == "edgekit.targets"
            and layer(dst) == "edgekit.targets"
            and src.split(".")[2] != dst.split(".")[2]
        )
    )
    assert bad == []


def test_the_daemon_does_not_import_the_cli():
    bad = sorted(
        (s, d)
        for s, ds in unit_graph().items()
        for d in ds
        if layer(s) == "edgekit.daemon" and layer(d) == "edgekit.cli"
    )
    assert bad == []


# a compiled extension is private to the one module that wraps it
EXTENSION_WRAPPERS = {("edgekit.targets.x1.kernels", "_native")}


def test_no_module_imports_another_modules_private_names():
    modules = _modules()
    scripts = {f"bench.{p.stem}": p for p in (REPO / "bench").glob("*.py")}  # benches use the library as users do
    bad = []
    for name, path in {**modules, **scripts}.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-1:] != ["__future__"]:
                mod = node.module or ""
                bad += [
                    f"{name}: from {'.' * node.level}{mod} import {a.name}"
                    for a in node.names
                    if a.name.startswith("_")
                    and not a.name.startswith("__")
                    and (name, a.name) not in EXTENSION_WRAPPERS
                ]
                bad += [
                    f"{name}: from {'.' * node.level}{mod}"
                    for _ in [0]
                    if any(p.startswith("_") and not p.startswith("__") for p in mod.split(".") if p)
                ]
    assert bad == []


if __name__ == "__main__":  # print the unit graph (for docs/architecture.md and review notes)
    g = unit_graph()
    for src in sorted(g):
        print(f"{src} -> {', '.join(sorted(g[src])) or '-'}")
    print("cycles:", _cycles(g))
