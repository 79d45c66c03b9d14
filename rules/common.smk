# Path helpers and wildcard lists for the rules (no logic beyond naming things).
import dataclasses
import json
import os
import shlex
import sys

from snakemake.exceptions import WorkflowError

from chexflow.config import folder_settings, resolved_config, stage_settings
from chexflow.data import registry as _registry  # cheap: no torch/webdataset at DAG time
from chexflow.studies import ablation as _ablation
from chexflow.studies import sweep as _sweep
from chexflow.train import config as _train
from chexflow.train import lease as _lease  # standard library only

# `chexflow` (the package's CLI) sits next to the Python that runs Snakemake (the venv). Every job's
# chexflow ends itself when it stalls, within the bound of config.yaml's watchdog section (braces doubled:
# Snakemake formats the prefix).
_WATCHDOG = shlex.quote(json.dumps(dataclasses.asdict(STUDY.watchdog))).replace("{", "{{").replace("}", "}}")
shell.prefix(
    f'set -euo pipefail; export PATH="$PATH:{os.path.dirname(sys.executable)}"; export CHEXFLOW_WATCHDOG={_WATCHDOG}; '
)

PRETRAIN_DATASET = STUDY.pretrain_dataset  # STUDY: config.yaml checked by chexflow.config (Snakefile)
FINETUNE_DATASET = STUDY.finetune_dataset
# The generated phantom releases (dataset -> its config section; the adapters say): the demo's
# fine-tuning data and its pretraining corpus (disjoint patient pools: the adapters' patient_pool).
DEMO_RELEASES = {name: d.release_config for name, d in _registry.DATASETS.items() if d.generated}


wildcard_constraints:
    dataset="|".join(_registry.adapters()),
    demo="|".join(DEMO_RELEASES),
    part="[A-Za-z0-9_]+",
    file="[^/]+",


def demo_dir(dataset):
    """Where rule make_demo_release writes a generated release (the demo's 'remote')."""
    return f"data/demo/{dataset}"


def n_demo_archives(dataset):
    """The archive count of a generated release (None for the other datasets)."""
    return STUDY.releases[dataset].n_archives if dataset in DEMO_RELEASES else None


def demo_release_json(wildcards):
    return json.dumps(config.get(DEMO_RELEASES[wildcards.demo], {}))


def pilot_archives(dataset):
    """A declared pilot subset of a release's archives (datasets.<dataset>.archives), None = all."""
    return (config.get("datasets", {}).get(dataset) or {}).get("archives")


def source_of(dataset):
    return _registry.get(dataset).source(n_archives=n_demo_archives(dataset))


def raw_paths(dataset, files):
    return [f"data/raw/{dataset}/{f.name}" for f in files]


def download_inputs(wildcards):
    """The demo's 'remote' is the locally generated release; real sources need nothing local."""
    return [f"{demo_dir(wildcards.dataset)}/SHA256SUMS"] if wildcards.dataset in DEMO_RELEASES else []


def source_args(wildcards):
    """The generated demo release has as many archives as demo_release says; real sources are fixed.
    The download and shard jobs get it from the configuration, never from what is on disk. A
    CSV-described dataset's source is its declaration (datasets.<name>), handed to both as well."""
    if wildcards.dataset in DEMO_RELEASES:
        return f"--n-archives {n_demo_archives(wildcards.dataset)}"
    table = STUDY.tables.get(wildcards.dataset)
    return f"--table-json {shlex.quote(json.dumps(dataclasses.asdict(table)))}" if table else ""


def download_mirror(wildcards):
    if wildcards.dataset in DEMO_RELEASES:
        return demo_dir(wildcards.dataset)
    if wildcards.dataset in STUDY.tables:  # a CSV-described folder: its table's folder
        return _registry.get(wildcards.dataset).mirror()
    return config["datasets"].get(wildcards.dataset, {}).get("mirror") or ""


def shard_config_json(wildcards):
    """shards.<dataset>, plus what the workflow sets for a folder dataset (its images, a CSV's declaration)."""
    ds = wildcards.dataset
    return json.dumps({**config["shards"][ds], "dataset": ds, **folder_settings(STUDY, ds)})


def gather_settings(dataset):
    """The shard settings plus a declared pilot subset of the archives (only the gather needs it:
    the split and the parts are the same for a pilot and the full release)."""
    archives = pilot_archives(dataset)
    has_pilot = "archives" in _registry.get(dataset).source_options()
    pilot = {"archives": None if archives is None else sorted(archives)} if has_pilot else {}
    return {**config["shards"][dataset], "dataset": dataset, **pilot, **folder_settings(STUDY, dataset)}


def gather_config_json(wildcards):
    return json.dumps(gather_settings(wildcards.dataset))


