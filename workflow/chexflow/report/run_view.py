"""What was run: the datasets (manifests), the stages (config and training logs) and their training curves."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from chexflow import host
from chexflow.report import plots
from chexflow.report.external_view import labelling_text
from chexflow.report.templating import hms, mean_of

PILOT_BANNER = ("PILOT on {n_parts} of {n_release} archives of {title}: {n_found:,} of the {n_listed:,} images "
                "named in the split lists were used. These numbers are NOT comparable with CheXNet or the other "
                "published results.")
EPOCH_KEYS = ("epoch", "train_loss", "val_loss", "val_metric", "val_metric_name", "lr", "images_per_sec",
              "epoch_time_s", "world_size")


def dataset_view(name: str, manifest: dict[str, Any], path: Path) -> dict[str, Any]:
    splits = [{"name": split, "n_images": info.get("n_images"), "n_patients": info.get("n_patients"),
               "n_shards": info.get("n_shards", len(info.get("shards", []) or [])), "n_listed": info.get("n_listed")}
              for split, info in manifest["splits"].items()]
    prevalence = []
    for label in manifest["labels"]:
        cells = []
        for split, info in manifest["splits"].items():
            count = (info.get("label_counts") or {}).get(label)
            n = info.get("n_images") or 0
            cells.append({"count": count, "pct": (100.0 * count / n) if count is not None and n else None})
        unknown = [(info.get("unknown_counts") or {}).get(label) for info in manifest["splits"].values()]
        prevalence.append({"label": plots.display_name(str(label)), "cells": cells,
                           "unknown": unknown if any(unknown) else None})
    return {"name": name, "title": manifest.get("title", name), "synthetic": bool(manifest.get("synthetic", False)),
            "split_source": manifest.get("split_source"), "release": release_text(manifest),
            "task": manifest.get("task", "?"), "image_size": manifest.get("image_size"),
            "n_rejects": manifest.get("n_rejects"), "splits": splits, "split_names": list(manifest["splits"]),
            "prevalence": prevalence, "path": str(path),
            "labelling": labelling_text(manifest.get("labelling")),
            "notes": list((manifest.get("labelling") or {}).get("notes") or [])}


def release_text(manifest: dict[str, Any]) -> str:
    """How much of the release a dataset's shards hold (from the manifest's coverage record)."""
    cov = manifest.get("coverage")
    if not cov:
        return "coverage not recorded"
    used = f"{cov.get('n_used', cov['n_found']):,} of {cov['n_listed']:,} listed images"
    if cov.get("n_rejected"):        # found but not usable: the manifest's rejects name each and why
        used += f", {cov['n_rejected']:,} rejected"
    if manifest.get("labelling"):       # a label-table dataset: images read from its folder, by shard job
        return f"{used}, read from the image folder by {len(cov['parts'])} shard job(s)"
    if cov.get("pilot"):
        return (f"PILOT on {len(cov['parts'])} of {cov['n_release_parts']} archives ({', '.join(cov['parts'])}): "
                f"{used}; not comparable with published results")
    return f"all {len(cov['parts'])} archives: {used}"


def run_view(config: dict[str, Any], manifests: dict[str, dict[str, Any]], pretrain: list[dict[str, Any]],
             finetune: list[dict[str, Any]]) -> dict[str, Any]:
    """What was run, from the config, the manifests and the training logs: architectures,
    datasets, backends, world sizes, the split used and how much of the release."""
    study = config.get("study") or {}
    names = list(manifests)
    stages = []
    for key, what, epochs, fallback in (("pretrain", "pretraining", pretrain, names[:1]),
                                        ("finetune", "fine-tuning", finetune, names[-1:])):
        section = config.get(key) or {}
        dataset = study.get(f"{key}_dataset") or (fallback[0] if fallback else None)
        manifest = manifests.get(dataset, {})
        world = epochs[-1].get("world_size")
        stages.append({
            "what": what, "dataset": dataset, "title": manifest.get("title", dataset or "unknown dataset"),
            "arch": (section.get("model") or {}).get("arch", "unknown architecture"),
            "backend": section.get("backend", "unknown backend"),
            "world": "?" if world is None else world,
            "split": manifest.get("split_source") or "not recorded",
            "release": release_text(manifest) if manifest else "n/a",
            "hosts": hosts_text(epochs),
        })
    subtitle = " and ".join(f"{s['arch']} {s['what']} on {s['title']} ({s['backend']}, {s['world']} rank"
                            f"{'' if s['world'] == 1 else 's'})" for s in stages)
    fine = stages[-1]
    cov = manifests.get(fine["dataset"], {}).get("coverage") or {}
    pilot = None
    if cov.get("pilot"):
        pilot = PILOT_BANNER.format(n_parts=len(cov["parts"]), n_release=cov["n_release_parts"], title=fine["title"],
                                    n_found=cov["n_found"], n_listed=cov["n_listed"])
    return {"subtitle": subtitle, "stages": stages, "pilot_banner": pilot}


def hosts_text(epochs: list[dict[str, Any]]) -> str:
    """Where a training's epochs were measured: one host, or each host with its epochs (a requeue
    may resume a run on another node, whose speed and kernels differ)."""
    runs: list[tuple[str, list[Any]]] = []
    for e in epochs:
        text = host.summary(e.get("host"))
        if runs and runs[-1][0] == text:
            runs[-1][1].append(e.get("epoch"))
        else:
            runs.append((text, [e.get("epoch")]))
    if len(runs) == 1:
        return runs[0][0]
    span = lambda ep: f"epoch {ep[0]}" if len(ep) == 1 else f"epochs {ep[0]}-{ep[-1]}"   # noqa: E731
    return "; ".join(f"{span(ep)}: {text}" for text, ep in runs)


def training_view(epochs: list[dict[str, Any]], title: str, *, tested: dict[str, Any] | None = None) -> dict[str, Any]:
    """``tested``: the evaluation's metrics of the model file (which epoch was tested)."""
    last = epochs[-1]
    total = sum(float(e.get("epoch_time_s") or 0.0) for e in epochs)
    metric_name = str(last.get("val_metric_name") or "val_metric")
    best = max((e for e in epochs if e.get("val_metric") is not None), key=lambda e: e["val_metric"], default=None)
    return {
        "title": title,
        "plot": plots.training_curves(epochs, title),
        "n_epochs": len(epochs),
        "world_size": last.get("world_size"),
        "total_time": hms(total),
        "metric_name": metric_name.replace("_", " "),
        "final_metric": last.get("val_metric"),
        "best_metric": None if best is None else best["val_metric"],
        "best_epoch": None if best is None else best["epoch"],
        "mean_images_per_sec": mean_of([e.get("images_per_sec") for e in epochs]),
        "rows": [{k: e.get(k) for k in EPOCH_KEYS} for e in epochs],
        "tested_epoch": None if tested is None else tested.get("model_epoch"),
        "tested_metric": None if tested is None else tested.get("model_val_metric"),
    }

