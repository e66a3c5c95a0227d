"""What a bundle of an imported VLM carries beside its graphs so that the reporter and edgekitd serve it as they
serve radreport-tiny: the model's own `tokenizer.json`, an edgekit `generation_config.json` holding its chat
template, a `preprocessor_config.json` with its image processing, and its `config.json`.

Why derive a template instead of running the model's Jinja chat template at serving time: the runtime assembles
every prompt in one place (`edgekit.prompt`: `<bos> + template(prompt) + <sep>`), with no Jinja and no
transformers on the device. So the chat template is rendered once here, at build time, for one user turn with an
image, and cut into that shape; the cut is checked by tokenizing both ways, and a template that does not fit is
refused rather than served differently. The template keeps the model's image token where the chat template puts
it (`image_token`), and the runtime puts the image span there, as the model's processor does. A decoder alone (a
text model) is served through the same cut, without the image (`text_serving`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from edgekit import names
from edgekit.errors import ConfigError
from edgekit.positions import MROPE, POSITIONS_KEY
from edgekit.prompt import IMAGE_TOKEN, prompt_layout

from .config import language_model_config, read_config_file
from .family import family_named
from .spec_base import VlmSpecBase

SENTINEL = "\x00PROMPT\x00"
DEFAULT_PROMPT = "Describe the image."
DEFAULT_MAX_NEW_TOKENS = 128


def _optional(path: Path) -> dict[str, Any]:
    """A side file of the model directory as a dict, {} when the directory does not have it."""
    return read_config_file(path) if path.is_file() else {}


def chat_template(model_dir: Path) -> str | None:
    """The model's chat template, where transformers looks for it (processor first, then tokenizer)."""
    if (model_dir / "chat_template.jinja").is_file():
        return (model_dir / "chat_template.jinja").read_text()
    for name in ("chat_template.json", "processor_config.json", "tokenizer_config.json"):
        if (model_dir / name).is_file():
            t = read_config_file(model_dir / name).get("chat_template")
            if isinstance(t, list):  # named templates: the default one
                t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
            if isinstance(t, str):
                return t
    return None


def render_turn(template: str, tokenizer_config: dict[str, Any], *, image: bool = True) -> str:
    """One user turn (an image, then SENTINEL as the text; SENTINEL alone when not `image`) with the generation
    prompt, as transformers renders it. A text turn's content is the string itself, which text models' templates
    read (`message['content']`); a VLM's is the list of parts its processor's template iterates."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg):
        what = "a single-image user turn" if image else "a single user turn"
        raise ConfigError(f"the chat template refused {what}: {msg}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    special = {k: tokenizer_config.get(k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    special = {k: v.get("content") if isinstance(v, dict) else v for k, v in special.items()}
    content = [{"type": "image"}, {"type": "text", "text": SENTINEL}] if image else SENTINEL
    messages = [{"role": "user", "content": content}]
    return env.from_string(template).render(messages=messages, add_generation_prompt=True, **special)


def rendered_turn(model_dir: Path, *, image: bool = True) -> str | None:
    """The model's chat template rendered for one user turn (`render_turn`); None when the directory has no
    template or jinja2 is not installed. A template that fails is the model's file, refused naming it."""
    template = chat_template(model_dir)
    if template is None:
        return None
    try:
        return render_turn(template, _optional(model_dir / "tokenizer_config.json"), image=image)
    except ImportError:
        return None
    except ConfigError:
        raise
    except Exception as exc:  # a template error is the model's file, named
        raise ConfigError(f"the chat template does not render ({type(exc).__name__}: {exc})", model_dir) from None


def _turn_text(spec: VlmSpecBase, model_dir: Path, tokenizer) -> tuple[str, str]:
    """The rendered user turn, and the image token's text, which stands in it once (where the span goes)."""
    text = rendered_turn(model_dir)  # None: no template or no jinja2, the family's layout below
    image = tokenizer.id_to_token(spec.image_token_id)
    if image is None:
        raise ConfigError(f"image_token_id {spec.image_token_id} is not in tokenizer.json", model_dir)
    if text is None:  # the family's own layout
        text = family_named(spec.family).fallback_template.replace("{prompt}", SENTINEL).replace("<image>", image)
    if SENTINEL not in text:
        raise ConfigError("the chat template drops the user's text for an image turn", model_dir)
    if text.count(image) != 1:
        raise ConfigError(
            f"the chat template writes the image token {image!r} {text.count(image)} times for one image", model_dir
        )
    return text, image


