"""The pixel canvas a phantom is drawn on, and the cheap shape primitives drawing uses.

Speed: every shape is evaluated only inside its bounding window (:meth:`Canvas.window`),
Gaussians use a polynomial approximation, periodic bands use triangle waves, and pixel noise is a
random window of a fixed noise bank -- transcendental ufuncs and fresh Gaussian noise cost more
than all the rest at 128 px. All pixel arithmetic is float32 (:data:`f32`).
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from chexflow.data.phantoms.anatomy import LEFT, RIGHT, SIDE_SIGN, ImageGeometry

Window = tuple[slice, slice]   # (rows, cols) of the image a shape is evaluated on
f32 = np.float32


@lru_cache(maxsize=64)
def _interp_index(n_in: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Linear interpolation of an n_in grid onto size pixels: (lower index, weight of upper)."""
    pos = (np.arange(size) + 0.5) / size * (n_in - 1)
    lower = np.clip(np.floor(pos).astype(np.intp), 0, n_in - 2)
    frac = (pos - lower).astype(np.float32)
    lower.setflags(write=False)
    frac.setflags(write=False)
    return lower, frac


def upsample(grid: np.ndarray, size: int, window: Window) -> np.ndarray:
    """Bilinear upsampling of a coarse n x n grid to size x size, evaluated on ``window``.

    Gather + blend instead of interpolation-matrix products: BLAS would start threads for these
    tiny products, which costs far more than it saves (and oversubscribes a loaded machine).
    """
    lower, frac = _interp_index(grid.shape[0], size)
    col_lower, col_frac = lower[window[1]], frac[window[1]]
    cols = grid[:, col_lower] * (1 - col_frac) + grid[:, col_lower + 1] * col_frac   # (n, w): small
    row_lower, row_frac = lower[window[0]], frac[window[0]][:, None]
    up = cols[row_lower]                                                           # whole-row gathers: cheap
    up += (cols[row_lower + 1] - up) * row_frac
    return up


@lru_cache(maxsize=1)
def _noise_bank() -> np.ndarray:
    """A fixed 1024x1024 standard-normal field; images take random windows of it as pixel noise."""
    bank = np.random.default_rng(20170101).standard_normal((1024, 1024), dtype=np.float32)
    bank.setflags(write=False)
    return bank


def pixel_noise(rng: np.random.Generator, size: int) -> np.ndarray:
    """A size x size standard-normal field: a random, randomly flipped window of the noise bank."""
    bank = _noise_bank()
    if size > bank.shape[0]:
        return rng.standard_normal((size, size), dtype=np.float32)
    row, col = rng.integers(0, bank.shape[0] - size + 1, size=2)
    flip = int(rng.integers(4))
    window = bank[row:row + size, col:col + size]
    return window[::-1] if flip & 1 else window.T if flip & 2 else window


def ramp(v: np.ndarray, width: float) -> np.ndarray:
    """0 for v <= 0, 1 for v >= width, linear in between."""
    return np.clip(v * f32(1.0 / width), 0.0, 1.0)


def _gaussian_of(e: np.ndarray) -> np.ndarray:
    """~exp(-e/2) for a squared normalised distance e (polynomial; exact 0 beyond e = 16)."""
    q = np.clip(1 - e * f32(1 / 16), 0.0, 1.0)
    q *= q
    q *= q
    q *= q
    return q


def triangle_wave(phase: np.ndarray) -> np.ndarray:
    """Triangle wave with period 1: 1 at integers, 0 at half-integers (a cheap cosine)."""
    return np.abs(f32(2) * (phase - np.floor(phase)) - f32(1))


