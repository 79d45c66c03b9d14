"""Matplotlib figures for the report, returned as ``data:image/png;base64,...`` URIs.

Uses the object-oriented API (``matplotlib.figure.Figure`` rendered by the Agg canvas),
never ``pyplot``: no global backend switch, no display needed, safe on compute nodes.
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

OURS_COLOR = "#1f6fb4"
CHEXNET_COLOR = "#e07b39"
WANG_COLOR = "#9a9a9a"


def display_name(label: str) -> str:
    return label.replace("_", " ")


def figure_to_data_uri(fig: Figure, *, dpi: int = 100, tight: bool = True) -> str:
    """PNG of ``fig`` as a base64 data URI. ``tight``: crop to the drawn area (renders the figure twice;
    the many-panel grids lay themselves out instead: 2.4x faster)."""
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight" if tight else None)
    return png_data_uri(buf.getvalue())


def png_data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _series(epochs: Sequence[Mapping[str, Any]], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for e in epochs:
        v = e.get(key)
        if v is None or (isinstance(v, float) and math.isnan(v)):
            continue
        xs.append(float(e["epoch"]))
        ys.append(float(v))
    return xs, ys


def training_curves(epochs: Sequence[Mapping[str, Any]], title: str) -> str:
    """2x2 panel: train/val loss, validation metric, learning rate, images/s per epoch."""
    fig = Figure(figsize=(10, 6.4))
    axes = fig.subplots(2, 2)
    metric_name = next((str(e["val_metric_name"]) for e in epochs if e.get("val_metric_name")), "val_metric")

    ax = axes[0, 0]
    for key, style, name in (("train_loss", "-o", "train"), ("val_loss", "-s", "validation")):
        xs, ys = _series(epochs, key)
        if xs:
            ax.plot(xs, ys, style, ms=3, label=name)
    ax.set_title("Loss")
    ax.legend(fontsize=8)

    for ax, key, color, name in ((axes[0, 1], "val_metric", "#2a9d8f", f"Validation {metric_name.replace('_', ' ')}"),
                                 (axes[1, 0], "lr", "#8e44ad", "Learning rate"),
                                 (axes[1, 1], "images_per_sec", "#c0392b", "Throughput (images/s)")):
        xs, ys = _series(epochs, key)
        ax.plot(xs, ys, "-o", ms=3, color=color)
        ax.set_title(name)
        if key == "lr" and ys and min(ys) > 0 and max(ys) / min(ys) > 20:
            ax.set_yscale("log")
    axes[1, 1].set_ylim(bottom=0)

    for ax in axes.flat:
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    return figure_to_data_uri(fig)


def auroc_bars(labels: Sequence[str], ours: Mapping[str, float | None], chexnet: Mapping[str, float],
               wang: Mapping[str, float] | None = None) -> str:
    """Horizontal grouped bars of per-label AUROC: ours vs CheXNet (and Wang et al.; none beside other
    findings than ChestX-ray14's: empty mappings)."""
    series = [("This run", ours, OURS_COLOR)] + ([("CheXNet", chexnet, CHEXNET_COLOR)] if chexnet else [])
    if wang:
        series.append(("Wang et al. 2017", wang, WANG_COLOR))
    n = len(labels)
    height = 0.8 / len(series)
    shown = [v for _, values, _ in series for v in (values.get(lab) for lab in labels) if v is not None]
    left = min(0.5, math.floor((min(shown, default=0.5) - 0.02) * 10) / 10)
    fig = Figure(figsize=(8.5, 0.48 * n + 1.4))
    ax = fig.subplots()
    y = np.arange(n)
    for k, (name, values, color) in enumerate(series):
        vals = [values.get(lab) for lab in labels]
        pos = y - 0.4 + height * (k + 0.5)
        ax.barh(pos, [v if v is not None else 0.0 for v in vals], height=height, color=color, label=name)
        for p, v in zip(pos, vals):
            if v is None:
                ax.text(left + 0.005, p, "n/a", va="center", fontsize=7)
    ax.set_yticks(y, [display_name(lab) for lab in labels])
    ax.invert_yaxis()
    ax.set_xlim(left, 1.0)
    ax.axvline(0.5, color="black", lw=0.8)
    ax.set_xlabel("AUROC")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.6 / (0.48 * n + 1.4) - 0.04), ncol=len(series),
              fontsize=8, frameon=False)
    ax.set_title("Per-label test AUROC")
    fig.tight_layout()
    return figure_to_data_uri(fig)


def _unit_axes(ax, xlabel: str, ylabel: str) -> None:
    """A panel of a grid whose both axes run over [0, 1] (rates, probabilities)."""
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.01)
    ax.tick_params(labelsize=7)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)


def _three(value: float | None) -> str:
    """A recorded metric in a figure's title (n/a: none recorded)."""
    return "n/a" if value is None else f"{value:.3f}"


def roc_grid(curves: Mapping[str, tuple[np.ndarray, np.ndarray, float | None, tuple[float, float] | None]]) -> str:
    """Grid of ROC curves. ``curves[label] = (fpr, tpr, the recorded auroc, youden (fpr, tpr) or None)``."""
    labels = list(curves)
    ncols = 5
    nrows = max(1, math.ceil(len(labels) / ncols))
    fig = Figure(figsize=(2.6 * ncols, 2.7 * nrows))
    axes = np.atleast_1d(fig.subplots(nrows, ncols, squeeze=False)).ravel()
    for ax, label in zip(axes, labels):
        fpr, tpr, auc, youden = curves[label]
        ax.plot([0, 1], [0, 1], ls="--", color="#bbbbbb", lw=0.8)
        ax.plot(fpr, tpr, color=OURS_COLOR, lw=1.5)
        if youden is not None:
            ax.plot([youden[0]], [youden[1]], "o", color=CHEXNET_COLOR, ms=4)
        ax.set_title(f"{display_name(label)} (AUROC {_three(auc)})", fontsize=9)
        _unit_axes(ax, "1 - specificity", "sensitivity")
        ax.set_aspect("equal")
    for ax in axes[len(labels):]:
        ax.set_visible(False)
    fig.tight_layout()
    return figure_to_data_uri(fig)


def _grid(n: int, ncols: int = 5, size: tuple[float, float] = (2.6, 2.7)) -> tuple[Figure, np.ndarray]:
    """A figure of ``n`` panels with a fixed layout (``tight_layout`` costs a third of such a figure)."""
    nrows = max(1, math.ceil(n / ncols))
    fig = Figure(figsize=(size[0] * ncols, size[1] * nrows))
    axes = np.atleast_1d(fig.subplots(nrows, ncols, squeeze=False)).ravel()
    fig.subplots_adjust(left=0.05, right=0.98, bottom=0.6 / (size[1] * nrows), top=1 - 0.35 / (size[1] * nrows),
                        wspace=0.4, hspace=0.6)
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, axes


def pr_grid(curves: Mapping[str, tuple[np.ndarray, np.ndarray, float | None, float]]) -> str:
    """Precision-recall per label. ``curves[label] = (recall, precision, auprc, prevalence)``; the dashed
    line is the prevalence, the AUPRC of a model that guesses."""
    fig, axes = _grid(len(curves))
    for ax, (label, (recall, precision, auprc, prevalence)) in zip(axes, curves.items()):
        ax.axhline(prevalence, ls="--", color="#bbbbbb", lw=0.8)
        ax.step(recall, precision, where="post", color=OURS_COLOR, lw=1.5)
        ax.set_title(f"{display_name(label)}\nAUPRC {_three(auprc)}, prevalence {prevalence:.3f}", fontsize=8)
        _unit_axes(ax, "recall (sensitivity)", "precision (PPV)")
    return figure_to_data_uri(fig, tight=False)


def reliability_grid(bins: Mapping[str, Sequence[Mapping[str, float]]]) -> str:
    """Reliability diagram per label: fraction positive against mean predicted probability per bin
    (marker area ~ images in the bin); the diagonal is perfect calibration."""
    fig, axes = _grid(len(bins))
    for ax, (label, rows) in zip(axes, bins.items()):
        ax.plot([0, 1], [0, 1], ls="--", color="#bbbbbb", lw=0.8)
        if rows:
            x = [b["mean_predicted"] for b in rows]
            y = [b["fraction_positive"] for b in rows]
            n = np.asarray([b["count"] for b in rows], float)
            ax.plot(x, y, "-", color=OURS_COLOR, lw=1.0)
            ax.scatter(x, y, s=12 + 80 * n / n.max(), color=OURS_COLOR, zorder=3)
        ax.set_title(display_name(label), fontsize=9)
        _unit_axes(ax, "mean predicted probability", "fraction positive")
    return figure_to_data_uri(fig, tight=False)


def saliency_row(images: Sequence[np.ndarray], heatmaps: Sequence[np.ndarray], meta: Sequence[Mapping[str, Any]],
                 *, tile: int = 160) -> str:
    """One finding's gallery: each input (grey, as the model saw it, min-max scaled) with its Grad-CAM
    overlaid (jet, 40%), the reference boxes (green) and where the map points (the pointing game's
    point: the tied maximum nearest their centroid, a white cross), captioned with TP/FP and the score. Drawn
    with PIL (a matplotlib figure per finding cost 0.35 s each)."""
    from matplotlib import colormaps
    from PIL import Image, ImageDraw
    jet, caption = colormaps["jet"], 14
    out = Image.new("RGB", (tile * max(len(images), 1) + 4 * len(images), tile + caption), "white")
    for k, (img, heat, m) in enumerate(zip(images, heatmaps, meta)):
        side = img.shape[0]
        grey = (img - img.min()) / max(float(img.max() - img.min()), 1e-6)
        rgb = np.repeat(grey[..., None], 3, axis=2)
        top = float(heat.max())
        if top > 0:
            rgb = 0.6 * rgb + 0.4 * jet(heat / top)[..., :3]
        pic = Image.fromarray((rgb * 255).astype(np.uint8)).resize((tile, tile), Image.Resampling.NEAREST)
        draw, f = ImageDraw.Draw(pic), tile / side
        for x0, y0, x1, y1 in m.get("boxes", []):
            draw.rectangle([x0 * f, y0 * f, x1 * f - 1, y1 * f - 1], outline=(0, 224, 0), width=2)
        px, py = m.get("point") or (None, None)      # the evaluation's point (None: no saliency)
        if px is not None:
            cx, cy, r = px * f, py * f, 5
            draw.line([cx - r, cy - r, cx + r, cy + r], fill="white", width=2)
            draw.line([cx - r, cy + r, cx + r, cy - r], fill="white", width=2)
        x = k * (tile + 4)
        out.paste(pic, (x, caption))
        ImageDraw.Draw(out).text((x + 2, 1), f"{m.get('kind', '')} {m.get('score', float('nan')):.2f}", fill="black")
    buf = io.BytesIO()
    out.save(buf, format="PNG")
    return png_data_uri(buf.getvalue())
