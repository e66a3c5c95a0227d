"""A bundle's own reference outputs (`reference.json`): what the just-built bundle generated, greedily, for one
fixed input, so a device can check that the bundle it received still writes the same tokens before serving it.

Why in the bundle: the manifest lists it with its sha256 like every other file, so a signature covers it, and a
bundle whose weights were changed and re-manifested (every checksum passes) is still caught by its own outputs.
The input travels in the file too (a study's frames as 8-bit values, zlib and base64; a text model's prompt), so
the check does not depend on the generator or the package that made it on the build machine.

- A vision-language bundle: the packaged sample study `models/samples/cr_chest` (the `sample` split's study 58,
  remade by the default model family's `calibration_studies`, as the build's calibration passes reach studies),
  with a fixed prompt. A text model's bundle: a fixed prompt.
- The tokens are greedy (temperature 0), at most `NEW_TOKENS`, with the bundle's stop token.
- The tolerance: on the engine that made them (`engine`), every token must match; on another engine of the same
  target (orin's TensorRT against ONNX Runtime at build time), the first `OTHER_ENGINE_TOKENS`, since FP16 kernels
  may break a near tie later in a sequence.

`write_reference` runs at build time (`edgekit.build`); `check_reference` runs on the device, in edgekitd's
rollout gate. A bundle without the file (built before it existed) passes with the note "no reference outputs".
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import logging
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edgekit.errors import BundleError, EdgekitError

if TYPE_CHECKING:
    from edgekit.reporter import Reporter

log = logging.getLogger(__name__)

REFERENCE_ROLE = "reference"
REFERENCE_FILE = "reference.json"
SCHEMA = "edgekit.reference/1"
NEW_TOKENS = 24
OTHER_ENGINE_TOKENS = 4
SAMPLE_SPLIT, SAMPLE_INDEX = "sample", 58  # models/samples/cr_chest (models/samples/cr_chest.json: sample-00058)
STUDY_PROMPT = "Follow-up."
TEXT_PROMPT = "Chest radiograph. Findings: left lung consolidation, right pleural effusion. Write the report."
NO_REFERENCE = "no reference outputs"


class ReferenceMismatchError(BundleError):
    """The bundle, run here, does not write the tokens it wrote when it was built."""

    code = "reference_mismatch"


# --- the input ---------------------------------------------------------------------------------------------------
def _encode_frames(frames: np.ndarray) -> dict[str, Any]:
    """Display frames (T, H, W) in [0, 1] as 8-bit values: exact to carry, and the model sees them as stored."""
    pixels = np.round(np.clip(np.asarray(frames, np.float32), 0.0, 1.0) * 255.0).astype(np.uint8)
    raw = pixels.tobytes()
    return {
        "shape": list(pixels.shape),
        "dtype": "uint8",
        "scale": 255,
        "encoding": "zlib+base64",
        "sha256": hashlib.sha256(raw).hexdigest(),
        "data": base64.b64encode(zlib.compress(raw, 9)).decode("ascii"),
    }


def _decode_frames(entry: dict[str, Any], where: Path) -> np.ndarray:
    try:
        raw = zlib.decompress(base64.b64decode(entry["data"]))
        shape = tuple(int(n) for n in entry["shape"])
        if hashlib.sha256(raw).hexdigest() != entry["sha256"]:
            raise ValueError("sha256 differs")
        pixels = np.frombuffer(raw, np.uint8).reshape(shape)
    except (KeyError, TypeError, ValueError, zlib.error) as err:
        raise BundleError(f"{REFERENCE_FILE}: the reference study's frames cannot be read ({err})", where) from None
    return pixels.astype(np.float32) / float(entry.get("scale", 255))


@functools.cache
def _sample_frames() -> tuple[np.ndarray, str]:
    """The packaged sample study, remade by the default model family (the core names no family); once a process."""
    from edgekit.plugins import get_model_family

    study = get_model_family().calibration_studies(1, split=SAMPLE_SPLIT, start=SAMPLE_INDEX)[0]
    return np.asarray(study.frames, np.float32), study.modality


def _cases(text: bool) -> list[dict[str, Any]]:
    if text:
        return [{"name": "fixed prompt", "kind": "prompt", "prompt": TEXT_PROMPT, "max_new_tokens": NEW_TOKENS}]
    frames, modality = _sample_frames()
    return [
        {
            "name": "sample study cr_chest",
            "kind": "study",
            "source": f"models/samples/cr_chest: the {SAMPLE_SPLIT} split's study {SAMPLE_INDEX}",
            "modality": modality,
            "prompt": STUDY_PROMPT,
            "frames": _encode_frames(frames),
            "max_new_tokens": NEW_TOKENS,
        }
    ]


# --- running a case ----------------------------------------------------------------------------------------------
def run_case(reporter: Reporter, case: dict[str, Any], where: Path) -> list[int]:
    """The greedy tokens `reporter` generates for one case (no meter runs: nothing is billed)."""
    from edgekit.ingest import Study

    options = reporter.options(max_new_tokens=int(case["max_new_tokens"]))
    pixels = None
    if case["kind"] == "study":
        frames = _decode_frames(case["frames"], where)
        study = Study(frames, modality=str(case["modality"]), uid_hash="uid:reference", source="dicom")
        fitted = reporter.fit_prompt(study.modality, str(case["prompt"]), options)
        pixels = reporter.pixel_values(study)
    else:
        fitted = reporter.fit_prompt("", str(case["prompt"]), options)
    ids = np.asarray([fitted.layout.ids], dtype=np.int64)
    result, _ = reporter.generate(pixels, ids, fitted.options, None, fitted.layout.image_slot)
    return [int(t) for t in result.token_ids]


def reference_engine(target) -> str | None:
    """The engine the reference is made with: ONNX Runtime where the target has it (orin's reference for its
    TensorRT engines, and runnable on any build machine), else the target's own."""
    engines = tuple(getattr(target, "engines", ()))
    return "onnxruntime" if "onnxruntime" in engines else (engines[0] if engines else None)