class Canvas:
    """Coordinates, anatomy masks and the layers findings draw into.

    ``X``, ``Y``: the anatomy-frame coordinates of every pixel (size x size). The layers:
    ``fill`` (0 aerated .. 1 opaque; counts inside the lungs), ``extra`` (additive brightness),
    ``dark_mult`` and ``mark_mult`` (multipliers of lung darkness and of lung markings).
    """

    def __init__(self, geom: ImageGeometry, size: int, jitter: tuple[float, float, float, float]):
        anatomy = geom.anatomy
        self.geom, self.size = geom, size
        lin = (np.arange(size, dtype=np.float32) + 0.5) * f32(2 / size) - 1
        shift_x, shift_y, dangle, dscale = jitter
        angle = anatomy.angle + dangle
        self._cos, self._sin = float(np.cos(angle)), float(np.sin(angle))
        self._scale = float(anatomy.scale * dscale)
        self._shift = (float(anatomy.shift_x + shift_x), float(anatomy.shift_y + shift_y))
        cos, sin, inv = f32(self._cos), f32(self._sin), f32(1 / self._scale)
        u = (lin[None, :] - f32(self._shift[0])) * inv
        v = (lin[:, None] - f32(self._shift[1])) * inv
        self.X = cos * u + sin * v
        self.Y = cos * v - sin * u
        shape = (size, size)
        self.fill = np.zeros(shape, np.float32)
        self.extra = np.zeros(shape, np.float32)
        self.dark_mult = np.ones(shape, np.float32)
        self.mark_mult = np.ones(shape, np.float32)
        self.lung: list[np.ndarray] = []             # soft lung masks (full size, 0 outside)
        self.lung_ellipse: list[np.ndarray] = []     # lung ellipse value (4 outside the lung window)
        self.lung_window: list[Window] = []
        for side in (RIGHT, LEFT):
            xc, w, h = geom.lung_centre_x(side), geom.lung_w[side], geom.lung_h[side]
            win = self.window(xc - w - 0.02, xc + w + 0.02, geom.lung_cy - h - 0.02, geom.lung_cy + h + 0.02)
            Y = self.Y[win]
            e = self.ellipse(win, xc, geom.lung_cy, w, h)
            dx = (self.X[win] - f32(geom.dome_peak_x(side))) * f32(1.0 / w)
            diaphragm = f32(geom.diaphragm[side]) + f32(geom.dome[side]) * dx * dx
            mask = np.zeros(shape, np.float32)
            mask[win] = ramp(1 - e, 0.18) * ramp(diaphragm - Y, 0.025)
            ellipse = np.full(shape, 4.0, np.float32)
            ellipse[win] = e
            self.lung.append(mask)
            self.lung_ellipse.append(ellipse)
            self.lung_window.append(win)

    def window(self, x0: float, x1: float, y0: float, y1: float) -> Window:
        """Pixel rows/cols covering the anatomy-frame box [x0, x1] x [y0, y1] (plus a margin)."""
        scale, cos, sin = self._scale, self._cos, self._sin
        half, n = self.size / 2, self.size
        cols = [(scale * (cos * x - sin * y) + self._shift[0] + 1) * half - 0.5 for x in (x0, x1) for y in (y0, y1)]
        rows = [(scale * (sin * x + cos * y) + self._shift[1] + 1) * half - 0.5 for x in (x0, x1) for y in (y0, y1)]
        r0 = min(max(math.floor(min(rows)) - 1, 0), n)
        r1 = min(max(math.ceil(max(rows)) + 2, 0), n)
        c0 = min(max(math.floor(min(cols)) - 1, 0), n)
        c1 = min(max(math.ceil(max(cols)) + 2, 0), n)
        return slice(r0, max(r0, r1)), slice(c0, max(c0, c1))

    def box(self, cx: float, cy: float, rx: float, ry: float) -> Window:
        return self.window(cx - rx, cx + rx, cy - ry, cy + ry)

    def ellipse(self, win: Window, cx: float, cy: float, rx: float, ry: float) -> np.ndarray:
        """Squared normalised distance from (cx, cy): 1 on the ellipse with radii rx, ry."""
        dx = (self.X[win] - f32(cx)) * f32(1.0 / rx)
        dy = (self.Y[win] - f32(cy)) * f32(1.0 / ry)
        return dx * dx + dy * dy

    def disc(self, win: Window, cx: float, cy: float, rx: float, ry: float, sharp: float = 4.0) -> np.ndarray:
        return np.clip((1 - self.ellipse(win, cx, cy, rx, ry)) * f32(sharp), 0.0, 1.0)

    def gauss(self, win: Window, cx: float, cy: float, sx: float, sy: float) -> np.ndarray:
        return _gaussian_of(self.ellipse(win, cx, cy, sx, sy))

    def rotated_disc(self, win: Window, cx: float, cy: float, rx: float, ry: float, angle: float,
                     sharp: float = 3.0) -> np.ndarray:
        cos, sin = f32(np.cos(angle)), f32(np.sin(angle))
        dx, dy = self.X[win] - f32(cx), self.Y[win] - f32(cy)
        p = (cos * dx + sin * dy) * f32(1.0 / rx)
        q = (cos * dy - sin * dx) * f32(1.0 / ry)
        return np.clip((1 - p * p - q * q) * f32(sharp), 0.0, 1.0)

    def lateral(self, win: Window, side: int) -> np.ndarray:
        """Lateral coordinate in lung ``side``: 0 on its centre line, 1 at its outer edge."""
        geom = self.geom
        return (self.X[win] - f32(geom.lung_centre_x(side))) * f32(SIDE_SIGN[side] / geom.lung_w[side])

    def smooth_noise(self, rng: np.random.Generator, n: int, win: Window) -> np.ndarray:
        """Smooth random field (~unit variance) from an n x n grid, evaluated on ``win``."""
        return upsample(rng.standard_normal((n, n), dtype=np.float32), self.size, win) * f32(1.4)
