"""Qwen2-VL and Qwen2.5-VL at one fixed square resolution: edgekit's graphs against transformers'
`Qwen2VLForConditionalGeneration` / `Qwen2_5_VLForConditionalGeneration` (random init from configs, nothing
downloaded), fed what its own image processor and chat template give for the same frame; `edgekit.positions`
against transformers' `get_rope_index` (left padding, decode steps); a cpu bundle served by `edgekit run`; x1 and
orin builds; the refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("jinja2")

from hf_vlm_factory import make_qwen2_vl, qwen2_vl_inputs  # noqa: E402

from edgekit.cli import app as app_module  # noqa: E402
from edgekit.errors import EdgekitError  # noqa: E402
from edgekit.generate import GenerationOptions, generate, generate_batch, place_image  # noqa: E402
from edgekit.hf import convert_hf  # noqa: E402
from edgekit.hf.parity import hf_pixel_values  # noqa: E402
from edgekit.ingest import Study  # noqa: E402
from edgekit.ort import CpuBackend  # noqa: E402
from edgekit.positions import POSITIONS_KEY, PositionScheme, for_rank  # noqa: E402
from edgekit.reporter import Reporter  # noqa: E402

TOL = 1e-4  # relative to the largest logit


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def qwen(tmp_path_factory, request):
    """The tiny model (56 px: an 8 x 8 patch grid, 16 image tokens), converted once per family (Qwen2.5-VL with
    windows of 3 x 3 merge units over its 4 x 4: uneven windows, full attention in its last block)."""
    root = tmp_path_factory.mktemp(request.param)
    vlm = make_qwen2_vl(root / "hf", family=request.param, window=42)
    result = convert_hf(root / "hf", root / "onnx")
    return vlm, result.spec, CpuBackend.from_dir(root / "onnx", intra_op_threads=1), root


def _hf_rope_index(vlm, ids: torch.Tensor, mask: torch.Tensor, grids: int):
    tt = (ids == vlm.image_token_id).int()
    grid = torch.tensor([[1, 8, 8]] * grids)
    return vlm.model.model.get_rope_index(ids, tt, image_grid_thw=grid, attention_mask=mask)


def test_positions_are_get_rope_index_with_left_padding_and_decode_steps(qwen):
    """Prefill positions (3, batch, seq) and rope_deltas as transformers computes them for left-padded rows with
    the image at different slots, and each decode step's position as its generate() feeds it
    (attention-mask count + rope_deltas, on all three axes)."""
    vlm, spec, _, _ = qwen
    span, scheme = spec.span_length, spec.positions
    assert scheme.kind == "mrope" and scheme.grid == (1, 4, 4) and span == 16
    rows = [(0, 3, 5), (2, 1, 9), (4, 6, 0)]  # (left padding, text before the image, text after it)
    seq = max(p + b + span + a for p, b, a in rows)
    ids, mask, slots = np.zeros((3, seq), np.int64), np.zeros((3, seq), np.int64), []
    for r, (pad, before, after) in enumerate(rows):
        pad += seq - (pad + before + span + after)
        text = 7 + np.arange(before + after)
        ids[r, pad:] = [*text[:before], *[vlm.image_token_id] * span, *text[before:]]
        mask[r, pad:] = 1
        slots.append(pad + before)
    ref, deltas = _hf_rope_index(vlm, torch.tensor(ids), torch.tensor(mask), 3)
    got, nxt = scheme.prefill(mask, slots, span)
    np.testing.assert_array_equal(got, ref.numpy())
    # the next position is transformers' rope_deltas added to the kept token count
    np.testing.assert_array_equal((nxt - mask.sum(-1))[:, None], deltas.numpy())
    # the image's rows and columns: start + (row, col) on the height / width axes, text after it resumes at +4
    at = slots[0]  # row 0: 3 text tokens before the image
    assert got[1, 0, at : at + span].tolist() == [3 + i // 4 for i in range(span)]
    assert got[2, 0, at : at + span].tolist() == [3 + i % 4 for i in range(span)]
    assert got[:, 0, at + span].tolist() == [7, 7, 7]
    for _ in range(3):  # decode: transformers' (mask.cumsum - 1)[last] + rope_deltas
        mask = np.concatenate([mask, np.ones((3, 1), np.int64)], axis=1)
        theirs = (mask.cumsum(-1) - 1)[:, -1:] + deltas.numpy()
        np.testing.assert_array_equal(scheme.step(nxt), np.broadcast_to(theirs, (3, 3, 1)))
        nxt = nxt + 1
    # an image that ends the prompt: the next token is still the largest position + 1 on every axis
    _, nxt = scheme.prefill(np.ones((1, 2 + span), np.int64), 2, span)
    assert nxt.tolist() == [2 + 4]
    text_only, nxt = scheme.prefill(np.ones((1, 5), np.int64))
    assert text_only.shape == (3, 1, 5) and (text_only == np.arange(5)).all() and nxt.tolist() == [5]
    with pytest.raises(EdgekitError, match="M-RoPE grid"):
        scheme.prefill(np.ones((1, 20), np.int64), 0, 12)
    assert PositionScheme.of({}).kind == "text" and PositionScheme.of({POSITIONS_KEY: scheme.to_dict()}) == scheme


def test_pixel_values_are_the_image_processors(qwen):
    """The vision graph's patch order and temporal copies: hf_pixel_values (what the graph computes, as numpy) is
    Qwen2VLImageProcessor's own pixel_values for the 8-bit frame at the fixed side, resize (BICUBIC) on."""
    vlm, spec, _, _ = qwen
    image = np.random.default_rng(0).integers(0, 256, (56, 56)).astype(np.uint8)
    out = qwen2_vl_inputs(vlm, image, "w1")
    assert out["image_grid_thw"].tolist() == [[1, 8, 8]]
    np.testing.assert_allclose(hf_pixel_values(spec, image / np.float32(255)), out["pixel_values"].numpy(), atol=2e-6)