def eos_token_id(model_dir: Path, tokenizer) -> int | None:
    """The model's end token: generation_config.json's `eos_token_id` (the first of a list), else
    tokenizer_config.json's `eos_token`; None when neither names one. What a bundle stops at, and what
    `edgekit finetune` ends each example with."""
    eos = _optional(model_dir / names.WEIGHT_FILES["generation_config"]).get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if eos is None:
        eos_tok = _optional(model_dir / "tokenizer_config.json").get("eos_token")
        eos_tok = eos_tok.get("content") if isinstance(eos_tok, dict) else eos_tok
        eos = tokenizer.token_to_id(eos_tok) if eos_tok else None
    return None if eos is None else int(eos)


def generation_config(spec: VlmSpecBase, model_dir: Path, tokenizer) -> dict[str, Any]:
    """edgekit's generation config for an imported VLM: `bos + template + sep` cut from the rendered chat turn,
    the image token left in the template where the turn has it."""
    text, image = _turn_text(spec, model_dir, tokenizer)
    return cut_turn(text, image, model_dir, tokenizer, add_special_tokens=True)


def cut_turn(text: str, image: str | None, model_dir: Path, tokenizer, *, add_special_tokens: bool) -> dict[str, Any]:
    """edgekit's generation config from one rendered user turn (`text`, SENTINEL where the user's words go):
    `bos + template + sep` cut from it, the `image` token (None: a text model's turn) left in the template where
    the turn has it, and the cut checked by tokenizing both ways. `<bos>` is the turn's first token and `<sep>` its
    last, where they stand apart from the user's words (null where the turn starts or ends with them).
    `add_special_tokens`: whether the turn is tokenized with the tokenizer's own special tokens, as a VLM's
    processor does; a text model's turn is not, as transformers' `apply_chat_template` does not (its template
    writes them)."""
    where = model_dir / "tokenizer.json"
    full = text.replace(SENTINEL, DEFAULT_PROMPT)
    enc = tokenizer.encode(full, add_special_tokens=add_special_tokens)
    ids, offsets = enc.ids, enc.offsets
    lo, hi = text.index(SENTINEL), text.index(SENTINEL) + len(DEFAULT_PROMPT)
    bos, sep = offsets[0][1] <= lo, offsets[-1][0] >= hi  # tokens of their own, not the user's words
    start, end = offsets[0][1] if bos else 0, offsets[-1][0] if sep else len(full)  # the text between them
    if image is not None:
        at = full.index(image)
        if not (start <= at and at + len(image) <= end):
            raise ConfigError("the chat template puts the image in its first or last token", where)
    escape = lambda t: t.replace("{", "{{").replace("}", "}}")  # noqa: E731
    template = escape(full[start:lo]) + "{prompt}" + escape(full[hi:end])
    turn = "one user turn with an image" if image is not None else "one user turn"
    config = {
        "prompt_template": template,
        "prompt_format": "<bos> + encode(prompt_template) + <sep>"
        + (", the image span where image_token stands" if image is not None else "")
        + f"; cut from the model's chat template for {turn}",
        **({IMAGE_TOKEN: image} if image is not None else {}),
        "bos_token_id": int(ids[0]) if bos else None,
        "sep_token_id": int(ids[-1]) if sep else None,
        **generation_ends(model_dir, tokenizer),
        **({"default_prompt": DEFAULT_PROMPT} if image is not None else {}),  # a text model is given its prompt
    }
    image_id = tokenizer.token_to_id(image) if image is not None else None
    for prompt in (DEFAULT_PROMPT, "a b c"):  # the cut must tokenize as the whole turn does, the image in place
        whole = tokenizer.encode(text.replace(SENTINEL, prompt), add_special_tokens=add_special_tokens).ids
        layout = prompt_layout(tokenizer, config, "", prompt)
        if image_id is None:
            same = layout.ids == whole
        else:
            slot = whole.index(image_id) if whole.count(image_id) == 1 else -1
            same = slot >= 0 and (layout.ids, layout.image_slot) == (whole[:slot] + whole[slot + 1 :], slot)
        if not same:
            raise ConfigError(
                "the chat template cannot be served as <bos> + template + <sep>"
                + (" with the image in its place" if image is not None else "")
                + ": the cut tokenizes differently",
                where,
            )
    return config


