"""LoRA merge without torch, checked against PEFT's own `merge_and_unload` on real saved adapters."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import helper, numpy_helper

from edgekit.errors import ConfigError
from edgekit.export import export_model
from edgekit.export.model_config import ModelConfig
from edgekit.names import DECODER, VISION_ENCODER
from edgekit.passes.base import PassContext
from edgekit.passes.lora import LoraMergePass, merge_lora
from edgekit.passes.peft_adapter import AdapterError, read_peft_adapter

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from edgekit.export.parity import TorchBackend  # noqa: E402
from edgekit.models.radreport_tiny.modeling import RadReportTiny  # noqa: E402
from edgekit.targets.cpu import CpuBackend  # noqa: E402

TINY = ModelConfig(
    image_size=16,
    patch_size=8,
    num_frames=2,
    vision_hidden=32,
    vision_layers=1,
    vision_heads=2,
    vision_mlp=64,
    vocab_size=61,
    hidden=32,
    layers=2,
    heads=4,
    kv_heads=2,
    intermediate=64,
)
TARGETS = ["q_proj", "v_proj", "gate_proj"]
DECODER_ONLY = r"model\.layers\.\d+\.(self_attn\.(q|v)_proj|mlp\.gate_proj)"


def tiny_model(seed: int = 0) -> RadReportTiny:
    torch.manual_seed(seed)
    return RadReportTiny(TINY).eval()


def state(model) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def save_adapter(out, *, seed: int, r: int = 4, alpha: float = 8, target_modules=TARGETS, rslora=False):
    """Wrap a fresh copy of the base model with PEFT, give lora_B non-zero values, save; return the PEFT model."""
    pm = peft.get_peft_model(
        tiny_model(),
        peft.LoraConfig(
            target_modules=target_modules, r=r, lora_alpha=alpha, use_rslora=rslora, init_lora_weights=True
        ),
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:  # A is random by default; B is zero, so make both ours
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    pm.save_pretrained(str(out))
    return pm


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("base")
    export_model(state(tiny_model()), TINY, d)
    return d


def initializers(path) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}


def test_merge_matches_peft_merge_and_unload(base, tmp_path):
    pm = save_adapter(tmp_path / "adapter", seed=1)
    reference = state(pm.merge_and_unload())
    result = merge_lora(base, tmp_path / "out", [tmp_path / "adapter"])
    # q/v exist in both the vision encoder and the decoder: the adapter spans two graphs
    assert set(result) == {DECODER, VISION_ENCODER}
    assert len(result[DECODER]) == 3 * TINY.layers
    merged = {**initializers(tmp_path / "out" / VISION_ENCODER), **initializers(tmp_path / "out" / DECODER)}
    touched = [k for k in merged if k.endswith(".weight") and any(t in k for t in TARGETS)]
    assert len(touched) == 3 * TINY.layers + 2 * TINY.vision_layers
    before = initializers(base / DECODER)
    for name, w in merged.items():
        np.testing.assert_allclose(w, reference[name], atol=1e-5, rtol=0, err_msg=name)
        if name in before and name in touched:
            assert np.abs(w - before[name]).max() > 1e-3  # the update really landed
    # logits through ORT against the PEFT-merged torch model
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 7, TINY.hidden)).astype(np.float32)
    mask, pos = np.ones((2, 7), np.int64), np.tile(np.arange(7), (2, 1))
    ort_logits, _ = CpuBackend.from_dir(tmp_path / "out").decode(x, mask, pos, None)
    ref_logits, _ = TorchBackend(reference, TINY).decode(x, mask, pos, None)
    np.testing.assert_allclose(ort_logits, ref_logits, atol=1e-4, rtol=0)


def test_rslora_and_regex_target_modules(base, tmp_path):
    pm = save_adapter(tmp_path / "a", seed=2, r=8, alpha=4, target_modules=DECODER_ONLY, rslora=True)
    adapter = read_peft_adapter(tmp_path / "a")
    assert adapter.use_rslora and isinstance(adapter.target_modules, str)
    assert {m.scaling for m in adapter.modules.values()} == {4 / np.sqrt(8)}
    reference = state(pm.merge_and_unload())
    result = merge_lora(base, tmp_path / "out", [tmp_path / "a"])
    assert set(result) == {DECODER}  # the regex keeps the vision encoder out
    for name, w in initializers(tmp_path / "out" / DECODER).items():
        np.testing.assert_allclose(w, reference[name], atol=1e-5, rtol=0, err_msg=name)


def test_two_weighted_adapters_match_peft_cat_combination(base, tmp_path):
    save_adapter(tmp_path / "a", seed=3, r=4, alpha=8)
    save_adapter(tmp_path / "b", seed=4, r=2, alpha=2, target_modules=["q_proj", "o_proj"])
    pm = peft.PeftModel.from_pretrained(tiny_model(), str(tmp_path / "a"), adapter_name="a")
    pm.load_adapter(str(tmp_path / "b"), adapter_name="b")
    pm.add_weighted_adapter(["a", "b"], [0.7, -0.4], "mix", combination_type="cat")
    pm.set_adapter("mix")
    reference = state(pm.merge_and_unload(adapter_names=["mix"]))
    merge_lora(base, tmp_path / "out", [tmp_path / "a", tmp_path / "b"], [0.7, -0.4])
    merged = {**initializers(tmp_path / "out" / VISION_ENCODER), **initializers(tmp_path / "out" / DECODER)}
    for name, w in merged.items():
        np.testing.assert_allclose(w, reference[name], atol=1e-5, rtol=0, err_msg=name)


def test_fan_in_fan_out_weight_stored_in_out(tmp_path):
    """A GPT-2 style Conv1D weight is (in, out) and feeds MatMul directly; the update must be transposed."""
    from transformers.pytorch_utils import Conv1D

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = Conv1D(12, 8)  # nf=12 outputs, nx=8 inputs; weight (8, 12)

    torch.manual_seed(0)
    block = Block()
    w0 = block.c_attn.weight.detach().numpy().copy()
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 8])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 12])
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "c_attn.weight"], ["y"], name="/c_attn/MatMul")],
        "g",
        [x],
        [y],
        [numpy_helper.from_array(w0, "c_attn.weight")],
    )
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), str(model_dir / DECODER))

    pm = peft.get_peft_model(block, peft.LoraConfig(target_modules=["c_attn"], r=2, lora_alpha=4, fan_in_fan_out=True))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape) * 0.3)
    pm.save_pretrained(str(tmp_path / "adapter"))
    assert read_peft_adapter(tmp_path / "adapter").fan_in_fan_out
    reference = pm.merge_and_unload().c_attn.weight.detach().numpy()
    merge_lora(model_dir, tmp_path / "out", [tmp_path / "adapter"], module_prefix="")
    merged = initializers(tmp_path / "out" / DECODER)["c_attn.weight"]
    assert merged.shape == (8, 12)
    np.testing.assert_allclose(merged, reference, atol=1e-5, rtol=0)


def _mismatched_adapter(tmp_path, base_adapter):
    """Edit a real adapter: one module with the wrong width, one that the model lacks."""
    from safetensors.numpy import load_file, save_file

    src = load_file(str(base_adapter / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    src[key] = np.zeros((TINY.hidden + 8, 4), np.float32)
    src["base_model.model.model.layers.9.mlp.gate_proj.lora_A.weight"] = np.zeros((4, TINY.hidden), np.float32)
    src["base_model.model.model.layers.9.mlp.gate_proj.lora_B.weight"] = np.zeros((TINY.intermediate, 4), np.float32)
    out = tmp_path / "bad"
    out.mkdir()
    save_file(src, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text((base_adapter / "adapter_config.json").read_text())
    return out


def test_mismatched_adapter_is_refused_with_every_module_and_no_output(base, tmp_path):
    save_adapter(tmp_path / "good", seed=5)
    bad = _mismatched_adapter(tmp_path, tmp_path / "good")
    with pytest.raises(AdapterError) as err:
        merge_lora(base, tmp_path / "out", [bad])
    msg = str(err.value)
    assert len(err.value.problems) == 2
    assert "model.layers.0.self_attn.q_proj expects (out, in) (40, 32), the model has (32, 32)" in msg
    assert "model.layers.9.mlp.gate_proj has no weight MatMul" in msg
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []  # no temp dir left behind


def test_adapter_with_other_rank_than_config_is_refused(tmp_path):
    save_adapter(tmp_path / "a", seed=6, r=4)
    cfg = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    cfg["r"] = 8
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterError, match="rank is 8 by the config but A is"):
        read_peft_adapter(tmp_path / "a")


def test_missing_files_and_unsupported_features(tmp_path):
    with pytest.raises(AdapterError, match="adapter directory not found"):
        read_peft_adapter(tmp_path / "nope")
    (tmp_path / "x").mkdir()
    with pytest.raises(AdapterError, match="adapter_config.json not found"):
        read_peft_adapter(tmp_path / "x")
    (tmp_path / "x" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "use_dora": True}))
    with pytest.raises(AdapterError, match="use_dora is set"):
        read_peft_adapter(tmp_path / "x")


def test_pass_refuses_in_preconditions_and_leaves_model_untouched(base, tmp_path):
    save_adapter(tmp_path / "good", seed=7)
    bad = _mismatched_adapter(tmp_path, tmp_path / "good")
    model = ir.load(base / DECODER)
    before = {k: v.const_value.numpy().copy() for k, v in model.graph.initializers.items()}
    p = LoraMergePass.from_string(f"adapters={bad}")
    with pytest.raises(AdapterError):
        p(model, PassContext(graph=DECODER, model_dir=base))
    for k, v in model.graph.initializers.items():
        np.testing.assert_array_equal(v.const_value.numpy(), before[k])


def test_pass_merges_one_graph_when_siblings_hold_the_rest(base, tmp_path):
    pm = save_adapter(tmp_path / "a", seed=8)
    reference = state(pm.merge_and_unload())
    model = ir.load(base / DECODER)
    p = LoraMergePass.from_string(f"adapters={tmp_path / 'a'},weights=1.0")
    report = p(model, PassContext(graph=DECODER, model_dir=base)).report
    assert len(report.initializers_touched) == 3 * TINY.layers
    for name, v in model.graph.initializers.items():
        np.testing.assert_allclose(v.const_value.numpy(), reference[name], atol=1e-5, rtol=0)
    # without the sibling graphs, the vision modules cannot be placed: refused
    with pytest.raises(AdapterError, match="vision_model"):
        LoraMergePass.from_string(f"adapters={tmp_path / 'a'}")(ir.load(base / DECODER), PassContext(graph=DECODER))


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="lora.adapters"):
        LoraMergePass.from_string("")
    with pytest.raises(ConfigError, match="lora.weights"):
        LoraMergePass.from_string("adapters=a;b,weights=1.0")


def test_site_style_is_invertible_and_new():
    from edgekit.models.radreport_tiny.lora import from_site_style, site_style
    from edgekit.models.synth import generate_study

    for i in range(40):
        ref = generate_study(i, "val").references
        assert from_site_style(site_style(ref[0])) == ref[0]
        assert site_style(ref[0]) not in ref  # a phrasing the model never saw


def test_finetune_recipe_on_a_tiny_model_and_merge_without_torch(tmp_path):
    """The recipe end to end on a tiny random model (the trained model is not used here: too slow for a test):
    the adapter it saves merges with edgekit's pass to PEFT's own merged weights."""
    from edgekit.models.radreport_tiny.data import build_split, tokenizer_corpus
    from edgekit.models.radreport_tiny.lora import LoraRecipe, finetune, site_style, to_site
    from edgekit.models.radreport_tiny.tokenizer import train_tokenizer
    from edgekit.preprocess import PreprocessConfig

    pcfg = PreprocessConfig()
    train, val = build_split("train", 16, pcfg), build_split("val", 4, pcfg)
    tok = train_tokenizer(tokenizer_corpus(train) + tokenizer_corpus(to_site(train)), vocab_size=400)
    cfg = ModelConfig(
        image_size=pcfg.image_size,
        patch_size=16,
        num_frames=pcfg.num_frames,
        vision_hidden=32,
        vision_layers=1,
        vision_heads=2,
        vision_mlp=64,
        vocab_size=tok.get_vocab_size(),
        hidden=48,
        layers=2,
        heads=4,
        kv_heads=2,
        intermediate=96,
    )
    torch.manual_seed(0)
    model = RadReportTiny(cfg).eval()
    base_weights = state(model)
    opts = LoraRecipe(epochs=4, batch_size=8, r=4, alpha=8, lr=1e-2, eval_batch=4)
    result = finetune(model, tok, train, val, opts, tmp_path / "run", max_new_tokens=8)
    assert result["steps"] == 8 and result["trainable_params"] > 0
    assert result["last_loss"] < result["first_loss"]
    assert set(result["before"]) == set(result["after"]) == {"bleu4", "finding_f1"}
    assert json.loads((tmp_path / "run" / "lora_result.json").read_text())["bleu4_gain"] == result["bleu4_gain"]
    assert val.texts[0].references[0] != site_style(val.texts[0].references[0])

    export_model(base_weights, cfg, tmp_path / "base")
    merge_lora(tmp_path / "base", tmp_path / "merged", [tmp_path / "run" / "adapter"])
    reference = state(model)  # the recipe merged PEFT's layers into `model` in place
    for name, w in initializers(tmp_path / "merged" / DECODER).items():
        np.testing.assert_allclose(w, reference[name], atol=1e-5, rtol=0, err_msg=name)
