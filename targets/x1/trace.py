"""Where emulated time and energy go: a chrome trace, per-op / per-layer / per-token reports, and a plot.

Input is what the emulator records (`RunResult.records`: one `InstrRecord` per executed instruction, with its
queue, start cycle, cycles, compute- and memory-cycles, bound and energy per action). Times are *emulated* X1
time (cycles / clock), not wall time: runs (one per emulator call) are laid end to end, as the chip would run
them. The trace has one process ("X1") with one track per queue (LOAD, COMPUTE, STORE) and a "calls" track with
one span per run, so Perfetto / chrome://tracing show the overlap of the three queues directly.
"""

from __future__ import annotations

import csv
import json
import re
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

QUEUES = ("LOAD", "COMPUTE", "STORE")
_CALLS_TID = 0
_LAYER_IN_NAME = re.compile(r"layers\.(\d+)")


def _get(obj, key, default=None):
    return obj.get(key, default) if isinstance(obj, dict) else getattr(obj, key, default)


def queue_name(q) -> str:
    """LOAD/COMPUTE/STORE from a name, an enum or the ISA's queue number (0, 1, 2)."""
    if hasattr(q, "name"):
        q = q.name
    if isinstance(q, int):
        return QUEUES[q]
    return str(q).upper()


def label_runs(history: Iterable) -> list[tuple[str, object]]:
    """[(label, RunResult)] from RunResults or (phase, RunResult) pairs; decode runs numbered per token."""
    out: list[tuple[str, object]] = []
    counts: defaultdict[str, int] = defaultdict(int)
    for item in history:
        phase, run = item if isinstance(item, tuple) else (_get(item, "graph", "run") or "run", item)
        counts[phase] += 1
        out.append((f"{phase} {counts[phase]}" if phase in ("decode", "embed", "run") else phase, run))
    return out


def _energy_pj(rec) -> float:
    e = _get(rec, "energy_pj", {}) or {}
    return float(sum(e.values())) if isinstance(e, dict) else float(e)


def layer_type(rec) -> str:
    """A record's layer type from its ONNX symbol: the module path inside the layer, at most two levels
    ('self_attn.q_proj', 'mlp.gate_proj', 'input_layernorm', 'self_attn' for the attention core); the mnemonic
    when the instruction has no symbol."""
    symbol = _get(rec, "symbol") or ""
    parts = [p for p in str(symbol).split("/") if p]
    if len(parts) < 2:
        return str(_get(rec, "mnemonic", "?"))
    module = parts[:-1]  # drop the op name
    for i, p in enumerate(module):
        if _LAYER_IN_NAME.fullmatch(p):
            module = module[i + 1 :]
            break
    else:
        module = module[1:] if len(module) > 1 else module
    return ".".join(module[:2]) if module else str(_get(rec, "mnemonic", "?"))


def record_layer(rec):
    layer = _get(rec, "layer")
    if layer is None or (isinstance(layer, int) and layer < 0):
        m = _LAYER_IN_NAME.search(str(_get(rec, "symbol") or ""))
        return int(m.group(1)) if m else None
    return layer


def _run_cycles(run) -> float:
    totals = _get(run, "totals", {}) or {}
    cycles = float(_get(totals, "cycles", 0.0) or 0.0)
    end = max(
        (float(_get(r, "start_cycle", 0)) + float(_get(r, "cycles", 0)) for r in _get(run, "records", [])), default=0.0
    )
    return max(cycles, end)


