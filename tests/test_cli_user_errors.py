"""What a user gets wrong is one line naming the file and the reason (JSON with --json), never a traceback: an
output that cannot be written, a flag beyond the library's bounds, a machine file a target does not take. Logs
get whole table cells, and the samples script keeps to its own folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgekit.bundle import REQUIRED_ROLES, write_bundle
from edgekit.cli import errors as cli_errors
from edgekit.cli.app import main
from edgekit.generate import MAX_NEW_TOKENS, MAX_TEMPERATURE

ROOT = Path(__file__).resolve().parents[1]


def _one_line(err: str) -> str:
    assert "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    return err


# --- (5) outputs that cannot be written ---------------------------------------------------------------------------

UNDER_A_FILE = [
    ["build", "--target", "cpu", "--no-parity", "-o", "{out}"],
    ["convert", "-o", "{out}"],
    ["data", "synth", "--count", "1", "-o", "{out}"],
    ["profile", "{tmp}/no-bundle", "-s", "{tmp}/s.dcm", "-o", "{out}"],
    ["eval", "{tmp}/no-bundle", "--data", "{tmp}", "--out", "{out}"],
]


@pytest.mark.parametrize("args", UNDER_A_FILE, ids=lambda a: " ".join(a[:2]))
@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_an_output_under_a_file_is_one_line_before_any_work(tmp_path, capsys, args, as_json):
    (tmp_path / "afile").write_text("a regular file")
    out = tmp_path / "afile" / "sub"
    argv = [a.format(out=out, tmp=tmp_path) for a in args] + (["--json"] if as_json else [])
    assert main(argv) == 2
    stdout, err = capsys.readouterr()
    _one_line(err)
    assert str(out) in err and "afile" in err and "not a folder" in err
    assert "no-bundle" not in err  # refused before the bundle is even opened
    if as_json:
        error = json.loads(stdout)["error"]
        assert error["file"] == str(out) and error["code"] == "invalid_config" and "not a folder" in error["message"]


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="needs Linux /proc")
def test_an_output_the_os_refuses_is_one_line(tmp_path, capsys):
    argv = ["data", "synth", "--count", "1", "-o", "/proc/nope/x"]
    rc = main(argv)
    err = _one_line(capsys.readouterr().err)
    assert rc != 0 and "/proc/nope" in err
    assert main([*argv, "--json"]) == rc
    out, _ = capsys.readouterr()
    error = json.loads(out)["error"]
    assert error["code"] == "io_error" and error["file"].startswith("/proc/nope") and error["message"]
    assert main(["--debug", *argv]) == rc
    assert "Traceback" in capsys.readouterr().err  # --debug shows it


def test_only_oserrors_on_a_named_path_are_the_users():
    named = ["data", "synth", "-o", "/data/out/x", "--eval=/splits/test"]
    assert cli_errors._user_path(OSError(2, "No such file", "/data/out"), named) == "/data/out"
    assert cli_errors._user_path(OSError(2, "No such file", "/data/out/x/a.dcm"), named) == "/data/out/x/a.dcm"
    assert cli_errors._user_path(OSError(2, "No such file", "/splits/test/studies.jsonl"), named)
    # a package file or the root is not something the user named: that is a bug and keeps its traceback
    assert cli_errors._user_path(OSError(2, "No such file", "/usr/lib/edgekit/weights.bin"), named) is None
    assert cli_errors._user_path(OSError(13, "Permission denied", "/"), named) is None
    assert cli_errors._user_path(OSError("no file at all"), named) is None


# --- (11) bounds and ignored inputs --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        ["--max-new-tokens", str(MAX_NEW_TOKENS + 1)],
        ["--max-new-tokens", "100000"],
        ["--temperature", str(MAX_TEMPERATURE * 10)],
        ["--temperature", "nan"],
    ],
)
def test_sampling_flags_take_the_librarys_bounds(tmp_path, capsys, bad):
    assert main(["run", str(tmp_path / "no-bundle"), "-s", str(tmp_path / "s.dcm"), *bad]) == 2
    err = capsys.readouterr().err
    assert bad[0] in err and "no-bundle" not in err and "Traceback" not in err, err


def test_sampling_flags_accept_the_bounds_themselves(tmp_path, capsys):
    args = ["--max-new-tokens", str(MAX_NEW_TOKENS), "--temperature", str(MAX_TEMPERATURE)]
    assert main(["run", str(tmp_path / "no-bundle"), "-s", str(tmp_path / "s.dcm"), *args]) == 2
    assert "no-bundle" in capsys.readouterr().err  # past the flags: it fails on the bundle


@pytest.mark.parametrize("limit", ["-1", "0"])
def test_eval_refuses_a_limit_below_one(tmp_path, capsys, limit):
    assert main(["eval", str(tmp_path / "no-bundle"), "--data", str(tmp_path), "--limit", limit]) == 2
    err = capsys.readouterr().err
    assert "--limit" in err and "no-bundle" not in err


def test_build_for_cpu_refuses_a_machine_file_in_one_line(tmp_path, capsys):
    machine = tmp_path / "bad.toml"
    machine.write_text("not = [a machine")
    out = tmp_path / "o"
    assert main(["build", "--target", "cpu", "--machine", str(machine), "--no-parity", "-o", str(out)]) == 2
    err = _one_line(capsys.readouterr().err)
    assert str(machine) in err and "takes no machine description" in err
    assert not out.exists()


def test_tables_in_a_log_are_not_wrapped_at_80_columns(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    comps = {}
    for role in REQUIRED_ROLES:
        (src / f"{role}.bin").write_bytes(role.encode() * 50)
        comps[role] = src / f"{role}.bin"
    source = "measured on a long, descriptive sentence that says where this figure came from, " * 2
    bundle = write_bundle(
        tmp_path / "b", comps, name="tiny", target="cpu", provenance={}, figures={"parity": {"source": source}}
    )
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "EDGEKIT_DEBUG")}
    r = subprocess.run(
        [sys.executable, "-m", "edgekit.cli.app", "bundle", "inspect", str(bundle)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert source.strip() in r.stdout, r.stdout  # whole, on one line


def test_profile_help_names_the_plot_each_target_writes(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")
    assert main(["profile", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "ops.png" in text and "layer_types.png" in text


# --- (11) the samples script ------------------------------------------------------------------------------------


def _sample_files() -> dict[str, tuple[int, int]]:
    from edgekit.models.synth.samples import SAMPLES_DIR

    return {str(p): (p.stat().st_mtime_ns, p.stat().st_size) for p in SAMPLES_DIR.rglob("*") if p.is_file()}


def test_samples_script_help_writes_nothing():
    before = _sample_files()
    r = subprocess.run(
        [sys.executable, "-m", "edgekit.models.synth.samples", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert r.returncode == 0 and "--out" in r.stdout, r.stdout + r.stderr
    assert _sample_files() == before


def test_samples_script_refuses_an_installed_package_without_out(tmp_path, monkeypatch, capsys):
    from edgekit.models.synth import samples

    installed = tmp_path / "lib" / "site-packages" / "edgekit" / "models" / "samples"
    installed.mkdir(parents=True)
    monkeypatch.setattr(samples, "SAMPLES_DIR", installed)
    with pytest.raises(SystemExit) as exc:
        samples.main([])
    assert exc.value.code == 2 and "--out" in capsys.readouterr().err
    assert not any(installed.iterdir())
    assert samples.main(["--out", str(tmp_path / "mine")]) == 0
    assert (tmp_path / "mine" / "cr_chest.json").is_file() and not any(installed.iterdir())
