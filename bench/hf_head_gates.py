"""Head gates for a user's Hugging Face decoder, side by side in one run: does `edgekit finetune` make the X1's
dynamic head skipping (DSS) cheap on a model edgekit did not train?

The user's model is a LLaMA trained here from random init on a task that needs attention (reverse a sequence of
words, tests/finetune_factory.py); nothing is downloaded. From it, two fine-tunes with the same data and steps:
LoRA alone, and LoRA with learned head gates closing 37.5% of the heads (`edgekit finetune`). Each is taken
through the shipped path (`edgekit convert`, the `lora` pass merging the adapter and folding the gates) and
scored in ONNX Runtime: exact match of the greedy completion on held-out prompts, with a Wilson 95% interval.

DSS is run with the X1's own policy (`edgekit.targets.x1.dss.HeadMaskPolicy`, the seed's 0.38 / 0.015) on the
same merged weights in torch, with a KV cache: each decode token's per-head output norms feed the next token's
mask, and a masked head's output is zeroed for that token, as the X1 runtime does. No X1 energy here: the X1
target builds VLMs; the embedded model's emulated energy with DSS is bench/x1_dss.py and bench/compression_table.py.

    python bench/hf_head_gates.py [--pretrain-steps 800] [--steps 300] [--n 200] [--json out/hf_head_gates.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from finetune_factory import make_llama, reverse_task, write_jsonl  # noqa: E402

from edgekit.finetune.data import Tokenization, read_dataset  # noqa: E402
from edgekit.finetune.trainer import FinetuneOptions, finetune  # noqa: E402
from edgekit.hf import convert_hf  # noqa: E402
from edgekit.passes.heads import HeadPrunePass  # noqa: E402
from edgekit.passes.lora import merge_lora  # noqa: E402
from edgekit.passes.pipeline import run_pipeline  # noqa: E402
from edgekit.targets.x1.dss import HeadMaskPolicy, load_head_importance  # noqa: E402

SHAPE = dict(vocab=72, hidden=64, layers=4, heads=8)
LENGTH = 5  # words to reverse; the completion is LENGTH words + </s>
EOS = 2


def wilson(k: int, n: int) -> list[float]:
    if n == 0:
        return [0.0, 0.0]
    z, p = 1.96, k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return [round(c - h, 4), round(c + h, 4)]


def pretrain(path: Path, data: Path, steps: int, seed: int) -> dict:
    """The user's model: every weight trained on the task (what a user brings; edgekit only fine-tunes)."""
    import transformers
    from tokenizers import Tokenizer

    make_llama(path, **SHAPE, seed=seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).train()
    tok = Tokenization(Tokenizer.from_file(str(path / "tokenizer.json")), EOS)
    ds = read_dataset(data, tok, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / steps)
    g = torch.Generator().manual_seed(seed)
    t0, losses = time.perf_counter(), []
    for _ in range(steps):
        idx = torch.randint(len(ds), (64,), generator=g).tolist()
        ex = [ds.examples[i] for i in idx]
        n = max(len(e.input_ids) for e in ex)
        ids = torch.tensor([e.input_ids + [0] * (n - len(e.input_ids)) for e in ex])
        labels = torch.tensor([e.labels + [-100] * (n - len(e.labels)) for e in ex])
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    model.eval().save_pretrained(path)
    return {
        "steps": steps,
        "last_loss": round(float(np.mean(losses[-20:])), 4),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def encode_prompts(path: Path, rows: list[dict]) -> list[tuple[list[int], list[int]]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    return [
        (tok.encode(r["prompt"]).ids, tok.encode(r["completion"], add_special_tokens=False).ids + [EOS]) for r in rows
    ]


class OrtLM:
    """embed_tokens + decoder graphs in ONNX Runtime; greedy decode by full recompute (short sequences)."""

    def __init__(self, onnx_dir: Path, layers: int, kv_heads: int, head_dim: int):
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        self.embed = ort.InferenceSession(str(onnx_dir / "embed_tokens.onnx"), opts)
        self.dec = ort.InferenceSession(str(onnx_dir / "decoder_model_merged.onnx"), opts)
        self.layers, self.kv, self.hd = layers, kv_heads, head_dim

    def logits(self, ids: list[int]) -> np.ndarray:
        x = np.asarray([ids], np.int64)
        feed = {
            "inputs_embeds": self.embed.run(None, {"input_ids": x})[0],
            "attention_mask": np.ones(x.shape, np.int64),
            "position_ids": np.arange(x.shape[1])[None],
        }
        for i in range(self.layers):
            for kv in ("key", "value"):
                feed[f"past_key_values.{i}.{kv}"] = np.zeros((1, self.kv, 0, self.hd), np.float32)
        return self.dec.run(None, feed)[0][0, -1]

    def generate(self, prompt: list[int], n: int) -> list[int]:
        ids, out = list(prompt), []
        for _ in range(n):
            t = int(self.logits(ids).argmax())
            out.append(t)
            if t == EOS:
                break
            ids.append(t)
        return out


def dss_generate(model, att, policy: HeadMaskPolicy | None, prompt: list[int], n: int) -> list[int]:
    """Greedy decode with a KV cache; with `policy`, each decode token's heads are masked as the X1 runtime does."""
    from transformers import DynamicCache

    state = {"mask": None, "norms": np.zeros((len(att.modules), att.heads))}

    def hook_for(layer: int):
        def hook(_m, args):
            x = args[0]
            b, t, _ = x.shape
            heads = x.view(b, t, att.heads, att.head_dim)
            norms = heads[0, -1].norm(dim=-1).double().numpy()
            if state["mask"] is not None:
                keep = torch.tensor(state["mask"][layer], dtype=x.dtype)
                heads = heads * keep[None, None, :, None]
                norms = np.where(state["mask"][layer], norms, np.nan)
            state["norms"][layer] = norms
            return (heads.reshape(b, t, -1), *args[1:])

        return hook

    handles = [model.get_submodule(p).o_proj.register_forward_pre_hook(hook_for(i)) for i, p in enumerate(att.modules)]
    try:
        cache, out = DynamicCache(), []
        if policy is not None:
            policy.begin_prefill()
        x = torch.tensor([prompt])
        with torch.no_grad():
            for step in range(n):
                if policy is not None and step > 0:
                    policy.begin_decode()
                    state["mask"] = policy(state["norms"].copy())
                logits = model(input_ids=x, cache=cache, use_cache=True).logits
                t = int(logits[0, -1].argmax())
                out.append(t)
                if t == EOS:
                    break
                x = torch.tensor([[t]])
        return out
    finally:
        for h in handles:
            h.remove()


def torch_merged(base_dir: Path, adapter: Path):
    import peft
    import transformers

    from edgekit.finetune.hf_gates import find_decoder_attention
    from edgekit.passes.head_gates import read_head_gates

    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir).eval()
    model = peft.PeftModel.from_pretrained(base, adapter).merge_and_unload().eval()
    att = find_decoder_attention(model)
    gates = read_head_gates(adapter)
    if gates is not None:  # the fold the lora pass does, in torch
        with torch.no_grad():
            for layer, path in zip(gates.layers, att.modules):
                w = model.get_submodule(path).o_proj.weight
                w.mul_(torch.from_numpy(np.repeat(layer.gates, layer.head_dim))[None, :])
    return model, att


def score(gen, cases) -> dict:
    hits = tok_ok = tok_n = 0
    for prompt, want in cases:
        got = gen(prompt, len(want))
        hits += got == want
        tok_ok += sum(a == b for a, b in zip(got, want))
        tok_n += len(want)
    return {
        "exact_match": round(hits / len(cases), 4),
        "exact_match_ci95": wilson(hits, len(cases)),
        "token_accuracy": round(tok_ok / tok_n, 4),
        "n": len(cases),
    }


def x1_cost(root: Path, rate: float, steps: int, seed: int, tokens: int) -> list[dict]:
    """Emulated X1 time and energy per decode token of a user's SmolVLM (random init, small size from
    tests/hf_vlm_factory.py), fine-tuned with and without gates, each built for x1 through the `lora` pass: DSS off
    against DSS at the seed's setting. The emulator's cost depends on what is computed, not on what the weights
    know, so a random-init model measures the cost; its reports mean nothing and are not scored."""
    import importlib.resources

    from hf_vlm_factory import make_idefics3

    from edgekit.build import build
    from edgekit.generate import GenerationOptions
    from edgekit.targets.x1.engine import SparseConfig, X1Engine

    vlm = make_idefics3(root / "vlm", "small", family="smolvlm", seed=seed)
    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range(200)]
    rows = [
        {"prompt": " ".join(rng.choice(words, 4)), "completion": " ".join(rng.choice(words, 8))} for _ in range(256)
    ]
    write_jsonl(root / "vlm.jsonl", rows)
    study = importlib.resources.files("edgekit.models") / "samples" / "ct_chest"
    options = GenerationOptions(max_new_tokens=tokens, stop_token_ids=[])
    out = []
    for name, r in (("LoRA", 0.0), ("LoRA + gates", rate)):
        opts = FinetuneOptions(steps=steps, batch_size=16, gate_rate=r, seed=seed, threads=2)
        res = finetune(vlm.path, root / "vlm.jsonl", root / f"vlm-{name}", opts)
        recipe = root / f"{name}.toml"
        recipe.write_text(f'name = "lora"\n[[pass]]\nname = "lora"\nadapters = ["{root / f"vlm-{name}"}"]\n')
        bundle = build("x1", root / f"x1-{name}", model_dir=vlm.path, parity=False, recipe=recipe).bundle
        base = None
        for label, cfg in (
            ("off", SparseConfig(enable_sparsity=False)),
            ("0.38 / 0.015", SparseConfig(sparsity_target=0.38, sensitivity_threshold=0.015)),
        ):
            rep = X1Engine(bundle, cfg).report(str(study), "w1 w2", options)
            c = rep.cost
            row = {
                "model": f"SmolVLM small, {name}",
                "closed": res.get("gates", {}).get("closed", 0),
                "heads": res.get("gates", {}).get("total"),
                "dss": label,
                "skip_rate": round(c["skip_rate"], 4),
                "tokens": rep.timings["new_tokens"],
                "emulated_ms_per_token": round(c["emulated_ms_per_token"], 5),
                "mj_per_token": round(c["mj_per_token"], 5),
                "energy_source": c["figure_source"],
            }
            base = base or row
            row["mj_per_token_ratio_vs_off"] = round(row["mj_per_token"] / base["mj_per_token"], 4)
            row["ms_per_token_ratio_vs_off"] = round(row["emulated_ms_per_token"] / base["emulated_ms_per_token"], 4)
            out.append(row)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pretrain-steps", type=int, default=800)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--n", type=int, default=200, help="held-out prompts")
    ap.add_argument("--rate", type=float, default=0.375)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--x1-tokens", type=int, default=32, help="decode tokens per emulated X1 report (0: skip the X1 part)"
    )
    ap.add_argument("--json", type=Path, default=Path("out/hf_head_gates.json"))
    a = ap.parse_args(argv)
    torch.set_num_threads(2)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hf-gates-") as tmp:
        root = Path(tmp)

        def rows(n: int, seed: int) -> list[dict]:
            return reverse_task(n, words=SHAPE["vocab"] - 4, length=LENGTH, seed=seed)

        write_jsonl(root / "pre.jsonl", rows(20000, a.seed + 10))
        write_jsonl(root / "ft.jsonl", rows(2000, a.seed + 11))
        held = rows(a.n, a.seed + 12)
        base = root / "base"
        pre = pretrain(base, root / "pre.jsonl", a.pretrain_steps, a.seed)
        print(f"pretrained the user's model: {pre}", flush=True)
        cases = encode_prompts(base, held)
        convert_hf(base, root / "onnx")
        kv, hd = SHAPE["heads"] // 2, SHAPE["hidden"] // SHAPE["heads"]
        table, fine = [], {}
        base_ort = OrtLM(root / "onnx", SHAPE["layers"], kv, hd)
        table.append(
            {"model": "user's model (pretrained)", "closed": 0, "dss": "off", **score(base_ort.generate, cases)}
        )
        for name, rate in (("LoRA", 0.0), ("LoRA + gates", a.rate)):
            opts = FinetuneOptions(steps=a.steps, batch_size=16, gate_rate=rate, seed=a.seed, threads=2)
            res = finetune(base, root / "ft.jsonl", root / name, opts)
            merge_lora(root / "onnx", root / f"{name}-onnx", [root / name])
            fine[name] = res
            lm = OrtLM(root / f"{name}-onnx", SHAPE["layers"], kv, hd)
            closed = res.get("gates", {}).get("closed", 0)
            row = {
                "model": f"{name} ({res['train_seconds']} s)",
                "closed": closed,
                "dss": "off",
                **score(lm.generate, cases),
            }
            table.append(row)
            model, att = torch_merged(base, root / name)
            torch_dense = score(partial(dss_generate, model, att, None), cases)
            row["torch_agrees"] = torch_dense["exact_match"] == row["exact_match"]
            g = (
                load_head_importance(root / f"{name}-onnx" / "head_importance.json", SHAPE["layers"], SHAPE["heads"])
                if closed
                else np.ones((SHAPE["layers"], SHAPE["heads"]))
            )
            for label, thr in (("0.38 / 0.015", 0.015), ("0.38 / budget-bound", 1.0)):
                if closed and thr == 1.0:
                    continue  # the gated model reaches its budget at the seed's threshold already
                policy = HeadMaskPolicy(g, sparsity_target=0.38, sensitivity_threshold=thr)
                s = score(partial(dss_generate, model, att, policy), cases)
                st = policy.stats
                table.append(
                    {
                        "model": name,
                        "closed": closed,
                        "dss": label,
                        **s,
                        "skip_rate": round(st.skip_rate, 4),
                        "forced_active": st.forced_active,
                    }
                )
            if not closed:  # a static prune of the same share by measured output norm (the heads pass), no training
                run_pipeline(
                    root / f"{name}-onnx", root / f"{name}-pruned", [HeadPrunePass.from_string(f"ratio={a.rate}")]
                )
                pr = OrtLM(root / f"{name}-pruned", SHAPE["layers"], kv, hd)
                table.append(
                    {
                        "model": name,
                        "closed": round(a.rate * SHAPE["layers"] * SHAPE["heads"]),
                        "dss": f"static prune {a.rate} by output norm",
                        **score(pr.generate, cases),
                    }
                )
        x1 = x1_cost(root, a.rate, 60, a.seed, a.x1_tokens) if a.x1_tokens else []
    result = {
        "bench": "hf_head_gates",
        "task": f"reverse {LENGTH} words (tests/finetune_factory.py), held-out prompts, greedy",
        "model": {**SHAPE, "kv_heads": SHAPE["heads"] // 2},
        "pretrain": pre,
        "finetune": {
            k: {kk: v[kk] for kk in ("steps", "train_seconds", "first_loss", "last_loss", "trainable_parameters")}
            | ({"gates": v["gates"]} if "gates" in v else {})
            for k, v in fine.items()
        },
        "rows": table,
        "x1": x1,
        "x1_source": "edgekit x1 emulator (emulated:x1), default machine, the bundled ct_chest sample, "
        "one report per row at a fixed decode length; a random-init SmolVLM: cost only, its text is not scored",
        "quality_source": f"exact match of the greedy completion, {a.n} held-out prompts, Wilson 95% interval; "
        "dss off: ONNX Runtime on the merged graphs; dss rows: torch on the same merged weights with the X1 policy",
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{'model':34} {'closed':>6} {'DSS':>34} {'skipped':>8} {'exact match [95% CI]':>26} {'tok acc':>8}")
    for r in table:
        ci = r["exact_match_ci95"]
        skip = f"{r['skip_rate']:.3f}" if "skip_rate" in r else "-"
        print(
            f"{r['model']:34} {r['closed']:>6} {r['dss']:>34} {skip:>8} "
            f"{r['exact_match']:>8.3f} [{ci[0]:.3f}, {ci[1]:.3f}] {r['token_accuracy']:>8.3f}"
        )
    if x1:
        print(
            f"\n{'x1, emulated':30} {'closed':>9} {'DSS':>14} {'skipped':>8} {'ms/token':>9} {'mJ/token':>9} "
            f"{'vs off':>7}"
        )
        for r in x1:
            closed = f"{r['closed']}/{r['heads']}" if r["heads"] else "0"
            print(
                f"{r['model']:30} {closed:>9} {r['dss']:>14} {r['skip_rate']:>8.3f} "
                f"{r['emulated_ms_per_token']:>9.4f} {r['mj_per_token']:>9.4f} {r['mj_per_token_ratio_vs_off']:>7.3f}"
            )
    print(f"\nwrote {a.json} ({result['seconds']} s)")
    return result


if __name__ == "__main__":
    main()
