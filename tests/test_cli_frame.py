"""The CLI frame: one-line errors with exit 2 (JSON with --json), --debug tracebacks, Ctrl-C = 130, lazy
subcommands, bundle verbs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from edgekit import __version__
from edgekit.bundle import REQUIRED_ROLES
from edgekit.cli import app as app_module

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str, env_extra: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "EDGEKIT_DEBUG"}
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "edgekit.cli.app", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd or ROOT,
        timeout=60,
    )


@pytest.fixture
def bundle_dir(placeholder_bundle) -> Path:
    return placeholder_bundle


def _corrupt(bundle: Path) -> Path:
    victim = bundle / "decoder.bin"
    data = bytearray(victim.read_bytes())
    data[3] ^= 0x20
    victim.write_bytes(bytes(data))
    return victim


def test_verify_corrupt_bundle_prints_one_line_and_exits_2(bundle_dir):
    victim = _corrupt(bundle_dir)
    r = _cli("bundle", "verify", str(bundle_dir))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ") and str(victim) in lines[0] and "checksum mismatch" in lines[0]
    assert "Traceback" not in r.stderr and r.stdout == ""


@pytest.mark.parametrize("how", ["flag", "env"])
def test_debug_shows_the_traceback(bundle_dir, how):
    _corrupt(bundle_dir)
    if how == "flag":
        r = _cli("--debug", "bundle", "verify", str(bundle_dir))
    else:
        r = _cli("bundle", "verify", str(bundle_dir), env_extra={"EDGEKIT_DEBUG": "1"})
    assert r.returncode == 2
    assert "Traceback" in r.stderr and "BundleError" in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: ")


def test_verify_ok_and_json(bundle_dir):
    r = _cli("bundle", "verify", str(bundle_dir))
    assert r.returncode == 0 and r.stdout.startswith("ok: ")
    r = _cli("bundle", "verify", "--json", str(bundle_dir))
    data = json.loads(r.stdout)
    assert data["ok"] is True and data["name"] == "tiny" and data["components"] == len(REQUIRED_ROLES)


def test_inspect_reads_a_damaged_bundle(bundle_dir):
    _corrupt(bundle_dir)
    r = _cli("bundle", "inspect", "--json", str(bundle_dir))
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["target"] == "cpu" and set(data["components"]) == set(REQUIRED_ROLES)
    r = _cli("bundle", "inspect", str(bundle_dir))
    assert r.returncode == 0 and "decoder" in r.stdout and "parity" in r.stdout


def test_version_and_help():
    r = _cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"edgekit {__version__}"
    r = _cli("--help")
    assert r.returncode == 0 and "bundle" in r.stdout


def test_usage_error_exits_2_without_traceback():
    r = _cli("no-such-command")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "no-such-command" in r.stderr


def test_in_process_main_pack_unpack(bundle_dir, tmp_path, capsys):
    ekb = tmp_path / "x.ekb"
    assert app_module.main(["bundle", "pack", str(bundle_dir), "-o", str(ekb)]) == 0
    assert ekb.is_file() and capsys.readouterr().out.strip() == str(ekb)
    out_dir = tmp_path / "unpacked"
    assert app_module.main(["bundle", "unpack", str(ekb), "--out", str(out_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"written": str(out_dir)}
    assert app_module.main(["bundle", "verify", str(out_dir)]) == 0
    (out_dir / "tokenizer_x.bin").write_text("stray files are allowed")
    (out_dir / "tokenizer.bin").unlink()
    capsys.readouterr()
    assert app_module.main(["bundle", "verify", str(out_dir)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "missing component file" in err and "tokenizer.bin" in err


def test_keyboard_interrupt_exits_130(tmp_path):
    script = tmp_path / "interrupt.py"
    script.write_text(
        textwrap.dedent("""
        import os, signal, sys, time
        from edgekit.cli.app import app, main

        # a shell that starts us in the background leaves SIGINT ignored; Ctrl-C in a terminal is not
        signal.signal(signal.SIGINT, signal.default_int_handler)

        @app.command("sleepy")
        def sleepy() -> None:
            os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C, delivered mid-command
            time.sleep(10)

        sys.exit(main(["sleepy"]))
    """)
    )
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 130 and "Traceback" not in r.stderr


def test_subcommands_load_lazily(bundle_dir, tmp_path):
    script = tmp_path / "lazy.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys
        from edgekit.cli.app import main, SUBCOMMANDS
        code = main(["bundle", "verify", {str(bundle_dir)!r}])
        others = [n for n in SUBCOMMANDS if n != "bundle" and f"edgekit.cli.{{n}}_cmd" in sys.modules]
        print(code, others)
    """)
    )
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.stdout.strip().splitlines()[-1] == "0 []", r.stdout + r.stderr


def test_a_missing_subcommand_module_fails_loudly(monkeypatch):
    """No scaffolding for modules "not written yet": a listed subcommand without its module is a packaging
    mistake and must fail, not silently vanish from `edgekit --help`."""
    assert app_module._load("bundle") is not None
    with pytest.raises(ModuleNotFoundError, match="not_written_yet"):
        app_module._load("not_written_yet")
    monkeypatch.setitem(app_module.SUBCOMMANDS, "not_written_yet", "A subcommand whose module is missing.")
    with pytest.raises(ModuleNotFoundError):
        app_module.main(["not_written_yet"])
