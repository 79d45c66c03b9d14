# Fine-tuning: the training rule on the fine-tuning data, starting from the pretraining model's
# backbone (weights only) with finetune.init: pretrained; with init: random it does not need the
# pretraining model (finetune_inputs).


use rule pretrain_model as finetune_model with:
    input:
        unpack(finetune_inputs),
    output:
        model="results/finetune/model.pt",
        metrics="results/finetune/metrics.jsonl",
    log:
        "logs/finetune/train.log",
    benchmark:
        "benchmarks/finetune/train.tsv"
    params:
        cfg=train_config_json("finetune"),
        backend=train_backend("finetune"),
        tensorboard="logs/finetune/tensorboard",
