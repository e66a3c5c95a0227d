"""Train radreport-tiny from scratch on synthetic studies, deterministically, on 2 CPU cores.

    python -m edgekit.models.radreport_tiny.train --out DIR

Every source of randomness is seeded and torch runs deterministic kernels on a fixed thread count, so the same
code, data and torch build give the same weights bit for bit. DIR receives the committed artefacts
(`model.safetensors`, `config.json`, `tokenizer.json`, `generation_config.json`, `preprocessor_config.json`,
`training_log.json`) and a float16 pixel cache under `DIR/cache` that makes reruns skip data generation.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from edgekit.errors import ConfigError
from edgekit.export.model_config import ModelConfig
from edgekit.preprocess import PreprocessConfig

from .data import (
    COUNT_CHANNELS,
    FINDING_LABELS,
    IGNORE,
    PRESENCE_LABELS,
    EncodedSplit,
    build_split,
    encode_split,
    eval_items,
    iterate_batches,
    make_batch,
    tokenizer_corpus,
)
from .head_gates import HeadGates, closed_target
from .modeling import RadReportTiny
from .tokenizer import BOS_ID, EOS_ID, PAD_ID, PROMPT_TEMPLATE, SEP_ID, decode_report, train_tokenizer

HERE = Path(__file__).resolve().parent
# beside this file; plus the core's config
CODE_FILES = ("modeling.py", "tokenizer.py", "data.py", "train.py", "head_gates.py")


@dataclass
class TrainOptions:
    train_studies: int = 6400
    val_studies: int = 200
    epochs: int = 8
    batch_size: int = 32
    lr: float = 3e-3
    min_lr_ratio: float = 0.05
    warmup_frac: float = 0.05
    weight_decay: float = 0.05
    clip_norm: float = 1.0
    seed: int = 0
    xc_share: float = 0.3
    phrasings: int = 1  # train on the first N reference phrasings, a random one per study and epoch (4: all)
    threads: int = 2
    workers: int = 2  # processes generating studies before training starts
    eval_studies: int | None = None  # val studies for greedy generation (default: all)
    model: dict = field(default_factory=dict)  # ModelConfig overrides
    aux_weight: float = 2.0  # weight of the training-only finding probe's loss (0 disables it)
    probe_attributes: bool = True  # the probe also reads each finding's count and size (False: presence only)
    count_map_weight: float = 1.0  # weight of the training-only count-map probe's loss (0 disables it)
    head_gate_rate: float = 0.375  # fraction of decoder heads the learned gates close (0: no gates)
    head_gate_weight: float = 0.05  # weight of the L1 penalty on the open gates
    head_gate_window: tuple[float, float] = (0.4, 0.6)  # fractions of training over which heads are closed

    def model_config(self, vocab_size: int, pcfg: PreprocessConfig) -> ModelConfig:
        base = replace(ModelConfig(), image_size=pcfg.image_size, num_frames=pcfg.num_frames, vocab_size=vocab_size)
        try:
            return replace(base, **self.model)
        except TypeError as e:
            raise ConfigError(f"unknown model option: {e}") from None


def set_determinism(seed: int, threads: int) -> None:
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(threads)


def init_weights(model: RadReportTiny, seed: int) -> None:
    """Small normal init (std 0.02) for every matrix and embedding; torch's default N(0, 1) embeddings and
    fan-in uniform linears train noticeably slower at this size. Norms stay at one, biases at zero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)


def build_model(cfg: ModelConfig, seed: int) -> RadReportTiny:
    torch.manual_seed(seed)
    model = RadReportTiny(cfg)
    init_weights(model, seed)
    return model


