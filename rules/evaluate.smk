# Evaluation: the selected model on the test split, AUROC per finding with bootstrap CIs.
# evaluate_model is the body the studies' evaluations (evaluate_ablation, evaluate_sweep_winner)
# share through `use rule ... with:`.


rule evaluate_model:
    input:
        model=rules.finetune_model.output.model,
        manifest=manifest(FINETUNE_DATASET),
    output:
        metrics="results/evaluate/metrics.json",
        predictions="results/evaluate/predictions.csv",
        auroc=report("results/evaluate/auroc.csv", caption="../report/auroc.rst", category="Evaluation"),
    log:
        "logs/evaluate/evaluate.log",
    benchmark:
        "benchmarks/evaluate/evaluate.tsv"
    conda:
        "../envs/train.yaml"
    params:
        cfg=stage_json("evaluate"),
        out_dir=output_dir,
    shell:
        "chexflow evaluate --config-json {params.cfg:q} --model {input.model}"
        " --manifest {input.manifest} --out-dir {params.out_dir} > {log} 2>&1"
