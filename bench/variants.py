"""The default model's variants on every target side by side: size, latency, emulated cost (x1), finding F1 (95% CI).

Each variant is built with `edgekit build --target T --recipe NAME` (`fp32`: no recipe, i.e. the FP32 export on
cpu and the x1 build's own INT4 on x1) and scored with `edgekit eval` on the same synthetic test split in one run,
so the ratios are comparable even on a noisy machine. Sizes are relative to the cpu fp32 bundle. On x1 the
latency is the emulator's wall time on this machine (not the chip's); the chip's figures are the emulated ms and
mJ per report (the X1 cost model, per instruction).

    python bench/variants.py                     # all variants on cpu and x1, the 240-study test split
    python bench/variants.py --limit 60 --targets x1 --variants fp32 int4 int4-awq
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from edgekit.build import build
from edgekit.eval.runner import default_test_split, evaluate
from edgekit.plugins import get_model_family
from edgekit.reporter import Reporter

PLAIN = "fp32"  # no recipe
TARGETS = ["cpu", "x1"]


def variants() -> list[str]:
    return [PLAIN, *get_model_family().recipe_names()]


def measure(target: str, variant: str, tmp: Path, data: Path, limit: int | None, threads: int | None) -> dict:
    t0 = time.perf_counter()
    res = build(target, tmp / f"{target}-{variant}", parity=False, recipe=None if variant == PLAIN else variant)
    build_s = time.perf_counter() - t0
    o = evaluate(Reporter.from_bundle(res.bundle, threads=threads), data, limit=limit, include_video=False)["overall"]
    emulated = o.get("emulated")
    compiled = res.figures.get("x1_compile")
    return {
        "target": target,
        "variant": variant,
        "bundle_bytes": res.figures["size"]["bytes"],
        "finding_f1": o["finding_f1"],
        "bleu4": o["bleu4"],
        "hallucinated_finding_rate": o["hallucinated_finding_rate"],
        "latency_ms_p50": o["latency_ms"]["p50"],
        "decode_tokens_per_s": o["decode_tokens_per_s"],
        "emulated_ms_per_report": emulated["ms_per_report"] if emulated else None,
        "emulated_mj_per_report": emulated["mj_per_report"] if emulated else None,
        "host_partitions": sum(compiled["host_partitions"].values()) if compiled else None,
        "n": o["n"],
        "build_s": round(build_s, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", nargs="+", default=variants())
    ap.add_argument("--targets", nargs="+", default=TARGETS)
    ap.add_argument("--limit", type=int, default=None, help="first N test studies (default: all)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=Path("bench/variants.json"))
    a = ap.parse_args()
    data = default_test_split()
    rows = []
    with tempfile.TemporaryDirectory(prefix="edgekit-variants-") as tmp:
        for target in a.targets:
            for v in a.variants:
                r = measure(target, v, Path(tmp), data, a.limit, a.threads)
                rows.append(r)
                print(f"{target} {v}: F1 {r['finding_f1']['value']:.3f}, p50 {r['latency_ms_p50']:.0f} ms", flush=True)
        reference = next((r for r in rows if r["variant"] == PLAIN and r["target"] == "cpu"), None)
        if reference is None:  # the table's sizes are relative to the cpu fp32 bundle: build it when not asked for
            reference = {"bundle_bytes": build("cpu", Path(tmp) / "ref", parity=False).figures["size"]["bytes"]}
    for r in rows:
        r["size_ratio"] = r["bundle_bytes"] / reference["bundle_bytes"]
    doc = {
        "split": "synthetic test",
        "n": rows[0]["n"],
        "size_reference": "cpu fp32 bundle",
        "rows": rows,
        "source": "edgekit eval (finding F1 with 95% percentile bootstrap over studies, 1000 resamples); latency "
        "p50 = wall time per report on this machine (ONNX Runtime CPU, or the x1 emulator); emulated ms and mJ per "
        "report = the x1 emulator's cost model (machine x1-default), mean over reports",
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=2))
    t = Table(title=f"radreport-tiny variants on {' and '.join(a.targets)}: synthetic test split, {doc['n']} studies")
    for c in ("target", "variant", "size MB", "x fp32", "p50 ms", "emul. ms", "emul. mJ", "finding F1 [95% CI]", "n"):
        t.add_column(c, justify="left" if c in ("target", "variant") else "right")
    for r in rows:
        f = r["finding_f1"]
        emul = r["emulated_ms_per_report"] is not None
        t.add_row(
            r["target"],
            r["variant"] if r["variant"] != PLAIN else f"{PLAIN} (no recipe{', INT4' if r['target'] == 'x1' else ''})",
            f"{r['bundle_bytes'] / 1e6:.2f}",
            f"{r['size_ratio']:.3f}",
            f"{r['latency_ms_p50']:.0f}",
            f"{r['emulated_ms_per_report']:.3f}" if emul else "-",
            f"{r['emulated_mj_per_report']:.2f}" if emul else "-",
            f"{f['value']:.3f} [{f['ci95'][0]:.3f}, {f['ci95'][1]:.3f}]",
            str(r["n"]),
        )
    Console(width=160).print(t)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
