"""``chexflow <stage>``: the command line the Snakemake rules call.

Every stage takes its settings as ``--config FILE`` (YAML/JSON) or ``--config-json STRING`` (what
the rules pass), builds the stage's frozen dataclass from it (unknown keys and wrong types fail
naming the key) and calls the stage's ``run`` function with plain paths.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from chexflow import errors, watchdog
from chexflow.data.workers import worker_death
from chexflow.data.config import DemoReleaseConfig, ShardConfig, TableSpec
from chexflow.data.stamps import verified_dir
from chexflow.evaluate.config import EvaluateConfig
from chexflow.predict.config import ExportConfig, PredictConfig
from chexflow.settings import ConfigError, from_dict, load_stage_config
from chexflow.studies.config import ScalingConfig
from chexflow.train.config import TrainConfig


def _add_config(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--config", type=Path, help="stage settings as a YAML/JSON file")
    g.add_argument("--config-json", help="stage settings as a JSON string (what the rules pass)")


def _add_paths(p: argparse.ArgumentParser, *flags: str, required: bool = True) -> None:
    """Path arguments without a help of their own (their names say what they are)."""
    for flag in flags:
        p.add_argument(flag, type=Path, required=required, default=None)


def _load(cls, args):
    if args.config is None and args.config_json is None:
        return cls()
    return load_stage_config(cls, path=args.config, text=args.config_json)


# --------------------------------------------------------------------------- stages

def cmd_make_demo_release(args) -> None:
    from chexflow.data import registry
    from chexflow.data.phantoms.release import make_release
    cfg = _load(DemoReleaseConfig, args)
    dataset = registry.get(args.dataset)
    if not getattr(dataset, "generated", False):
        raise ConfigError(f"--dataset {args.dataset!r} is not a generated phantom release (those are: "
                          f"{', '.join(n for n, d in registry.DATASETS.items() if getattr(d, 'generated', False))})")
    info = make_release(args.out, n_images=cfg.n_images, image_size=cfg.image_size,
                        images_per_archive=cfg.images_per_archive, test_fraction=cfg.test_fraction,
                        seed=cfg.seed, pool=dataset.patient_pool, workers=args.workers, progress=True,
                        boxes=dataset.has_boxes)
    print(info)


def _declared(dataset: str, table: TableSpec | None) -> None:
    """A CSV-described dataset's adapter, from the declaration the rule hands the command."""
    if table is not None:
        from chexflow.data import registry
        registry.declare({dataset: table})


def _load_shards(args) -> ShardConfig:
    cfg = _load(ShardConfig, args)
    _declared(cfg.dataset, cfg.table)
    return cfg


def cmd_download(args) -> None:
    from chexflow.data import download, registry, sources
    if args.table_json is not None:
        _declared(args.dataset, load_stage_config(TableSpec, text=args.table_json))
    src = registry.get_source(args.dataset, n_archives=args.n_archives)
    src = sources.with_test_pins(src, registry.load_test_registry())   # tests only: see sources.py
    download.fetch_source_file(src, args.file, args.dest, args.mirror or None, progress=True)


def cmd_split(args) -> None:
    from chexflow.data import nih, registry, shards, sources
    cfg = _load_shards(args)
    content = sources.registry_content(registry.load_test_registry(), cfg.dataset)   # tests only
    df = shards.split_dataset(cfg.dataset, args.raw, cfg, args.out,
                              expected=nih.ReleaseCounts(**content) if content else None)
    counts = df.groupby("split").agg(images=("image", "size"), patients=("patient", "nunique"))
    print(counts.to_string())


def cmd_shards(args) -> None:
    from chexflow.data import shards
    cfg = _load_shards(args)
    if cfg.table is None and args.table_json is not None:
        _declared(cfg.dataset, load_stage_config(TableSpec, text=args.table_json))
    m = shards.write_part(cfg.dataset, args.part, args.raw, args.splits, args.out, cfg, n_archives=args.n_archives,
                          progress=True)
    print(f"{cfg.dataset}/{args.part}: {len(m['shards'])} shards, "
          f"{sum(s['count'] for s in m['shards'])} images, {len(m['rejects'])} rejected")