def _served_cases(vlm, spec, backend, root, cases: int, new_tokens: int = 6):
    """Per case: the processor's input_ids against edgekit's prompt layout with the span at its slot, the prefill
    logits (relative error) and greedy tokens, transformers fed its processor's own inputs."""
    from tokenizers import Tokenizer

    from edgekit.hf.serving import generation_config
    from edgekit.prompt import prompt_layout

    tok = Tokenizer.from_file(str(vlm.path / "tokenizer.json"))
    gen = generation_config(spec, vlm.path, tok)
    rng = np.random.default_rng(3)
    errors, same = [], 0
    for _ in range(cases):
        prompt = " ".join(f"w{int(w)}" for w in rng.integers(0, 100, 4))
        image = rng.integers(0, 256, (spec.image_size, spec.image_size)).astype(np.uint8)
        hf = qwen2_vl_inputs(vlm, image, prompt)
        layout = prompt_layout(tok, gen, "", prompt)
        ours_ids = [*layout.ids[: layout.image_slot], *spec.span_ids, *layout.ids[layout.image_slot :]]
        assert ours_ids == hf["input_ids"][0].tolist()
        with torch.no_grad():
            ref = vlm.model(**hf).logits[0].numpy()
            theirs = vlm.model.generate(**hf, max_new_tokens=new_tokens, do_sample=False)[0, len(ours_ids) :]
        pixels = (image / np.float32(255))[None, None, None]
        text = np.asarray([layout.ids], np.int64)
        x, mask = place_image(backend.embed(text), np.ones_like(text), backend.encode_images(pixels), layout.image_slot)
        logits, _ = backend.decode(x, mask, spec.positions.prefill(mask, layout.image_slot, spec.span_length)[0], None)
        assert np.abs(ref).max() > 0.5
        errors.append(float(np.abs(logits[0] - ref).max() / np.abs(ref).max()))
        ours = generate(
            backend,
            pixels,
            text,
            GenerationOptions(max_new_tokens=new_tokens),
            image_slot=layout.image_slot,
            positions=spec.positions,
        ).token_ids
        same += ours == theirs.tolist()
    return max(errors), same


def test_logits_and_greedy_match_transformers_fed_its_processor(qwen):
    vlm, spec, backend, root = qwen
    err, same = _served_cases(vlm, spec, backend, root, cases=3)
    assert err <= TOL and same == 3


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_second_size_tied_embeddings_matches(tmp_path, family):
    """Another fixed side (84 px: a 12 x 12 grid, 36 image tokens, a 6 x 6 M-RoPE grid; Qwen2.5-VL: windows of
    4 x 4 merge units, so 4 + 2 per side) and tied embeddings."""
    vlm = make_qwen2_vl(tmp_path / "hf", side=84, tied=True, seed=1, family=family, window=56)
    spec = convert_hf(tmp_path / "hf", tmp_path / "onnx").spec
    assert spec.span_length == 36 and spec.positions.grid == (1, 6, 6)
    assert spec.decoder.lm_head == spec.decoder.embed_tokens
    err, same = _served_cases(vlm, spec, CpuBackend.from_dir(tmp_path / "onnx", intra_op_threads=1), tmp_path, 2)
    assert err <= TOL and same == 2


def test_qwen2_5_vl_windows_are_transformers_window_index(tmp_path):
    """The vision graph's window permutation, block mask and gather back: its features are transformers'
    `get_image_features` for the processor's pixels, and the windows matter (the same model attending over the
    whole image in every block answers differently)."""
    vlm = make_qwen2_vl(tmp_path / "hf", side=84, family="qwen2_5_vl", window=56)
    spec = convert_hf(tmp_path / "hf", tmp_path / "onnx").spec
    assert spec.tower.window == 4 and spec.tower.full_attention == (1,)
    gray = np.random.default_rng(2).uniform(0, 1, (84, 84)).astype(np.float32)
    ours = CpuBackend.from_dir(tmp_path / "onnx", intra_op_threads=1).encode_images(gray[None, None, None])[0]
    pixels, grid = torch.tensor(hf_pixel_values(spec, gray)), torch.tensor([[1, 12, 12]])
    with torch.no_grad():
        theirs = vlm.model.model.get_image_features(pixels, grid).pooler_output[0].numpy()
        vlm.model.model.visual.fullatt_block_indexes = [0, 1]
        whole = vlm.model.model.get_image_features(pixels, grid).pooler_output[0].numpy()
    scale = np.abs(theirs).max()
    assert np.abs(ours - theirs).max() / scale <= 1e-5 and np.abs(whole - theirs).max() / scale > 1e-2


