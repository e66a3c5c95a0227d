"""`edgekit finetune`: LoRA + learned head gates on users' Hugging Face models, merged and folded without torch.

Checked against the real parts: PEFT loads the adapter it writes; ONNX Runtime runs the converted graphs after
the `lora` pass and must give the logits of the PEFT model with its gates applied; the X1 bundle of a gated
SmolVLM skips the closed heads under the seed's DSS setting.
"""

from __future__ import annotations

import importlib.resources
import json
import shutil

import numpy as np
import pytest

pytest.importorskip("peft", reason="needs the train extra (torch, transformers, peft)")
import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402
from finetune_factory import make_llama, reverse_task, write_image_records, write_jsonl  # noqa: E402
from hf_vlm_factory import make_idefics3  # noqa: E402

from edgekit import names  # noqa: E402
from edgekit.cli import app as app_module  # noqa: E402
from edgekit.finetune.trainer import FinetuneOptions, finetune  # noqa: E402
from edgekit.passes.lora import merge_lora  # noqa: E402
from edgekit.passes.peft_adapter import AdapterError  # noqa: E402

OPTS = FinetuneOptions(steps=16, batch_size=8, gate_rate=0.5, threads=1)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """A tiny LLaMA, fine-tuned 16 steps with half its heads closed."""
    root = tmp_path_factory.mktemp("ft")
    make_llama(root / "base")
    write_jsonl(root / "train.jsonl", reverse_task(64, seed=1))
    write_jsonl(root / "eval.jsonl", reverse_task(16, seed=2))
    result = finetune(root / "base", root / "train.jsonl", root / "adapter", OPTS, eval_data=root / "eval.jsonl")
    return root, result


def _onnx_logits(onnx_dir, ids: np.ndarray, layers: int, kv_heads: int, head_dim: int) -> np.ndarray:
    embed = ort.InferenceSession(str(onnx_dir / "embed_tokens.onnx"))
    dec = ort.InferenceSession(str(onnx_dir / "decoder_model_merged.onnx"))
    feed = {
        "inputs_embeds": embed.run(None, {"input_ids": ids})[0],
        "attention_mask": np.ones(ids.shape, np.int64),
        "position_ids": np.arange(ids.shape[1])[None].repeat(ids.shape[0], 0),
    }
    for i in range(layers):
        for kv in ("key", "value"):
            feed[f"past_key_values.{i}.{kv}"] = np.zeros((ids.shape[0], kv_heads, 0, head_dim), np.float32)
    return dec.run(None, feed)[0]


def test_adapter_is_peft_format_and_the_gates_close_the_rate_asked(tuned):
    import peft
    import transformers

    root, result = tuned
    ad = root / "adapter"
    assert {"adapter_config.json", "adapter_model.safetensors", names.HEAD_GATES_FILE} <= {p.name for p in ad.iterdir()}
    assert result["gates"] == {**result["gates"], "closed": 4, "total": 8, "closed_ratio": 0.5}
    doc = json.loads((ad / names.HEAD_GATES_FILE).read_text())
    assert [e["module"] for e in doc["layers"]] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    for e in doc["layers"]:
        assert len(e["closed"]) < e["heads"]  # no layer loses every head
        assert all(e["score"][h] == 0.0 for h in e["closed"]) and all(0 < s < 1 for s in e["score"] if s)
    assert result["before"]["tokens"] == result["after"]["tokens"] == 16 * 6  # 5 words + </s>, per example
    assert result["last_loss"] < result["first_loss"]
    # PEFT itself reads what was written
    base = transformers.AutoModelForCausalLM.from_pretrained(root / "base")
    loaded = peft.PeftModel.from_pretrained(base, ad)
    assert any("lora_A" in n for n, _ in loaded.named_parameters())


