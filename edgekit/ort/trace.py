"""ONNX Runtime's per-node traces of one report merged into one chrome trace, a summary by op type, a plot.

ORT writes one trace per session (vision encoder, embeddings, decoder); a user wants one file to open in
Perfetto or chrome://tracing, and a table of the op types that dominate, per graph.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path


def merge_traces(traces: list[Path], out: Path) -> Path:
    """Concatenate ORT chrome traces into one file, one process row per graph."""
    events = []
    for pid, path in enumerate(traces):
        graph = path.name.split("_20")[0]  # ORT names files <prefix>_<date>.json
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": graph}})
        for ev in json.loads(path.read_text()):
            ev = dict(ev)
            ev["pid"] = pid
            events.append(ev)
    out.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return out


def op_summary(traces: list[Path]) -> list[dict]:
    """Total kernel time per (graph, op type), largest first."""
    totals: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    for path in traces:
        graph = path.name.split("_20")[0]
        for ev in json.loads(path.read_text()):
            if ev.get("cat") != "Node" or not str(ev.get("name", "")).endswith("_kernel_time"):
                continue
            op = ev.get("args", {}).get("op_name", "?")
            t = totals[(graph, op)]
            t[0] += ev.get("dur", 0) / 1000.0
            t[1] += 1
    all_ms = sum(v[0] for v in totals.values()) or 1.0
    rows = [
        {"graph": g, "op": op, "ms": round(ms, 3), "calls": int(n), "share": round(ms / all_ms, 4)}
        for (g, op), (ms, n) in totals.items()
    ]
    return sorted(rows, key=lambda r: -r["ms"])


def plot_ops(rows: list[dict], out: Path, title: str, top: int = 15) -> Path:
    """A horizontal bar chart of the op types that take the most time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = rows[:top][::-1]
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.2))
    ax.barh([f"{r['graph']}: {r['op']}" for r in rows], [r["ms"] for r in rows], color="#3b7dd8")
    ax.set_xlabel("kernel time (ms), ONNX Runtime profiler")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