def generation_ends(model_dir: Path, tokenizer) -> dict[str, int]:
    """Where generation stops and what pads: the model's end token (refused when it names none), its pad token
    and its max_new_tokens (generation_config.json), edgekit's defaults otherwise."""
    hf_gen = _optional(model_dir / names.WEIGHT_FILES["generation_config"])
    eos = eos_token_id(model_dir, tokenizer)
    if eos is None:
        raise ConfigError("no eos_token_id (generation_config.json) or eos_token (tokenizer_config.json)", model_dir)
    return {
        "eos_token_id": int(eos),
        "pad_token_id": int(hf_gen.get("pad_token_id") or 0),
        "max_new_tokens": int(hf_gen.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS),
    }


def preprocessor_config(spec: VlmSpecBase, model_dir: Path) -> dict[str, Any]:
    """edgekit's preprocessing for the vision graph (one frame, resized to the tower's square, values in [0, 1]:
    the graph normalises) and, for the record, the model's own image processor settings."""
    hf, notes = family_named(spec.family).processor_record(
        spec, _optional(model_dir / names.WEIGHT_FILES["preprocessor_config"])
    )
    return {
        "image_size": spec.image_size,
        "num_frames": 1,
        "mean": 0.0,
        "std": 1.0,
        "normalization": {
            "in": names.VISION_ENCODER,
            "image_mean": list(spec.image_mean),
            "image_std": list(spec.image_std),
            "channels": spec.tower.channels,
        },
        "resample": "box (edgekit.preprocess: Pillow BOX in mode F to image_size x image_size, no crop)",
        "hf_image_processor": hf,
        **notes,  # how the vision graph follows the family's processor (anyres, splitting, a fixed grid)
    }


def model_config(spec: VlmSpecBase, cfg: dict[str, Any]) -> dict[str, Any]:
    """The model's config.json, plus `max_positions` (the language model's whole context) and `image_tokens`
    (the positions the image span takes), which the reporter's context budget and the targets' shape limits read
    (`edgekit.prompt`), and the language model's `vocab_size` at the top level."""
    positions = language_model_config(cfg).get("max_position_embeddings")
    out = dict(cfg)
    if positions:
        out["max_positions"] = int(positions)
    out[names.IMAGE_TOKENS] = spec.span_length
    out.setdefault("vocab_size", spec.decoder.vocab_size)  # top level, where edgekit's readers look
    out["edgekit_vlm"] = spec.to_dict()
    if spec.positions.kind == MROPE:  # Qwen2-VL: M-RoPE over the image's grid (absent: text)
        out[POSITIONS_KEY] = spec.positions.to_dict()
    return out


def read_tokenizer(model_dir: Path):
    """The directory's `tokenizer.json` as a tokenizers `Tokenizer`, refused in one line when missing or foreign."""
    from tokenizers import Tokenizer

    tok_path = model_dir / names.WEIGHT_FILES["tokenizer"]
    if not tok_path.is_file():
        raise ConfigError(
            "tokenizer.json is missing: edgekit's runtime reads the tokenizers library's tokenizer.json", model_dir
        )
    try:
        return Tokenizer.from_file(str(tok_path))
    except Exception as exc:  # tokenizers raises its own exception type for a foreign file
        raise ConfigError(f"not a tokenizers tokenizer.json ({type(exc).__name__})", tok_path) from None


def write_model_files(model_dir: Path, files: dict[str, dict[str, Any]], out: Path) -> dict[str, Path]:
    """The directory's tokenizer.json copied and `files` ({role: JSON}) written into `out`; paths by role."""
    out.mkdir(parents=True, exist_ok=True)
    tok_path = model_dir / names.WEIGHT_FILES["tokenizer"]
    paths = {"tokenizer": Path(shutil.copy2(tok_path, out / tok_path.name))}
    for role, data in files.items():
        p = out / names.WEIGHT_FILES[role]
        p.write_text(json.dumps(data, indent=2) + "\n")
        paths[role] = p
    return paths


def write_serving_files(spec: VlmSpecBase, model_dir: Path, cfg: dict[str, Any], out: Path) -> dict[str, Path]:
    """The bundle's model files by role (edgekit.names.WEIGHT_FILES), written into `out`: a model directory as a
    target's build side reads one (`BuildInputs.model_dir`)."""
    tokenizer = read_tokenizer(model_dir)
    files = {
        "generation_config": generation_config(spec, model_dir, tokenizer),
        "preprocessor_config": preprocessor_config(spec, model_dir),
        "model_config": model_config(spec, cfg),
    }
    return write_model_files(model_dir, files, out)
