"""A safetensors checkpoint (one file or shards listed in `model.safetensors.index.json`) read one tensor at a
time.

Why not `safetensors.numpy.load_file`: it loads everything, and a 1.2B model in float32 is ~5 GB before any
conversion copy. Here only the headers are read up front (names, dtypes, shapes, byte ranges); `read(name)`
reads one tensor straight from the file into a fresh float32 array (no mmap, so nothing stays resident), and
`lazy(name)` wraps that in an `onnx_ir.LazyTensor` that the ONNX writer evaluates, writes and drops per tensor.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx_ir as ir

from edgekit.errors import ConfigError, EdgekitError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own limit

# safetensors dtype -> (numpy dtype of the stored bytes, how to widen to float32)
_DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "F64": np.dtype("<f8"),
}


class CheckpointError(EdgekitError):
    """A Hugging Face checkpoint whose files are missing, truncated or hold tensors edgekit cannot read."""

    code = "invalid_weights"


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    dtype: str  # safetensors dtype code (F32, BF16, ...)
    shape: tuple[int, ...]
    start: int  # absolute byte offset in `file`
    nbytes: int


def _read_header(path: Path) -> dict[str, TensorEntry]:
    if not path.is_file():
        raise CheckpointError("safetensors file not found", path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError("not a safetensors file (shorter than its header length)", path)
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise CheckpointError("not a safetensors file (bad header length)", path)
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise CheckpointError("not a safetensors file (header is not JSON)", path) from None
    base = 8 + n
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in info["data_offsets"])
            entry = TensorEntry(
                path, str(info["dtype"]), tuple(int(d) for d in info["shape"]), base + begin, end - begin
            )
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"tensor {name!r} has a malformed header entry", path) from None
        if base + end > size:
            raise CheckpointError(
                f"file is truncated: tensor {name!r} ends at byte {base + end}, the file has {size}", path
            )
        entries[name] = entry
    return entries


class SafetensorsCheckpoint(Mapping[str, np.ndarray]):
    """Name -> float32 array, read on access. Iterating gives names; `shape(name)` costs no I/O."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        self.entries: dict[str, TensorEntry] = {}
        index = self.dir / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
                raise CheckpointError("not a valid safetensors index (no weight_map)", index) from None
            for shard in sorted(set(weight_map.values())):
                if not (self.dir / shard).is_file():
                    raise CheckpointError(f"shard listed in {INDEX_FILE} is missing", self.dir / shard)
                found = _read_header(self.dir / shard)
                self.entries.update({k: v for k, v in found.items() if weight_map.get(k) == shard})
            missing = sorted(set(weight_map) - set(self.entries))
            if missing:
                raise CheckpointError(
                    f"{len(missing)} tensor(s) listed in the index are not in their shard (first: {missing[0]!r})",
                    index,
                )
        elif (self.dir / SINGLE_FILE).is_file():
            self.entries = _read_header(self.dir / SINGLE_FILE)
        else:
            raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in the model directory", self.dir)
        for name, e in self.entries.items():
            if e.dtype not in _DTYPES:
                raise CheckpointError(f"tensor {name!r} has dtype {e.dtype}; edgekit reads F32, F16, BF16, F64", e.file)

    # Mapping ---------------------------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> np.ndarray:
        return self.read(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    # reading ---------------------------------------------------------------------------------------------------
    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name].shape

    def read(self, name: str) -> np.ndarray:
        """One tensor as a new float32 array (bf16 widened exactly by a 16-bit shift)."""
        e = self.entries[name]
        stored = _DTYPES[e.dtype]
        count = int(np.prod(e.shape, dtype=np.int64))
        if count * stored.itemsize != e.nbytes:
            raise CheckpointError(f"tensor {name!r}: {e.nbytes} bytes do not hold shape {e.shape} of {e.dtype}", e.file)
        raw = np.empty(count, stored)
        with open(e.file, "rb") as f:
            f.seek(e.start)
            got = f.readinto(raw.data.cast("B"))
        if got != e.nbytes:
            raise CheckpointError(f"file is truncated at tensor {name!r}", e.file)
        if e.dtype == "BF16":
            out = (raw.astype(np.uint32) << 16).view(np.float32)
        elif e.dtype == "F32":
            out = raw.view(np.float32)
        else:
            out = raw.astype(np.float32)
        return out.reshape(e.shape)

    def read_rows(self, name: str, rows: list[int]) -> np.ndarray:
        """Rows of a 2-D tensor (a few token embeddings) as float32, reading only those rows' bytes."""
        e = self.entries[name]
        if len(e.shape) != 2 or any(not 0 <= r < e.shape[0] for r in rows):
            raise CheckpointError(f"tensor {name!r} of shape {e.shape} has no rows {rows}", e.file)
        stored = _DTYPES[e.dtype]
        width = e.shape[1] * stored.itemsize
        raw = np.empty((len(rows), e.shape[1]), stored)
        with open(e.file, "rb") as f:
            for i, r in enumerate(rows):
                f.seek(e.start + r * width)
                if f.readinto(memoryview(raw[i]).cast("B")) != width:
                    raise CheckpointError(f"file is truncated at tensor {name!r}", e.file)
        if e.dtype == "BF16":
            return (raw.astype(np.uint32) << 16).view(np.float32)
        return raw.astype(np.float32)

    def lazy(self, name: str) -> ir.LazyTensor:
        """An initializer payload that reads the tensor only when the ONNX writer asks for its bytes."""
        return ir.LazyTensor(
            lambda: ir.Tensor(self.read(name), name=name),
            dtype=ir.DataType.FLOAT,
            shape=ir.Shape(self.shape(name)),
            name=name,
            cache=False,
        )


