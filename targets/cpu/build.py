"""The cpu target's build side: the portable graphs ship as the recipe left them, plus the fused decoder.

The portable `decoder_model_merged.onnx` stays in the bundle (other runtimes' parity, `edgekit eval` references,
and the `decoder = "portable"` runtime setting). Beside it goes `decoder_cpu.onnx` (role `cpu_decoder`): the same
decoder lowered onto ONNX Runtime's fused CPU kernels (`fused.py`), which the run side serves with its KV cache
bound in place (`slots.py`). The build measures the two against each other on a short greedy run and stamps the
result into the bundle's figures; a decoder the lowering cannot read (a graph that is not the portable export's
layout) ships without the fused one, the reason recorded in the build steps.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import onnx_ir as ir

from edgekit import names
from edgekit.export.save import save_model
from edgekit.prompt import context_positions
from edgekit.target import BuildInputs, TargetBuild

from .fused import ACCURACY_LEVEL, FUSED_DECODER, FUSED_ROLE, ROPE_POSITIONS, FuseCpuDecoder, NotPortable
from .runtime import FUSED, PORTABLE

WORK_DIR = "cpu-fused"
CHECK_PROMPT, CHECK_STEPS = 16, 8  # the build's fused-vs-portable check: a prompt, then greedy steps


def prepare(inputs: BuildInputs) -> TargetBuild:
    decoder = inputs.graphs / names.DECODER
    t0 = time.perf_counter()
    model = ir.load(decoder)
    lowering = FuseCpuDecoder(max_positions=model_positions(inputs.model_dir))
    try:
        lowering(model)
    except NotPortable as err:
        inputs.say(f"cpu: no fused decoder, the portable one serves ({err.reason})")
        return _portable(inputs, err.reason)
    inputs.say("cpu: decoder lowered onto ONNX Runtime's fused kernels (GroupQueryAttention, in-place KV cache)")
    fused = save_model(model, inputs.work / WORK_DIR / FUSED_DECODER)
    seconds = time.perf_counter() - t0
    components = {FUSED_ROLE: fused}
    data = fused.with_name(fused.name + ".data")
    if data.is_file():
        components[f"{FUSED_ROLE}_data"] = data
    inputs.say("cpu: fused decoder against the portable one (greedy, teacher-forced)")
    try:
        check = fused_parity(inputs.graphs, fused)
    except Exception as exc:  # ORT refuses a kernel's shape or layout at load or run: the portable decoder serves
        reason = f"ONNX Runtime cannot run the fused decoder: {_last_line(exc)}"
        inputs.say(f"cpu: no fused decoder, the portable one serves ({reason})")
        return _portable(inputs, reason)
    ops: dict[str, int] = {}
    for node in model.graph:
        ops[node.op_type] = ops.get(node.op_type, 0) + 1
    step = {
        "name": "cpu_fuse",
        "params": {
            "accuracy_level": ACCURACY_LEVEL,
            "fuse_norms": True,
            "pack_qkv": True,
            "rope_positions": model.metadata_props.get(ROPE_POSITIONS),
        },
        "ops": dict(sorted(ops.items())),
        "seconds": round(seconds, 3),
    }
    figures = {
        "cpu_fused_parity": {
            **check,
            "source": f"ONNX Runtime CPU: {FUSED_DECODER} against {names.DECODER} on a {CHECK_PROMPT}-token prompt "
            f"and {CHECK_STEPS} greedy steps fed the portable decoder's tokens; logits of each step's last position",
        }
    }
    return TargetBuild(
        graphs=inputs.graphs, components=components, figures=figures, steps=[step], runtime={"decoder": FUSED}
    )


def model_positions(model_dir: Path) -> int | None:
    """The model's whole context from its config.json (None when it does not say): the rows of the fused
    decoder's RoPE tables, which the reporter's context budget keeps every request within."""
    path = model_dir / names.WEIGHT_FILES["model_config"]
    try:
        return context_positions(json.loads(path.read_text())) if path.is_file() else None
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError, ValueError):
        return None


def _portable(inputs: BuildInputs, reason: str) -> TargetBuild:
    """The bundle without a fused decoder: the portable one serves, and the build steps say why."""
    return TargetBuild(
        graphs=inputs.graphs, steps=[{"name": "cpu_fuse", "skipped": reason}], runtime={"decoder": PORTABLE}
    )


def _last_line(exc: BaseException) -> str:
    """ORT's own reason: the last line of its message (the lines before it name the node and the kernel)."""
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__


def fused_parity(graphs: Path, fused: Path, *, prompt: int = CHECK_PROMPT, steps: int = CHECK_STEPS) -> dict:
    """The fused decoder's logits against the portable decoder's on the same tokens: the largest difference,
    relative to the largest logit, and how many greedy choices agree."""
    from edgekit.ort import CpuBackend
    from edgekit.positions import for_rank

    from .slots import CpuSlotBackend

    portable = CpuBackend(None, graphs / names.EMBED_TOKENS, graphs / names.DECODER, intra_op_threads=1)
    candidate = CpuSlotBackend(
        fused, graphs / names.EMBED_TOKENS, None, max_rows=1, capacity=prompt + steps, intra_op_threads=1
    )
    rank = 3 if candidate.signature.mrope else 2
    vocab = candidate.signature.vocab
    ids = np.random.default_rng(0).integers(min(5, vocab - 1), vocab, (1, prompt))
    x = portable.embed(ids)
    pos = np.arange(prompt)[None]
    want, past = portable.decode(x, np.ones((1, prompt), np.int64), for_rank(pos, rank), None)
    got = candidate.prefill(0, x, for_rank(pos, rank))
    worst, scale, agree = 0.0, 0.0, 0
    for i in range(steps + 1):
        w = want[0, -1]
        worst, scale = max(worst, float(np.abs(w - got).max())), max(scale, float(np.abs(w).max()))
        token = int(w.argmax())
        agree += token == int(got.argmax())
        if i == steps:
            break
        x, p = portable.embed(np.array([[token]])), for_rank(np.array([[prompt + i]]), rank)
        want, past = portable.decode(x, np.ones((1, prompt + i + 1), np.int64), p, past)
        got = candidate.step([0], x, p)[0]
    return {"max_abs": worst, "max_rel": worst / scale if scale else 0.0, "greedy_agree": f"{agree}/{steps + 1}"}
