# Evaluation: the selected model on the test split: AUROC per finding with bootstrap CIs, PR,
# calibration and operating points, AUROC and underdiagnosis by subgroup (the release's label table), Grad-CAM
# heatmaps scored against the release's box list (evaluation_inputs), and the model file that travels alone
# (the weights with what predict needs: thresholds, stored size, normalisation). evaluate_model is the body
# the studies' evaluations (evaluate_ablation, evaluate_seed, evaluate_sweep_winner) share through
# `use rule ... with:`. Evaluation refuses a model whose run id is not the one of the training
# settings it is handed on this manifest's data (--train-config-json, --manifest, and the pretraining
# model for init: pretrained, hence the same inputs as the training job): a stale model is never scored.


rule evaluate_model:
    input:
        unpack(evaluation_inputs),
        model=rules.finetune_model.output.model,
    output:
        metrics="results/evaluate/metrics.json",
        predictions="results/evaluate/predictions.csv",
        auroc=report("results/evaluate/auroc.csv", caption="../report/auroc.rst", category="Evaluation"),
        calibration="results/evaluate/calibration.csv",
        subgroups="results/evaluate/subgroups.csv",
        underdiagnosis="results/evaluate/underdiagnosis.csv",
        localisation="results/evaluate/localisation.csv",
        saliency="results/evaluate/saliency.npz",
        model="results/evaluate/model.pt",  # the evaluated model with its predict record: travels alone
    log:
        "logs/evaluate/evaluate.log",
    benchmark:
        "benchmarks/evaluate/evaluate.tsv"
    conda:
        "../envs/train.yaml"
    params:
        cfg=stage_json("evaluate"),
        train=train_config_json("finetune"),
        pretrained=pretrained_arg,
        trials="",
        out_dir=output_dir,
        extra=evaluation_args,
    shell:
        "chexflow evaluate --config-json {params.cfg:q} --model {input.model}"
        " --manifest {input.manifest} --train-config-json {params.train:q} {params.pretrained}"
        " {params.trials} --out-dir {params.out_dir} {params.extra} > {log} 2>&1"


# External validation (evaluate.external): the evaluated model on another dataset's test split, for the
# findings both share (chexflow.data.labelmap), beside the internal test: AUROC per finding with its patient
# bootstrap CI on each test set, and the drop with a CI from independent bootstraps of the two (they share no
# patient). The model must be the one the internal record was made with (its run id). The external set's
# matched findings get the internal audits too: calibration, and AUROC by subgroup from its label table.
rule evaluate_external:
    input:
        unpack(external_inputs),
        model=rules.evaluate_model.output.model,
        metrics=rules.evaluate_model.output.metrics,
        predictions=rules.evaluate_model.output.predictions,
    output:
        metrics="results/external/{dataset}/metrics.json",
        predictions="results/external/{dataset}/predictions.csv",
        auroc=report("results/external/{dataset}/auroc.csv", caption="../report/external.rst", category="Evaluation"),
    log:
        "logs/external/{dataset}.log",
    benchmark:
        "benchmarks/external/{dataset}.tsv"
    conda:
        "../envs/train.yaml"
    params:
        cfg=stage_json("evaluate"),
        out_dir=output_dir,
        extra=evaluation_args,
    shell:
        "chexflow evaluate-external --config-json {params.cfg:q} --model {input.model}"
        " --manifest {input.manifest} --internal-metrics {input.metrics}"
        " --internal-predictions {input.predictions} --out-dir {params.out_dir} {params.extra} > {log} 2>&1"
