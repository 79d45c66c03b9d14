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

import pandas as pd

from chexflow.evaluate import published
from chexflow.evaluate.metrics import paired_bootstrap_auroc_diff, paired_bootstrap_over_seeds
from chexflow.fsutil import write_text_atomic
from chexflow.report import analyses, plots
from chexflow.report.ablation_arms import aligned as _aligned
from chexflow.report.ablation_arms import published_comparisons
from chexflow.report.ablation_arms import verdict as _verdict
from chexflow.report.errors import ReportInputError
from chexflow.report.inputs import (INPUTS, check_inputs, load_benchmark, load_manifest, load_metrics_json,
                                    load_metrics_jsonl, load_predictions)
from chexflow.report.provenance import collect_provenance, package_versions
from chexflow.report.results_view import auroc_rows, calibration_view, mean_row, roc_view
from chexflow.report.run_view import dataset_view, run_view
from chexflow.report.run_view import training_view as _training_view
from chexflow.report.studies_view import scaling_view, sweep_view
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
    weak = [r.display for r in ctx["rows"] if r.ci_low is not None and r.ci_low <= 0.5]
    if weak:
        out.append(f"The AUROC CI includes chance (0.5) or lies below it for {', '.join(weak)}.")
    roc = ctx["roc"]
    if roc and roc.get("n_few"):
        few = [o["display"] for o in roc["operating_points"] if o["few"]]
        out.append(f"Operating points of {', '.join(few)} rest on fewer than {roc['min_val_positives']} validation "
                   "positives (images or patients): their thresholds are unstable.")
    out += analyses.limitations(ctx)
    abl = ctx["ablation"]
    if abl and len(abl["seeds"]) == 1:
        out.append("The ablation rests on one training seed per arm: its CI covers the test patients, not training "
                   "randomness (ablation.seeds runs several).")
    return out


# --------------------------------------------------------------------------- ablation
def _arm_name(init: str) -> str:
    names = {"pretrained": "Fine-tuned from the pretraining model", "random": "Fine-tuned from random init",
             "file": "Fine-tuned from published weights (init_file)"}
    return names.get(init, init)


def _ablation_view(runs: dict[str, dict[str, Path]], labels: list[str], config: dict,
                   main_metrics: dict[str, Any]) -> dict[str, Any] | None:
    """Pretrained vs random init, per training seed and over seeds: each run's test mean AUROC and
    tested epoch, the paired patient-bootstrap CI of the gain on the same images, per finding with CIs."""
    loaded = []
    for name, files in runs.items():
        m = load_metrics_json(files["metrics"])
        init, seed = m["model_init"], m["model_seed"]
        if init not in ("pretrained", "random", "file") or seed is None:
            raise ReportInputError(f"{files['metrics']}: names no init/seed of its model (model_init, model_seed)")
        loaded.append({"name": name, "init": init, "seed": int(seed), "metrics": m, "files": files,
                       "predictions": load_predictions(files["predictions"], labels),
                       "epochs": load_metrics_jsonl(files["training"], f"ablation run {name}")})
    by = {(r["init"], r["seed"]): r for r in loaded}
    seeds = sorted({r["seed"] for r in loaded if ("pretrained", r["seed"]) in by and ("random", r["seed"]) in by})
    if not seeds:
        raise ReportInputError("the ablation's runs hold no seed with both arms (pretrained and random)")
    ev = config.get("evaluate") or {}
    boot = {"n_resamples": int(ev.get("bootstrap_resamples", 1000)), "seed": int(ev.get("seed", 0))}
    ref = by[("pretrained", seeds[0])]["predictions"]
    pairs = [(_aligned(ref, by[("pretrained", s)]), _aligned(ref, by[("random", s)])) for s in seeds]
    y = ref[labels].to_numpy(float)
    cols = [f"{lab}_score" for lab in labels]
    scores = [(p[cols].to_numpy(float), r[cols].to_numpy(float)) for p, r in pairs]
    per_seed = []
    for s_, (a, b) in zip(seeds, scores):
        res = paired_bootstrap_auroc_diff(y, a, b, ref["patient"].to_numpy(), labels, **boot)
        epochs = {init: by[(init, s_)]["metrics"]["model_epoch"] for init in ("pretrained", "random")}
        per_seed.append({**res, "seed": s_, **_verdict(res["ci"]), "epochs": epochs})
    over = paired_bootstrap_over_seeds(y, scores, ref["patient"].to_numpy(), labels, **boot) if len(seeds) > 1 else None
    first = per_seed[0]
    main_seed = main_metrics.get("model_seed")
    main_init = main_metrics.get("model_init") or "pretrained"
    other = next((r for r in loaded if r["init"] != main_init and r["seed"] == main_seed), None)
    rows = [{"name": _arm_name(r["init"]), "init": r["init"], "seed": r["seed"],
             "mean_auroc": r["metrics"]["mean_auroc"], "ci": r["metrics"]["mean_auroc_ci"], "epoch": r["metrics"]["model_epoch"],
             "n_epochs": len(r["epochs"]), "where": str(r["files"]["metrics"].parent)}
            for r in sorted(loaded, key=lambda r: (r["seed"], ("pretrained", "random", "file").index(r["init"])))]
    return {
        "rows": rows, "seeds": seeds, "per_seed": per_seed, "paired": first if len(seeds) == 1 else None,
        "over_seeds": None if over is None else {**over, **_verdict(over["ci"], over["t_ci"])},
        "per_label": [{"display": plots.display_name(lab), **first["labels"][lab]} for lab in first["labels_used"]],
        "other_training": None if other is None else _training_view(
            other["epochs"], f"Ablation: fine-tuning from {other['init']} init (seed {other['seed']})",
            tested=other["metrics"]),
        "main_init": main_init, "other_init": "pretrained" if main_init == "random" else "random",
        "published": published_comparisons(by, seeds, ref, labels, boot),
    }




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
    ablation = _ablation_view(tree["ablation"], labels, config, metrics) if tree.get("ablation") else None

    rows = auroc_rows(metrics, synthetic=bool(synthetic))
    prov = dict(provenance)
    prov.setdefault("packages", package_versions())
    prov.setdefault("git_commit", "unknown")
    packages = prov.pop("packages")
    training = [_training_view(pretrain, "Pretraining"), _training_view(finetune, "Fine-tuning", tested=metrics)]
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
        "bars": plots.auroc_bars(labels, {r.label: r.ours for r in rows}, published.CHEXNET_AUROC,
                                 published.WANG2017_AUROC),
        "has_ci": any(r.ci_low is not None for r in rows),
        "roc": roc,
        "calibration": calibration_view(metrics, predictions, labels),
        "subgroups": analyses.subgroup_view(metrics),
        "localisation": analyses.localisation_view(metrics, ev.get("saliency"), labels),
        "underdiagnosis": analyses.underdiagnosis_view(metrics),
        "training": training,
        "tested": {"epoch": metrics.get("model_epoch"), "val_metric": metrics.get("model_val_metric")},
        "scaling": scaling,
        "sweep": sweep,
        "ablation": ablation,
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