def to_torch(batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Copies into torch's own (64-byte aligned) memory: BLAS kernels may round differently on numpy's
    16-byte aligned buffers, which made identical runs drift apart in the last bit."""
    return {k: torch.from_numpy(v).clone() for k, v in batch.items()}


class FindingProbe(nn.Module):
    """Training-only: a linear read-out of every (type, location) finding from the flattened image tokens.

    It gives the vision encoder a direct signal for what the report must say and where, instead of only the
    gradient that trickles back through the decoder's cross-attention to image tokens. With it, the 2-core
    training budget reaches the finding F1 the decoder alone did not (0.77 -> see training_log.json). It is
    not part of the exported model.
    """

    def __init__(self, cfg: ModelConfig, num_labels: int):
        super().__init__()
        self.proj = nn.Linear(cfg.num_image_tokens * cfg.hidden, num_labels)

    def forward(self, image_features: torch.Tensor) -> torch.Tensor:
        return self.proj(image_features.flatten(1))


class CountMapProbe(nn.Module):
    """Training-only: from each image token alone, how many findings of each counted type and side (nodules in
    the left and in the right lung) are centred in that token's cell of the image.

    A study's count is otherwise taught by one label per study (a report word, three of the finding probe's
    labels), and the encoder did not learn to count small blobs from it: CT nodule counts were right in 16 of 28
    test studies, with every stage of the vision path equally poor at it under a linear read-out. Counting
    where each nodule is gives every cell its own target. It is not part of the exported model.
    """

    def __init__(self, cfg: ModelConfig, num_channels: int):
        super().__init__()
        self.proj = nn.Linear(cfg.hidden, num_channels)

    def forward(self, image_features: torch.Tensor) -> torch.Tensor:  # (b, tokens, hidden) -> (b, channels, tokens)
        return self.proj(image_features).transpose(1, 2)

    def loss(self, image_features: torch.Tensor, count_maps: torch.Tensor) -> torch.Tensor:
        """Squared error summed over a study's channels and cells, mean over studies."""
        return (self(image_features) - count_maps).pow(2).sum((1, 2)).mean()


def training_loss(
    model: RadReportTiny,
    probe: FindingProbe | None,
    batch: dict[str, torch.Tensor],
    aux_weight: float,
    count_probe: CountMapProbe | None = None,
    count_map_weight: float = 0.0,
    gates: HeadGates | None = None,
    gate_weight: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(total loss, LM loss): report cross-entropy plus `aux_weight` x the probe's binary cross-entropy plus
    `count_map_weight` x the count-map probe's squared error (`CountMapProbe.loss`) plus `gate_weight` x the
    mean open head gate, with the decoder's heads scaled by `gates`."""
    if gates is not None:
        with gates.applied(model):
            total, lm = training_loss(model, probe, batch, aux_weight, count_probe, count_map_weight)
        return total + gate_weight * gates.penalty(), lm
    img = model.encode_images(batch["pixel_values"])
    x = torch.cat([img, model.model.embed_tokens(batch["input_ids"])], dim=1)
    mask = torch.cat(
        [torch.ones(x.shape[0], img.shape[1], dtype=batch["attention_mask"].dtype), batch["attention_mask"]], 1
    )
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model.decode(x, mask, pos)[0][:, img.shape[1] :]
    lm = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1), ignore_index=IGNORE
    )
    total = lm
    if probe is not None and aux_weight != 0:
        labels = batch["finding_labels"][:, : probe.proj.out_features]  # presence first, then count and size
        total = total + aux_weight * F.binary_cross_entropy_with_logits(probe(img), labels)
    if count_probe is not None and count_map_weight != 0:
        total = total + count_map_weight * count_probe.loss(img, batch["count_maps"])
    return total, lm


