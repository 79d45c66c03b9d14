"""Render the single-file HTML report of a chexflow run: read each input, arrange it into the view of
its section, fill the templates.

Everything is embedded (inline CSS, figures as base64 PNG data URIs): the HTML opens offline, can be
mailed, and references no external asset. The sections' views live beside this module (``inputs``:
reading the files; ``run_view``, ``results_view``, ``analyses``, ``studies_view``; ``templating``:
the Jinja2 templates under ``templates/``, loaded as package data); this module assembles them.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from chexflow import host
from chexflow.evaluate import published
from chexflow.fsutil import write_text_atomic
from chexflow.report import analyses, external_view, plots
from chexflow.report.errors import ReportInputError
from chexflow.report.inputs import (INPUTS, check_inputs, load_benchmark, load_external, load_manifest,
                                    load_metrics_json, load_metrics_jsonl, load_predictions)
from chexflow.report.provenance import collect_provenance, package_versions
from chexflow.report.results_view import auroc_rows, calibration_view, mean_row, roc_view
from chexflow.report.run_view import dataset_view, run_view, training_view
from chexflow.report.studies_view import ablation_view, scaling_view, sweep_view
from chexflow.report.templating import MODEL_CARD_TEMPLATE, config_yaml, hms, template

__all__ = ["ReportInputError", "render_report", "collect_provenance", "package_versions", "INPUTS"]

SYNTHETIC_BANNER = ("These results are on the embedded SYNTHETIC demo data (phantoms, not real radiographs): "
                    "the numbers say nothing about real chest X-ray performance.")

def limitations_of(ctx: dict[str, Any]) -> list[str]:
    """What the run itself shows about the limits of its numbers (the report's and the model card's list)."""
    out = []
    if ctx["synthetic_datasets"]:
        out.append("Trained and tested on synthetic phantoms: the numbers say nothing about real radiographs.")
    if ctx["run"]["pilot_banner"]:
        out.append("A pilot on part of the release: not comparable with published results.")
    undefined = [r.display for r in ctx["rows"] if r.ours is None]
    if undefined:
        out.append(f"No test AUROC for {', '.join(undefined)}: a single class in the test split.")
    few = [f"{r.display} ({r.too_few})" for r in ctx["rows"] if r.too_few]
    if few:
        out.append(f"AUROC without a CI, too few patients: {'; '.join(few)}.")
    weak = [r.display for r in ctx["rows"] if r.vs_chance in ("includes", "below")]
    if weak:
        out.append(f"The AUROC CI includes chance (0.5) or lies below it for {', '.join(weak)}.")
    roc = ctx["roc"]
    if roc and roc.get("n_few"):
        few = [o["display"] for o in roc["operating_points"] if o["few"]]
        out.append(f"Operating points of {', '.join(few)} rest on fewer than {roc['min_val_positives']} validation "
                   "positives (images or patients): their thresholds are unstable.")
    out += analyses.limitations(ctx)
    out += external_view.limitations(ctx["external"])
    abl = ctx["ablation"]
    if abl and len(abl["seeds"]) == 1:
        out.append("The ablation rests on one training seed per arm: its CI covers the test patients, not training "
                   "randomness (ablation.seeds runs several).")
    return out


# --------------------------------------------------------------------------- entry point
def render_report(out_html: Path, *, inputs: dict[str, Any], config: dict, provenance: dict,
                  model_card: Path | None = None) -> None:
    """Write the self-contained HTML report to ``out_html`` (atomically), and the model card to
    ``model_card`` when given.

    ``inputs``: the report's files as one structure (``INPUTS``; the workflow's report_input_tree);
    a section appears for what is there (the studies switched on, the ablation's runs).
    """
    out_html = Path(out_html)
    tree = check_inputs(inputs)
    ev, tr = tree["evaluation"], tree["training"]
    metrics = load_metrics_json(ev["metrics"])
    labels = list(metrics["labels"])
    pretrain = load_metrics_jsonl(tr["pretrain"], "pretraining")
    finetune = load_metrics_jsonl(tr["finetune"], "fine-tuning")
    loaded = {}
    for role, p in tree.get("manifests", {}).items():
        m = load_manifest(p, role)
        loaded[str(m.get("dataset", role))] = (m, p)
    datasets = [dataset_view(name, m, p) for name, (m, p) in loaded.items()]
    manifests = {name: m for name, (m, _) in loaded.items()}
    synthetic = [d["name"] for d in datasets if d["synthetic"]]
    benchmarks = [load_benchmark(p, stage) for stage, p in tree.get("benchmarks", {}).items()]
    predictions = load_predictions(ev["predictions"], labels) if "predictions" in ev else None
    roc = roc_view(predictions, labels, metrics)

    sc, sw = tree.get("scaling"), tree.get("sweep")
    if sw is not None and {"table", "selection"} - set(sw):
        raise ReportInputError("the sweep section needs both the sweep table and the selection JSON")
    scaling = scaling_view(sc["table"], sc.get("plot")) if sc else None
    sweep = sweep_view(sw["table"], sw["selection"], sw.get("metrics")) if sw else None
    ablation = ablation_view(tree["ablation"]["comparison"]) if tree.get("ablation") else None
    external = external_view.external_view({name: load_external(p) for name, p in tree.get("external", {}).items()})

    rows = auroc_rows(metrics, synthetic=bool(synthetic))
    prov = dict(provenance)
    prov.setdefault("packages", package_versions())
    prov.setdefault("git_commit", "unknown")
    packages = prov.pop("packages")
    training = [training_view(pretrain, "Pretraining"), training_view(finetune, "Fine-tuning", tested=metrics)]
    context = {
        "title": "chexflow report",
        "generated_utc": datetime.now(timezone.utc).replace(microsecond=0).isoformat(),
        "synthetic_banner": SYNTHETIC_BANNER if synthetic else None,
        "run": run_view(config, manifests, pretrain, finetune),
        "synthetic_datasets": synthetic,
        "datasets": datasets,
        "benchmarks": benchmarks,
        "total_stage_time": hms(sum(b["seconds"] for b in benchmarks)) if benchmarks else None,
        "metrics": metrics,
        "rows": rows,
        "mean": mean_row(rows, metrics, synthetic=bool(synthetic)),
        "below_chance": [r for r in rows if r.ours is not None and r.ours < 0.5],
        "bars": plots.auroc_bars(labels, {r.label: r.ours for r in rows},
                                 *((published.CHEXNET_AUROC, published.WANG2017_AUROC) if metrics.get("published_comparable")
                                   else ({}, {}))),
        "has_ci": any(r.ci_low is not None for r in rows),
        "min_patients": metrics.get("min_patients"),
        "roc": roc,
        "calibration": calibration_view(metrics, predictions, labels),
        "subgroups": analyses.subgroup_view(metrics),
        "localisation": analyses.localisation_view(metrics, ev.get("saliency"), labels),
        "underdiagnosis": analyses.underdiagnosis_view(metrics),
        "training": training,
        "tested": {"epoch": metrics.get("model_epoch"), "val_metric": metrics.get("model_val_metric")},
        "evaluation_host": host.summary(metrics.get("host")),
        "scaling": scaling,
        "sweep": sweep,
        "ablation": ablation,
        "external": external,
        "published": analyses.published_view(),
        "split_caveat": published.SPLIT_CAVEAT,
        "config_yaml": config_yaml(config),
        "config": config,
        "provenance": prov,
        "packages": packages,
    }
    context["limitations"] = limitations_of(context)
    context["model_card_text"] = template(MODEL_CARD_TEMPLATE, html=False).render(**context)
    write_text_atomic(out_html, template().render(**context))
    if model_card is not None:
        write_text_atomic(Path(model_card), context["model_card_text"])
