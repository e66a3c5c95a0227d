"""Hugging Face import: random-init LLaMA / Qwen2 / SigLIP / ViT models built with transformers from small
configs (no downloads), saved with `save_pretrained`, converted by edgekit and compared with transformers' own
forward; plus the memory path (external data, checks through files) and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from edgekit.cli import app as app_module  # noqa: E402
from edgekit.errors import ConfigError, EdgekitError  # noqa: E402
from edgekit.hf import SafetensorsCheckpoint, convert_hf  # noqa: E402
from edgekit.passes import make_pass, run_pipeline  # noqa: E402

TOL = 1e-4
DEC = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    initializer_range=0.2,
)  # a wide init so logits spread and 1e-4 means something


def _save(model, path: Path, **kw) -> Path:
    model.save_pretrained(path, **kw)
    return path


def _causal_lm(config, seed=0, random_bias=False):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    if random_bias:  # HF initialises biases to zero, which would hide a graph that ignores them
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0.0, 0.5)
    return model


class OnnxLM:
    """The converted embed_tokens + decoder graphs, run the way the cpu backend runs them."""

    def __init__(self, out: Path, spec):
        self.embed = ort.InferenceSession(str(out / "embed_tokens.onnx"))
        self.dec = ort.InferenceSession(str(out / "decoder_model_merged.onnx"))
        self.spec = spec

    def __call__(self, ids: np.ndarray, past=None):
        past_len = 0 if past is None else past[0][0].shape[2]
        feed = {
            "inputs_embeds": self.embed.run(None, {"input_ids": ids})[0],
            "attention_mask": np.ones((ids.shape[0], past_len + ids.shape[1]), np.int64),
            "position_ids": np.arange(past_len, past_len + ids.shape[1])[None].repeat(ids.shape[0], 0),
        }
        for i in range(self.spec.layers):
            empty = np.zeros((ids.shape[0], self.spec.kv_heads, 0, self.spec.head_dim), np.float32)
            feed[f"past_key_values.{i}.key"] = empty if past is None else past[i][0]
            feed[f"past_key_values.{i}.value"] = empty if past is None else past[i][1]
        out = self.dec.run(None, feed)
        return out[0], [(out[1 + 2 * i], out[2 + 2 * i]) for i in range(self.spec.layers)]


def _hf_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


def _check_decoder_parity(model, out: Path, spec, ids: np.ndarray) -> None:
    lm = OnnxLM(out, spec)
    ref = _hf_logits(model, ids)
    got, _ = lm(ids)
    assert np.abs(got - ref).max() <= TOL, np.abs(got - ref).max()
    assert np.abs(ref).max() > 0.5  # the comparison is not between two near-zero tensors

    # KV cache: prefill all but the last 3 tokens, then decode them one by one against the full forward
    n = ids.shape[1] - 3
    logits, past = lm(ids[:, :n])
    for t in range(n, ids.shape[1]):
        logits, past = lm(ids[:, t : t + 1], past)
        assert np.abs(logits[:, -1] - ref[:, t]).max() <= TOL
        assert past[0][0].shape[2] == t + 1

    # greedy: 8 new tokens with the KV cache vs transformers' argmax over its own full forward
    ours, theirs = ids[:1], ids[:1]
    logits, past = lm(ours)
    for _ in range(8):
        ours = np.concatenate([ours, logits[:, -1:].argmax(-1)], axis=1)
        logits, past = lm(ours[:, -1:], past)
        theirs = np.concatenate([theirs, _hf_logits(model, theirs)[:, -1:].argmax(-1)], axis=1)
    np.testing.assert_array_equal(ours, theirs)


IDS = np.array([[5, 17, 3, 99, 42, 7, 64, 1, 120], [9, 8, 7, 6, 5, 4, 3, 2, 1]], np.int64)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.mark.parametrize(
    "family,extra,random_bias",
    [
        ("llama", {"rope_parameters": LLAMA3_ROPE}, False),  # untied lm_head, llama3 rope scaling
        ("qwen2", {}, True),  # q/k/v biases
        (
            "llama",
            {
                "tie_word_embeddings": True,
                "head_dim": 24,  # tied embeddings, head_dim != hidden/heads,
                "rope_parameters": {"rope_type": "linear", "rope_theta": 500000.0, "factor": 2.0},
            },
            False,
        ),
    ],
    ids=["llama-llama3rope", "qwen2-bias", "llama-tied-linearrope"],
)
def test_decoder_parity(tmp_path, family, extra, random_bias):
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[family]
    model = _causal_lm(cls(**DEC, **extra), random_bias=random_bias)
    result = convert_hf(_save(model, tmp_path / "hf"), tmp_path / "onnx")
    assert result.kind == "decoder" and result.model_type == family
    spec = result.spec
    assert spec.qkv_bias == (family == "qwen2")
    if extra.get("tie_word_embeddings"):
        assert spec.lm_head == "model.embed_tokens" and spec.head_dim == 24
    _check_decoder_parity(model, tmp_path / "onnx", spec, IDS)
    assert json.loads((tmp_path / "onnx" / "hf_config.json").read_text())["model_type"] == family


def test_sharded_bf16_checkpoint(tmp_path):
    model = _causal_lm(transformers.LlamaConfig(**DEC), seed=3).to(torch.bfloat16)
    hf = _save(model, tmp_path / "hf", max_shard_size="40KB")
    assert (hf / "model.safetensors.index.json").is_file()
    assert len(list(hf.glob("model-*.safetensors"))) > 1
    result = convert_hf(hf, tmp_path / "onnx")
    # the reference: transformers' own fp32 load of the same bf16 shards (bf16 widens exactly; the rotary
    # frequencies are recomputed in fp32, as edgekit does)
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    _check_decoder_parity(ref, tmp_path / "onnx", result.spec, IDS)


@pytest.mark.parametrize("family", ["siglip", "vit"])
def test_vision_encoder_parity(tmp_path, family):
    torch.manual_seed(0)
    common = dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=8
    )
    if family == "siglip":
        model = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**common)).eval()
    else:
        model = transformers.ViTModel(transformers.ViTConfig(**common)).eval()
    with torch.no_grad():  # non-trivial norms, biases and positions
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    result = convert_hf(_save(model, tmp_path / "hf"), tmp_path / "onnx")
    x = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
    with torch.no_grad():
        ref = model(pixel_values=torch.tensor(x)).last_hidden_state.numpy()
    got = ort.InferenceSession(str(result.graphs[0])).run(None, {"pixel_values": x})[0]
    assert got.shape == ref.shape == (2, 16 + (family == "vit"), 32)
    assert np.abs(got - ref).max() <= TOL
    names = {i.name for i in __import__("onnx").load(str(result.graphs[0])).graph.initializer}
    assert (
        "encoder.layer.0.attention.attention.query.weight"
        if family == "vit"
        else "encoder.layers.0.self_attn.q_proj.weight"
    ) in names  # the checkpoint's own names


def _tiny_llama_dir(tmp_path: Path) -> Path:
    return _save(_causal_lm(transformers.LlamaConfig(**DEC), seed=1), tmp_path / "hf")


def test_unsupported_model_type_is_refused_in_one_line(tmp_path, capsys):
    hf = tmp_path / "gpt2"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64}))
    with pytest.raises(ConfigError, match="model_type 'gpt2' is not supported"):
        convert_hf(hf, tmp_path / "out")
    assert app_module.main(["convert", str(hf), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "config.json" in err and "gpt2" in err and "llama" in err
    assert not (tmp_path / "out").exists()


def test_cli_convert_detects_hf_dir(tmp_path, capsys):
    hf = _tiny_llama_dir(tmp_path)
    assert app_module.main(["convert", str(hf), "-o", str(tmp_path / "onnx"), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["graph"] for r in rows] == ["embed_tokens.onnx", "decoder_model_merged.onnx"]


def test_truncated_shard_is_refused_naming_it(tmp_path):
    hf = _tiny_llama_dir(tmp_path)
    f = hf / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(EdgekitError, match="truncated") as info:
        SafetensorsCheckpoint(hf)
    assert info.value.path == str(f)


def test_external_data_convert_and_int4_check_through_files(tmp_path, monkeypatch):
    """The big-model path on a small model: weights external, the pass's check comparing through files
    (as above 1.5 GB) gives the same errors as the in-memory check; past check_max_bytes it is skipped."""
    hf = _tiny_llama_dir(tmp_path)
    result = convert_hf(hf, tmp_path / "onnx", external_data_threshold_bytes=0)
    assert (tmp_path / "onnx" / "decoder_model_merged.onnx.data").is_file()
    _check_decoder_parity(_causal_lm(transformers.LlamaConfig(**DEC), seed=1), tmp_path / "onnx", result.spec, IDS)

    passes = lambda: [make_pass("prune:ratio=0.3"), make_pass("int4:block=32")]  # noqa: E731
    in_memory = run_pipeline(tmp_path / "onnx", tmp_path / "q1", passes())
    from edgekit.passes import check, pipeline

    monkeypatch.setattr(check, "IN_MEMORY_LIMIT_BYTES", 0)
    monkeypatch.setattr(pipeline, "IN_MEMORY_LIMIT_BYTES", 0)
    via_files = run_pipeline(tmp_path / "onnx", tmp_path / "q2", passes())  # before = source file, then snapshot
    for a, b in zip(via_files.reports, in_memory.reports, strict=True):
        assert a.worst("logits").rel_l2 == pytest.approx(b.worst("logits").rel_l2, rel=1e-5)
        assert 0 < a.worst("logits").rel_l2 < 1.0
    e2e = via_files.end_to_end["decoder_model_merged.onnx"]
    assert max(e.rel_l2 for e in e2e) == pytest.approx(
        max(e.rel_l2 for e in in_memory.end_to_end["decoder_model_merged.onnx"]), rel=1e-5
    )
    assert not list(tmp_path.glob(".q2*")) and not (tmp_path / "q2" / ".check").exists()  # no scratch left

    skipped = run_pipeline(tmp_path / "onnx", tmp_path / "q3", [make_pass("int4:block=32")], check_max_bytes=0).reports[
        0
    ]
    assert skipped.check is None and "check_max_bytes" in skipped.notes["check_skipped"]


def test_missing_external_data_is_refused_naming_the_file(tmp_path):
    convert_hf(_tiny_llama_dir(tmp_path), tmp_path / "onnx", external_data_threshold_bytes=0)
    (tmp_path / "onnx" / "decoder_model_merged.onnx.data").unlink()
    with pytest.raises(EdgekitError, match="decoder_model_merged.onnx.data is missing") as info:
        run_pipeline(tmp_path / "onnx", tmp_path / "q", [make_pass("int4:block=32")])
    assert info.value.path.endswith("decoder_model_merged.onnx")
    assert not (tmp_path / "q").exists() and not list(tmp_path.glob(".q*"))
