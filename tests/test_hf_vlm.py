"""Whole Hugging Face VLMs (llava with CLIP/SigLIP towers and LLaMA/Qwen2/Mistral language models; idefics3 and
smolvlm in the processor's no-split and splitting modes): random-init models built from tiny configs with
transformers (nothing downloaded), converted by edgekit, and compared with transformers' forward and `generate()` for
the same image and tokens; then built into bundles and served by the reporter unchanged; then the refusals.

The 100-case parity at two sizes per family is bench/hf_vlm_parity.py; here two cases per configuration."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("jinja2")

from hf_vlm_factory import hf_reference, make_idefics3, make_llava, make_llava_next, processor_inputs  # noqa: E402

from edgekit import names  # noqa: E402
from edgekit.cli import app as app_module  # noqa: E402
from edgekit.errors import ConfigError, EdgekitError  # noqa: E402
from edgekit.generate import GenerationOptions, generate, place_image  # noqa: E402
from edgekit.hf import convert_hf  # noqa: E402
from edgekit.hf.parity import hf_pixel_values  # noqa: E402
from edgekit.ingest import Study  # noqa: E402
from edgekit.ort import CpuBackend  # noqa: E402
from edgekit.reporter import Reporter  # noqa: E402

TOL = 1e-4  # relative to the largest logit


def _parity(vlm, onnx_dir, spec, cases=2, new_tokens=6):
    backend = CpuBackend.from_dir(onnx_dir, intra_op_threads=1)
    rng = np.random.default_rng(1)
    for _ in range(cases):
        gray = rng.uniform(0, 1, (spec.image_size, spec.image_size)).astype(np.float32)
        text = [int(t) for t in rng.integers(8, spec.decoder.vocab_size - 1, 6)]
        ref_logits, ref_tokens = hf_reference(vlm, spec.span_ids, gray, text, new_tokens)
        pixels = gray[None, None, None]
        image = backend.encode_images(pixels)
        assert image.shape == (1, spec.span_length, spec.decoder.hidden)
        x = np.concatenate([image, backend.embed(np.asarray([text]))], axis=1)
        n = x.shape[1]
        logits, _ = backend.decode(x, np.ones((1, n), np.int64), np.arange(n)[None], None)
        scale = np.abs(ref_logits).max()
        assert scale > 0.5  # not two near-zero tensors
        assert np.abs(logits[0] - ref_logits).max() / scale <= TOL
        got = generate(backend, pixels, np.asarray([text]), GenerationOptions(max_new_tokens=new_tokens)).token_ids
        assert got == ref_tokens


@pytest.mark.parametrize(
    "tower,text,over,tokens",
    [
        ("clip", "llama", {}, 16),  # feature layer -2, CLS dropped ('default')
        ("siglip", "qwen2", {"vision_feature_select_strategy": "full"}, 16),  # q/k/v biases, no CLS
        ("clip", "mistral", {"vision_feature_layer": [-3, -1], "vision_feature_select_strategy": "full"}, 17),
    ],
    ids=["clip-llama", "siglip-qwen2-full", "clip-mistral-multilayer"],
)
def test_llava_parity(tmp_path, tower, text, over, tokens):
    vlm = make_llava(tmp_path / "hf", tower=tower, text=text, **over)
    result = convert_hf(tmp_path / "hf", tmp_path / "onnx")
    assert result.kind == "vlm" and result.spec.num_image_tokens == tokens
    assert result.spec.text_model_type == text
    _parity(vlm, tmp_path / "onnx", result.spec)
    names = {i.name for i in onnx.load(str(tmp_path / "onnx" / "vision_encoder.onnx")).graph.initializer}
    # transformers 5's module names (what PEFT adapters name), from the checkpoint's on-disk layout
    assert {"model.multi_modal_projector.linear_1.weight", "model.language_model.layers.0.self_attn.q_proj.weight"} <= (
        names | {i.name for i in onnx.load(str(tmp_path / "onnx" / "decoder_model_merged.onnx")).graph.initializer}
    )


@pytest.mark.parametrize("family", ["idefics3", "smolvlm"])
def test_idefics3_parity(tmp_path, family):
    vlm = make_idefics3(tmp_path / "hf", family=family)
    spec = convert_hf(tmp_path / "hf", tmp_path / "onnx").spec
    assert spec.num_image_tokens == 4 and spec.span_ids == [5, 6, *[vlm.image_token_id] * 4, 5]
    _parity(vlm, tmp_path / "onnx", spec)


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("llava")
    return make_llava(root / "hf", tower="clip", text="llama", seed=2)


def _study(size: int, seed: int = 0) -> Study:
    frames = np.random.default_rng(seed).uniform(0, 1, (3, 2 * size, 2 * size)).astype(np.float32)
    return Study(frames, modality="CT", uid_hash="uid:test", source="dicom")


def _build_cpu_with_parity(model_dir, out, capsys) -> None:
    """`edgekit build HF_DIR --target cpu --json`: built, with the build's parity figure against transformers
    measured (greedy identical on every case, logits within TOL)."""
    assert app_module.main(["build", str(model_dir), "--target", "cpu", "-o", str(out), "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)["figures"]
    assert figures["parity"]["measured"] and figures["parity"]["greedy_identical"] == 1.0
    assert figures["parity"]["max_rel_logit_error"] <= TOL


def _check_served_as_transformers(reporter, vlm, span_ids: list[int], study: Study, prompt: str):
    """The reporter's report for `study` is transformers' greedy tokens for the frame it serves, the span at the
    prompt's image slot. Returns the report and the prompt's layout."""
    report = reporter.report(study, prompt, reporter.options(max_new_tokens=6))
    layout = reporter.prompt(study.modality, prompt)
    served = reporter.pixel_values(study)[0, 0, 0]
    _, tokens = hf_reference(vlm, span_ids, served, layout.ids, len(report.text.split()) or 1, layout.image_slot)
    assert report.text == reporter.tokenizer.decode(tokens, skip_special_tokens=True).strip()
    return report, layout


def test_build_and_serve_llava_bundle(tmp_path, llava_dir, capsys):
    """`edgekit build HF_DIR` -> a bundle with the model's tokenizer, template and preprocessing; the reporter
    serves it as it is, and its tokens are transformers' for the same study and prompt."""
    out = tmp_path / "bundle"
    _build_cpu_with_parity(llava_dir.path, out, capsys)
    manifest = json.loads((out / "manifest.json").read_text())
    assert (out / "tokenizer.json").read_bytes() == (llava_dir.path / "tokenizer.json").read_bytes()
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["prompt_template"] == "USER: <image>\n{prompt} " and gen["image_token"] == "<image>"
    assert gen["bos_token_id"] == 1 and gen["sep_token_id"] == 4
    pre = json.loads((out / "preprocessor_config.json").read_text())
    assert pre["image_size"] == 28 and pre["num_frames"] == 1
    assert pre["normalization"]["image_mean"] == pytest.approx(list(llava_dir.mean))
    assert manifest["name"] == "hf" and manifest["provenance"]["passes"][0]["name"] == "hf_import"

    reporter = Reporter.from_bundle(out, threads=1)
    span = convert_hf(llava_dir.path, tmp_path / "onnx").spec.span_ids
    report, layout = _check_served_as_transformers(reporter, llava_dir, span, _study(28), "w3 w4 w5")
    ids = layout.ids
    assert ids[0] == 1 and ids[-1] == 4 and layout.image_slot == 2  # <s> USER: [image] ... ASSISTANT:
    typed = reporter.prompt("CT", "<image> w3")  # the user's own image token stays text
    assert typed.image_slot == 2 and typed.ids.count(llava_dir.image_token_id) == 1
    assert report.stop_reason in ("max_new_tokens", "stop_token")