def test_lora_pass_merges_and_folds_the_gates_as_the_trained_model_computes(tuned, tmp_path):
    import peft
    import transformers

    from edgekit.finetune.gates import HeadGates
    from edgekit.finetune.hf_gates import find_decoder_attention, gates_applied
    from edgekit.hf import convert_hf

    root, _ = tuned
    convert_hf(root / "base", tmp_path / "onnx")
    merge_lora(tmp_path / "onnx", tmp_path / "merged", [root / "adapter"])
    doc = json.loads((tmp_path / "merged" / names.HEAD_IMPORTANCE_FILE).read_text())
    assert doc["layers"] == json.loads((root / "adapter" / names.HEAD_GATES_FILE).read_text())["layers"]

    # the reference: PEFT's model with the saved gates hooked on, as in training
    base = transformers.AutoModelForCausalLM.from_pretrained(root / "base").eval()
    model = peft.PeftModel.from_pretrained(base, root / "adapter").eval()
    att = find_decoder_attention(base)
    gates = HeadGates(len(att.modules), att.heads)
    with torch.no_grad():
        gates.logits.copy_(torch.logit(torch.tensor([e["score"] for e in doc["layers"]]).clamp(1e-6, 1 - 1e-6)))
        gates.closed.copy_(torch.tensor([[h in e["closed"] for h in range(att.heads)] for e in doc["layers"]]))
    ids = np.array([[1, 7, 12, 30, 9, 44, 3], [1, 20, 21, 22, 23, 24, 3]], np.int64)
    with torch.no_grad(), gates_applied(base, att, gates):
        ref = model(torch.tensor(ids)).logits.numpy()
    with torch.no_grad():
        ungated = model(torch.tensor(ids)).logits.numpy()
    got = _onnx_logits(tmp_path / "merged", ids, 2, 2, att.head_dim)
    scale = np.abs(ref).max()
    assert np.abs(got - ref).max() / scale < 1e-5
    assert np.abs(ungated - ref).max() / scale > 1e-2  # the gates change what the model computes
    # a closed head's o_proj input columns are exactly zero in the merged graph
    import onnx
    from onnx import numpy_helper

    dec = onnx.load(str(tmp_path / "merged" / "decoder_model_merged.onnx"))
    w = {i.name: numpy_helper.to_array(i) for i in dec.graph.initializer if "layers.0.self_attn.o_proj" in i.name}
    (o_proj,) = [v for v in w.values() if v.ndim == 2]
    for h in doc["layers"][0]["closed"]:
        cols = slice(h * att.head_dim, (h + 1) * att.head_dim)
        block = o_proj[:, cols] if o_proj.shape[1] == att.heads * att.head_dim else o_proj[cols, :]
        assert not block.any()


def test_gated_adapters_cannot_be_stacked_or_weighted(tuned, tmp_path):
    from edgekit.hf import convert_hf

    root, _ = tuned
    convert_hf(root / "base", tmp_path / "onnx")
    with pytest.raises(AdapterError, match="at most one"):
        merge_lora(tmp_path / "onnx", tmp_path / "m1", [root / "adapter", root / "adapter"])
    with pytest.raises(AdapterError, match="weight 1.0 only"):
        merge_lora(tmp_path / "onnx", tmp_path / "m2", [root / "adapter"], [0.5])
    bad = tmp_path / "bad"
    shutil.copytree(root / "adapter", bad)
    doc = json.loads((bad / names.HEAD_GATES_FILE).read_text())
    doc["layers"][1]["head_dim"] = 8
    (bad / names.HEAD_GATES_FILE).write_text(json.dumps(doc))
    with pytest.raises(AdapterError, match=r"model.layers.1.self_attn.o_proj takes 64 inputs, the gates cover 32"):
        merge_lora(tmp_path / "onnx", tmp_path / "m3", [bad])
    assert not any((tmp_path / m).exists() for m in ("m1", "m2", "m3"))


