"""The picture of a profile: one panel per front (device), energy per report against finding F1, the front drawn
through, latency as colour. Fronts never share axes: their energies and latencies come from different sources."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

from edgekit.pareto.profile import Front, Profile


def plot_profile(profile: Profile, out_stem: Path) -> list[Path]:
    """Write `<out_stem>.png` and `.svg` (a panel per front, two across); their paths. Headless (Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fronts = profile.fronts
    cols = min(len(fronts), 2) or 1
    rows = max(1, math.ceil(len(fronts) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(8 * cols, 5.5 * rows), dpi=120, squeeze=False)
    for ax, front in zip(axes.flat, fronts):
        _panel(fig, ax, front, profile.split)
    for ax in list(axes.flat)[len(fronts) :]:
        ax.set_visible(False)
    if not fronts:
        axes[0][0].set_visible(True)
        axes[0][0].set_title("edgekit pareto: no points")
    if len(fronts) > 1:
        fig.suptitle(f"edgekit pareto: {len(fronts)} fronts, one per device; never compared with each other")
    fig.tight_layout()
    out = []
    for suffix in (".png", ".svg"):
        path = out_stem.with_suffix(suffix)
        fig.savefig(path)
        out.append(path)
    plt.close(fig)
    return out


def _panel(fig, ax, front: Front, split: dict) -> None:
    points = [p for p in front.points if math.isfinite(p.energy_j)]
    on = {p.id for p in front.front}
    if points:
        sc = ax.scatter(
            [p.energy_j for p in points],
            [p.f1 for p in points],
            c=[p.latency_p95_ms for p in points],
            cmap="viridis",
            s=[90 if p.id in on else 40 for p in points],
            edgecolors=["black" if p.id in on else "none" for p in points],
            linewidths=1.2,
            zorder=3,
        )
        fig.colorbar(sc, ax=ax, label=f"latency p95 (ms; {front.latency_source})")
        on_front = sorted((p for p in points if p.id in on), key=lambda p: p.energy_j)
        ax.step(
            [p.energy_j for p in on_front],
            [p.f1 for p in on_front],
            where="post",
            color="black",
            linewidth=0.8,
            alpha=0.6,
            label="Pareto front (energy, F1, "
            + ("video F1, " if any(p.video_f1 is not None for p in points) else "")
            + "latency)",
            zorder=2,
        )
        for p in points:
            lo, hi = p.f1_ci
            ax.plot([p.energy_j, p.energy_j], [lo, hi], color="grey", linewidth=0.6, zorder=1)
        ax.autoscale_view()
        to_points = 72.0 / fig.dpi
        anchors = [tuple(ax.transData.transform((p.energy_j, p.f1)) * to_points) for p in on_front]
        for p, dy in zip(on_front, label_offsets(anchors)):
            video = f" (video F1 {p.video_f1:.3f})" if p.video_f1 is not None and p.video_f1 < p.f1 else ""
            ax.annotate(p.id + video, (p.energy_j, p.f1), textcoords="offset points", xytext=(5, dy), fontsize=7)
        if (
            min(p.energy_j for p in points) > 0
            and max(p.energy_j for p in points) / min(p.energy_j for p in points) > 20
        ):
            ax.set_xscale("log")
        ax.legend(loc="lower right", fontsize=8)
    source = front.energy_source if points else "no meter"
    ax.set_xlabel(f"energy per report (J; {source})")
    ax.set_ylabel(f"finding F1 ({split.get('name', '?')} split, {split.get('count', '?')} studies; 95% CI bars)")
    ax.set_title("\n".join(textwrap.wrap(front.label, 70)), fontsize=9)
    ax.grid(True, alpha=0.3)


def label_offsets(anchors: list[tuple[float, float]], *, line: float = 9.0, wide: float = 150.0) -> list[float]:
    """Vertical offsets (points) of the labels of points at `anchors` (display positions in points, in the order
    drawn): 4 above the point, unless a label already placed less than `wide` across is within a line of it; then
    a line below the lowest such label, so labels of close points stack instead of overlapping."""
    out: list[float] = []
    placed: list[tuple[float, float]] = []  # (x, label y) of the labels so far
    for x, y in anchors:
        label = y + 4.0
        while clash := [ly for lx, ly in placed if abs(x - lx) < wide and abs(label - ly) < line]:
            label = min(clash) - line
        placed.append((x, label))
        out.append(label - y)
    return out
