"""`edgekit pareto` on a cpu and an x1 bundle of the embedded default model, with no knob flags: one front per
device (the X1's emulated figures beside this machine's wall clock and meter are never ranked together), each
bundle measured along the default grid, a plot panel per front; and edgekitd's policy, reading that profile,
serves the variants of one device and refuses variants on two."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from edgekit.cli.app import main
from edgekit.errors import ConfigError
from edgekit.pareto import non_dominated, read_profile
from edgekit.pareto.configs import default_grid

LIMIT = "1"  # one study per point: the grid's shape is under test here, not its figures


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    from edgekit.build import build

    root = tmp_path_factory.mktemp("pareto-fronts")
    cpu, x1 = root / "radreport-tiny-cpu", root / "radreport-tiny-x1"
    build("cpu", cpu, parity=False)
    build("x1", x1, parity=False, recipe="int4")  # RTN INT4: the default AWQ + GPTQ calibration takes a minute
    return {"cpu": cpu, "x1": x1}


@pytest.fixture(scope="module")
def profiled(bundles, tmp_path_factory):
    from edgekit.models.synth import write_split

    split = write_split(tmp_path_factory.mktemp("pareto-fronts-split") / "test", "test", 2).parent
    out = tmp_path_factory.mktemp("pareto-fronts-out") / "profile"
    args = ["pareto", str(bundles["cpu"]), str(bundles["x1"]), "-o", str(out), "--data", str(split)]
    args += ["--limit", LIMIT]
    assert main([*args, "--json"]) == 0  # measures every point; the tests' own runs resume from it
    return out, args


def test_cpu_and_x1_bundles_get_a_front_each_along_the_default_grid(profiled, capsys):
    out, args = profiled
    capsys.readouterr()
    assert main([*args, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    profile = read_profile(out / "pareto.json")

    fronts = profile.fronts
    assert [f.targets for f in fronts] == [("cpu",), ("x1",)]
    cpu, x1 = fronts
    assert (x1.energy_source, x1.latency_source, x1.device) == ("emulated:x1", "emulated:x1", "x1 (emulated)")
    assert cpu.latency_source == "measured:wall-clock" and cpu.energy_source.startswith(("measured:", "estimated:"))
    assert cpu.device == "this machine"
    for front in fronts:  # one energy source per front, and no point of one front on the other
        assert len({p.energy_source for p in front.points}) == 1
        assert len({p.latency_source for p in front.points}) == 1
        assert {p.id for p in front.front} <= {p.id for p in front.points}
    assert not {p.id for p in cpu.points} & {p.id for p in x1.points}
    assert not {p.id for p in cpu.front} & {p.id for p in x1.points}
    assert not {p.id for p in x1.front} & {p.id for p in cpu.points}

    # what pareto.json and --json say: the fronts apart, each labelled with its device, targets and sources
    assert [f["targets"] for f in shown["fronts"]] == [["cpu"], ["x1"]]
    assert shown["fronts"][1]["energy_source"] == "emulated:x1" and "x1 (emulated)" in shown["fronts"][1]["label"]
    assert shown["fronts"] == [f.to_dict() for f in fronts]
    with pytest.raises(ConfigError, match="not compared on one front"):
        non_dominated(profile.points)  # figures from both devices: refused, not ranked

    # no knob flags: each bundle at its own settings, then each default-grid value alone
    assert shown["grid"]["kind"] == "default"
    for target, front in (("cpu", cpu), ("x1", x1)):
        grid = default_grid(target)
        want = [{}] + [{knob: v} for knob, values in grid.items() for v in values]
        got = [{k: v for k, v in p.settings.items() if k != "variant"} for p in front.points]
        assert got == want and len(front.points) > 1
        assert all(p.count == int(LIMIT) for p in front.points)
    assert "threads" in default_grid("cpu") and "sparsity_target" in default_grid("x1")
    assert "sparsity_target" not in default_grid("cpu") and "threads" not in default_grid("x1")

    files = shown["files"]
    assert files[1].endswith("pareto.png") and (out / "pareto.png").stat().st_size > 10_000
    assert (out / "pareto.svg").read_text().startswith("<?xml")


def test_the_table_shows_each_front_apart_with_its_device_and_sources(profiled, capsys, monkeypatch):
    from edgekit.cli import output

    _, args = profiled
    monkeypatch.setattr(output.console, "width", 250)  # the console's width is fixed when it is made
    capsys.readouterr()
    assert main(args) == 0  # resumed: every point is in pareto.json already
    text = capsys.readouterr().out
    assert "front 1 of 2: this machine, target cpu: energy " in text
    assert "front 2 of 2: x1 (emulated), target x1: energy emulated:x1, latency emulated:x1" in text
    assert "grid: the default, one knob at a time" in text and "sparsity_target 0.0 (x1)" in text


def test_no_default_grid_is_one_point_per_bundle_and_knob_flags_replace_the_grid(bundles):
    from edgekit.bundle import load_bundle
    from edgekit.pareto.configs import plan

    loaded = [load_bundle(bundles["cpu"]), load_bundle(bundles["x1"])]
    knobs = {"max_new_tokens": None, "video_max_frames": None, "sparsity_target": None, "threads": None}
    configs, grid = plan(loaded, knobs, use_default=False)
    assert [c.settings for c in configs] == [{}, {}] and grid["kind"] == "none"
    configs, grid = plan(loaded, {**knobs, "max_new_tokens": [8, 16]})
    assert [c.settings for c in configs] == [{"max_new_tokens": 8}, {"max_new_tokens": 16}] * 2
    assert grid["kind"] == "flags"


def test_the_daemon_serves_one_device_of_a_profile_with_two_fronts_and_refuses_variants_on_both(bundles, profiled):
    pytest.importorskip("prometheus_client")
    from edgekit.daemon.policy_loop import match_profile

    out, _ = profiled
    cfg = SimpleNamespace(policy_profile=out / "pareto.json", max_batch=8)

    def registry(*names):
        return SimpleNamespace(specs={n: SimpleNamespace(bundle=bundles[n], settings={}) for n in names})

    # load-time knobs (threads, the DSS target) belong to variants configured with them: the others are served
    points = match_profile(cfg, registry("x1"))
    assert points and {p.energy_source for p in points} == {"emulated:x1"}
    assert {p.settings["variant"] for p in points} == {"x1"}
    assert {p.target for p in match_profile(cfg, registry("cpu"))} == {"cpu"}
    with pytest.raises(ConfigError, match="points lie on 2 fronts") as err:
        match_profile(cfg, registry("cpu", "x1"))
    assert "emulated:x1" in str(err.value) and "never compared" in str(err.value)
