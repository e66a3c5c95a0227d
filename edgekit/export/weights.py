"""radreport-tiny's weights without torch: the expected names and shapes, loading, validation, random init.

Checking every tensor up front turns a wrong or truncated checkpoint into one clear error naming the tensor,
instead of a shape error deep inside ONNX Runtime. `random_weights` gives tests and benchmarks a model of any
size without torch or a trained checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edgekit.errors import EdgekitError
from edgekit.export.model_config import ModelConfig


def expected_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of `RadReportTiny(c)` with its shape (the safetensors names)."""
    shapes: dict[str, tuple[int, ...]] = {
        "vision_model.embeddings.patch_embedding.weight": (c.vision_hidden, 1, c.patch_size, c.patch_size),
        "vision_model.embeddings.patch_embedding.bias": (c.vision_hidden,),
        "vision_model.embeddings.position_embedding.weight": (c.grid * c.grid, c.vision_hidden),
        "vision_model.post_layernorm.weight": (c.vision_hidden,),
        "vision_model.post_layernorm.bias": (c.vision_hidden,),
        "connector.fc1.weight": (c.hidden, 2 * c.vision_hidden),
        "connector.fc1.bias": (c.hidden,),
        "connector.fc2.weight": (c.hidden, c.hidden),
        "connector.fc2.bias": (c.hidden,),
        "model.embed_tokens.weight": (c.vocab_size, c.hidden),
        "model.norm.weight": (c.hidden,),
        "lm_head.weight": (c.vocab_size, c.hidden),
    }
    d, m = c.vision_hidden, c.vision_mlp
    for i in range(c.vision_layers):
        p = f"vision_model.encoder.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes[f"{p}.self_attn.{proj}.weight"] = (d, d)
            shapes[f"{p}.self_attn.{proj}.bias"] = (d,)
        for ln in ("layer_norm1", "layer_norm2"):
            shapes[f"{p}.{ln}.weight"] = (d,)
            shapes[f"{p}.{ln}.bias"] = (d,)
        shapes.update(
            {
                f"{p}.mlp.fc1.weight": (m, d),
                f"{p}.mlp.fc1.bias": (m,),
                f"{p}.mlp.fc2.weight": (d, m),
                f"{p}.mlp.fc2.bias": (d,),
            }
        )
    for i in range(c.layers):
        shapes.update(
            decoder_layer_shapes(f"model.layers.{i}", c.hidden, c.heads, c.kv_heads, c.head_dim, c.intermediate)
        )
    return shapes


def decoder_layer_shapes(
    p: str, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, qkv_bias: bool = False
) -> dict[str, tuple[int, ...]]:
    """One LLaMA-style decoder layer's parameters under prefix `p` (transformers' names): radreport-tiny's and
    every imported decoder's (`edgekit.hf.convert.expected_decoder_shapes`)."""
    h, q, kv = hidden, heads * head_dim, kv_heads * head_dim
    shapes = {
        f"{p}.input_layernorm.weight": (h,),
        f"{p}.post_attention_layernorm.weight": (h,),
        f"{p}.self_attn.q_proj.weight": (q, h),
        f"{p}.self_attn.k_proj.weight": (kv, h),
        f"{p}.self_attn.v_proj.weight": (kv, h),
        f"{p}.self_attn.o_proj.weight": (h, q),
        f"{p}.mlp.gate_proj.weight": (intermediate, h),
        f"{p}.mlp.up_proj.weight": (intermediate, h),
        f"{p}.mlp.down_proj.weight": (h, intermediate),
    }
    if qkv_bias:
        shapes.update(
            {
                f"{p}.self_attn.q_proj.bias": (q,),
                f"{p}.self_attn.k_proj.bias": (kv,),
                f"{p}.self_attn.v_proj.bias": (kv,),
            }
        )
    return shapes


def check_weights(weights: dict[str, np.ndarray], c: ModelConfig, path: str | Path | None = None) -> None:
    """Raise `EdgekitError` naming the first missing or mis-shaped tensors; extra tensors are ignored."""
    problems = []
    for name, shape in expected_shapes(c).items():
        if name not in weights:
            problems.append(f"{name} is missing")
        elif tuple(weights[name].shape) != shape:
            problems.append(f"{name} has shape {tuple(weights[name].shape)}, config.json needs {shape}")
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise EdgekitError(
            "weights do not match config.json: " + "; ".join(problems[:3]) + more, path, code="invalid_weights"
        )


def load_weights(path: str | Path) -> dict[str, np.ndarray]:
    """Read a safetensors file as float32 numpy arrays."""
    from safetensors.numpy import load_file

    path = Path(path)
    if not path.is_file():
        raise EdgekitError("weights file not found", path, code="invalid_weights")
    try:
        tensors = load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types for truncated or foreign files
        raise EdgekitError(
            f"not a readable safetensors file ({type(exc).__name__})", path, code="invalid_weights"
        ) from exc
    return {k: np.asarray(v, dtype=np.float32) for k, v in tensors.items()}


def random_weights(c: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Weights with PyTorch's default init scales (Linear/Conv uniform +-1/sqrt(fan_in), Embedding N(0, 1),
    norms weight 1 / bias 0), so random models produce logits of realistic spread."""
    rng = np.random.default_rng(seed)
    shapes = expected_shapes(c)
    out = {}
    for name, shape in shapes.items():
        module, kind = name.rsplit(".", 1)
        if "norm" in module.rsplit(".", 1)[-1]:
            arr = np.ones(shape) if kind == "weight" else np.zeros(shape)
        elif module.endswith(("embed_tokens", "position_embedding")):
            arr = rng.standard_normal(shape)
        else:
            fan_in = int(np.prod(shapes[f"{module}.weight"][1:]))
            arr = rng.uniform(-1.0, 1.0, shape) / np.sqrt(fan_in)
        out[name] = arr.astype(np.float32)
    return out