def split_inputs(wildcards):
    """The raw files the split reads: the source's files of the roles the dataset's adapter names."""
    source = source_of(wildcards.dataset)
    return raw_paths(wildcards.dataset, _registry.get(wildcards.dataset).split_files(source))


def part_inputs(wildcards):
    source = source_of(wildcards.dataset)
    return raw_paths(wildcards.dataset, _registry.get(wildcards.dataset).part_files(source, wildcards.part))


def part_manifests(wildcards):
    return dataset_part_manifests(wildcards.dataset)


def dataset_part_manifests(dataset):
    parts = _registry.get(dataset).parts(STUDY.shards[dataset], n_demo_archives(dataset))
    return [f"data/shards/{dataset}/parts/{p}/manifest.json" for p in parts]


def manifest(dataset):
    return f"data/shards/{dataset}/manifest.json"


def train_config_json(stage, **overrides):
    """The stage's settings (its section over the shared `training:` one) for `chexflow train`."""
    return json.dumps(stage_settings(config, stage, STUDY.dataset(stage), **overrides))


def train_backend(stage):
    return STUDY.train[stage].backend


def output_dir(wildcards, output):
    """Params function: the directory of a job's first output (for commands taking --out-dir)."""
    return os.path.dirname(output[0])


def stage_json(section):
    """A section for its stage's command; evaluate.external is the workflow's (which evaluate_external
    jobs exist), not the evaluation's: left out, a change of it does not redo the evaluation."""
    return json.dumps({k: v for k, v in config[section].items() if (section, k) != ("evaluate", "external")})


# ------------------------------------------------------------------ optional studies (config)
def study_enabled(section):
    return getattr(STUDY, section).enabled


def study_json(section):
    """A study's section as JSON ({} when config.yaml has none: the dataclass defaults)."""
    return json.dumps(config.get(section, {}))


def scaling_points():
    return [f"results/scaling/world{w}/throughput.json" for w in STUDY.scaling.world_sizes]


def scaling_tasks(wildcards):
    """Ranks of a scaling job = its world size (SLURM: see scale_pretrain in profiles/slurm)."""
    return int(wildcards.world)


def study_targets():
    """What `rule all` adds for the studies switched on in config.yaml."""
    targets = []
    if study_enabled("scaling"):
        targets.append("results/scaling/scaling.csv")
    if study_enabled("sweep"):
        targets.append("results/sweep/evaluate/metrics.json")
    targets += [f"{r.eval_dir}/metrics.json" for r in ablation_runs() if not r.is_main]
    if study_enabled("predict"):
        targets.append(predict_outputs()["predictions"])
    if study_enabled("export"):
        targets.append(export_outputs()["summary"])
    return targets


# ------------------------------------------------------------------ using the model (rules/predict.smk)
def predict_inputs():
    """The folders, files and .txt lists predict.inputs names (Snakemake checks they exist)."""
    return list(STUDY.predict.inputs)


def predict_outputs():
    """predict_images' outputs: the CSV, and the heatmaps' folder with predict.heatmaps."""
    out = {"predictions": "results/predict/predictions.csv"}
    if STUDY.predict.heatmaps:
        out["heatmaps"] = directory("results/predict/heatmaps")
    return out


def heatmap_dir_arg(wildcards, output):
    """Params function: `--heatmap-dir DIR` when the job declares the heatmaps' folder."""
    return f"--heatmap-dir {output.heatmaps}" if "heatmaps" in output.keys() else ""


def export_outputs():
    """export_model's outputs: one file per format of export.formats, and the checks' summary."""
    from chexflow.predict import EXPORT_FILES, EXPORT_SUMMARY

    files = {f: f"results/export/{EXPORT_FILES[f]}" for f in STUDY.export.formats}
    return {**files, "summary": f"results/export/{EXPORT_SUMMARY}"}


def _sweep_trials():
    return _sweep.expand_trials(STUDY.sweep)


def sweep_results():
    return [f"results/sweep/trials/{t['id']}/result.json" for t in _sweep_trials()]


def sweep_trials_arg():
    """`chexflow evaluate --trials-json`: every trial's overrides (the sweep winner is one of them)."""
    return f"--trials-json {shlex.quote(json.dumps([t['params'] for t in _sweep_trials()]))}"


def sweep_trial_json(wildcards):
    """The trial's overrides of the finetune section (a changed trial reruns alone)."""
    return json.dumps(next(t["params"] for t in _sweep_trials() if t["id"] == wildcards.trial))


# ------------------------------------------------------------------ fine-tuning initialisation
FINETUNE_INIT = _train.main_init(config)  # finetune.init of the main run (and the sweep's trials)
ABLATION_INIT = _train.other_init(config)  # the ablation's: the other one


