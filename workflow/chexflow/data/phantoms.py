"""The "mini-NIH" demo release: synthetic chest-radiograph phantoms in the NIH ChestX-ray14 layout.

``make_release`` samples whole patients (with their real label rows) from the NIH label file
shipped with torchxrayvision, renders one grey phantom radiograph per row whose 14 findings
follow that row's labels, and writes the release exactly as NIH publishes it
(``images_NNN.tar.gz`` holding ``images/<Image Index>``, ``Data_Entry_2017_v2020.csv``,
``train_val_list.txt``, ``test_list.txt``) plus ``release.json`` and ``SHA256SUMS`` (written
last: the directory is complete only once it exists). Everything is deterministic in ``seed``:
the same arguments give byte-identical files.

The phantoms are NOT radiographs. They carry real co-occurrence and prevalence of the labels
(because the rows are real) and a visual signature per finding of moderate strength, so that
a small CNN learns them to a mean AUROC between chance and perfect (measured: a 4-block CNN,
~100k parameters, 7 epochs on 4,500 training images at 64 px, reached a held-out mean of 0.90,
per label from 0.74 Infiltration to 0.97 Consolidation/Edema; a logistic regression on 16x16
pixels reaches 0.70, see tests/test_phantoms.py). Nodules are ~1 px wide below 64 px. Anatomy (thorax size,
heart, lungs, ribs, exposure) is drawn per patient, so follow-up images of one patient look
alike -- which is why splits must be patient-wise, as for the real data.

Geometry is drawn in a normalised "anatomy frame": x from -1 (image left = patient's right in a
PA view) to 1, y from -1 (top) to 1 (bottom), rotated/shifted/scaled per image.
"""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import math
import os
import tarfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

from chexflow.data import nih

GENERATOR = "chexflow.data.phantoms"
GENERATOR_VERSION = "1"
RIGHT, LEFT = 0, 1          # patient's right lung is on the image left (x < 0)
_SIDE_SIGN = (-1.0, 1.0)    # direction of "lateral" for each side
# RNG streams of make_release (numpy SeedSequence entropy [seed, stream, ...])
_STREAM_PATIENTS, _STREAM_ANATOMY, _STREAM_IMAGE, _STREAM_SPLIT = 0, 1, 2, 3


class ReleaseError(ValueError):
    """make_release was given impossible arguments; the message says which."""


# --------------------------------------------------------------------------- anatomy

@dataclass(frozen=True)
class Anatomy:
    """Per-patient geometry and appearance (anatomy-frame units, brightness in 0..1)."""
    shift_x: float = 0.0
    shift_y: float = 0.0
    scale: float = 1.0
    angle: float = 0.0           # radians
    lung_w: float = 0.31         # half-width of the right lung; the left one is a bit narrower
    lung_h: float = 0.62         # lung half-height
    lung_cy: float = -0.12       # lung centre y
    gap: float = 0.07            # half-width of the mediastinum between the lungs
    dia_r: float = 0.27          # top of the right hemidiaphragm dome (y)
    dia_l: float = 0.32          # top of the left one (lower)
    dome: float = 0.2            # dome height: lateral costophrenic angle = dia + dome
    heart_w: float = 0.27        # half-width of the heart shadow
    heart_h: float = 0.22
    heart_dx: float = 0.09       # heart centre x (towards the patient's left)
    heart_cy: float = 0.25
    rib_spacing: float = 0.165
    rib_phase: float = 0.0
    rib_curve: float = 1.0
    tissue: float = 0.56         # soft-tissue brightness
    lung_dark: float = 0.30      # how much aerated lung darkens the tissue
    markings: float = 0.11       # vessel (lung marking) brightness
    bone: float = 1.0
    bubble: float = 0.0          # gastric air bubble radius (0: none)


def sample_anatomy(rng: np.random.Generator) -> Anatomy:
    """Draw one patient's anatomy."""
    u = rng.uniform
    return Anatomy(
        shift_x=u(-0.05, 0.05), shift_y=u(-0.05, 0.06), scale=u(0.9, 1.06), angle=np.deg2rad(u(-3.0, 3.0)),
        lung_w=u(0.28, 0.34), lung_h=u(0.57, 0.66), lung_cy=u(-0.16, -0.08), gap=u(0.05, 0.09),
        dia_r=u(0.22, 0.31), dia_l=u(0.28, 0.36), dome=u(0.15, 0.24),
        heart_w=u(0.24, 0.30), heart_h=u(0.19, 0.24), heart_dx=u(0.08, 0.13), heart_cy=u(0.1, 0.17),
        rib_spacing=u(0.15, 0.18), rib_phase=u(0, 2 * np.pi), rib_curve=u(0.8, 1.2),
        tissue=u(0.5, 0.62), lung_dark=u(0.26, 0.34), markings=u(0.08, 0.13), bone=u(0.8, 1.2),
        bubble=u(0.05, 0.09) if u() < 0.6 else 0.0,
    )


@dataclass
class _Geom:
    """Per-image geometry (mutable while findings adjust it; scalars only)."""
    a: Anatomy
    lung_w: list[float]
    lung_h: list[float]
    lung_cy: float
    dia: list[float]
    dome: list[float]
    heart_w: float
    heart_h: float
    heart_dx: float
    heart_cy: float
    rib_spacing: float
    dark: float = 1.0        # global lung darkness multiplier (emphysema > 1)
    mark: float = 1.0        # global marking multiplier

    def xc(self, s: int) -> float:
        """Lung centre x of side s."""
        return _SIDE_SIGN[s] * (self.a.gap + self.lung_w[s])

    def dia_x_peak(self, s: int) -> float:
        return self.xc(s) - _SIDE_SIGN[s] * 0.15 * self.lung_w[s]

    def hilum(self, s: int) -> tuple[float, float]:
        return _SIDE_SIGN[s] * (self.a.gap + 0.55 * self.lung_w[s]), self.lung_cy + 0.12

    def point_in_lung(self, rng: np.random.Generator, s: int, *, zone: str = "any",
                      radius: float = 0.75) -> tuple[float, float]:
        """A random point well inside lung s ('upper'/'lower'/'any' zone)."""
        for _ in range(200):
            a, b = rng.uniform(-1, 1, size=2)
            if a * a + b * b > radius * radius:
                continue
            if zone == "upper" and b > 0.1:
                continue
            if zone == "lower" and b < -0.1:
                continue
            x = self.xc(s) + a * self.lung_w[s]
            y = self.lung_cy + b * self.lung_h[s]
            if y < self._dia_at(s, x) - 0.06:
                return float(x), float(y)
        return self.xc(s), self.lung_cy  # pragma: no cover - practically unreachable

    def _dia_at(self, s: int, x: float) -> float:
        return self.dia[s] + self.dome[s] * ((x - self.dia_x_peak(s)) / self.lung_w[s]) ** 2


