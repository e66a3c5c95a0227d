"""`X1Backend`: edgekit's generation backend protocol over the X1 emulator, so reports, eval and the daemon run
x1 bundles like any other target.

The KV cache stays inside the emulator's SRAM-bank model (INT4 + FP16 scales, window + spill): `decode` returns
an opaque `KVCache` as `present` and takes it back as `past` (a list of (key, value) float arrays is accepted too,
and quantised on entry). Each call's `RunResult` (instruction records, cycles, energy) is appended to `history`.

Dynamic head sparsity hook: before each decode step after the first (prefill and the first decode token run
dense, dss.md), `head_mask_fn(layer_stats)` is called with
`layer_stats`, a float32 (layers, heads) array: for each layer and query head, the L2 norm of that head's
attention output (the `head_dim` values that feed the O projection, FP16 as stored) for the last query row of
batch item 0, from the most recent call in which the head was computed (a skipped head keeps its last norm).
It returns a bool (layers, heads) mask of heads to compute (None = all).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edgekit.errors import BundleError

from .emulator import Emulator, KVCache, RunResult
from .machine import load_machine
from .program import load_program

PROGRAM_ROLES = {"vision_encoder": "x1_vision_encoder", "embed_tokens": "x1_embed_tokens", "decoder": "x1_decoder"}
PROGRAM_FILES = {"vision_encoder": "vision_encoder.x1", "embed_tokens": "embed_tokens.x1",
                 "decoder": "decoder_model_merged.x1"}
MACHINE_ROLE = "x1_machine"


def _locate(bundle_or_dir) -> tuple[dict[str, Path], Path | None]:
    """Program files by graph, and the machine description the bundle carries (if any)."""
    from edgekit.bundle import load_bundle

    b = bundle_or_dir
    if not hasattr(b, "component"):
        p = Path(b)
        if p.is_dir() and not (p / "manifest.json").is_file():
            files = {g: p / f for g, f in PROGRAM_FILES.items() if (p / f).is_file()}
            if not files:
                raise BundleError("no X1 programs (*.x1) in this folder", p)
            machine = p / "machine.toml"
            return files, machine if machine.is_file() else None
        b = load_bundle(p)
    files = {g: b.component(role) for g, role in PROGRAM_ROLES.items() if role in b.roles}
    if "decoder" not in files:
        raise BundleError("bundle has no X1 programs (built for another target?)", b.source)
    return files, b.component(MACHINE_ROLE) if MACHINE_ROLE in b.roles else None


class X1Backend:
    def __init__(self, bundle_or_dir, machine=None, *, head_mask_fn=None):
        files, machine_file = _locate(bundle_or_dir)
        self.machine = machine if machine is not None else load_machine(machine_file)
        self.programs = {g: load_program(f, self.machine) for g, f in files.items()}
        self.emulator = Emulator(self.programs, self.machine)
        self.head_mask_fn = head_mask_fn
        self.history: list[RunResult] = []
        self.num_layers = self.emulator.layers
        self.kv_heads, self.head_dim = self.emulator.kv_heads, self.emulator.head_dim
        self.heads = self.emulator.heads
        self._layer_stats = np.full((self.num_layers, self.heads), np.nan, np.float32)
        self._unmerged: list[RunResult] = []  # decode results whose head norms are not in `layer_stats` yet
        self.last_mask: np.ndarray | None = None
        self._decode_steps = 0

    @property
    def layer_stats(self) -> np.ndarray:
        """The latest norm of each (layer, head) (see the module docstring), merged from the decode results on
        read: generation without a head-mask policy never computes them."""
        for r in self._unmerged:
            if r.head_norms is not None:
                self._layer_stats = np.where(np.isnan(r.head_norms), self._layer_stats, r.head_norms).astype(
                    np.float32)
        self._unmerged.clear()
        return self._layer_stats

    @layer_stats.setter
    def layer_stats(self, value) -> None:
        self._unmerged.clear()
        self._layer_stats = np.asarray(value, np.float32)

    def encode_images(self, pixel_values: np.ndarray) -> np.ndarray:
        r = self.emulator.run("vision_encoder", {"pixel_values": np.ascontiguousarray(pixel_values, np.float32)})
        self.history.append(r)
        return r.outputs["image_features"]

    def embed(self, input_ids: np.ndarray) -> np.ndarray:
        r = self.emulator.run("embed_tokens", {"input_ids": np.ascontiguousarray(input_ids, np.int64)})
        self.history.append(r)
        return r.outputs["inputs_embeds"]

    def decode(self, inputs_embeds: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
               past=None):
        feeds = {"inputs_embeds": np.ascontiguousarray(inputs_embeds, np.float32),
                 "attention_mask": np.ascontiguousarray(attention_mask, np.int64),
                 "position_ids": np.ascontiguousarray(position_ids, np.int64)}
        kv = None
        if past is None:
            kv = self.emulator.new_kv()
            self._decode_steps = 0
        elif isinstance(past, KVCache):
            kv = past
        else:
            kv = KVCache.from_arrays(list(past), self.emulator.window, self.emulator.new_kv().group)
        mask = None
        if self.head_mask_fn is not None and past is not None and self._decode_steps >= 2:  # dss.md: prefill and
            # the first decode token run dense (no statistics yet)
            mask = self.head_mask_fn(self.layer_stats.copy())
        self.last_mask = None if mask is None else np.asarray(mask, bool)
        r = self.emulator.run("decoder", feeds, head_mask=self.last_mask, kv_state=kv, want_present=False)
        self._decode_steps += 1
        self._unmerged.append(r)
        self.history.append(r)
        return r.outputs["logits"], r.kv_state

    def totals(self) -> dict:
        """Emulated cycles, seconds and energy over `history`."""
        keys = ("cycles", "seconds", "energy_j")
        return {k: float(sum(r.totals[k] for r in self.history)) for k in keys} | {"calls": len(self.history)}
