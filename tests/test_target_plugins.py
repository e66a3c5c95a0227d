"""Targets are plug-ins: a target the core has never heard of builds and serves through the same paths.

`toy` is registered at run time (as an out-of-tree package would be) with a build side that ships the exported
graphs plus a file of its own and a runtime section, and a run side that wraps ONNX Runtime and reports a cost.
It has a weight format of its own (`toy-int4`, registered from here as its package would on import: the INT4
codes as INT8 scaled by Cast/Mul/Reshape, which any opset runs), which the int4 pass writes for it with no edit
to the pass, and a pareto knob of its own. Nothing in edgekit's core is edited or stubbed: `edgekit.build.build`
and `Reporter` run as users run them.
"""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

from edgekit import names
from edgekit.build import build
from edgekit.errors import ConfigError
from edgekit.ort import CpuBackend
from edgekit.passes.patterns import add_initializer
from edgekit.passes.weight_formats import FORMATS, MATMUL, WeightFormat, register_weight_format
from edgekit.plugins import TARGETS, get_target, load_backend, register_target
from edgekit.reporter import Reporter
from edgekit.target import ParetoKnob, RuntimeOptions, TargetBuild, runtime_settings

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


def encode_toy_int4(model: ir.Model, matmul: ir.Node, qw, name: str, opts: dict) -> tuple[int, int]:
    """The MatMul's B as Reshape(Cast(INT8 codes (K/B, B, N)) * scales (K/B, 1, N)) to (K, N)."""
    codes = (qw.q.astype(np.int16) - 2 ** (qw.bits - 1)).T.astype(np.int8)  # (K, N), signed
    k, n = codes.shape
    blocks = k // qw.block
    graph, take = model.graph, opts["node_names"].take
    stored = add_initializer(graph, codes.reshape(blocks, qw.block, n), f"{name}.toy_codes")
    scales = add_initializer(graph, qw.scales.T.reshape(blocks, 1, n).astype(np.float32), f"{name}.toy_scales")
    shape = add_initializer(graph, np.array([k, n], np.int64), f"{name}.toy_shape")
    cast = ir.node("Cast", [stored], {"to": int(ir.DataType.FLOAT)}, name=take(f"{name}_ToyCast"))
    mul = ir.node("Mul", [cast.outputs[0], scales], name=take(f"{name}_ToyScale"))
    reshape = ir.node("Reshape", [mul.outputs[0], shape], name=take(f"{name}_ToyWeight"))
    for node, suffix in ((cast, "toy_float"), (mul, "toy_scaled"), (reshape, "toy_weight")):
        node.outputs[0].name, node.outputs[0].dtype = f"{name}.{suffix}", ir.DataType.FLOAT
        graph.insert_before(matmul, node)
    matmul.replace_input_with(1, reshape.outputs[0])
    return 3, 0


TOY_INT4 = WeightFormat(
    name="toy-int4",
    label="ToyInt{bits}",
    summary="the toy target's own: INT4 codes stored as INT8, scaled by Cast/Mul/Reshape",
    uses=(MATMUL,),
    bits=(4,),
    encode_matmul=encode_toy_int4,
)


class ToyTarget:
    name = "toy"
    takes_machine = False
    weight_formats = ("toy-int4",)
    pareto_knobs = {"greeting": ParetoKnob(setting="greeting", grid=("hey",))}

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
    register_weight_format(TOY_INT4)  # what the toy package does on import
    register_target("toy", ToyTarget())
    yield
    TARGETS.pop("toy", None)
    FORMATS.pop("toy-int4", None)


def _recipe(tmp_path: Path, *passes: str) -> Path:
    """A recipe file of `passes`, each a TOML [[pass]] body."""
    path = tmp_path / "toy-recipe.toml"
    path.write_text('name = "toy-int4"\n' + "".join(f"[[pass]]\n{body}\n" for body in passes))
    return path


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


