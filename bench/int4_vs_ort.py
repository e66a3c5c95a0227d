"""INT4 output error, edgekit vs ONNX Runtime's MatMulNBitsQuantizer (default algorithm), same bits and block.

Two decoders: (a) the default radreport-tiny decoder (`--model-dir` with the exported graphs; random weights when
none is given), (b) a random-init LLaMA-architecture decoder from edgekit's builder whose RMSNorm weights give a
few input channels 10-50x larger activations and whose weights are 10x larger on those channels, the outlier
structure of real LLMs (Gaussian weights alone are easy for RTN and would hide what calibration buys).
Error = relative L2 error of the logits against FP32 on held-out feeds (not the calibration feeds).

    python bench/int4_vs_ort.py [--model-dir DIR] [--block 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx_ir as ir

from edgekit.export import DecoderSpec, build_decoder, export_model, random_weights
from edgekit.export.model_config import ModelConfig
from edgekit.names import DECODER
from edgekit.passes import PassContext, make_pass
from edgekit.passes.calibration import embedding_table, sample_feeds
from edgekit.passes.check import compare_outputs, run_all, session
from edgekit.passes.int8 import fold_weight_transposes


def outlier_llama(seed: int = 0) -> tuple[ir.Model, np.ndarray]:
    spec = DecoderSpec(
        hidden=256,
        layers=4,
        heads=8,
        kv_heads=4,
        head_dim=32,
        intermediate=704,
        vocab_size=2048,
        rms_eps=1e-5,
        rope_theta=10000.0,
    )
    rng = np.random.default_rng(seed)
    w: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": rng.standard_normal((2048, 256)).astype(np.float32) * 0.02,
        "model.norm.weight": np.ones(256, np.float32),
        "lm_head.weight": rng.standard_normal((2048, 256)).astype(np.float32) * 0.05,
    }
    outliers = rng.choice(256, 4, replace=False)
    for i in range(spec.layers):
        p = f"model.layers.{i}"
        shapes = {
            "self_attn.q_proj": (256, 256),
            "self_attn.k_proj": (128, 256),
            "self_attn.v_proj": (128, 256),
            "self_attn.o_proj": (256, 256),
            "mlp.gate_proj": (704, 256),
            "mlp.up_proj": (704, 256),
            "mlp.down_proj": (256, 704),
        }
        for name, shape in shapes.items():
            m = rng.standard_normal(shape).astype(np.float32) / np.sqrt(shape[1])
            if shape[1] == 256 and not name.endswith(("o_proj",)):
                m[:, outliers] *= 10.0
            w[f"{p}.{name}.weight"] = m
        for norm in ("input_layernorm", "post_attention_layernorm"):
            g = np.ones(256, np.float32)
            g[outliers] = rng.uniform(10, 50, len(outliers))
            w[f"{p}.{norm}.weight"] = g
    w["model.norm.weight"][outliers] = rng.uniform(10, 50, len(outliers))
    return build_decoder(w, spec), w["model.embed_tokens.weight"] * 50  # embeddings at residual-stream scale


def ort_int4(fp32: ir.Model, block: int, symmetric: bool) -> bytes:
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    folded = ir.from_proto(ir.to_proto(fp32))
    fold_weight_transposes(folded)  # ORT quantizes only MatMuls whose B is an initializer
    import logging

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    q = MatMulNBitsQuantizer(ir.to_proto(folded), bits=4, block_size=block, is_symmetric=symmetric)
    q.process()
    return q.model.model.SerializeToString()


def edgekit_int4(fp32: ir.Model, spec: str, calib) -> bytes:
    model = ir.from_proto(ir.to_proto(fp32))
    make_pass(spec)(model, PassContext(calibration={DECODER: calib}))
    return ir.to_proto(model).SerializeToString()


def measure(label: str, fp32: ir.Model, embeddings: np.ndarray, block: int) -> list[dict]:
    calib = sample_feeds(fp32, 16, seq=32, seed=1, embeddings=embeddings)
    evals = sample_feeds(fp32, 8, seq=32, seed=2, embeddings=embeddings)
    ref = run_all(session(ir.to_proto(fp32).SerializeToString()), evals)
    rows = []
    variants = [
        ("ort default (asym)", lambda: ort_int4(fp32, block, False)),
        ("ort default (sym)", lambda: ort_int4(fp32, block, True)),
        ("edgekit rtn (sym)", lambda: edgekit_int4(fp32, f"int4:block={block}", calib)),
        ("edgekit rtn (asym)", lambda: edgekit_int4(fp32, f"int4:block={block},symmetric=false", calib)),
        ("edgekit awq (sym)", lambda: edgekit_int4(fp32, f"int4:block={block},method=awq", calib)),
        ("edgekit awq (asym)", lambda: edgekit_int4(fp32, f"int4:block={block},method=awq,symmetric=false", calib)),
    ]
    for name, make in variants:
        t = time.perf_counter()
        data = make()
        seconds = time.perf_counter() - t
        err = compare_outputs(ref, run_all(session(data), evals), ["logits"])[0]
        rows.append(
            {
                "model": label,
                "method": name,
                "logits_rel_l2": err.rel_l2,
                "logits_max_abs": err.max_abs,
                "quantize_s": seconds,
            }
        )
    base = {"sym": rows[1]["logits_rel_l2"], "asym": rows[0]["logits_rel_l2"]}
    for r in rows:
        r["ratio_vs_ort_same_symmetry"] = r["logits_rel_l2"] / base["asym" if "asym" in r["method"] else "sym"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, help="folder with decoder_model_merged.onnx (+ embed_tokens.onnx)")
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--json", type=Path, default=Path("bench/int4_vs_ort.json"))
    args = ap.parse_args()

    if args.model_dir:
        default_dir, note = args.model_dir, f"weights from {args.model_dir}"
    else:
        default_dir = Path(tempfile.mkdtemp()) / "radreport"
        export_model(random_weights(ModelConfig(), 0), ModelConfig(), default_dir, check=False)
        note = "random weights (trained ones not given: pass --model-dir)"
    rows = measure(
        f"radreport-tiny ({note})",
        ir.load(default_dir / "decoder_model_merged.onnx"),
        embedding_table(default_dir),
        args.block,
    )
    llama, emb = outlier_llama()
    rows += measure(
        "random LLaMA 4x256 with 4 outlier channels (10-50x activations, 10x weights)", llama, emb, args.block
    )

    print(
        f"INT4 block={args.block}: logits relative L2 error vs FP32 (lower is better); ratio = edgekit / ORT "
        "MatMulNBitsQuantizer default algorithm at the same symmetry"
    )
    print(f"{'model':<60} {'method':<20} {'rel L2':>9} {'ratio':>7} {'quant s':>8}")
    for r in rows:
        print(
            f"{r['model'][:60]:<60} {r['method']:<20} {r['logits_rel_l2']:9.4f} "
            f"{r['ratio_vs_ort_same_symmetry']:7.3f} {r['quantize_s']:8.2f}"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"block": args.block, "rows": rows}, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
