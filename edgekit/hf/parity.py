"""An imported VLM's graphs against transformers' own model of the same directory: the build's parity figure.

The same grey image and prompt go to both: to ONNX Runtime as edgekit serves it (display values; the vision
graph normalises), to transformers as its image processor would hand them over (the frame as RGB, normalised
per channel) with the image span in `input_ids`. Compared: the prefill logits (max |error| relative to the
largest logit) and greedy tokens from `generate()`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .vlm import VlmSpec

NOT_MEASURED = {
    "measured": False,
    "source": "not measured: needs PyTorch and transformers (pip install 'edgekit[train]')",
}


def hf_pixel_values(spec: VlmSpec, gray: np.ndarray) -> np.ndarray:
    """(S, S) in [0, 1] -> transformers' pixel_values for one image (llava: (1, C, S, S); idefics3: (1, 1, C, S, S))."""
    c = spec.tower.channels
    mean = np.asarray(spec.image_mean, np.float32)[:, None, None]
    std = np.asarray(spec.image_std, np.float32)[:, None, None]
    x = ((np.repeat(gray[None], c, axis=0) - mean) / std)[None].astype(np.float32)
    return x if spec.family == "llava" else x[None]


def compare(model, backend, spec: VlmSpec, gray: np.ndarray, text_ids: list[int], new_tokens: int) -> dict:
    """One case: relative logit error of the prefill and whether greedy tokens agree."""
    import torch

    from edgekit.generate import GenerationOptions, generate

    ids = torch.tensor([[*spec.span_ids, *text_ids]])
    pv = torch.tensor(hf_pixel_values(spec, gray))
    with torch.no_grad():
        ref = model(input_ids=ids, pixel_values=pv).logits[0].float().numpy()
        theirs = model.generate(
            input_ids=ids, pixel_values=pv, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None
        )[0, ids.shape[1] :].tolist()
    pixels = gray[None, None, None].astype(np.float32)
    x = np.concatenate([backend.encode_images(pixels), backend.embed(np.asarray([text_ids], np.int64))], axis=1)
    n = x.shape[1]
    got, _ = backend.decode(x, np.ones((1, n), np.int64), np.arange(n, dtype=np.int64)[None], None)
    ours = generate(backend, pixels, np.asarray([text_ids]), GenerationOptions(max_new_tokens=new_tokens)).token_ids
    return {
        "rel_logit_error": float(np.abs(got[0] - ref).max() / max(float(np.abs(ref).max()), 1e-12)),
        "greedy_identical": ours == theirs,
    }


def measure_hf_parity(onnx_dir: Path, model_dir: Path, spec: VlmSpec, samples: int = 4, new_tokens: int = 8) -> dict:
    try:
        import torch
        import transformers
    except ImportError:
        return dict(NOT_MEASURED)
    from edgekit.ort import CpuBackend

    model = transformers.AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    backend = CpuBackend.from_dir(onnx_dir)
    rng = np.random.default_rng(0)
    specials = {*spec.span_ids}
    vocab = [i for i in range(spec.decoder.vocab_size) if i not in specials]
    cases = [
        compare(
            model,
            backend,
            spec,
            rng.uniform(0, 1, (spec.image_size, spec.image_size)).astype(np.float32),
            [int(t) for t in rng.choice(vocab, 8)],
            new_tokens,
        )
        for _ in range(samples)
    ]
    return {
        "measured": True,
        "max_rel_logit_error": max(c["rel_logit_error"] for c in cases),
        "greedy_identical": sum(c["greedy_identical"] for c in cases) / len(cases),
        "samples": samples,
        "source": f"ONNX Runtime CPU vs transformers {transformers.__version__} (float32) of the same directory, "
        f"{samples} random grey images x 8-token prompts, prefill logits and {new_tokens} greedy tokens",
    }