def start_inputs(stage, init):
    """Named inputs of the weights a run of `stage` starts from, so that Snakemake tracks them:
    `pretrained`, the pretraining model (init: pretrained), or `init_file`, the stage's weights file
    (init: file); none from random init."""
    if init == "pretrained":
        return {"pretrained": rules.pretrain_model.output.model}
    if init == "file":
        return {"init_file": STUDY.train[stage].init_file}
    return {}


def pretrain_inputs(wildcards):
    """Input function of pretrain_model: the data and, with pretrain.init: file, the weights file."""
    return {"manifest": manifest(PRETRAIN_DATASET), **start_inputs("pretrain", STUDY.train["pretrain"].init)}


def finetune_inputs(wildcards):
    """Input function of finetune_model, sweep_trial and their evaluations: the data and, only with
    finetune.init: pretrained, the pretraining model, or with init: file the weights file (with init
    random they do not wait for it; the evaluation needs it to compute the run id the model must carry)."""
    return {"manifest": manifest(FINETUNE_DATASET), **start_inputs("finetune", FINETUNE_INIT)}


def ablation_inputs(wildcards):
    """Input function of finetune_ablation and evaluate_ablation: like finetune_inputs, for the other init."""
    return {"manifest": manifest(FINETUNE_DATASET), **start_inputs("finetune", ABLATION_INIT)}


def pretrained_arg(wildcards, input):
    """Params function: `--pretrained PATH` when the job has the input `pretrained`, else nothing."""
    return f"--pretrained {input.pretrained}" if "pretrained" in input.keys() else ""


def seed_inputs(wildcards):
    """Input function of finetune_seed and evaluate_seed: the data and, for the pretrained arm, the
    pretraining model."""
    return {"manifest": manifest(FINETUNE_DATASET), **start_inputs("finetune", wildcards.init)}


def seed_config_json(wildcards):
    """The finetune section of one ablation run: its arm's init and its training seed."""
    return train_config_json("finetune", init=wildcards.init, seed=int(wildcards.seed))


def ablation_runs():
    """The ablation's (arm, seed) runs when it is switched on (chexflow.studies.ablation.runs)."""
    return _ablation.study_runs(STUDY)


def ablation_run_tree():
    """The files of every ablation run, by the run's name (`chexflow compare-ablation --runs-json`)."""
    return {
        f"{r.init}_seed{r.seed}": {
            "metrics": f"{r.eval_dir}/metrics.json",
            "predictions": f"{r.eval_dir}/predictions.csv",
            "training": f"{r.train_dir}/metrics.jsonl",
        }
        for r in ablation_runs()
    }


def ablation_compare_inputs(wildcards):
    """Named inputs of compare_ablation: the leaves of ablation_run_tree."""
    return dict(_leaves(ablation_run_tree()))


def ablation_runs_json(wildcards):
    return json.dumps(ablation_run_tree())


def ablation_main_run(wildcards):
    """The main run's name among ablation_run_tree's."""
    return next(f"{r.init}_seed{r.seed}" for r in ablation_runs() if r.is_main)


# ------------------------------------------------------------------ evaluation
def evaluation_inputs(wildcards):
    """Named inputs of evaluate_model besides the model: finetune_inputs (the shards' manifest and the
    pretraining model, which the run id depends on) and the release's label table (subgroups) and box list
    (localisation) where the dataset has them."""
    ds = FINETUNE_DATASET
    source = STUDY.sources.get(ds)
    files = _registry.get(ds).evaluation_files(source_of(ds), boxes=source.boxes if source else True)
    files = {k: f"data/raw/{ds}/{f.name}" for k, f in files.items()}
    if label_table_of(ds):
        files["label_table"] = label_table_of(ds)
    return {**finetune_inputs(wildcards), **files}


def box_frame(dataset):
    """The side (px) of the images the box list refers to: a generated release's own image size."""
    if dataset in DEMO_RELEASES:
        return STUDY.releases[dataset].image_size
    return _registry.get(dataset).box_frame()


def evaluation_args(wildcards, input):
    """Params function: `--label-table`, `--boxes`/`--box-frame` for the inputs evaluate_model (and
    evaluate_external) has."""
    args = [f"--label-table {input.label_table}"] if "label_table" in input.keys() else []
    if "boxes" in input.keys():
        args.append(f"--boxes {input.boxes} --box-frame {box_frame(FINETUNE_DATASET)}")
    return " ".join(args)


# ------------------------------------------------------------------ external validation
def external_dir(dataset):
    return f"results/external/{dataset}"


def label_table_of(ds):
    """The table of a dataset's sex, age and view (subgroups): a folder dataset's split table, else its
    release's label file where it has one (None: no subgroups)."""
    if _registry.get(ds).folder:
        return f"data/shards/{ds}/splits.csv"
    files = _registry.get(ds).evaluation_files(source_of(ds), boxes=False)
    return f"data/raw/{ds}/{files['label_table'].name}" if "label_table" in files else None


