"""An imported VLM's graphs against transformers' own model of the same directory: the build's parity figure.

The same grey image and prompt go to both: to ONNX Runtime as edgekit serves it (display values; the vision
graph normalises; the image at the bundle's image slot), to transformers as its processor would hand them over
(the frame as RGB, normalised per channel; the image span in `input_ids` where the chat template's image token
stands). Each case's prompt is the bundle's own template around random tokens. Compared: the prefill logits (max
|error| relative to the largest logit) and greedy tokens from `generate()`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .family import family_named, family_of
from .spec_base import VlmSpecBase

NOT_MEASURED = {
    "measured": False,
    "source": "not measured: needs PyTorch and transformers (pip install 'edgekit[train]')",
}


def hf_pixel_values(spec: VlmSpecBase, gray: np.ndarray) -> np.ndarray:
    """(S, S) in [0, 1] -> transformers' pixel_values for one image, as the family's processor writes them."""
    return family_named(spec.family).hf_pixel_values(spec, gray)


def hf_image_inputs(spec: VlmSpecBase, gray: np.ndarray) -> dict:
    """The image keyword arguments transformers' model takes for one frame, as the family's processor gives them
    (`edgekit.hf.family`: pixel values, LLaVA-NeXT's `image_sizes`, Qwen2-VL's `image_grid_thw`)."""
    return family_named(spec.family).hf_image_inputs(spec, gray)


def hf_token_inputs(spec, ids) -> dict:
    """What else transformers' model takes with `input_ids` (Qwen2-VL's `mm_token_type_ids`); none for a spec
    without a family (a decoder alone, fine-tuning's text-only spec)."""
    family = family_of(spec)
    return family.hf_token_inputs(spec, ids) if family else {}


def compare(
    model, backend, spec: VlmSpecBase, gray: np.ndarray, text_ids: list[int], new_tokens: int, slot: int = 0
) -> dict:
    """One case (the image before text token `slot`): relative logit error of the prefill and whether greedy
    tokens agree."""
    import torch

    from edgekit.generate import GenerationOptions, generate, place_image

    ids = torch.tensor([[*text_ids[:slot], *spec.span_ids, *text_ids[slot:]]])
    images = {**hf_image_inputs(spec, gray), **hf_token_inputs(spec, ids)}
    scheme = spec.positions  # Qwen2-VL: M-RoPE; the rest: text
    with torch.no_grad():
        ref = model(input_ids=ids, **images).logits[0].float().numpy()
        theirs = model.generate(input_ids=ids, **images, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None)[
            0, ids.shape[1] :
        ].tolist()
    pixels = gray[None, None, None].astype(np.float32)
    text = np.asarray([text_ids], np.int64)
    x, mask = place_image(backend.embed(text), np.ones_like(text), backend.encode_images(pixels), slot)
    got, _ = backend.decode(x, mask, scheme.prefill(mask, slot, x.shape[1] - text.shape[1])[0], None)
    options = GenerationOptions(max_new_tokens=new_tokens)
    ours = generate(backend, pixels, text, options, image_slot=slot, positions=scheme).token_ids
    return {
        "rel_logit_error": float(np.abs(got[0] - ref).max() / max(float(np.abs(ref).max()), 1e-12)),
        "greedy_identical": ours == theirs,
    }


def measure_hf_parity(
    onnx_dir: Path, model_dir: Path, spec: VlmSpecBase, samples: int = 4, new_tokens: int = 8
) -> dict:
    try:
        import torch
        import transformers
    except ImportError:
        return dict(NOT_MEASURED)
    from tokenizers import Tokenizer

    from edgekit import names
    from edgekit.ort import CpuBackend
    from edgekit.prompt import prompt_layout

    from .serving import generation_config

    model = transformers.AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    backend = CpuBackend.from_dir(onnx_dir)
    tokenizer = Tokenizer.from_file(str(Path(model_dir) / names.WEIGHT_FILES["tokenizer"]))
    layout = prompt_layout(tokenizer, generation_config(spec, Path(model_dir), tokenizer), "", "")
    rng = np.random.default_rng(0)
    specials = {*spec.span_ids}
    vocab = [i for i in range(spec.decoder.vocab_size) if i not in specials]
    cases = []
    for _ in range(samples):  # the template's tokens, the image in its slot, 8 random tokens right after it
        ids, slot = layout.ids, layout.image_slot
        text = [*ids[:slot], *(int(t) for t in rng.choice(vocab, 8)), *ids[slot:]]
        gray = rng.uniform(0, 1, (spec.image_size, spec.image_size)).astype(np.float32)
        cases.append(compare(model, backend, spec, gray, text, new_tokens, slot))
    return {
        "measured": True,
        "max_rel_logit_error": max(c["rel_logit_error"] for c in cases),
        "greedy_identical": sum(c["greedy_identical"] for c in cases) / len(cases),
        "samples": samples,
        "source": f"ONNX Runtime CPU vs transformers {transformers.__version__} (float32) of the same directory, "
        f"{samples} random grey images x the chat template around 8 random tokens (the image in the template's "
        f"place), prefill logits and {new_tokens} greedy tokens",
    }