def cmd_gather(args) -> None:
    from chexflow.data import shards
    cfg = _load_shards(args)
    m = shards.gather(cfg.dataset, args.parts, args.out, cfg, splits_csv=args.splits)
    for split, s in m["splits"].items():
        listed = f" of {s['n_listed']} listed" if "n_listed" in s else ""
        print(f"{split}: {s['n_images']}{listed} images, {s['n_patients']} patients, {s['n_shards']} shards")


def cmd_train(args) -> None:
    from chexflow.train import signals
    signals.install()           # before torch is imported (seconds): a signal then is remembered, not fatal
    from chexflow.train.run import start
    from chexflow.train.trainer import TrainPaths
    cfg = _load(TrainConfig, args)
    outcome = start(cfg, TrainPaths(manifest=args.manifest, out_dir=args.out_dir, ckpt_dir=args.ckpt_dir,
                                    pretrained=args.pretrained, tensorboard=args.tensorboard, verified=verified_dir()))
    if outcome.exit_code:
        sys.exit(outcome.exit_code)


def cmd_launch(args) -> None:
    import os
    from chexflow.train.launch import BACKENDS, launch
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    backend = args.backend or os.environ.get("CHEXFLOW_BACKEND", "horovod")
    if backend not in BACKENDS:
        raise ConfigError(f"CHEXFLOW_BACKEND: {backend!r} is none of {' | '.join(BACKENDS)}")
    sys.exit(launch(backend, args.n, cmd))


def cmd_keep_log(args) -> None:
    from chexflow.fsutil import link_numbered
    print(f"this attempt's log: {args.log} (kept as {link_numbered(args.log)})", file=sys.stderr)


def _expected_run_ids(args) -> set[str] | None:
    """The run ids the model to evaluate may carry: of the training section (--train-config-json)
    or, with --trials-json, of each sweep trial's overrides of it; None when no section is given."""
    from chexflow.evaluate.run import expected_run_ids
    if args.train_config_json is None:
        if args.trials_json is not None:
            raise ConfigError("--trials-json needs --train-config-json (the section the trials override)")
        return None
    section = load_stage_config(TrainConfig, text=args.train_config_json)
    if args.trials_json is None:
        return expected_run_ids([section], args.manifest, args.pretrained)
    from chexflow.studies.sweep import apply_params
    try:
        trials = json.loads(args.trials_json)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--trials-json is not valid JSON: {exc}") from None
    if not isinstance(trials, list) or not all(isinstance(t, dict) for t in trials):
        raise ConfigError(f"--trials-json: expected a list of mappings (the trials' overrides), got {trials!r}")
    base = json.loads(args.train_config_json)
    trial_cfgs = [from_dict(TrainConfig, apply_params(base, t)) for t in trials]
    return expected_run_ids(trial_cfgs, args.manifest, args.pretrained)


def cmd_evaluate(args) -> None:
    from chexflow.evaluate.run import run
    cfg = _load(EvaluateConfig, args)
    res = run(cfg, model_path=args.model, manifest=args.manifest, out_dir=args.out_dir,
              expect_run_ids=_expected_run_ids(args), label_table=args.label_table, boxes=args.boxes,
              box_frame=args.box_frame, heatmaps=not args.no_heatmaps, verified=verified_dir())
    print(f"mean AUROC {res['mean_auroc']:.4f} on {res['n_images']} test images")


def cmd_evaluate_external(args) -> None:
    from chexflow.evaluate.external import run
    cfg = _load(EvaluateConfig, args)
    res = run(cfg, model_path=args.model, manifest=args.manifest, internal_metrics=args.internal_metrics,
              internal_predictions=args.internal_predictions, out_dir=args.out_dir, label_table=args.label_table)
    for f in res["findings"]:
        ci = f["drop"]["ci"]
        drop = "undefined" if f["drop"]["diff"] is None else f"{f['drop']['diff']:+.4f}" + (
            f" (95% CI {ci[0]:+.4f} to {ci[1]:+.4f})" if ci else " (no CI)")
        print(f"{f['finding']} = {res['dataset']} {f['external_label']}: drop {drop}")
    print(f"findings without a match: model {res['label_map']['model_only']}, {res['dataset']} "
          f"{res['label_map']['data_only']}")


