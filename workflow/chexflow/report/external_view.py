"""The external validations' view: per external test set, internal and external AUROC side by side per
shared finding, each with its CI, the drop with its CI and verdict (``chexflow.evaluate.external``
decides it and stores it), the findings the label map could not match, and the internal audits on the
external set beside the internal ones (calibration, AUROC by subgroup, underdiagnosis). Renders the
records; computes nothing."""
from __future__ import annotations

from typing import Any

from chexflow.evaluate.intervals import ci_columns
from chexflow.report import plots


def labelling_text(labelling: dict[str, Any] | None) -> str | None:
    """A label table's policy as one sentence (the manifest's ``labelling``)."""
    if not labelling:
        return None
    uncertain = labelling.get("uncertain") or {}
    by_policy: dict[str, list[str]] = {}
    for finding, policy in uncertain.items():
        by_policy.setdefault(policy, []).append(plots.display_name(finding))
    names = {"ones": "positive (U-Ones)", "zeros": "negative (U-Zeros)", "ignore": "unknown, masked (U-Ignore)"}
    parts = [f"uncertain read as {names.get(p, p)} for {', '.join(f)}" for p, f in by_policy.items()]
    blank = "negative" if labelling.get("blank") == "negative" else "unknown, masked"
    views = "frontal images only (lateral left out)" if labelling.get("views") == "frontal" else "all views"
    return "; ".join([*parts, f"blank (not mentioned) read as {blank}", views]) + "."


def _side(e: dict[str, Any]) -> dict[str, Any]:
    return {"auroc": e.get("auroc"), **ci_columns(e.get("ci")), "n_pos": e.get("n_pos"),
            "n_neg": e.get("n_neg"), "n_unknown": e.get("n_unknown"), "too_few": e.get("too_few")}


def _calibration(f: dict[str, Any]) -> dict[str, Any]:
    """A matched finding's ECE and Brier score on each test set, each with its interval (or none)."""
    cal = f.get("calibration") or {}

    def side(which: str) -> dict[str, Any]:
        c, iv = cal.get(which) or {}, cal.get(f"{which}_intervals") or {}
        return {"ece": c.get("ece"), "ece_ci": iv.get("ece_ci"), "brier": c.get("brier"), "brier_ci": iv.get("brier_ci")}
    return {"display": plots.display_name(f["finding"]), "internal": side("internal"), "external": side("external")}


def _subgroups(rec: dict[str, Any]) -> list[dict[str, Any]]:
    """The external set's AUROC by subgroup: each group's mean over its findings with enough patients."""
    sub = rec.get("subgroups") or {}
    return [{"attribute": g["attribute"], "group": g["group"], "n_images": g["n_images"], "n_patients": g["n_patients"],
             "mean_auroc": g.get("mean_auroc"), "ci": g.get("mean_ci"),
             "findings": [plots.display_name(x) for x in g.get("mean_labels") or []], "note": g.get("note") or ""}
            for g in sub.get("groups") or []]


def external_view(records: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per external test set (records by dataset name), in the order given."""
    out = []
    for name, rec in records.items():
        rows = []
        for f in rec["findings"]:
            drop = f["drop"]
            rows.append({"display": plots.display_name(f["finding"]), "external_label": f["external_label"],
                         "internal": _side(f["internal"]), "external": _side(f["external"]), "drop": drop.get("diff"),
                         **ci_columns(drop.get("ci"), "drop_ci"), "verdict": drop.get("verdict_text"),
                         "lower": drop.get("verdict") == "lower"})
        mean = rec["mean"]
        lm = rec["label_map"]
        out.append({"name": name, "title": rec.get("title") or name, "split_source": rec.get("split_source"),
                    "synthetic": rec.get("synthetic"), "n_images": rec["n_images"], "n_patients": rec["n_patients"],
                    "rows": rows, "mean": {**mean, **ci_columns(mean.get("ci")), "verdict": mean.get("verdict_text")},
                    "model_only": [plots.display_name(x) for x in lm["model_only"]], "data_only": lm["data_only"],
                    "near": lm.get("near_not_matched") or [], "labelling": labelling_text(rec.get("labelling")),
                    "bootstrap": rec["bootstrap"], "statistic": rec.get("statistic"),
                    "calibration": [_calibration(f) for f in rec["findings"]], "subgroups": _subgroups(rec),
                    "underdiagnosis": rec.get("underdiagnosis")})
    return out


def limitations(views: list[dict[str, Any]]) -> list[str]:
    out = []
    for v in views:
        lower = [r["display"] for r in v["rows"] if r["lower"]]
        if lower:
            out.append(f"On {v['title']} (external) the AUROC is lower for {', '.join(lower)}: the CI of the drop "
                       "lies above zero.")
        if v["model_only"]:
            out.append(f"Not externally validated on {v['title']}: {', '.join(v['model_only'])} (no matching label).")
    return out
