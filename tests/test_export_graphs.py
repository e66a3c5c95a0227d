"""The exported graphs' structure: checker-clean, default domain, weights under their names, external data."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from edgekit.errors import ConfigError, EdgekitError
from edgekit.export import (
    DecoderSpec,
    build_decoder,
    expected_shapes,
    export_default,
    export_model,
    random_weights,
    save_model,
    validate,
)
from edgekit.export.save import non_default_domains

from small_model import SMALL


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    weights = random_weights(SMALL, seed=1)
    return weights, export_model(weights, SMALL, tmp_path_factory.mktemp("onnx"))


def _graphs(paths):
    return {p.name: onnx.load(str(p)) for p in (paths.vision_encoder, paths.embed_tokens, paths.decoder)}


def test_graphs_pass_full_check_with_opset_21_default_domain_only(exported):
    _, paths = exported
    for name, model in _graphs(paths).items():
        validate(paths.decoder.parent / name)
        assert non_default_domains(model) == set(), name
        assert {(o.domain, o.version) for o in model.opset_import} == {("", 21)}
        ops = {n.op_type for n in model.graph.node}
        assert not ops & {"If", "Loop", "Scan", "Gelu", "RMSNormalization", "RotaryEmbedding"}, name
    assert "LayerNormalization" in {n.op_type for n in _graphs(paths)["vision_encoder.onnx"].graph.node}


def test_initializers_are_exactly_the_checkpoint_tensors(exported):
    weights, paths = exported
    seen = {}
    for model in _graphs(paths).values():
        for init in model.graph.initializer:
            assert init.name not in seen, f"{init.name} stored twice"
            seen[init.name] = onnx.numpy_helper.to_array(init)
    assert seen.keys() == expected_shapes(SMALL).keys()
    for name, array in seen.items():
        assert array.dtype == np.float32
        np.testing.assert_array_equal(array, weights[name], err_msg=name)


def test_io_names_follow_the_hf_vlm_convention(exported):
    _, paths = exported
    g = _graphs(paths)
    dec = g["decoder_model_merged.onnx"].graph
    assert [i.name for i in dec.input][:3] == ["inputs_embeds", "attention_mask", "position_ids"]
    assert [i.name for i in dec.input][3:] == [f"past_key_values.{i}.{kv}" for i in range(2) for kv in ("key", "value")]
    presents = [f"present.{i}.{kv}" for i in range(2) for kv in ("key", "value")]
    assert [o.name for o in dec.output] == ["logits", *presents]
    assert [i.name for i in g["vision_encoder.onnx"].graph.input] == ["pixel_values"]
    assert [o.name for o in g["vision_encoder.onnx"].graph.output] == ["image_features"]
    assert [o.name for o in g["embed_tokens.onnx"].graph.output] == ["inputs_embeds"]


def test_nodes_are_named_after_their_modules(exported):
    _, paths = exported
    g = _graphs(paths)
    dec_names = [n.name for n in g["decoder_model_merged.onnx"].graph.node]
    vis_names = [n.name for n in g["vision_encoder.onnx"].graph.node]
    for names in (dec_names, vis_names):
        assert all(names) and len(set(names)) == len(names)
    assert "/model/layers.0/self_attn/q_proj/MatMul" in dec_names
    assert "/model/layers.1/mlp/down_proj/MatMul" in dec_names
    assert "/lm_head/MatMul" in dec_names
    assert "/vision_model/encoder/layers.0/self_attn/q_proj/MatMul" in vis_names
    assert "/vision_model/encoder/layers.0/layer_norm1/LayerNormalization" in vis_names
    assert "/connector/fc2/MatMul" in vis_names


def _run(path, feeds):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)


def test_weights_go_to_external_data_above_the_threshold(exported, tmp_path):
    weights, inline = exported
    ext = export_model(weights, SMALL, tmp_path, external_data_threshold_bytes=0)
    data = ext.decoder.with_name(ext.decoder.name + ".data")
    assert data.is_file() and data.stat().st_size > ext.decoder.stat().st_size
    ids = np.array([[3, 7, 11]], np.int64)
    np.testing.assert_array_equal(
        _run(ext.embed_tokens, {"input_ids": ids})[0], _run(inline.embed_tokens, {"input_ids": ids})[0]
    )
    pv = np.random.default_rng(0).uniform(-1, 1, (1, 2, 1, 32, 32)).astype(np.float32)
    np.testing.assert_array_equal(
        _run(ext.vision_encoder, {"pixel_values": pv})[0], _run(inline.vision_encoder, {"pixel_values": pv})[0]
    )
    # exporting again below the threshold writes one file and removes the stale weights file
    export_model(weights, SMALL, tmp_path)
    assert not data.exists()


def test_export_default_reads_safetensors_and_config(tmp_path):
    from safetensors.numpy import save_file

    save_file(random_weights(SMALL, seed=2), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(SMALL.to_dict()))
    paths = export_default(tmp_path, tmp_path / "out")
    assert all(p.is_file() for p in (paths.vision_encoder, paths.embed_tokens, paths.decoder))


def test_bad_checkpoints_raise_errors_naming_file_and_tensor(tmp_path):
    from safetensors.numpy import save_file

    weights = random_weights(SMALL)
    missing = {k: v for k, v in weights.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(EdgekitError, match="model.layers.1.mlp.up_proj.weight is missing"):
        export_model(missing, SMALL, tmp_path)
    wrong = dict(weights, **{"lm_head.weight": np.zeros((5, 48), np.float32)})
    with pytest.raises(EdgekitError, match=r"lm_head.weight has shape \(5, 48\)"):
        export_model(wrong, SMALL, tmp_path)

    with pytest.raises(ConfigError, match="config.json"):
        export_default(tmp_path, tmp_path / "out")
    (tmp_path / "config.json").write_text(json.dumps(SMALL.to_dict()))
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(EdgekitError, match="model.safetensors: not a readable safetensors") as err:
        export_default(tmp_path, tmp_path / "out")
    assert err.value.code == "invalid_weights"
    save_file(missing, str(tmp_path / "model.safetensors"))
    with pytest.raises(EdgekitError, match="up_proj.weight is missing"):
        export_default(tmp_path, tmp_path / "out")


def test_decoder_builder_serves_qwen2_style_specs(tmp_path):
    """A spec with q/k/v biases and tied embeddings (Qwen2): zero biases and a tied head give the LLaMA graph's
    logits when lm_head equals the embedding table."""
    weights = random_weights(SMALL, seed=3)
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    base = DecoderSpec.from_model_config(SMALL)
    qwen = DecoderSpec(**{**base.__dict__, "qkv_bias": True, "lm_head": "model.embed_tokens"})
    qwen_weights = dict(weights)
    for i in range(SMALL.layers):
        for proj, n in (("q_proj", SMALL.heads), ("k_proj", SMALL.kv_heads), ("v_proj", SMALL.kv_heads)):
            qwen_weights[f"model.layers.{i}.self_attn.{proj}.bias"] = np.zeros(n * SMALL.head_dim, np.float32)
    a = save_model(build_decoder(weights, base), tmp_path / "a.onnx")
    b = save_model(build_decoder(qwen_weights, qwen), tmp_path / "b.onnx")
    validate(b)
    inits = {i.name for i in onnx.load(str(b)).graph.initializer}
    assert "model.layers.0.self_attn.q_proj.bias" in inits and "lm_head.weight" not in inits
    rng = np.random.default_rng(0)
    feeds = {
        "inputs_embeds": rng.standard_normal((1, 5, 48)).astype(np.float32),
        "attention_mask": np.ones((1, 5), np.int64),
        "position_ids": np.arange(5)[None],
    }
    for i in range(SMALL.layers):
        for kv in ("key", "value"):
            feeds[f"past_key_values.{i}.{kv}"] = np.zeros((1, 2, 0, 12), np.float32)
    np.testing.assert_allclose(_run(a, feeds)[0], _run(b, feeds)[0], atol=1e-5)