def test_build_x1_smolvlm_bundle_runs(tmp_path):
    vlm = make_idefics3(tmp_path / "hf", family="smolvlm", seed=3)
    out = tmp_path / "x1"
    assert app_module.main(["build", str(vlm.path), "--target", "x1", "-o", str(out), "--no-parity"]) == 0
    reporter = Reporter.from_bundle(out, threads=1)
    report = reporter.report(_study(32, seed=1), "w7", reporter.options(max_new_tokens=4))
    assert report.target == "x1" and report.timings["new_tokens"] >= 1
    assert reporter.backend.heads == 4  # DSS sees the decoder's heads under model.text_model.layers
    assert report.energy_source and report.energy_source.startswith("emulated")
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["prompt_template"] == "User:<image>{prompt}<end_of_utterance>\n"
    assert json.loads((out / "config.json").read_text())["image_tokens"] == 7  # <fake><global> 4 x <image> <fake>


# idefics3 / smolvlm image splitting -------------------------------------------------------------------------
def _block_image(m: int, r: int, seed: int) -> np.ndarray:
    """A random 8-bit grey image of r x r blocks of equal pixels: every integer-factor downscale filter that
    averages (Pillow's BOX, the vision graph's block mean) gives its exact block values, so the processor's
    pixel_values are reproducible to the bit; tiles and global image still see distinct random content."""
    blocks = np.random.default_rng(seed).integers(0, 256, (m, m)).astype(np.uint8)
    return np.kron(blocks, np.ones((r, r), np.uint8))


def _portable(reporter: Reporter) -> CpuBackend:
    """The bundle's portable graphs in ONNX Runtime: every position's logits (the served cpu decoder returns the
    last position's only)."""
    bundle = reporter.bundle
    return CpuBackend(
        bundle.component(names.VISION),
        bundle.component(names.EMBED),
        bundle.component(names.DECODER_ROLE),
        intra_op_threads=1,
    )


