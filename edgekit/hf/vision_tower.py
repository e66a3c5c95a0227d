"""`vision_encoder.onnx` for a Hugging Face ViT or SigLIP vision model: pixel_values (batch, C, H, W) ->
last_hidden_state (batch, tokens, hidden), i.e. patch embedding + encoder + final LayerNorm (no pooling head).

Why a builder of its own rather than `export.vision`: that graph is radreport-tiny's (frames, temporal pooling,
connector) and hard-wires SigLIP names. Here a name table per family keeps each initializer under the
checkpoint's own name (ViT's `attention.attention.query`, SigLIP's `self_attn.q_proj`), so LoRA adapters and
quantization reports match the Hugging Face module names.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from edgekit import names
from edgekit.errors import ConfigError
from edgekit.export.blocks import gelu, layer_norm, linear
from edgekit.export.irbuilder import GraphBuilder, scope_of

from .checkpoint import find_prefix

F32 = ir.DataType.FLOAT
GELU = {"gelu": "none", "gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "quick_gelu": "quick"}

# role -> name template ({p}: model prefix, {i}: layer index)
NAMES: dict[str, dict[str, str | None]] = {
    "siglip": {
        "patch": "{p}embeddings.patch_embedding",
        "pos": "{p}embeddings.position_embedding.weight",
        "cls": None,
        "ln1": "{p}encoder.layers.{i}.layer_norm1",
        "q": "{p}encoder.layers.{i}.self_attn.q_proj",
        "k": "{p}encoder.layers.{i}.self_attn.k_proj",
        "v": "{p}encoder.layers.{i}.self_attn.v_proj",
        "o": "{p}encoder.layers.{i}.self_attn.out_proj",
        "ln2": "{p}encoder.layers.{i}.layer_norm2",
        "fc1": "{p}encoder.layers.{i}.mlp.fc1",
        "fc2": "{p}encoder.layers.{i}.mlp.fc2",
        "final": "{p}post_layernorm",
        "layer": "{p}encoder.layers.{i}",
    },
    "vit": {
        "patch": "{p}embeddings.patch_embeddings.projection",
        "pos": "{p}embeddings.position_embeddings",
        "cls": "{p}embeddings.cls_token",
        "ln1": "{p}encoder.layer.{i}.layernorm_before",
        "q": "{p}encoder.layer.{i}.attention.attention.query",
        "k": "{p}encoder.layer.{i}.attention.attention.key",
        "v": "{p}encoder.layer.{i}.attention.attention.value",
        "o": "{p}encoder.layer.{i}.attention.output.dense",
        "ln2": "{p}encoder.layer.{i}.layernorm_after",
        "fc1": "{p}encoder.layer.{i}.intermediate.dense",
        "fc2": "{p}encoder.layer.{i}.output.dense",
        "final": "{p}layernorm",
        "layer": "{p}encoder.layer.{i}",
    },
}
# CLIP's vision tower (LLaVA's): SigLIP's layout plus a class token and a pre-LayerNorm (a bias-free patch conv)
NAMES["clip"] = {
    **NAMES["siglip"],
    "cls": "{p}embeddings.class_embedding",
    "pre": "{p}pre_layrnorm",  # sic: transformers' spelling
}
PREFIXES = {"siglip": ("", "vision_model.", "model.vision_model."), "vit": ("", "vit.")}


def _template(family: str, role: str) -> str:
    """The name template of a module the family's tower has (a KeyError for one it has not: SigLIP's `cls`)."""
    template = NAMES[family][role]
    if template is None:
        raise KeyError(f"a {family} tower has no {role!r} module")
    return template


@dataclass(frozen=True)
class VisionTowerSpec:
    family: str  # "siglip" | "vit" | "clip"
    prefix: str  # "" or "vision_model." / "vit." as found in the checkpoint
    image_size: int
    patch_size: int
    channels: int
    hidden: int
    layers: int
    heads: int
    ln_eps: float
    gelu: str  # "none" (erf) | "tanh"
    qkv_bias: bool = True

    def name(self, role: str, i: int | None = None) -> str:
        return _template(self.family, role).format(p=self.prefix, i=i)

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_tokens(self) -> int:
        return self.num_patches + (1 if self.has_cls else 0)

    @property
    def has_cls(self) -> bool:
        return self.family in ("vit", "clip")


def vision_tower_spec(cfg: dict[str, Any], model_dir: str | Path, names: Collection[str]) -> VisionTowerSpec:
    where = Path(model_dir) / "config.json"
    mt = cfg.get("model_type")
    family = "vit" if mt == "vit" else "siglip"
    if mt == "siglip":  # a full SigLIP (text + vision) checkpoint: use its vision_config
        cfg = cfg.get("vision_config") or {}
    return tower_spec(cfg, family, PREFIXES[family], names, where)


def tower_spec(
    cfg: dict[str, Any], family: str, prefixes: Collection[str], names: Collection[str], where: Path
) -> VisionTowerSpec:
    """A tower's spec from its (vision) config; `prefixes` are where its weights may sit in the checkpoint
    (a VLM nests them: `vision_tower.`, `model.vision_model.`)."""
    probe = _template(family, "ln1")  # layer 0's first norm: a VLM may drop the tower's unused final norm
    prefix = find_prefix(names, prefixes, probe.format(p="", i=0) + ".weight", where)
    act = cfg.get("hidden_act", {"siglip": "gelu_pytorch_tanh", "clip": "quick_gelu"}.get(family, "gelu"))
    if act not in GELU:
        raise ConfigError(f"hidden_act {act!r} is not supported (edgekit builds {', '.join(GELU)})", where)
    default_eps = {"vit": 1e-12, "clip": 1e-5}.get(family, 1e-6)
    try:
        spec = VisionTowerSpec(
            family=family,
            prefix=prefix,
            image_size=int(cfg["image_size"]),
            patch_size=int(cfg["patch_size"]),
            channels=int(cfg.get("num_channels", 3)),
            hidden=int(cfg["hidden_size"]),
            layers=int(cfg["num_hidden_layers"]),
            heads=int(cfg["num_attention_heads"]),
            ln_eps=float(cfg.get("layer_norm_eps", default_eps)),
            gelu=GELU[act],
            qkv_bias=bool(cfg.get("qkv_bias", True)),
        )
    except KeyError as exc:
        raise ConfigError(f"{exc.args[0]} is missing", where) from None
    if spec.hidden % spec.heads:
        raise ConfigError(f"hidden_size {spec.hidden} is not a multiple of num_attention_heads {spec.heads}", where)
    return spec


def expected_tower_shapes(spec: VisionTowerSpec, layers: int, intermediate: int) -> dict[str, tuple[int, ...]]:
    """The tensors the first `layers` layers (and the embeddings) read, with the shapes the config implies."""
    d, p, c = spec.hidden, spec.patch_size, spec.channels
    shapes: dict[str, tuple[int, ...]] = {
        f"{spec.name('patch')}.weight": (d, c, p, p),
        spec.name("pos"): (spec.num_tokens, d),
    }
    if spec.family != "clip":
        shapes[f"{spec.name('patch')}.bias"] = (d,)
    if spec.family == "clip":
        shapes[spec.name("cls")] = (d,)
        shapes[f"{spec.name('pre')}.weight"] = shapes[f"{spec.name('pre')}.bias"] = (d,)
    for i in range(layers):
        for role in ("ln1", "ln2"):
            shapes[f"{spec.name(role, i)}.weight"] = shapes[f"{spec.name(role, i)}.bias"] = (d,)
        for role in ("q", "k", "v", "o"):
            shapes[f"{spec.name(role, i)}.weight"] = (d, d)
            shapes[f"{spec.name(role, i)}.bias"] = (d,)
        shapes[f"{spec.name('fc1', i)}.weight"] = (intermediate, d)
        shapes[f"{spec.name('fc1', i)}.bias"] = (intermediate,)
        shapes[f"{spec.name('fc2', i)}.weight"] = (d, intermediate)
        shapes[f"{spec.name('fc2', i)}.bias"] = (d,)
    return shapes


def _embeddings(b: GraphBuilder, pixels: ir.Value, spec: VisionTowerSpec) -> ir.Value:
    patch = spec.name("patch")
    scope = scope_of(patch)
    p = spec.patch_size
    conv_inputs = [pixels, b.weight(f"{patch}.weight")]
    if spec.family != "clip":  # CLIP's patch conv has no bias
        conv_inputs.append(b.weight(f"{patch}.bias"))
    y = b.op(scope, "Conv", conv_inputs, {"kernel_shape": [p, p], "strides": [p, p]})
    y = b.op(scope, "Transpose", [b.op(scope, "Reshape", [y, b.const([0, spec.hidden, -1])])], {"perm": [0, 2, 1]})
    if spec.has_cls:  # a learned [CLS] token in front of the patches (ViT: (1, 1, D); CLIP: (D,))
        cls_name = spec.name("cls")
        cscope = scope_of(cls_name.rsplit(".", 1)[0])
        batch = b.op(cscope, "Shape", [pixels], {"start": 0, "end": 1})
        shape = b.op(cscope, "Concat", [batch, b.const([1, spec.hidden])], {"axis": 0})
        cls = b.op(cscope, "Expand", [b.weight(cls_name), shape])
        y = b.op(cscope, "Concat", [cls, y], {"axis": 1})
    y = b.op(scope_of(spec.name("pos").rsplit(".", 1)[0]), "Add", [y, b.weight(spec.name("pos"))])
    if spec.family == "clip":
        y = layer_norm(b, y, spec.name("pre"), spec.ln_eps)
    return y


def _attention(b: GraphBuilder, x: ir.Value, spec: VisionTowerSpec, i: int) -> ir.Value:
    scope = scope_of(spec.name("q", i).rsplit(".", 1)[0])
    h, hd = spec.heads, spec.hidden // spec.heads

    def heads(role: str, perm: list[int]) -> ir.Value:
        y = linear(b, x, spec.name(role, i), bias=spec.qkv_bias)
        return b.op(scope, "Transpose", [b.op(scope, "Reshape", [y, b.const([0, 0, h, hd])])], {"perm": perm})

    q, k_t, v = heads("q", [0, 2, 1, 3]), heads("k", [0, 2, 3, 1]), heads("v", [0, 2, 1, 3])
    scores = b.op(scope, "Div", [b.op(scope, "MatMul", [q, k_t]), b.const(math.sqrt(hd), np.float32)])
    y = b.op(scope, "MatMul", [b.op(scope, "Softmax", [scores], {"axis": -1}), v])
    y = b.op(scope, "Reshape", [b.op(scope, "Transpose", [y], {"perm": [0, 2, 1, 3]}), b.const([0, 0, spec.hidden])])
    return linear(b, y, spec.name("o", i), bias=True)


def _layer(b: GraphBuilder, x: ir.Value, spec: VisionTowerSpec, i: int) -> ir.Value:
    scope = scope_of(spec.name("layer", i))
    x = b.op(scope, "Add", [x, _attention(b, layer_norm(b, x, spec.name("ln1", i), spec.ln_eps), spec, i)])
    h = layer_norm(b, x, spec.name("ln2", i), spec.ln_eps)
    h = activation(b, linear(b, h, spec.name("fc1", i), bias=True), scope, spec.gelu)
    return b.op(scope, "Add", [x, linear(b, h, spec.name("fc2", i), bias=True)])


def activation(b: GraphBuilder, x: ir.Value, scope: str, kind: str) -> ir.Value:
    """GELU (erf or tanh), or CLIP's quick_gelu x * sigmoid(1.702 x)."""
    if kind != "quick":
        return gelu(b, x, scope, approximate=kind)
    scope = f"{scope}/QuickGelu"
    return b.op(scope, "Mul", [x, b.op(scope, "Sigmoid", [b.op(scope, "Mul", [x, b.const(1.702, np.float32)])])])


