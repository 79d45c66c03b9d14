# chexflow: download -> shards -> Horovod pretraining -> fine-tuning -> evaluation -> report.
# All logic is in the Python package under workflow/chexflow; the rules only call its CLI.
import sys
from pathlib import Path

from snakemake.utils import min_version, validate

min_version("9.0")

sys.path.insert(0, str(Path(workflow.basedir) / "workflow"))


configfile: "config.yaml"


validate(config, "workflow/chexflow/schemas/config.schema.yaml")


include: "rules/common.smk"
include: "rules/download.smk"
include: "rules/shards.smk"
include: "rules/pretrain.smk"
include: "rules/finetune.smk"
include: "rules/evaluate.smk"
include: "rules/report.smk"


rule all:
    input:
        "results/report/chexflow_report.html",