class ModuleNames:
    """For a spec with `renames` ((checkpoint prefix, module prefix), ...): the graph names weights as
    transformers' modules are named (what PEFT adapters and quantization reports say) where the checkpoint on disk
    uses another layout (LLaVA's and Qwen2-VL's legacy ones)."""

    renames: tuple[tuple[str, str], ...] = ()

    def to_checkpoint(self, name: str) -> str:
        """A graph (module) weight name -> the checkpoint's name for it."""
        for ckpt, module in self.renames:
            if name.startswith(module):
                return ckpt + name[len(module) :]
        return name

    def to_module(self, name: str) -> str:
        for ckpt, module in self.renames:
            if name.startswith(ckpt):
                return module + name[len(ckpt) :]
        return name

    def aliases(self, checkpoint_names: Collection[str]) -> dict[str, str]:
        """{graph name: checkpoint name} for every renamed tensor."""
        out = {self.to_module(n): n for n in checkpoint_names}
        return {k: v for k, v in out.items() if k != v}


def find_prefix(names: Collection[str], prefixes: Collection[str], tensor: str, where: Path) -> str:
    """The first of `prefixes` under which the checkpoint has `tensor` (a VLM nests a part's weights under one of
    a few module paths, by transformers version); refused in one line naming what was looked for, and where."""
    found = next((p for p in prefixes if p + tensor in names), None)
    if found is None:
        raise ConfigError(f"no {tensor} in the checkpoint (looked under {', '.join(repr(p) for p in prefixes)})", where)
    return found


def weights_digest(model_dir: str | Path) -> str:
    """One sha256 over a checkpoint's safetensors files (single or shards, in name order): its provenance."""
    import hashlib

    h = hashlib.sha256()
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


class ShapeOnlyWeights(Mapping[str, np.ndarray]):
    """Zero-filled float32 stand-ins with the checkpoint's shapes, for building a graph without reading weights.

    Backed by untouched anonymous memory (`np.zeros` of a large size maps fresh pages lazily), so a graph of a
    5 GB model is built in a few MB; `attach_lazy_weights` then swaps each initializer for the real tensor.
    `aliases` maps a name the builder asks for to the checkpoint's name (e.g. an untied `lm_head`).
    """

    def __init__(self, checkpoint: SafetensorsCheckpoint, aliases: Mapping[str, str] | None = None):
        self.checkpoint = checkpoint
        self.aliases = dict(aliases or {})

    def __getitem__(self, name: str) -> np.ndarray:
        real = self.aliases.get(name, name)
        if real not in self.checkpoint.entries:
            raise KeyError(name)
        return np.zeros(self.checkpoint.shape(real), np.float32)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self.checkpoint.entries) + list(self.aliases))

    def __len__(self) -> int:
        return len(self.checkpoint.entries) + len(self.aliases)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.aliases.get(name, name) in self.checkpoint.entries


def attach_lazy_weights(
    model: ir.Model, checkpoint: SafetensorsCheckpoint, aliases: Mapping[str, str] | None = None
) -> int:
    """Point every initializer of `model` at its checkpoint tensor (read at save time). Returns how many."""
    aliases = dict(aliases or {})
    n = 0
    for name, value in model.graph.initializers.items():
        real = aliases.get(name, name)
        if real in checkpoint.entries:
            value.const_value = checkpoint.lazy(real)
            n += 1
    return n
