"""The X1 program file: one compiled graph as a versioned, checksummed binary (docs/x1/isa.md, issue 4 item 4).

Why a binary with sections and per-section sha256: a program is what a user ships to a device, so a truncated
copy, a flipped bit, a program built for another ISA version or another machine description must be refused at
load time with a message naming the file and the problem, never run with silently wrong numbers.

Layout (little-endian):
    header   magic b"EKX1PRG\\0" | u32 isa_version | u32 format_version | 32 B machine sha256 | u32 n_sections
    table    n_sections x (4 B tag | u64 offset | u64 length | 32 B sha256 of the payload)
    payloads CODE  32-byte instructions (isa.md "Encoding")
             WGHT  packed weights and scales (INT4 nibbles column-major, FP16 scales, FP16/FP32 tensors)
             WIDX  JSON: weight name -> dtype, shape, offset, bytes, space
             IODS  JSON: graph inputs / outputs (name, shape with symbolic dims, dtype)
             MPLN  JSON: memory plan (tensor id -> name, space, offset, bytes, first/last use)
             SYMS  JSON: instruction index -> ONNX node name
             ATTR  JSON: per-instruction operands that do not fit seven u32 (perm, axes, tensor lists, layer)
             HOST  JSON: host partitions (ONNX Runtime) with their inputs, outputs and costs
             HBIN  the host partitions' ONNX models, concatenated
             META  JSON: graph name, compile time, statistics
Operand convention: u32 operand 0 is the index of the instruction's ATTR record; operands 1..6 are tensor
addresses (space << 28 | tensor id, the id indexing the memory plan, whose entry gives the byte offset).
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.errors import EdgekitError

MAGIC = b"EKX1PRG\0"
FORMAT_VERSION = 1
ISA_VERSION = 1
_HEADER = struct.Struct("<8sII32sI")
_ENTRY = struct.Struct("<4sQQ32s")
INSTR_BYTES = 32
_INSTR = struct.Struct("<BBBB7I")
SECTIONS = ("CODE", "WGHT", "WIDX", "IODS", "MPLN", "SYMS", "ATTR", "HOST", "HBIN", "META")

# isa.md instruction table, in table order (opcode = position + 1).
MNEMONICS = (
    "VLD.GLB.128B",
    "KVLD",
    "VST.GLB.128B",
    "KVEVICT",
    "XL_GEMM.W4A8",
    "XL_GEMM.W8A8",
    "XL_GEMM.F16",
    "XL_VMATMUL_CAUSAL",
    "XL_VMATMUL_PV",
    "XL_ROPE_ROTATE",
    "KVAPPEND",
    "VXMAD.F16",
    "VADD",
    "VMUL",
    "VRMSNORM",
    "VLAYERNORM",
    "VSOFTMAX",
    "VSILU_MUL",
    "VGELU",
    "VQUANT.I8",
    "VCOPY",
    "VTRANSPOSE",
    "DSS.MASK",
    "HOSTCALL",
    "BARRIER",
    "END",
)
OPCODE = {m: i + 1 for i, m in enumerate(MNEMONICS)}
QUEUES = ("LOAD", "COMPUTE", "STORE")
QUEUE_OF = {"VLD.GLB.128B": 0, "KVLD": 0, "VST.GLB.128B": 2, "KVEVICT": 2}
SPACES = {"ACT": 0, "KV": 1, "NMW": 2, "DRAM": 3, "REG": 4}
POP_PREV, POP_NEXT, PUSH_PREV, PUSH_NEXT = 1, 2, 4, 8


class ProgramError(EdgekitError):
    """A program file that cannot be run: corrupt, truncated, or built for another ISA or machine."""


@dataclass
class Instr:
    mnemonic: str
    operands: tuple[int, ...] = ()
    flags: int = 0
    variant: int = 0

    @property
    def queue(self) -> int:
        return QUEUE_OF.get(self.mnemonic, 1)

    def encode(self) -> bytes:
        ops = list(self.operands) + [0] * (7 - len(self.operands))
        if len(ops) > 7:
            raise ValueError(f"{self.mnemonic}: more than 7 operands")
        return _INSTR.pack(OPCODE[self.mnemonic], self.queue, self.flags, self.variant, *[o & 0xFFFFFFFF for o in ops])

    @classmethod
    def decode(cls, raw: bytes, where) -> Instr:
        opcode, queue, flags, variant, *ops = _INSTR.unpack(raw)
        if not 1 <= opcode <= len(MNEMONICS):
            raise ProgramError(f"unknown opcode {opcode}", where)
        m = MNEMONICS[opcode - 1]
        if queue != QUEUE_OF.get(m, 1):
            raise ProgramError(f"{m} is in queue {queue}, the ISA puts it in {QUEUE_OF.get(m, 1)}", where)
        return cls(m, tuple(ops), flags, variant)


def address(space: str, offset: int) -> int:
    return (SPACES[space] << 28) | (offset & 0x0FFFFFFF)


def split_address(addr: int) -> tuple[str, int]:
    space = {v: k for k, v in SPACES.items()}.get(addr >> 28, f"?{addr >> 28}")
    return space, addr & 0x0FFFFFFF


@dataclass
class Program:
    """One compiled graph. `weights` maps names to the arrays stored in WGHT (already packed/typed)."""

    header: dict[str, Any]
    instructions: list[Instr]
    symbols: dict[int, str]
    io: dict[str, Any]
    attrs: list[dict[str, Any]] = field(default_factory=list)
    weights: dict[str, np.ndarray] = field(default_factory=dict)
    weight_space: dict[str, str] = field(default_factory=dict)
    memory_plan: dict[str, Any] = field(default_factory=dict)
    host: list[dict[str, Any]] = field(default_factory=list)
    host_models: list[bytes] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def machine_hash(self) -> str:
        return self.header["machine_hash"]

    def to_bytes(self) -> bytes:
        blob, index, offset = [], {}, 0
        for name, arr in self.weights.items():
            raw = np.array(arr, order="C").tobytes()
            index[name] = {
                "dtype": arr.dtype.str,
                "shape": list(arr.shape),
                "offset": offset,
                "bytes": len(raw),
                "space": self.weight_space.get(name, "NMW"),
            }
            blob.append(raw)
            offset += len(raw)
        hbin, hoff = [], 0
        host = []
        for part, raw in zip(self.host, self.host_models):
            host.append({**part, "offset": hoff, "bytes": len(raw)})
            hbin.append(raw)
            hoff += len(raw)
        js = lambda o: json.dumps(o, sort_keys=True, separators=(",", ":")).encode()  # noqa: E731
        payloads = {
            "CODE": b"".join(i.encode() for i in self.instructions),
            "WGHT": b"".join(blob),
            "WIDX": js(index),
            "IODS": js(self.io),
            "MPLN": js(self.memory_plan),
            "SYMS": js({str(k): v for k, v in self.symbols.items()}),
            "ATTR": js(self.attrs),
            "HOST": js(host),
            "HBIN": b"".join(hbin),
            "META": js(self.meta),
        }
        table_end = _HEADER.size + _ENTRY.size * len(payloads)
        entries, pos = [], table_end
        for tag, data in payloads.items():
            entries.append(_ENTRY.pack(tag.encode(), pos, len(data), hashlib.sha256(data).digest()))
            pos += len(data)
        head = _HEADER.pack(
            MAGIC,
            int(self.header["isa_version"]),
            FORMAT_VERSION,
            bytes.fromhex(self.header["machine_hash"]),
            len(payloads),
        )
        return head + b"".join(entries) + b"".join(payloads.values())

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        tmp = path.with_name(path.name + ".partial")
        tmp.write_bytes(self.to_bytes())
        tmp.replace(path)
        return path

    def size_bytes(self) -> int:
        return len(self.to_bytes())


def load_program(path: str | Path, machine) -> Program:
    """Read and verify a program file for `machine` (a `Machine`); every failure is a `ProgramError` naming it."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ProgramError("program file not found", path) from None
    except OSError as err:
        raise ProgramError(f"cannot read program file: {err}", path) from err
    return program_from_bytes(data, machine, path)


