"""Decode tokens/s, FP32 vs INT4 MatMulNBits on `cpu`, side by side in one run.

Shapes: a random-init decoder shaped like SmolLM2-135M (hidden 576, 30 layers, 9 heads, 3 KV heads, intermediate
1536, vocab 49152, untied lm_head) and the default radreport-tiny decoder. Batch 1, a 32-token prompt, 32 new tokens
(greedy on the logits, the next input is the token's embedding row), median of `--reps` runs. INT4 variants:
accuracy_level 0 (FP32 compute on dequantized blocks) and 4 (INT8 activations), block 32.

    python bench/int4_speed.py [--reps 3] [--threads 2] [--json bench/int4_speed.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from edgekit.decoder_shape import DecoderShape
from edgekit.export import DecoderSpec, build_decoder, random_weights
from edgekit.export.model_config import ModelConfig
from edgekit.passes import make_pass

# SmolLM2-135M's shape, with its own (untied) LM head here: the benchmark's random weights give it one
SMOLLM2 = DecoderSpec(
    DecoderShape("smollm2-135m", 576, 30, 9, 3, 64, 1536, 49152),
    rms_eps=1e-5,
    rope_theta=100000.0,
)


def smollm2_weights(spec: DecoderSpec, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    h, kv = spec.hidden, spec.kv_heads * spec.head_dim
    w = {
        "model.embed_tokens.weight": rng.standard_normal((spec.vocab_size, h), np.float32) * 0.02,
        "model.norm.weight": np.ones(h, np.float32),
        "lm_head.weight": rng.standard_normal((spec.vocab_size, h), np.float32) * 0.02,
    }
    for i in range(spec.layers):
        p = f"model.layers.{i}"
        for name, shape in {
            "self_attn.q_proj": (h, h),
            "self_attn.k_proj": (kv, h),
            "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, h),
            "mlp.gate_proj": (spec.intermediate, h),
            "mlp.up_proj": (spec.intermediate, h),
            "mlp.down_proj": (h, spec.intermediate),
        }.items():
            w[f"{p}.{name}.weight"] = rng.standard_normal(shape, np.float32) * 0.02
        w[f"{p}.input_layernorm.weight"] = np.ones(h, np.float32)
        w[f"{p}.post_attention_layernorm.weight"] = np.ones(h, np.float32)
    return w


def decode_tps(
    model_bytes: bytes, emb: np.ndarray, spec: DecoderSpec, threads: int, prompt: int, new: int, reps: int
) -> float:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    sess = ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])
    outs = [o.name for o in sess.get_outputs()]
    rng = np.random.default_rng(0)
    runs = []
    for _ in range(reps + 1):  # the first run warms up
        x = emb[rng.integers(0, emb.shape[0], prompt)][None]
        past = [np.zeros((1, spec.kv_heads, 0, spec.head_dim), np.float32)] * (2 * spec.layers)
        total, start = 0, 0.0
        for step in range(new + 1):
            seq = x.shape[1]
            feeds = {
                "inputs_embeds": x,
                "attention_mask": np.ones((1, total + seq), np.int64),
                "position_ids": np.arange(total, total + seq, dtype=np.int64)[None],
            }
            for i in range(spec.layers):
                feeds[f"past_key_values.{i}.key"], feeds[f"past_key_values.{i}.value"] = past[2 * i], past[2 * i + 1]
            if step == 1:
                start = time.perf_counter()  # decode only: prefill excluded
            res = sess.run(outs, feeds)
            past = res[1:]
            total += seq
            x = emb[[int(res[0][0, -1].argmax())]][None]
        runs.append(new / (time.perf_counter() - start))
    return statistics.median(runs[1:])


def measure(label: str, weights: dict, spec: DecoderSpec, args) -> list[dict]:
    fp32 = build_decoder(weights, spec)
    emb = weights["model.embed_tokens.weight"]
    variants = {"fp32": ir.to_proto(fp32).SerializeToString()}
    for level in (0, 4):
        m = build_decoder(weights, spec)
        make_pass(f"int4:block=32,accuracy_level={level}")(m)
        variants[f"int4 acc{level}"] = ir.to_proto(m).SerializeToString()
    rows = []
    for name, data in variants.items():
        tps = decode_tps(data, emb, spec, args.threads, args.prompt, args.new, args.reps)
        rows.append({"model": label, "variant": name, "tokens_per_s": tps, "mb": len(data) / 1e6})
    for r in rows:
        r["speedup_vs_fp32"] = r["tokens_per_s"] / rows[0]["tokens_per_s"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--json", type=Path, default=Path("bench/int4_speed.json"))
    args = ap.parse_args()
    cfg = ModelConfig()
    rows = measure("radreport-tiny (random weights)", random_weights(cfg, 0), DecoderSpec.from_model_config(cfg), args)
    rows += measure("SmolLM2-135M shape (random)", smollm2_weights(SMOLLM2), SMOLLM2, args)
    print(
        f"decode tokens/s, batch 1, prompt {args.prompt}, {args.new} new tokens, median of {args.reps}, "
        f"{args.threads} threads, ORT {ort.__version__}"
    )
    print(f"{'model':<34} {'variant':<11} {'tok/s':>8} {'x fp32':>7} {'MB':>8}")
    for r in rows:
        print(
            f"{r['model']:<34} {r['variant']:<11} {r['tokens_per_s']:8.1f} {r['speedup_vs_fp32']:7.2f} {r['mb']:8.1f}"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"rows": rows, "threads": args.threads, "reps": args.reps}, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
