"""radreport-tiny: the embedded default model (architecture, tokenizer, training and LoRA recipes, variant
recipes, committed weights). `FAMILY` is its plug-in for `edgekit.plugins`."""

from .family import FAMILY

__all__ = ["FAMILY"]