def _check_prefill_and_greedy(vlm, reporter, layout, image: np.ndarray, theirs: dict, spec) -> None:
    """Our ONNX Runtime prefill (the span at the layout's slot) and greedy tokens against transformers' model fed
    the processor's own inputs `theirs` for the same `image` (uint8, made so the processor's pixels are ours), and
    the parity check's copy of the processor's pixels (`hf_pixel_values`) against the processor's."""
    slot = layout.image_slot
    pixels = (image.astype(np.float32) / 255)[None, None, None]
    np.testing.assert_allclose(hf_pixel_values(spec, pixels[0, 0, 0]), theirs["pixel_values"].numpy(), atol=1e-5)
    portable = _portable(reporter)
    text = np.asarray([layout.ids], np.int64)
    x, mask = place_image(portable.embed(text), np.ones_like(text), portable.encode_images(pixels), slot)
    logits, _ = portable.decode(x, mask, np.arange(x.shape[1])[None], None)  # every position's logits
    with torch.no_grad():
        ref = vlm.model(**theirs).logits[0].numpy()
        greedy = vlm.model.generate(**theirs, max_new_tokens=6, do_sample=False)[0, x.shape[1] :].tolist()
    scale = np.abs(ref).max()
    assert scale > 0.5 and np.abs(logits[0] - ref).max() / scale <= TOL
    # the served decoder (the cpu target's own, where the build could lower it) writes the same greedy tokens
    for backend in (portable, reporter.backend):
        ours = generate(backend, pixels, text, GenerationOptions(max_new_tokens=6), image_slot=slot).token_ids
        assert ours == greedy, type(backend).__name__


def test_idefics3_split_matches_the_processor_and_serves(tmp_path, capsys):
    """Splitting on (`do_image_splitting: true`, size.longest_edge = 2 x the tower's 28): edgekit's span is
    `Idefics3Processor`'s 2 x 2 tiles with their row/col markers and newlines (the tokenizer merges "\n\n"),
    then the global image; transformers' model fed the processor's own `input_ids` and `pixel_values` gives the
    prefill logits and greedy tokens of the ONNX graphs; the cpu bundle is served by the Reporter."""
    from transformers.image_utils import PILImageResampling

    vlm = make_idefics3(tmp_path / "hf", family="idefics3", seed=11, tiles=2)
    out = tmp_path / "bundle"
    _build_cpu_with_parity(vlm.path, out, capsys)
    spec = convert_hf(vlm.path, tmp_path / "onnx").spec
    img = vlm.image_token_id
    tile = [img] * 4
    assert (spec.tiles, spec.image_size, spec.num_image_tokens) == (2, 56, 20)
    assert spec.span_ids == [5, 7, *tile, 5, 8, *tile, 11, 5, 9, *tile, 5, 10, *tile, 12, 5, 6, *tile, 5]
    pre = json.loads((out / "preprocessor_config.json").read_text())
    assert pre["image_size"] == 56 and pre["image_splitting"]["rows"] == 2
    assert json.loads((out / "config.json").read_text())["image_tokens"] == 33 == spec.span_length

    reporter = Reporter.from_bundle(out, threads=1)
    prompt = "w3 w4 w5"
    layout = reporter.prompt("", prompt)
    slot = layout.image_slot
    image = _block_image(28, 2, seed=4)
    theirs = processor_inputs(vlm, image, prompt, resample=PILImageResampling.BOX)
    assert theirs["input_ids"][0].tolist() == [*layout.ids[:slot], *spec.span_ids, *layout.ids[slot:]]
    _check_prefill_and_greedy(vlm, reporter, layout, image, theirs, spec)
    # the processor's default resample (LANCZOS) changes the global image only: the tiles are exact crops
    lanczos = processor_inputs(vlm, image, prompt)["pixel_values"]
    assert torch.equal(lanczos[0, :4], theirs["pixel_values"][0, :4])
    assert not torch.allclose(lanczos[0, 4], theirs["pixel_values"][0, 4], atol=1e-2)

    study = _study(56, seed=2)  # 112 px frames, BOX-resized to 56 by edgekit's preprocessing
    _check_served_as_transformers(reporter, vlm, spec.span_ids, study, prompt)


def test_smolvlm_split_parity_and_x1_bundle(tmp_path):
    """SmolVLM split 2 x 2: the graphs against transformers' model on the same tiles and global image, and the
    x1 build of it served by the Reporter."""
    vlm = make_idefics3(tmp_path / "hf", family="smolvlm", seed=12, tiles=2)
    spec = convert_hf(vlm.path, tmp_path / "onnx").spec
    assert spec.tiles == 2 and spec.span_length == 33
    _parity(vlm, tmp_path / "onnx", spec)
    out = tmp_path / "x1"
    assert app_module.main(["build", str(vlm.path), "--target", "x1", "-o", str(out), "--no-parity"]) == 0
    reporter = Reporter.from_bundle(out, threads=1)
    report = reporter.report(_study(56, seed=1), "w7", reporter.options(max_new_tokens=4))
    assert report.target == "x1" and report.timings["new_tokens"] >= 1
    assert json.loads((out / "config.json").read_text())["image_tokens"] == 33
    # the tiling and its block-mean downscale are X1 instructions: nothing of the vision graph runs on the host
    figures = json.loads((out / "manifest.json").read_text())["figures"]
    assert figures["x1_compile"]["host_partitions"]["vision_encoder"] == 0