# ------------------------------------------------------------------------------------------------------------
# chrome trace
# ------------------------------------------------------------------------------------------------------------
def chrome_trace(history: Iterable, clock_hz: float, *, machine: str = "") -> dict:
    """The trace document (write it with `json.dump`): complete events ("ph": "X") in microseconds."""
    us_per_cycle = 1e6 / clock_hz
    events = [
        {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": f"X1 {machine}".strip()}},
        {"name": "thread_name", "ph": "M", "pid": 1, "tid": _CALLS_TID, "args": {"name": "calls"}},
    ]
    for i, q in enumerate(QUEUES, start=1):
        events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": i, "args": {"name": q}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": i, "args": {"sort_index": i}})
    offset = 0.0
    for label, run in label_runs(history):
        span = _run_cycles(run)
        totals = _get(run, "totals", {}) or {}
        events.append(
            {
                "name": label,
                "ph": "X",
                "pid": 1,
                "tid": _CALLS_TID,
                "ts": offset * us_per_cycle,
                "dur": span * us_per_cycle,
                "cat": "call",
                "args": {"cycles": span, "energy_j": _get(totals, "energy_j")},
            }
        )
        for rec in _get(run, "records", []):
            q = queue_name(_get(rec, "queue"))
            events.append(
                {
                    "name": str(_get(rec, "mnemonic")),
                    "ph": "X",
                    "pid": 1,
                    "tid": QUEUES.index(q) + 1 if q in QUEUES else len(QUEUES) + 1,
                    "cat": q,
                    "ts": (offset + float(_get(rec, "start_cycle", 0))) * us_per_cycle,
                    "dur": float(_get(rec, "cycles", 0)) * us_per_cycle,
                    "args": {
                        "symbol": _get(rec, "symbol"),
                        "layer": record_layer(rec),
                        "bound": _get(rec, "bound"),
                        "cycles": _get(rec, "cycles"),
                        "compute_cycles": _get(rec, "compute_cycles"),
                        "memory_cycles": _get(rec, "memory_cycles"),
                        "energy_pj": _get(rec, "energy_pj"),
                        "index": _get(rec, "index"),
                        "call": label,
                    },
                }
            )
        offset += span
    return {
        "traceEvents": events,
        "displayTimeUnit": "ns",
        "otherData": {"time": "emulated X1 time", "clock_hz": clock_hz, "machine": machine},
    }


# ------------------------------------------------------------------------------------------------------------
# reports
# ------------------------------------------------------------------------------------------------------------
def _aggregate(history: Iterable, key, clock_hz: float) -> list[dict]:
    rows: dict = {}
    for _label, run in label_runs(history):
        for rec in _get(run, "records", []):
            k = key(rec)
            r = rows.setdefault(
                k,
                {
                    "_key": k,
                    "count": 0,
                    "cycles": 0.0,
                    "compute_cycles": 0.0,
                    "memory_cycles": 0.0,
                    "energy_pj": 0.0,
                    "_bounds": defaultdict(float),
                },
            )
            cycles = float(_get(rec, "cycles", 0))
            r["count"] += 1
            r["cycles"] += cycles
            r["compute_cycles"] += float(_get(rec, "compute_cycles", 0) or 0)
            r["memory_cycles"] += float(_get(rec, "memory_cycles", 0) or 0)
            r["energy_pj"] += _energy_pj(rec)
            r["_bounds"][str(_get(rec, "bound"))] += cycles
    total_c = sum(r["cycles"] for r in rows.values()) or 1.0
    total_e = sum(r["energy_pj"] for r in rows.values()) or 1.0
    out = []
    for r in rows.values():
        bounds = r.pop("_bounds")
        r.update(
            ms=r["cycles"] / clock_hz * 1e3,
            mj=r.pop("energy_pj") * 1e-9,
            bound=max(bounds, key=bounds.get) if bounds else "",
            time_share=r["cycles"] / total_c,
        )
        r["energy_share"] = r["mj"] / (total_e * 1e-9)
        out.append(r)
    return sorted(out, key=lambda r: -r["cycles"])


