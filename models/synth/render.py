"""Pixels of the synthetic studies: anatomy-like backgrounds with findings drawn where a 64x64 model can see them.

Each kind has fixed zones for its finding types (a CT mass in the upper lung, nodules in the mid lung, effusion
at the dependent base, ...), so findings never overlap one another and removing one finding from a study leaves
the rest of its pixels untouched: anatomy, noise and each type's placement come from separate random streams.
Laterality follows radiology convention: the patient's right is on the image left (low column numbers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from edgekit.findings.vocabulary import CR_CHEST, CT_CHEST, MR_BRAIN, US_CARDIAC, Finding

RngFor = Callable[[str], np.random.Generator]  # a finding type -> its own placement stream


@dataclass
class Rendered:
    stored: np.ndarray  # (n, H, W) stored values, dtype as written to DICOM
    masks: dict[str, np.ndarray] = field(default_factory=dict)  # type -> bool (n, H, W) pixels the finding set
    centres: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # counted type -> (row, col) each
    center: float | None = None
    width: float | None = None
    photometric: str = "MONOCHROME2"


def _grid(size: int) -> tuple[np.ndarray, np.ndarray]:
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    return yy + 0.5, xx + 0.5


def _smooth_noise(rng: np.random.Generator, size: int, cell: int) -> np.ndarray:
    """Unit-variance-ish noise with features about `cell` pixels across (bilinear upsampling of a coarse grid)."""
    n = size // cell + 2
    coarse = rng.standard_normal((n, n)).astype(np.float32)
    pos = (np.arange(size, dtype=np.float32) + 0.5) / cell
    i0 = np.floor(pos).astype(int)
    f = pos - i0
    rows = coarse[i0] * (1 - f)[:, None] + coarse[i0 + 1] * f[:, None]
    return rows[:, i0] * (1 - f)[None, :] + rows[:, i0 + 1] * f[None, :]


def _ellipse(yy, xx, cy, cx, ry, rx) -> np.ndarray:
    return ((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2


def _z_profile(n: int, rng: np.random.Generator) -> np.ndarray:
    """Per-slice radius factor of a finding: a flattened ellipsoid covering at least ~60% of the series, so the
    8 frames the model samples see it several times."""
    z = (np.arange(n, dtype=np.float32) + 0.5) / n
    zc = rng.uniform(0.4, 0.6)
    hz = rng.uniform(0.42, 0.5)
    t = np.clip(np.abs(z - zc) / hz, 0, 1)
    return (1 - t**4) ** 0.25


def _lobulated(yy, xx, cy, cx, r, rng) -> np.ndarray:
    """Normalised radius of a lobulated blob (<= 1 inside); its widest diameter stays about 2 r."""
    theta = np.arctan2(yy - cy, xx - cx)
    p1, p2 = rng.uniform(0, 2 * np.pi, 2)
    wobble = 1 + 0.1 * np.sin(3 * theta + p1) + 0.06 * np.sin(5 * theta + p2)
    return np.sqrt((yy - cy) ** 2 + (xx - cx) ** 2) / (r * wobble / 1.08)


def _find(findings: list[Finding], type_: str) -> Finding | None:
    return next((f for f in findings if f.type == type_), None)


def _location(f: Finding) -> str:
    """The side `f` is drawn on: findings with locations in the vocabulary are generated with one."""
    if f.location is None:
        raise ValueError(f"a {f.type} finding needs a location to be drawn")
    return f.location


def _size_mm(f: Finding) -> int:
    """The diameter `f` is drawn with: findings with sizes in the vocabulary are generated with one."""
    if f.size_mm is None:
        raise ValueError(f"a {f.type} finding needs a size to be drawn")
    return f.size_mm


def _side_sign(side: str) -> int:
    """-1 for the patient's right (image left), +1 for the patient's left."""
    return -1 if side == "right" else 1


# ------------------------------------------------------------------------------------------------------ CT chest


def render_ct_chest(
    findings: list[Finding], n: int, anat: np.random.Generator, noise: np.random.Generator, place: RngFor
) -> Rendered:
    ct = _ct_anatomy(n, anat)
    masks: dict[str, np.ndarray] = {}
    centres_of: dict[str, list[tuple[float, float]]] = {}
    f = _find(findings, "pleural effusion")
    if f:
        masks[f.type] = _ct_effusion(ct, f, place(f.type))
    f = _find(findings, "mass")
    if f:
        masks[f.type] = _ct_mass(ct, f, place(f.type))
    f = _find(findings, "nodule")
    if f:
        masks[f.type], centres_of[f.type] = _ct_nodules(ct, f, place(f.type))
    hu = ct.hu
    hu += noise.normal(0, 15, hu.shape).astype(np.float32)
    stored = np.clip(np.rint(hu + 1024), 0, 4095).astype(np.int16)
    return Rendered(stored, masks, centres_of, center=-600.0, width=1500.0)


@dataclass
class _ChestCT:
    """A CT chest series in Hounsfield units before noise, with the lungs that findings are placed in."""

    yy: np.ndarray
    xx: np.ndarray
    hu: np.ndarray  # (n, H, W) float32
    lungs: np.ndarray  # (n, H, W) bool
    lung_centre: dict[str, tuple[float, float]]  # side -> (row, col)
    lung_ry: float
    lung_rx: float

    @property
    def n(self) -> int:
        return self.hu.shape[0]


def _ct_anatomy(n: int, anat: np.random.Generator) -> _ChestCT:
    """Body, subcutaneous fat, spine and two textured lungs, widest mid-series (every draw from `anat`)."""
    size = CT_CHEST.rows
    yy, xx = _grid(size)
    oy, ox = anat.uniform(-3, 3, 2)
    cy, cx = 64 + oy, 64 + ox
    body_ry, body_rx = anat.uniform(44, 48), anat.uniform(57, 61)
    lung_ry, lung_rx = anat.uniform(34, 37), anat.uniform(20, 22)
    lung_dx = anat.uniform(26, 28)
    texture = _smooth_noise(anat, size, 4) * 25
    z = (np.arange(n, dtype=np.float32) + 0.5) / n
    lung_scale = 0.9 + 0.1 * np.sin(np.pi * z)  # lungs widest mid-series

    hu = np.empty((n, size, size), np.float32)
    lungs = np.zeros((n, size, size), bool)
    lung_centre = {}
    for side in ("right", "left"):
        lung_centre[side] = (cy - 2, cx + _side_sign(side) * lung_dx)
    body = _ellipse(yy, xx, cy, cx, body_ry, body_rx)
    spine = _ellipse(yy, xx, cy + body_ry - 12, cx, 7, 7)
    for k in range(n):
        img = np.full((size, size), -1000.0, np.float32)
        img[body <= 1] = 40.0
        img[(body <= 1) & (body > 0.82)] = -100.0  # subcutaneous fat
        img[spine <= 1] = 650.0
        img[spine <= 0.4] = 250.0
        for ly, lx in lung_centre.values():
            m = _ellipse(yy, xx, ly, lx, lung_ry * lung_scale[k], lung_rx * lung_scale[k]) <= 1
            lungs[k] |= m
            img[m] = -850.0 + texture[m]
        hu[k] = img
    return _ChestCT(yy, xx, hu, lungs, lung_centre, lung_ry, lung_rx)


def _ct_effusion(ct: _ChestCT, f: Finding, rng: np.random.Generator) -> np.ndarray:
    """Dependent (posterior = image bottom) fluid with a meniscus rising laterally; painted, its mask returned."""
    yy, xx, lung_ry, lung_rx = ct.yy, ct.xx, ct.lung_ry, ct.lung_rx
    side = _location(f)
    ly, lx = ct.lung_centre[side]
    depth = rng.uniform(0.42, 0.48) * lung_ry
    lateral = np.clip((xx - lx) * _side_sign(side) / lung_rx, 0, 1)
    level = ly + lung_ry - depth - 6 * lateral**2
    side_lung = np.abs(xx - lx) < lung_rx + 1
    m = ct.lungs & (yy >= level)[None] & side_lung[None]
    ct.hu[m] = 12.0
    return m


def _ct_mass(ct: _ChestCT, f: Finding, rng: np.random.Generator) -> np.ndarray:
    """Upper lung, lobulated soft tissue; painted, its mask returned."""
    ly, lx = ct.lung_centre[_location(f)]
    r = _size_mm(f) / CT_CHEST.pixel_spacing_mm / 2
    my, mx = ly - 0.5 * ct.lung_ry + rng.uniform(-2, 2), lx + rng.uniform(-2, 2)
    rho = _lobulated(ct.yy, ct.xx, my, mx, r, rng)
    prof = _z_profile(ct.n, rng)
    m = np.stack([rho <= p for p in prof])
    ct.hu[m] = 35.0
    return m


def _ct_nodules(ct: _ChestCT, f: Finding, rng: np.random.Generator) -> tuple[np.ndarray, list[tuple[float, float]]]:
    """Mid lung, round, well apart; the others are the smallest size. Painted; the mask and centres returned."""
    yy, xx, lung_ry, lung_rx, mm = ct.yy, ct.xx, ct.lung_ry, ct.lung_rx, CT_CHEST.pixel_spacing_mm
    ly, lx = ct.lung_centre[_location(f)]
    radii = [_size_mm(f) / mm / 2] + [min(CT_CHEST.spec("nodule").sizes_mm) / mm / 2] * (f.count - 1)
    centres = _place_apart(
        rng,
        radii,
        y_range=(ly + 4, ly + 0.5 * lung_ry),
        x_range=(lx - lung_rx + 3, lx + lung_rx - 3),
        gap=4.0,
        inside=lambda y, x, r: _ellipse(y, x, ly, lx, lung_ry * 0.9 - r, lung_rx * 0.9 - r) <= 1,
    )
    m = np.zeros(ct.hu.shape, bool)
    for (ny, nx), r in zip(centres, radii):
        prof = _z_profile(ct.n, rng)
        d = np.sqrt((yy - ny) ** 2 + (xx - nx) ** 2)
        m |= np.stack([d <= r * p for p in prof])
    ct.hu[m] = 30.0
    return m, [(float(y), float(x)) for y, x in centres]


def _place_apart(rng, radii, *, y_range, x_range, gap, inside) -> list[tuple[float, float]]:
    """Centres for discs of `radii` inside a region, at least `gap` px apart (rejection sampling, then a row)."""
    for _ in range(200):
        pts: list[tuple[tuple[float, float], float]] = []
        for r in radii:
            for _ in range(50):
                y = rng.uniform(*y_range)
                x = rng.uniform(*x_range)
                if inside(y, x, r) and all(np.hypot(y - py, x - px) >= r + pr + gap for (py, px), pr in pts):
                    pts.append(((y, x), r))
                    break
            else:
                break
        if len(pts) == len(radii):
            return [p for p, _ in pts]
    # Deterministic fallback: a row across the middle of the range.
    y = (y_range[0] + y_range[1]) / 2
    xs = np.linspace(x_range[0] + radii[0], x_range[1] - radii[-1], len(radii))
    return [(y, float(x)) for x in xs]


# ------------------------------------------------------------------------------------------------------ MR brain


def render_mr_brain(
    findings: list[Finding], n: int, anat: np.random.Generator, noise: np.random.Generator, place: RngFor
) -> Rendered:
    size, mm = MR_BRAIN.rows, MR_BRAIN.pixel_spacing_mm
    yy, xx = _grid(size)
    oy, ox = anat.uniform(-3, 3, 2)
    cy, cx = 64 + oy, 64 + ox
    head_ry, head_rx = anat.uniform(54, 57), anat.uniform(45, 48)
    texture = _smooth_noise(anat, size, 6) * 0.04
    z = (np.arange(n, dtype=np.float32) + 0.5) / n
    scale = 0.86 + 0.14 * np.sin(np.pi * z)
    hydro = _find(findings, "hydrocephalus") is not None
    v_ry, v_rx, v_dx = (18, 9, 11) if hydro else (10, 4, 7)

    img = np.empty((n, size, size), np.float32)
    brain = np.zeros((n, size, size), bool)
    for k in range(n):
        e = _ellipse(yy, xx, cy, cx, head_ry * scale[k], head_rx * scale[k])
        s = np.zeros((size, size), np.float32)
        s[e <= 1] = 0.75  # scalp
        s[e <= 0.86] = 0.08  # skull
        s[e <= 0.76] = 0.15  # CSF rim
        b = e <= 0.72
        s[b] = 0.45 + texture[b]
        s[b & (np.abs(xx - cx) < 1.0)] = 0.25  # falx
        brain[k] = b
        img[k] = s
    masks: dict[str, np.ndarray] = {}
    vent = np.zeros((size, size), bool)
    for sign in (-1, 1):
        vent |= _ellipse(yy, xx, cy - 8, cx + sign * v_dx, v_ry, v_rx) <= 1
    v = brain & vent[None]
    img[v] = 0.1
    if hydro:
        masks["hydrocephalus"] = v

    f = _find(findings, "lesion")
    if f:  # bright, homogeneous, lateral-anterior in its hemisphere
        rng = place(f.type)
        r = _size_mm(f) / mm / 2
        ly, lx = cy - 26 + rng.uniform(-3, 3), cx + _side_sign(_location(f)) * (27 + rng.uniform(-2, 2))
        prof = _z_profile(n, rng)
        d = np.sqrt((yy - ly) ** 2 + (xx - lx) ** 2)
        m = np.stack([d <= r * p for p in prof]) & brain
        img[m] = 0.95
        masks[f.type] = m
    f = _find(findings, "mass")
    if f:  # ring-enhancing with a dark core and oedema, posterior
        rng = place(f.type)
        r = _size_mm(f) / mm / 2
        side = -1 if rng.random() < 0.5 else 1
        my, mx = cy + 22 + rng.uniform(-2, 2), cx + side * (12 + rng.uniform(-2, 2))
        rho = _lobulated(yy, xx, my, mx, r, rng)
        prof = _z_profile(n, rng)
        m = np.zeros((n, size, size), bool)
        for k, p in enumerate(prof):
            if p <= 0:
                continue
            q = rho / p
            ring = q <= 1
            img[k][(q <= 1 + 6 / r) & ~ring & brain[k]] = 0.3  # oedema
            img[k][ring] = 0.95
            img[k][q <= 1 - 3.5 / r] = 0.22
            m[k] = ring
        masks[f.type] = m

    img += noise.normal(0, 0.02, img.shape).astype(np.float32)
    gain = float(anat.uniform(2600, 3400))
    stored = np.clip(np.rint(np.abs(img) * gain), 0, 4095).astype(np.uint16)
    return Rendered(stored, masks, center=round(gain / 2), width=round(gain))


# ---------------------------------------------------------------------------------------------- chest radiograph


def render_cr_chest(
    findings: list[Finding], anat: np.random.Generator, noise: np.random.Generator, place: RngFor, *, monochrome1: bool
) -> Rendered:
    size = CR_CHEST.rows
    yy, xx = _grid(size)
    oy, ox = anat.uniform(-5, 5, 2)
    cy, cx = 120 + oy, 128 + ox
    lung_ry, lung_rx, lung_dx = anat.uniform(76, 82), anat.uniform(36, 40), anat.uniform(46, 50)
    img = np.full((size, size), 0.05, np.float32)
    torso = (np.abs(xx - cx) < 108) & (yy > cy - 100)
    img[torso] = 0.5
    lungs = {}
    for side in ("right", "left"):
        ly, lx = cy, cx + _side_sign(side) * lung_dx
        e = _ellipse(yy, xx, ly, lx, lung_ry, lung_rx)
        lungs[side] = (ly, lx, e)
    lung_any = (lungs["right"][2] <= 1) | (lungs["left"][2] <= 1)
    markings = _smooth_noise(anat, size, 5) * 0.035 + _smooth_noise(anat, size, 12) * 0.03
    img[lung_any] = 0.27 + markings[lung_any]
    # ribs: faint curved bands over the lungs
    rib_phase = anat.uniform(0, 18)
    ribs = np.sin(2 * np.pi * (yy + 0.002 * (xx - cx) ** 2 + rib_phase) / 18) > 0.72
    img[lung_any & ribs] += 0.07
    below = yy > cy + lung_ry * 0.82  # diaphragm / abdomen
    img[below & torso & ~lung_any] = 0.58

    masks: dict[str, np.ndarray] = {}
    cardio = _find(findings, "cardiomegaly") is not None
    thorax_w = 2 * (lung_dx + lung_rx)
    heart_rx = (0.31 if cardio else 0.2) * thorax_w
    heart = _ellipse(yy, xx, cy + 0.45 * lung_ry, cx + 0.15 * heart_rx, 0.42 * lung_ry, heart_rx) <= 1
    img[heart] = np.maximum(img[heart], 0.62)
    if cardio:
        masks["cardiomegaly"] = heart[None]

    f = _find(findings, "consolidation")
    if f:  # patchy opacity in the mid zone
        ly, lx, e = lungs[_location(f)]
        rng = place(f.type)
        r = rng.uniform(0.5, 0.58) * lung_rx
        py, px = ly - 0.1 * lung_ry + rng.uniform(-6, 6), lx + rng.uniform(-4, 4)
        patch = _smooth_noise(rng, size, 6) * 0.06
        rho = _lobulated(yy, xx, py, px, r, rng)
        m = (rho <= 1) & (e <= 1)
        img[m] = 0.58 + patch[m]
        masks[f.type] = m[None]
    f = _find(findings, "pleural effusion")
    if f:  # dense base with a meniscus rising laterally
        side = _location(f)
        ly, lx, e = lungs[side]
        rng = place(f.type)
        depth = rng.uniform(0.5, 0.58) * lung_ry
        lateral = np.clip((xx - lx) * _side_sign(side) / lung_rx, 0, 1)
        level = ly + lung_ry - depth - 18 * lateral**2
        m = (e <= 1.02) & (yy >= level)
        img[m] = np.maximum(img[m], 0.66)
        masks[f.type] = m[None]
    f = _find(findings, "pneumothorax")
    if f:  # lateral-apical rim without lung markings, edged by a bright pleural line
        side = _location(f)
        ly, lx, e = lungs[side]
        rng = place(f.type)
        rho = np.sqrt(e)
        edge = rng.uniform(0.6, 0.66)
        lateral = (xx - lx) * _side_sign(side) > -0.3 * lung_rx
        upper = yy < ly + 0.3 * lung_ry
        m = (rho <= 1) & (rho > edge) & lateral & upper
        img[m] = 0.02
        line = (rho <= edge) & (rho > edge - 0.03) & lateral & upper
        img[line] = 0.45
        masks[f.type] = (m | line)[None]

    img += noise.normal(0, 0.015, img.shape).astype(np.float32)
    mono2 = np.clip(np.rint(np.clip(img, 0, 1) * 4000 + 40), 0, 4095)
    stored = (4095 - mono2 if monochrome1 else mono2).astype(np.uint16)[None]
    return Rendered(
        stored, masks, center=2048.0, width=4096.0, photometric="MONOCHROME1" if monochrome1 else "MONOCHROME2"
    )


# ---------------------------------------------------------------------------------------------- cardiac echo cine


# End-diastolic cavity radius and end-systolic radius (px at 128): the normal ring contracts by 40%, the
# hypokinetic one by 8%, a difference of ~4 px at 64x64 between the sampled frames.
US_DIASTOLE_RADIUS = 22.0
US_SYSTOLE_RADIUS = {"normal": 13.0, "reduced": 20.0}
US_EFFUSION_PX = 9.0


def render_us_cardiac(
    findings: list[Finding],
    n: int,
    anat: np.random.Generator,
    noise: np.random.Generator,
    place: RngFor,
    *,
    cycles: int,
) -> Rendered:
    size = US_CARDIAC.rows
    yy, xx = _grid(size)
    apex_x = 64 + anat.uniform(-2, 2)
    dy, dx = yy - 4, xx - apex_x
    depth = np.sqrt(dy**2 + dx**2)
    angle = np.degrees(np.arctan2(dx, dy))
    fan = (np.abs(angle) < 38) & (depth < 124) & (depth > 6)
    speckle = np.clip(anat.rayleigh(1.0, (size, size)).astype(np.float32), 0, 3.5)
    tissue = 55 + 25 * _smooth_noise(anat, size, 10)
    cy, cx = 70 + anat.uniform(-3, 3), apex_x + anat.uniform(-3, 3)
    r = np.sqrt((yy - cy) ** 2 + (xx - cx) ** 2)
    reduced = _find(findings, "reduced wall motion") is not None
    effusion = _find(findings, "pericardial effusion") is not None
    rd = US_DIASTOLE_RADIUS + anat.uniform(-1, 1)
    rs = US_SYSTOLE_RADIUS["reduced" if reduced else "normal"]
    wall_area = (rd + 8) ** 2 - rd**2  # the myocardium keeps its area: it thickens as it contracts
    phase0 = anat.uniform(0, 1)

    frames = np.empty((n, size, size), np.float32)
    wall_masks = np.zeros((n, size, size), bool)
    eff_masks = np.zeros((n, size, size), bool)
    for k in range(n):
        beat = 0.5 - 0.5 * np.cos(2 * np.pi * (cycles * k / n + phase0))
        r_in = rd - (rd - rs) * beat
        r_out = np.sqrt(r_in**2 + wall_area)
        g = tissue.copy()
        g[r < r_in] = 10  # blood pool
        wall = (r >= r_in) & (r < r_out)
        g[wall] = 150
        gap = US_EFFUSION_PX if effusion else 0.0
        if effusion:
            band = (r >= r_out) & (r < r_out + gap)
            g[band] = 6
            eff_masks[k] = band
        g[(r >= r_out + gap) & (r < r_out + gap + 4)] = 205  # pericardium
        wall_masks[k] = (r >= rs) & (r < rd + 8)
        frames[k] = g
    frames *= speckle[None] * 0.75 + 0.25
    frames += noise.normal(0, 4, frames.shape).astype(np.float32)
    frames[:, ~fan] = 0
    stored = np.clip(np.rint(frames), 0, 255).astype(np.uint8)
    masks = {}
    if reduced:
        masks["reduced wall motion"] = wall_masks
    if effusion:
        masks["pericardial effusion"] = eff_masks
    return Rendered(stored, masks, center=128.0, width=256.0)
