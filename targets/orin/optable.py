"""onnx-tensorrt's operator support table, as data: which ONNX ops TensorRT's parser imports, for which types,
under which restrictions.

Why a shipped table and not a query of TensorRT: the capability check runs where the bundle is built, a machine
that usually has no TensorRT. `trt_ops.json` is `docs/operators.md` of onnx/onnx-tensorrt turned into JSON by
`parse_operators_md` (its source, commit and the changelog entries applied on top are recorded inside it);
`python -m edgekit.targets.orin.optable operators.md` regenerates it from another release's file.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from functools import lru_cache
from importlib.resources import files

TABLE_FILE = "trt_ops.json"
# ONNX tensor element types by the names the table uses
TYPE_NAMES = {
    1: "FP32",
    2: "UINT8",
    3: "INT8",
    6: "INT32",
    7: "INT64",
    9: "BOOL",
    10: "FP16",
    11: "DOUBLE",
    16: "BF16",
    17: "FP8",
    22: "INT4",
}


@dataclass(frozen=True)
class OpSupport:
    supported: bool
    types: tuple[str, ...]
    restrictions: str


@dataclass(frozen=True)
class OpTable:
    tensorrt: str
    opset_range: tuple[int, int]
    source: dict
    operators: dict[str, OpSupport]

    def get(self, op_type: str) -> OpSupport | None:
        return self.operators.get(op_type)

    def cite(self) -> str:
        s = self.source
        return f"onnx-tensorrt {s['file']} at {s['ref']} ({s['commit'][:10]}), deltas to TensorRT {self.tensorrt}"


_ROW = re.compile(r"^\|\s*([A-Za-z0-9_]+)\s*\|\s*(Y|N)[^|]*(?:\|([^|]*))?(?:\|(.*))?$")
_HEADER = re.compile(r"opset\s+(\d+)\s+to\s+opset\s+(\d+)", re.IGNORECASE)


def parse_operators_md(text: str) -> tuple[tuple[int, int] | None, dict[str, dict]]:
    """The opset range the page states and {op: {supported, types, restrictions}} from its support matrix."""
    header = _HEADER.search(text)
    ops: dict[str, dict] = {}
    for line in text.splitlines():
        m = _ROW.match(line.strip())
        if not m or m.group(1) in ("Operator",):
            continue
        types = [t.strip().replace("INF64", "INT64") for t in (m.group(3) or "").split(",") if t.strip()]
        restrictions = (m.group(4) or "").strip().strip("|").strip()
        ops[m.group(1)] = {"supported": m.group(2) == "Y", "types": types, "restrictions": restrictions}
    return ((int(header.group(1)), int(header.group(2))) if header else None), ops


@lru_cache(maxsize=1)
def load_table() -> OpTable:
    """The shipped table (package data, found with importlib.resources)."""
    data = json.loads((files(__package__) / TABLE_FILE).read_text(encoding="utf-8"))
    ops = {
        name: OpSupport(bool(v["supported"]), tuple(v["types"]), v.get("restrictions", ""))
        for name, v in data["operators"].items()
    }
    return OpTable(data["tensorrt"], tuple(data["opset_range"]), data["source"], ops)


def main(argv: list[str]) -> int:
    """Print the JSON operators part of a `docs/operators.md` (to paste into trt_ops.json with its source)."""
    if len(argv) != 1:
        sys.stderr.write("usage: python -m edgekit.targets.orin.optable path/to/operators.md\n")
        return 2
    with open(argv[0], encoding="utf-8") as f:
        opsets, ops = parse_operators_md(f.read())
    sys.stdout.write(json.dumps({"opset_range": opsets, "operators": ops}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