def program_from_bytes(data: bytes, machine, where: str | Path = "<program>") -> Program:
    if len(data) < _HEADER.size:
        raise ProgramError(f"truncated: {len(data)} bytes, shorter than the {_HEADER.size}-byte header", where)
    magic, isa, fmt, mhash, n = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ProgramError("not an X1 program (bad magic)", where)
    if isa != machine.machine.isa_version:
        raise ProgramError(
            f"built for ISA version {isa}; machine '{machine.machine.name}' runs ISA version "
            f"{machine.machine.isa_version}",
            where,
        )
    if fmt != FORMAT_VERSION:
        raise ProgramError(
            f"program format version {fmt} is not supported (this edgekit reads {FORMAT_VERSION})", where
        )
    if mhash.hex() != machine.hash:
        raise ProgramError(
            f"built for another machine description (hash {mhash.hex()[:16]}, this machine "
            f"'{machine.machine.name}' is {machine.short_hash}); recompile for it",
            where,
        )
    if n > 64 or _HEADER.size + n * _ENTRY.size > len(data):
        raise ProgramError("truncated or corrupt section table", where)
    sections: dict[str, bytes] = {}
    for i in range(n):
        tag, off, length, digest = _ENTRY.unpack_from(data, _HEADER.size + i * _ENTRY.size)
        name = tag.decode("ascii", "replace")
        if off + length > len(data):
            raise ProgramError(f"truncated: section {name} ends at byte {off + length}, file has {len(data)}", where)
        payload = data[off : off + length]
        if hashlib.sha256(payload).digest() != digest:
            raise ProgramError(f"corrupt: checksum mismatch in section {name}", where)
        sections[name] = payload
    missing = [s for s in SECTIONS if s not in sections]
    if missing:
        raise ProgramError(f"missing section(s) {', '.join(missing)}", where)
    code = sections["CODE"]
    if len(code) % INSTR_BYTES:
        raise ProgramError("corrupt: code section is not a whole number of 32-byte instructions", where)
    instrs = [Instr.decode(code[i : i + INSTR_BYTES], where) for i in range(0, len(code), INSTR_BYTES)]
    check_tokens(instrs, where)
    try:
        load = lambda s: json.loads(sections[s].decode())  # noqa: E731
        index, io, plan, syms, attrs, host, meta = (
            load(s) for s in ("WIDX", "IODS", "MPLN", "SYMS", "ATTR", "HOST", "META")
        )
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ProgramError(f"corrupt: a JSON section does not parse ({err})", where) from None
    blob = sections["WGHT"]
    weights, spaces = {}, {}
    for name, e in index.items():
        if e["offset"] + e["bytes"] > len(blob):
            raise ProgramError(f"corrupt: weight {name} lies outside the weight section", where)
        weights[name] = np.frombuffer(
            blob, np.dtype(e["dtype"]), count=int(np.prod(e["shape"], dtype=np.int64)), offset=e["offset"]
        ).reshape(e["shape"])
        spaces[name] = e["space"]
    hbin = sections["HBIN"]
    host_models = [hbin[p["offset"] : p["offset"] + p["bytes"]] for p in host]
    for ins in instrs:
        if ins.operands and ins.mnemonic not in ("END", "BARRIER") and ins.operands[0] >= len(attrs):
            raise ProgramError(
                f"corrupt: {ins.mnemonic} names attribute record {ins.operands[0]} of {len(attrs)}", where
            )
    header = {
        "magic": MAGIC.rstrip(b"\0").decode(),
        "isa_version": isa,
        "format_version": fmt,
        "machine_hash": mhash.hex(),
    }
    return Program(
        header, instrs, {int(k): v for k, v in syms.items()}, io, attrs, weights, spaces, plan, host, host_models, meta
    )


