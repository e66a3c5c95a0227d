"""One model description per source (edgekit.model_description) and the VLM family contract behind it
(edgekit.hf.family): each family answers every question, the cost models read the same numbers, and no module
branches on a family's name."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from edgekit.describe_model import describe, describe_config
from edgekit.errors import ConfigError
from edgekit.hf.config import VLM_TYPES
from edgekit.hf.family import FAMILY_MODULES, MODEL_TYPES, VlmFamily, family_for, family_named
from edgekit.model_description import MROPE, TEXT, ModelDescription
from edgekit.plugins import get_model_family

REPO = Path(__file__).resolve().parents[1]
CONTRACT = ("spec", "image_tokens", "expected_shapes", "build_vision", "hf_pixel_values", "vision_description")


@pytest.mark.parametrize("name", sorted(FAMILY_MODULES))
def test_every_family_keeps_the_whole_contract(name):
    family = family_named(name)
    assert isinstance(family, VlmFamily) and family.name == name
    missing = [m for m in CONTRACT if getattr(type(family), m) is getattr(VlmFamily, m)]
    assert not missing, f"{name} leaves {missing} to the base, which raises"
    assert "{prompt}" in family.fallback_template and "<image>" in family.fallback_template


def test_every_vlm_model_type_has_a_family_and_unknown_ones_are_refused():
    assert set(MODEL_TYPES) == set(VLM_TYPES)
    assert family_for("smolvlm") is family_named("idefics3")
    assert family_for("qwen2_5_vl").positions == MROPE and family_for("llava").positions == TEXT
    with pytest.raises(ConfigError, match="not a VLM"):
        family_for("gpt2")
    with pytest.raises(ConfigError, match="unknown VLM family"):
        family_named("blip")


def test_no_module_branches_on_a_vlm_family_name():
    """A family's behaviour lives in its module: nothing compares `family` against a family's name."""
    names = "|".join(sorted({*FAMILY_MODULES, *MODEL_TYPES}))
    pattern = re.compile(rf"family\"?\)?\s*(==|!=|in)\s*\(?\"({names})\"")
    hits = []
    for root in ("edgekit", "targets", "models", "daemon"):
        for path in (REPO / root).rglob("*.py"):
            hits += [
                f"{path.relative_to(REPO)}:{i}"
                for i, line in enumerate(path.read_text().splitlines(), 1)
                if pattern.search(line)
            ]
    assert not hits


def test_the_embedded_model_is_described_as_it_ships():
    """The X1 and Orin cost models read one description; the X1 one used to count ModelConfig's default vocabulary
    (1024) instead of the shipped weights' (588)."""
    shipped = json.loads((get_model_family().weights_dir() / "config.json").read_text())
    tiny = describe("radreport-tiny")
    assert tiny.vocab == shipped["vocab_size"] and tiny.family == "radreport-tiny"
    assert tiny.vision is not None and tiny.image_tokens == 16 and tiny.positions == TEXT
    from edgekit.targets.orin.estimate import preset

    assert preset("radreport-tiny") == tiny


def test_a_hugging_face_decoder_and_a_vlm_bundle_config_are_described(tmp_path):
    text = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 300,
        "tie_word_embeddings": True,
    }
    decoder = describe_config({"model_type": "qwen2", **text}, "tiny-qwen2")
    assert isinstance(decoder, ModelDescription) and decoder.vision is None and decoder.family == "qwen2"
    assert decoder.head_dim == 16 and decoder.tied_embeddings and decoder.image_tokens == 0
    vision = {"hidden_size": 32, "image_size": 32, "patch_size": 8, "intermediate_size": 64, "num_hidden_layers": 3}
    llava = {
        "model_type": "llava",
        "text_config": text,
        "vision_config": vision,
        "edgekit_vlm": {"family": "llava", "tower_layers": 2, "image_tokens": 16},
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(llava))
    described = describe(str(tmp_path))
    assert described.vision.layers == 2 and described.image_tokens == 16  # the layers built, not the checkpoint's
    qwen = {"model_type": "qwen2_vl", "text_config": text, "vision_config": {"embed_dim": 32, "patch_size": 14}}
    assert describe_config(qwen, "raw").vision is None  # a directory's Qwen2-VL has no fixed side before import
    with pytest.raises(ConfigError, match="vision_config"):
        describe_config({**llava, "vision_config": {"hidden_size": 32}}, "broken")


def test_the_graph_specs_hold_the_description_they_build_from(tmp_path):
    """A shape number is written once: the export specs hold the description (radreport's) or the decoder shape
    the one config reader gives (a Hugging Face decoder's, the same `describe_hf` describes), and read it through."""
    import dataclasses

    from edgekit.export.specs import DecoderSpec, VisionSpec
    from edgekit.hf.config import decoder_spec
    from edgekit.model_description import from_model_config

    from small_model import SMALL

    described = from_model_config(SMALL)
    dec, vis = DecoderSpec.from_model_config(SMALL), VisionSpec.from_model_config(SMALL)
    assert dec.shape == described and vis.model == described
    sizes = (dec.hidden, dec.layers, dec.heads, dec.kv_heads, dec.head_dim, dec.intermediate, dec.vocab_size)
    assert sizes == (48, 2, 4, 2, 12, 96, 97)
    assert (vis.hidden, vis.layers, vis.heads, vis.out_hidden, vis.num_image_tokens) == (32, 1, 2, 48, 4)
    assert vis.num_image_tokens == described.image_tokens
    with pytest.raises(ConfigError, match="no vision tower"):
        VisionSpec(dataclasses.replace(described, vision=None), heads=2, ln_eps=1e-6)

    text = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    cfg = {"model_type": "qwen2", **text, "intermediate_size": 128, "vocab_size": 300, "rms_norm_eps": 1e-6}
    spec = decoder_spec(cfg, tmp_path, {"lm_head.weight"})
    assert ModelDescription.of(spec.shape, family="qwen2") == describe_config(cfg, tmp_path.name)
    assert spec.head_dim == 16 and spec.lm_head == "lm_head" and spec.qkv_bias
    with pytest.raises(ConfigError, match="num_attention_heads 4 is not a multiple of num_key_value_heads 3"):
        decoder_spec({**cfg, "num_key_value_heads": 3}, tmp_path, ())
    with pytest.raises(ConfigError, match="vocab_size is missing"):
        decoder_spec({k: v for k, v in cfg.items() if k != "vocab_size"}, tmp_path, ())


# the modules that read a VLM config's parts: the one language-model reader, and each family's own (the towers')
CONFIG_PART_READERS = {
    "edgekit/hf/config.py",  # language_model_config: every reader of the language model goes through it
    "edgekit/hf/vlm_spec.py",  # the tower families' language model, checked as they build it
    "edgekit/hf/tower_family.py",
    "edgekit/hf/llava.py",
    "edgekit/hf/idefics3.py",
    "edgekit/hf/qwen2_vl.py",
    "edgekit/hf/vision_tower.py",  # a whole SigLIP checkpoint imported as a vision model: its tower
}


def test_only_the_config_reader_and_the_families_read_a_vlm_configs_parts():
    pattern = re.compile(r"""(\.get\(|\[|getattr\([^,]+,\s*)["'](text|vision)_config["']|\.(text|vision)_config\b""")
    hits = []
    for root in ("edgekit", "targets", "models", "daemon"):
        for path in (REPO / root).rglob("*.py"):
            rel = str(path.relative_to(REPO))
            if rel in CONFIG_PART_READERS:
                continue
            hits += [f"{rel}:{i}" for i, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits
