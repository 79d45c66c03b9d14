"""A phantom patient's anatomy and one exposure's geometry, in the normalised anatomy frame.

The anatomy frame: x from -1 (image left = patient's right in a PA view) to 1, y from -1 (top)
to 1 (bottom); each image rotates, shifts and scales it (see :class:`~.canvas.Canvas`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

RIGHT, LEFT = 0, 1          # patient's right lung is on the image left (x < 0)
SIDE_SIGN = (-1.0, 1.0)     # direction of "lateral" for each side


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
    diaphragm_right: float = 0.27    # top of the right hemidiaphragm dome (y)
    diaphragm_left: float = 0.32     # top of the left one (lower)
    dome: float = 0.2            # dome height: lateral costophrenic angle = diaphragm + dome
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
        diaphragm_right=u(0.22, 0.31), diaphragm_left=u(0.28, 0.36), dome=u(0.15, 0.24),
        heart_w=u(0.24, 0.30), heart_h=u(0.19, 0.24), heart_dx=u(0.08, 0.13), heart_cy=u(0.1, 0.17),
        rib_spacing=u(0.15, 0.18), rib_phase=u(0, 2 * np.pi), rib_curve=u(0.8, 1.2),
        tissue=u(0.5, 0.62), lung_dark=u(0.26, 0.34), markings=u(0.08, 0.13), bone=u(0.8, 1.2),
        bubble=u(0.05, 0.09) if u() < 0.6 else 0.0,
    )


@dataclass
class ImageGeometry:
    """One exposure's geometry (mutable while findings adjust it; scalars only).

    Per-side lists are indexed by ``RIGHT``/``LEFT``.
    """
    anatomy: Anatomy
    lung_w: list[float]
    lung_h: list[float]
    lung_cy: float
    diaphragm: list[float]   # y of the top of each hemidiaphragm dome
    dome: list[float]
    heart_w: float
    heart_h: float
    heart_dx: float
    heart_cy: float
    rib_spacing: float
    lung_darkness: float = 1.0   # global lung darkness multiplier (emphysema > 1)
    marking_gain: float = 1.0    # global lung-marking multiplier

    def lung_centre_x(self, side: int) -> float:
        return SIDE_SIGN[side] * (self.anatomy.gap + self.lung_w[side])

    def dome_peak_x(self, side: int) -> float:
        """x of the highest point of the hemidiaphragm under lung ``side``."""
        return self.lung_centre_x(side) - SIDE_SIGN[side] * 0.15 * self.lung_w[side]

    def hilum(self, side: int) -> tuple[float, float]:
        return SIDE_SIGN[side] * (self.anatomy.gap + 0.55 * self.lung_w[side]), self.lung_cy + 0.12

    def point_in_lung(self, rng: np.random.Generator, side: int, *, zone: str = "any",
                      radius: float = 0.75) -> tuple[float, float]:
        """A random point well inside lung ``side`` ('upper'/'lower'/'any' zone)."""
        for _ in range(200):
            a, b = rng.uniform(-1, 1, size=2)
            if a * a + b * b > radius * radius:
                continue
            if zone == "upper" and b > 0.1:
                continue
            if zone == "lower" and b < -0.1:
                continue
            x = self.lung_centre_x(side) + a * self.lung_w[side]
            y = self.lung_cy + b * self.lung_h[side]
            if y < self._diaphragm_y_at(side, x) - 0.06:
                return float(x), float(y)
        return self.lung_centre_x(side), self.lung_cy  # pragma: no cover - practically unreachable

    def _diaphragm_y_at(self, side: int, x: float) -> float:
        return self.diaphragm[side] + self.dome[side] * ((x - self.dome_peak_x(side)) / self.lung_w[side]) ** 2


def image_geometry(anatomy: Anatomy, rng: np.random.Generator) -> ImageGeometry:
    """The geometry of one exposure of ``anatomy`` (depth of inspiration varies per image)."""
    inspiration = rng.uniform(0.96, 1.04)
    diaphragm_shift = rng.uniform(-0.03, 0.03)
    a = anatomy
    return ImageGeometry(
        anatomy=a, lung_w=[a.lung_w, a.lung_w * 0.93],
        lung_h=[a.lung_h * inspiration, a.lung_h * inspiration * 0.98], lung_cy=a.lung_cy,
        diaphragm=[a.diaphragm_right + diaphragm_shift, a.diaphragm_left + diaphragm_shift],
        dome=[a.dome, a.dome * 0.95], heart_w=a.heart_w, heart_h=a.heart_h, heart_dx=a.heart_dx,
        heart_cy=a.heart_cy, rib_spacing=a.rib_spacing)
