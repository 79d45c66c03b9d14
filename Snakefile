# chexflow: download -> shards -> Horovod pretraining -> fine-tuning -> evaluation -> report.
# All logic is in the Python package under workflow/chexflow; the rules only call its CLI.
import sys
from pathlib import Path

from snakemake.utils import min_version, validate

min_version("9.0")

sys.path.insert(0, str(Path(workflow.basedir) / "workflow"))

from chexflow.config import check_study


configfile: "config.yaml"


report: "report/workflow.rst"


# Every range and every relation between settings, all problems at once, before any job
# (chexflow.config.check_study); then the generated schema, as editors and `snakemake --lint` see it.
STUDY = check_study(config)


validate(config, "workflow/chexflow/schemas/config.schema.yaml")


# config.yaml's container.image: each job inside it (with --sdm apptainer); null: none (docs/container.md)
container: STUDY.container.image


include: "rules/common.smk"
include: "rules/download.smk"
include: "rules/shards.smk"
include: "rules/pretrain.smk"
include: "rules/finetune.smk"
include: "rules/evaluate.smk"
include: "rules/report.smk"
include: "rules/scaling.smk"
include: "rules/sweep.smk"
include: "rules/ablation.smk"
include: "rules/predict.smk"


onstart:
    refuse_orphaned_training()  # training left running by a killed Snakemake: name it, submit nothing


rule all:
    input:
        "results/report/chexflow_report.html",
        study_targets(),  # scaling / sweep / ablation / predict / export outputs, when enabled in config.yaml
        kept_files(),  # what they are made from: a missing one (a failed job's) is made again
