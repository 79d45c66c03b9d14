# Using the fine-tuned model (off by default: config.yaml `predict:` and `export:`). predict_images
# applies it to the image files of predict.inputs (PNG, JPEG, DICOM): one CSV row per file, heatmaps
# with predict.heatmaps. export_model writes its TorchScript and ONNX files, each checked against
# torch on test images of the manifest. Both read evaluation's model file, which carries the thresholds
# chosen on validation and the stored image size of the data the model was trained on.


rule predict_images:
    input:
        model=rules.evaluate_model.output.model,
        images=predict_inputs(),
    output:
        **predict_outputs(),
    log:
        "logs/predict/predict.log",
    benchmark:
        "benchmarks/predict/predict.tsv"
    conda:
        "../envs/predict.yaml"
    threads: 2  # the model, and the processes decoding files beside it
    params:
        cfg=study_json("predict"),
        heatmaps=heatmap_dir_arg,
    shell:
        "chexflow predict --config-json {params.cfg:q} --model {input.model}"
        " --out {output.predictions} {params.heatmaps} > {log} 2>&1"


rule export_model:
    input:
        model=rules.evaluate_model.output.model,
        manifest=manifest(FINETUNE_DATASET),
        card=rules.render_report.output.card,  # the model card travels with the exports
    output:
        **export_outputs(),
    log:
        "logs/export/export.log",
    benchmark:
        "benchmarks/export/export.tsv"
    conda:
        "../envs/predict.yaml"
    params:
        cfg=study_json("export"),
        out_dir=output_dir,
    shell:
        "chexflow export --config-json {params.cfg:q} --model {input.model} --manifest {input.manifest}"
        " --out-dir {params.out_dir} --model-card {input.card} > {log} 2>&1"