def cmd_predict(args) -> None:
    from chexflow.predict.run import run
    cfg = _load(PredictConfig, args)
    run(cfg, model_path=args.model, manifest=args.manifest, metrics=args.metrics, out_csv=args.out,
        inputs=args.inputs, heatmap_dir=args.heatmap_dir)


def cmd_export(args) -> None:
    from chexflow.predict.export import run
    cfg = _load(ExportConfig, args)
    summary = run(cfg, model_path=args.model, manifest=args.manifest, metrics=args.metrics, out_dir=args.out_dir,
                  model_card=args.model_card)
    for fmt, e in summary["exports"].items():
        print(f"{fmt}: {args.out_dir / e['file']} (max |export - torch| {max(e['max_abs_diff'].values()):.3g})")


def cmd_report(args) -> None:
    from chexflow.report.render import ReportInputError, collect_provenance, render_report
    import yaml
    from chexflow.fsutil import read_text_regular
    try:
        if args.study_config_json:
            config = json.loads(args.study_config_json)
        else:
            config = yaml.safe_load(read_text_regular(args.study_config, what="study config")) \
                if args.study_config else {}
    except (ValueError, yaml.YAMLError) as exc:          # JSONDecodeError, UnicodeDecodeError are ValueErrors
        raise ConfigError(f"{args.study_config or '--study-config-json'}: not a study config ({exc})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{args.study_config or '--study-config-json'}: not a study config (a "
                          f"{type(config).__name__}, not a mapping)")
    try:
        inputs = json.loads(args.inputs_json)
    except json.JSONDecodeError as exc:
        raise ReportInputError(f"--inputs-json is not valid JSON: {exc}") from exc
    render_report(args.out, inputs=inputs, config=config, provenance=collect_provenance(args.repo),
                  model_card=args.model_card)


def cmd_scale_point(args) -> None:
    from chexflow.train import signals
    signals.install()           # as `chexflow train`
    from chexflow.studies import scaling
    pretrain = _load(TrainConfig, args)
    study = load_stage_config(ScalingConfig, text=args.scaling_json)
    scaling.run_point(pretrain, study, world=args.world, manifest=args.manifest, out_dir=args.out_dir,
                      job_threads=args.job_threads, verified=verified_dir())


def cmd_scale_summary(args) -> None:
    from chexflow.studies import scaling
    df = scaling.write_summary(args.points, out_csv=args.out_csv, out_json=args.out_json, out_png=args.out_plot)
    print(df.to_string(index=False))


def cmd_sweep_trial(args) -> None:
    import shlex
    from chexflow.studies import sweep
    finetune = json.loads(args.config_json)
    from_dict(TrainConfig, finetune)          # the base section itself must be valid
    sweep.run_trial(finetune, json.loads(args.params_json), trial_id=args.trial,
                    launcher=shlex.split(args.launcher), ranks=args.ranks, manifest=args.manifest,
                    pretrained=args.pretrained, out_dir=args.out_dir)


def cmd_sweep_select(args) -> None:
    from chexflow.studies import sweep
    summary = sweep.write_selection(args.results, out_csv=args.out_csv, out_json=args.out_json,
                                    out_model=args.out_model)
    w = summary["winner"]
    print(f"winner {w['trial']} ({json.dumps(w['params'])}): val {w['val_metric_name']} {w['val_metric']:.4f}; "
          f"{summary['n_failed']} of {summary['n_trials']} trials failed")