@pytest.mark.parametrize("longest,tile", [(56, 28), (57, 28), (20, 28), (29, 28), (100, 28), (127, 42), (4097, 512)])
def test_split_tiling_follows_the_processor(longest, tile):
    """The tile count edgekit derives for a square frame is the one transformers' image processors (Idefics3's,
    SmolVLM's) cut (their rounding of odd sizes, multiples of the tile and the 4096 cap included)."""
    from edgekit.hf.idefics3 import square_resize

    h, w = square_resize(longest, tile)
    assert h == w
    tiles = h // tile if h > tile else 0
    for family in ("Idefics3", "SmolVLM"):  # SmolVLM's processor has its own copy of the arithmetic
        cls = getattr(transformers, f"{family}ImageProcessorPil", getattr(transformers, f"{family}ImageProcessor"))
        proc = cls(do_image_splitting=True, size={"longest_edge": longest}, max_image_size={"longest_edge": tile})
        got = proc(images=[[np.zeros((10, 10, 3), np.uint8)]], return_row_col_info=True, return_tensors="np")
        assert (got["rows"][0][0], got["cols"][0][0]) == (tiles, tiles), family
        assert got["pixel_values"].shape[1] == (tiles * tiles + 1 if tiles else 1)


@pytest.mark.parametrize(
    "edit,needle",
    [
        (
            {"max_image_size": {"longest_edge": 32}},
            "max_image_size.longest_edge 32 is not the vision tower's image_size 28",
        ),
        ({"do_resize": False}, "do_resize: false with image splitting"),
        ({"size": {"height": 56, "width": 56}}, "size: expected {'longest_edge': <int>}"),
    ],
    ids=["tile-not-tower", "no-resize", "size-not-longest-edge"],
)
def test_split_the_graph_cannot_fix_is_refused_in_one_line(tmp_path, capsys, edit, needle):
    vlm = make_idefics3(tmp_path / "hf", family="idefics3", tiles=2)
    pre_path = vlm.path / "preprocessor_config.json"
    pre_path.write_text(json.dumps({**json.loads(pre_path.read_text()), **edit}))
    err = _refused_convert(vlm, tmp_path, capsys)
    assert needle in err and "preprocessor_config.json" in err


# llava_next: anyres fixed for the square frame ---------------------------------------------------------------
@pytest.mark.parametrize(
    "tower,text,over,tiles,tokens",
    [
        ("clip", "llama", {}, 2, 16 + 8 * 9),  # base 4x4, the 2x2 grid's 8x8 map + a newline per row
        ("siglip", "qwen2", {"vision_feature_select_strategy": "full"}, 3, 16 + 12 * 13),
        ("clip", "mistral", {"vision_feature_layer": [-3, -1]}, 1, 16 + 4 * 5),  # the tower's own size
    ],
    ids=["clip-llama-2x2", "siglip-qwen2-full-3x3", "clip-mistral-multilayer-1x1"],
)
def test_llava_next_parity(tmp_path, tower, text, over, tiles, tokens):
    vlm = make_llava_next(tmp_path / "hf", tower=tower, text=text, tiles=tiles, **over)
    spec = convert_hf(tmp_path / "hf", tmp_path / "onnx").spec
    assert (spec.family, spec.tiles, spec.image_size) == ("llava_next", tiles, 28 * tiles)
    assert spec.num_image_tokens == tokens and spec.span_ids == [vlm.image_token_id] * tokens
    _parity(vlm, tmp_path / "onnx", spec)
    names = {i.name for i in onnx.load(str(tmp_path / "onnx" / "vision_encoder.onnx")).graph.initializer}
    assert {"model.image_newline", "model.multi_modal_projector.linear_1.weight"} <= names


def test_llava_next_matches_the_processor_and_serves(tmp_path, capsys):
    """A 56 px frame on pinpoints [[28, 56], [56, 28], [56, 56]]: `LlavaNextProcessor` picks 56 x 56, cuts 2 x 2
    crops and puts the base image in front; its `input_ids` are edgekit's prompt with the span (88 image tokens)
    at the slot, and transformers' model fed the processor's own `input_ids`, `pixel_values` and `image_sizes`
    gives the ONNX graphs' prefill logits and greedy tokens; the cpu bundle is served by the Reporter."""
    from transformers.image_utils import PILImageResampling

    vlm = make_llava_next(tmp_path / "hf", seed=13, tiles=2)
    out = tmp_path / "bundle"
    _build_cpu_with_parity(vlm.path, out, capsys)
    spec = convert_hf(vlm.path, tmp_path / "onnx").spec
    pre = json.loads((out / "preprocessor_config.json").read_text())
    assert pre["image_size"] == 56 and pre["anyres"]["rows"] == 2 and pre["anyres"]["grid_pinpoint"] == [56, 56]
    assert json.loads((out / "config.json").read_text())["image_tokens"] == 88 == spec.span_length

    reporter = Reporter.from_bundle(out, threads=1)
    prompt = "w3 w4 w5"
    layout = reporter.prompt("", prompt)
    slot = layout.image_slot
    assert slot == 2
    image = _block_image(28, 2, seed=5)
    theirs = processor_inputs(vlm, image, prompt, resample=PILImageResampling.BOX)
    assert theirs["input_ids"][0].tolist() == [*layout.ids[:slot], *spec.span_ids, *layout.ids[slot:]]
    assert theirs["image_sizes"].tolist() == [[56, 56]] and tuple(theirs["pixel_values"].shape) == (1, 5, 3, 28, 28)
    _check_prefill_and_greedy(vlm, reporter, layout, image, theirs, spec)
    # the processor's default resample (BICUBIC) changes the base image only: the crops are exact
    bicubic = processor_inputs(vlm, image, prompt)["pixel_values"]
    assert torch.equal(bicubic[0, 1:], theirs["pixel_values"][0, 1:])
    assert not torch.allclose(bicubic[0, 0], theirs["pixel_values"][0, 0], atol=1e-2)

    study = _study(56, seed=3)  # 112 px frames, BOX-resized to 56 by edgekit's preprocessing
    _check_served_as_transformers(reporter, vlm, spec.span_ids, study, prompt)


