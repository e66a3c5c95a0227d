"""Targets are plug-ins: a target the core has never heard of builds and serves through the same paths.

`toy` is registered at run time (as an out-of-tree package would be) with a build side that ships the exported
graphs plus a file of its own and a runtime section, and a run side that wraps ONNX Runtime and reports a cost.
Nothing in edgekit's core is edited or stubbed: `edgekit.build.build` and `Reporter` run as users run them.
"""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path

import pytest

from edgekit import names
from edgekit.build import build
from edgekit.errors import ConfigError
from edgekit.ort import CpuBackend
from edgekit.plugins import TARGETS, get_target, load_backend, register_target
from edgekit.reporter import Reporter
from edgekit.target import RuntimeOptions, TargetBuild, runtime_settings

SAMPLE = Path(str(files("edgekit.models") / "samples" / "cr_chest"))


class CountingBackend(CpuBackend):
    """ORT underneath; counts decoder calls per report as the toy target's 'cost'. A cost read per call can be
    billed to one report only if reports run one at a time: so it does not batch rows (`batch_rows`)."""

    batch_rows = False

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls = 0

    def decode(self, *a, **kw):
        self.calls += 1
        return super().decode(*a, **kw)

    def take_cost(self) -> dict:
        calls, self.calls = self.calls, 0
        return {"decoder_calls": calls, "source": "toy target: decoder calls counted by its backend"}


class ToyTarget:
    name = "toy"
    takes_machine = False

    def check_recipe(self, recipe_passes):
        if "fp16" in recipe_passes:
            raise ConfigError("target 'toy' cannot run FP16 graphs")

    def prepare(self, inputs):
        note = inputs.work / "toy.json"
        note.write_text(json.dumps({"recipe": inputs.recipe}))
        return TargetBuild(
            graphs=inputs.graphs,
            components={"toy_note": note},
            figures={"toy": {"value": 1, "source": "toy target"}},
            steps=[{"name": "toy", "params": {}}],
            runtime={"greeting": "hello"},
        )

    def load_backend(self, bundle, options):
        settings = runtime_settings({"greeting": "hi"}, bundle.manifest.runtime, options.settings, bundle.source)
        backend = CountingBackend(
            bundle.component(names.VISION),
            bundle.component(names.EMBED),
            bundle.component(names.DECODER_ROLE),
            intra_op_threads=1,
        )
        backend.greeting = settings["greeting"]
        return backend


@pytest.fixture
def toy_registered():
    register_target("toy", ToyTarget())
    yield
    TARGETS.pop("toy", None)


def test_a_registered_target_builds_and_reports_with_no_core_edit(toy_registered, tmp_path):
    result = build("toy", tmp_path / "toy", parity=False)
    manifest = json.loads((result.bundle / "manifest.json").read_text())
    assert manifest["target"] == "toy" and manifest["runtime"] == {"greeting": "hello"}
    assert "toy_note" in manifest["components"] and manifest["figures"]["toy"]["source"] == "toy target"
    assert [s["name"] for s in manifest["provenance"]["passes"]] == ["export", "toy"]
    reporter = Reporter.from_bundle(result.bundle, threads=1)
    assert reporter.backend.greeting == "hello"  # the run side read the bundle's runtime section
    report = reporter.report(SAMPLE, "Cough.")
    assert report.target == "toy" and report.text
    assert report.cost["decoder_calls"] == report.timings["new_tokens"] + (report.stop_reason == "stop_token")
    again = reporter.report(SAMPLE, "Cough.")
    assert again.cost == report.cost  # cost is per report: nothing carried over


def test_request_settings_override_the_bundle_and_unknown_ones_are_named(toy_registered, tmp_path):
    from edgekit.bundle import load_bundle

    b = load_bundle(build("toy", tmp_path / "toy", parity=False).bundle)
    assert load_backend(b, RuntimeOptions(settings={"greeting": "hey"})).greeting == "hey"
    with pytest.raises(ConfigError, match="unknown runtime setting.*gretting"):
        load_backend(b, RuntimeOptions(settings={"gretting": "hey"}))


def test_a_target_refuses_a_recipe_up_front_and_a_machine_it_does_not_take(toy_registered, tmp_path):
    with pytest.raises(ConfigError, match="cannot run FP16"):
        build("toy", tmp_path / "a", parity=False, recipe="fp16")
    assert not (tmp_path / "a").exists()
    with pytest.raises(ConfigError, match="takes no machine"):
        build("toy", tmp_path / "b", parity=False, machine=tmp_path / "m.toml")


def test_unknown_targets_are_named_with_the_known_ones():
    with pytest.raises(ConfigError, match=r"unknown target 'nope' \(known: cpu, orin, x1\)"):
        get_target("nope")
    with pytest.raises(ConfigError, match="not buildable here.*cpu, orin, x1"):
        build("nope", Path("/nonexistent/out"))
