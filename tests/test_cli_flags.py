"""The shared flags (edgekit/cli/options.py) mean the same thing in every subcommand; `--out` refuses an existing
output without `--force`; errors with `--json` are JSON; library parameters are shown as flags."""

from __future__ import annotations

import json

import pytest
import typer

from edgekit.cli.app import app, main
from edgekit.cli.errors import cli_message

# parameter name -> the flags it must have wherever it appears
SHARED = {
    "study": ["--study", "-s"],
    "prompt": ["--prompt", "-p"],
    "out": ["--out", "-o"],
    "force": ["--force"],
    "threads": ["--threads"],
    "as_json": ["--json"],
    "machine": ["--machine"],
    "max_new_tokens": ["--max-new-tokens"],
    "temperature": ["--temperature"],
    "top_p": ["--top-p"],
    "seed": ["--seed"],
    "image_size": ["--image-size"],
}


def _leaf_commands() -> dict[str, object]:
    root = typer.main.get_command(app)
    found: dict[str, object] = {}

    def walk(cmd, path: tuple[str, ...]) -> None:
        if hasattr(cmd, "list_commands"):
            ctx = cmd.make_context("edgekit", [], resilient_parsing=True)
            for name in cmd.list_commands(ctx):
                walk(cmd.get_command(ctx, name), (*path, name))
        else:
            found[" ".join(path)] = cmd

    walk(root, ())
    return found


LEAVES = _leaf_commands()


def test_shared_flags_are_spelled_the_same_everywhere():
    short_means: dict[str, set[str]] = {}
    for path, cmd in LEAVES.items():
        params = {p.name: p for p in cmd.params}
        for name, opts in SHARED.items():
            if name in params:
                assert sorted(params[name].opts) == sorted(opts), (path, name, params[name].opts)
        for p in cmd.params:
            if getattr(p, "hidden", False):
                continue
            longs = [o for o in p.opts if o.startswith("--")]
            for short in (o for o in p.opts if len(o) == 2 and o.startswith("-")):
                short_means.setdefault(short, set()).update(longs)
        if "out" in params:
            assert "force" in params, f"edgekit {path} writes --out but takes no --force"
        assert "as_json" in params, f"edgekit {path} has no --json"
    for short, longs in short_means.items():
        assert len(longs) == 1, f"{short} means {sorted(longs)}"
    assert short_means["-s"] == {"--study"} and short_means["-o"] == {"--out"}


def test_image_size_is_one_shared_flag_on_build_and_convert():
    """--image-size (Qwen2-VL's pinned side) is options.py's one option wherever it appears, and the library's
    `image_size` in an error reads as the flag."""
    from edgekit.cli.options import ImageSizeOption

    takers = {path for path, cmd in LEAVES.items() if "image_size" in {p.name for p in cmd.params}}
    assert takers == {"build", "convert"}
    shared = ImageSizeOption.__metadata__[0]
    for path in takers:
        (param,) = [p for p in LEAVES[path].params if p.name == "image_size"]
        assert param.help == shared.help and param.metavar == "S"
    assert cli_message("`image_size` 60 is not a multiple of 28") == "--image-size 60 is not a multiple of 28"


def test_every_command_that_writes_takes_out_and_force():
    writers = {
        "build",
        "convert",
        "optimize",
        "eval",
        "profile",
        "bundle pack",
        "bundle unpack",
        "x1 compile",
        "data synth",
    }
    for path in writers:
        names = {p.name for p in LEAVES[path].params}
        assert {"out", "force"} <= names, path


@pytest.fixture
def bundle_dir(placeholder_bundle):
    return placeholder_bundle