@pytest.mark.parametrize("side", [20, 28, 41, 56, 57, 84, 100, 336, 672, 700])
def test_llava_next_grid_arithmetic_follows_transformers(side):
    """edgekit's copies of `select_best_resolution` and of the processor's unpadded feature count agree with
    transformers' for square images on llava-v1.6's pinpoints and the tiny test ones."""
    from transformers.image_processing_utils import select_best_resolution as theirs

    from edgekit.hf.llava_next import DEFAULT_PINPOINTS, select_best_resolution, unpadded_features

    for points in (DEFAULT_PINPOINTS, ((28, 56), (56, 28), (56, 56))):
        best = select_best_resolution((side, side), points)
        assert best == tuple(theirs([side, side], [list(p) for p in points]))
        tile = points[0][0]
        proc = transformers.LlavaNextProcessor.__new__(transformers.LlavaNextProcessor)
        ph = pw = tile // 14 if tile == 336 else tile // 7
        rows, cols = unpadded_features((side, side), (ph * best[0] // tile, pw * best[1] // tile))
        unpadded, newlines = proc._get_unpadded_features(side, side, ph, pw, best[0] // tile, best[1] // tile)
        assert (rows * cols, rows) == (unpadded, newlines)


@pytest.mark.parametrize(
    "where,edit,needle",
    [
        ("both", {"image_grid_pinpoints": [[28, 56], [56, 28]]}, "hold no square multiple of the tower's 28 px"),
        ("config", {"vision_feature_select_strategy": "full"}, "leaves 17 tokens per crop, not the tower's 4x4"),
        ("pre", {"crop_size": {"height": 32, "width": 32}}, "crop size 32 is not the vision tower's image_size 28"),
        ("pre", {"image_grid_pinpoints": [[28, 28]]}, "differ from config.json's"),
    ],
    ids=["no-square-pinpoint", "clip-full", "crop-not-tower", "pinpoints-differ"],
)
def test_llava_next_the_graph_cannot_fix_is_refused_in_one_line(tmp_path, capsys, where, edit, needle):
    vlm = make_llava_next(tmp_path / "hf")
    files = {"pre": ["preprocessor_config.json"], "config": ["config.json"]}
    for name in files.get(where, files["pre"] + files["config"]):  # both: the processor's and the model's
        path = vlm.path / name
        path.write_text(json.dumps({**json.loads(path.read_text()), **edit}))
    err = _refused_convert(vlm, tmp_path, capsys)
    assert needle in err and path.name in err


# the image in the template's place ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "make",
    [
        lambda p: make_llava(p, tower="clip", text="llama", seed=5),
        lambda p: make_llava(p, tower="siglip", text="qwen2", seed=6, vision_feature_select_strategy="full"),
        lambda p: make_idefics3(p, family="idefics3", seed=7),
        lambda p: make_idefics3(p, family="smolvlm", seed=8),
    ],
    ids=["llava-clip-llama", "llava-siglip-qwen2", "idefics3", "smolvlm"],
)
def test_templated_prompt_matches_transformers_processor(tmp_path, make):
    """A bundle's prompt as the model's own processor builds it: transformers' processor renders the chat
    template and expands the image token where the template puts it (after `USER: `, after `User:`); edgekit's
    prompt, with the image at its slot, gives the same token sequence, and the ONNX prefill's logits (ONNX
    Runtime) match transformers' forward on the processor's `input_ids` and `pixel_values`."""
    vlm = make(tmp_path / "hf")
    if vlm.family == "smolvlm":  # its processor is built with a video processor, which needs torchvision
        pytest.importorskip("num2words", reason="transformers' SmolVLMProcessor needs num2words")
        # not in the test extra: PyPI's torchvision for torch 2.13 is the CUDA build, whose operators do not
        # register beside the CPU torch pinned here (and then break transformers' image processors)
        pytest.importorskip("torchvision", reason="transformers' SmolVLMProcessor needs torchvision (a CPU build)")
    from edgekit.build import build

    out = build("cpu", tmp_path / "bundle", model_dir=vlm.path, parity=False).bundle
    reporter = Reporter.from_bundle(out, threads=1)
    spec = convert_hf(vlm.path, tmp_path / "onnx").spec
    prompt = "w3 w4 w5 w6"
    layout = reporter.prompt("", prompt)
    image = np.random.default_rng(3).integers(0, 256, (spec.image_size, spec.image_size)).astype(np.uint8)
    theirs = processor_inputs(vlm, image, prompt)
    gray = image.astype(np.float32) / 255
    slot = layout.image_slot
    assert slot == 2  # after <s> USER: / <|im_start|> User:, not in front of <bos>
    ours = [*layout.ids[:slot], *spec.span_ids, *layout.ids[slot:]]
    assert theirs["input_ids"][0].tolist() == ours
    with torch.no_grad():
        ref = vlm.model(**theirs).logits[0].numpy()
    backend = _portable(reporter)
    text, image = np.asarray([layout.ids], np.int64), backend.encode_images(gray[None, None, None])
    positions = np.arange(len(ours))[None]
    logits, _ = backend.decode(*place_image(backend.embed(text), np.ones_like(text), image, slot), positions, None)
    scale = np.abs(ref).max()
    assert scale > 0.5 and np.abs(logits[0] - ref).max() / scale <= TOL
    # the old layout (the image in front of <bos>) is not what the model sees: the slot is what makes it match
    front, _ = backend.decode(*place_image(backend.embed(text), np.ones_like(text), image, 0), positions, None)
    assert np.abs(front[0, -1] - ref[-1]).max() / scale > 100 * TOL


def test_place_image_puts_each_rows_image_at_its_slot():
    """One slot for all rows or one per row (a left-padded row counts its padding); the mask is 1 on the image;
    a slot outside the prompt and an image count that is not the prompt count are refused."""
    text = np.arange(2 * 4, dtype=np.float32).reshape(2, 4, 1)
    mask = np.array([[1, 1, 1, 1], [0, 1, 1, 1]])
    image = -np.ones((2, 2, 1), np.float32)
    x, m = place_image(text, mask, image, [1, 3])
    assert x[..., 0].tolist() == [[0, -1, -1, 1, 2, 3], [4, 5, 6, -1, -1, 7]]
    assert m.tolist() == [[1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1]]
    x, m = place_image(text, mask, image, 4)
    assert x[..., 0].tolist() == [[0, 1, 2, 3, -1, -1], [4, 5, 6, 7, -1, -1]] and m[:, 4:].all()
    assert place_image(text, mask, None, 2)[0] is text
    for slot, bad in ((5, image), (-1, image), (0, image[:1])):
        with pytest.raises(EdgekitError):
            place_image(text, mask, bad, slot)


def test_image_tokens_are_one_fact_for_the_context_budget_and_orin_limits(tmp_path, llava_dir):
    """An imported VLM's config.json says how many positions its image span takes (`image_tokens`) beside its
    whole context; the reporter's budget and the orin target's TensorRT limits read both through
    `edgekit.prompt`, so the prefill profile spans image + prompt up to the model's real context."""
    from edgekit.hf import read_hf_config
    from edgekit.hf.serving import write_serving_files
    from edgekit.reporter import ContextBudget, PromptTooLongError
    from edgekit.targets.orin.profiles import Limits

    spec = convert_hf(llava_dir.path, tmp_path / "onnx").spec
    cfg = read_hf_config(llava_dir.path)
    files = write_serving_files(spec, llava_dir.path, cfg, tmp_path / "serving")
    model, gen, pre = (
        json.loads(files[r].read_text()) for r in ("model_config", "generation_config", "preprocessor_config")
    )
    context = cfg["text_config"]["max_position_embeddings"]
    assert spec.span_length == 16 and model["image_tokens"] == 16 and model["max_positions"] == context
    budget = ContextBudget.of(model)
    assert (budget.positions, budget.image_tokens) == (context, 16)
    limits = Limits.of(model, gen, pre)
    assert (limits.max_positions, limits.image_tokens) == (context, 16)
    assert limits.opt_prompt == 16 + 16  # the image span + a typical prompt text
    opts = GenerationOptions(max_new_tokens=8)
    assert budget.fit(context - 16 - 1, opts, []).max_new_tokens == 1  # one position left for the report
    with pytest.raises(PromptTooLongError, match="16 image tokens"):
        budget.fit(context - 16, opts, [])


# refusals ------------------------------------------------------------------------------------------------------
def _refused_convert(vlm, tmp_path, capsys) -> str:
    """`edgekit convert` of `vlm` refused: exit 2, one error line (returned), no output directory left behind."""
    capsys.readouterr()
    assert app_module.main(["convert", str(vlm.path), "-o", str(tmp_path / "onnx")]) == 2
    err = _one_line(capsys)
    assert not (tmp_path / "onnx").exists()
    return err


def _one_line(capsys) -> str:
    """The one error line on stderr (progress lines before it are not errors)."""
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, errors
    return errors[0]


@pytest.mark.parametrize(
    "make", [lambda p: make_llava(p, seed=2), lambda p: make_idefics3(p, tiles=2)], ids=["llava", "split"]
)
def test_preprocessor_config_not_an_object_is_refused_in_one_line(tmp_path, capsys, make):
    """preprocessor_config.json is read once for the normalisation and the tiling, and refused by the one HF config
    reader whichever field would have been read first."""
    vlm = make(tmp_path / "hf")
    (vlm.path / "preprocessor_config.json").write_text("[]")
    err = _refused_convert(vlm, tmp_path, capsys)
    assert "not a JSON object" in err and "preprocessor_config.json" in err


@pytest.mark.parametrize("family", ["paligemma", "qwen3_vl"])  # qwen2_vl, qwen2_5_vl: tests/test_hf_qwen2_vl.py
def test_unsupported_vlm_family_lists_the_supported_ones(tmp_path, capsys, family):
    hf = tmp_path / family
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": family}))
    for cmd in (["convert", str(hf), "-o", str(tmp_path / "o")], ["build", str(hf), "-o", str(tmp_path / "b")]):
        assert app_module.main(cmd) == 2
        err = _one_line(capsys)
        assert f"model_type '{family}' is not supported" in err and "llava, idefics3, smolvlm" in err
        assert "qwen2_vl, qwen2_5_vl" in err  # listed among the supported ones
    assert not (tmp_path / "o").exists() and not (tmp_path / "b").exists()


def test_decoder_without_a_tokenizer_is_refused(tmp_path, capsys):
    """A decoder alone builds into a text bundle (tests/test_text_bundles.py), but not without what serves it."""
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    capsys.readouterr()
    assert app_module.main(["build", str(tmp_path / "llama"), "-o", str(tmp_path / "b")]) == 2
    assert "tokenizer.json is missing" in _one_line(capsys)
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize(
    "edit,needle",
    [
        ("drop", "multi_modal_projector.linear_2.weight is missing"),
        ("reshape", "vision_tower.encoder.layers.0.mlp.fc1.weight has shape (64, 16), config.json implies (64, 32)"),
        ("drop_lm", "language_model.model.layers.1.self_attn.k_proj.weight is missing"),
    ],
)
def test_weights_not_matching_config_are_refused_naming_the_tensor(tmp_path, llava_dir, capsys, edit, needle):
    from safetensors.numpy import load_file, save_file

    hf = tmp_path / "hf"
    shutil.copytree(llava_dir.path, hf)
    tensors = load_file(str(hf / "model.safetensors"))
    if edit == "drop":
        del tensors["multi_modal_projector.linear_2.weight"]
    elif edit == "drop_lm":
        del tensors["language_model.model.layers.1.self_attn.k_proj.weight"]
    else:
        name = "vision_tower.encoder.layers.0.mlp.fc1.weight"
        tensors[name] = tensors[name][:, :16].copy()
    save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})
    capsys.readouterr()
    with pytest.raises(EdgekitError, match="checkpoint does not match config.json") as info:
        convert_hf(hf, tmp_path / "onnx")
    assert needle in str(info.value)
    assert not (tmp_path / "onnx").exists() and not list(tmp_path.glob(".onnx*"))  # no graph written
    assert app_module.main(["build", str(hf), "-o", str(tmp_path / "b")]) == 2
    assert needle in _one_line(capsys) and not (tmp_path / "b").exists()


