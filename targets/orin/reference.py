"""Reference inputs and outputs for parity, made at build time and shipped in the bundle (`orin_reference.npz`).

Four cases, one per way the engines are called: the vision encoder on one study's pixels, the embedding table on
a prompt, a decoder prefill over image + prompt with an empty KV cache, and one decode step on the KV cache that
prefill made (a text model's bundle: no vision case, a prefill over the prompt alone). The decoder's inputs come
from the FP32 export (so every variant of a model is checked on the same inputs); the outputs stored are the orin
graphs' own, from ONNX Runtime on cpu: what `edgekit engine check` compares a TensorRT engine with, as
`polygraphy run --trt --onnxrt` does.

`compare` is the one comparison, used for the build's parity figure (orin graphs vs FP32 export, vs the recipe's
graphs) and for the engine check.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from edgekit import names
from edgekit.ort import session_options
from edgekit.positions import for_rank

CASES = ("vision_encoder", "embed_tokens", "decoder:prefill", "decoder:decode")
ROLE_OF = {"vision_encoder": names.VISION, "embed_tokens": names.EMBED, "decoder:prefill": names.DECODER_ROLE}
ROLE_OF["decoder:decode"] = names.DECODER_ROLE
PROMPT_TOKENS = 12


def _session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), session_options(intra_op_threads=1), providers=["CPUExecutionProvider"])


def _run(session: ort.InferenceSession, feeds: dict) -> dict[str, np.ndarray]:
    out_names = [o.name for o in session.get_outputs()]
    return dict(zip(out_names, session.run(out_names, feeds)))


def make_inputs(fp32: Path, *, frames: int, image_size: int, vocab: int, seed: int = 0) -> dict[str, dict]:
    """{case: {input name: array}}, decoder inputs computed by the FP32 graphs in `fp32`."""
    rng = np.random.default_rng(seed)
    pixels = rng.uniform(-1, 1, (1, frames, 1, image_size, image_size)).astype(np.float32)
    ids = rng.integers(4, vocab, (1, PROMPT_TOKENS)).astype(np.int64)
    vision = fp32 / names.VISION_ENCODER if (fp32 / names.VISION_ENCODER).is_file() else None
    embed = _session(fp32 / names.EMBED_TOKENS)
    text = _run(embed, {names.INPUT_IDS: ids})[names.INPUTS_EMBEDS]
    if vision is not None:
        image = _run(_session(vision), {names.PIXEL_VALUES: pixels})[names.IMAGE_FEATURES]
        text = np.concatenate([image, text], axis=1)
    x = text
    t = x.shape[1]
    decoder = _session(fp32 / names.DECODER)
    kv = {i.name: i.shape for i in decoder.get_inputs() if i.name.startswith(names.PAST_PREFIX)}
    rank = next(len(i.shape) for i in decoder.get_inputs() if i.name == names.POSITION_IDS)  # 3: M-RoPE
    empty = {n: np.zeros((1, s[1], 0, s[3]), np.float32) for n, s in kv.items()}
    prefill = {
        names.INPUTS_EMBEDS: x,
        names.ATTENTION_MASK: np.ones((1, t), np.int64),
        names.POSITION_IDS: for_rank(np.arange(t, dtype=np.int64)[None], rank),
        **empty,
    }
    out = _run(decoder, prefill)
    token = out[names.LOGITS][:, -1].argmax(-1)[:, None].astype(np.int64)
    decode = {
        names.INPUTS_EMBEDS: _run(embed, {names.INPUT_IDS: token})[names.INPUTS_EMBEDS],
        names.ATTENTION_MASK: np.ones((1, t + 1), np.int64),
        names.POSITION_IDS: for_rank(np.array([[t]], np.int64), rank),
        **{n: out[names.PRESENT_PREFIX + n[len(names.PAST_PREFIX) :]] for n in kv},
    }
    return {
        **({"vision_encoder": {names.PIXEL_VALUES: pixels}} if vision is not None else {}),
        "embed_tokens": {names.INPUT_IDS: ids},
        "decoder:prefill": prefill,
        "decoder:decode": decode,
    }


def run_cases(graphs: Path, inputs: dict[str, dict]) -> dict[str, dict[str, np.ndarray]]:
    """Every case through the graphs in `graphs` (ONNX Runtime, cpu)."""
    sessions = {role: _session(graphs / names.GRAPH_FILES[role]) for role in names.graph_roles_in(graphs)}
    return {case: _run(sessions[ROLE_OF[case]], feeds) for case, feeds in inputs.items()}


def save(path: Path, inputs: dict, outputs: dict) -> Path:
    arrays = {f"{c}/in/{n}": a for c, feeds in inputs.items() for n, a in feeds.items()}
    arrays |= {f"{c}/out/{n}": a for c, outs in outputs.items() for n, a in outs.items()}
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    return path


def load(path: Path) -> tuple[dict[str, dict], dict[str, dict]]:
    inputs: dict[str, dict] = {}
    outputs: dict[str, dict] = {}
    with np.load(path) as data:
        for key in data.files:
            case, kind, name = key.split("/", 2)
            (inputs if kind == "in" else outputs).setdefault(case, {})[name] = data[key]
    return inputs, outputs


def compare(got: dict[str, dict], want: dict[str, dict]) -> dict[str, dict]:
    """Per case: the worst relative L2 error and max |error| over its outputs, and for logits the share of
    positions whose top-1 token agrees."""
    out = {}
    for case, ref in want.items():
        worst, max_abs, top1 = 0.0, 0.0, None
        for name, w in ref.items():
            g = np.asarray(got[case][name], np.float64)
            w = np.asarray(w, np.float64)
            if w.size == 0:
                continue
            diff = g - w
            worst = max(worst, float(np.linalg.norm(diff) / (np.linalg.norm(w) or 1.0)))
            max_abs = max(max_abs, float(np.abs(diff).max()))
            if name == names.LOGITS:
                top1 = float((g.argmax(-1) == w.argmax(-1)).mean())
        out[case] = {"rel_l2": round(worst, 6), "max_abs": round(max_abs, 6)}
        if top1 is not None:
            out[case]["logits_top1"] = round(top1, 4)
    return out


def within(metrics: dict[str, dict], tolerance: dict) -> list[str]:
    """The cases outside the plan's tolerance, each as a short reason (empty: all pass)."""
    bad = []
    for case, m in metrics.items():
        if m["rel_l2"] > tolerance["rel_l2"]:
            bad.append(f"{case}: relative error {m['rel_l2']:.4g} > {tolerance['rel_l2']}")
        if m.get("logits_top1") is not None and m["logits_top1"] < tolerance["logits_top1"]:
            bad.append(f"{case}: top-1 agreement {m['logits_top1']:.3f} < {tolerance['logits_top1']}")
    return bad
