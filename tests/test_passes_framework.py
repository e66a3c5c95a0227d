"""The pass framework: typed configs, registry, recipes, the pipeline's atomic output and the CLI."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import onnx_ir as ir
import pytest

from edgekit.cli.app import main
from edgekit.errors import ConfigError
from edgekit.export import export_model, random_weights
from edgekit.export.model_config import ModelConfig
from edgekit.names import DECODER
from edgekit.passes import (
    GraphPass,
    PassChanges,
    PassConfig,
    PassContext,
    PassFailedError,
    PassPreconditionError,
    load_recipe,
    make_pass,
    param,
    run_pipeline,
)
from edgekit.passes.int4 import Int4Config
from edgekit.plugins import get_model_family

SMALL = ModelConfig(
    vocab_size=256,
    hidden=64,
    layers=2,
    heads=4,
    kv_heads=2,
    intermediate=128,
    vision_hidden=32,
    vision_layers=1,
    vision_heads=2,
    vision_mlp=64,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("model")
    export_model(random_weights(SMALL, 0), SMALL, d, check=False)
    (d / "config.json").write_text("{}")
    return d


def test_config_parses_types_and_lists():
    cfg = Int4Config.from_string("block=64,symmetric=false,keep=lm_head;model.layers.0.*,mixed=2")
    assert (cfg.block, cfg.symmetric, cfg.keep, cfg.mixed) == (64, False, ["lm_head", "model.layers.0.*"], 2)
    assert Int4Config.from_mapping({"block": 128, "method": "awq"}).method == "awq"


@pytest.mark.parametrize(
    "text, field",
    [
        ("block=48", "int4.block"),
        ("block=abc", "int4.block"),
        ("mixed=-1", "int4.mixed"),
        ("symmetric=maybe", "int4.symmetric"),
        ("colour=red", "colour"),
        ("format=qdq-blocked,symmetric=false", "int4.symmetric"),
        ("format=qdq-blocked,float_zeros=true", "int4.float_zeros"),
        ("format=nope", "int4.format"),
        ("block", "key=value"),
    ],
)
def test_config_errors_name_the_field(text, field):
    with pytest.raises(ConfigError) as err:
        Int4Config.from_string(text, where="int4")
    assert field in str(err.value)


def test_unknown_pass_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown pass 'int9'"):
        make_pass("int9:block=32")


def test_recipes_in_repo_parse_where_their_passes_exist():
    family = get_model_family()
    for path in map(family.recipe_path, family.recipe_names()):
        try:
            recipe = load_recipe(path)
        except ConfigError as err:  # heads / sparse24 may not be written yet
            assert "unknown pass" in str(err), str(err)
            continue
        assert recipe.passes


def test_recipe_errors_name_the_file_and_pass(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[[pass]]\nname = "int4"\nblock = 7\n')
    with pytest.raises(ConfigError) as err:
        load_recipe(bad)
    assert "bad.toml" in str(err.value) and "pass[0] int4.block" in str(err.value)


def test_precondition_when_no_weight_matmul():
    x = ir.val("x", ir.DataType.FLOAT, [2, 4])
    node = ir.node("Relu", [x])
    node.outputs[0].name, node.outputs[0].dtype, node.outputs[0].shape = "y", ir.DataType.FLOAT, ir.Shape([2, 4])
    model = ir.Model(ir.Graph([x], node.outputs, nodes=[node], opset_imports={"": 21}), ir_version=10)
    with pytest.raises(PassPreconditionError, match="no MatMul with a constant weight"):
        make_pass("int4")(model)


def test_pipeline_writes_graphs_reports_and_other_files(model_dir, tmp_path):
    out = tmp_path / "int4"
    result = run_pipeline(model_dir, out, [make_pass("int4:block=32")])
    assert {p.name for p in out.iterdir()} >= {DECODER, "vision_encoder.onnx", "embed_tokens.onnx", "config.json"}
    (report,) = result.reports
    assert report.graph == DECODER and report.size_after < 0.2 * report.size_before
    assert report.worst("logits").rel_l2 < 0.2
    assert result.provenance()["passes"][0]["pass_name"] == "int4"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@dataclass
class _BoomConfig(PassConfig):
    scale: float = param(2.0, min=0.0)


class _ScaleWeightsPass(GraphPass):
    """Doubles every weight: a real change whose error the check must see, and then refuse."""

    name = "scale_weights"
    Config = _BoomConfig
    graphs = ("vision_encoder.onnx",)  # runs after the decoder was already written to the temp folder
    max_rel_error = 0.01

    def transform(self, model, ctx):
        from edgekit.passes import find_weight_matmuls

        for m in find_weight_matmuls(model):
            m.weight.const_value = ir.Tensor(m.weight.const_value.numpy() * self.config.scale, name=m.weight.name)
        return PassChanges(initializers_touched=["all"])


def test_pipeline_leaves_no_output_on_failure(model_dir, tmp_path):
    out = tmp_path / "never"
    with pytest.raises(PassFailedError, match="exceeds"):
        run_pipeline(model_dir, out, [make_pass("int4"), _ScaleWeightsPass()])
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_pipeline_refuses_existing_output_and_bad_block(model_dir, tmp_path):
    (tmp_path / "exists").mkdir()
    with pytest.raises(ConfigError, match="already exists"):
        run_pipeline(model_dir, tmp_path / "exists", [make_pass("int4")])
    with pytest.raises(ConfigError, match="does not divide K=64 of model.layers.0.self_attn.q_proj.weight"):
        run_pipeline(model_dir, tmp_path / "o", [make_pass("int4:block=128")])
    assert not (tmp_path / "o").exists()


def test_cli_happy_path_and_bad_pass(model_dir, tmp_path, capsys):
    out = tmp_path / "cli"
    assert main(["optimize", str(model_dir), "-o", str(out), "--pass", "int4:block=32", "--json"]) == 0
    import json

    data = json.loads(capsys.readouterr().out)
    assert data["passes"][0]["pass_name"] == "int4" and (out / DECODER).is_file()
    assert main(["optimize", str(model_dir), "-o", str(tmp_path / "x"), "--pass", "int4:bloc=32"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown parameter(s) bloc" in err[0]
    assert not (tmp_path / "x").exists()


def test_cli_help_has_examples(capsys):
    with pytest.raises(SystemExit):
        from edgekit.cli.app import app

        app(["optimize", "--help"], prog_name="edgekit")
    text = " ".join(capsys.readouterr().out.split())
    assert "Examples:" in text and "method=awq" in text and "--recipe" in text


# ----------------------------------------------------------------------------------------------------------------
# one way to run a pass: bound to a context, through onnx-ir's PassBase.__call__
# ----------------------------------------------------------------------------------------------------------------
def _small_decoder(model_dir) -> ir.Model:
    return ir.load(model_dir / DECODER)


def test_a_bound_pass_runs_under_onnx_ir_and_reports(model_dir):
    model = _small_decoder(model_dir)
    ctx = PassContext(graph=DECODER, model_dir=model_dir)
    result = ir.passes.PassManager([make_pass("int4:block=32").bind(ctx)])(model)
    assert result.model is model and result.modified
    assert any(n.op_type == "MatMulNBits" for n in model.graph)
    direct = make_pass("fp16")(_small_decoder(model_dir), ctx)  # the same run, without a manager
    assert direct.report.pass_name == "fp16" and direct.report.graph == DECODER and direct.modified


def test_a_pass_holds_only_its_configuration(model_dir):
    p = make_pass("int4:block=32,method=awq,calib=2")
    before = dict(vars(p))
    p(_small_decoder(model_dir))
    p(ir.load(model_dir / "vision_encoder.onnx"), PassContext(graph="vision_encoder.onnx", model_dir=model_dir))
    assert vars(p) == before and set(vars(p)) == {"config"}


def test_precondition_errors_are_edgekit_and_onnx_ir_errors():
    x = ir.val("x", ir.DataType.FLOAT, [2, 4])
    node = ir.node("Relu", [x])
    node.outputs[0].name, node.outputs[0].dtype, node.outputs[0].shape = "y", ir.DataType.FLOAT, ir.Shape([2, 4])
    model = ir.Model(ir.Graph([x], node.outputs, nodes=[node], opset_imports={"": 21}), ir_version=10)
    with pytest.raises(PassPreconditionError, match="int8: no MatMul") as err:
        make_pass("int8").bind()(model)
    assert isinstance(err.value, ir.passes.PreconditionError)  # what onnx-ir callers catch
    with pytest.raises(ir.passes.PassError) as err:  # a manager names the pass that failed, cause kept
        ir.passes.PassManager([make_pass("int8").bind()])(model)
    assert isinstance(err.value.__cause__.__cause__, PassPreconditionError)


class _PromisesNoMatMulPass(GraphPass):
    """Claims to remove every MatMul and does nothing: its postcondition must catch the broken promise."""

    name = "no_matmul"

    def transform(self, model, ctx):
        return PassChanges()

    def postconditions(self, model, ctx):
        if any(n.op_type == "MatMul" for n in model.graph):
            raise PassFailedError(f"{self.name}: MatMuls left in {ctx.graph}")


def test_postconditions_run_after_the_transform(model_dir):
    with pytest.raises(PassFailedError, match="MatMuls left in decoder_model_merged.onnx"):
        _PromisesNoMatMulPass()(_small_decoder(model_dir))


def test_recipe_names_resolve_through_the_model_family():
    family = get_model_family()
    assert "int4-awq" in family.recipe_names()
    recipe = load_recipe("int4-awq")
    assert recipe.name == "int4-awq" and [p.name for p in recipe.passes] == ["int4", "int4", "qembed"]
    with pytest.raises(ConfigError, match="recipe not found"):
        load_recipe("no-such-recipe")


def test_the_pass_framework_never_imports_the_model_packages():
    """The model families are plug-ins that depend on the core, never the other way round."""
    import ast

    import edgekit.passes

    for path in Path(edgekit.passes.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not any(m.startswith(("edgekit.models", "edgekit.targets")) for m in mods), (path.name, mods)
