"""`edgekit profile` on an x1 bundle: the last report's emulator runs as a chrome trace, per-op / layer / token /
layer-type tables, a plot, and the summary the profile command prints.

Why apart from the backend: it only reads what the backend kept (`X1Backend.last_runs`, kept when profiling)
and the report's cost; the backend is the run side.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edgekit.errors import ConfigError

from .trace import write_profile as write_trace


def _per_token(dss: dict) -> str:
    """Heads DSS skipped per decode token, of the heads a token has (layers x heads)."""
    return f"{dss['heads_skipped'] / dss['tokens']:.2f} of {dss['heads_total'] // dss['tokens']}"


def write_profile(backend, report, out: Path) -> dict:
    """The last report's runs on `backend` (an `X1Backend` loaded with `keep_runs`) written under `out`."""
    if not backend.keep_runs:
        raise ConfigError("this x1 backend was not loaded for profiling (profile_dir not given)")
    cost = report.cost
    m = backend.machine
    tokens = report.timings["new_tokens"]
    tables = write_trace(
        backend.last_runs,
        m.hz,
        out,
        machine=m.machine.name,
        title=f"{report.model} on x1 ({m.machine.name}): one report, {tokens} tokens, "
        f"{cost['emulated_ms_total']:.2f} ms, {cost['mj_total']:.2f} mJ emulated",
    )
    dss = cost.get("dss", {"sparsity_target": 0.0, "skip_rate": 0.0})
    # where the importance DSS ranks heads by came from: uniform (no scores in the bundle) ranks none above another
    g = backend.policy.importance if backend.policy is not None else None
    importance = (
        "a caller's head mask"
        if g is None
        else "uniform head importance: the bundle has none"
        if np.all(g == g.flat[0])
        else "head importance from the bundle"
    )
    return {
        "summary": {
            "emulated ms / report": round(cost["emulated_ms_total"], 3),
            "mJ / report": round(cost["mj_total"], 3),
            "emulated ms / token": round(cost["emulated_ms_per_token"], 4),
            "mJ / token": round(cost["mj_per_token"], 4),
            "tokens": tokens,
            "DSS": (
                f"on ({importance}), skip rate {cost['skip_rate']:.3f} of target {cost['sparsity_target']:.2f}"
                if backend.dss_active
                else "off"
            ),
            **({"heads skipped / token": _per_token(dss)} if backend.dss_active and dss.get("tokens") else {}),
        },
        "summary_title": f"x1 emulated, machine {m.machine.name} ({m.short_hash})",
        "tables": {
            "per layer": [
                {"layer": r["layer"], "ms": round(r["ms"], 4), "mJ": round(r["mj"], 4), "bound": r["bound"]}
                for r in tables["layers"]
            ],
            "by layer type": [
                {
                    "layer type": r["layer_type"],
                    "ms": round(r["ms"], 4),
                    "mJ": round(r["mj"], 4),
                    "bound": r["bound"],
                }
                for r in tables["layer_types"][:12]
            ],
        },
        "details": {
            "machine": cost["machine"],
            "per_report": {"emulated_ms": cost["emulated_ms_total"], "mj": cost["mj_total"], "tokens": tokens},
            "per_token": {"emulated_ms": cost["emulated_ms_per_token"], "mj": cost["mj_per_token"]},
            "dss": dss,
            "phases": cost["phases"],
            "layers": [{k: r[k] for k in ("layer", "ms", "mj", "bound", "time_share")} for r in tables["layers"]],
            "layer_types": [
                {k: r[k] for k in ("layer_type", "ms", "mj", "bound", "time_share")} for r in tables["layer_types"]
            ],
        },
        "files": tables["paths"],
        "trace": str(out / "trace.json"),
        "plot": str(out / "layer_types.png"),
        "source": cost["source"] + ", one report",
    }
