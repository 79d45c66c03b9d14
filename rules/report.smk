# Report: one self-contained HTML file (plots inline), with sections for the studies switched on
# in config.yaml (scaling, sweep, ablation: their outputs become inputs via report_study_inputs).
# `snakemake --report report.html` (or .zip) also collects the files marked with report() below
# and in the study rules, with the captions in report/.


rule render_report:
    input:
        unpack(report_study_inputs),
        metrics=rules.evaluate_model.output.metrics,
        predictions=rules.evaluate_model.output.predictions,
        pretrain=rules.pretrain_model.output.metrics,
        finetune=rules.finetune_model.output.metrics,
        pretrain_manifest=manifest(PRETRAIN_DATASET),
        finetune_manifest=manifest(FINETUNE_DATASET),
    output:
        report("results/report/chexflow_report.html", caption="../report/chexflow_report.rst", category="Report"),
    log:
        "logs/report/report.log",
    benchmark:
        "benchmarks/report/report.tsv"
    conda:
        "../envs/report.yaml"
    params:
        cfg=json.dumps(resolved_config(config)),
        manifests=report_manifest_args(),
        benchmarks=report_benchmark_args(),
        repo=workflow.basedir,
        studies=report_study_args(),
    shell:
        "chexflow report --out {output} --metrics {input.metrics} --predictions {input.predictions}"
        " --pretrain-metrics {input.pretrain} --finetune-metrics {input.finetune}"
        " {params.manifests} {params.benchmarks} --study-config-json {params.cfg:q}"
        " --repo {params.repo:q} {params.studies} > {log} 2>&1"
