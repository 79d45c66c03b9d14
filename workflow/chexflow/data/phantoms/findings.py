"""The 14 NIH findings as phantom signatures.

Each finding may (1) change the geometry before the anatomy is drawn and/or (2) draw into the
canvas layers. Every finding has its own RNG, so adding one finding never changes another's
appearance, nor the base image outside the finding's own footprint. ``state`` carries what a
finding's geometry step decided (e.g. the side) to its drawing step.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from chexflow.data import nih
from chexflow.data.phantoms.anatomy import LEFT, RIGHT, SIDE_SIGN, ImageGeometry
from chexflow.data.phantoms.canvas import Canvas, f32, ramp, triangle_wave, upsample


def _random_side(rng: np.random.Generator) -> int:
    return int(rng.integers(2))


def _geometry_atelectasis(geom: ImageGeometry, rng: np.random.Generator, state: dict) -> None:
    side = state["side"] = _random_side(rng)
    geom.diaphragm[side] -= rng.uniform(0.05, 0.11)              # volume loss: raised hemidiaphragm,
    geom.lung_h[side] *= rng.uniform(0.92, 0.97)                 # smaller lung,
    geom.heart_dx += SIDE_SIGN[side] * rng.uniform(0.01, 0.04)   # mediastinum pulled towards it


def _draw_atelectasis(canvas: Canvas, rng: np.random.Generator, state: dict) -> None:
    geom, side = canvas.geom, state["side"]
    if rng.uniform() < 0.5:   # plate-like (discoid) band in the lower zone
        x = geom.lung_centre_x(side) + rng.uniform(-0.35, 0.35) * geom.lung_w[side]
        y = geom.diaphragm[side] - rng.uniform(0.06, 0.2)
        rx, ry = rng.uniform(0.14, 0.24), rng.uniform(0.022, 0.035)
        win = canvas.box(x, y, rx, rx)
        band = canvas.rotated_disc(win, x, y, rx, ry, rng.uniform(-0.35, 0.35), sharp=2.5)
        canvas.fill[win] += f32(rng.uniform(0.65, 0.9)) * band
    else:                     # lobar collapse: dense wedge at the medial base
        x = geom.lung_centre_x(side) - SIDE_SIGN[side] * 0.55 * geom.lung_w[side]
        y = geom.diaphragm[side] - rng.uniform(0.0, 0.1)
        rx, ry = rng.uniform(0.1, 0.16), rng.uniform(0.2, 0.3)
        win = canvas.box(x, y, ry, ry)
        wedge = canvas.rotated_disc(win, x, y, rx, ry, SIDE_SIGN[side] * rng.uniform(0.2, 0.5), sharp=2.0)
        canvas.fill[win] += f32(rng.uniform(0.5, 0.75)) * wedge * canvas.lung[side][win]


def _geometry_cardiomegaly(geom: ImageGeometry, rng: np.random.Generator, state: dict) -> None:
    geom.heart_w *= rng.uniform(1.12, 1.36)
    geom.heart_h *= rng.uniform(1.03, 1.17)
    geom.heart_dx += rng.uniform(0.0, 0.04)


def _draw_effusion(canvas: Canvas, rng: np.random.Generator, state: dict) -> None:
    geom = canvas.geom
    sides = (RIGHT, LEFT) if rng.uniform() < 0.35 else (_random_side(rng),)
    for side in sides:
        height = 0.08 + 0.3 * rng.beta(1.5, 2.0)      # fluid column above the costophrenic angle
        level = geom.diaphragm[side] + 0.8 * geom.dome[side] - height
        meniscus = rng.uniform(0.06, 0.16)
        win = canvas.lung_window[side]
        lateral = ramp(canvas.lateral(win, side), 1.0)
        top = f32(level) - f32(meniscus) * lateral * lateral
        density = f32(rng.uniform(0.75, 1.0))
        canvas.fill[win] += density * ramp(canvas.Y[win] - top, 0.06) * canvas.lung[side][win]


def _draw_infiltration(canvas: Canvas, rng: np.random.Generator, state: dict) -> None:
    geom = canvas.geom
    sides = (RIGHT, LEFT) if rng.uniform() < 0.35 else (_random_side(rng),)
    amp, bias = f32(rng.uniform(0.3, 0.5)), f32(rng.uniform(0.35, 0.7))
    for side in sides:
        x, y = geom.point_in_lung(rng, side, radius=0.6)
        sx, sy = rng.uniform(0.13, 0.2), rng.uniform(0.16, 0.26)
        win = canvas.box(x, y, 2.5 * sx, 2.5 * sy)
        patches = ramp(canvas.smooth_noise(rng, 9, win) + bias, 1.2)
        canvas.fill[win] += amp * patches * canvas.gauss(win, x, y, sx, sy)


def _draw_mass(canvas: Canvas, rng: np.random.Generator, state: dict) -> None:
    side = _random_side(rng)
    x, y = canvas.geom.point_in_lung(rng, side, radius=0.65)
    r = rng.uniform(0.07, 0.12)
    ry = r * rng.uniform(0.85, 1.15)
    ang = rng.uniform(0, 2 * np.pi)                     # lobulation: a satellite lobe
    x2, y2 = x + 0.6 * r * np.cos(ang), y + 0.6 * r * np.sin(ang)
    win = canvas.box(x, y, 1.8 * r, 1.8 * r)
    main = canvas.disc(win, x, y, r, ry, sharp=3.0)
    blob = np.maximum(main, canvas.disc(win, x2, y2, 0.6 * r, 0.6 * r, sharp=3.0))
    canvas.fill[win] += f32(rng.uniform(0.45, 0.8)) * blob


def _draw_nodule(canvas: Canvas, rng: np.random.Generator, state: dict) -> None:
    n = 1 if rng.uniform() < 0.75 else 2
    for _ in range(n):
        side = _random_side(rng)
        x, y = canvas.geom.point_in_lung(rng, side, radius=0.7)
        r = rng.uniform(0.035, 0.055)
        win = canvas.box(x, y, r, r)
        blob = canvas.disc(win, x, y, r, r, sharp=2.5)
        canvas.fill[win] += f32(rng.uniform(0.7, 1.0)) * blob
        canvas.extra[win] += f32(rng.uniform(0.0, 0.05)) * blob


def _draw_pneumonia(canvas: Canvas, rng: np.random.Generator, state: dict) -> None:
    geom = canvas.geom
    side = _random_side(rng)
    x, y = geom.point_in_lung(rng, side, zone="lower" if rng.uniform() < 0.6 else "any", radius=0.5)
    rx, ry = rng.uniform(0.14, 0.22), rng.uniform(0.14, 0.24)
    win = canvas.box(x, y, rx, ry)
    texture = 0.75 + 0.25 * ramp(canvas.smooth_noise(rng, 7, win) + 1, 2.0)
    region = canvas.disc(win, x, y, rx, ry, sharp=1.3) * texture
    hx, hy = geom.hilum(side)    # air bronchograms: dark tubes radiating from the hilum
    theta = np.arctan2(canvas.Y[win] - f32(hy), canvas.X[win] - f32(hx))
    n_tubes, phase = rng.uniform(18, 28), rng.uniform(0, 1)
    tubes = ramp(triangle_wave(theta * f32(n_tubes / (2 * np.pi)) + f32(phase)) - f32(0.8), 0.2)
    inner = ramp(region - 0.5, 0.3)
    canvas.fill[win] += f32(rng.uniform(0.5, 0.8)) * region - f32(0.45) * tubes * inner


def _geometry_pneumothorax(geom: ImageGeometry, rng: np.random.Generator, state: dict) -> None:
    state["side"] = _random_side(rng)


def _draw_pneumothorax(canvas: Canvas, rng: np.random.Generator, state: dict) -> None:
    geom, side = canvas.geom, state["side"]
    k = rng.uniform(0.8, 0.95)                          # collapsed lung size
    apical = rng.uniform() < 0.5
    cx = geom.lung_centre_x(side) - SIDE_SIGN[side] * (1 - k) * geom.lung_w[side] * (0.3 if apical else 0.9)
    cy = geom.lung_cy + (1 - k) * geom.lung_h[side] * (1.0 if apical else 0.3)
    win = canvas.lung_window[side]
    e = canvas.ellipse(win, cx, cy, k * geom.lung_w[side], (k + (1 - k) * 0.4) * geom.lung_h[side])
    lung = canvas.lung[side][win]
    gas = ramp(e - 1, 0.08) * lung                     # pleural air: no markings, darker
    canvas.dark_mult[win] += f32(rng.uniform(0.1, 0.3)) * gas
    canvas.mark_mult[win] *= 1 - f32(0.85) * gas
    line = ramp(f32(0.12) - np.abs(e - 1), 0.06) * lung  # visceral pleural line
    canvas.extra[win] += f32(rng.uniform(0.04, 0.1)) * line


def _draw_consolidation(canvas: Canvas, rng: np.random.Generator, state: dict) -> None:
    geom = canvas.geom
    side = _random_side(rng)
    upper = rng.uniform() < 0.4
    x, y = geom.point_in_lung(rng, side, zone="upper" if upper else "lower", radius=0.55)
    tilt = rng.uniform(-0.15, 0.15)
    rx, ry = rng.uniform(0.17, 0.28), rng.uniform(0.2, 0.32)
    win = canvas.box(x, y, rx, ry)
    fissure = f32(y + (0.12 if upper else -0.12)) + f32(tilt) * canvas.X[win]
    lobe = ramp(fissure - canvas.Y[win], 0.03) if upper else ramp(canvas.Y[win] - fissure, 0.03)
    region = canvas.disc(win, x, y, rx, ry, sharp=2.5) * lobe * canvas.lung[side][win]
    canvas.fill[win] += f32(rng.uniform(0.5, 0.85)) * region


def _draw_edema(canvas: Canvas, rng: np.random.Generator, state: dict) -> None:
    geom = canvas.geom
    amp = f32(rng.uniform(0.12, 0.32))
    sx, sy = rng.uniform(0.15, 0.22), rng.uniform(0.2, 0.28)
    for side in (RIGHT, LEFT):                       # bilateral perihilar "bat wing"
        hx, hy = geom.hilum(side)
        win = canvas.box(hx, hy, 4 * sx, 4 * sy)
        haze = canvas.gauss(win, hx + SIDE_SIGN[side] * 0.04, hy, sx, sy)
        canvas.fill[win] += amp * haze
        canvas.mark_mult[win] += f32(0.4) * haze     # interstitial thickening


def _geometry_emphysema(geom: ImageGeometry, rng: np.random.Generator, state: dict) -> None:
    f = rng.uniform(1.02, 1.08)
    geom.lung_h = [h * f for h in geom.lung_h]
    geom.lung_cy += 0.02
    low = rng.uniform(0.02, 0.08)
    geom.diaphragm = [d + low for d in geom.diaphragm]   # low, flattened diaphragm
    geom.dome = [d * rng.uniform(0.45, 0.8) for d in geom.dome]
    geom.heart_w *= rng.uniform(0.85, 0.95)              # narrow, vertical heart
    geom.rib_spacing *= 1.04
    geom.lung_darkness *= rng.uniform(1.06, 1.18)        # hyperlucent
    geom.marking_gain *= rng.uniform(0.5, 0.8)           # pruned vessels


def _geometry_fibrosis(geom: ImageGeometry, rng: np.random.Generator, state: dict) -> None:
    geom.lung_h = [h * 0.96 for h in geom.lung_h]
    geom.diaphragm = [d - 0.02 for d in geom.diaphragm]


def _draw_fibrosis(canvas: Canvas, rng: np.random.Generator, state: dict) -> None:
    geom = canvas.geom
    period = rng.uniform(0.09, 0.12)
    angles = rng.uniform(0.2, 0.7), rng.uniform(-0.7, -0.2)
    amp = f32(rng.uniform(0.45, 0.7))
    noise = rng.standard_normal((10, 10), dtype=np.float32)
    for side in (RIGHT, LEFT):
        win = canvas.lung_window[side]
        X, Y = canvas.X[win], canvas.Y[win]
        warp = upsample(noise, canvas.size, win) * f32(0.18)
        net = None
        for ang in angles:
            proj = (X * f32(np.cos(ang)) + Y * f32(np.sin(ang))) * f32(1 / period) + warp
            lines = ramp(triangle_wave(proj) - f32(0.72), 0.28)
            net = lines if net is None else np.maximum(net, lines)
        basal = ramp(Y - f32(geom.lung_cy + 0.05), 0.4)
        canvas.fill[win] += amp * net * basal * canvas.lung[side][win]


def _draw_pleural_thickening(canvas: Canvas, rng: np.random.Generator, state: dict) -> None:
    geom = canvas.geom
    sides = (RIGHT, LEFT) if rng.uniform() < 0.3 else (_random_side(rng),)
    for side in sides:
        t = rng.uniform(0.3, 0.45)                       # thickness in ellipse units
        lateral = rng.uniform() < 0.7
        amp, dense = f32(rng.uniform(0.7, 0.95)), f32(rng.uniform(0.04, 0.08))
        win = canvas.lung_window[side]
        lumpy = canvas.smooth_noise(rng, 14, win) * f32(0.12)  # irregular inner margin
        rim = ramp(canvas.lung_ellipse[side][win] - f32(1 - t) + lumpy, 0.06) * canvas.lung[side][win]
        if lateral:                                      # lateral chest wall
            where = ramp(canvas.lateral(win, side) - f32(0.1), 0.3)
        else:                                            # apical cap
            where = ramp(f32(geom.lung_cy - 0.45 * geom.lung_h[side]) - canvas.Y[win], 0.1)
        canvas.fill[win] += amp * rim * where
        canvas.extra[win] += dense * rim * where         # denser than the chest wall


def _draw_hernia(canvas: Canvas, rng: np.random.Generator, state: dict) -> None:
    geom = canvas.geom
    r = rng.uniform(0.09, 0.14)
    cx = geom.heart_dx * rng.uniform(0.0, 0.6)
    cy = geom.diaphragm[LEFT] - r * rng.uniform(0.4, 0.9)
    level = f32(cy + rng.uniform(-0.2, 0.3) * r)         # air-fluid level
    gas_amp = f32(rng.uniform(0.12, 0.2))
    win = canvas.box(cx, cy, 1.5 * r, 1.4 * r)
    e = canvas.ellipse(win, cx, cy, r * 1.15, r)
    body = ramp(1 - e, 0.15)
    gas = body * ramp(level - canvas.Y[win], 0.01)
    rim = ramp(f32(0.2) - np.abs(e - 1), 0.1)
    canvas.extra[win] += f32(0.05) * rim - gas_amp * gas + f32(0.03) * (body - gas)


class Finding(NamedTuple):
    """How a finding shows: a change of the geometry, a drawing into the canvas (either may be None)."""
    geometry: Callable[[ImageGeometry, np.random.Generator, dict], None] | None
    draw: Callable[[Canvas, np.random.Generator, dict], None] | None


FINDINGS: dict[str, Finding] = {
    "Atelectasis": Finding(_geometry_atelectasis, _draw_atelectasis),
    "Cardiomegaly": Finding(_geometry_cardiomegaly, None),
    "Effusion": Finding(None, _draw_effusion),
    "Infiltration": Finding(None, _draw_infiltration),
    "Mass": Finding(None, _draw_mass),
    "Nodule": Finding(None, _draw_nodule),
    "Pneumonia": Finding(None, _draw_pneumonia),
    "Pneumothorax": Finding(_geometry_pneumothorax, _draw_pneumothorax),
    "Consolidation": Finding(None, _draw_consolidation),
    "Edema": Finding(None, _draw_edema),
    "Emphysema": Finding(_geometry_emphysema, None),
    "Fibrosis": Finding(_geometry_fibrosis, _draw_fibrosis),
    "Pleural_Thickening": Finding(None, _draw_pleural_thickening),
    "Hernia": Finding(None, _draw_hernia),
}
assert tuple(FINDINGS) == nih.LABELS

