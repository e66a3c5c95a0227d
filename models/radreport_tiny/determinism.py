"""What makes a radreport-tiny run repeat bit for bit: the seed, deterministic kernels on a fixed thread count,
and batches in torch's own memory. Training, the LoRA recipe and the co-pruning gradients all start here."""

from __future__ import annotations

import numpy as np
import torch


def set_determinism(seed: int, threads: int) -> None:
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(threads)


def to_torch(batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Copies into torch's own (64-byte aligned) memory: BLAS kernels may round differently on numpy's
    16-byte aligned buffers, which made identical runs drift apart in the last bit."""
    return {k: torch.from_numpy(v).clone() for k, v in batch.items()}
