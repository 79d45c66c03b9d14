"""The report's views of the evaluation's analyses: AUROC and underdiagnosis by subgroup, where the
model looks (pointing game and gallery), and the published results. Each view only arranges a record
that ``chexflow.evaluate`` computed (metrics.json, saliency.npz); nothing is recomputed here."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from chexflow.evaluate import published
from chexflow.report import plots
from chexflow.report.errors import ReportInputError
from chexflow.report.inputs import opened

ATTRIBUTE_NAMES = {"sex": "Sex", "age_band": "Age (years)", "view": "View position"}


def attribute_name(attr: str) -> str:
    """``sex`` -> Sex; an intersection ``sex x view`` -> Sex x View position."""
    return " x ".join(ATTRIBUTE_NAMES.get(a, a) for a in attr.split(" x "))


def subgroup_view(metrics: dict[str, Any]) -> dict[str, Any] | None:
    sub = metrics.get("subgroups")
    if not sub:
        return None
    groups = []
    for g in sub["groups"]:
        if g["group"] == "unknown" and not g["n_images"]:
            continue
        details = [{"display": plots.display_name(lab), **e} for lab, e in g["labels"].items()]
        no_ci = [f"{d['display']} ({d.get('n_pos_patients', '?')} pos. / {d.get('n_neg_patients', '?')} neg. patients)"
                 for d in details if d["auroc"] is not None and d["ci"] is None]
        groups.append({**g, "attribute_name": attribute_name(g["attribute"]), "details": details, "no_ci": no_ci})
    return {"groups": groups, "min_count": sub.get("min_count"), "age_bands": sub.get("age_bands"),
            "n_no_ci": sum(len(g["no_ci"]) for g in groups)}


def underdiagnosis_view(metrics: dict[str, Any]) -> dict[str, Any] | None:
    """The underdiagnosis record: overall, per subgroup, and the intersections large enough for a CI
    (how many smaller ones were left out is said)."""
    rec = metrics.get("underdiagnosis")
    if not rec:
        return None

    def named(cells: list[dict]) -> list[dict]:
        return [{**c, "attribute_name": attribute_name(c["attribute"])} for c in cells]

    for key in ("groups", "intersections"):
        for k, c in enumerate(rec.get(key) or []):
            _check_cell(c, f"underdiagnosis.{key}[{k}]")
    if rec.get("overall") is not None:
        _check_cell(rec["overall"], "underdiagnosis.overall")
    inter = named(rec.get("intersections") or [])
    shown = [c for c in inter if not c.get("too_few")]
    return {**rec, "groups": named(rec.get("groups") or []), "intersections": shown,
            "n_intersections_left_out": len(inter) - len(shown), "overall": rec.get("overall")}


CELL_KEYS = ("attribute", "group", "note", "too_few")
RATE_KEYS = ("n", "missed", "rate", "ci", "interval")
VERDICT_KEYS = ("n", "n_no_saliency", "n_pointed", "n_patients", "hits", "hits_range", "n_tied", "hit_rate", "ci",
                "random_point", "centre_point", "p_above", "mean_iobb", "mean_iobb_ci", "unit", "verdict_text", "elsewhere")


def _check_cell(cell: Any, where: str) -> None:
    """An underdiagnosis cell of metrics.json as the evaluation writes it, or an error naming the key."""
    ok = isinstance(cell, dict) and all(k in cell for k in CELL_KEYS) and all(
        isinstance(cell.get(level), dict) and all(k in cell[level] for k in RATE_KEYS)
        for level in ("image", "patient", "companion"))
    if not ok:
        raise ReportInputError(f"metrics.json: {where} must be an object with {list(CELL_KEYS)} and image/patient/companion "
                               f"rates {list(RATE_KEYS)}, got {str(cell)[:200]}")


def localisation_view(metrics: dict[str, Any], saliency: Path | None, labels: list[str]) -> dict[str, Any] | None:
    loc = metrics.get("localisation")
    if not loc and saliency is None:
        return None
    loc = loc or {}
    for lab, e in (loc.get("labels") or {}).items():
        if not isinstance(e, dict) or any(k not in e for k in VERDICT_KEYS):
            raise ReportInputError(f"metrics.json: localisation.labels[{lab!r}] must be an object with "
                                   f"{list(VERDICT_KEYS)} (an evaluation of this version), got {str(e)[:200]}")
    rows = [{"display": plots.display_name(lab), **e, "auroc": metrics["labels"].get(lab, {}).get("auroc")}
            for lab, e in (loc.get("labels") or {}).items()]
    totals = {k: sum(r.get(k) or 0 for r in rows) for k in ("n", "n_no_saliency", "n_pointed", "n_tied", "hits")}
    totals["hits_range"] = [sum((r.get("hits_range") or [0, 0])[i] for r in rows) for i in (0, 1)]
    gallery = _gallery(saliency, labels) if saliency is not None else None
    return {**{k: loc.get(k) for k in ("method", "layer", "layer_side", "crop", "level", "tie_rtol", "min_patients")},
            "boxes": loc.get("boxes"), "rows": rows, "totals": totals, "gallery": gallery,
            "elsewhere": [r["display"] for r in rows if r.get("elsewhere")]}


def _gallery(path: Path, labels: list[str]) -> list[dict[str, Any]]:
    """The saliency gallery (saliency.npz of the evaluation): one overlay figure per finding."""
    with opened(path, "saliency gallery") as fh:
        try:
            with np.load(fh, allow_pickle=False) as z:
                inputs, heat = z["inputs"].astype(np.float32), z["heatmaps"].astype(np.float32)
                meta = json.loads(str(z["meta"]))
        except (OSError, ValueError, KeyError, json.JSONDecodeError) as exc:
            raise ReportInputError(f"{path}: not a saliency gallery of chexflow evaluate ({exc})") from exc
    if not (len(meta) == len(inputs) == len(heat)):
        raise ReportInputError(f"{path}: {len(meta)} entries but {len(inputs)} inputs and {len(heat)} heatmaps")
    out = []
    for lab in labels:
        idx = [k for k, m in enumerate(meta) if m.get("label") == lab]
        if idx:
            out.append({"display": plots.display_name(lab), "n": len(idx),
                        "plot": plots.saliency_row([inputs[k] for k in idx], [heat[k] for k in idx],
                                                   [meta[k] for k in idx])})
    return out


def published_view() -> dict[str, Any]:
    """The published results, the official-split state of the art marked."""
    sota = {p.key for p in published.OFFICIAL_SPLIT_STATE_OF_THE_ART}
    return {"rows": [{"result": p, "sota": p.key in sota} for p in published.PUBLISHED],
            "caveat": published.SPLIT_CAVEAT}


def limitations(ctx: dict[str, Any]) -> list[str]:
    """What the subgroups, underdiagnosis and localisation show about the limits of the numbers."""
    out = []
    loc = ctx["localisation"]
    if loc and loc["elsewhere"]:
        out.append(f"{', '.join(loc['elsewhere'])}: the AUROC's CI lies above 0.5, while the heatmaps' peak falls in the "
                   "box less often than a random point's (patients as the unit, p < 0.025).")
    sub = ctx["subgroups"]
    if sub:
        small = [f"{g['attribute_name'].lower()} {g['group']}" for g in sub["groups"]
                 if g["group"] != "unknown" and g["mean_ci"] is None]
        if small:
            out.append(f"Subgroups too small for a CI: {', '.join(small)}.")
        if sub["n_no_ci"]:
            out.append(f"{sub['n_no_ci']} subgroup x finding AUROCs rest on fewer than {sub['min_count']} positive or "
                       "negative patients: shown without a CI.")
    und = ctx.get("underdiagnosis")
    if und and und.get("overall") is None:
        out.append(f"No underdiagnosis rate: {und.get('note')}.")
    elif und and not und.get("detectable"):
        out.append(f"The underdiagnosis audit cannot detect underdiagnosis at its operating point: {und.get('verdict')}.")
    elif und:
        higher = [f"{c['attribute_name'].lower()} {c['group']}" for c in und["groups"] if c.get("verdict") == "higher"]
        if higher:
            out.append(f"Underdiagnosis higher than in the rest of the attribute (95% CI of the difference above 0): "
                       f"{', '.join(higher)}.")
    return out