def test_a_targets_own_weight_format_is_what_the_int4_pass_writes_for_it(toy_registered, tmp_path):
    """The recipe names no format: the build fills in the toy's, the pass writes it through the format's encoder,
    and the bundle serves."""
    recipe = _recipe(tmp_path, 'name = "int4"\nmethod = "rtn"\nblock = 32')
    result = build("toy", tmp_path / "toy", parity=False, recipe=recipe)
    (decoder,) = [r for r in result.steps[1]["passes"] if r["graph"] == names.GRAPH_FILES[names.DECODER_ROLE]]
    assert decoder["config"]["format"] == "toy-int4" and decoder["notes"]["encoding"] == "ToyInt4"
    graph = ir.load(result.bundle / names.GRAPH_FILES[names.DECODER_ROLE])
    ops = {n.op_type for n in graph.graph}
    assert "Cast" in ops and not ops & {"MatMulNBits", "DequantizeLinear"}
    assert any(n.name.endswith("_ToyWeight") for n in graph.graph)
    report = Reporter.from_bundle(result.bundle, threads=1).report(SAMPLE, "Cough.")
    assert report.target == "toy" and report.text


def test_a_format_the_target_does_not_take_is_refused_in_one_line(toy_registered, tmp_path):
    named = _recipe(tmp_path, 'name = "int4"\nformat = "matmulnbits"')
    with pytest.raises(
        ConfigError, match=r"pass\[0\] int4\.format: target toy does not take matmulnbits \(it takes toy-int4\)"
    ):
        build("toy", tmp_path / "a", parity=False, recipe=named)
    assert not (tmp_path / "a").exists()
    table = _recipe(tmp_path, 'name = "qembed"')  # the toy's format stores no embedding table
    with pytest.raises(ConfigError, match=r"qembed\.format: toy-int4 stores matmul.*target toy takes toy-int4 only"):
        build("toy", tmp_path / "b", parity=False, recipe=table)


def test_a_targets_pareto_knobs_come_from_its_plug_in(toy_registered):
    from edgekit.pareto.configs import DEFAULT_GRID, default_grid, knobs_of
    from edgekit.pareto.measure import runtime_settings as knob_settings

    assert knobs_of("toy")[-1] == "greeting" and default_grid("toy")["greeting"] == ("hey",)
    assert DEFAULT_GRID["greeting"] == (("hey",), ("toy",))
    assert knob_settings({"greeting": "hey", "max_new_tokens": 8}, "toy") == {"greeting": "hey"}
    assert knob_settings({"greeting": "hey"}, "cpu") == {}  # not a cpu knob


def test_a_targets_own_knob_reaches_the_pareto_cli_flag(toy_registered):
    """`edgekit pareto --knob greeting=yo`: the toy's knob, which no named flag knows, typed like its grid (str) and
    planned as a configuration of its bundles; a knob no bundle's target has is named with the ones they have."""
    from edgekit.pareto.configs import plan
    from edgekit.pareto.knob_flags import merge_knobs, parse_knob_flags

    extra = parse_knob_flags(["greeting=yo", "greeting=hi", "max_new_tokens=8"], ["toy"])
    assert extra == {"greeting": ["yo", "hi"], "max_new_tokens": [8]}
    knobs = merge_knobs({"max_new_tokens": [16], "threads": None}, extra)
    assert knobs == {"max_new_tokens": [16, 8], "threads": None, "greeting": ["yo", "hi"]}

    class _Bundle:  # what plan reads of a loaded bundle
        source, target, digest = "/b/toy-bundle", "toy", "0" * 64

    configs, grid = plan([_Bundle()], knobs)
    assert sorted(c.id for c in configs) == [
        "toy-bundle[greeting=hi,max_new_tokens=16]",
        "toy-bundle[greeting=hi,max_new_tokens=8]",
        "toy-bundle[greeting=yo,max_new_tokens=16]",
        "toy-bundle[greeting=yo,max_new_tokens=8]",
    ]
    assert grid["kind"] == "flags"
    with pytest.raises(ConfigError, match=r"--knob sparsity_target: not a knob of these bundles. targets"):
        parse_knob_flags(["sparsity_target=0.5"], ["toy"])
    with pytest.raises(ConfigError, match=r"--knob 'greeting': expected NAME=VALUE"):
        parse_knob_flags(["greeting"], ["toy"])
    with pytest.raises(ConfigError, match=r"--knob max_new_tokens=0: max_new_tokens takes a whole number >= 1"):
        parse_knob_flags(["max_new_tokens=0"], ["toy"])