def test_template_that_cannot_be_served_is_refused(tmp_path, llava_dir, capsys):
    hf = tmp_path / "hf"
    shutil.copytree(llava_dir.path, hf)
    assert (hf / "chat_template.jinja").is_file()  # where transformers 5 saves it
    (hf / "chat_template.jinja").write_text("{{ raise_exception('no images here') }}")
    with pytest.raises(ConfigError, match="no images here"):
        from edgekit.build import build

        build("cpu", tmp_path / "b", model_dir=hf, parity=False)
    assert not (tmp_path / "b").exists()


def test_template_without_its_image_token_is_refused(tmp_path, llava_dir):
    """A chat template that drops the image for an image turn has no place for the span: refused, not guessed."""
    hf = tmp_path / "hf"
    shutil.copytree(llava_dir.path, hf)
    (hf / "chat_template.jinja").write_text("USER: {{ messages[0]['content'][1]['text'] }} ASSISTANT:")
    from edgekit.build import build

    with pytest.raises(ConfigError, match="writes the image token '<image>' 0 times"):
        build("cpu", tmp_path / "b", model_dir=hf, parity=False)
    assert not (tmp_path / "b").exists()


def test_adapter_for_another_base_is_refused_up_front(tmp_path, llava_dir):
    peft = pytest.importorskip("peft")
    from edgekit.passes.lora import merge_lora
    from edgekit.passes.peft_adapter import AdapterError

    other = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
    )
    lora = peft.get_peft_model(other, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    lora.save_pretrained(tmp_path / "adapter")
    convert_hf(llava_dir.path, tmp_path / "onnx")
    with pytest.raises(AdapterError) as info:
        merge_lora(tmp_path / "onnx", tmp_path / "merged", [tmp_path / "adapter"])
    assert "model.layers.0.self_attn.q_proj" in str(info.value)
    assert not (tmp_path / "merged").exists()


def test_peft_adapter_of_the_same_llava_merges_as_peft_does(tmp_path, llava_dir):
    """The graph names LLaVA's weights as transformers 5's modules are named, so an adapter trained on the model
    (PEFT keys `base_model.model.model.language_model.layers...`) merges, and answers as PEFT's own merge."""
    import dataclasses

    peft = pytest.importorskip("peft")
    from edgekit.passes.lora import merge_lora

    base = transformers.LlavaForConditionalGeneration.from_pretrained(llava_dir.path).eval()
    config = peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=r".*language_model.*\.(q_proj|v_proj|down_proj)", init_lora_weights=False
    )
    lora = peft.get_peft_model(base, config)
    lora.save_pretrained(tmp_path / "adapter")
    merged = lora.merge_and_unload().eval()
    spec = convert_hf(llava_dir.path, tmp_path / "onnx").spec
    merge_lora(tmp_path / "onnx", tmp_path / "merged", [tmp_path / "adapter"])
    _parity(dataclasses.replace(llava_dir, model=merged), tmp_path / "merged", spec, cases=1)


