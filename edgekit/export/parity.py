"""How closely a backend (ORT on cpu, the x1 emulator...) reproduces the PyTorch reference: figures for bundles.

`edgekit build` stamps these into the bundle so a user sees what an export or a compression step cost. The
reference runs through the same `generate` loop via `TorchBackend`, so greedy mismatches come from the math of
the backend alone. Needs torch (the `train` extra); importing this module does not.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from edgekit.errors import ConfigError
from edgekit.export.model_config import ModelConfig
from edgekit.generate import KV, Backend, GenerationOptions, generate


def _torch():
    try:
        import torch
    except ImportError as exc:
        raise ConfigError("parity checks need PyTorch: pip install 'edgekit[train]'") from exc
    return torch


class TorchBackend:
    """The model family's PyTorch reference behind the generation backend protocol (numpy in, numpy out,
    float32, no grad)."""

    batch_rows = True  # `decode` keeps no per-sequence state: the engine may batch rows of different lengths

    def __init__(self, weights: Mapping[str, np.ndarray], config: ModelConfig, family: str | None = None):
        from edgekit.plugins import DEFAULT_MODEL, get_model_family

        torch = _torch()
        self.torch = torch
        self.model = get_model_family(family or DEFAULT_MODEL).reference_model(config).eval()
        self.model.load_state_dict({k: torch.from_numpy(np.asarray(v, np.float32)) for k, v in weights.items()})

    @classmethod
    def of_model(cls, model) -> TorchBackend:
        """A reference model already in memory (one a training run or a recipe is scoring), its weights shared
        rather than copied, so what it generates goes through the engine every target's reports go through."""
        backend = cls.__new__(cls)
        backend.torch, backend.model = _torch(), model
        return backend

    def encode_images(self, pixel_values: np.ndarray) -> np.ndarray:
        with self.torch.no_grad():
            return self.model.encode_images(self.torch.from_numpy(np.asarray(pixel_values, np.float32))).numpy()

    def embed(self, input_ids: np.ndarray) -> np.ndarray:
        with self.torch.no_grad():
            return self.model.model.embed_tokens(self.torch.from_numpy(np.asarray(input_ids, np.int64))).numpy()

    def decode(self, inputs_embeds, attention_mask, position_ids, past: KV | None = None):
        t = self.torch.from_numpy
        tpast = None if past is None else [(t(k), t(v)) for k, v in past]
        with self.torch.no_grad():
            logits, present = self.model.decode(
                t(np.asarray(inputs_embeds, np.float32)),
                t(np.asarray(attention_mask, np.int64)),
                t(np.asarray(position_ids, np.int64)),
                tpast,
            )
        return logits.numpy(), [(k.numpy(), v.numpy()) for k, v in present]


@dataclass(frozen=True)
class ParityReport:
    samples: int
    decode_steps: int
    image_features_max_abs: float
    prefill_logits_max_abs: float
    decode_logits_max_abs: float  # KV-cache decode, teacher-forced on the reference's greedy tokens
    greedy_match_rate: float  # share of samples whose greedy sequences are identical
    greedy_token_match_rate: float  # share of greedy positions before the first divergence, over all positions

    def to_dict(self) -> dict:
        return asdict(self)


def random_sample(config: ModelConfig, rng: np.random.Generator, prompt_len: int = 8):
    """Pixels in the model's input range and a prompt of ordinary (non-special) token ids."""
    pixels = rng.uniform(-1, 1, (1, config.num_frames, 1, config.image_size, config.image_size)).astype(np.float32)
    prompt = rng.integers(5, config.vocab_size, (1, prompt_len), dtype=np.int64)
    return pixels, prompt


def _teacher_forced_logits(backend: Backend, pixels, prompt, tokens: list[int]) -> list[np.ndarray]:
    """Prefill then one KV-cache decode per given token: the logits of every call."""
    image = backend.encode_images(pixels)
    x = np.concatenate([image, backend.embed(prompt)], axis=1)
    mask = np.ones(x.shape[:2], np.int64)
    pos = np.arange(x.shape[1], dtype=np.int64)[None]
    logits, past = backend.decode(x, mask, pos, None)
    out = [logits]
    for tok in tokens:
        mask = np.concatenate([mask, np.ones((1, 1), np.int64)], axis=1)
        pos = pos[:, -1:] + 1
        logits, past = backend.decode(backend.embed(np.array([[tok]], np.int64)), mask, pos, past)
        out.append(logits)
    return out


def measure_parity(
    candidate: Backend,
    weights: Mapping[str, np.ndarray],
    config: ModelConfig,
    *,
    samples: int = 10,
    decode_steps: int = 20,
    seed: int = 0,
    reference: Backend | None = None,
) -> ParityReport:
    """Compare `candidate` with the torch reference built from the same weights on `samples` random inputs."""
    with single_threaded_torch():
        return _measure_parity(
            candidate, weights, config, samples=samples, decode_steps=decode_steps, seed=seed, reference=reference
        )


@contextmanager
def single_threaded_torch():
    """Batch-1 decode of a small model is fastest on one torch thread, and several threads fighting another
    busy process for 2 cores made a parity check 20x slower (27 s vs 1.4 s measured for 2 samples)."""
    try:
        import torch
    except ImportError:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _measure_parity(
    candidate: Backend,
    weights: Mapping[str, np.ndarray],
    config: ModelConfig,
    *,
    samples: int,
    decode_steps: int,
    seed: int,
    reference: Backend | None,
) -> ParityReport:
    ref = reference if reference is not None else TorchBackend(weights, config)
    rng = np.random.default_rng(seed)
    greedy = GenerationOptions(max_new_tokens=decode_steps)
    img_err = prefill_err = decode_err = 0.0
    exact = matched = total = 0
    for _ in range(samples):
        pixels, prompt = random_sample(config, rng)
        img_err = max(img_err, float(np.abs(ref.encode_images(pixels) - candidate.encode_images(pixels)).max()))
        ref_tokens = generate(ref, pixels, prompt, greedy).token_ids
        cand_tokens = generate(candidate, pixels, prompt, greedy).token_ids
        forced = ref_tokens[: decode_steps - 1] if decode_steps > 1 else []
        ref_logits = _teacher_forced_logits(ref, pixels, prompt, forced)
        cand_logits = _teacher_forced_logits(candidate, pixels, prompt, forced)
        prefill_err = max(prefill_err, float(np.abs(ref_logits[0] - cand_logits[0]).max()))
        for r, c in zip(ref_logits[1:], cand_logits[1:]):
            decode_err = max(decode_err, float(np.abs(r - c).max()))
        exact += ref_tokens == cand_tokens
        prefix = next(
            (i for i, (a, b) in enumerate(zip(ref_tokens, cand_tokens)) if a != b),
            min(len(ref_tokens), len(cand_tokens)),
        )
        matched += prefix
        total += max(len(ref_tokens), len(cand_tokens))
    return ParityReport(
        samples=samples,
        decode_steps=decode_steps,
        image_features_max_abs=img_err,
        prefill_logits_max_abs=prefill_err,
        decode_logits_max_abs=decode_err,
        greedy_match_rate=exact / samples if samples else 1.0,
        greedy_token_match_rate=matched / total if total else 1.0,
    )


def measure_export_parity(
    onnx_dir: str | Path, weights: Mapping[str, np.ndarray], config: ModelConfig, **kwargs
) -> ParityReport:
    """Parity of the three graphs in `onnx_dir` run on the cpu target (ONNX Runtime)."""
    from edgekit.ort import CpuBackend

    return measure_parity(CpuBackend.from_dir(onnx_dir), weights, config, **kwargs)