def lm_loss(model: RadReportTiny, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy of the report tokens and <eos>: logits at t - 1 predict the label at t."""
    logits = model(batch["pixel_values"], batch["input_ids"], batch["attention_mask"])
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1), ignore_index=IGNORE
    )


def make_optimizer(model: RadReportTiny, opts: TrainOptions, total_steps: int):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and not n.endswith("logits")]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or n.endswith("logits")]  # + gate logits
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": opts.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=opts.lr,
        betas=(0.9, 0.98),
    )
    warmup = max(1, int(opts.warmup_frac * total_steps))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = (step - warmup) / max(1, total_steps - warmup)
        return opts.min_lr_ratio + (1 - opts.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def train_loop(
    model,
    batches,
    opts: TrainOptions,
    total_steps: int,
    log_every: int = 20,
    out=sys.stdout,
    probe: FindingProbe | None = None,
    count_probe: CountMapProbe | None = None,
    gates: HeadGates | None = None,
):
    """Run the optimiser over `batches`; returns the per-step training (LM) losses. With `gates`, heads are
    closed on the schedule of `opts.head_gate_window` (`closed_target`)."""
    params = nn.ModuleList([model] + [p for p in (probe, count_probe, gates) if p is not None])
    opt, sched = make_optimizer(params, opts, total_steps)
    params.train()
    losses, t0 = [], time.perf_counter()
    for step, batch in enumerate(batches):
        loss, lm = training_loss(
            model,
            probe,
            to_torch(batch),
            opts.aux_weight,
            count_probe,
            opts.count_map_weight,
            gates,
            opts.head_gate_weight,
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params.parameters(), opts.clip_norm)
        opt.step()
        sched.step()
        if gates is not None:
            want = closed_target(step, total_steps, gates.closed.numel(), opts.head_gate_rate, *opts.head_gate_window)
            for li, h in gates.close_to(want):
                if out is not None:
                    print(f"step {step + 1}: closed head {h} of layer {li}", file=out, flush=True)
        losses.append(lm.item())
        if out is not None and (step % log_every == 0 or step == total_steps - 1):
            recent = float(np.mean(losses[-log_every:]))
            print(
                f"step {step + 1}/{total_steps} loss {recent:.4f} lr {sched.get_last_lr()[0]:.2e} "
                f"{time.perf_counter() - t0:.0f}s",
                file=out,
                flush=True,
            )
    return losses


@torch.no_grad()
def eval_loss(model, enc: EncodedSplit, batch_size: int) -> float:
    """Teacher-forced loss over every val study (first reference), weighted per token."""
    model.eval()
    items = [(i, t.modality, 0) for i, t in enumerate(enc.data.texts)]
    total, count = 0.0, 0
    for s in range(0, len(items), batch_size):
        b = to_torch(make_batch(enc, items[s : s + batch_size]))
        n = int((b["labels"][:, 1:] != IGNORE).sum())
        total += float(lm_loss(model, b)) * n
        count += n
    return total / max(1, count)


@torch.no_grad()
def greedy_generate(
    model, pixel_values: torch.Tensor, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """Batched greedy decoding with the KV cache of `model.decode`; prompts are left-padded and masked."""
    model.eval()
    b = len(prompts)
    width = max(len(p) for p in prompts)
    ids = torch.full((b, width), PAD_ID, dtype=torch.long)
    pmask = torch.zeros((b, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        pmask[i, width - len(p) :] = 1
    img = model.encode_images(pixel_values)
    x = torch.cat([img, model.model.embed_tokens(ids)], 1)
    mask = torch.cat([torch.ones(b, img.shape[1], dtype=torch.long), pmask], 1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits, past = model.decode(x, mask, pos)
    next_pos = pos[:, -1:] + 1
    out = [[] for _ in range(b)]
    done = torch.zeros(b, dtype=torch.bool)
    for _ in range(max_new_tokens):
        tok = logits[:, -1].argmax(-1)
        for i in range(b):
            if not done[i]:
                out[i].append(int(tok[i]))
        done |= tok == EOS_ID
        if bool(done.all()):
            break
        mask = torch.cat([mask, torch.ones(b, 1, dtype=torch.long)], 1)
        logits, past = model.decode(model.model.embed_tokens(tok[:, None]), mask, next_pos, past)
        next_pos = next_pos + 1
    return out


def evaluate_generation(
    model, tok, enc: EncodedSplit, max_new_tokens: int, batch_size: int = 64, limit: int | None = None
) -> dict:
    """Greedy reports for the val studies, parsed and scored at finding level against the ground truth."""
    from edgekit.eval.finding_metrics import prf, score_study
    from edgekit.findings import parse_report

    items = eval_items(enc)
    if limit is not None:
        items = [it for it in items if it[0] < limit]
    tp = fp = fn = halluc = predicted = contra = count_ok = 0
    size_err: list[float] = []
    unparsable, per_type, samples = 0, {}, []
    for s in range(0, len(items), batch_size):
        chunk = items[s : s + batch_size]
        pv = torch.from_numpy(enc.data.pixels[[i for i, _, _ in chunk]].astype(np.float32))
        gen = greedy_generate(model, pv, [enc.prompts[i][m] for i, m, _ in chunk], max_new_tokens)
        for (i, modality, _), ids in zip(chunk, gen):
            t = enc.data.texts[i]
            text = decode_report(tok, ids)
            try:
                parsed = parse_report(text)
            except Exception:  # a garbled report scores as predicting nothing
                unparsable += 1
                parsed = None
            pred = list(parsed.findings) if parsed else []
            pneg = list(parsed.negatives) if parsed else []
            sc = score_study(list(t.findings), list(t.negatives), pred, pneg)
            tp, fp, fn = tp + sc.tp, fp + sc.fp, fn + sc.fn
            halluc, predicted, contra = halluc + sc.hallucinated, predicted + sc.predicted, contra + sc.contradictions
            count_ok += sc.count_correct
            size_err += sc.size_abs_err_mm
            for f in t.findings:
                d = per_type.setdefault(f.type, {"truth": 0, "found": 0})
                d["truth"] += 1
            truth_keys = [(f.type, f.location) for f in t.findings]
            for f in pred:
                if (f.type, f.location) in truth_keys:
                    truth_keys.remove((f.type, f.location))
                    per_type.setdefault(f.type, {"truth": 0, "found": 0})["found"] += 1
            if len(samples) < 6 and s == 0:
                samples.append(
                    {"modality": modality, "indication": t.indication, "generated": text, "reference": t.references[0]}
                )
    p, r, f1 = prf(tp, fp, fn)
    return {
        "reports": len(items),
        "studies": len({i for i, _, _ in items}),
        "precision": p,
        "recall": r,
        "f1": f1,
        "tp": tp,
        "fp": fp,
        "fn": fn,
        "false_positive_rate": fp / predicted if predicted else 0.0,
        "hallucination_rate": halluc / predicted if predicted else 0.0,
        "contradictions": contra,
        "count_accuracy": count_ok / tp if tp else None,
        "size_mae_mm": float(np.mean(size_err)) if size_err else None,
        "unparsable": unparsable,
        "recall_by_type": {k: round(v["found"] / v["truth"], 4) for k, v in sorted(per_type.items()) if v["truth"]},
        "samples": samples,
    }


def code_digest() -> str:
    import edgekit.export.model_config
    import edgekit.finetune.gates

    h = hashlib.sha256()
    core = [Path(edgekit.export.model_config.__file__), Path(edgekit.finetune.gates.__file__)]
    for path in [*core, *(HERE / name for name in CODE_FILES)]:
        h.update(path.read_bytes())
    return h.hexdigest()


def generation_config(max_new_tokens: int) -> dict:
    return {
        "prompt_template": PROMPT_TEMPLATE,
        "prompt_format": "<bos> + encode(prompt_template) + <sep>, no special tokens added by the tokenizer",
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "sep_token_id": SEP_ID,
        "pad_token_id": PAD_ID,
        "max_new_tokens": max_new_tokens,
    }


def save_artifacts(
    out: Path, model, cfg: ModelConfig, tok, pcfg: PreprocessConfig, gen_cfg: dict, log: dict, importance=None
):
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    pcfg.save(out / "preprocessor_config.json")
    (out / "training_log.json").write_text(json.dumps(log, indent=2) + "\n")
    if importance is not None:  # the learned head gates: the bundle's head importance for the x1's DSS
        (out / "head_importance.json").write_text(json.dumps(importance, indent=1) + "\n")


def run(opts: TrainOptions, out: Path, *, evaluate: bool = True, cache: bool = True) -> dict:
    wall0, cpu0 = time.perf_counter(), time.process_time()
    set_determinism(opts.seed, opts.threads)
    pcfg = PreprocessConfig()
    cache_dir = out / "cache" if cache else None
    train = build_split("train", opts.train_studies, pcfg, cache_dir=cache_dir, workers=opts.workers)
    val = build_split("val", opts.val_studies, pcfg, cache_dir=cache_dir, workers=opts.workers)
    data_s = time.perf_counter() - wall0
    print(f"data: {len(train)} train, {len(val)} val studies in {data_s:.0f}s", flush=True)

    tok = train_tokenizer(tokenizer_corpus(train))
    enc_train, enc_val = encode_split(tok, train), encode_split(tok, val)
    longest = max(len(r) for refs in enc_train.references + enc_val.references for r in refs)
    max_new = int(math.ceil(longest * 1.25)) + 8
    cfg = opts.model_config(tok.get_vocab_size(), pcfg)
    print(f"tokenizer: {tok.get_vocab_size()} tokens; longest report {longest} tokens", flush=True)

    model = build_model(cfg, opts.seed)
    n_params = sum(p.numel() for p in model.parameters())
    steps_per_epoch = len(train) // opts.batch_size
    total = steps_per_epoch * opts.epochs
    print(f"model: {n_params / 1e6:.2f}M params; {total} steps of {opts.batch_size}", flush=True)
    t_train = time.perf_counter()
    n_labels = len(FINDING_LABELS) if opts.probe_attributes else PRESENCE_LABELS
    probe = FindingProbe(cfg, n_labels) if opts.aux_weight > 0 else None
    if probe is not None:
        init_weights(probe, opts.seed + 1)
    count_probe = CountMapProbe(cfg, len(COUNT_CHANNELS)) if opts.count_map_weight > 0 else None
    if count_probe is not None:
        init_weights(count_probe, opts.seed + 2)
    gates = HeadGates(cfg.layers, cfg.heads) if opts.head_gate_rate > 0 else None
    losses = train_loop(
        model,
        iterate_batches(
            enc_train,
            batch_size=opts.batch_size,
            epochs=opts.epochs,
            seed=opts.seed,
            xc_share=opts.xc_share,
            phrasings=opts.phrasings,
            count_cells=cfg.grid // cfg.pool_stride if count_probe is not None else None,
        ),
        opts,
        total,
        probe=probe,
        count_probe=count_probe,
        gates=gates,
    )
    importance = None
    if gates is not None:  # what is evaluated and saved below is the model with the gates folded in
        importance = gates.importance_doc(model)
        gates.fold_into(model)
    train_s = time.perf_counter() - t_train
    val_loss = eval_loss(model, enc_val, 64)
    print(f"val loss {val_loss:.4f}", flush=True)
    metrics = None
    if evaluate:
        t_eval = time.perf_counter()
        metrics = evaluate_generation(model, tok, enc_val, max_new, limit=opts.eval_studies)
        metrics["seconds"] = round(time.perf_counter() - t_eval, 1)
        print("val generation: " + json.dumps({k: v for k, v in metrics.items() if k != "samples"}), flush=True)

    log = {
        "options": asdict(opts),
        "torch_version": torch.__version__,
        "python": platform.python_version(),
        "threads": opts.threads,
        "params": n_params,
        "steps": total,
        "samples": total * opts.batch_size,
        "train_studies": len(train),
        "val_studies": len(val),
        "vocab_size": tok.get_vocab_size(),
        "longest_report_tokens": longest,
        "loss_curve": [round(float(np.mean(losses[i : i + 50])), 4) for i in range(0, len(losses), 50)],
        "final_train_loss": round(float(np.mean(losses[-max(1, steps_per_epoch // 4) :])), 4),
        "final_val_loss": round(val_loss, 4),
        "val_generation": metrics,
        "data_sha256": {"train": train.digest(), "val": val.digest()},
        "code_sha256": code_digest(),
        "seconds": {
            "data": round(data_s, 1),
            "train": round(train_s, 1),
            "wall_total": round(time.perf_counter() - wall0, 1),
            "cpu_total": round(time.process_time() - cpu0, 1),  # this process only (not the data workers)
        },
    }
    save_artifacts(out, model, cfg, tok, pcfg, generation_config(max_new), log, importance)
    print(
        f"wrote {out} in {log['seconds']['wall_total']:.0f}s wall, {log['seconds']['cpu_total']:.0f}s CPU", flush=True
    )
    return log


def parse_args(argv: list[str] | None) -> tuple[TrainOptions, argparse.Namespace]:
    d = TrainOptions()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="directory for the weights and training_log.json")
    ap.add_argument("--train-studies", type=int, default=d.train_studies)
    ap.add_argument("--val-studies", type=int, default=d.val_studies)
    ap.add_argument("--epochs", type=int, default=d.epochs)
    ap.add_argument("--batch-size", type=int, default=d.batch_size)
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--workers", type=int, default=d.workers)
    ap.add_argument("--eval-studies", type=int, default=None)
    ap.add_argument(
        "--phrasings",
        type=int,
        default=d.phrasings,
        help="train on the first N of the 4 reference phrasings (4: every one, the recipe before this option)",
    )
    ap.add_argument("--aux-weight", type=float, default=d.aux_weight, help="finding-probe loss weight (0: off)")
    ap.add_argument(
        "--presence-probe-only",
        action="store_true",
        help="the probe reads presence only, not counts and sizes (the recipe before this option)",
    )
    ap.add_argument(
        "--count-map-weight",
        type=float,
        default=d.count_map_weight,
        help="count-map probe loss weight (0: off, the recipe before this option)",
    )
    ap.add_argument(
        "--head-gate-rate",
        type=float,
        default=d.head_gate_rate,
        help="fraction of decoder heads the learned gates close (0: no gates, the recipe before this option)",
    )
    ap.add_argument("--head-gate-weight", type=float, default=d.head_gate_weight, help="L1 penalty on open gates")
    ap.add_argument("--model", type=json.loads, default={}, help='ModelConfig overrides as JSON, e.g. {"hidden": 128}')
    ap.add_argument("--no-eval", action="store_true", help="skip greedy generation on val")
    ap.add_argument("--no-cache", action="store_true", help="do not read or write the pixel cache")
    a = ap.parse_args(argv)
    opts = replace(
        d,
        train_studies=a.train_studies,
        val_studies=a.val_studies,
        epochs=a.epochs,
        batch_size=a.batch_size,
        lr=a.lr,
        seed=a.seed,
        workers=a.workers,
        eval_studies=a.eval_studies,
        model=a.model,
        aux_weight=a.aux_weight,
        probe_attributes=not a.presence_probe_only,
        count_map_weight=a.count_map_weight,
        head_gate_rate=a.head_gate_rate,
        head_gate_weight=a.head_gate_weight,
        phrasings=a.phrasings,
    )
    for name in ("train_studies", "val_studies", "epochs", "batch_size", "phrasings"):
        if getattr(opts, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
    if opts.batch_size > opts.train_studies:
        raise ConfigError("--batch-size must not exceed --train-studies")
    return opts, a


def main(argv: list[str] | None = None) -> int:
    try:
        opts, a = parse_args(argv)
        run(opts, a.out, evaluate=not a.no_eval, cache=not a.no_cache)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