# --- build time --------------------------------------------------------------------------------------------------
def write_reference(bundle_path: Path, out: Path, say: Callable[[str], None] | None = None) -> dict[str, Path]:
    """Run the just-built bundle at `bundle_path` on the reference input(s) and write `out` (`reference.json`);
    returns `{REFERENCE_ROLE: out}` for the bundle's components, or {} (with a note) when its target's run side
    cannot load here."""
    from edgekit.bundle import load_bundle
    from edgekit.plugins import get_target
    from edgekit.reporter import Reporter
    from edgekit.target import RuntimeOptions

    say = say or (lambda _msg: None)
    bundle = load_bundle(bundle_path)
    engine = reference_engine(get_target(bundle.target))
    say(f"reference: greedy tokens of the built bundle on {engine or bundle.target}")
    try:
        reporter = Reporter.from_bundle(bundle, runtime=RuntimeOptions(threads=1, engine=engine))
    except EdgekitError as err:
        say(f"reference: not written: the bundle does not run here ({err.reason})")
        log.warning("no reference outputs written: %s", err)
        return {}
    try:
        cases = _cases(reporter.is_text)
        for case in cases:
            case["token_ids"] = run_case(reporter, case, out)
    except EdgekitError as err:  # a prompt the model's context cannot take, say: the bundle itself is fine
        say(f"reference: not written: the reference input does not run ({err.reason})")
        log.warning("no reference outputs written: %s", err)
        return {}
    finally:
        reporter.close()
    doc = {
        "schema": SCHEMA,
        "target": bundle.target,
        "engine": engine,
        "tolerance": {
            "same_engine_tokens": "all",
            "other_engine_tokens": OTHER_ENGINE_TOKENS,
            "note": f"greedy token ids; on engine {engine!r} every token must match, on another engine of the "
            f"target the first {OTHER_ENGINE_TOKENS}",
        },
        "cases": cases,
    }
    out.write_text(json.dumps(doc, indent=1) + "\n")
    return {REFERENCE_ROLE: out}


# --- on the device -----------------------------------------------------------------------------------------------
def read_reference(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise BundleError(f"{REFERENCE_FILE} cannot be read ({type(err).__name__})", path) from None
    ok = isinstance(doc, dict) and doc.get("schema") == SCHEMA and isinstance(doc.get("cases"), list)
    ok = ok and all(
        isinstance(c, dict) and isinstance(c.get("token_ids"), list) and c.get("kind") in ("study", "prompt")
        for c in doc["cases"]
    )
    if not ok:
        raise BundleError(f"{REFERENCE_FILE} is not an {SCHEMA} document", path)
    return doc


def first_difference(got: list[int], want: list[int], count: int) -> int | None:
    """The first position among the first `count` of `want` where `got` differs (or has ended); None if none."""
    for i in range(min(count, len(want))):
        if i >= len(got) or got[i] != want[i]:
            return i
    return None


def check_reference(reporter: Reporter, engine: str | None) -> dict[str, Any]:
    """Run the loaded bundle on its own reference input(s) and compare with the tokens stored at build time;
    `engine`: the one `reporter` runs on. Raises `ReferenceMismatchError` naming the file and the first position
    that differs; a bundle without the file passes with the note "no reference outputs"."""
    bundle = reporter.bundle
    if REFERENCE_ROLE not in bundle.manifest.components:
        return {"checked": False, "note": NO_REFERENCE}
    path = bundle.component(REFERENCE_ROLE)
    doc = read_reference(path)
    same = engine == doc.get("engine")
    compared = 0
    for case in doc["cases"]:
        want = [int(t) for t in case["token_ids"]]
        count = len(want) if same else min(len(want), int(doc["tolerance"].get("other_engine_tokens", 1)))
        got = run_case(reporter, case, path)
        pos = first_difference(got, want, count)
        if pos is not None:
            here = f"token {got[pos]}" if pos < len(got) else "the end of the output"
            raise ReferenceMismatchError(
                f"{REFERENCE_FILE}: case {case.get('name')!r} differs at token position {pos}: {here} on "
                f"{engine or bundle.target}, token {want[pos]} in the reference (made on {doc.get('engine')}; "
                f"{count} tokens must match)",
                path,
            )
        compared += count
    return {
        "checked": True,
        "cases": len(doc["cases"]),
        "tokens_compared": compared,
        "engine": engine,
        "reference_engine": doc.get("engine"),
    }
