"""An imported decoder's graphs against transformers' own model of the same directory: a text bundle's parity figure.

Each case is the prompt the bundle serves (its chat template around a prompt, `edgekit.prompt`) with random tokens
before its last token, fed as token ids to both: to ONNX Runtime through the engine, to transformers'
`AutoModelForCausalLM`. Compared: the prefill logits (max |error| relative to the largest logit) and the greedy
tokens of `generate()`, neither side stopping at the end token, so every case compares `new_tokens` tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .parity import NOT_MEASURED


def compare_text(model, backend, ids: list[int], new_tokens: int) -> dict:
    """One case: relative logit error of the prefill and whether greedy tokens agree."""
    import torch

    from edgekit.generate import GenerationOptions, generate

    x = torch.tensor([ids])
    with torch.no_grad():
        ref = model(input_ids=x).logits[0].float().numpy()
        theirs = model.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(ids) :].tolist()
    text = np.asarray([ids], np.int64)
    got, _ = backend.decode(backend.embed(text), np.ones_like(text), np.arange(len(ids))[None], None)
    ours = generate(backend, None, text, GenerationOptions(max_new_tokens=new_tokens)).token_ids
    return {
        "rel_logit_error": float(np.abs(got[0] - ref).max() / max(float(np.abs(ref).max()), 1e-12)),
        "greedy_identical": ours == theirs,
    }


def measure_text_parity(
    onnx_dir: Path, model_dir: Path, generation_config: Path, samples: int = 4, new_tokens: int = 8
) -> dict:
    """The build's parity figure for a decoder's graphs in `onnx_dir`, served with `generation_config` (the
    bundle's, written by `text_serving`); a note saying why when torch or transformers is missing."""
    try:
        import torch
        import transformers
    except ImportError:
        return dict(NOT_MEASURED)
    from tokenizers import Tokenizer

    from edgekit import names
    from edgekit.ort import CpuBackend
    from edgekit.prompt import prompt_layout

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    d = Path(onnx_dir)
    backend = CpuBackend(None, d / names.EMBED_TOKENS, d / names.DECODER)
    tokenizer = Tokenizer.from_file(str(Path(model_dir) / names.WEIGHT_FILES["tokenizer"]))
    gen = json.loads(Path(generation_config).read_text())
    base = prompt_layout(tokenizer, gen, "", "Findings.").ids
    rng = np.random.default_rng(0)
    vocab = int(model.config.vocab_size)
    cases = []
    for _ in range(samples):  # the served prompt, 8 random tokens before its last token (the template's <sep>)
        ids = [*base[:-1], *(int(t) for t in rng.integers(0, vocab, 8)), base[-1]]
        cases.append(compare_text(model, backend, ids, new_tokens))
    return {
        "measured": True,
        "max_rel_logit_error": max(c["rel_logit_error"] for c in cases),
        "greedy_identical": sum(c["greedy_identical"] for c in cases) / len(cases),
        "samples": samples,
        "source": f"ONNX Runtime CPU vs transformers {transformers.__version__} (float32) of the same directory, "
        f"{samples} prompts (the chat template around 8 random tokens), prefill logits and {new_tokens} greedy "
        "tokens",
    }
