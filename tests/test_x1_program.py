"""X1 program files: round trip, and refusal of corrupt, truncated, other-ISA and other-machine files."""

import struct

import numpy as np
import pytest

from edgekit.targets.x1.machine import Machine, load_machine
from edgekit.targets.x1.program import (
    PUSH_NEXT,
    Instr,
    Program,
    ProgramError,
    check_tokens,
    disassemble,
    load_program,
)


def _program(machine) -> Program:
    instrs = [Instr("XL_GEMM.W4A8", (0, 1, 2)), Instr("VADD", (1, 2, 3, 4)), Instr("END")]
    attrs = [{"weight": "w", "in": ["x"], "out": ["y"]}, {"op": "Add", "in": ["y", "b"], "out": ["z"]}]
    w = {
        "w.q": np.arange(12, dtype=np.uint8).reshape(3, 4),
        "w.s": np.ones((3, 1), np.float16),
        "const:b": np.array(2.5, np.float32),
    }
    return Program(
        {"magic": "EKX1PRG", "isa_version": 1, "machine_hash": machine.hash},
        instrs,
        {0: "/model/q_proj/MatMul", 1: "/model/Add"},
        {"inputs": [], "outputs": []},
        attrs,
        w,
        {k: "NMW" for k in w},
        {"tensors": []},
        [],
        [],
        {"graph": "t"},
    )


def test_round_trip(tmp_path):
    m = load_machine()
    path = _program(m).save(tmp_path / "p.x1")
    p = load_program(path, m)
    assert [i.mnemonic for i in p.instructions] == ["XL_GEMM.W4A8", "VADD", "END"]
    assert p.instructions[1].operands[:4] == (1, 2, 3, 4)
    assert p.symbols[0] == "/model/q_proj/MatMul"
    assert p.weights["const:b"].shape == () and float(p.weights["const:b"]) == 2.5
    np.testing.assert_array_equal(p.weights["w.q"], np.arange(12).reshape(3, 4))
    assert p.header["machine_hash"] == m.hash and p.header["isa_version"] == 1
    assert disassemble(p)[0]["symbol"] == "/model/q_proj/MatMul"


def test_truncated_and_corrupt_are_refused(tmp_path):
    m = load_machine()
    data = _program(m).to_bytes()
    (tmp_path / "t.x1").write_bytes(data[:-10])
    with pytest.raises(ProgramError, match="truncated") as e:
        load_program(tmp_path / "t.x1", m)
    assert "t.x1" in str(e.value)
    (tmp_path / "h.x1").write_bytes(data[:20])
    with pytest.raises(ProgramError, match="truncated"):
        load_program(tmp_path / "h.x1", m)
    bad = bytearray(data)
    bad[-5] ^= 0xFF  # inside the last section's payload
    (tmp_path / "c.x1").write_bytes(bytes(bad))
    with pytest.raises(ProgramError, match="checksum mismatch"):
        load_program(tmp_path / "c.x1", m)
    (tmp_path / "m.x1").write_bytes(b"NOTX1PRG" + data[8:])
    with pytest.raises(ProgramError, match="bad magic"):
        load_program(tmp_path / "m.x1", m)


def test_other_isa_and_other_machine_are_refused(tmp_path):
    m = load_machine()
    data = bytearray(_program(m).to_bytes())
    struct.pack_into("<I", data, 8, 2)  # isa_version field
    (tmp_path / "isa.x1").write_bytes(bytes(data))
    with pytest.raises(ProgramError, match="ISA version 2"):
        load_program(tmp_path / "isa.x1", m)
    other = dict(m.content)
    other["clock"] = {"ghz": 1.5}
    m2 = Machine.from_dict(other)
    path = _program(m).save(tmp_path / "p.x1")
    with pytest.raises(ProgramError, match="another machine description"):
        load_program(path, m2)


def test_unbalanced_tokens_are_a_deadlock():
    with pytest.raises(ProgramError, match="deadlock"):
        check_tokens([Instr("KVLD", (0,), flags=PUSH_NEXT), Instr("END")], "p.x1")
