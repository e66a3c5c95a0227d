"""TensorRT optimisation profiles (min / opt / max per dynamic input) for the three graphs, and the check that
refuses a request beyond them before any device work.

Static where the model allows: the image size and every hidden size are fixed by the model's config; batch,
prompt length and KV length vary, and so does the frame count below the model's own (1 .. num_frames: the
daemon's frame skipping hands the encoder fewer frames; the encoder pools over them). The decoder gets two
profiles, as LLM engines do: `prefill` (the whole prompt, empty KV cache) and `decode` (one token, a KV cache of
1 .. max_positions - 1). Each input dim is named by the exporter (`batch`, `seq`, `past_seq`, `total_seq`,
`frames`); an unknown name is refused rather than guessed.

Batch follows the continuous-batching engine (`edgekit.engine`), which calls the graphs in three ways: one decode
step for every decoding row at once (batch 1 .. max_batch), the images of the requests it admits together (the
vision encoder, 1 .. max_batch) and one prefill per request (batch 1: the engine never prefills two prompts in one
call, so the prefill profile is static in batch and TensorRT tunes it for that alone). `max_batch` is the plan's
setting (the manifest's `runtime.max_batch`, default 8 as the engine's), and the run side's `max_rows` is the
decode profile's batch maximum, so the engine never asks for more rows than the engines take.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import onnx

from edgekit import names
from edgekit.errors import ConfigError

PREFILL, DECODE, DEFAULT = "prefill", "decode", "default"
DEFAULT_MAX_BATCH = 8  # the engine's default max_batch (edgekit.engine.Engine, edgekitd's [engine] max_batch)
TYPICAL_PROMPT_TEXT = 16  # tokens of a typical indication, for the `opt` shapes


@dataclass(frozen=True)
class Limits:
    """What the profiles span. `opt_*` are the shapes TensorRT tunes its tactics for."""

    max_batch: int
    max_positions: int
    image_tokens: int
    frames: int
    opt_prompt: int  # image + typical prompt
    opt_kv: int  # half-way through a typical report

    @classmethod
    def of(cls, model_config: dict, generation_config: dict, preprocess: dict, max_batch: int = DEFAULT_MAX_BATCH):
        from edgekit import prompt as layout

        positions = layout.context_positions(model_config) or 0
        if positions < 2:
            raise ConfigError("the model config names no max_positions: TensorRT profiles need a maximum length")
        image_tokens = layout.image_tokens(model_config)  # an imported VLM's whole span, or edgekit's own count
        prompt = min(positions - 1, image_tokens + TYPICAL_PROMPT_TEXT)
        report = int(generation_config.get("max_new_tokens", 64))
        return cls(
            max_batch=max_batch,
            max_positions=positions,
            image_tokens=image_tokens,
            frames=int(preprocess.get("num_frames", model_config.get("num_frames", 1))),
            opt_prompt=prompt,
            opt_kv=min(positions - 1, prompt + report // 2),
        )


def typical_batch(max_batch: int) -> int:
    """The decode profile's `opt` batch: half the maximum, rounded up (4 of 8).

    TensorRT times its tactics at `opt` and runs them at any batch in [min, max], so `opt` should be where the
    steps spend their time. A loaded service (edgekitd's 8 workers into one engine) runs near the maximum, an idle
    one at 1, and the controllers (`edgekit.engine.control`) move between; the midpoint keeps both ends within a
    factor of two of the tuned shape. No Orin was available to time the alternatives: this is a choice, not a
    measurement (docs/orin.md)."""
    return max(1, (max_batch + 1) // 2)


def _dims(path: Path) -> dict[str, list[int | str]]:
    model = onnx.load(str(path), load_external_data=False)
    out = {}
    for i in model.graph.input:
        out[i.name] = [d.dim_param if d.dim_param else d.dim_value for d in i.type.tensor_type.shape.dim]
    return out


def _shape(dims: list[int | str], sizes: dict[str, tuple[int, int, int]], graph: str, name: str) -> dict:
    mins, opts, maxs = [], [], []
    for d in dims:
        if isinstance(d, int) and d > 0:
            lo = mid = hi = d
        elif d in sizes:
            lo, mid, hi = sizes[d]
        else:
            raise ConfigError(f"input {name} has a dimension '{d}' the orin profiles do not know", graph)
        mins.append(lo)
        opts.append(mid)
        maxs.append(hi)
    return {"min": mins, "opt": opts, "max": maxs}


def make_profiles(graphs: Mapping[str, Path], limits: Limits) -> dict[str, list[dict]]:
    """{role: [{"name", "shapes": {input: {"min", "opt", "max"}}}]} for the graphs `graphs` names by role."""
    if limits.max_batch < 1:
        raise ConfigError(f"max_batch must be >= 1, got {limits.max_batch}")
    b = (1, 1, limits.max_batch)  # images and embeddings: one request's, or several at once
    steps = (1, typical_batch(limits.max_batch), limits.max_batch)  # one decode step for every decoding row
    p, kv = limits.max_positions, limits.opt_kv
    text = (1, max(1, limits.opt_prompt - limits.image_tokens), p)
    prompt = (1, limits.opt_prompt, p)
    per_role = {
        names.VISION: [(DEFAULT, {"batch": b, "frames": (1, limits.frames, limits.frames)})],
        names.EMBED: [(DEFAULT, {"batch": b, "seq": text})],
        names.DECODER_ROLE: [
            (PREFILL, {"batch": (1, 1, 1), "seq": prompt, "past_seq": (0, 0, 0), "total_seq": prompt}),
            (DECODE, {"batch": steps, "seq": (1, 1, 1), "past_seq": (1, kv, p - 1), "total_seq": (2, kv + 1, p)}),
        ],
    }
    out = {}
    for role, path in graphs.items():  # a text model's bundle has no vision graph, nor its profile
        path = Path(path)
        dims = _dims(path)
        out[role] = [
            {"name": pname, "shapes": {n: _shape(d, sizes, path.name, n) for n, d in dims.items()}}
            for pname, sizes in per_role[role]
        ]
    return out


def graph_paths(folder: Path) -> dict[str, Path]:
    """The graphs of a folder that holds them under their standard names (a build's, a bundle's root): three, or a
    text model's two."""
    return {role: Path(folder) / names.GRAPH_FILES[role] for role in names.graph_roles_in(folder)}


def max_rows(decoder_profiles: list[dict]) -> int:
    """The most rows one decode step may carry: the decode profile's batch maximum (what the engine is told)."""
    decode = next(p for p in decoder_profiles if p["name"] == DECODE)
    return int(decode["shapes"][names.INPUTS_EMBEDS]["max"][0])


def is_static(profiles: list[dict]) -> bool:
    """DLA needs min = opt = max for every input of every profile."""
    return all(s["min"] == s["opt"] == s["max"] for prof in profiles for s in prof["shapes"].values())


class ProfileError(ConfigError):
    """A request shape no optimisation profile of the engine covers."""

    code = "beyond_profile"
    http_status = 422


def select_profile(profiles: list[dict], shapes: dict[str, tuple[int, ...]], role: str, where=None) -> int:
    """The index of the first profile covering `shapes`, or a one-line refusal naming the input and its bound in
    the profile that misses by the fewest axes (the first such): a decode step of too many rows is refused by
    the decode profile's batch bound, not by the prefill profile, which misses on more."""
    closest: tuple[int, tuple] | None = None
    for i, prof in enumerate(profiles):
        misses = []
        for name, shape in shapes.items():
            bounds = prof["shapes"].get(name)
            if bounds is None:
                continue
            for axis, (n, lo, hi) in enumerate(zip(shape, bounds["min"], bounds["max"])):
                if not lo <= n <= hi:
                    misses.append((name, axis, n, lo, hi, prof["name"]))
        if not misses:
            return i
        if closest is None or len(misses) < closest[0]:
            closest = (len(misses), misses[0])
    if closest is None:
        raise ProfileError(f"the {role} engine has no optimisation profiles (runtime.profiles in the manifest)", where)
    name, axis, n, lo, hi, pname = closest[1]
    if role == names.DECODER_ROLE and name == names.INPUTS_EMBEDS and axis == 1 and n > hi:
        reason = f"a prompt of {n} positions (image and text) is longer than the engine's maximum of {hi}"
    else:
        reason = f"input {name} has size {n} on axis {axis}, outside the engine's profile [{lo}, {hi}]"
    raise ProfileError(f"{reason} ({role} profile '{pname}', runtime.profiles in the manifest)", where)
