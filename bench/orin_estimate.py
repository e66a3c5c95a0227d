"""Orin estimate table: every device x power mode x precision, for the seed's 1.2B VLM and radreport-tiny, against
the seed's AGX Orin figures as ratios, and against NVIDIA's published Orin Nano tokens/s.

Side by side in one run (analytic, well under a second):
- the seed-1.2b shape (assumed: a TinyLlama-1.1B-shaped decoder + SigLIP-B/16 tower, 1.19B parameters) in FP16 and
  INT4 (block 32, the int4-orin recipe's), and radreport-tiny (its packaged config) in FP16 and INT4, on every
  device and nvpmodel mode in targets/orin/devices.toml;
- on AGX Orin 64GB, the estimate / seed ratios for latency, power and memory (seed: 1420 -> 312 ms, 58 -> 24 W,
  8.7 -> 2.1 GB per report), an FP32 row (what an unquantised, un-converted baseline would cost), and how many
  generated tokens would make each estimate equal the seed's latency;
- the decode-rate check against NVIDIA's published MLC INT4 tokens/s on Orin Nano.
The report: 256 image tokens + `--prompt` text tokens in, `--new` tokens out (defaults 32 and 96: about 70 words,
a chest-radiograph findings + impression section). radreport-tiny uses its own 16 image tokens.

    python bench/orin_estimate.py [--prompt 32] [--new 96] [--out out/bench/orin_estimate.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from edgekit.targets.orin.estimate import Precision, estimate_report, known_devices, preset, reference_checks

SEED = {  # ../shared/seed-figures.md: 1.2B medical VLM on Jetson AGX Orin, LoRA then INT4
    "fp16": {"latency_ms": 1420.0, "avg_power_w": 58.0, "memory_gb": 8.7},
    "int4": {"latency_ms": 312.0, "avg_power_w": 24.0, "memory_gb": 2.1},
}
PRECISIONS = {"fp16": Precision(weights="fp16"), "int4": Precision(weights="int4", block=32)}


def _row(est) -> dict:
    return {
        "source": est.source,
        "latency_ms": est.latency_ms,
        "energy_j": est.energy_j,
        "avg_power_w": est.avg_power_w,
        "ms_per_token": est.ms_per_token,
        "memory_gb": est.memory["total_gb"],
        "decode_bound": est.phase("decode").bound,
    }


def tokens_to_match(shape, weights: Precision, target_ms: float, prompt: int) -> int | None:
    """The report length (new tokens) at which the estimate equals `target_ms` on AGX Orin 64GB MAXN."""
    for n in range(1, 2049):
        if estimate_report(shape, weights=weights, prompt_tokens=prompt, new_tokens=n).latency_ms >= target_ms:
            return n
    return None


def run(prompt: int, new: int) -> dict:
    seed, tiny = preset("seed-1.2b"), preset("radreport-tiny")
    grid = []
    for device, modes in known_devices().items():
        for mode in modes:
            row = {"device": device, "mode": mode}
            for model_name, shape in (("seed-1.2b", seed), ("radreport-tiny", tiny)):
                for pname, prec in PRECISIONS.items():
                    est = estimate_report(shape, device, mode, weights=prec, prompt_tokens=prompt, new_tokens=new)
                    row[f"{model_name}/{pname}"] = _row(est)
            grid.append(row)
    seed_rows = []
    for pname, prec in {**PRECISIONS, "fp32": Precision(weights="fp32")}.items():
        est = estimate_report(seed, "agx-orin-64", "MAXN", weights=prec, prompt_tokens=prompt, new_tokens=new)
        r = {"precision": pname, **_row(est), "breakdown": est.breakdown}
        ref = SEED.get(pname)
        if ref:
            r.update({f"{k}_vs_seed": r[k] / v for k, v in ref.items()})
            r["new_tokens_matching_seed_latency"] = tokens_to_match(seed, prec, ref["latency_ms"], prompt)
        seed_rows.append(r)
    lengths = []
    for n in (32, 48, 64, 96, 128, 192):
        e16 = estimate_report(seed, weights=PRECISIONS["fp16"], prompt_tokens=prompt, new_tokens=n)
        e4 = estimate_report(seed, weights=PRECISIONS["int4"], prompt_tokens=prompt, new_tokens=n)
        lengths.append(
            {
                "new_tokens": n,
                "fp16_ms": e16.latency_ms,
                "int4_ms": e4.latency_ms,
                "speedup": e16.latency_ms / e4.latency_ms,
                "fp16_w": e16.avg_power_w,
                "int4_w": e4.avg_power_w,
            }
        )
    return {
        "report": {"image_tokens": seed.vision.image_tokens, "prompt_tokens": prompt, "new_tokens": new},
        "seed_model": seed.to_dict(),
        "seed_figures": SEED,
        "seed_agx64_maxn": seed_rows,
        "report_length": lengths,
        "grid": grid,
        "references": reference_checks(),
        "source": "edgekit Orin cost model (edgekit.targets.orin.estimate); NVIDIA's published tables; no device run",
    }


def print_tables(result: dict) -> None:
    r = result["report"]
    m = result["seed_model"]
    print(
        f"report: {r['image_tokens']} image + {r['prompt_tokens']} prompt tokens in, {r['new_tokens']} out; "
        f"seed-1.2b = {m['params'] / 1e9:.2f}B parameters (assumed shape)"
    )
    print("\nseed-1.2b on AGX Orin 64GB MAXN vs the seed's figures (estimate / seed)")
    print(
        f"{'precision':9} {'ms':>8} {'J':>7} {'W':>6} {'ms/tok':>7} {'GB':>5} {'t/seed':>7} {'W/seed':>7} "
        f"{'GB/seed':>7} {'tokens for seed ms':>18}"
    )
    for s in result["seed_agx64_maxn"]:
        ratios = (
            f"{s['latency_ms_vs_seed']:7.2f} {s['avg_power_w_vs_seed']:7.2f} {s['memory_gb_vs_seed']:7.2f} "
            f"{s['new_tokens_matching_seed_latency']!s:>18}"
            if "latency_ms_vs_seed" in s
            else f"{'-':>7} {'-':>7} {'-':>7} {'-':>18}"
        )
        print(
            f"{s['precision']:9} {s['latency_ms']:8.1f} {s['energy_j']:7.2f} {s['avg_power_w']:6.1f} "
            f"{s['ms_per_token']:7.2f} {s['memory_gb']:5.2f} {ratios}"
        )
    print("\nreport length (AGX Orin 64GB MAXN, seed-1.2b): seed speed-up FP16 -> INT4 is 1420/312 = 4.55x")
    print(f"{'new tok':>7} {'fp16 ms':>8} {'int4 ms':>8} {'speedup':>7} {'fp16 W':>7} {'int4 W':>7}")
    for x in result["report_length"]:
        print(
            f"{x['new_tokens']:7d} {x['fp16_ms']:8.1f} {x['int4_ms']:8.1f} {x['speedup']:7.2f} "
            f"{x['fp16_w']:7.1f} {x['int4_w']:7.1f}"
        )
    print("\nevery device x mode (ms per report / average W)")
    cols = ["seed-1.2b/fp16", "seed-1.2b/int4", "radreport-tiny/fp16", "radreport-tiny/int4"]
    print(f"{'device':18} {'mode':10} " + " ".join(f"{c:>21}" for c in cols))
    for row in result["grid"]:
        cells = " ".join(f"{row[c]['latency_ms']:11.1f} / {row[c]['avg_power_w']:5.1f} W" for c in cols)
        print(f"{row['device']:18} {row['mode']:10} {cells}")
    print("\ndecode tokens/s vs NVIDIA's published Orin Nano measurements (MLC, INT4)")
    print(f"{'reference':20} {'device':18} {'mode':10} {'published':>9} {'estimate':>9} {'ratio':>6}")
    for x in result["references"]:
        print(
            f"{x['reference']:20} {x['device']:18} {x['mode']:10} {x['published_tokens_per_s']:9.2f} "
            f"{x['estimated_tokens_per_s']:9.2f} {x['ratio']:6.2f}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=32, help="text prompt tokens (image tokens come from the model)")
    ap.add_argument("--new", type=int, default=96, help="generated tokens per report")
    ap.add_argument("--out", type=Path, default=Path("out/bench/orin_estimate.json"))
    args = ap.parse_args(argv)
    result = run(args.prompt, args.new)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print_tables(result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
