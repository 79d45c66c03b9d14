"""Render one phantom radiograph: the patient's anatomy, one exposure, the findings present, and
where each finding was drawn (its regions, the demo's reference for localisation scores)."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from chexflow.data import nih
from chexflow.data.phantoms.anatomy import LEFT, RIGHT, Anatomy, image_geometry, sample_anatomy
from chexflow.data.phantoms.canvas import Canvas, f32, pixel_noise, ramp, triangle_wave, upsample
from chexflow.data.phantoms.findings import FINDINGS


# A finding's region is where it changed the image: the pixels whose grey value differs from the
# same exposure rendered without that finding (same patient, same noise, the other findings kept) by
# at least REGION_LEVEL of the largest difference (its visible core, not the tails of smooth edges),
# split into the patient's right and left side (a bilateral finding shows as two boxes), except for
# findings that sit on the midline. A side holding less than MIN_SIDE_SHARE of the changed pixels is
# a tail crossing the midline (e.g. the mediastinum pulled over by atelectasis), not a second region.
REGION_LEVEL = 0.25
MIN_SIDE_SHARE = 0.05
MIDLINE_FINDINGS = ("Cardiomegaly", "Hernia")


class Region(NamedTuple):
    """A finding's box in pixels of the rendered image: left, top, width, height (x right, y down)."""
    label: str
    x: float
    y: float
    w: float
    h: float


class Rendered(NamedTuple):
    image: np.ndarray            # uint8 size x size
    regions: list[Region]


def render_phantom(findings: np.ndarray, *, size: int, rng: np.random.Generator,
                   anatomy: Anatomy | None = None) -> np.ndarray:
    """Render one phantom radiograph (uint8 size x size) showing the given findings (see ``render``)."""
    return render(findings, size=size, rng=rng, anatomy=anatomy, regions=False).image


def render(findings: np.ndarray, *, size: int, rng: np.random.Generator, anatomy: Anatomy | None = None,
           regions: bool = True) -> Rendered:
    """Render one phantom radiograph (uint8 size x size) showing the given findings; with ``regions``
    also where each finding shows (``Region`` boxes: one more render per finding present, from a copy
    of ``rng``'s starting state, so the image is the same either way).

    ``findings``: 14 values in ``nih.LABELS`` order, 1 = present (NaN counts as absent).
    ``anatomy``: the patient's anatomy (default: drawn from ``rng``). ``rng`` first yields one
    seed per finding, then drives the base image; each finding present draws from its own
    generator, so toggling a finding leaves the rest of the image unchanged.
    """
    values = np.asarray(findings, dtype=np.float64).reshape(-1)
    if values.shape != (len(nih.LABELS),):
        raise ValueError(f"findings must have {len(nih.LABELS)} entries (nih.LABELS order), got {values.shape}")
    if size < 8:
        raise ValueError(f"size must be at least 8, got {size}")
    start = rng.bit_generator.state
    image, canvas = _render(values, size, rng, anatomy)
    if not regions:
        return Rendered(image, [])
    found: list[Region] = []
    for i in np.flatnonzero(values > 0.5):
        without = values.copy()
        without[i] = 0.0
        replay = np.random.Generator(type(rng.bit_generator)())
        replay.bit_generator.state = start
        other, _ = _render(without, size, replay, anatomy)
        diff = np.abs(image.astype(np.int16) - other.astype(np.int16))
        found += _regions(nih.LABELS[i], diff, canvas)
    return Rendered(image, found)


def _render(values: np.ndarray, size: int, rng: np.random.Generator,
            anatomy: Anatomy | None) -> tuple[np.ndarray, Canvas]:
    seeds = rng.integers(0, 2**63 - 1, size=len(nih.LABELS))
    if anatomy is None:
        anatomy = sample_anatomy(rng)
    present = [(i, label) for i, label in enumerate(nih.LABELS) if values[i] > 0.5]
    finding_rng = {i: np.random.default_rng(seeds[i]) for i, _ in present}
    state: dict[int, dict] = {i: {} for i, _ in present}

    # per-exposure variation (drawn in a fixed order whatever the findings)
    jitter = (rng.uniform(-0.03, 0.03), rng.uniform(-0.03, 0.03), np.deg2rad(rng.uniform(-2, 2)),
              rng.uniform(0.97, 1.03))
    exposure = rng.uniform(0.85, 1.15), rng.uniform(-0.05, 0.05), rng.uniform(0.85, 1.2)
    noise_sigma = rng.uniform(0.012, 0.03)
    vessel_grids = rng.standard_normal((12, 12), dtype=np.float32), rng.standard_normal((20, 20), dtype=np.float32)
    noise = pixel_noise(rng, size)

    geom = image_geometry(anatomy, rng)
    for i, label in present:
        if FINDINGS[label].geometry is not None:
            FINDINGS[label].geometry(geom, finding_rng[i], state[i])
    canvas = Canvas(geom, size, jitter)
    for i, label in present:
        if FINDINGS[label].draw is not None:
            FINDINGS[label].draw(canvas, finding_rng[i], state[i])

    img, occlusion = _soft_tissue(canvas)
    _draw_lungs(img, canvas, occlusion, vessel_grids)
    _draw_bones_and_airways(img, canvas)
    img += canvas.extra
    return _expose(img, noise, noise_sigma, exposure), canvas


