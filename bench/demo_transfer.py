"""Does pretraining help fine-tuning on the embedded demo? (issue 12)

Builds, once, the demo release (fine-tuning data, config.yaml's demo_release) and the pretraining
corpus (demo_pretrain_release: a second phantom release from the disjoint "pretrain" patient
pool), shards both, then for one recipe: pretraining -> fine-tuning from it and from random init
(same budget) for each seed -> test AUROC of both and their paired patient-bootstrap difference
(metrics.paired_bootstrap_auroc_diff, as the report computes it). Stages run as the workflow runs
them (`chexflow split|shards|gather|train|evaluate`) on one rank with one core
(OMP_NUM_THREADS=1) and config.yaml's batch sizes, as the workstation profile runs the demo (one
rank per training job, one core each), so a seed's row is what the demo reports for that seed.

usage: python bench/demo_transfer.py WORKDIR '{}' --name default [--seeds 0,1,2]
  the JSON: overrides {"corpus": {...demo_pretrain_release keys...}, "pretrain": {...},
  "finetune": {...}, "evaluate": {...}} of config.yaml's sections (dotted keys allowed, e.g.
  "optim.lr"); '{}' = the defaults of config.yaml.
Prints one row per seed and the mean/sd, with wall and CPU (user+sys of the children) seconds.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def setkey(d: dict, key: str, value) -> None:
    *head, last = key.split(".")
    for k in head:
        d = d.setdefault(k, {})
    d[last] = value


def section(conf: dict, name: str, overrides: dict) -> dict:
    """config.yaml's section ``name`` (a training stage: over the shared training: section) with overrides."""
    from chexflow.config import stage_settings
    from chexflow.train.config import STAGES
    base = stage_settings(conf, name, "") if name in STAGES else conf.get(name, {})
    out = {k: v for k, v in copy.deepcopy(base).items() if k not in ("stage", "dataset")}
    for k, v in overrides.items():
        setkey(out, k, v)
    return out


def cpu_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run(cmd: list[str], log: Path, env: dict) -> None:
    with open(log, "w") as fh:
        r = subprocess.run([str(c) for c in cmd], env=env, stdout=fh, stderr=subprocess.STDOUT)
    if r.returncode:
        sys.exit(f"failed ({r.returncode}): {' '.join(map(str, cmd))[:300]}\nsee {log}")


def build(work: Path, name: str, dataset: str, release: dict, shard_cfg: dict, env: dict) -> Path:
    """Release + split + shards + gather of one phantom release; returns its manifest."""
    from chexflow.data.config import DemoReleaseConfig
    from chexflow.settings import from_dict
    from chexflow.data import registry
    from chexflow.data.phantoms.release import make_release
    manifest = work / "shards" / name / "manifest.json"
    if manifest.exists():
        return manifest
    raw = work / "raw" / name
    make_release(raw, pool=registry.get(dataset).patient_pool, **release)
    sdir = work / "shards" / name
    sdir.mkdir(parents=True, exist_ok=True)
    cfg = json.dumps({**shard_cfg, "dataset": dataset})
    chex = BIN / "chexflow"
    run([chex, "split", "--config-json", cfg, "--raw", raw, "--out", sdir / "splits.csv"], sdir / "split.log", env)
    n_arch = from_dict(DemoReleaseConfig, release).n_archives
    parts = []
    for i in range(1, n_arch + 1):
        part = f"images_{i:03d}"
        run([chex, "shards", "--config-json", cfg, "--part", part, "--raw", raw, "--splits", sdir / "splits.csv",
             "--out", sdir / "parts" / part], sdir / f"{part}.log", env)
        parts.append(sdir / "parts" / part / "manifest.json")
    run([chex, "gather", "--config-json", cfg, "--splits", sdir / "splits.csv", "--out", manifest, *parts],
        sdir / "gather.log", env)
    return manifest


def train(out: Path, cfg: dict, manifest: Path, env: dict, pretrained: Path | None = None) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    if (out / "model.pt").exists():
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    cmd = [BIN / "chexflow", "train", "--config-json", json.dumps(cfg), "--manifest", manifest,
           "--out-dir", out, "--ckpt-dir", out / "ckpt"]
    if pretrained is not None:
        cmd += ["--pretrained", pretrained]
    run(cmd, out / "train.log", env)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def evaluate(out: Path, cfg: dict, model: Path, manifest: Path, env: dict) -> dict:
    if not (out / "metrics.json").exists():
        run([BIN / "chexflow", "evaluate", "--config-json", json.dumps(cfg), "--model", model,
             "--manifest", manifest, "--out-dir", out], out.parent / f"{out.name}.log", env)
    return json.loads((out / "metrics.json").read_text())


