"""The default model's variants side by side: size, finding F1 (95% CI), BLEU-4 and decode tokens/s on `cpu`.

Each variant is built with `edgekit build --target cpu --recipe NAME` and scored with `edgekit eval` on the same
synthetic test split in one run, so the ratios are comparable even on a noisy machine.

    python bench/variants.py                     # all variants, the 240-study test split
    python bench/variants.py --limit 60 --variants fp32 int4 int4-awq
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
from edgekit.reporter import Reporter

VARIANTS = ["fp32", "fp16", "int8", "int4", "int4-awq", "int4-heads38", "int4-sparse24"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", nargs="+", default=VARIANTS)
    ap.add_argument("--limit", type=int, default=None, help="first N test studies (default: all)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=Path("bench/variants.json"))
    a = ap.parse_args()
    data = default_test_split()
    rows = []
    with tempfile.TemporaryDirectory(prefix="edgekit-variants-") as tmp:
        for v in a.variants:
            t0 = time.perf_counter()
            res = build("cpu", Path(tmp) / v, parity=False, recipe=None if v == "fp32" else v)
            build_s = time.perf_counter() - t0
            result = evaluate(
                Reporter.from_bundle(res.bundle, threads=a.threads), data, limit=a.limit, include_video=False
            )
            o = result["overall"]
            rows.append(
                {
                    "variant": v,
                    "bundle_bytes": res.figures["size"]["bytes"],
                    "finding_f1": o["finding_f1"],
                    "bleu4": o["bleu4"],
                    "rouge_l": o["rouge_l"]["value"],
                    "hallucinated_finding_rate": o["hallucinated_finding_rate"],
                    "decode_tokens_per_s": o["decode_tokens_per_s"],
                    "latency_ms_p50": o["latency_ms"]["p50"],
                    "n": o["n"],
                    "build_s": round(build_s, 1),
                }
            )
            print(
                f"{v}: F1 {o['finding_f1']['value']:.3f} BLEU {o['bleu4']['value']:.1f} "
                f"{o['decode_tokens_per_s']:.0f} tok/s",
                flush=True,
            )
    base = rows[0]
    for r in rows:
        r["size_ratio"] = r["bundle_bytes"] / base["bundle_bytes"]
        r["speed_ratio"] = r["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        r["f1_delta_points"] = 100 * (r["finding_f1"]["value"] - base["finding_f1"]["value"])
        r["bleu4_delta"] = r["bleu4"]["value"] - base["bleu4"]["value"]
    doc = {
        "split": "synthetic test",
        "n": rows[0]["n"],
        "reference": rows[0]["variant"],
        "rows": rows,
        "source": "edgekit eval (finding F1 with 95% percentile bootstrap over studies, 1000 resamples; "
        "sacrebleu BLEU-4 multi-reference); decode tok/s = mean over reports, ONNX Runtime CPU",
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=2))
    t = Table(title=f"radreport-tiny variants on cpu: synthetic test split, {doc['n']} studies")
    for c in ("variant", "size MB", "x fp32", "finding F1 [95% CI]", "dF1 pts", "BLEU-4", "dBLEU", "tok/s", "x fp32"):
        t.add_column(c)
    for r in rows:
        f = r["finding_f1"]
        t.add_row(
            r["variant"],
            f"{r['bundle_bytes'] / 1e6:.2f}",
            f"{r['size_ratio']:.3f}",
            f"{f['value']:.3f} [{f['ci95'][0]:.3f}, {f['ci95'][1]:.3f}]",
            f"{r['f1_delta_points']:+.1f}",
            f"{r['bleu4']['value']:.1f}",
            f"{r['bleu4_delta']:+.2f}",
            f"{r['decode_tokens_per_s']:.0f}",
            f"{r['speed_ratio']:.2f}",
        )
    Console(width=160).print(t)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
