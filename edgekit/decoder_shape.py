"""A LLaMA-style decoder's shape, as the targets' cost models read it: numbers only, no weights.

Why one module: the X1 and Orin cost models budget the same decoders (RMSNorm, RoPE, GQA, SwiGLU MLP) before any
weights exist, and count their matmul weights the same way; each used to carry its own copy of these fields, their
checks and that count. `edgekit.model_description.ModelDescription` adds the vision tower and the position scheme.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from edgekit.errors import ConfigError

_SIZES = ("hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate", "vocab")


@dataclass(frozen=True)
class DecoderShape:
    """A decoder: `heads` query heads sharing `kv_heads` K/V heads of `head_dim`, a SwiGLU MLP of `intermediate`,
    an LM head over `vocab` (the embedding table is that head's when `tied_embeddings`)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool = False

    def __post_init__(self) -> None:
        for field_name in _SIZES:
            value = getattr(self, field_name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"model shape field '{field_name}' must be a positive integer, got {value!r}")
        if self.heads % self.kv_heads:
            raise ConfigError(
                f"model shape field 'kv_heads': {self.heads} heads do not split into {self.kv_heads} KV groups"
            )

    @property
    def group_size(self) -> int:
        """Query heads sharing one K/V head (GQA); 1 for multi-head attention."""
        return self.heads // self.kv_heads

    def layer_params(self, head_keep: float = 1.0) -> float:
        """Matmul weights of one decoder layer; pruned heads (`head_keep` < 1) remove their Q columns and O rows."""
        q = self.hidden * self.heads * self.head_dim * head_keep
        kv = self.hidden * self.kv_heads * self.head_dim
        return 2 * q + 2 * kv + 3 * self.hidden * self.intermediate

    def decoder_params(self, head_keep: float = 1.0) -> float:
        return self.layers * self.layer_params(head_keep)

    def lm_head_params(self) -> int:
        return self.hidden * self.vocab

    def linear_params(self) -> int:
        """Weights of every matmul run per token (decoder layers + LM head), which decode streams once each."""
        return int(self.decoder_params()) + self.lm_head_params()

    def to_dict(self) -> dict:
        return asdict(self)
