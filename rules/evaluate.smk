# Evaluation: the selected model on the test split, AUROC per finding with bootstrap CIs.


rule evaluate_model:
    input:
        model="results/finetune/model.pt",
        manifest=manifest(FINETUNE_DATASET),
    output:
        metrics="results/evaluate/metrics.json",
        predictions="results/evaluate/predictions.csv",
        auroc=report("results/evaluate/auroc.csv", caption="../report/auroc.rst", category="Evaluation"),
    params:
        cfg=stage_json("evaluate"),
    log:
        "logs/evaluate/evaluate.log",
    benchmark:
        "benchmarks/evaluate/evaluate.tsv"
    conda:
        "../envs/train.yaml"
    shell:
        "chexflow evaluate --config-json {params.cfg:q} --model {input.model}"
        " --manifest {input.manifest} --out-dir results/evaluate > {log} 2>&1"
