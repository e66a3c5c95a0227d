"""Names that the exporter, the passes, the targets and bundles all share: one home, below all of them.

A vision-language model travels as three ONNX graphs with the Hugging Face VLM names (`vision_encoder`,
`embed_tokens`, `decoder_model_merged`), a text model (a decoder alone: LLaMA, Qwen2, Mistral) as the last two; the
decoder carries its KV cache as `past_key_values.{i}.key|value` in and `present.{i}.key|value` out. Every layer
that reads or writes these graphs takes the names from here, so a rename is one edit and a second spelling cannot
creep in.
"""

from __future__ import annotations

from pathlib import Path

# graph roles (bundle component roles) and their file names -----------------------------------------------------
VISION = "vision_encoder"
EMBED = "embed_tokens"
DECODER_ROLE = "decoder"
GRAPH_ROLES = (VISION, EMBED, DECODER_ROLE)
TEXT_GRAPH_ROLES = (EMBED, DECODER_ROLE)  # a text model's bundle: no vision graph
GRAPH_FILES = {VISION: "vision_encoder.onnx", EMBED: "embed_tokens.onnx", DECODER_ROLE: "decoder_model_merged.onnx"}
VISION_ENCODER = GRAPH_FILES[VISION]
EMBED_TOKENS = GRAPH_FILES[EMBED]
DECODER = GRAPH_FILES[DECODER_ROLE]

# the files a model directory carries beside its weights, by bundle role ----------------------------------------
WEIGHTS_FILE = "model.safetensors"
WEIGHT_FILES = {
    "tokenizer": "tokenizer.json",
    "generation_config": "generation_config.json",
    "preprocessor_config": "preprocessor_config.json",
    "model_config": "config.json",
}
HEAD_IMPORTANCE = "head_importance"  # role of the heads pass's per-head scores (x1 DSS reads them)
HEAD_IMPORTANCE_FILE = "head_importance.json"
HEAD_GATES_FILE = "head_gates.json"  # learned gates beside a LoRA adapter (edgekit finetune); the lora pass folds them
# model_config.json key: decoder positions one image takes (an imported VLM's span, wrapper tokens included); read
# through edgekit.prompt.image_tokens by the reporter's context budget and the targets' shape limits
IMAGE_TOKENS = "image_tokens"

# graph inputs and outputs ---------------------------------------------------------------------------------------
PIXEL_VALUES = "pixel_values"
IMAGE_FEATURES = "image_features"
INPUT_IDS = "input_ids"
INPUTS_EMBEDS = "inputs_embeds"
ATTENTION_MASK = "attention_mask"
POSITION_IDS = "position_ids"
LOGITS = "logits"
PAST_PREFIX = "past_key_values."
PRESENT_PREFIX = "present."


def past_key(layer: int) -> str:
    return f"{PAST_PREFIX}{layer}.key"


def past_value(layer: int) -> str:
    return f"{PAST_PREFIX}{layer}.value"


def present_key(layer: int) -> str:
    return f"{PRESENT_PREFIX}{layer}.key"


def present_value(layer: int) -> str:
    return f"{PRESENT_PREFIX}{layer}.value"


def graph_roles_in(folder) -> tuple[str, ...]:
    """The graph roles whose files are in `folder`, in `GRAPH_ROLES` order: all three for a VLM, the text roles for
    a decoder alone. For a target's build side, which prepares whatever graphs the export wrote."""
    return tuple(role for role in GRAPH_ROLES if (Path(folder) / GRAPH_FILES[role]).is_file())


def graph_role(file_name: str) -> str | None:
    """The role of a graph file name (`decoder_model_merged.onnx` -> `decoder`), None for other files."""
    return next((role for role, f in GRAPH_FILES.items() if f == file_name), None)
