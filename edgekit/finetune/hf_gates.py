"""Head gates on a Hugging Face model's decoder: found by module layout, applied as `o_proj` input hooks.

Why hooks on `o_proj`: every decoder edgekit imports (LLaMA, Qwen2, Mistral, and the text models of LLaVA and
Idefics3/SmolVLM) concatenates its heads' outputs, head-major, into `o_proj`'s input, so scaling that input per
head is the gate, with no change to transformers' attention code. The hook goes on the module that is
`self_attn.o_proj` *after* PEFT wraps it, so the LoRA branch sees the gated input too: what the model computes
in training is then exactly `(W + dW) diag(g) x`, which the `lora` pass folds the same way.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass

from edgekit.errors import ConfigError
from edgekit.hf.config import decoder_shape, language_model_config

from .gates import HeadGates

# `<prefix>layers.<i>.self_attn` holding an `o_proj`: vision towers name theirs `out_proj`, so they never match
_ATTENTION = re.compile(r"^(?P<prefix>(?:.*\.)?)layers\.(?P<layer>\d+)\.self_attn$")


@dataclass(frozen=True)
class DecoderAttention:
    """Where a model's decoder attention lives: one `self_attn` module path per layer, in layer order."""

    modules: tuple[str, ...]
    heads: int
    head_dim: int

    @property
    def prefix(self) -> str:
        """The decoder layers' common prefix, e.g. `model.language_model.` (LLaVA) or `model.` (LLaMA)."""
        return self.modules[0].rsplit("layers.", 1)[0]


def find_decoder_attention(model) -> DecoderAttention:
    """The decoder's attention modules; refuses a model with none, or with two decoders, in one line."""
    stacks: dict[str, dict[int, str]] = {}
    for name, module in model.named_modules():
        m = _ATTENTION.match(name)
        if m and hasattr(module, "o_proj"):
            stacks.setdefault(m["prefix"], {})[int(m["layer"])] = name
    if len(stacks) != 1:
        what = "no decoder attention layer (`layers.N.self_attn.o_proj`)" if not stacks else "several decoders"
        raise ConfigError(f"cannot gate heads: {what} in {type(model).__name__}")
    (layers,) = stacks.values()
    if sorted(layers) != list(range(len(layers))):
        raise ConfigError(f"cannot gate heads: decoder layers {sorted(layers)} are not numbered 0..N-1")
    # the language model's heads, read as edgekit reads any config (a VLM's language model: language_model_config)
    where = f"{type(model).__name__}.config"
    heads = decoder_shape(language_model_config(model.config.to_dict()), where).heads
    in_features = model.get_submodule(layers[0]).o_proj.in_features
    if in_features % heads:
        raise ConfigError(f"cannot gate heads: o_proj input {in_features} is not a multiple of {heads} heads")
    return DecoderAttention(tuple(layers[i] for i in range(len(layers))), heads, in_features // heads)


@contextmanager
def gates_applied(model, attention: DecoderAttention, gates: HeadGates):
    """Within the block, every decoder layer's `o_proj` input is scaled per head by the gates."""
    handles = []

    def hook_for(layer: int):
        def hook(_module, args):
            x = args[0]
            scale = gates.values()[layer].repeat_interleave(attention.head_dim).to(x.dtype)
            return (x * scale, *args[1:])

        return hook

    try:
        for i, path in enumerate(attention.modules):
            o_proj = model.get_submodule(path).o_proj  # PEFT's wrapper once wrapped: the LoRA branch is gated too
            handles.append(o_proj.register_forward_pre_hook(hook_for(i)))
        yield
    finally:
        for h in handles:
            h.remove()