def normalize_frames(b: GraphBuilder, x: ir.Value, channels: int, mean, std, scope: str) -> ir.Value:
    """The image processor's last steps in the graph, for grey display frames (n, 1, S, S) in [0, 1]: the frame
    on every channel the tower was trained on (a grey image as RGB), then `(x - image_mean) / image_std`."""
    if channels > 1:
        x = b.op(scope, "Concat", [x] * channels, {"axis": 1})
    shape = (1, channels, 1, 1)
    mean_c = b.const(np.asarray(mean, np.float32).reshape(shape), np.float32)
    std_c = b.const(np.asarray(std, np.float32).reshape(shape), np.float32)
    return b.op(scope, "Div", [b.op(scope, "Sub", [x, mean_c]), std_c])


def hidden_states(b: GraphBuilder, pixels: ir.Value, spec: VisionTowerSpec, layers: int) -> list[ir.Value]:
    """transformers' `hidden_states` of the tower for NCHW `pixels`: [embeddings, after layer 1, ..., after layer
    `layers`] (no final norm), so a VLM can pick the layer it was trained on and build no layer past it."""
    states = [_embeddings(b, pixels, spec)]
    for i in range(layers):
        states.append(_layer(b, states[-1], spec, i))
    return states


def build_vision_tower(weights: Mapping[str, np.ndarray], spec: VisionTowerSpec) -> ir.Model:
    b = GraphBuilder(weights, "vision_encoder")
    pixels = b.input(names.PIXEL_VALUES, F32, ["batch", spec.channels, spec.image_size, spec.image_size])
    x = hidden_states(b, pixels, spec, spec.layers)[-1]
    x = layer_norm(b, x, spec.name("final"), spec.ln_eps)
    b.output(x, "last_hidden_state", F32, ["batch", spec.num_tokens, spec.hidden])
    return b.model()