def test_batch_with_left_padding_generates_each_row_as_alone(qwen):
    """generate_batch's M-RoPE prefill and decode positions for left-padded rows: each row's tokens are the ones
    it gets alone (its positions do not count the padding)."""
    vlm, spec, backend, _ = qwen
    rng = np.random.default_rng(5)
    pixels = rng.uniform(0, 1, (2, 1, 1, 56, 56)).astype(np.float32)
    rows = [[1, 7, 8, 9, 5], [1, 7, 5]]
    opts = GenerationOptions(max_new_tokens=5)
    alone = [
        generate(backend, pixels[i : i + 1], [r], opts, image_slot=2, positions=spec.positions).token_ids
        for i, r in enumerate(rows)
    ]
    ids = np.asarray([rows[0], [0, 0, *rows[1]]], np.int64)
    mask = np.asarray([[1] * 5, [0, 0, 1, 1, 1]], np.int64)
    batch = generate_batch(backend, pixels, ids, opts, mask, image_slot=[2, 4], positions=spec.positions)
    assert [r.token_ids for r in batch] == alone


def test_cpu_bundle_is_served_by_edgekit_run_as_transformers_answers(tmp_path, qwen, capsys):
    """`edgekit build --target cpu` (its parity figure measured against transformers), then `edgekit run`: the
    report is transformers' greedy text for the frame the bundle serves, with M-RoPE placed by the bundle's
    record and no code of the runner's own."""
    vlm, spec, _, _ = qwen
    out = tmp_path / "bundle"
    assert app_module.main(["build", str(vlm.path), "--target", "cpu", "-o", str(out), "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)["figures"]
    assert figures["parity"]["greedy_identical"] == 1.0 and figures["parity"]["max_rel_logit_error"] <= TOL
    cfg = json.loads((out / "config.json").read_text())
    assert cfg[POSITIONS_KEY] == {"kind": "mrope", "grid": [1, 4, 4]} and cfg["image_tokens"] == 16
    gen = json.loads((out / "generation_config.json").read_text())
    assert (
        gen["image_token"] == "<|image_pad|>"
        and "<|vision_start|><|image_pad|><|vision_end|>" in gen["prompt_template"]
    )
    pre = json.loads((out / "preprocessor_config.json").read_text())
    assert pre["image_size"] == 56 and pre["fixed_resolution"]["image_grid_thw"] == [1, 8, 8]
    assert pre["hf_image_processor"]["resample"] == 3  # BICUBIC, recorded
    frames = np.random.default_rng(0).uniform(0, 1, (1, 112, 112)).astype(np.float32)
    reporter = Reporter.from_bundle(out, threads=1)
    study = Study(frames, modality="CT", uid_hash="uid:t", source="dicom")
    served = reporter.pixel_values(study)[0, 0, 0]
    report = reporter.report(study, "w3 w4", reporter.options(max_new_tokens=6))
    layout = reporter.prompt("CT", "w3 w4")
    ids = torch.tensor([[*layout.ids[: layout.image_slot], *spec.span_ids, *layout.ids[layout.image_slot :]]])
    hf = {
        "input_ids": ids,
        "pixel_values": torch.tensor(hf_pixel_values(spec, served)),
        "image_grid_thw": torch.tensor([[1, 8, 8]]),
        "mm_token_type_ids": (ids == vlm.image_token_id).int(),
    }
    with torch.no_grad():
        theirs = vlm.model.generate(**hf, max_new_tokens=6, do_sample=False)[0, ids.shape[1] :].tolist()
    assert report.text == reporter.tokenizer.decode(theirs, skip_special_tokens=True).strip()
    capsys.readouterr()
    assert (
        app_module.main(["run", str(out), "-s", _sample("cr_chest"), "-p", "w3 w4", "--max-new-tokens", "4", "--json"])
        == 0
    )
    got = json.loads(capsys.readouterr().out)
    assert got["target"] == "cpu" and got["timings"]["new_tokens"] == 4
    # the orin estimate sizes the tower at the fixed side: every patch through its blocks, 2 x 2 merged into tokens
    from edgekit.targets.orin.estimate import read_bundle

    shape = read_bundle(out)[0]
    text = vlm.model.config.text_config
    assert (shape.hidden, shape.layers, shape.vocab) == (text.hidden_size, text.num_hidden_layers, text.vocab_size)
    assert shape.vision.patches == 64 and shape.vision.image_tokens == spec.span_length == 16
    assert shape.vision.hidden == spec.tower.hidden and shape.vision.layers == spec.tower.layers
    # calibration feeds (INT4's): the bundle's M-RoPE positions around the image at the template's slot
    from edgekit.passes.calibration import record_decoder_feeds

    feed = record_decoder_feeds(out, 1)[0]
    seq, slot = feed["inputs_embeds"].shape[1], reporter.prompt("CT", "").image_slot
    expected = spec.positions.prefill(np.ones((1, seq), np.int64), slot, spec.span_length)[0]
    np.testing.assert_array_equal(feed["position_ids"], expected)


def _sample(name: str) -> str:
    from pathlib import Path

    return str(Path(__file__).resolve().parents[1] / "models" / "samples" / name)


def test_x1_bundle_feeds_mrope(tmp_path, qwen, capsys):
    """The x1 build compiles all three graphs with no host partition (the vision rotary tables and M-RoPE's slices
    lowered), and its emulator honours M-RoPE: its prefill logits stay far closer to ONNX Runtime's on the
    same INT4 graphs with the M-RoPE positions than with text positions on the three axes."""
    from edgekit.bundle import load_bundle
    from edgekit.plugins import load_backend
    from edgekit.target import RuntimeOptions

    vlm, spec, _, _ = qwen
    out = tmp_path / "x1"
    assert app_module.main(["build", str(vlm.path), "--target", "x1", "-o", str(out), "--no-parity"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert set(manifest["figures"]["x1_compile"]["host_partitions"].values()) == {0}
    x1 = load_backend(load_bundle(out), RuntimeOptions(threads=1))
    ort = CpuBackend.from_dir(out, intra_op_threads=1)
    pixels = np.random.default_rng(1).uniform(0, 1, (1, 1, 1, 56, 56)).astype(np.float32)
    ids = np.asarray([[1, 7, 8, 9, 10, 11, 5]], np.int64)
    x, mask = place_image(ort.embed(ids), np.ones_like(ids), ort.encode_images(pixels), 3)
    pos = spec.positions.prefill(mask, 3, spec.span_length)[0]
    text = for_rank(np.arange(mask.shape[1])[None], 3)
    ref = ort.decode(x, mask, pos, None)[0]
    rel = lambda a: float(np.abs(a - ref).max() / np.abs(ref).max())  # noqa: E731
    assert rel(x1.decode(x, mask, pos, None)[0]) < 0.5 * rel(x1.decode(x, mask, text, None)[0])
    # without its KV cache the emulator recomputes the whole sequence: positions grow along their last axis
    dense = load_backend(load_bundle(out), RuntimeOptions(threads=1, settings={"kv_caching": False}))
    opts = GenerationOptions(max_new_tokens=4)
    cached, recomputed = (generate(be, pixels, ids, opts, image_slot=3, positions=spec.positions) for be in (x1, dense))
    assert recomputed.token_ids == cached.token_ids and len(cached.token_ids) == 4
    report = Reporter.from_bundle(out, threads=1).report(_sample("cr_chest"), "w3", GenerationOptions(max_new_tokens=3))
    # the analytic estimate sizes the bundle's language model (text_config), not edgekit's own defaults
    capsys.readouterr()
    assert app_module.main(["x1", "estimate", str(out), "--json"]) == 0
    text = vlm.model.config.text_config
    model = json.loads(capsys.readouterr().out)["model"]
    assert (model["hidden"], model["layers"], model["vocab"]) == (text.hidden_size, text.num_hidden_layers, 160)
    assert report.target == "x1" and report.timings["new_tokens"] >= 1 and report.energy_source == "emulated:x1"


def test_orin_build_profiles_take_mrope_positions(tmp_path, qwen):
    """orin's build side here: capability check, FP16 graphs, TensorRT profiles with position_ids (3, batch,
    seq), reference inputs; the graphs served by its ONNX Runtime backend (the engines need TensorRT, absent)."""
    from edgekit.bundle import load_bundle
    from edgekit.targets.orin.onnx_backend import OrinOnnxBackend

    vlm, _, _, _ = qwen
    out = tmp_path / "orin"
    assert app_module.main(["build", str(vlm.path), "--target", "orin", "-o", str(out), "--no-parity"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    cap = manifest["figures"]["orin_capability"]
    assert cap["supported_nodes"] == cap["nodes"]
    profiles = manifest["runtime"]["profiles"]["decoder"]
    prefill, decode = (p["shapes"]["position_ids"] for p in profiles)
    assert prefill["min"][0] == prefill["max"][0] == 3 and decode["max"] == [3, 8, 1]
    assert manifest["figures"]["orin_parity"]["vs_fp32_export"]["decoder:decode"]["logits_top1"] == 1
    bundle = load_bundle(out)
    reporter = Reporter(bundle, backend=OrinOnnxBackend(bundle, intra_op_threads=1))
    assert reporter.report(_sample("cr_chest"), "w3", GenerationOptions(max_new_tokens=3)).timings["new_tokens"] >= 1


def _convert_refused(hf, tmp_path, capsys) -> str:
    capsys.readouterr()
    assert app_module.main(["convert", str(hf), "-o", str(tmp_path / "onnx")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and not (tmp_path / "onnx").exists()
    return errors[0]


def test_dynamic_resolution_is_refused_naming_the_fix(tmp_path, qwen, capsys):
    """The processor's stock min_pixels < max_pixels: a grid per image size, refused in one line that says why and
    how to pin it; an explicit other size is served at that size."""
    vlm, _, _, _ = qwen
    hf = tmp_path / "hf"
    shutil.copytree(vlm.path, hf)
    pre = json.loads((hf / "preprocessor_config.json").read_text())
    pre["size"] = {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280}
    (hf / "preprocessor_config.json").write_text(json.dumps(pre))
    err = _convert_refused(hf, tmp_path, capsys)
    assert "preprocessor_config.json" in err and "dynamic resolution" in err and "min_pixels = max_pixels" in err
    assert "pass --image-size S (a multiple of 14" in err  # the library's `image_size`, named as the CLI's flag
    pre["size"] = {"shortest_edge": 70 * 70, "longest_edge": 70 * 70}  # 70 px: not a multiple of 14 -> 70 rounds
    (hf / "preprocessor_config.json").write_text(json.dumps(pre))
    assert convert_hf(hf, tmp_path / "o70").spec.image_size == 70  # smart_resize: round(70/14)*14 = 70


CONFIG_EDITS = {
    "section": lambda c: c["text_config"]["rope_parameters"].update(mrope_section=[2, 3, 4]),
    "vision_rope": lambda c: c["vision_config"].update(rope_parameters=[10000]),
    "rope_theta": lambda c: c["vision_config"].update(rope_parameters={"rope_theta": "1e4"}),
    "text_config": lambda c: c.update(text_config="qwen2"),
}


HUB_DYNAMIC = {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 1280}  # the stock Qwen2-VL-2B-Instruct's range


def _dynamic_copy(vlm, dest):
    """The model directory as the Hub ships it: min_pixels < max_pixels (dynamic resolution)."""
    shutil.copytree(vlm.path, dest)
    pre = json.loads((dest / "preprocessor_config.json").read_text())
    pre.update(
        HUB_DYNAMIC, size={"shortest_edge": HUB_DYNAMIC["min_pixels"], "longest_edge": HUB_DYNAMIC["max_pixels"]}
    )
    (dest / "preprocessor_config.json").write_text(json.dumps(pre))
    return dest


def _digest(folder) -> str:
    import hashlib

    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        h.update(str(p.relative_to(folder)).encode())
        h.update(p.read_bytes() if p.is_file() else b"/")
    return h.hexdigest()


def _processor(settings: dict, where):
    """transformers' own image processor rebuilt from a preprocessor_config.json's settings."""
    where.mkdir()
    (where / "preprocessor_config.json").write_text(json.dumps(settings))
    return transformers.AutoImageProcessor.from_pretrained(where)


def test_image_size_builds_a_dynamic_download_served_as_transformers_answers(tmp_path, qwen, capsys):
    """`edgekit build HF_DIR --image-size 70` on a dynamic-resolution directory: the graphs, the M-RoPE grid and
    the build's parity check at 70 px; the bundle's recorded processor pinned (min_pixels = max_pixels = 70*70),
    so transformers' processor built from it gives the grid and pixels the graph takes; `edgekit run` answers as
    transformers fed that processor's inputs; the user's directory is left as it was."""
    from edgekit.ingest import load_study

    from ingest_factory import make_dataset, save

    vlm, _, _, _ = qwen
    hf = _dynamic_copy(vlm, tmp_path / "hf")
    before = _digest(hf)
    out = tmp_path / "bundle"
    argv = ["build", str(hf), "--target", "cpu", "-o", str(out), "--image-size", "70", "--json"]
    assert app_module.main(argv) == 0
    figures = json.loads(capsys.readouterr().out)["figures"]
    assert figures["parity"]["greedy_identical"] == 1.0 and figures["parity"]["max_rel_logit_error"] <= TOL
    cfg = json.loads((out / "config.json").read_text())
    assert cfg[POSITIONS_KEY] == {"kind": "mrope", "grid": [1, 5, 5]} and cfg["image_tokens"] == 25
    pre = json.loads((out / "preprocessor_config.json").read_text())
    assert pre["image_size"] == 70 and pre["fixed_resolution"]["image_grid_thw"] == [1, 10, 10]
    record = pre["hf_image_processor"]
    assert record["min_pixels"] == record["max_pixels"] == 70 * 70
    assert record["size"] == {"shortest_edge": 70 * 70, "longest_edge": 70 * 70}
    proc = _processor(record, tmp_path / "proc")
    image = np.random.default_rng(6).integers(0, 256, (70, 70)).astype(np.uint8)
    image[0, :2] = (0, 255)  # the study's min-max display mapping is then image / 255
    study = save(make_dataset(image), tmp_path / "study.dcm")
    capsys.readouterr()
    argv = ["run", str(out), "-s", str(study), "-p", "w3 w4", "--max-new-tokens", "6", "--json"]
    assert app_module.main(argv) == 0
    answer = json.loads(capsys.readouterr().out)["text"]
    assert len(answer.split()) >= 3  # words of the random model's vocabulary, not an empty report
    reporter = Reporter.from_bundle(out, threads=1)
    served = reporter.pixel_values(load_study(study))[0, 0, 0]
    np.testing.assert_allclose(served, image / np.float32(255), atol=1e-6)
    theirs = proc(images=[np.repeat(image[:, :, None], 3, axis=-1)], return_tensors="pt")
    assert theirs["image_grid_thw"].tolist() == [[1, 10, 10]]
    other = proc(images=[np.zeros((112, 112, 3), np.uint8)], return_tensors="pt")["image_grid_thw"]
    assert other.tolist() == [[1, 10, 10]]  # pinned: any square image to 70 px (the directory's range kept 112)
    n = int(theirs["image_grid_thw"].prod()) // 4
    layout = reporter.prompt("CT", "w3 w4")
    ids = torch.tensor(
        [[*layout.ids[: layout.image_slot], *[vlm.image_token_id] * n, *layout.ids[layout.image_slot :]]]
    )
    hf_in = {**theirs, "input_ids": ids, "mm_token_type_ids": (ids == vlm.image_token_id).int()}
    with torch.no_grad():
        tokens = vlm.model.generate(**hf_in, max_new_tokens=6, do_sample=False)[0, ids.shape[1] :].tolist()
    assert answer == reporter.tokenizer.decode(tokens, skip_special_tokens=True).strip()
    assert _digest(hf) == before


def test_convert_image_size_writes_the_pinned_processor_beside_the_graphs(tmp_path, qwen, capsys):
    """`edgekit convert --image-size`: the preprocessor_config.json beside the graphs is pinned to the side, and
    transformers' processor loaded from that folder gives the vision graph's input (its pixels feed the model's
    own image features, which the graph returns for the same frame)."""
    vlm, _, _, _ = qwen
    hf = _dynamic_copy(vlm, tmp_path / "hf")
    before = _digest(hf)
    out = tmp_path / "onnx"
    assert app_module.main(["convert", str(hf), "--image-size", "42", "-o", str(out), "--json"]) == 0
    capsys.readouterr()
    pre = json.loads((out / "preprocessor_config.json").read_text())
    assert pre["min_pixels"] == pre["max_pixels"] == 42 * 42 and pre["patch_size"] == 7
    proc = transformers.AutoImageProcessor.from_pretrained(out)
    image = np.random.default_rng(7).integers(0, 256, (42, 42)).astype(np.uint8)
    theirs = proc(images=[np.repeat(image[:, :, None], 3, axis=-1)], return_tensors="pt")
    assert theirs["image_grid_thw"].tolist() == [[1, 6, 6]]
    ours = CpuBackend.from_dir(out, intra_op_threads=1).encode_images((image / np.float32(255))[None, None, None])[0]
    with torch.no_grad():
        features = vlm.model.model.get_image_features(theirs["pixel_values"], theirs["image_grid_thw"])
    ref = features.pooler_output[0].numpy()
    assert ours.shape == (9, ref.shape[-1]) and np.abs(ours - ref).max() / np.abs(ref).max() <= 1e-5
    assert _digest(hf) == before


def _refused_json(argv, capsys) -> dict:
    capsys.readouterr()
    assert app_module.main([*argv, "--json"]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in err
    error = json.loads(out)["error"]
    assert error["code"] == "invalid_config" and error["message"] in lines[0]
    return error


def test_image_size_refusals_are_one_line_and_json(tmp_path, qwen, capsys):
    """A side that is not a multiple of patch * merge (naming the flag and the nearest valid sides); the flag on a
    LLaVA directory, a plain decoder and edgekit's own model (saying what sets their side): one line, exit 2,
    JSON with --json, nothing written, the model directory unchanged."""
    from finetune_factory import make_llama
    from hf_vlm_factory import make_llava

    vlm, _, _, _ = qwen
    hf = _dynamic_copy(vlm, tmp_path / "hf")
    before = _digest(hf)
    for cmd in ("build", "convert"):
        error = _refused_json([cmd, str(hf), "--image-size", "60", "-o", str(tmp_path / cmd)], capsys)
        assert "--image-size 60 is not a multiple of patch_size * merge_size = 14" in error["message"]
        assert "the nearest valid sides: 56 or 70" in error["message"] and not (tmp_path / cmd).exists()
    assert _digest(hf) == before
    llava = make_llava(tmp_path / "llava").path
    before = _digest(llava)
    for cmd in ("build", "convert"):
        error = _refused_json([cmd, str(llava), "--image-size", "56", "-o", str(tmp_path / cmd)], capsys)
        assert "--image-size pins Qwen2-VL's dynamic resolution" in error["message"]
        assert "does not apply to llava: its side is the vision tower's vision_config.image_size" in error["message"]
        assert not (tmp_path / cmd).exists()
    assert _digest(llava) == before
    llama = tmp_path / "llama"
    make_llama(llama)
    error = _refused_json(["convert", str(llama), "--image-size", "56", "-o", str(tmp_path / "l")], capsys)
    assert "does not apply to llama: a decoder alone takes no image" in error["message"]
    for cmd in ("build", "convert"):  # edgekit's own model: no MODEL
        error = _refused_json([cmd, "--image-size", "56", "-o", str(tmp_path / cmd)], capsys)
        assert "does not apply to edgekit's own model: its side is its config.json's image_size" in error["message"]
        assert not (tmp_path / cmd).exists()


@pytest.mark.parametrize("side,patch", [(392, 14), (784, 14), (840, 14), (98, 7), (196, 7), (448, 14)])
def test_pinned_sides_are_fixed_whatever_the_processors_float_arithmetic_does_to_huge_images(side, patch):
    """min_pixels = max_pixels = S*S fixes S for the S x S frames edgekit feeds. transformers' smart_resize sends
    a 65536 px image to S - 28 for these S (float rounding), which the dynamic-resolution probe refused before
    (`--image-size 392` on Qwen2-VL-2B was refused as dynamic)."""
    from edgekit.hf.qwen2_vl_processor import fixed_side, pin_processor, smart_resize

    pre = pin_processor(None, side, patch, 2, 2)
    assert fixed_side(pre, patch, 2, Path("preprocessor_config.json")) == side
    assert smart_resize(side, 2 * patch, side * side, side * side) == side  # the frame edgekit feeds keeps S
    if side != 448:
        assert smart_resize(1 << 16, 2 * patch, side * side, side * side) == side - 2 * patch  # the quirk


def test_image_size_whose_span_fills_the_context_is_refused_naming_the_largest_that_fits(tmp_path, qwen, capsys):
    """A side whose image span leaves the decoder no room for a prompt and a report would build a bundle that
    refuses every report: refused at convert/build time in one line naming the largest side that fits (the
    span is (S / 14)^2 tokens for the tiny model; 40 positions leave 38 for it: 6 x 14 = 84 px)."""
    from safetensors import safe_open

    from edgekit.hf.config import read_config_file
    from edgekit.hf.vlm import vlm_spec

    vlm, _, _, _ = qwen
    hf = _dynamic_copy(vlm, tmp_path / "hf")
    cfg = json.loads((hf / "config.json").read_text())
    cfg["text_config"]["max_position_embeddings"] = 40
    (hf / "config.json").write_text(json.dumps(cfg))
    for cmd in ("build", "convert"):
        error = _refused_json([cmd, str(hf), "--image-size", "98", "-o", str(tmp_path / cmd)], capsys)
        assert "one image takes 49 decoder positions and text_config.max_position_embeddings is 40" in error["message"]
        assert "the largest --image-size that leaves room is 84" in error["message"]
        assert not (tmp_path / cmd).exists()
    with safe_open(str(hf / "model.safetensors"), "np") as f:
        names_ = list(f.keys())
    spec = vlm_spec(read_config_file(hf / "config.json"), hf, names_, image_size=84)  # the side it names fits
    assert spec.span_length == 36


@pytest.mark.parametrize(
    "edit,needle",
    [
        ("drop", "visual.merger.mlp.2.weight is missing"),  # the checkpoint's own name
        ("reshape", "visual.blocks.0.attn.qkv.weight has shape (96, 16), config.json implies (96, 32)"),
        ("section", "mrope_section [2, 3, 4] does not sum to head_dim / 2 = 8"),
        ("vision_rope", "vision_config.rope_parameters: expected an object, got [10000]"),
        ("rope_theta", "rope_theta: expected a positive number, got '1e4'"),
        ("text_config", "text_config: expected an object, got 'qwen2'"),
    ],
)
def test_weights_or_config_not_matching_are_refused_before_any_graph(tmp_path, qwen, capsys, edit, needle):
    from safetensors.numpy import load_file, save_file

    vlm, _, _, _ = qwen
    hf = tmp_path / "hf"
    shutil.copytree(vlm.path, hf)
    if edit in CONFIG_EDITS:  # config.json values of the wrong type: one line, not a ValueError traceback
        cfg = json.loads((hf / "config.json").read_text())
        CONFIG_EDITS[edit](cfg)
        (hf / "config.json").write_text(json.dumps(cfg))
    else:
        tensors = load_file(str(hf / "model.safetensors"))
        if edit == "drop":
            del tensors["visual.merger.mlp.2.weight"]
        else:
            tensors["visual.blocks.0.attn.qkv.weight"] = tensors["visual.blocks.0.attn.qkv.weight"][:, :16].copy()
        save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})
    assert needle in _convert_refused(hf, tmp_path, capsys)
    assert app_module.main(["build", str(hf), "-o", str(tmp_path / "b")]) == 2 and not (tmp_path / "b").exists()


def test_hub_config_layout_is_read(tmp_path, qwen):
    """The Hub's Qwen2-VL config.json (transformers 4's layout: the text fields at the top level,
    `rope_scaling: {type: mrope, mrope_section}`) gives the same decoder, and transformers agrees with it."""
    from edgekit.hf import SafetensorsCheckpoint, read_hf_config
    from edgekit.hf.parity import measure_hf_parity
    from edgekit.hf.vlm import vlm_spec

    vlm, spec, _, _ = qwen
    hf = tmp_path / "hf"
    shutil.copytree(vlm.path, hf)
    cfg = json.loads((hf / "config.json").read_text())
    text = cfg.pop("text_config")
    rope = text.pop("rope_parameters")
    text.pop("model_type")
    cfg.update(text, rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]}, rope_theta=10000.0)
    (hf / "config.json").write_text(json.dumps(cfg))
    got = convert_hf(hf, tmp_path / "onnx").spec
    assert got.decoder == spec.decoder and got.tower == spec.tower
    figure = measure_hf_parity(
        tmp_path / "onnx", hf, vlm_spec(read_hf_config(hf), hf, SafetensorsCheckpoint(hf).entries), 1, 4
    )
    assert figure["greedy_identical"] == 1.0 and figure["max_rel_logit_error"] <= TOL


def test_finetune_feeds_mrope_token_types(tmp_path, qwen):
    """`edgekit finetune` on an image record: Qwen2-VL's forward needs `mm_token_type_ids` beside the processor's
    pixels and grid (its M-RoPE reads them); without them transformers refuses the batch."""
    from finetune_factory import write_image_records

    from edgekit.finetune.trainer import FinetuneOptions, finetune

    vlm, _, _, _ = qwen
    write_image_records(tmp_path, 4)
    opts = FinetuneOptions(steps=1, batch_size=4, gate_rate=0.25, threads=1)
    result = finetune(vlm.path, tmp_path / "t.jsonl", tmp_path / "ad", opts)
    assert result["data"]["layout"] == "image+prompt+completion" and np.isfinite(result["last_loss"])


def test_peft_adapter_merges_as_peft_does(tmp_path, qwen):
    """The graphs name Qwen2-VL's weights as transformers 5's modules are named (`model.language_model.layers...`,
    `model.visual.blocks...`) whatever the checkpoint's layout on disk, so a PEFT adapter trained on the model
    merges and answers as PEFT's own merge."""
    import dataclasses

    peft = pytest.importorskip("peft")
    from edgekit.passes.lora import merge_lora

    vlm, spec, _, root = qwen
    cls = type(vlm.model)
    base = cls.from_pretrained(vlm.path).eval()
    targets = r".*(language_model.*\.(q_proj|v_proj|down_proj)|visual.*\.attn\.qkv)"
    lora = peft.get_peft_model(
        base, peft.LoraConfig(r=2, lora_alpha=4, target_modules=targets, init_lora_weights=False)
    )
    lora.save_pretrained(tmp_path / "adapter")
    merged = lora.merge_and_unload().eval()
    merge_lora(root / "onnx", tmp_path / "merged", [tmp_path / "adapter"])
    backend = CpuBackend.from_dir(tmp_path / "merged", intra_op_threads=1)
    err, same = _served_cases(dataclasses.replace(vlm, model=merged), spec, backend, tmp_path, 1)
    assert err <= TOL and same == 1


def test_heads_pass_calibrates_an_mrope_decoder(tmp_path, qwen, capsys):
    """The heads pass's own calibration feeds take the decoder's (3, batch, seq) positions
    (`edgekit.positions.for_rank`): `edgekit optimize --pass heads` runs on the converted graphs."""
    import onnx_ir as ir

    from edgekit.passes.heads import default_calibration

    _, _, _, root = qwen
    feeds = default_calibration(ir.load(str(root / "onnx" / "decoder_model_merged.onnx")), root / "onnx", samples=1)
    assert feeds[0]["position_ids"].shape == (3, 1, 48)
    assert app_module.main(["optimize", str(root / "onnx"), "-o", str(tmp_path / "o"), "--pass", "heads"]) == 0
    assert (tmp_path / "o" / "decoder_model_merged.onnx").is_file()


def test_edgekitd_serves_a_qwen2_vl_bundle_as_the_reporter_does(tmp_path):
    """edgekitd (a real daemon subprocess over its Unix socket) serving a qwen2_vl bundle as a variant: its
    report is the Reporter's, M-RoPE placed from the bundle's record with no daemon code of its own."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from edgekit.build import build
    from edgekit.daemon.testing import DaemonProcess

    vlm = make_qwen2_vl(tmp_path / "hf", seed=4)
    bundle = build("cpu", tmp_path / "bundle", model_dir=vlm.path, parity=False).bundle
    config = tmp_path / "edgekitd.toml"
    config.write_text(f'[[variants]]\nname = "qwen2-vl"\nbundle = "{bundle}"\n')
    study = _sample("cr_chest") + "/image.dcm"
    reporter = Reporter.from_bundle(bundle, threads=1)
    want = reporter.report(study, "w3 w4", reporter.options(max_new_tokens=6)).text
    with DaemonProcess(tmp_path / "state", config=config).start() as d:
        reply = d.client.report(study, "w3 w4", max_new_tokens=6)
    assert reply.status == 200, reply.body[:300]
    assert reply.json()["variant"] == "qwen2-vl" and reply.json()["text"] == want