def paired(pre: pd.DataFrame, rnd: pd.DataFrame) -> dict:
    """Pretrained - random test mean AUROC, paired patient bootstrap (as the report computes it)."""
    from chexflow.data import nih
    from chexflow.evaluate import metrics
    rnd = rnd.set_index("image").loc[pre["image"]].reset_index()
    labels = [c for c in nih.LABELS if c in pre.columns]
    return metrics.paired_bootstrap_auroc_diff(
        pre[labels].to_numpy(float), pre[[f"{c}_score" for c in labels]].to_numpy(float),
        rnd[[f"{c}_score" for c in labels]].to_numpy(float), pre["patient"].to_numpy(), labels,
        n_resamples=1000, seed=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("work", type=Path)
    ap.add_argument("recipe", help="JSON overrides (see the module doc)")
    ap.add_argument("--name", required=True, help="name of this recipe's run directory")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--inits", default="pretrained,random",
                    help="which fine-tuning arms to run (the table needs both, e.g. from an earlier call)")
    args = ap.parse_args()
    rec = json.loads(args.recipe)
    conf = yaml.safe_load((ROOT / "config.yaml").read_text())
    env = dict(os.environ, PYTHONPATH=str(ROOT / "workflow"), OMP_NUM_THREADS="1")
    work = args.work
    t0, c0 = time.time(), cpu_children()
    demo = build(work, "demo", "nih_demo", conf["demo_release"], conf["shards"]["nih_demo"], env)
    corpus_rel = section(conf, "demo_pretrain_release", rec.get("corpus", {}))
    ctag = "corpus_{n_images}_{image_size}_{seed}".format(**corpus_rel)
    corpus = build(work, ctag, "nih_demo_pretrain", corpus_rel, conf["shards"]["nih_demo_pretrain"], env)
    print(f"data: {time.time() - t0:.0f} s wall, {cpu_children() - c0:.0f} s CPU", flush=True)

    run_dir = work / "runs" / args.name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "recipe.json").write_text(json.dumps(rec, indent=1))
    pre = section(conf, "pretrain", {"backend": "single", "checkpoint.every_steps": 0, **rec.get("pretrain", {})})
    pre = {**pre, "stage": "pretrain", "dataset": "nih_demo_pretrain"}
    t, c = time.time(), cpu_children()
    rows = train(run_dir / "pretrain", pre, corpus, env)
    for r in rows:
        print(f"  pretrain ep{r['epoch']} train_loss {r['train_loss']:.4f} val_loss {r['val_loss']:.4f}"
              f" val {r['val_metric']:.4f}", flush=True)
    print(f"pretrain: {time.time() - t:.0f} s wall, {cpu_children() - c:.0f} s CPU", flush=True)
    ev = section(conf, "evaluate", rec.get("evaluate", {}))
    table = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        res = {}
        for init in args.inits.split(","):
            ft = section(conf, "finetune", {"backend": "single", "checkpoint.every_steps": 0,
                                            **rec.get("finetune", {}), "init": init, "seed": seed})
            ft = {**ft, "stage": "finetune", "dataset": "nih_demo"}
            d = run_dir / f"ft_{init}_s{seed}"
            t, c = time.time(), cpu_children()
            rows = train(d, ft, demo, env, pretrained=run_dir / "pretrain/model.pt" if init == "pretrained" else None)
            m = evaluate(d / "eval", ev, d / "model.pt", demo, env)
            res[init] = m
            vals = " ".join(f"{r['val_metric']:.3f}" for r in rows)
            print(f"  seed {seed} {init:10s} val {vals}"
                  f"  test {m['mean_auroc']:.4f}  ({time.time() - t:.0f} s wall, {cpu_children() - c:.0f} s CPU)",
                  flush=True)
        if len(res) < 2:
            continue
        d = paired(pd.read_csv(run_dir / f"ft_pretrained_s{seed}/eval/predictions.csv"),
                   pd.read_csv(run_dir / f"ft_random_s{seed}/eval/predictions.csv"))
        diff = f"{d['diff']:+.4f} CI {d['ci'][0]:+.4f}..{d['ci'][1]:+.4f}"
        table.append((seed, res["pretrained"]["mean_auroc"], res["random"]["mean_auroc"], diff))
        print(f"seed {seed}: pretrained {table[-1][1]:.4f} random {table[-1][2]:.4f} diff {diff}", flush=True)
    if not table:
        return
    p = np.array([t[1] for t in table])
    r = np.array([t[2] for t in table])
    print(f"mean pretrained {p.mean():.4f} sd {p.std(ddof=1) if len(p) > 1 else 0:.4f}; "
          f"random {r.mean():.4f} sd {r.std(ddof=1) if len(r) > 1 else 0:.4f}; "
          f"diff {(p - r).mean():+.4f} sd {(p - r).std(ddof=1) if len(p) > 1 else 0:.4f}")
    print(f"total: {time.time() - t0:.0f} s wall, {cpu_children() - c0:.0f} s CPU, load {os.getloadavg()}")


if __name__ == "__main__":
    main()
