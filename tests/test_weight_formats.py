"""Weight formats by name: passes take `format=`, targets declare the formats they take, the build fills and
refuses by them, and the deprecated `target=` of edgekit <= 0.x still reads as the format that target takes."""

from __future__ import annotations

import warnings

import pytest

from edgekit.build import retarget_recipe
from edgekit.errors import ConfigError
from edgekit.passes import make_pass
from edgekit.passes.recipe import load_recipe
from edgekit.passes.weight_formats import FORMATS, WritesWeightFormat
from edgekit.plugins import get_model_family, get_target, target_names


def _recipe(tmp_path, body: str):
    path = tmp_path / "r.toml"
    path.write_text(f'name = "r"\n[[pass]]\n{body}\n')
    return load_recipe(path)


def _built_for(recipe, target: str):
    return retarget_recipe(recipe, target, get_target(target).weight_formats)


def test_every_shipped_target_names_registered_formats():
    for name in target_names():
        formats = get_target(name).weight_formats
        assert formats and all(f in FORMATS for f in formats), (name, formats)


@pytest.mark.parametrize(
    "target, spec, want",
    [
        ("cpu", "int4", "matmulnbits"),
        ("cpu", "int8", "ort-dynamic"),
        ("cpu", "qembed", "gather-block-quantized"),
        ("cpu", "qembed:bits=8", "qdq-blocked"),  # GatherBlockQuantized is written for 4 bits only
        ("orin", "int4", "qdq-blocked"),
        ("orin", "int8", "qdq-blocked"),
        ("x1", "int4", "qdq-blocked"),
        ("x1", "qembed", "qdq-blocked"),
    ],
)
def test_a_pass_naming_no_format_takes_the_first_its_target_takes_that_fits(tmp_path, target, spec, want):
    name, _, params = spec.partition(":")
    body = f'name = "{name}"\n' + "".join(f"{k} = {v}\n" for k, v in (p.split("=") for p in params.split(",") if p))
    (p,) = _built_for(_recipe(tmp_path, body), target).passes
    assert p.config.format == want and p.format.name == want


def test_without_a_target_passes_write_onnx_runtimes_formats():
    assert make_pass("int4").format.name == "matmulnbits"
    assert make_pass("int8").format.name == "ort-dynamic"
    assert make_pass("qembed").format.name == "gather-block-quantized"


def test_a_format_the_target_does_not_take_or_cannot_fit_is_one_line_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"pass\[0\] int4\.format: target x1 does not take matmulnbits"):
        _built_for(_recipe(tmp_path, 'name = "int4"\nformat = "matmulnbits"'), "x1")
    with pytest.raises(ConfigError, match=r"int4\.symmetric: format qdq-blocked takes symmetric weights only"):
        _built_for(_recipe(tmp_path, 'name = "int4"\nsymmetric = false'), "orin")
    with pytest.raises(ConfigError, match=r"int4\.other_bits: writes qdq-blocked, which target t does not take"):
        retarget_recipe(_recipe(tmp_path, 'name = "int4"\nother_bits = 4'), "t", ("matmulnbits",))
    with pytest.raises(ConfigError, match=r"int4\.format: unknown weight format 'int4-nope' \(known: matmulnbits"):
        make_pass("int4:format=int4-nope")


def test_cpu_keeps_a_recipes_own_format(tmp_path):
    (p,) = _built_for(_recipe(tmp_path, 'name = "int4"\nformat = "qdq-blocked"'), "cpu").passes
    assert p.config.format == "qdq-blocked" and p.min_opset() == 21


@pytest.mark.parametrize(
    "spec, want",
    [
        ("int4:target=x1", "qdq-blocked"),
        ("int4:target=cpu", "matmulnbits"),
        ("int8:target=orin", "qdq-blocked"),
        ("int8:target=cpu", "ort-dynamic"),
        ("qembed:target=cpu", "gather-block-quantized"),
        ("qembed:encoding=dequantize", "qdq-blocked"),
    ],
)
def test_the_deprecated_target_and_encoding_read_as_a_format_with_a_warning(spec, want):
    with pytest.warns(FutureWarning, match=f"deprecated.*format={want}"):
        p = make_pass(spec)
    assert p.format.name == want


def test_an_old_recipe_naming_a_target_builds_for_any_target_as_before(tmp_path):
    """`target = "cpu"` in a recipe was always overridden by the build's target: it still is, with no warning
    left in the built config (the deprecated field is cleared)."""
    with pytest.warns(FutureWarning, match="int4.target=cpu is deprecated"):
        old = _recipe(tmp_path, 'name = "int4"\ntarget = "cpu"')
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (p,) = _built_for(old, "x1").passes
    assert p.config.format == "qdq-blocked" and p.config.target is None
    with pytest.raises(ConfigError, match=r"int4\.target: unknown target 'nope'"):
        make_pass("int4:target=nope")


def test_shipped_recipes_name_formats_not_targets():
    family = get_model_family()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        for name in family.recipe_names():
            for p in load_recipe(name).passes:
                if isinstance(p.config, WritesWeightFormat):
                    assert p.config.target is None, (name, p.name)