def check_tokens(instrs: list[Instr], where) -> None:
    """Dependency tokens must balance between each pair of neighbouring queues, else the program deadlocks."""
    sent = {(0, 1): 0, (1, 0): 0, (1, 2): 0, (2, 1): 0}
    for ins in instrs:
        q = ins.queue
        if ins.flags & PUSH_NEXT and q < 2:
            sent[(q, q + 1)] += 1
        if ins.flags & PUSH_PREV and q > 0:
            sent[(q, q - 1)] += 1
        if ins.flags & POP_PREV and q > 0:
            sent[(q - 1, q)] -= 1
        if ins.flags & POP_NEXT and q < 2:
            sent[(q + 1, q)] -= 1
    bad = [f"{QUEUES[a]}->{QUEUES[b]}" for (a, b), v in sent.items() if v]
    if bad:
        raise ProgramError(f"dependency tokens do not balance ({', '.join(bad)}): the program would deadlock", where)


def disassemble(program: Program) -> list[dict[str, Any]]:
    """One row per instruction: index, mnemonic, queue, operands (as space:offset), attributes, ONNX symbol."""
    rows = []
    for i, ins in enumerate(program.instructions):
        attr = program.attrs[ins.operands[0]] if ins.operands and ins.operands[0] < len(program.attrs) else {}
        ops = [f"{s}:{o}" for s, o in (split_address(a) for a in ins.operands[1:] if a)]
        extra = {k: v for k, v in attr.items() if k not in ("in", "out")}
        rows.append(
            {
                "index": i,
                "mnemonic": ins.mnemonic,
                "queue": QUEUES[ins.queue],
                "operands": ops,
                "attrs": extra,
                "symbol": program.symbols.get(i, ""),
            }
        )
    return rows