def external_inputs(wildcards):
    """Named inputs of evaluate_external besides the internal evaluation: the external set's manifest and
    its label table (subgroups)."""
    table = label_table_of(wildcards.dataset)
    return {"manifest": manifest(wildcards.dataset), **({"label_table": table} if table else {})}


def external_targets():
    """evaluate_external's records of the datasets evaluate.external names."""
    return {ds: f"{external_dir(ds)}/metrics.json" for ds in STUDY.evaluate.external}


# ------------------------------------------------------------------ the report's inputs: one structure
def report_input_tree():
    """Everything the report reads, as one structure of paths (`chexflow report --inputs-json`): the
    rule's named inputs are its leaves (report_inputs). A new report input is added here only; the
    renderer shows a section for what is there."""
    main = {"pretrain": rules.pretrain_model, "finetune": rules.finetune_model, "evaluate": rules.evaluate_model}
    tree = {
        "evaluation": {k: rules.evaluate_model.output[k] for k in ("metrics", "predictions", "saliency")},
        "training": {"pretrain": rules.pretrain_model.output.metrics, "finetune": rules.finetune_model.output.metrics},
        "manifests": {"pretrain": manifest(PRETRAIN_DATASET), "finetune": manifest(FINETUNE_DATASET)},
        "benchmarks": {stage: job.benchmark for stage, job in main.items()},
    }
    for ds, metrics in external_targets().items():  # each external test set: its record and its data
        tree.setdefault("external", {})[ds] = metrics
        tree["manifests"][f"external_{ds}"] = manifest(ds)
        tree["benchmarks"][f"external_{ds}"] = f"benchmarks/external/{ds}.tsv"
    runs = [r for r in ablation_runs() if not r.is_main]
    for r in runs:  # the ablation's jobs count in the stage times too
        tree["benchmarks"][
            f"finetune_{r.init}_seed{r.seed}"
        ] = f"benchmarks/{r.root.removeprefix('results/')}/train.tsv"
        tree["benchmarks"][
            f"evaluate_{r.init}_seed{r.seed}"
        ] = f"benchmarks/{r.root.removeprefix('results/')}/evaluate.tsv"
    if runs:
        tree["benchmarks"]["compare_ablation"] = "benchmarks/ablation/compare.tsv"
        tree["ablation"] = {"comparison": "results/ablation/comparison.json"}
    if study_enabled("scaling"):
        tree["scaling"] = {"table": "results/scaling/scaling.csv", "plot": "results/scaling/scaling.png"}
    if study_enabled("sweep"):
        tree["sweep"] = {
            "table": "results/sweep/trials.csv",
            "selection": "results/sweep/selection.json",
            "metrics": "results/sweep/evaluate/metrics.json",
        }
    return tree


def _leaves(tree, prefix=""):
    for key, value in tree.items():
        name = f"{prefix}__{key}" if prefix else key
        if isinstance(value, dict):
            yield from _leaves(value, name)
        else:
            yield name, str(value)


def report_inputs(wildcards):
    """Named inputs of render_report: the leaves of report_input_tree."""
    return dict(_leaves(report_input_tree()))


def report_inputs_json(wildcards):
    return json.dumps(report_input_tree())


# ------------------------------------------------------------------ what a plain `snakemake` makes again
def kept_files():
    """What the target `all` lists besides the report: the report's inputs, the files of the
    ablation's runs (compare_ablation's inputs), the shards' part manifests, the sweep's trials and
    the scaling points. Snakemake leaves a missing file alone while what was made from it is up
    to date (snakemake/snakemake#1978): a job that failed (its outputs are deleted; a failed
    `--forcerun` leaves exactly that) would never run again. As targets, a missing one is made again,
    and what depends on it after it; downloads (data/raw) only when a job that reads them runs."""
    parts = dataset_part_manifests(PRETRAIN_DATASET) + dataset_part_manifests(FINETUNE_DATASET)
    parts += [m for ds in STUDY.evaluate.external for m in dataset_part_manifests(ds)]
    scaling = scaling_points() if study_enabled("scaling") else []
    sweep = sweep_results() if study_enabled("sweep") else []
    ablation = [path for _, path in _leaves(ablation_run_tree())]
    return [path for _, path in _leaves(report_input_tree())] + ablation + parts + scaling + sweep


# ------------------------------------------------------------------ before anything is submitted
def refuse_orphaned_training():
    """`onstart`: a training job or process that outlived an earlier Snakemake of this directory (killed,
    then `--unlock`) still holds its checkpoint directory; submitting the stage again would put a
    second trainer into it. Stop before any job is submitted, naming it and what to do."""
    stale_s = max(STUDY.train[stage].checkpoint.lease_stale_s for stage in ("pretrain", "finetune"))
    found = _lease.live_holders("results", stale_s=stale_s)
    if found:
        raise WorkflowError(_lease.orphan_message(found))
