# Training: one multi-rank job. `resources.mpi` is the launcher: `chexflow launch` (local ranks
# via horovodrun/torchrun) on a workstation, `srun --mpi=pmix ...` under SLURM (profile).
# Checkpoints go to <output dir>/checkpoints/, which is NOT a declared output, so a rerun after a
# failure or preemption resumes from them. Snakemake deletes the log before every attempt (a retry,
# a requeued job's restart): `chexflow keep-log` keeps each attempt's as train.<n>.log too.
# pretrain_model is the body that finetune_model and finetune_ablation share through `use rule ...
# with:` (sweep_trial and scale_pretrain run other commands, which `use rule` cannot change, with the
# same helpers).


rule pretrain_model:
    input:
        unpack(pretrain_inputs),
    output:
        model="results/pretrain/model.pt",
        metrics="results/pretrain/metrics.jsonl",
    log:
        "logs/pretrain/train.log",
    benchmark:
        "benchmarks/pretrain/train.tsv"
    conda:
        "../envs/train.yaml"
    # one core (OMP_NUM_THREADS=1) and one local rank on a workstation: two CPU ranks on 2 cores
    # cost 2.3-2.5x the CPU of one, and two one-core jobs (pretraining and the ablation's
    # fine-tuning) side by side beat one two-core job after the other (BENCHMARKS.md);
    # `--set-resources pretrain_model:tasks=N` and the SLURM profile set N ranks and their cores
    # (`chexflow launch` shares the job's threads among its local ranks)
    threads: 1
    resources:
        tasks=1,
        mpi="chexflow launch",
    params:
        cfg=train_config_json("pretrain"),
        backend=train_backend("pretrain"),
        pretrained=pretrained_arg,
        out_dir=output_dir,
        tensorboard="logs/pretrain/tensorboard",
    shell:
        "chexflow keep-log {log} && CHEXFLOW_BACKEND={params.backend} {resources.mpi} -n {resources.tasks}"
        " chexflow train --config-json {params.cfg:q} --manifest {input.manifest} {params.pretrained}"
        " --out-dir {params.out_dir} --ckpt-dir {params.out_dir}/checkpoints"
        " --tensorboard {params.tensorboard} > {log} 2>&1"