def _geom(a: Anatomy, rng: np.random.Generator) -> _Geom:
    insp = rng.uniform(0.96, 1.04)          # depth of inspiration of this exposure
    ddia = rng.uniform(-0.03, 0.03)
    return _Geom(a=a, lung_w=[a.lung_w, a.lung_w * 0.93], lung_h=[a.lung_h * insp, a.lung_h * insp * 0.98],
                 lung_cy=a.lung_cy, dia=[a.dia_r + ddia, a.dia_l + ddia], dome=[a.dome, a.dome * 0.95],
                 heart_w=a.heart_w, heart_h=a.heart_h, heart_dx=a.heart_dx, heart_cy=a.heart_cy,
                 rib_spacing=a.rib_spacing)


# --------------------------------------------------------------------------- canvas
# Speed: every shape is evaluated only inside its bounding window (``_Canvas.window``), Gaussians
# use a polynomial approximation, periodic bands use triangle waves, and pixel noise is a random
# window of a fixed noise bank -- transcendental ufuncs and fresh Gaussian noise cost more than all
# the rest at 128 px.

Win = tuple[slice, slice]
_F = np.float32


@lru_cache(maxsize=64)
def _interp_index(n_in: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Linear interpolation of an n_in grid onto size pixels: (lower index, weight of upper)."""
    pos = (np.arange(size) + 0.5) / size * (n_in - 1)
    lo = np.clip(np.floor(pos).astype(np.intp), 0, n_in - 2)
    frac = (pos - lo).astype(np.float32)
    lo.setflags(write=False)
    frac.setflags(write=False)
    return lo, frac


def _upsample(grid: np.ndarray, size: int, win: Win) -> np.ndarray:
    """Bilinear upsampling of a coarse n x n grid to size x size, evaluated on ``win``.

    Gather + blend instead of interpolation-matrix products: BLAS would start threads for these
    tiny products, which costs far more than it saves (and oversubscribes a loaded machine).
    """
    lo, fr = _interp_index(grid.shape[0], size)
    lc, fr_c = lo[win[1]], fr[win[1]]
    cols = grid[:, lc] * (1 - fr_c) + grid[:, lc + 1] * fr_c      # (n, w): small
    lr, fr_r = lo[win[0]], fr[win[0]][:, None]
    up = cols[lr]                                                 # whole-row gathers: cheap
    up += (cols[lr + 1] - up) * fr_r
    return up


@lru_cache(maxsize=1)
def _noise_bank() -> np.ndarray:
    """A fixed 1024x1024 standard-normal field; images take random windows of it as pixel noise."""
    bank = np.random.default_rng(20170101).standard_normal((1024, 1024), dtype=np.float32)
    bank.setflags(write=False)
    return bank


def _pixel_noise(rng: np.random.Generator, size: int) -> np.ndarray:
    bank = _noise_bank()
    if size > bank.shape[0]:
        return rng.standard_normal((size, size), dtype=np.float32)
    r, c = rng.integers(0, bank.shape[0] - size + 1, size=2)
    flip = int(rng.integers(4))
    win = bank[r:r + size, c:c + size]
    return win[::-1] if flip & 1 else win.T if flip & 2 else win


def _ramp(v: np.ndarray, width: float) -> np.ndarray:
    """0 for v <= 0, 1 for v >= width, linear in between."""
    return np.clip(v * _F(1.0 / width), 0.0, 1.0)


def _gauss_of(e: np.ndarray) -> np.ndarray:
    """~exp(-e/2) for a squared normalised distance e (polynomial; exact 0 beyond e = 16)."""
    q = np.clip(1 - e * _F(1 / 16), 0.0, 1.0)
    q *= q
    q *= q
    q *= q
    return q


def _tri(phase: np.ndarray) -> np.ndarray:
    """Triangle wave with period 1: 1 at integers, 0 at half-integers (a cheap cosine)."""
    return np.abs(_F(2) * (phase - np.floor(phase)) - _F(1))


class _Canvas:
    """Coordinates, anatomy masks and the layers findings draw into."""

    def __init__(self, g: _Geom, size: int, jitter: tuple[float, float, float, float]):
        a = g.a
        self.g, self.size = g, size
        lin = (np.arange(size, dtype=np.float32) + 0.5) * _F(2 / size) - 1
        sx, sy, dang, dscale = jitter
        ang = a.angle + dang
        self._c, self._s = float(np.cos(ang)), float(np.sin(ang))
        self._scale = float(a.scale * dscale)
        self._sh = (float(a.shift_x + sx), float(a.shift_y + sy))
        c, s, inv = _F(self._c), _F(self._s), _F(1 / self._scale)
        u = (lin[None, :] - _F(self._sh[0])) * inv
        v = (lin[:, None] - _F(self._sh[1])) * inv
        self.X = c * u + s * v
        self.Y = c * v - s * u
        shape = (size, size)
        self.fill = np.zeros(shape, np.float32)      # 0 aerated .. 1 opaque (counts inside lungs)
        self.extra = np.zeros(shape, np.float32)     # additive brightness
        self.dark_mult = np.ones(shape, np.float32)  # lung darkness multiplier
        self.mark_mult = np.ones(shape, np.float32)  # lung-marking multiplier
        self.lung: list[np.ndarray] = []             # soft lung masks (full size, 0 outside)
        self.ell: list[np.ndarray] = []              # lung ellipse value (4 outside the lung window)
        self.lwin: list[Win] = []
        for side in (RIGHT, LEFT):
            xc, w, h = g.xc(side), g.lung_w[side], g.lung_h[side]
            win = self.window(xc - w - 0.02, xc + w + 0.02, g.lung_cy - h - 0.02, g.lung_cy + h + 0.02)
            X, Y = self.X[win], self.Y[win]
            e = self.ellipse(win, xc, g.lung_cy, w, h)
            dx = (X - _F(g.dia_x_peak(side))) * _F(1.0 / w)
            dia = _F(g.dia[side]) + _F(g.dome[side]) * dx * dx
            mask = np.zeros(shape, np.float32)
            mask[win] = _ramp(1 - e, 0.18) * _ramp(dia - Y, 0.025)
            ell = np.full(shape, 4.0, np.float32)
            ell[win] = e
            self.lung.append(mask)
            self.ell.append(ell)
            self.lwin.append(win)
        self.full: Win = (slice(0, size), slice(0, size))

    def window(self, x0: float, x1: float, y0: float, y1: float) -> Win:
        """Pixel rows/cols covering the anatomy-frame box [x0, x1] x [y0, y1] (plus a margin)."""
        sc, c, s = self._scale, self._c, self._s
        half, n = self.size / 2, self.size
        cols = [(sc * (c * x - s * y) + self._sh[0] + 1) * half - 0.5 for x in (x0, x1) for y in (y0, y1)]
        rows = [(sc * (s * x + c * y) + self._sh[1] + 1) * half - 0.5 for x in (x0, x1) for y in (y0, y1)]
        r0 = min(max(math.floor(min(rows)) - 1, 0), n)
        r1 = min(max(math.ceil(max(rows)) + 2, 0), n)
        c0 = min(max(math.floor(min(cols)) - 1, 0), n)
        c1 = min(max(math.ceil(max(cols)) + 2, 0), n)
        return slice(r0, max(r0, r1)), slice(c0, max(c0, c1))

    def box(self, cx: float, cy: float, rx: float, ry: float) -> Win:
        return self.window(cx - rx, cx + rx, cy - ry, cy + ry)

    def ellipse(self, win: Win, cx: float, cy: float, rx: float, ry: float) -> np.ndarray:
        dx = (self.X[win] - _F(cx)) * _F(1.0 / rx)
        dy = (self.Y[win] - _F(cy)) * _F(1.0 / ry)
        return dx * dx + dy * dy

    def disc(self, win: Win, cx: float, cy: float, rx: float, ry: float, sharp: float = 4.0) -> np.ndarray:
        return np.clip((1 - self.ellipse(win, cx, cy, rx, ry)) * _F(sharp), 0.0, 1.0)

    def gauss(self, win: Win, cx: float, cy: float, sx: float, sy: float) -> np.ndarray:
        return _gauss_of(self.ellipse(win, cx, cy, sx, sy))

    def rotated_disc(self, win: Win, cx: float, cy: float, rx: float, ry: float, angle: float,
                     sharp: float = 3.0) -> np.ndarray:
        c, s = _F(np.cos(angle)), _F(np.sin(angle))
        dx, dy = self.X[win] - _F(cx), self.Y[win] - _F(cy)
        p = (c * dx + s * dy) * _F(1.0 / rx)
        q = (c * dy - s * dx) * _F(1.0 / ry)
        return np.clip((1 - p * p - q * q) * _F(sharp), 0.0, 1.0)

    def smooth_noise(self, rng: np.random.Generator, n: int, win: Win) -> np.ndarray:
        """Smooth random field (~unit variance) from an n x n grid, evaluated on ``win``."""
        return _upsample(rng.standard_normal((n, n), dtype=np.float32), self.size, win) * _F(1.4)


# --------------------------------------------------------------------------- findings
# Each finding may (1) change the geometry before the anatomy is drawn and/or (2) draw into the
# canvas layers. Every finding has its own RNG, so adding one finding never changes another's
# appearance, nor the base image outside the finding's own footprint.

def _side(rng: np.random.Generator) -> int:
    return int(rng.integers(2))


def _geo_atelectasis(g: _Geom, rng: np.random.Generator, st: dict) -> None:
    s = st["side"] = _side(rng)
    g.dia[s] -= rng.uniform(0.05, 0.11)                     # volume loss: raised hemidiaphragm,
    g.lung_h[s] *= rng.uniform(0.92, 0.97)                  # smaller lung,
    g.heart_dx += _SIDE_SIGN[s] * rng.uniform(0.01, 0.04)   # mediastinum pulled towards it


def _draw_atelectasis(cv: _Canvas, rng: np.random.Generator, st: dict) -> None:
    g, s = cv.g, st["side"]
    if rng.uniform() < 0.5:   # plate-like (discoid) band in the lower zone
        x = g.xc(s) + rng.uniform(-0.35, 0.35) * g.lung_w[s]
        y = g.dia[s] - rng.uniform(0.06, 0.2)
        rx, ry = rng.uniform(0.14, 0.24), rng.uniform(0.022, 0.035)
        win = cv.box(x, y, rx, rx)
        band = cv.rotated_disc(win, x, y, rx, ry, rng.uniform(-0.35, 0.35), sharp=2.5)
        cv.fill[win] += _F(rng.uniform(0.65, 0.9)) * band
    else:                     # lobar collapse: dense wedge at the medial base
        x = g.xc(s) - _SIDE_SIGN[s] * 0.55 * g.lung_w[s]
        y = g.dia[s] - rng.uniform(0.0, 0.1)
        rx, ry = rng.uniform(0.1, 0.16), rng.uniform(0.2, 0.3)
        win = cv.box(x, y, ry, ry)
        wedge = cv.rotated_disc(win, x, y, rx, ry, _SIDE_SIGN[s] * rng.uniform(0.2, 0.5), sharp=2.0)
        cv.fill[win] += _F(rng.uniform(0.5, 0.75)) * wedge * cv.lung[s][win]


def _geo_cardiomegaly(g: _Geom, rng: np.random.Generator, st: dict) -> None:
    g.heart_w *= rng.uniform(1.12, 1.36)
    g.heart_h *= rng.uniform(1.03, 1.17)
    g.heart_dx += rng.uniform(0.0, 0.04)


def _draw_effusion(cv: _Canvas, rng: np.random.Generator, st: dict) -> None:
    g = cv.g
    sides = (RIGHT, LEFT) if rng.uniform() < 0.35 else (_side(rng),)
    for s in sides:
        height = 0.08 + 0.3 * rng.beta(1.5, 2.0)      # fluid column above the costophrenic angle
        level = g.dia[s] + 0.8 * g.dome[s] - height
        menisc = rng.uniform(0.06, 0.16)
        win = cv.lwin[s]
        lat = _ramp((cv.X[win] - _F(g.xc(s))) * _F(_SIDE_SIGN[s] / g.lung_w[s]), 1.0)
        top = _F(level) - _F(menisc) * lat * lat
        cv.fill[win] += _F(rng.uniform(0.75, 1.0)) * _ramp(cv.Y[win] - top, 0.06) * cv.lung[s][win]


def _draw_infiltration(cv: _Canvas, rng: np.random.Generator, st: dict) -> None:
    g = cv.g
    sides = (RIGHT, LEFT) if rng.uniform() < 0.35 else (_side(rng),)
    amp, bias = _F(rng.uniform(0.3, 0.5)), _F(rng.uniform(0.35, 0.7))
    for s in sides:
        x, y = g.point_in_lung(rng, s, radius=0.6)
        sx, sy = rng.uniform(0.13, 0.2), rng.uniform(0.16, 0.26)
        win = cv.box(x, y, 2.5 * sx, 2.5 * sy)
        patches = _ramp(cv.smooth_noise(rng, 9, win) + bias, 1.2)
        cv.fill[win] += amp * patches * cv.gauss(win, x, y, sx, sy)


def _draw_mass(cv: _Canvas, rng: np.random.Generator, st: dict) -> None:
    s = _side(rng)
    x, y = cv.g.point_in_lung(rng, s, radius=0.65)
    r = rng.uniform(0.07, 0.12)
    ry = r * rng.uniform(0.85, 1.15)
    ang = rng.uniform(0, 2 * np.pi)                     # lobulation: a satellite lobe
    x2, y2 = x + 0.6 * r * np.cos(ang), y + 0.6 * r * np.sin(ang)
    win = cv.box(x, y, 1.8 * r, 1.8 * r)
    blob = np.maximum(cv.disc(win, x, y, r, ry, sharp=3.0), cv.disc(win, x2, y2, 0.6 * r, 0.6 * r, sharp=3.0))
    cv.fill[win] += _F(rng.uniform(0.45, 0.8)) * blob


def _draw_nodule(cv: _Canvas, rng: np.random.Generator, st: dict) -> None:
    n = 1 if rng.uniform() < 0.75 else 2
    for _ in range(n):
        s = _side(rng)
        x, y = cv.g.point_in_lung(rng, s, radius=0.7)
        r = rng.uniform(0.035, 0.055)
        win = cv.box(x, y, r, r)
        blob = cv.disc(win, x, y, r, r, sharp=2.5)
        cv.fill[win] += _F(rng.uniform(0.7, 1.0)) * blob
        cv.extra[win] += _F(rng.uniform(0.0, 0.05)) * blob


def _draw_pneumonia(cv: _Canvas, rng: np.random.Generator, st: dict) -> None:
    g = cv.g
    s = _side(rng)
    x, y = g.point_in_lung(rng, s, zone="lower" if rng.uniform() < 0.6 else "any", radius=0.5)
    rx, ry = rng.uniform(0.14, 0.22), rng.uniform(0.14, 0.24)
    win = cv.box(x, y, rx, ry)
    region = cv.disc(win, x, y, rx, ry, sharp=1.3) * (0.75 + 0.25 * _ramp(cv.smooth_noise(rng, 7, win) + 1, 2.0))
    hx, hy = g.hilum(s)     # air bronchograms: dark tubes radiating from the hilum
    theta = np.arctan2(cv.Y[win] - _F(hy), cv.X[win] - _F(hx))
    n_tubes, phase = rng.uniform(18, 28), rng.uniform(0, 1)
    tubes = _ramp(_tri(theta * _F(n_tubes / (2 * np.pi)) + _F(phase)) - _F(0.8), 0.2)
    inner = _ramp(region - 0.5, 0.3)
    cv.fill[win] += _F(rng.uniform(0.5, 0.8)) * region - _F(0.45) * tubes * inner


def _geo_pneumothorax(g: _Geom, rng: np.random.Generator, st: dict) -> None:
    st["side"] = _side(rng)


def _draw_pneumothorax(cv: _Canvas, rng: np.random.Generator, st: dict) -> None:
    g, s = cv.g, st["side"]
    k = rng.uniform(0.8, 0.95)                          # collapsed lung size
    apical = rng.uniform() < 0.5
    cx = g.xc(s) - _SIDE_SIGN[s] * (1 - k) * g.lung_w[s] * (0.3 if apical else 0.9)
    cy = g.lung_cy + (1 - k) * g.lung_h[s] * (1.0 if apical else 0.3)
    win = cv.lwin[s]
    e = cv.ellipse(win, cx, cy, k * g.lung_w[s], (k + (1 - k) * 0.4) * g.lung_h[s])
    lung = cv.lung[s][win]
    gas = _ramp(e - 1, 0.08) * lung                     # pleural air: no markings, darker
    cv.dark_mult[win] += _F(rng.uniform(0.1, 0.3)) * gas
    cv.mark_mult[win] *= 1 - _F(0.85) * gas
    line = _ramp(_F(0.12) - np.abs(e - 1), 0.06) * lung  # visceral pleural line
    cv.extra[win] += _F(rng.uniform(0.04, 0.1)) * line


def _draw_consolidation(cv: _Canvas, rng: np.random.Generator, st: dict) -> None:
    g = cv.g
    s = _side(rng)
    upper = rng.uniform() < 0.4
    x, y = g.point_in_lung(rng, s, zone="upper" if upper else "lower", radius=0.55)
    tilt = rng.uniform(-0.15, 0.15)
    rx, ry = rng.uniform(0.17, 0.28), rng.uniform(0.2, 0.32)
    win = cv.box(x, y, rx, ry)
    fissure = _F(y + (0.12 if upper else -0.12)) + _F(tilt) * cv.X[win]
    lobe = _ramp(fissure - cv.Y[win], 0.03) if upper else _ramp(cv.Y[win] - fissure, 0.03)
    region = cv.disc(win, x, y, rx, ry, sharp=2.5) * lobe * cv.lung[s][win]
    cv.fill[win] += _F(rng.uniform(0.5, 0.85)) * region


def _draw_edema(cv: _Canvas, rng: np.random.Generator, st: dict) -> None:
    g = cv.g
    amp = _F(rng.uniform(0.12, 0.32))
    sx, sy = rng.uniform(0.15, 0.22), rng.uniform(0.2, 0.28)
    for s in (RIGHT, LEFT):                              # bilateral perihilar "bat wing"
        hx, hy = g.hilum(s)
        win = cv.box(hx, hy, 4 * sx, 4 * sy)
        haze = cv.gauss(win, hx + _SIDE_SIGN[s] * 0.04, hy, sx, sy)
        cv.fill[win] += amp * haze
        cv.mark_mult[win] += _F(0.4) * haze              # interstitial thickening


def _geo_emphysema(g: _Geom, rng: np.random.Generator, st: dict) -> None:
    f = rng.uniform(1.02, 1.08)
    g.lung_h = [h * f for h in g.lung_h]
    g.lung_cy += 0.02
    low = rng.uniform(0.02, 0.08)
    g.dia = [d + low for d in g.dia]                     # low, flattened diaphragm
    g.dome = [d * rng.uniform(0.45, 0.8) for d in g.dome]
    g.heart_w *= rng.uniform(0.85, 0.95)                 # narrow, vertical heart
    g.rib_spacing *= 1.04
    g.dark *= rng.uniform(1.06, 1.18)                    # hyperlucent
    g.mark *= rng.uniform(0.5, 0.8)                      # pruned vessels


def _geo_fibrosis(g: _Geom, rng: np.random.Generator, st: dict) -> None:
    g.lung_h = [h * 0.96 for h in g.lung_h]
    g.dia = [d - 0.02 for d in g.dia]


def _draw_fibrosis(cv: _Canvas, rng: np.random.Generator, st: dict) -> None:
    g = cv.g
    period = rng.uniform(0.09, 0.12)
    angles = rng.uniform(0.2, 0.7), rng.uniform(-0.7, -0.2)
    amp = _F(rng.uniform(0.45, 0.7))
    noise = rng.standard_normal((10, 10), dtype=np.float32)
    for s in (RIGHT, LEFT):
        win = cv.lwin[s]
        X, Y = cv.X[win], cv.Y[win]
        warp = _upsample(noise, cv.size, win) * _F(0.18)
        net = None
        for ang in angles:
            proj = (X * _F(np.cos(ang)) + Y * _F(np.sin(ang))) * _F(1 / period) + warp
            lines = _ramp(_tri(proj) - _F(0.72), 0.28)
            net = lines if net is None else np.maximum(net, lines)
        basal = _ramp(Y - _F(g.lung_cy + 0.05), 0.4)
        cv.fill[win] += amp * net * basal * cv.lung[s][win]


def _draw_pleural_thickening(cv: _Canvas, rng: np.random.Generator, st: dict) -> None:
    g = cv.g
    sides = (RIGHT, LEFT) if rng.uniform() < 0.3 else (_side(rng),)
    for s in sides:
        t = rng.uniform(0.3, 0.45)                       # thickness in ellipse units
        lateral = rng.uniform() < 0.7
        amp, dense = _F(rng.uniform(0.7, 0.95)), _F(rng.uniform(0.04, 0.08))
        win = cv.lwin[s]
        lumpy = cv.smooth_noise(rng, 14, win) * _F(0.12)  # irregular inner margin
        rim = _ramp(cv.ell[s][win] - _F(1 - t) + lumpy, 0.06) * cv.lung[s][win]
        if lateral:                                      # lateral chest wall
            where = _ramp((cv.X[win] - _F(g.xc(s))) * _F(_SIDE_SIGN[s] / g.lung_w[s]) - _F(0.1), 0.3)
        else:                                            # apical cap
            where = _ramp(_F(g.lung_cy - 0.45 * g.lung_h[s]) - cv.Y[win], 0.1)
        cv.fill[win] += amp * rim * where
        cv.extra[win] += dense * rim * where             # denser than the chest wall


def _draw_hernia(cv: _Canvas, rng: np.random.Generator, st: dict) -> None:
    g = cv.g
    r = rng.uniform(0.09, 0.14)
    cx = g.heart_dx * rng.uniform(0.0, 0.6)
    cy = g.dia[LEFT] - r * rng.uniform(0.4, 0.9)
    level = _F(cy + rng.uniform(-0.2, 0.3) * r)         # air-fluid level
    gas_amp = _F(rng.uniform(0.12, 0.2))
    win = cv.box(cx, cy, 1.5 * r, 1.4 * r)
    e = cv.ellipse(win, cx, cy, r * 1.15, r)
    body = _ramp(1 - e, 0.15)
    gas = body * _ramp(level - cv.Y[win], 0.01)
    rim = _ramp(_F(0.2) - np.abs(e - 1), 0.1)
    cv.extra[win] += _F(0.05) * rim - gas_amp * gas + _F(0.03) * (body - gas)


_GeoFn = Callable[[_Geom, np.random.Generator, dict], None]
_DrawFn = Callable[[_Canvas, np.random.Generator, dict], None]
FINDINGS: dict[str, tuple[_GeoFn | None, _DrawFn | None]] = {
    "Atelectasis": (_geo_atelectasis, _draw_atelectasis),
    "Cardiomegaly": (_geo_cardiomegaly, None),
    "Effusion": (None, _draw_effusion),
    "Infiltration": (None, _draw_infiltration),
    "Mass": (None, _draw_mass),
    "Nodule": (None, _draw_nodule),
    "Pneumonia": (None, _draw_pneumonia),
    "Pneumothorax": (_geo_pneumothorax, _draw_pneumothorax),
    "Consolidation": (None, _draw_consolidation),
    "Edema": (None, _draw_edema),
    "Emphysema": (_geo_emphysema, None),
    "Fibrosis": (_geo_fibrosis, _draw_fibrosis),
    "Pleural_Thickening": (None, _draw_pleural_thickening),
    "Hernia": (None, _draw_hernia),
}
assert tuple(FINDINGS) == nih.LABELS


# --------------------------------------------------------------------------- rendering

def render_phantom(findings: np.ndarray, *, size: int, rng: np.random.Generator,
                   anatomy: Anatomy | None = None) -> np.ndarray:
    """Render one phantom radiograph (uint8 size x size) showing the given findings.

    ``findings``: 14 values in ``nih.LABELS`` order, 1 = present (NaN counts as absent).
    ``anatomy``: the patient's anatomy (default: drawn from ``rng``). ``rng`` first yields one
    seed per finding, then drives the base image; each finding present draws from its own
    generator, so toggling a finding leaves the rest of the image unchanged.
    """
    f = np.asarray(findings, dtype=np.float64).reshape(-1)
    if f.shape != (len(nih.LABELS),):
        raise ValueError(f"findings must have {len(nih.LABELS)} entries (nih.LABELS order), got {f.shape}")
    if size < 8:
        raise ValueError(f"size must be at least 8, got {size}")
    seeds = rng.integers(0, 2**63 - 1, size=len(nih.LABELS))
    if anatomy is None:
        anatomy = sample_anatomy(rng)
    present = [(i, label) for i, label in enumerate(nih.LABELS) if f[i] > 0.5]
    frng = {i: np.random.default_rng(seeds[i]) for i, _ in present}
    state: dict[int, dict] = {i: {} for i, _ in present}

    # per-exposure variation (drawn in a fixed order whatever the findings)
    jitter = (rng.uniform(-0.03, 0.03), rng.uniform(-0.03, 0.03), np.deg2rad(rng.uniform(-2, 2)),
              rng.uniform(0.97, 1.03))
    exposure = rng.uniform(0.85, 1.15), rng.uniform(-0.05, 0.05), rng.uniform(0.85, 1.2)
    noise_sigma = rng.uniform(0.012, 0.03)
    vessels = rng.standard_normal((12, 12), dtype=np.float32), rng.standard_normal((20, 20), dtype=np.float32)
    noise = _pixel_noise(rng, size)

    g = _geom(anatomy, rng)
    for i, label in present:
        geo = FINDINGS[label][0]
        if geo is not None:
            geo(g, frng[i], state[i])
    cv = _Canvas(g, size, jitter)
    for i, label in present:
        draw = FINDINGS[label][1]
        if draw is not None:
            draw(cv, frng[i], state[i])
    return _compose(cv, vessels, noise, noise_sigma, exposure)


def _compose(cv: _Canvas, vessel_grids: tuple[np.ndarray, np.ndarray], noise: np.ndarray,
             noise_sigma: float, exposure: tuple[float, float, float]) -> np.ndarray:
    g, a, X, Y, size = cv.g, cv.g.a, cv.X, cv.Y, cv.size

    # trunk: soft tissue, denser towards the abdomen; air outside is nearly black
    bx, by = X * _F(1 / 0.94), (Y - _F(0.12)) * _F(1 / 1.2)
    bx, by = bx * bx, by * by
    body = _ramp(1 - bx * bx - by * by - _F(0.3) * bx, 0.1)   # squarish trunk with shoulders
    img = _F(0.05) + _F(a.tissue) * body * (1 + _F(0.18) * _ramp(Y - _F(0.25), 0.6))

    # heart and aortic knob: denser, and they hide the medial lung
    occl = np.zeros((size, size), np.float32)
    win = cv.box(g.heart_dx, g.heart_cy, g.heart_w, g.heart_h)
    occl[win] = cv.disc(win, g.heart_dx, g.heart_cy, g.heart_w, g.heart_h, sharp=3.0)
    kx, ky = g.a.gap + 0.01, g.lung_cy - 0.22
    win = cv.box(kx, ky, 0.05, 0.075)
    occl[win] = np.maximum(occl[win], cv.disc(win, kx, ky, 0.05, 0.075, sharp=2.0))
    img += _F(0.05) * occl

    # lungs: darkness minus vessel markings (ridges of two smooth noise fields, denser at the hila)
    dark = _F(a.lung_dark * g.dark)
    mark = _F(a.markings * g.mark)
    for s in (RIGHT, LEFT):
        win = cv.lwin[s]
        na = _upsample(vessel_grids[0], size, win)
        nb = _upsample(vessel_grids[1], size, win)
        ridge = np.maximum(_ramp(1 - np.abs(na) * _F(4.2), 1.0), _F(0.6) * _ramp(1 - np.abs(nb) * _F(4.9), 1.0))
        hx, hy = g.hilum(s)
        hilar = cv.gauss(win, hx, hy, 0.3, 0.38)
        vessels = ridge * (_F(0.35) + _F(0.65) * hilar) + _F(0.5) * hilar * hilar
        aerated = cv.lung[s][win] * (1 - _F(0.92) * occl[win]) * (1 - np.clip(cv.fill[win], 0.0, 1.0))
        img[win] -= aerated * (dark * cv.dark_mult[win] - mark * cv.mark_mult[win] * vessels)

    # bones: posterior and anterior ribs (periodic curved bands), clavicles, spine; trachea
    half_w = g.a.gap + 2 * max(g.lung_w) + 0.05
    rib_y0, rib_y1 = g.lung_cy - max(g.lung_h) - 0.06, max(g.dia) + 0.35
    win = cv.window(-half_w, half_w, rib_y0, rib_y1)
    Xw, Yw = X[win], Y[win]
    u = np.abs(Xw)
    thorax = _ramp(1 - cv.ellipse(win, 0.0, g.lung_cy + 0.02, half_w, max(g.lung_h) + 0.06), 0.15) \
        * _ramp(_F(max(g.dia) + 0.25) - Yw, 0.1)
    k = _F(1 / g.rib_spacing)
    t_post = (Yw - _F(a.rib_curve) * (_F(0.8) * u * u - _F(0.22) * u)) * k + _F(a.rib_phase / (2 * np.pi))
    t_ant = (Yw + _F(0.45) * u - _F(0.15) * u * u) * k + _F(a.rib_phase / (2 * np.pi) + 0.27)
    ribs = _F(0.09) * _ramp(_tri(t_post) - _F(0.62), 0.25) + _F(0.035) * _ramp(_tri(t_ant) - _F(0.7), 0.2)
    img[win] += _F(a.bone) * ribs * thorax

    y0 = g.lung_cy - g.lung_h[0] + 0.02
    win = cv.window(-0.75, 0.75, y0 - 0.2, y0 + 0.1)
    u = np.abs(X[win])
    clav_y = _F(y0) - _F(0.28) * (u - _F(0.08)) + _F(0.4) * (u - _F(0.35)) ** 2
    clav = _ramp(_F(0.035) - np.abs(Y[win] - clav_y), 0.015) * _ramp(u - _F(0.05), 0.04) * _ramp(_F(0.72) - u, 0.05)
    img[win] += _F(0.11 * a.bone) * clav

    win = cv.window(-0.08, 0.08, -1.6, 1.6)
    spine = _ramp(_F(0.06) - np.abs(X[win]), 0.015) * (_F(0.75) + _F(0.25) * _tri(Y[win] * _F(1 / 0.12)))
    img[win] += _F(0.07 * a.bone) * spine
    win = cv.window(-0.05, 0.06, -1.6, g.lung_cy - 0.09)
    trachea = _ramp(_F(0.03) - np.abs(X[win] - _F(0.01)), 0.012) * _ramp(_F(g.lung_cy - 0.15) - Y[win], 0.06)
    img[win] -= _F(0.09) * trachea
    if a.bubble > 0:
        bx0, by0 = g.xc(LEFT) - 0.05, g.dia[LEFT] + g.dome[LEFT] * 0.3 + 0.1
        win = cv.box(bx0, by0, a.bubble * 1.3, a.bubble)
        img[win] -= _F(0.1) * cv.disc(win, bx0, by0, a.bubble * 1.3, a.bubble, sharp=2.0)
    img += cv.extra

    contrast, offset, gamma = exposure
    img += _F(offset - 0.02)
    img *= _F(contrast)
    img += _F(noise_sigma) * noise
    np.clip(img, 0.0, 1.0, out=img)
    img **= _F(gamma)
    img *= _F(255)
    img += _F(0.5)
    return img.astype(np.uint8)


def image_rng(seed: int, name: str) -> np.random.Generator:
    """The RNG that renders image ``name`` of a release with ``seed``."""
    return np.random.default_rng([seed, _STREAM_IMAGE, _name_key(name)])


def patient_anatomy(seed: int, patient: str) -> Anatomy:
    """The anatomy of ``patient`` in a release with ``seed`` (shared by the patient's images)."""
    return sample_anatomy(np.random.default_rng([seed, _STREAM_ANATOMY, _name_key(patient)]))


def _name_key(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")


def render_row(seed: int, image: str, patient: str, findings: np.ndarray, size: int) -> np.ndarray:
    """Render the phantom of one label row as make_release does."""
    return render_phantom(findings, size=size, rng=image_rng(seed, image), anatomy=patient_anatomy(seed, patient))


def encode_png(img: np.ndarray) -> bytes:
    """8-bit grey PNG with fixed settings (no timestamps or text chunks: deterministic bytes)."""
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(img, mode="L").save(buf, format="PNG", compress_level=6, optimize=False)
    return buf.getvalue()


# --------------------------------------------------------------------------- release

@dataclass(frozen=True)
class ReleaseInfo:
    out_dir: Path
    n_images: int
    n_patients: int
    n_train_val: int
    n_test: int
    archives: tuple[str, ...]
    files: tuple[str, ...]        # every file listed in SHA256SUMS
    label_counts: dict[str, int]
    seed: int
    image_size: int


def _patient_findings(table: pd.DataFrame) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for pid, findings in zip(table["Patient ID"].astype(str), table["Finding Labels"].astype(str)):
        out.setdefault(pid, set()).update(f for f in findings.split("|") if f in nih.LABELS)
    return out


def sample_rows(table: pd.DataFrame, n_images: int, seed: int, *, min_patients_per_label: int = 12,
                max_images_per_patient: int = 8) -> pd.DataFrame:
    """Whole patients, seeded, until ``n_images`` rows (the last patient's later rows dropped if
    needed); rows keep the label file's order.

    Rare findings are guaranteed: first, for every finding from the rarest up, seeded-random
    patients (with at most ``max_images_per_patient`` images) who have it are taken until
    ``min_patients_per_label`` such patients are in; then the other patients in random order.
    The rows stay real NIH rows; only which patients are sampled is stratified, so that every
    finding has positives on both sides of the split (Hernia is 0.2% of NIH images).
    """
    if n_images > len(table):
        raise ReleaseError(f"n_images={n_images} exceeds the {len(table)} rows of the label file")
    rng = np.random.default_rng([seed, _STREAM_PATIENTS])
    patients = pd.unique(table["Patient ID"].astype(str))
    sizes = table.groupby(table["Patient ID"].astype(str), sort=False).size()
    findings = _patient_findings(table)
    order_all = [patients[i] for i in rng.permutation(len(patients))]
    prevalence = {label: sum(label in f for f in findings.values()) for label in nih.LABELS}
    first: list[str] = []
    taken: set[str] = set()
    budget = n_images // 2                      # stratification uses at most half the images
    used = 0
    for label in sorted(nih.LABELS, key=lambda lab: prevalence[lab]):
        have = sum(1 for p in first if label in findings[p])
        for p in order_all:
            if have >= min_patients_per_label or used >= budget:
                break
            if p in taken or label not in findings[p] or sizes[p] > max_images_per_patient:
                continue
            first.append(p)
            taken.add(p)
            used += int(sizes[p])
            have += 1
    order = first + [p for p in order_all if p not in taken]
    counts = sizes.loc[order].to_numpy()
    n_take = int(np.searchsorted(np.cumsum(counts), n_images) + 1)
    chosen = order[:n_take]
    pid = table["Patient ID"].astype(str)
    rows = table[pid.isin(set(chosen))]
    excess = len(rows) - n_images
    if excess > 0:
        last = rows.index[pid.loc[rows.index] == chosen[-1]]
        rows = rows.drop(last[len(last) - excess:])
    return rows


def split_patients(patients: list[str], test_fraction: float, seed: int,
                   findings: dict[str, set[str]] | None = None) -> set[str]:
    """Seeded patient-wise choice of the test patients (at least one, never all, when 2+ patients).

    With ``findings`` (patient -> findings) the choice is stratified: for every finding from the
    rarest up, about ``test_fraction`` of its not yet assigned patients go to test (at least one
    when it has two or more), so every finding is present in both train_val and test.
    """
    uniq = sorted(set(patients))
    n_test = int(round(test_fraction * len(uniq)))
    if len(uniq) >= 2:
        n_test = min(max(n_test, 1 if test_fraction > 0 else 0), len(uniq) - 1)
    rng = np.random.default_rng([seed, _STREAM_SPLIT])
    order = [uniq[i] for i in rng.permutation(len(uniq))]
    test: set[str] = set()
    assigned: set[str] = set()
    if findings and test_fraction > 0:
        prevalence = {lab: sum(lab in findings.get(p, ()) for p in uniq) for lab in nih.LABELS}
        for label in sorted(nih.LABELS, key=lambda lab: prevalence[lab]):
            group = [p for p in order if label in findings.get(p, ()) and p not in assigned]
            k = int(round(test_fraction * len(group)))
            if len(group) >= 2:
                k = min(max(k, 1), len(group) - 1)
            test.update(group[:k])
            assigned.update(group)
            if len(test) >= n_test:
                break
    for p in order:
        if len(test) >= n_test:
            break
        if p not in assigned:
            test.add(p)
            assigned.add(p)
    return test


def _tmp(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def _write_bytes_atomic(path: Path, data: bytes) -> None:
    tmp = _tmp(path)
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_archive(path: Path, members: list[tuple[str, bytes]]) -> None:
    """NIH-layout archive: ``images/`` then ``images/<name>``; fixed mtimes/owners: same bytes each run.

    The release's packaging, also used by tests that build a mirror in the exact NIH layout."""
    tmp = _tmp(path)
    try:
        with open(tmp, "wb") as raw, gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0,
                                                   compresslevel=6) as gz:
            with tarfile.open(fileobj=gz, mode="w|", format=tarfile.GNU_FORMAT) as tar:
                d = tarfile.TarInfo("images")
                d.type, d.mode, d.mtime = tarfile.DIRTYPE, 0o755, 0
                tar.addfile(d)
                for name, data in members:
                    ti = tarfile.TarInfo(f"images/{name}")
                    ti.size, ti.mode, ti.mtime = len(data), 0o644, 0
                    ti.uid = ti.gid = 0
                    ti.uname = ti.gname = ""
                    tar.addfile(ti, io.BytesIO(data))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_tables(out_dir: Path, rows: pd.DataFrame, train_val: list[str], test: list[str]) -> None:
    """The release's label file (the rows, all columns, verbatim) and its two split lists."""
    buf = io.StringIO()
    rows.to_csv(buf, index=False, lineterminator="\n")
    _write_bytes_atomic(out_dir / nih.LABEL_CSV_NAME, buf.getvalue().encode())
    _write_bytes_atomic(out_dir / "train_val_list.txt", "".join(n + "\n" for n in train_val).encode())
    _write_bytes_atomic(out_dir / "test_list.txt", "".join(n + "\n" for n in test).encode())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _render_chunk(args: tuple[int, int, list[tuple[str, str, np.ndarray]]]) -> list[bytes]:
    seed, size, rows = args
    out, anatomy = [], {}
    for image, patient, f in rows:
        if patient not in anatomy:
            anatomy[patient] = patient_anatomy(seed, patient)
        out.append(encode_png(render_phantom(f, size=size, rng=image_rng(seed, image), anatomy=anatomy[patient])))
    return out


def make_release(out_dir: Path | str, *, n_images: int, image_size: int, images_per_archive: int,
                 test_fraction: float, seed: int, labels_csv: Path | str | None = None,
                 workers: int = 1, progress: bool = False) -> ReleaseInfo:
    """Write a synthetic release in the NIH ChestX-ray14 layout to ``out_dir``; see the module doc.

    A stale ``SHA256SUMS`` is removed first and written last, so an interrupted run never looks
    complete; stale ``images_NNN.tar.gz`` beyond this release's archives are removed.
    ``workers`` > 1 renders in that many processes (same bytes as ``workers=1``).
    """
    if n_images < 1:
        raise ReleaseError(f"n_images must be positive, got {n_images}")
    if image_size < 8:
        raise ReleaseError(f"image_size must be at least 8, got {image_size}")
    if images_per_archive < 1:
        raise ReleaseError(f"images_per_archive must be positive, got {images_per_archive}")
    if not 0.0 <= test_fraction < 1.0:
        raise ReleaseError(f"test_fraction must be in [0, 1), got {test_fraction}")
    n_archives = -(-n_images // images_per_archive)
    if n_archives > 999:
        raise ReleaseError(f"{n_archives} archives exceed the images_NNN naming (max 999); "
                           "raise images_per_archive")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "SHA256SUMS").unlink(missing_ok=True)

    src = Path(labels_csv) if labels_csv is not None else nih.find_label_csv()
    table = nih.read_label_table(src)
    rows = sample_rows(table, n_images, seed)
    labels = nih.labels_from_findings(rows["Finding Labels"], source=str(src)).to_numpy(np.float32)
    names = rows["Image Index"].tolist()
    patients = rows["Patient ID"].astype(str).tolist()

    # archives
    archives: list[str] = []
    chunks = [list(range(i, min(i + images_per_archive, n_images))) for i in range(0, n_images, images_per_archive)]
    jobs = [(seed, image_size, [(names[j], patients[j], labels[j]) for j in idx]) for idx in chunks]
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=n_images, unit="img", desc="phantoms")
    if workers > 1:
        from concurrent.futures import ProcessPoolExecutor
        pool = ProcessPoolExecutor(workers)
        sub = [(s, z, r[k:k + 64]) for s, z, r in jobs for k in range(0, len(r), 64)]
        rendered = pool.map(_render_chunk, sub)
    else:
        pool = None
        rendered = (_render_chunk((s, z, r[k:k + 64])) for s, z, r in jobs for k in range(0, len(r), 64))
    try:
        for a, idx in enumerate(chunks, start=1):
            pngs: list[bytes] = []
            while len(pngs) < len(idx):
                got = next(rendered)
                pngs.extend(got)
                if bar is not None:
                    bar.update(len(got))
            name = f"images_{a:03d}.tar.gz"
            write_archive(out_dir / name, [(names[j], png) for j, png in zip(idx, pngs)])
            archives.append(name)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
        if bar is not None:
            bar.close()
    for stale in out_dir.glob("images_*.tar.gz"):
        if stale.name not in archives:
            stale.unlink()

    # patient-wise official-style split
    test_patients = split_patients(patients, test_fraction, seed, findings=_patient_findings(rows))
    test = [n for n, p in zip(names, patients) if p in test_patients]
    train_val = [n for n, p in zip(names, patients) if p not in test_patients]
    write_tables(out_dir, rows, train_val, test)

    label_counts = {label: int(labels[:, i].sum()) for i, label in enumerate(nih.LABELS)}
    meta = {
        "synthetic": True,
        "description": "Synthetic phantom chest radiographs in the NIH ChestX-ray14 layout; label rows "
                       "are real rows of the NIH label file, images are rendered phantoms.",
        "generator": GENERATOR, "generator_version": GENERATOR_VERSION,
        "seed": seed, "image_size": image_size, "images_per_archive": images_per_archive,
        "test_fraction": test_fraction,
        "n_images": n_images, "n_patients": len(set(patients)),
        "n_train_val_images": len(train_val), "n_test_images": len(test),
        "n_test_patients": len(test_patients), "archives": archives,
        "label_counts": label_counts,
        "labels_source": {"name": src.name, "sha256": _sha256(src)},
    }
    _write_bytes_atomic(out_dir / "release.json", (json.dumps(meta, indent=1) + "\n").encode())

    files = sorted([*archives, nih.LABEL_CSV_NAME, "train_val_list.txt", "test_list.txt", "release.json"])
    sums = "".join(f"{_sha256(out_dir / f)}  {f}\n" for f in files)
    _write_bytes_atomic(out_dir / "SHA256SUMS", sums.encode())
    return ReleaseInfo(out_dir=out_dir, n_images=n_images, n_patients=len(set(patients)),
                       n_train_val=len(train_val), n_test=len(test), archives=tuple(archives),
                       files=tuple(files), label_counts=label_counts, seed=seed, image_size=image_size)