def cmd_compare_ablation(args) -> None:
    from chexflow.studies import ablation_compare
    evaluate = _load(EvaluateConfig, args)
    try:
        runs = json.loads(args.runs_json)
    except json.JSONDecodeError as exc:
        raise ablation_compare.ComparisonInputError(f"--runs-json is not valid JSON: {exc}") from exc
    rec = ablation_compare.write_comparison(runs, args.out, main=args.main, n_resamples=evaluate.bootstrap_resamples,
                                            seed=evaluate.seed)
    def said(d: dict) -> str:
        ci = "no CI" if d["ci_low"] is None else f"95% CI {d['ci_low']:+.4f} to {d['ci_high']:+.4f}"
        return f"{d['diff']:+.4f} ({ci}): {d['verdict']}"

    for c in [{"a": "pretrained", "b": "random", **rec}, *rec["published"]]:
        for d in c["per_seed"]:
            print(f"{c['a']} - {c['b']}, seed {d['seed']}: {said(d)}")
        if c["over_seeds"]:
            print(f"{c['a']} - {c['b']}, over {c['over_seeds']['n_seeds']} seeds: {said(c['over_seeds'])}")


def _add_model_inputs(p: argparse.ArgumentParser, *, export: bool) -> None:
    """The fine-tuned model and what overrides its predict record (predict, export)."""
    p.add_argument("--model", type=Path, required=True,
                   help="results/evaluate/model.pt (carries its predict record: alone it is enough)")
    p.add_argument("--manifest", type=Path, required=export,
                   help="manifest of the data the model was trained on: the test images of the check" if export
                   else "override: manifest of the data the model was trained on (its stored image size; needed "
                        "for a model file without a predict record)")
    p.add_argument("--metrics", type=Path, default=None,
                   help="override: evaluation's metrics.json (the thresholds chosen on validation; needed for a "
                        "model file without a predict record)")


def _data_commands(sub) -> None:
    """The data stages: the demo release, downloads, the split, shards."""
    p = sub.add_parser("make-demo-release", help="generate the synthetic mini-NIH release (phantoms)")
    _add_config(p)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--workers", type=int, default=1, help="rendering processes")
    p.add_argument("--dataset", default="nih_demo",
                   help="which release: nih_demo (fine-tuning data) or nih_demo_pretrain (the pretraining "
                        "corpus); they draw from disjoint patient pools")
    p.set_defaults(func=cmd_make_demo_release)

    p = sub.add_parser("download", help="fetch one file of a dataset source, verified")
    p.add_argument("--dataset", required=True)
    p.add_argument("--file", required=True)
    p.add_argument("--dest", type=Path, required=True, help="directory (data/raw/<dataset>)")
    p.add_argument("--mirror", default=None, help="directory, file:// or http(s) base URL")
    p.add_argument("--n-archives", type=int, default=None, help="nih_demo: number of archives of the generated release")
    p.add_argument("--table-json", default=None,
                   help="a CSV-described dataset: its declaration (datasets.<name>) as JSON")
    p.set_defaults(func=cmd_download)

    p = sub.add_parser("split", help="patient-wise train/val/test assignment")
    _add_config(p)
    _add_paths(p, "--raw", "--out")
    p.set_defaults(func=cmd_split)

    p = sub.add_parser("shards", help="write the shards of one source archive")
    _add_config(p)
    p.add_argument("--part", required=True)
    _add_paths(p, "--raw", "--splits")
    p.add_argument("--out", type=Path, required=True, help="directory of this part's shards")
    p.add_argument("--n-archives", type=int, default=None,
                   help="a generated release (nih_demo*): its number of archives, as configured")
    p.add_argument("--table-json", default=None,
                   help="a CSV-described dataset: its declaration as JSON (--config-json's table, where set, wins)")
    p.set_defaults(func=cmd_shards)

    p = sub.add_parser("gather", help="combine part manifests into the dataset manifest")
    _add_config(p)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--splits", type=Path, default=None,
                   help="splits.csv: check that every listed image was found (coverage in the manifest)")
    p.add_argument("parts", type=Path, nargs="+")
    p.set_defaults(func=cmd_gather)