def _box(label: str, mask: np.ndarray) -> Region:
    rows, cols = np.flatnonzero(mask.any(axis=1)), np.flatnonzero(mask.any(axis=0))
    return Region(label, float(cols[0]), float(rows[0]), float(cols[-1] + 1 - cols[0]), float(rows[-1] + 1 - rows[0]))


def _regions(label: str, diff: np.ndarray, canvas: Canvas) -> list[Region]:
    """The boxes of the pixels a finding changed: one per side of the patient (midline findings: one);
    none when the finding changed no pixel's grey value."""
    top = int(diff.max())
    if top == 0:
        return []
    mask = diff >= max(1.0, REGION_LEVEL * top)
    total = int(mask.sum())
    if label in MIDLINE_FINDINGS:
        return [_box(label, mask)]
    right = canvas.X < 0                  # the patient's right is the image left (anatomy frame x < 0)
    sides = [mask & right, mask & ~right]
    return [_box(label, side) for side in sides if side.sum() >= MIN_SIDE_SHARE * total]


def _soft_tissue(canvas: Canvas) -> tuple[np.ndarray, np.ndarray]:
    """The trunk with heart and aortic knob (float image), and how much those hide the lungs."""
    geom, anatomy, X, Y, size = canvas.geom, canvas.geom.anatomy, canvas.X, canvas.Y, canvas.size

    # trunk: soft tissue, denser towards the abdomen; air outside is nearly black
    bx, by = X * f32(1 / 0.94), (Y - f32(0.12)) * f32(1 / 1.2)
    bx, by = bx * bx, by * by
    body = ramp(1 - bx * bx - by * by - f32(0.3) * bx, 0.1)   # squarish trunk with shoulders
    img = f32(0.05) + f32(anatomy.tissue) * body * (1 + f32(0.18) * ramp(Y - f32(0.25), 0.6))

    # heart and aortic knob: denser, and they hide the medial lung
    occlusion = np.zeros((size, size), np.float32)
    win = canvas.box(geom.heart_dx, geom.heart_cy, geom.heart_w, geom.heart_h)
    occlusion[win] = canvas.disc(win, geom.heart_dx, geom.heart_cy, geom.heart_w, geom.heart_h, sharp=3.0)
    knob_x, knob_y = anatomy.gap + 0.01, geom.lung_cy - 0.22
    win = canvas.box(knob_x, knob_y, 0.05, 0.075)
    occlusion[win] = np.maximum(occlusion[win], canvas.disc(win, knob_x, knob_y, 0.05, 0.075, sharp=2.0))
    img += f32(0.05) * occlusion
    return img, occlusion


def _draw_lungs(img: np.ndarray, canvas: Canvas, occlusion: np.ndarray,
                vessel_grids: tuple[np.ndarray, np.ndarray]) -> None:
    """Darken the aerated lungs, minus vessel markings (ridges of two smooth noise fields, denser
    at the hila); what findings filled or the heart hides stays bright."""
    geom, anatomy, size = canvas.geom, canvas.geom.anatomy, canvas.size
    dark = f32(anatomy.lung_dark * geom.lung_darkness)
    mark = f32(anatomy.markings * geom.marking_gain)
    for side in (RIGHT, LEFT):
        win = canvas.lung_window[side]
        coarse = upsample(vessel_grids[0], size, win)
        fine = upsample(vessel_grids[1], size, win)
        ridge = np.maximum(ramp(1 - np.abs(coarse) * f32(4.2), 1.0), f32(0.6) * ramp(1 - np.abs(fine) * f32(4.9), 1.0))
        hx, hy = geom.hilum(side)
        hilar = canvas.gauss(win, hx, hy, 0.3, 0.38)
        vessels = ridge * (f32(0.35) + f32(0.65) * hilar) + f32(0.5) * hilar * hilar
        aerated = canvas.lung[side][win] * (1 - f32(0.92) * occlusion[win]) * (1 - np.clip(canvas.fill[win], 0.0, 1.0))
        img[win] -= aerated * (dark * canvas.dark_mult[win] - mark * canvas.mark_mult[win] * vessels)


