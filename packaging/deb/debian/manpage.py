"""A man page from a command's --help, by help2man, with every subcommand's --help in a COMMANDS section.

help2man alone sees only the top-level --help; edgekit's useful text (each subcommand's options and examples) is
one level down or two, so this walks the "Commands:" lists and appends each --help verbatim. Run at package build
time with TYPER_USE_RICH=0 (plain click help, no boxes). Stdlib only.

    python3 manpage.py --version-of edgekit -o edgekit.1 -- /path/to/venv/bin/python -m edgekit.cli.app
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path


def help_text(cmd: list[str]) -> str:
    env = {**os.environ, "TYPER_USE_RICH": "0", "COLUMNS": "80", "NO_COLOR": "1"}
    out = subprocess.run([*cmd, "--help"], capture_output=True, text=True, env=env, check=True)
    return out.stdout


def subcommands(text: str) -> list[str]:
    """The names listed under click's "Commands:" heading (two-space indent, name first; a blank line ends it)."""
    names, inside = [], False
    for line in text.splitlines():
        if line.strip() == "Commands:":
            inside = True
        elif inside and not line.strip():
            break
        elif inside and line.startswith("  ") and not line.startswith("   "):
            names.append(line.split()[0])
    return names


def description(text: str) -> str:
    """The first line of text after the usage block (argparse's and click's help both put the description there)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if not line.strip()), len(lines))
    return next((line.strip() for line in lines[start:] if line.strip()), "")


def roff_verbatim(text: str) -> str:
    lines = []
    for line in text.rstrip().splitlines():
        line = line.replace("\\", "\\e")
        if line.startswith((".", "'")):
            line = "\\&" + line
        lines.append(line)
    return ".nf\n" + "\n".join(lines) + "\n.fi\n"


def commands_section(cmd: list[str], prog: str) -> str:
    out = []

    def walk(path: list[str]) -> None:
        for name in subcommands(help_text(cmd + path)):
            sub = path + [name]
            text = help_text(cmd + sub)
            out.append(f'.SS "{prog} {" ".join(sub)}"\n' + roff_verbatim(text))
            walk(sub)

    walk([])
    return "[COMMANDS]\n" + "".join(out) if out else ""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-o", "--output", required=True, type=Path, help="the .1 file to write")
    p.add_argument("--version-of", required=True, help="distribution whose version the page carries")
    p.add_argument("cmd", nargs="+", help="the command, after --")
    args = p.parse_args()
    prog = args.output.stem
    version = importlib.metadata.version(args.version_of)
    with tempfile.TemporaryDirectory() as tmp:
        wrapper = Path(tmp) / prog  # help2man names the page after the program it runs
        wrapper.write_text(f'#!/bin/sh\nexec {shlex.join(args.cmd)} "$@"\n')
        wrapper.chmod(0o755)
        include = Path(tmp) / "include.h2m"
        include.write_text(
            commands_section(args.cmd, prog)
            + "[SEE ALSO]\n"
            + ("edgekitd(1)" if prog == "edgekit" else "edgekit(1), systemd.socket(5)")
            + ", /usr/share/doc/edgekit/README.md.gz\n"
        )
        env = {**os.environ, "TYPER_USE_RICH": "0", "COLUMNS": "80", "NO_COLOR": "1"}
        subprocess.run(
            [
                "help2man",
                "--no-info",
                "--no-discard-stderr",
                "--section=1",
                f"--version-string={version}",
                f"--name={description(help_text(args.cmd)).rstrip('.')}",
                f"--include={include}",
                f"--output={args.output}",
                str(wrapper),
            ],
            check=True,
            env=env,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