def _train_commands(sub) -> None:
    """Training: one rank, the local launcher, the job log."""
    p = sub.add_parser("train", help="one rank of pretraining or fine-tuning (start via launch/srun)")
    _add_config(p)
    _add_paths(p, "--manifest", "--out-dir", "--ckpt-dir")
    _add_paths(p, "--pretrained", "--tensorboard", required=False)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("launch", help="start N local ranks of a command (horovodrun / torchrun)")
    p.add_argument("-n", "--ranks", dest="n", type=int, required=True)
    p.add_argument("--backend", choices=["horovod", "ddp", "single"], default=None,
                   help="default: $CHEXFLOW_BACKEND or horovod")
    p.add_argument("command", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_launch)

    p = sub.add_parser("keep-log", help="create a job's log and keep it under a numbered name too (one per attempt)")
    p.add_argument("log", type=Path, help="the log the job writes (logs/<stage>/train.log -> train.<n>.log)")
    p.set_defaults(func=cmd_keep_log)


def _model_commands(sub) -> None:
    """The fine-tuned model: evaluation on test, predict, export."""
    p = sub.add_parser("evaluate", help="test-set predictions, AUROC with bootstrap CIs")
    _add_config(p)
    _add_paths(p, "--model", "--manifest", "--out-dir")
    p.add_argument("--train-config-json", default=None,
                   help="the training section (with stage, dataset) that should have produced the model: its run "
                        "id must be the model file's (the rules pass it; without it the run id is not checked)")
    p.add_argument("--pretrained", type=Path, default=None,
                   help="the pretraining model, for a section with init: pretrained (part of the run id)")
    p.add_argument("--trials-json", default=None,
                   help="sweep: the trials' overrides of that section (a JSON list); the model must be one trial's")
    p.add_argument("--label-table", type=Path, default=None, help="the release's label table (subgroups)")
    p.add_argument("--boxes", type=Path, default=None, help="the release's box list (localisation scores)")
    p.add_argument("--box-frame", type=int, default=None, help="side (px) of the images the boxes refer to")
    p.add_argument("--no-heatmaps", action="store_true", help="no Grad-CAM (the ablation's runs)")
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser("evaluate-external", help="the evaluated model on another dataset's test split, beside the "
                                                 "internal test (external validation)")
    _add_config(p)
    p.add_argument("--model", type=Path, required=True, help="the evaluation's model.pt")
    p.add_argument("--manifest", type=Path, required=True, help="the external dataset's manifest")
    p.add_argument("--internal-metrics", type=Path, required=True, help="the evaluation's metrics.json")
    p.add_argument("--internal-predictions", type=Path, required=True, help="the evaluation's predictions.csv")
    p.add_argument("--label-table", type=Path, default=None, help="the external set's sex, age and view (subgroups)")
    p.add_argument("--out-dir", type=Path, required=True)
    p.set_defaults(func=cmd_evaluate_external)

    p = sub.add_parser("predict", help="the fine-tuned model on PNG/JPEG/DICOM files: one CSV row per file")
    _add_config(p)
    _add_model_inputs(p, export=False)
    p.add_argument("--out", type=Path, required=True, help="the CSV to write")
    p.add_argument("--heatmap-dir", type=Path, default=None, help="with predict.heatmaps (default: beside --out)")
    p.add_argument("inputs", nargs="*", help="folders, image files or .txt lists (default: predict.inputs)")
    p.set_defaults(func=cmd_predict)

    p = sub.add_parser("export", help="TorchScript and ONNX of the fine-tuned model, checked against torch")
    _add_config(p)
    _add_model_inputs(p, export=True)
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--model-card", type=Path, default=None, help="carried along when the file exists")
    p.set_defaults(func=cmd_export)


