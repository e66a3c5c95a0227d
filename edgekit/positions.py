"""The decoder's `position_ids`, computed in one place for generation (prefill and decode), calibration feeds,
parity checks and the targets' reference feeds.

Two kinds, recorded in the bundle's `config.json` (`POSITIONS_KEY`) so every runtime feeds the graph what it
was built for:
- **text** (LLaMA, Qwen2, radreport-tiny...): `(batch, seq)`, each kept token's index among the row's kept
  tokens (`attention_mask` cumulative sum - 1; left padding 0), one more per decode step.
- **mrope** (Qwen2-VL's multimodal RoPE): `(3, batch, seq)` (temporal, height, width), as transformers'
  `get_rope_index` computes them and onnxruntime-genai / TensorRT Edge-LLM feed them: text tokens count on all
  three axes; the image span's tokens take `start + (t, row, col)` of its merged grid (`start` the text
  position where the span begins); the text after the span continues from the span's largest position + 1
  (`start + max(h, w)` for an image's one time step), not from its token count. A decode step feeds one
  position on all three axes: the next after the largest so far (transformers' `rope_deltas` added to the token
  count).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgekit.errors import ConfigError, EdgekitError

POSITIONS_KEY = "edgekit_positions"  # config.json key: {"kind": "mrope", "grid": [t, h, w]}; absent: text
TEXT, MROPE = "text", "mrope"


@dataclass(frozen=True)
class PositionScheme:
    """What `position_ids` the decoder takes: `kind` text or mrope; `grid` the image span's merged (t, h, w)
    grid (mrope: the span is exactly t * h * w tokens, in t, row, column order)."""

    kind: str = TEXT
    grid: tuple[int, int, int] = (0, 0, 0)

    def __post_init__(self) -> None:
        if self.kind not in (TEXT, MROPE):
            raise ConfigError(f"{POSITIONS_KEY}.kind {self.kind!r} is not one of {TEXT}, {MROPE}")
        if self.kind == MROPE and (len(self.grid) != 3 or min(self.grid) < 1):
            raise ConfigError(f"{POSITIONS_KEY}.grid {list(self.grid)} must be three positive sizes (t, h, w)")

    @property
    def span_tokens(self) -> int:
        t, h, w = self.grid
        return t * h * w

    def to_dict(self) -> dict:
        return {"kind": self.kind, **({"grid": list(self.grid)} if self.kind == MROPE else {})}

    @classmethod
    def of(cls, model_config: Mapping | None, where: str | Path | None = None) -> PositionScheme:
        """The scheme a bundle's (or a graph folder's) config.json records; text when it records none. A record
        that is not one is refused naming `where` (the file it was read from)."""
        d = (model_config or {}).get(POSITIONS_KEY)
        if d is None:
            return cls()
        if not isinstance(d, Mapping):
            raise ConfigError(f"{POSITIONS_KEY}: expected an object, got {d!r}", where)
        grid = d.get("grid", (0, 0, 0))
        if not isinstance(grid, (list, tuple)) or not all(isinstance(x, int) and not isinstance(x, bool) for x in grid):
            raise ConfigError(f"{POSITIONS_KEY}.grid: expected a list of ints, got {grid!r}", where)
        try:
            return cls(str(d.get("kind", TEXT)), tuple(grid))
        except ConfigError as err:
            raise ConfigError(err.reason, where) from None

    @classmethod
    def beside(cls, graph_dir) -> PositionScheme:
        """The scheme recorded beside a folder of graphs: a bundle's model files (`config.json`) or
        `edgekit convert`'s output (`hf_config.json`, where the conversion records it); text when neither does."""
        for name in ("config.json", "hf_config.json"):
            path = Path(graph_dir) / name
            if path.is_file():
                try:
                    cfg = json.loads(path.read_text())
                except (json.JSONDecodeError, UnicodeDecodeError):
                    raise ConfigError("not valid JSON", path) from None
                if isinstance(cfg, Mapping) and POSITIONS_KEY in cfg:
                    return cls.of(cfg, path)
        return cls()

    # the two calls generation makes ------------------------------------------------------------------------
    def prefill(
        self, mask: np.ndarray, image_slot: int | Sequence[int] | None = None, span: int = 0
    ) -> tuple[np.ndarray, np.ndarray]:
        """(position_ids, next) for a prefill of `mask` (batch, seq), where each row's image span (`span` tokens)
        starts at sequence index `image_slot` (None or span 0: no image). `next` (batch,) is the position the
        next token takes."""
        mask = np.asarray(mask, np.int64)
        text = np.maximum(mask.cumsum(-1) - 1, 0)
        if self.kind == TEXT:
            return text, text[:, -1] + 1
        batch, seq = mask.shape
        if image_slot is None or span == 0:
            return np.broadcast_to(text, (3, batch, seq)).copy(), text[:, -1] + 1
        if span != self.span_tokens:
            raise EdgekitError(f"an image span of {span} tokens; M-RoPE grid {list(self.grid)} has {self.span_tokens}")
        slots = np.broadcast_to(np.asarray(image_slot, np.int64), (batch,))
        if slots.min() < 0 or slots.max() + span > seq:
            raise EdgekitError(f"image span at {image_slot} (+{span}) is outside the sequence of {seq}")
        t, h, w = self.grid
        grid = np.stack(np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")).reshape(3, -1)
        out = np.zeros((3, batch, seq), np.int64)
        nxt = np.zeros(batch, np.int64)
        for row in range(batch):
            kept = mask[row].astype(bool)
            if not kept[slots[row] : slots[row] + span].all():
                raise EdgekitError("the attention mask masks part of the image span")
            pos = np.zeros((3, seq), np.int64)
            before = int(kept[: slots[row]].sum())  # the text position where the span starts
            pos[:, : slots[row]] = text[row, : slots[row]]
            pos[:, slots[row] : slots[row] + span] = before + grid
            after = slice(slots[row] + span, seq)
            resume = before + max(h, w)  # the span's largest position + 1 (get_rope_index: + max(h, w))
            pos[:, after] = resume + np.maximum(mask[row, after].cumsum() - 1, 0)
            pos[:, ~kept] = 0  # padding: 0, as transformers leaves it
            out[:, row] = pos
            nxt[row] = pos[:, kept].max() + 1 if kept.any() else 0
        return out, nxt

    def step(self, nxt: np.ndarray) -> np.ndarray:
        """position_ids of one decode token per row at positions `nxt` (batch,): (batch, 1), or (3, batch, 1)."""
        pos = np.asarray(nxt, np.int64)[:, None]
        return np.broadcast_to(pos, (3, *pos.shape)).copy() if self.kind == MROPE else pos


def for_rank(positions: np.ndarray, rank: int) -> np.ndarray:
    """Text positions (batch, seq) as a decoder whose `position_ids` input has `rank` dims takes them (3: the
    same position on the three M-RoPE axes, as transformers broadcasts text-only positions): for feeds made
    from a graph's signature alone (a target's reference inputs)."""
    positions = np.asarray(positions, np.int64)
    return np.broadcast_to(positions, (3, *positions.shape)).copy() if rank == 3 else positions