def test_x1_bundle_of_a_gated_smolvlm_skips_the_closed_heads(tmp_path):
    from PIL import Image

    from edgekit.ingest import Study
    from edgekit.reporter import Reporter

    vlm = make_idefics3(tmp_path / "hf", family="smolvlm", seed=3)
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (40, 40), dtype=np.uint8)).save(tmp_path / "img.png")
    rows = [{"prompt": f"w{i} w{i + 1}", "completion": f"w{i + 2} w{i + 3} w{i + 4}"} for i in range(24)]
    shutil.copytree(importlib.resources.files("edgekit.models") / "samples" / "ct_chest", tmp_path / "ct")
    rows += [{"image": "img.png", **r} for r in rows[:8]] + [{"image": "ct", **r} for r in rows[8:12]]
    write_jsonl(tmp_path / "train.jsonl", rows)
    # an image record is laid out as the bundle will serve it: the span at the template's slot, after 'User:'
    from edgekit.finetune.data import read_dataset
    from edgekit.finetune.trainer import load_model

    _model, _kind, tok, spec = load_model(vlm.path)
    ex = read_dataset(tmp_path / "train.jsonl", tok, 256, vlm=True).examples[24]
    user = ex.input_ids.index(3)  # "User:"
    assert ex.input_ids[user + 1 : user + 1 + len(spec.span_ids)] == list(spec.span_ids)
    # a DICOM series is read through edgekit's ingest, as the daemon reads it: the middle slice, display values
    from edgekit.finetune.data import load_grey
    from edgekit.ingest import load_study

    ct = load_grey(tmp_path / "ct", spec.image_size)
    assert ct.shape == (spec.image_size, spec.image_size) and 0.0 <= ct.min() < ct.max() <= 1.0
    frames = load_study(tmp_path / "ct").frames
    assert abs(float(ct.mean()) - float(frames[len(frames) // 2].mean())) < 0.05
    result = finetune(vlm.path, tmp_path / "train.jsonl", tmp_path / "ad", OPTS)
    assert result["data"]["layout"] == "image+prompt+completion, prompt+completion"
    assert result["gates"]["closed"] == 4
    recipe = tmp_path / "gated.toml"
    recipe.write_text(f'name = "gated"\n[[pass]]\nname = "lora"\nadapters = ["{tmp_path / "ad"}"]\n')
    out = tmp_path / "x1"
    argv = ["build", str(vlm.path), "--target", "x1", "-o", str(out), "--no-parity", "--recipe", str(recipe)]
    assert app_module.main(argv) == 0
    shipped = json.loads((out / names.HEAD_IMPORTANCE_FILE).read_text())
    assert sum(len(e["closed"]) for e in shipped["layers"]) == 4
    reporter = Reporter.from_bundle(out, threads=1)
    study = Study(rng.uniform(0, 1, (3, 64, 64)).astype(np.float32), modality="CT", uid_hash="uid:t", source="dicom")
    report = reporter.report(study, "w7", reporter.options(max_new_tokens=8))
    dss = report.cost["dss"]
    # budget floor(0.38 * 8) = 3 heads a token, all found among the 4 closed ones (c = g * r = 0 < 0.015)
    assert dss["budget_heads_per_token"] == 3
    assert dss["heads_skipped"] == 3 * (dss["tokens"] - 1) and report.cost["skip_rate"] > 0.25


def test_bad_data_is_listed_by_line_and_nothing_is_written(tuned, tmp_path, capsys):
    root, _ = tuned
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "w1 w2"}\n{oops\n{"prompt": "w1"}\n{"image": "x.png", "prompt": "a", "completion": "b"}\n')
    capsys.readouterr()
    rc = app_module.main(["finetune", str(root / "base"), "--data", str(bad), "-o", str(tmp_path / "o")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert rc == 2 and len(err) == 1
    assert "bad.jsonl" in err[0] and "3 bad line(s)" in err[0]
    assert "line 2: not JSON" in err[0] and "line 3: 'completion' must be a non-empty string" in err[0]
    assert "line 4: 'image' given, but the model has no vision tower" in err[0]
    assert not (tmp_path / "o").exists()
    rc = app_module.main(["finetune", str(root / "base"), "--data", str(bad), "-o", str(tmp_path / "o"), "--json"])
    assert rc == 2 and json.loads(capsys.readouterr().out)["error"]["code"]


def test_optimize_cli_writes_the_gates_beside_the_merged_graphs(tuned, tmp_path):
    from edgekit.hf import convert_hf

    root, _ = tuned
    convert_hf(root / "base", tmp_path / "onnx")
    argv = [
        "optimize",
        str(tmp_path / "onnx"),
        "-o",
        str(tmp_path / "m"),
        "--pass",
        f"lora:adapters={root / 'adapter'}",
    ]
    assert app_module.main(argv) == 0
    shipped = json.loads((tmp_path / "m" / names.HEAD_IMPORTANCE_FILE).read_text())
    gates = json.loads((root / "adapter" / names.HEAD_GATES_FILE).read_text())
    assert shipped["layers"] == gates["layers"]


def test_the_same_seed_gives_the_same_adapter_and_gates(tuned, tmp_path):
    root, _ = tuned
    opts = FinetuneOptions(steps=6, batch_size=4, gate_rate=0.25, threads=1, seed=5)
    for run in ("a", "b"):
        finetune(root / "base", root / "train.jsonl", tmp_path / run, opts)
    for name in ("adapter_model.safetensors", names.HEAD_GATES_FILE):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


@pytest.mark.parametrize("case", ["embedded", "no-data"])
def test_wrong_model_or_missing_data_is_one_line_before_any_loading(tuned, tmp_path, capsys, case):
    from edgekit.build import default_model_dir

    root, _ = tuned
    model, data = (default_model_dir(), root / "train.jsonl") if case == "embedded" else (root / "base", tmp_path / "x")
    capsys.readouterr()
    assert app_module.main(["finetune", str(model), "--data", str(data), "-o", str(tmp_path / "o")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    want = "not a Hugging Face model directory" if case == "embedded" else "fine-tuning data not found"
    assert len(err) == 1 and want in err[0] and not (tmp_path / "o").exists()


def test_image_records_of_a_split_smolvlm_feed_its_tiles(tmp_path):
    """With Idefics3's image splitting the span holds every tile's tokens; the pixel values must be the tiles and
    the global image in the processor's order, or transformers refuses the batch."""
    vlm = make_idefics3(tmp_path / "hf", family="smolvlm", seed=3, tiles=2)
    write_image_records(tmp_path, 16)
    opts = FinetuneOptions(steps=4, batch_size=4, gate_rate=0.25, threads=1)
    result = finetune(vlm.path, tmp_path / "t.jsonl", tmp_path / "ad", opts)
    assert result["data"]["layout"] == "image+prompt+completion" and result["gates"]["closed"] == 2
    assert np.isfinite(result["last_loss"])


def test_image_records_of_a_llava_next_pass_its_image_sizes(tmp_path):
    """LLaVA-NeXT's forward needs `image_sizes` beside the pixel values (its anyres packing reads them)."""
    from hf_vlm_factory import make_llava_next

    vlm = make_llava_next(tmp_path / "hf", seed=1)
    write_image_records(tmp_path, 8)
    opts = FinetuneOptions(steps=2, batch_size=4, gate_rate=0.25, threads=1)
    result = finetune(vlm.path, tmp_path / "t.jsonl", tmp_path / "ad", opts)
    assert result["data"]["layout"] == "image+prompt+completion" and np.isfinite(result["last_loss"])