def _study_commands(sub) -> None:
    """The studies: scaling, sweep, the ablation's comparison."""
    p = sub.add_parser("scale-point", help="one rank of the scaling study at one world size")
    _add_config(p)
    p.add_argument("--scaling-json", required=True, help="the scaling section as JSON")
    p.add_argument("--world", type=int, required=True, help="world size of this job")
    p.add_argument("--job-threads", type=int, default=None,
                   help="cores of the job on this node, shared by its ranks there")
    _add_paths(p, "--manifest", "--out-dir")
    p.set_defaults(func=cmd_scale_point)

    p = sub.add_parser("scale-summary", help="scaling table (speedup, efficiency) and plot")
    _add_paths(p, "--out-csv", "--out-json", "--out-plot")
    p.add_argument("points", type=Path, nargs="+", help="throughput.json of each world size")
    p.set_defaults(func=cmd_scale_summary)

    p = sub.add_parser("sweep-trial", help="one fine-tuning trial of the sweep (starts its ranks itself)")
    p.add_argument("--config-json", required=True, help="the finetune section (with stage, dataset) as JSON")
    p.add_argument("--params-json", required=True, help='the trial\'s overrides, e.g. {"optim.lr": 0.01}')
    p.add_argument("--trial", required=True, help="trial id (t000, t001, ...)")
    p.add_argument("--launcher", required=True, help="rank launcher: 'chexflow launch' or an srun line")
    p.add_argument("-n", "--ranks", type=int, required=True)
    _add_paths(p, "--manifest", "--out-dir")
    _add_paths(p, "--pretrained", required=False)
    p.set_defaults(func=cmd_sweep_trial)

    p = sub.add_parser("sweep-select", help="sweep table; the winner by validation metric")
    _add_paths(p, "--out-csv", "--out-json")
    p.add_argument("--out-model", type=Path, required=True, help="copy of the winner's model.pt")
    p.add_argument("results", type=Path, nargs="+", help="result.json of every trial")
    p.set_defaults(func=cmd_sweep_select)

    p = sub.add_parser("compare-ablation", help="the ablation's paired comparisons of its runs (comparison.json)")
    _add_config(p)
    p.add_argument("--runs-json", required=True,
                   help='the runs as {"<init>_seed<seed>": {"metrics": PATH, "predictions": PATH, "training": PATH}, ...}')
    p.add_argument("--main", required=True, help="the main run's name among them (e.g. pretrained_seed0)")
    p.add_argument("--out", type=Path, required=True, help="results/ablation/comparison.json")
    p.set_defaults(func=cmd_compare_ablation)


def _report_command(sub) -> None:
    """The report."""
    p = sub.add_parser("report", help="the self-contained HTML report and the model card")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model-card", type=Path, default=None, help="also write the model card (Markdown) here")
    p.add_argument("--inputs-json", required=True,
                   help='the report\'s files as one structure, e.g. {"evaluation": {"metrics": PATH, ...}, ...} '
                        "(chexflow.report.render.INPUTS; the rule passes its named inputs)")
    p.add_argument("--study-config", type=Path, default=None, help="config.yaml of the study")
    p.add_argument("--study-config-json", default=None, help="the study config as JSON (rules)")
    p.add_argument("--repo", type=Path, default=None)
    p.set_defaults(func=cmd_report)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="chexflow", description=__doc__.splitlines()[0],
                                 epilog="A refusal is one line on stderr and an exit status of docs/errors.md.")
    ap.add_argument("--debug", action="store_true",
                    help=f"with a refusal, its Python traceback too (or set {errors.DEBUG_ENV}=1)")
    sub = ap.add_subparsers(dest="stage", required=True)
    for add in (_data_commands, _train_commands, _model_commands, _study_commands, _report_command):
        add(sub)
    return ap


# the long-running commands: each marks its progress, and a stall ends it (chexflow.watchdog)
WATCHED = ("shards", "train", "evaluate", "evaluate-external", "predict", "scale-point")


def main(argv: list[str] | None = None) -> None:
    """Run one command; a refusal (chexflow.errors) ends it with one line on stderr and its exit code."""
    args = build_parser().parse_args(argv)
    try:
        if args.stage in WATCHED:
            watchdog.arm(args.stage)
        args.func(args)
    except SystemExit as exc:   # a command's own status (the trainer's 3, 4, 5, 143): kept for chexflow launch
        errors.record_exit(exc.code)
        raise
    except Exception as exc:  # noqa: BLE001 - sorted below: a refusal gets its line, anything else its traceback
        errors.refuse(args.stage, worker_death(exc), debug=errors.debug_requested(args.debug))
    finally:
        watchdog.disarm()


if __name__ == "__main__":
    main()
