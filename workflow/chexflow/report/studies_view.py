"""The optional studies' views: the scaling table and plot, the hyperparameter sweep, the ablation
(its comparison record, computed by ``chexflow.studies.ablation_compare``)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from chexflow.fsutil import read_json
from chexflow.report import plots
from chexflow.report.errors import ReportInputError
from chexflow.report.inputs import (load_comparison, load_metrics_json, load_metrics_jsonl, png_data_uri, read_csv,
                                    records)
from chexflow.report.run_view import training_view

ARM_NAMES = {"pretrained": "Fine-tuned from the pretraining model", "random": "Fine-tuned from random init",
             "file": "Fine-tuned from published weights (init_file)"}


def scaling_view(csv: Path, plot: Path | None) -> dict[str, Any]:
    df = read_csv(csv, "scaling table", ("world_size", "images_per_sec", "images_per_sec_per_rank", "speedup",
                                         "efficiency", "time_per_epoch_s"))
    return {"rows": records(df), "plot": png_data_uri(plot, "scaling plot") if plot else None,
            "baseline": int(df["world_size"].min()), "path": str(csv), "one_machine": _one_machine(df)}


def _one_machine(df: pd.DataFrame) -> dict[str, Any] | None:
    """The cores the ranks shared when every world size ran on one machine (None: unknown or several nodes)."""
    if not {"nodes", "cores_per_node"} <= set(df.columns):
        return None
    nodes = pd.to_numeric(df["nodes"], errors="coerce")
    cores = pd.to_numeric(df["cores_per_node"], errors="coerce")
    if nodes.isna().any() or cores.isna().any() or (nodes != 1).any() or cores.nunique() != 1:
        return None
    threads = pd.to_numeric(df.get("threads_per_rank"), errors="coerce") if "threads_per_rank" in df else None
    return {"cores": int(cores.iloc[0]), "max_world": int(df["world_size"].max()),
            "threads": None if threads is None or threads.isna().any()
            else {int(w): int(t) for w, t in zip(df["world_size"], threads)}}


def sweep_view(table_csv: Path, selection_json: Path, winner_metrics: Path | None) -> dict[str, Any]:
    df = read_csv(table_csv, "sweep table", ("trial", "status", "val_metric", "winner"))
    selection = read_json(selection_json, ReportInputError, what="sweep selection")
    fixed = {"trial", "status", "val_metric", "val_metric_name", "best_epoch", "reason", "winner"}
    params = [c for c in df.columns if c not in fixed]
    test = load_metrics_json(Path(winner_metrics)) if winner_metrics else None
    winner = selection.get("winner", {}) if isinstance(selection, dict) else {}
    return {"rows": records(df), "params": params, "winner": winner.get("trial"),
            "winner_params": winner.get("params", {}), "winner_val": winner.get("val_metric"),
            "n_trials": len(df), "n_failed": int((df["status"] != "ok").sum()),
            "test_mean_auroc": None if test is None else test["mean_auroc"],
            "test_mean_auroc_ci": None if test is None else test["mean_auroc_ci"]}



def ablation_view(comparison_json: Path) -> dict[str, Any]:
    """The ablation's section from its comparison record: each run's test mean AUROC and tested epoch,
    pretrained - random per seed (the headline when one seed), over seeds, per finding, the
    published-weights arm's comparisons, and the other arm's training curves (main training seed)."""
    rec = load_comparison(comparison_json)
    first = rec["per_seed"][0]
    rows = [{"name": ARM_NAMES[r["init"]], "init": r["init"], "seed": r["seed"], "mean_auroc": r["mean_auroc"],
             "ci": r["mean_auroc_ci"], "epoch": r["epoch"], "n_epochs": r["n_epochs"],
             "where": str(Path(r["metrics"]).parent)} for r in rec["runs"]]
    other = next((r for r in rec["runs"] if r["init"] != rec["main_init"] and r["seed"] == rec["main_seed"]), None)
    return {
        "rows": rows, "seeds": rec["seeds"], "per_seed": rec["per_seed"],
        "paired": first if len(rec["seeds"]) == 1 else None, "over_seeds": rec["over_seeds"],
        "per_label": [{"display": plots.display_name(lab), **first["labels"][lab]} for lab in first["labels_used"]],
        "other_training": None if other is None else training_view(
            load_metrics_jsonl(Path(other["training"]), f"ablation run {other['name']}"),
            f"Ablation: fine-tuning from {other['init']} init (seed {other['seed']})",
            tested={"model_epoch": other["epoch"], "model_val_metric": other["val_metric"]}),
        "main_init": rec["main_init"], "other_init": rec["other_init"], "published": rec["published"],
    }
