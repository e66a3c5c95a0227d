"""LoRA fine-tuning recipe: adapt radreport-tiny to one site's report style, and measure the gain.

    python -m edgekit.models.radreport_tiny.lora --weights models/radreport_tiny/weights --out DIR

Why this task: a deployment site writes reports its own way (its own section names and negation phrasing) while
the findings stay the same. That is what LoRA is for (a small update, no new knowledge), and the synthetic
generator gives ground truth for it: the "site" phrasing is a fixed, invertible rewrite of the canonical report,
unseen in pre-training. The recipe trains a LoRA adapter on the decoder (PEFT, torch, a few minutes on 2 CPU
cores), saves it in PEFT format (what `edgekit.passes.lora` merges without torch), and reports BLEU-4 against
the site-style references before and after, plus finding F1 (site text mapped back to the canonical phrasing) so
a style gain that costs content shows.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edgekit.preprocess import PreprocessConfig

from .data import SplitData, build_split, encode_split, iterate_batches, make_batch
from .determinism import set_determinism, to_torch
from .objectives import lm_loss
from .validation import greedy_reports

# The site's phrasing: (canonical, site). Applied in order; the inverse applies them backwards.
SITE_REWRITES = (
    ("FINDINGS:", "Findings of the study -"),
    ("IMPRESSION:", "Conclusion -"),
    (" No ", " Negative for "),
)
DECODER_MODULES = r"model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
# The LM head is adapted too: the site's words ("Negative for", "Conclusion") are token sequences the base model
# had learned never to emit; without the head, 200 steps lowered BLEU-4 (14.7 -> 13.9) and F1 (0.95 -> 0.54).
SITE_MODULES = DECODER_MODULES + r"|lm_head"


def site_style(report: str) -> str:
    """The canonical (style 0) report in the site's phrasing."""
    text = " " + report
    for canonical, site in SITE_REWRITES:
        text = text.replace(canonical, site)
    return text.strip()


def from_site_style(text: str) -> str:
    """Back to the canonical phrasing, so `parse_report` can score findings of a site-style report."""
    text = " " + text
    for canonical, site in reversed(SITE_REWRITES):
        text = text.replace(site, canonical)
    return text.strip()


@dataclass
class LoraRecipe:
    train_studies: int = 1600
    val_studies: int = 64
    epochs: int = 3
    batch_size: int = 16
    lr: float = 2e-3
    r: int = 16
    alpha: float = 32.0
    rslora: bool = False
    target_modules: str = SITE_MODULES
    seed: int = 0
    threads: int = 2
    eval_batch: int = 32


def to_site(data: SplitData) -> SplitData:
    """The same studies with one reference: the site-style rewrite of the canonical report."""
    texts = [replace(t, references=(site_style(t.references[0]),)) for t in data.texts]
    return SplitData(data.split, data.pixels, texts)


def generate_reports(model, tok, enc, max_new_tokens: int, batch: int) -> list[str]:
    from .tokenizer import decode_report

    out = []
    for s in range(0, len(enc.data), batch):
        idx = list(range(s, min(s + batch, len(enc.data))))
        pv = enc.data.pixels[idx].astype(np.float32)
        prompts = [enc.prompts[i][enc.data.texts[i].modality] for i in idx]
        out += [decode_report(tok, ids) for ids in greedy_reports(model, pv, prompts, max_new_tokens)]
    return out


def score(reports: list[str], data: SplitData) -> dict:
    """BLEU-4 against the site references, and finding F1 after mapping the text back to canonical phrasing."""
    from edgekit.eval.finding_metrics import prf, score_study
    from edgekit.eval.text_metrics import bleu_from_statistics, bleu_statistics
    from edgekit.findings import parse_report

    bleu = bleu_from_statistics(bleu_statistics(reports, [[t.references[0]] for t in data.texts]))
    tp = fp = fn = 0
    for text, t in zip(reports, data.texts):
        try:
            parsed = parse_report(from_site_style(text))
            pred, neg = list(parsed.findings), list(parsed.negatives)
        except Exception:  # a garbled report predicts nothing
            pred, neg = [], []
        sc = score_study(list(t.findings), list(t.negatives), pred, neg)
        tp, fp, fn = tp + sc.tp, fp + sc.fp, fn + sc.fn
    return {"bleu4": round(bleu, 3), "finding_f1": round(prf(tp, fp, fn)[2], 4)}


