"""What a power mode can do: a module's peak rates scaled by the mode's active TPCs and clocks and its memory clock.

Why apart: these are the peaks before any efficiency assumption, checked on their own against NVIDIA's published
sparse-INT8 figures (tests/test_orin_estimate.py), so a change to the scaling shows up here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass

from .data import Device, PowerMode, load_data


@dataclass(frozen=True)
class Rates:
    """Peak rates of one device in one power mode (before any efficiency assumption)."""

    fp16_tflops: float  # dense FP16 Tensor Core
    int8_tops: float  # dense INT8 Tensor Core
    fp32_tflops: float  # CUDA cores
    dla_int8_tops: float  # dense INT8, all DLAs
    bandwidth_gbs: float
    gpu_sparse_int8_tops: float  # the headline-style figure, to compare with NVIDIA's tables

    def compute(self, dtype: str) -> float:
        """Dense peak in FLOP/s (or op/s) for a compute precision."""
        return {"fp16": self.fp16_tflops, "int8": self.int8_tops, "fp32": self.fp32_tflops}[dtype] * 1e12


def mode_rates(device: Device, mode: PowerMode, arch: dict[str, float] | None = None) -> Rates:
    a = arch if arch is not None else load_data().architecture
    tpc_hz = mode.gpu_tpcs * mode.gpu_mhz * 1e6
    fp16 = a["dense_fp16_flops_per_tpc_per_clock"] * tpc_hz / 1e12
    sparse_int8 = a["sparse_int8_ops_per_tpc_per_clock"] * tpc_hz / 1e12
    dla = a["dla_sparse_int8_ops_per_core_per_clock"] / 2 * device.dla_cores * mode.dla_mhz * 1e6 / 1e12
    bw = device.memory_bus_bits / 8 * a["transfers_per_emc_clock"] * mode.emc_mhz * 1e6 / 1e9
    return Rates(
        fp16_tflops=fp16,
        int8_tops=2 * fp16,
        fp32_tflops=a["fp32_flops_per_tpc_per_clock"] * tpc_hz / 1e12,
        dla_int8_tops=dla,
        bandwidth_gbs=bw,
        gpu_sparse_int8_tops=sparse_int8,
    )
