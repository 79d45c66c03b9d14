# Fine-tuning: one multi-rank job starting from the pretraining model's backbone (weights only).


rule finetune_model:
    input:
        manifest=manifest(FINETUNE_DATASET),
        pretrained="results/pretrain/model.pt",
    output:
        model="results/finetune/model.pt",
        metrics="results/finetune/metrics.jsonl",
    params:
        cfg=train_config_json("finetune"),
        backend=config["finetune"]["backend"],
    log:
        "logs/finetune/train.log",
    benchmark:
        "benchmarks/finetune/train.tsv"
    threads: 2
    resources:
        tasks=2,
        mpi="chexflow launch",
    conda:
        "../envs/train.yaml"
    shell:
        "CHEXFLOW_BACKEND={params.backend} {resources.mpi} -n {resources.tasks}"
        " chexflow train --config-json {params.cfg:q} --manifest {input.manifest}"
        " --pretrained {input.pretrained}"
        " --out-dir results/finetune --ckpt-dir results/finetune/checkpoints"
        " --tensorboard logs/finetune/tensorboard > {log} 2>&1"