def finetune(model, tok, train: SplitData, val: SplitData, opts: LoraRecipe, out: Path, max_new_tokens: int) -> dict:
    """Wrap `model` with PEFT LoRA, train on site-style reports, save the adapter to `out/adapter`, and measure
    BLEU-4 / finding F1 on `val` before and after (the merged model). Returns the result dict (also saved)."""
    import peft

    set_determinism(opts.seed, opts.threads)
    enc_train, enc_val = encode_split(tok, to_site(train)), encode_split(tok, to_site(val))
    t0 = time.perf_counter()
    before = score(generate_reports(model, tok, enc_val, max_new_tokens, opts.eval_batch), enc_val.data)
    lcfg = peft.LoraConfig(  # PEFT annotates lora_alpha as an int; it scales by alpha / r, a float alpha too
        r=opts.r,
        lora_alpha=opts.alpha,  # type: ignore[arg-type]
        use_rslora=opts.rslora,
        target_modules=opts.target_modules,
        lora_dropout=0.0,
    )
    pm = peft.get_peft_model(model, lcfg)  # injects LoRA layers into `model` in place, freezes the rest
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=opts.lr, weight_decay=0.0)
    steps = (len(train) // opts.batch_size) * opts.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / max(steps, 1))
    losses = []
    model.train()
    for batch in iterate_batches(
        enc_train, batch_size=opts.batch_size, epochs=opts.epochs, seed=opts.seed, xc_share=0.0
    ):
        loss = lm_loss(model, to_torch(batch))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    train_s = time.perf_counter() - t0
    out.mkdir(parents=True, exist_ok=True)
    pm.save_pretrained(str(out / "adapter"))
    merged = pm.merge_and_unload().eval()
    after = score(generate_reports(merged, tok, enc_val, max_new_tokens, opts.eval_batch), enc_val.data)
    with torch.no_grad():
        val_loss = float(
            lm_loss(
                merged, to_torch(make_batch(enc_val, [(i, t.modality, 0) for i, t in enumerate(enc_val.data.texts)]))
            )
        )
    result = {
        "task": "site report style (SITE_REWRITES) on radreport-tiny",
        "recipe": asdict(opts),
        "trainable_params": int(sum(p.numel() for p in params)),
        "steps": len(losses),
        "first_loss": round(losses[0], 4) if losses else None,
        "last_loss": round(float(np.mean(losses[-5:])), 4) if losses else None,
        "val_loss_after": round(val_loss, 4),
        "train_seconds": round(train_s, 1),
        "before": before,
        "after": after,
        "bleu4_gain": round(after["bleu4"] - before["bleu4"], 3),
        "adapter": str(out / "adapter"),
    }
    (out / "lora_result.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def load_base(weights_dir: Path):
    """The trained model, tokenizer and max_new_tokens from a weights directory."""
    from safetensors.torch import load_file

    from edgekit.export.model_config import ModelConfig

    from .modeling import RadReportTiny
    from .tokenizer import load_tokenizer

    cfg = ModelConfig.load(weights_dir / "config.json")
    model = RadReportTiny(cfg)
    model.load_state_dict(load_file(str(weights_dir / "model.safetensors")))
    gen = json.loads((weights_dir / "generation_config.json").read_text())
    return model.eval(), load_tokenizer(weights_dir / "tokenizer.json"), int(gen["max_new_tokens"])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", type=Path, default=Path(__file__).resolve().parent / "weights")
    ap.add_argument("--out", type=Path, required=True)
    for f, v in asdict(LoraRecipe()).items():
        ap.add_argument(f"--{f.replace('_', '-')}", type=type(v) if not isinstance(v, bool) else int, default=v)
    args = ap.parse_args(argv)
    given: dict[str, Any] = {  # argparse's values, each parsed as its field's type
        f: (bool(getattr(args, f)) if isinstance(v, bool) else getattr(args, f))
        for f, v in asdict(LoraRecipe()).items()
    }
    opts = LoraRecipe(**given)
    model, tok, max_new = load_base(args.weights)
    pcfg = PreprocessConfig()
    cache = args.out / "cache"
    train = build_split("train", opts.train_studies, pcfg, cache_dir=cache, workers=opts.threads)
    val = build_split("val", opts.val_studies, pcfg, cache_dir=cache, workers=opts.threads)
    result = finetune(model, tok, train, val, opts, args.out, max_new)
    print(json.dumps({k: result[k] for k in ("before", "after", "bleu4_gain", "train_seconds", "steps")}))
    return result


if __name__ == "__main__":
    main()