def test_external_weights_ship_beside_their_graphs(tmp_path, llava_dir, monkeypatch):
    """A 2B-class import keeps its weights in <graph>.onnx.data (past protobuf's 2 GB): the bundle ships them
    under <role>_data beside the graph and serves the same report. Forced here with a threshold of 0 bytes."""
    import edgekit.hf
    from edgekit.build import build
    from edgekit.bundle.manifest import EXTERNAL_DATA_ROLES

    plain = build("cpu", tmp_path / "plain", model_dir=llava_dir.path, parity=False).bundle
    real = edgekit.hf.convert_hf
    monkeypatch.setattr(edgekit.hf, "convert_hf", lambda *a, **k: real(*a, **k, external_data_threshold_bytes=0))
    ext = build("cpu", tmp_path / "ext", model_dir=llava_dir.path, parity=False).bundle
    roles = json.loads((ext / "manifest.json").read_text())["components"]
    assert {EXTERNAL_DATA_ROLES[r] for r in ("vision_encoder", "embed_tokens", "decoder")} <= roles.keys()
    assert (ext / "decoder_model_merged.onnx.data").is_file()
    assert (ext / "decoder_model_merged.onnx").stat().st_size < 100_000  # the weights are not inside
    study = _study(28, seed=4)
    a, b = (Reporter.from_bundle(p, threads=1) for p in (plain, ext))
    texts = [r.report(study, "w9", r.options(max_new_tokens=5)).text for r in (a, b)]
    assert texts[0] == texts[1] and texts[0]


