# Ablation (config `ablation:`, in `rule all` only when ablation.enabled): fine-tuning from the
# other initialisation than finetune.init (random init when the main run starts from the
# pretraining model), with the same budget (the finetune section unchanged otherwise), evaluated
# on test like the main run. The report compares the mean AUROC of both.


rule finetune_ablation:
    input:
        init_inputs(ABLATION_INIT),
        manifest=manifest(FINETUNE_DATASET),
    output:
        model="results/ablation/finetune/model.pt",
        metrics="results/ablation/finetune/metrics.jsonl",
    params:
        cfg=ablation_train_json(),
        backend=config["finetune"]["backend"],
        pretrained=init_arg(ABLATION_INIT),
    log:
        "logs/ablation/train.log",
    benchmark:
        "benchmarks/ablation/train.tsv"
    threads: 2
    resources:
        tasks=2,
        mpi="chexflow launch",
    conda:
        "../envs/train.yaml"
    shell:
        "CHEXFLOW_BACKEND={params.backend} {resources.mpi} -n {resources.tasks}"
        " chexflow train --config-json {params.cfg:q} --manifest {input.manifest} {params.pretrained}"
        " --out-dir results/ablation/finetune --ckpt-dir results/ablation/finetune/checkpoints"
        " > {log} 2>&1"


rule evaluate_ablation:
    input:
        model="results/ablation/finetune/model.pt",
        manifest=manifest(FINETUNE_DATASET),
    output:
        metrics="results/ablation/evaluate/metrics.json",
        predictions="results/ablation/evaluate/predictions.csv",
        auroc=report("results/ablation/evaluate/auroc.csv", caption="../report/auroc.rst", category="Ablation"),
    params:
        cfg=stage_json("evaluate"),
    log:
        "logs/ablation/evaluate.log",
    benchmark:
        "benchmarks/ablation/evaluate.tsv"
    conda:
        "../envs/train.yaml"
    shell:
        "chexflow evaluate --config-json {params.cfg:q} --model {input.model}"
        " --manifest {input.manifest} --out-dir results/ablation/evaluate > {log} 2>&1"
