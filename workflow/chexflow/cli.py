"""``chexflow <stage>``: the command line the Snakemake rules call.

Every stage takes its settings as ``--config FILE`` (YAML/JSON) or ``--config-json STRING`` (what
the rules pass), builds the stage's frozen dataclass from it (unknown keys and wrong types fail
naming the key) and calls the stage's ``run`` function with plain paths.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from chexflow import config as C


def _add_config(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--config", type=Path, help="stage settings as a YAML/JSON file")
    g.add_argument("--config-json", help="stage settings as a JSON string (what the rules pass)")


def _load(cls, args):
    if args.config is None and args.config_json is None:
        return cls()
    return C.load_stage_config(cls, path=args.config, text=args.config_json)


# --------------------------------------------------------------------------- stages

def cmd_make_demo_release(args) -> None:
    from chexflow.data.phantoms import make_release
    cfg = _load(C.DemoReleaseConfig, args)
    info = make_release(args.out, n_images=cfg.n_images, image_size=cfg.image_size,
                        images_per_archive=cfg.images_per_archive, test_fraction=cfg.test_fraction,
                        seed=cfg.seed, workers=args.workers, progress=True)
    print(info)


def cmd_download(args) -> None:
    from chexflow.data import download, sources
    src = sources.get_source(args.dataset, n_archives=args.n_archives)
    download.fetch_source_file(src, args.file, args.dest, args.mirror or None, progress=True)


def cmd_split(args) -> None:
    from chexflow.data import shards
    cfg = _load(C.ShardConfig, args)
    df = shards.split_dataset(cfg.dataset, args.raw, cfg, args.out)
    counts = df.groupby("split").agg(images=("image", "size"), patients=("patient", "nunique"))
    print(counts.to_string())


def cmd_shards(args) -> None:
    from chexflow.data import shards
    cfg = _load(C.ShardConfig, args)
    m = shards.write_part(cfg.dataset, args.part, args.raw, args.splits, args.out, cfg)
    print(f"{cfg.dataset}/{args.part}: {len(m['shards'])} shards, "
          f"{sum(s['count'] for s in m['shards'])} images, {len(m['rejects'])} rejected")


def cmd_gather(args) -> None:
    from chexflow.data import shards
    cfg = _load(C.ShardConfig, args)
    m = shards.gather(cfg.dataset, args.parts, args.out, cfg)
    for split, s in m["splits"].items():
        print(f"{split}: {s['n_images']} images, {s['n_patients']} patients, {s['n_shards']} shards")


def cmd_train(args) -> None:
    from chexflow.train.trainer import TrainPaths, run
    cfg = _load(C.TrainConfig, args)
    run(cfg, TrainPaths(manifest=args.manifest, out_dir=args.out_dir, ckpt_dir=args.ckpt_dir,
                        pretrained=args.pretrained, tensorboard=args.tensorboard))


def cmd_launch(args) -> None:
    import os
    from chexflow.train.launch import launch
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    backend = args.backend or os.environ.get("CHEXFLOW_BACKEND", "horovod")
    sys.exit(launch(backend, args.n, cmd))


def cmd_evaluate(args) -> None:
    from chexflow.evaluate.run import run
    cfg = _load(C.EvaluateConfig, args)
    res = run(cfg, model_path=args.model, manifest=args.manifest, out_dir=args.out_dir)
    print(f"mean AUROC {res['mean_auroc']:.4f} on {res['n_images']} test images")


def cmd_report(args) -> None:
    from chexflow.report.render import collect_provenance, render_report
    import yaml
    if args.study_config_json:
        config = json.loads(args.study_config_json)
    else:
        config = yaml.safe_load(args.study_config.read_text()) if args.study_config else {}
    manifests = dict(kv.split("=", 1) for kv in args.manifest)
    benches = dict(kv.split("=", 1) for kv in args.benchmark)
    render_report(args.out, metrics_json=args.metrics, predictions_csv=args.predictions,
                  pretrain_metrics=args.pretrain_metrics, finetune_metrics=args.finetune_metrics,
                  manifests={k: Path(v) for k, v in manifests.items()}, config=config,
                  provenance=collect_provenance(args.repo), stage_benchmarks={k: Path(v) for k, v in benches.items()})


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="chexflow", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="stage", required=True)

    p = sub.add_parser("make-demo-release", help="generate the synthetic mini-NIH release (phantoms)")
    _add_config(p)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--workers", type=int, default=1, help="rendering processes")
    p.set_defaults(func=cmd_make_demo_release)

    p = sub.add_parser("download", help="fetch one file of a dataset source, verified")
    p.add_argument("--dataset", required=True)
    p.add_argument("--file", required=True)
    p.add_argument("--dest", type=Path, required=True, help="directory (data/raw/<dataset>)")
    p.add_argument("--mirror", default=None, help="directory, file:// or http(s) base URL")
    p.add_argument("--n-archives", type=int, default=None, help="nih_demo: number of archives")
    p.set_defaults(func=cmd_download)

    p = sub.add_parser("split", help="patient-wise train/val/test assignment")
    _add_config(p)
    p.add_argument("--raw", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=cmd_split)

    p = sub.add_parser("shards", help="write the shards of one source archive")
    _add_config(p)
    p.add_argument("--part", required=True)
    p.add_argument("--raw", type=Path, required=True)
    p.add_argument("--splits", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True, help="directory of this part's shards")
    p.set_defaults(func=cmd_shards)

    p = sub.add_parser("gather", help="combine part manifests into the dataset manifest")
    _add_config(p)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("parts", type=Path, nargs="+")
    p.set_defaults(func=cmd_gather)

    p = sub.add_parser("train", help="one rank of pretraining or fine-tuning (start via launch/srun)")
    _add_config(p)
    p.add_argument("--manifest", type=Path, required=True)
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--ckpt-dir", type=Path, required=True)
    p.add_argument("--pretrained", type=Path, default=None)
    p.add_argument("--tensorboard", type=Path, default=None)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("launch", help="start N local ranks of a command (horovodrun / torchrun)")
    p.add_argument("-n", "--ranks", dest="n", type=int, required=True)
    p.add_argument("--backend", choices=["horovod", "ddp", "single"], default=None,
                   help="default: $CHEXFLOW_BACKEND or horovod")
    p.add_argument("command", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_launch)

    p = sub.add_parser("evaluate", help="test-set predictions, AUROC with bootstrap CIs")
    _add_config(p)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--manifest", type=Path, required=True)
    p.add_argument("--out-dir", type=Path, required=True)
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser("report", help="the self-contained HTML report")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--metrics", type=Path, required=True)
    p.add_argument("--predictions", type=Path, default=None)
    p.add_argument("--pretrain-metrics", type=Path, required=True)
    p.add_argument("--finetune-metrics", type=Path, required=True)
    p.add_argument("--manifest", action="append", default=[], metavar="NAME=PATH")
    p.add_argument("--benchmark", action="append", default=[], metavar="STAGE=PATH")
    p.add_argument("--study-config", type=Path, default=None, help="config.yaml of the study")
    p.add_argument("--study-config-json", default=None, help="the study config as JSON (rules)")
    p.add_argument("--repo", type=Path, default=None)
    p.set_defaults(func=cmd_report)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except C.ConfigError as exc:
        print(f"chexflow {args.stage}: configuration error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
