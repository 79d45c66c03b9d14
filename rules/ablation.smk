# Ablation (config `ablation:`, in `rule all` only when ablation.enabled): fine-tuning from the
# other initialisation than finetune.init (chexflow.studies.ablation: random init when the main
# run starts from the pretraining model), with the same budget (the finetune section unchanged
# otherwise), evaluated on test like the main run. The report compares the mean AUROC of both.


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