@pytest.mark.parametrize("force_first", [False, True])
def test_out_refuses_an_existing_output_unless_force(bundle_dir, tmp_path, capsys, force_first):
    ekb = tmp_path / "x.ekb"
    ekb.write_bytes(b"an earlier file")
    assert main(["bundle", "pack", str(bundle_dir), "-o", str(ekb)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(ekb) in err and "--force" in err
    assert ekb.read_bytes() == b"an earlier file"
    args = ["--force", "-o", str(ekb)] if force_first else ["-o", str(ekb), "--force"]
    assert main(["bundle", "pack", str(bundle_dir), *args]) == 0
    assert ekb.read_bytes() != b"an earlier file"


def test_a_default_output_is_checked_too(bundle_dir, capsys):
    assert main(["bundle", "pack", str(bundle_dir)]) == 0
    capsys.readouterr()
    assert main(["bundle", "pack", str(bundle_dir)]) == 2
    assert "b.ekb" in capsys.readouterr().err
    assert main(["bundle", "pack", str(bundle_dir), "--force"]) == 0


def test_an_empty_folder_is_not_an_existing_output(bundle_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    ekb = tmp_path / "b.ekb"
    assert main(["bundle", "pack", str(bundle_dir), "-o", str(ekb)]) == 0
    assert main(["bundle", "unpack", str(ekb), "-o", str(tmp_path / "empty")]) == 0


def test_errors_with_json_are_json(tmp_path, capsys):
    missing = tmp_path / "nope"
    assert main(["bundle", "verify", str(missing), "--json"]) == 2
    out, err = capsys.readouterr()
    error = json.loads(out)["error"]
    assert error["code"] == "invalid_bundle" and error["file"] == str(missing) and error["message"]
    assert err.count("\n") == 1 and err.startswith("error: ") and str(missing) in err
    # a usage error (here: --top-p out of range) too
    assert main(["run", str(tmp_path), "--top-p", "0", "--json"]) == 2
    out, _ = capsys.readouterr()
    error = json.loads(out)["error"]
    assert error["code"] == "usage_error" and "--top-p" in error["message"]


def test_sampling_flags_are_checked_before_anything_loads(tmp_path, capsys):
    study = tmp_path / "s.dcm"
    for bad in (["--top-p", "0"], ["--top-p", "1.5"], ["--temperature", "-1"], ["--max-new-tokens", "0"]):
        assert main(["run", str(tmp_path / "no-bundle"), "-s", str(study), *bad]) == 2
        err = capsys.readouterr().err
        assert bad[0] in err and "no-bundle" not in err, err


def test_x1_estimate_takes_the_model_positionally_and_no_longer_has_s(capsys):
    assert main(["x1", "estimate", "qwen2-7b", "--head-sparsity", "0.38", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["name"] == "qwen2-7b"
    assert main(["x1", "estimate", "qwen2-7b", "-s", "0.38"]) == 2
    assert "-s" in capsys.readouterr().err
    assert main(["x1", "estimate", "--model", "qwen2-7b"]) == 2  # one spelling: the model is positional
    assert "--model" in capsys.readouterr().err


def test_data_synth_takes_out(tmp_path, capsys):
    out = tmp_path / "d"
    assert main(["data", "synth", "-o", str(out), "--split", "sample", "--count", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["studies"] == 2
    assert main(["data", "synth", "-o", str(out), "--split", "sample", "--count", "2"]) == 2
    assert str(out) in capsys.readouterr().err
    assert main(["data", "synth", "-o", str(out), "--split", "sample", "--count", "3", "--force", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["studies"] == 3
    assert main(["data", "synth", "--count", "1"]) == 2 and "--out" in capsys.readouterr().err
    assert main(["data", "synth", "-o", str(tmp_path / "e"), "--split", "holdout", "--json"]) == 2
    assert "holdout" in json.loads(capsys.readouterr().out)["error"]["message"]


def test_library_parameters_are_shown_as_flags():
    assert (
        cli_message("out: already exists (pass `overwrite=True` to replace it)")
        == "out: already exists (pass --force to replace it)"
    )
    assert cli_message("give `passes` or `recipe`") == "give --pass or --recipe"
    assert (
        cli_message("output already exists (overwrite=True replaces it)")
        == "output already exists (--force replaces it)"
    )
    assert (
        cli_message("`unknown` stays, and so do overwrites=True and strict=False")
        == "`unknown` stays, and so do overwrites=True and strict=False"
    )