def _draw_bones_and_airways(img: np.ndarray, canvas: Canvas) -> None:
    """Posterior and anterior ribs (periodic curved bands), clavicles, spine; trachea, gastric bubble."""
    geom, anatomy, X, Y = canvas.geom, canvas.geom.anatomy, canvas.X, canvas.Y
    half_w = anatomy.gap + 2 * max(geom.lung_w) + 0.05
    rib_y0, rib_y1 = geom.lung_cy - max(geom.lung_h) - 0.06, max(geom.diaphragm) + 0.35
    win = canvas.window(-half_w, half_w, rib_y0, rib_y1)
    Yw = Y[win]
    abs_x = np.abs(X[win])
    thorax = ramp(1 - canvas.ellipse(win, 0.0, geom.lung_cy + 0.02, half_w, max(geom.lung_h) + 0.06), 0.15) \
        * ramp(f32(max(geom.diaphragm) + 0.25) - Yw, 0.1)
    per_rib = f32(1 / geom.rib_spacing)
    phase = anatomy.rib_phase / (2 * np.pi)
    t_post = (Yw - f32(anatomy.rib_curve) * (f32(0.8) * abs_x * abs_x - f32(0.22) * abs_x)) * per_rib + f32(phase)
    t_ant = (Yw + f32(0.45) * abs_x - f32(0.15) * abs_x * abs_x) * per_rib + f32(phase + 0.27)
    posterior = f32(0.09) * ramp(triangle_wave(t_post) - f32(0.62), 0.25)
    ribs = posterior + f32(0.035) * ramp(triangle_wave(t_ant) - f32(0.7), 0.2)
    img[win] += f32(anatomy.bone) * ribs * thorax

    y0 = geom.lung_cy - geom.lung_h[0] + 0.02
    win = canvas.window(-0.75, 0.75, y0 - 0.2, y0 + 0.1)
    abs_x = np.abs(X[win])
    clavicle_y = f32(y0) - f32(0.28) * (abs_x - f32(0.08)) + f32(0.4) * (abs_x - f32(0.35)) ** 2
    clavicles = ramp(f32(0.035) - np.abs(Y[win] - clavicle_y), 0.015) * ramp(abs_x - f32(0.05), 0.04) \
        * ramp(f32(0.72) - abs_x, 0.05)
    img[win] += f32(0.11 * anatomy.bone) * clavicles

    win = canvas.window(-0.08, 0.08, -1.6, 1.6)
    spine = ramp(f32(0.06) - np.abs(X[win]), 0.015) * (f32(0.75) + f32(0.25) * triangle_wave(Y[win] * f32(1 / 0.12)))
    img[win] += f32(0.07 * anatomy.bone) * spine
    win = canvas.window(-0.05, 0.06, -1.6, geom.lung_cy - 0.09)
    trachea = ramp(f32(0.03) - np.abs(X[win] - f32(0.01)), 0.012) * ramp(f32(geom.lung_cy - 0.15) - Y[win], 0.06)
    img[win] -= f32(0.09) * trachea
    if anatomy.bubble > 0:
        bx, by = geom.lung_centre_x(LEFT) - 0.05, geom.diaphragm[LEFT] + geom.dome[LEFT] * 0.3 + 0.1
        win = canvas.box(bx, by, anatomy.bubble * 1.3, anatomy.bubble)
        img[win] -= f32(0.1) * canvas.disc(win, bx, by, anatomy.bubble * 1.3, anatomy.bubble, sharp=2.0)


def _expose(img: np.ndarray, noise: np.ndarray, noise_sigma: float,
            exposure: tuple[float, float, float]) -> np.ndarray:
    """Exposure (contrast, offset, gamma) and pixel noise; 8-bit grey."""
    contrast, offset, gamma = exposure
    img += f32(offset - 0.02)
    img *= f32(contrast)
    img += f32(noise_sigma) * noise
    np.clip(img, 0.0, 1.0, out=img)
    img **= f32(gamma)
    img *= f32(255)
    img += f32(0.5)
    return img.astype(np.uint8)
