"""Train radreport-tiny from scratch on synthetic studies, deterministically, on 2 CPU cores.

    python -m edgekit.models.radreport_tiny.train --out DIR

Every source of randomness is seeded and torch runs deterministic kernels on a fixed thread count, so the same
code, data and torch build give the same weights bit for bit. DIR receives the committed artefacts
(`model.safetensors`, `config.json`, `tokenizer.json`, `generation_config.json`, `preprocessor_config.json`,
`training_log.json`) and a float16 pixel cache under `DIR/cache` that makes reruns skip data generation.

This module is the training loop and its artefacts; what it minimises is in `objectives.py`, what makes it repeat
in `determinism.py`, and what it reports about the trained model on val (loss, greedy reports scored by
`edgekit.eval`) in `validation.py`.
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Annotated

import numpy as np
import torch
import typer
from tokenizers import Tokenizer
from torch import nn

from edgekit.errors import ConfigError
from edgekit.export.model_config import ModelConfig
from edgekit.preprocess import PreprocessConfig

from .data import (
    COUNT_CHANNELS,
    FINDING_LABELS,
    PRESENCE_LABELS,
    EncodedSplit,
    SplitData,
    build_split,
    encode_split,
    iterate_batches,
    tokenizer_corpus,
)
from .determinism import set_determinism, to_torch
from .head_gates import HeadGates, closed_target
from .modeling import RadReportTiny
from .objectives import CountMapProbe, FindingProbe, training_loss
from .tokenizer import BOS_ID, EOS_ID, PAD_ID, PROMPT_TEMPLATE, SEP_ID, train_tokenizer
from .validation import eval_loss, evaluate_generation

HERE = Path(__file__).resolve().parent
# beside this file; plus the core's config and gates
CODE_FILES = (
    "modeling.py",
    "tokenizer.py",
    "data.py",
    "train.py",
    "head_gates.py",
    "objectives.py",
    "determinism.py",
    "validation.py",
)


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


def init_weights(model: nn.Module, seed: int) -> None:
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


def make_optimizer(model: nn.Module, opts: TrainOptions, total_steps: int):
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


@dataclass
class Prepared:
    """The splits, the tokenizer trained on the train split's text, and what the model's shape takes from them."""

    train: SplitData
    val: SplitData
    data_s: float  # seconds from the run's start to both splits in memory
    tok: Tokenizer
    enc_train: EncodedSplit
    enc_val: EncodedSplit
    longest: int  # tokens of the longest reference
    max_new: int  # the generation config's max_new_tokens
    pcfg: PreprocessConfig
    cfg: ModelConfig


def prepare(opts: TrainOptions, out: Path, cache: bool, wall0: float) -> Prepared:
    """Data (from the pixel cache under `out` when `cache`), tokenizer and model config."""
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
    return Prepared(train, val, data_s, tok, enc_train, enc_val, longest, max_new, pcfg, cfg)


def train_with_heads(
    model: RadReportTiny, cfg: ModelConfig, enc_train: EncodedSplit, opts: TrainOptions, total_steps: int
) -> tuple[list[float], dict | None]:
    """Train `model` beside the training-only heads `opts` turns on (finding probe, count-map probe, head gates);
    returns the per-step LM losses and, with gates, their importance document, the gates folded into the model."""
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
        total_steps,
        probe=probe,
        count_probe=count_probe,
        gates=gates,
    )
    importance = None
    if gates is not None:  # what is evaluated and saved after this is the model with the gates folded in
        importance = gates.importance_doc(model)
        gates.fold_into(model)
    return losses, importance


def run(opts: TrainOptions, out: Path, *, evaluate: bool = True, cache: bool = True) -> dict:
    wall0, cpu0 = time.perf_counter(), time.process_time()
    set_determinism(opts.seed, opts.threads)
    data = prepare(opts, out, cache, wall0)

    model = build_model(data.cfg, opts.seed)
    n_params = sum(p.numel() for p in model.parameters())
    steps_per_epoch = len(data.train) // opts.batch_size
    total = steps_per_epoch * opts.epochs
    print(f"model: {n_params / 1e6:.2f}M params; {total} steps of {opts.batch_size}", flush=True)
    t_train = time.perf_counter()
    losses, importance = train_with_heads(model, data.cfg, data.enc_train, opts, total)
    train_s = time.perf_counter() - t_train
    val_loss = eval_loss(model, data.enc_val, 64)
    print(f"val loss {val_loss:.4f}", flush=True)
    metrics = None
    if evaluate:
        t_eval = time.perf_counter()
        metrics = evaluate_generation(model, data.tok, data.enc_val, data.max_new, limit=opts.eval_studies)
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
        "train_studies": len(data.train),
        "val_studies": len(data.val),
        "vocab_size": data.tok.get_vocab_size(),
        "longest_report_tokens": data.longest,
        "loss_curve": [round(float(np.mean(losses[i : i + 50])), 4) for i in range(0, len(losses), 50)],
        "final_train_loss": round(float(np.mean(losses[-max(1, steps_per_epoch // 4) :])), 4),
        "final_val_loss": round(val_loss, 4),
        "val_generation": metrics,
        "data_sha256": {"train": data.train.digest(), "val": data.val.digest()},
        "code_sha256": code_digest(),
    }
    log["seconds"] = seconds = {
        "data": round(data.data_s, 1),
        "train": round(train_s, 1),
        "wall_total": round(time.perf_counter() - wall0, 1),
        "cpu_total": round(time.process_time() - cpu0, 1),  # this process only (not the data workers)
    }
    save_artifacts(out, model, data.cfg, data.tok, data.pcfg, generation_config(data.max_new), log, importance)
    print(f"wrote {out} in {seconds['wall_total']:.0f}s wall, {seconds['cpu_total']:.0f}s CPU", flush=True)
    return log


# the command line: `python -m edgekit.models.radreport_tiny.train`, each flag one field of TrainOptions
app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, help=__doc__.split("\n")[0])
_D = TrainOptions()
_BEFORE = "the recipe before this option"


@app.command()
def main(
    out: Annotated[Path, typer.Option(help="Directory for the weights and training_log.json.", show_default=False)],
    train_studies: Annotated[int, typer.Option(min=1)] = _D.train_studies,
    val_studies: Annotated[int, typer.Option(min=1)] = _D.val_studies,
    epochs: Annotated[int, typer.Option(min=1)] = _D.epochs,
    batch_size: Annotated[int, typer.Option(min=1, help="At most --train-studies.")] = _D.batch_size,
    lr: float = _D.lr,
    seed: int = _D.seed,
    workers: Annotated[int, typer.Option(help="Processes generating studies before training.")] = _D.workers,
    eval_studies: Annotated[
        int | None, typer.Option(help="Greedy generation on the val studies below this (default: all).")
    ] = None,
    phrasings: Annotated[
        int, typer.Option(min=1, help=f"Train on the first N of the 4 reference phrasings (4: every one, {_BEFORE}).")
    ] = _D.phrasings,
    aux_weight: Annotated[float, typer.Option(help="Finding-probe loss weight (0: off).")] = _D.aux_weight,
    presence_probe_only: Annotated[
        bool,
        typer.Option("--presence-probe-only", help=f"The probe reads presence only, not counts and sizes ({_BEFORE})."),
    ] = False,
    count_map_weight: Annotated[
        float, typer.Option(help=f"Count-map probe loss weight (0: off, {_BEFORE}).")
    ] = _D.count_map_weight,
    head_gate_rate: Annotated[
        float, typer.Option(help=f"Fraction of decoder heads the learned gates close (0: no gates, {_BEFORE}).")
    ] = _D.head_gate_rate,
    head_gate_weight: Annotated[float, typer.Option(help="L1 penalty on open gates.")] = _D.head_gate_weight,
    model: Annotated[str, typer.Option(help='ModelConfig overrides as JSON, e.g. {"hidden": 128}.')] = "{}",
    no_eval: Annotated[bool, typer.Option("--no-eval", help="Skip greedy generation on val.")] = False,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Do not read or write the pixel cache.")] = False,
) -> None:
    """Train radreport-tiny from scratch into the --out directory (the defaults are the recipe's; the committed
    weights' run is in the model's README)."""
    if batch_size > train_studies:
        raise typer.BadParameter("must not exceed --train-studies", param_hint="--batch-size")
    try:
        overrides = json.loads(model)
    except json.JSONDecodeError as e:
        raise typer.BadParameter(f"not JSON: {e}", param_hint="--model") from None
    opts = replace(
        _D,
        train_studies=train_studies,
        val_studies=val_studies,
        epochs=epochs,
        batch_size=batch_size,
        lr=lr,
        seed=seed,
        workers=workers,
        eval_studies=eval_studies,
        model=overrides,
        aux_weight=aux_weight,
        probe_attributes=not presence_probe_only,
        count_map_weight=count_map_weight,
        head_gate_rate=head_gate_rate,
        head_gate_weight=head_gate_weight,
        phrasings=phrasings,
    )
    try:
        run(opts, out, evaluate=not no_eval, cache=not no_cache)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(2) from None


if __name__ == "__main__":
    app()
