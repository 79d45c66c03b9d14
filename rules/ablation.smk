# Ablation (config `ablation:`, in `rule all` only when ablation.enabled): fine-tuning from the
# other initialisation than finetune.init (chexflow.studies.ablation: random init when the main
# run starts from the pretraining model), with the same budget (the finetune section unchanged
# otherwise), evaluated on test like the main run (without heatmaps: the report shows the main
# model's). compare_ablation compares the runs (results/ablation/comparison.json); the report
# renders that. With ablation.seeds, every arm also runs with each other seed (finetune_seed,
# evaluate_seed under results/ablation/seed<seed>/<init>/).
# With finetune.init_file set, a third arm starts from that file (published weights) and runs as
# finetune_seed/evaluate_seed for every seed, finetune.seed's included.


use rule finetune_model as finetune_ablation with:
    input:
        unpack(ablation_inputs),
    output:
        model="results/ablation/finetune/model.pt",
        metrics="results/ablation/finetune/metrics.jsonl",
    log:
        "logs/ablation/train.log",
    benchmark:
        "benchmarks/ablation/train.tsv"
    params:
        cfg=train_config_json("finetune", init=ABLATION_INIT),
        tensorboard="logs/ablation/tensorboard",


use rule evaluate_model as evaluate_ablation with:
    input:
        unpack(ablation_inputs),
        model=rules.finetune_ablation.output.model,
    output:
        metrics="results/ablation/evaluate/metrics.json",
        predictions="results/ablation/evaluate/predictions.csv",
        auroc=report("results/ablation/evaluate/auroc.csv", caption="../report/auroc.rst", category="Ablation"),
    log:
        "logs/ablation/evaluate.log",
    benchmark:
        "benchmarks/ablation/evaluate.tsv"
    params:
        train=train_config_json("finetune", init=ABLATION_INIT),
        extra="--no-heatmaps",


use rule finetune_model as finetune_seed with:
    input:
        unpack(seed_inputs),
    output:
        model="results/ablation/seed{seed}/{init}/finetune/model.pt",
        metrics="results/ablation/seed{seed}/{init}/finetune/metrics.jsonl",
    log:
        "logs/ablation/seed{seed}/{init}/train.log",
    benchmark:
        "benchmarks/ablation/seed{seed}/{init}/train.tsv"
    wildcard_constraints:
        seed="[0-9]+",
        init="random|pretrained|file",
    params:
        cfg=seed_config_json,
        tensorboard="logs/ablation/seed{seed}/{init}/tensorboard",


use rule evaluate_model as evaluate_seed with:
    input:
        unpack(seed_inputs),
        model=rules.finetune_seed.output.model,
    output:
        metrics="results/ablation/seed{seed}/{init}/evaluate/metrics.json",
        predictions="results/ablation/seed{seed}/{init}/evaluate/predictions.csv",
        auroc="results/ablation/seed{seed}/{init}/evaluate/auroc.csv",
    log:
        "logs/ablation/seed{seed}/{init}/evaluate.log",
    benchmark:
        "benchmarks/ablation/seed{seed}/{init}/evaluate.tsv"
    wildcard_constraints:
        seed="[0-9]+",
        init="random|pretrained|file",
    params:
        train=seed_config_json,
        extra="--no-heatmaps",


# The comparison of the runs above (chexflow.studies.ablation_compare): pretrained - random per seed
# and over seeds, and the published-weights arm's two questions, each a paired patient bootstrap of
# the test mean AUROC on the same images. The report renders this record.
rule compare_ablation:
    input:
        unpack(ablation_compare_inputs),
    output:
        comparison="results/ablation/comparison.json",
    log:
        "logs/ablation/compare.log",
    benchmark:
        "benchmarks/ablation/compare.tsv"
    conda:
        "../envs/report.yaml"
    params:
        cfg=stage_json("evaluate"),
        runs=ablation_runs_json,
        main=ablation_main_run,
    shell:
        "chexflow compare-ablation --config-json {params.cfg:q} --runs-json {params.runs:q}"
        " --main {params.main} --out {output.comparison} > {log} 2>&1"
