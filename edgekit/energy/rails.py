"""Which Jetson power rails make the board's total: the one rule the INA3221 reader and the tegrastats parser share.

- Orin Nano / Orin NX (and TX2, Xavier NX) have an input rail, `VDD_IN`, that feeds the whole module: it is the
  total, and the other rails (VDD_CPU_GPU_CV, VDD_SOC) are parts of it; summing them would count twice.
- Jetson Nano (JetPack 4) calls its input rail `POM_5V_IN`.
- AGX Orin has no input rail. Its first monitor reads VDD_GPU_SOC, VDD_CPU_CV and VIN_SYS_5V0 (the second,
  VDDQ_VDD2_1V8AO and two NC channels): the total is the sum of the first three, as NVIDIA's power guide and
  tegrastats add them. The carrier board's own draw is in none of them.
- Any other board: the sum of every rail, labelled as a sum so nobody mistakes it for an input rail.

Sources: Jetson Linux Developer Guide, "Jetson Orin Nano Series, Jetson Orin NX Series and Jetson AGX Orin Series",
power monitor section (r35/r36); jetson_stats `jtop/core/power.py` (facts only: VDD_IN / POM_5V_IN as totals).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

INPUT_RAILS = ("VDD_IN", "POM_5V_IN")
AGX_ORIN_TOTAL = ("VDD_GPU_SOC", "VDD_CPU_CV", "VIN_SYS_5V0")


def total_rails(names: Iterable[str]) -> tuple[str, ...]:
    """The rails whose sum is the board total, from the rail names a board has."""
    names = list(names)
    for rail in INPUT_RAILS:
        if rail in names:
            return (rail,)
    if all(r in names for r in AGX_ORIN_TOTAL):
        return AGX_ORIN_TOTAL
    return tuple(names)


def total_label(rails: tuple[str, ...]) -> str:
    """The sensor part of the source label: `VDD_IN`, or the summed rails joined by `+`."""
    return "+".join(rails)


def board_total(watts_by_rail: Mapping[str, float]) -> tuple[float, tuple[str, ...]]:
    rails = total_rails(watts_by_rail)
    return sum(watts_by_rail[r] for r in rails), rails
