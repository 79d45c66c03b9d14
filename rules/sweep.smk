# Hyper-parameter sweep of fine-tuning (config `sweep:`, in `rule all` only when sweep.enabled):
# one job per trial (trials: chexflow.studies.sweep.expand_trials, grid or seeded random), each a
# real fine-tuning run of `resources.tasks` ranks started by `chexflow sweep-trial` through the
# launcher. A trial that diverges or crashes is recorded as failed in its result.json (the job
# succeeds); a bad trial config, a missing input or preemption fails the job; select_sweep fails
# when no trial succeeded. The winner (best validation AUROC) is the only model evaluated on test.


rule sweep_trial:
    input:
        unpack(finetune_inputs),
    output:
        "results/sweep/trials/{trial}/result.json",
    log:
        "logs/sweep/{trial}.log",
    benchmark:
        "benchmarks/sweep/{trial}.tsv"
    wildcard_constraints:
        trial="t[0-9]+",
    conda:
        "../envs/train.yaml"
    threads: 2
    resources:
        tasks=2,
        mpi="chexflow launch",
    params:
        cfg=train_config_json("finetune"),
        trial=sweep_trial_json,
        pretrained=pretrained_arg,
        out_dir=output_dir,
    shell:
        "chexflow keep-log {log} && chexflow sweep-trial --config-json {params.cfg:q} --params-json {params.trial:q}"
        " --trial {wildcards.trial} --launcher {resources.mpi:q} -n {resources.tasks}"
        " --manifest {input.manifest} {params.pretrained}"
        " --out-dir {params.out_dir} > {log} 2>&1"


rule select_sweep:
    input:
        sweep_results(),
    output:
        table=report("results/sweep/trials.csv", caption="../report/sweep.rst", category="Sweep"),
        summary="results/sweep/selection.json",
        model="results/sweep/winner/model.pt",
    log:
        "logs/sweep/select.log",
    benchmark:
        "benchmarks/sweep/select.tsv"
    conda:
        "../envs/train.yaml"  # torch: the winner's model file is checked before it is copied
    shell:
        "chexflow sweep-select --out-csv {output.table} --out-json {output.summary}"
        " --out-model {output.model} {input} > {log} 2>&1"


# the winner's model must carry the run id of one of the trials (select_sweep checked it is the winner's)
use rule evaluate_model as evaluate_sweep_winner with:
    input:
        unpack(finetune_inputs),
        model=rules.select_sweep.output.model,
    output:
        metrics="results/sweep/evaluate/metrics.json",
        predictions="results/sweep/evaluate/predictions.csv",
        auroc=report("results/sweep/evaluate/auroc.csv", caption="../report/auroc.rst", category="Sweep"),
    log:
        "logs/sweep/evaluate.log",
    benchmark:
        "benchmarks/sweep/evaluate.tsv"
    params:
        trials=sweep_trials_arg(),
        extra="--no-heatmaps",