def op_report(history: Iterable, clock_hz: float) -> list[dict]:
    """Per ONNX op (symbol) and mnemonic, summed over all runs."""
    rows = _aggregate(history, lambda r: (str(_get(r, "symbol") or ""), str(_get(r, "mnemonic"))), clock_hz)
    for r in rows:
        r["symbol"], r["mnemonic"] = r.pop("_key")
        r["layer_type"] = layer_type({"symbol": r["symbol"], "mnemonic": r["mnemonic"]})
    return rows


def layer_report(history: Iterable, clock_hz: float) -> list[dict]:
    """Per decoder/encoder layer ('-' for instructions outside any layer)."""
    rows = _aggregate(history, lambda r: record_layer(r), clock_hz)
    for r in rows:
        k = r.pop("_key")
        r["layer"] = "-" if k is None else k
    return sorted(rows, key=lambda r: (isinstance(r["layer"], str), r["layer"] if isinstance(r["layer"], int) else 0))


def layer_type_report(history: Iterable, clock_hz: float) -> list[dict]:
    rows = _aggregate(history, layer_type, clock_hz)
    for r in rows:
        r["layer_type"] = r.pop("_key")
    return rows


def token_report(history: Iterable, clock_hz: float) -> list[dict]:
    """One row per emulator run (encode, embeds, prefill, each decode token) with its totals."""
    rows = []
    for label, run in label_runs(history):
        totals = _get(run, "totals", {}) or {}
        recs = _get(run, "records", [])
        cycles = _run_cycles(run)
        bounds: defaultdict[str, float] = defaultdict(float)
        for rec in recs:
            bounds[str(_get(rec, "bound"))] += float(_get(rec, "cycles", 0))
        energy_j = _get(totals, "energy_j")
        rows.append(
            {
                "call": label,
                "instructions": len(recs),
                "cycles": cycles,
                "ms": cycles / clock_hz * 1e3,
                "mj": float(energy_j) * 1e3 if energy_j is not None else sum(map(_energy_pj, recs)) * 1e-9,
                "bound": max(bounds, key=bounds.__getitem__) if bounds else "",
            }
        )
    return rows


def write_csv(rows: list[dict], path: Path) -> Path:
    cols = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)
    return path


def plot_layer_types(rows: list[dict], path: Path, title: str, top: int = 15) -> Path:
    """Two bar charts side by side: emulated time and energy per layer type, bars coloured by bound type."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(rows, key=lambda r: -r["ms"])[:top][::-1]
    colours = {"memory": "#d8703b", "compute": "#3b7dd8", "dispatch": "#8a8a8a"}
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 0.35 * len(rows) + 1.6), sharey=True)
    names = [r["layer_type"] for r in rows]
    c = [colours.get(r["bound"], "#6a6a6a") for r in rows]
    a.barh(names, [r["ms"] for r in rows], color=c)
    a.set_xlabel("emulated time (ms)")
    b.barh(names, [r["mj"] for r in rows], color=c)
    b.set_xlabel("energy (mJ, dynamic)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=v) for v in colours.values()]
    b.legend(handles, [f"{k}-bound" for k in colours], fontsize=8, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_profile(history: Iterable, clock_hz: float, out: Path, *, title: str, machine: str = "") -> dict:
    """Everything `edgekit profile` writes for an x1 bundle; returns {name: path} and the summary tables."""
    history = list(history)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tables = {
        "ops": op_report(history, clock_hz),
        "layers": layer_report(history, clock_hz),
        "tokens": token_report(history, clock_hz),
        "layer_types": layer_type_report(history, clock_hz),
    }
    paths = {"trace": out / "trace.json"}
    (out / "trace.json").write_text(json.dumps(chrome_trace(history, clock_hz, machine=machine)))
    for name, rows in tables.items():
        (out / f"{name}.json").write_text(json.dumps(rows, indent=1))
        paths[name] = write_csv(rows, out / f"{name}.csv")
    paths["plot"] = plot_layer_types(tables["layer_types"], out / "layer_types.png", title)
    return {"paths": {k: str(v) for k, v in paths.items()}, **tables}