def test_calibration_feeds_of_an_imported_vlm_are_laid_out_as_served(tmp_path, llava_dir):
    """`optimize --calib` records the decoder's prefill as the reporter feeds it: the VLM's own preprocessing
    and the image span at the template's slot, not in front of `<bos>`."""
    from edgekit.build import build
    from edgekit.passes.calibration import record_decoder_feeds
    from edgekit.plugins import get_model_family

    out = tmp_path / "bundle"
    build("cpu", out, model_dir=llava_dir.path, parity=False)
    (feed,) = record_decoder_feeds(out, 1)
    reporter = Reporter.from_bundle(out, threads=1)
    (calib,) = get_model_family().calibration_studies(1)
    study = Study(calib.frames, modality=calib.modality, uid_hash="uid:calib", source="dicom")
    layout = reporter.prompt(study.modality, "")
    backend = reporter.backend
    image = backend.encode_images(reporter.pixel_values(study))
    text = backend.embed(np.asarray([layout.ids], np.int64))
    want, _ = place_image(text, np.ones(text.shape[:2], np.int64), image, layout.image_slot)
    assert layout.image_slot == 2
    np.testing.assert_allclose(feed["inputs_embeds"], want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", ["llava", "smolvlm", "smolvlm-split", "llava_next"])
def test_orin_estimate_reads_an_imported_vlms_shape_from_its_own_config(tmp_path, llava_dir, family):
    """`edgekit x1/orin estimate BUNDLE` sizes an imported VLM by its text and vision configs, not by edgekit's
    own model config's defaults; a split image counts every tile through the tower."""
    from edgekit.build import build
    from edgekit.targets.orin.estimate import read_bundle

    tiles = 2 if family in ("smolvlm-split", "llava_next") else 0
    if family == "llava_next":
        vlm = make_llava_next(tmp_path / "hf", seed=1)
    else:
        vlm = llava_dir if family == "llava" else make_idefics3(tmp_path / "hf", family="smolvlm", seed=3, tiles=tiles)
    out = tmp_path / "bundle"
    build("cpu", out, model_dir=vlm.path, parity=False)
    shape = read_bundle(out)[0]
    text, vision = vlm.model.config.text_config, vlm.model.config.vision_config
    assert (shape.hidden, shape.layers, shape.heads, shape.kv_heads, shape.vocab) == (
        text.hidden_size,
        text.num_hidden_layers,
        text.num_attention_heads,
        text.num_key_value_heads,
        text.vocab_size,
    )
    assert shape.vision.hidden == vision.hidden_size and shape.vision.image_size == vision.image_size
    # llava: a 4 x 4 patch grid, every patch a token; smolvlm: 4 x 4 pixel-shuffled by 2 into 2 x 2, and split
    # 2 x 2 tiles + the global image, 4 tokens each; llava_next: the base 16, then 2 x 2 crops as an 8 x 8 grid
    # with a newline token per row (8 x 9)
    assert shape.vision.image_tokens == {"llava": 16, "smolvlm": 4, "smolvlm-split": 20, "llava_next": 88}[family]
    assert shape.vision.tiles == (5 if tiles else 1)
