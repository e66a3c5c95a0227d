"""Every subcommand's `--help` ends with examples, and every example runs as written (exit 0).

The examples are parsed out of the rendered `--help` of each command and sub-command, found by walking the CLI
(so a new subcommand without examples fails here), and run in-process through `edgekit.cli.app.main` in a fresh
folder holding what the examples assume:

- `models/`: the package's `edgekit.models` (the embedded weights, recipes and bundled samples), found with
  importlib.resources;
- `out/radreport-tiny-cpu`, `out/radreport-tiny-x1`: the default model's bundles (what `edgekit build`'s first two
  examples write);
- `data/test`: 8 studies of the synthetic test split (what `edgekit data synth -o data/test` writes);
- `hf/tiny-llama`, `hf/train.jsonl`, `hf/eval.jsonl`: a random-init Hugging Face LLaMA and a small task in JSON
  Lines (tests/finetune_factory.py), for `edgekit finetune`; made only where the train extra is installed.

Examples of `build` start without `out/`, and those of `data` without `data/`: they are the ones that make them.
`a && b` runs both; `edgekit ... | jq FILTER` runs the edgekit part and checks its stdout is JSON (and, when jq is
installed, that jq accepts it).
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import json
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from edgekit.cli.app import SUBCOMMANDS, app, main

WITHOUT = {"build": ("out",), "data": ("data",)}  # the folders a command's examples make themselves


def _commands() -> list[tuple[str, ...]]:
    """Every command and sub-command path, e.g. ("bundle", "pack"), walked from the click tree."""
    import typer

    root = typer.main.get_command(app)
    paths: list[tuple[str, ...]] = []

    def walk(cmd, path: tuple[str, ...]) -> None:
        if path:
            paths.append(path)
        if hasattr(cmd, "list_commands"):
            ctx = cmd.make_context(path[-1] if path else "edgekit", [], resilient_parsing=True)
            for name in cmd.list_commands(ctx):
                walk(cmd.get_command(ctx, name), (*path, name))

    walk(root, ())
    return paths


COMMANDS = _commands()


def _help(path: tuple[str, ...], capsys, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "1000")  # rich wraps at the terminal width; no example may be cut in two
    capsys.readouterr()
    assert main([*path, "--help"]) == 0
    return capsys.readouterr().out


def _examples(help_text: str) -> list[str]:
    lines = [line.strip() for line in help_text.splitlines()]
    assert "Examples:" in lines, "no Examples section"
    after = lines[lines.index("Examples:") + 1 :]
    return [line for line in after if line.startswith("edgekit ")]


def _steps(example: str) -> list[tuple[list[str], list[str] | None]]:
    """`a && b | jq f` -> [(argv of a, None), (argv of b, ["jq", "f"])], each argv without the leading `edgekit`."""
    lexer = shlex.shlex(example, posix=True, punctuation_chars="&|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    tokens = list(lexer)
    steps, current, pipe = [], [], None
    for tok in [*tokens, "&&"]:
        if tok == "&&":
            assert current and current[0] == "edgekit", f"not an edgekit command: {current}"
            steps.append((current[1:], pipe))
            current, pipe = [], None
        elif tok == "|":
            pipe = []
        elif pipe is not None:
            pipe.append(tok)
        else:
            current.append(tok)
    return steps


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    from edgekit.build import build
    from edgekit.models.synth.splits import write_split

    root = tmp_path_factory.mktemp("world")
    (root / "models").symlink_to(Path(str(importlib.resources.files("edgekit.models"))), target_is_directory=True)
    build("cpu", root / "out" / "radreport-tiny-cpu", parity=False)
    build("x1", root / "out" / "radreport-tiny-x1", parity=False)
    write_split(root / "data" / "test", "test", 8)
    if importlib.util.find_spec("peft") is not None:
        from finetune_factory import make_llama, reverse_task, write_jsonl

        make_llama(root / "hf" / "tiny-llama")
        write_jsonl(root / "hf" / "train.jsonl", reverse_task(32, seed=1))
        write_jsonl(root / "hf" / "eval.jsonl", reverse_task(8, seed=2))
    return root


def _fresh(world: Path, dest: Path, command: tuple[str, ...]) -> Path:
    skip = WITHOUT.get(command[0], ())
    for item in world.iterdir():
        if item.name in skip:
            continue
        if item.is_symlink():
            (dest / item.name).symlink_to(item.readlink(), target_is_directory=True)
        else:
            shutil.copytree(item, dest / item.name)
    return dest


def test_every_subcommand_module_imports_and_is_listed():
    """A missing or broken subcommand module is a packaging mistake: it must fail, not vanish from the CLI."""
    import importlib

    for name in SUBCOMMANDS:
        module = importlib.import_module(f"edgekit.cli.{name}_cmd")
        assert module.app is not None
    assert {p[0] for p in COMMANDS} == set(SUBCOMMANDS)
    for group, subs in {
        "bundle": {"inspect", "verify", "pack", "unpack", "keygen", "sign"},
        "x1": {"estimate", "compile", "inspect"},
        "data": {"synth"},
    }.items():
        assert {p[1] for p in COMMANDS if len(p) == 2 and p[0] == group} == subs


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_help_examples_run(command, world, tmp_path, capsys, monkeypatch):
    if command[0] == "finetune" and not (world / "hf").is_dir():
        pytest.skip("edgekit finetune needs the train extra (torch, transformers, peft)")
    examples = _examples(_help(command, capsys, monkeypatch))
    assert examples, f"edgekit {' '.join(command)} --help shows no example"
    for i, example in enumerate(examples):
        assert f"edgekit {' '.join(command)}" in example, f"{example!r} does not show `edgekit {' '.join(command)}`"
        cwd = tmp_path / f"example-{i}"
        cwd.mkdir()
        monkeypatch.chdir(_fresh(world, cwd, command))
        for argv, pipe in _steps(example):
            capsys.readouterr()
            rc = main(argv)
            out, err = capsys.readouterr()
            assert rc == 0, f"{example!r} exited {rc}: {err.strip()}"
            if pipe is not None:
                assert pipe[0] == "jq", example
                json.loads(out)
                if shutil.which("jq"):
                    subprocess.run(pipe, input=out, text=True, check=True, capture_output=True)


def test_examples_parser():
    assert _steps("edgekit a b 'c d'   # note") == [(["a", "b", "c d"], None)]
    assert _steps("edgekit a -o x && edgekit b x --json | jq '.f | length'") == [
        (["a", "-o", "x"], None),
        (["b", "x", "--json"], ["jq", ".f | length"]),
    ]
