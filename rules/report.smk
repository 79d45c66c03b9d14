# Report: one self-contained HTML file (plots inline), with sections for what its inputs hold (the
# studies switched on in config.yaml), and the model card next to the model. The rule hands the
# report its inputs as one structure (report_input_tree in common.smk; its leaves are the named
# inputs). `snakemake --report report.html` (or .zip) also collects the files marked with report()
# below and in the study rules, with the captions in report/.


rule render_report:
    input:
        unpack(report_inputs),
    output:
        html=report("results/report/chexflow_report.html", caption="../report/chexflow_report.rst", category="Report"),
        card="results/finetune/model_card.md",
    log:
        "logs/report/report.log",
    benchmark:
        "benchmarks/report/report.tsv"
    conda:
        "../envs/report.yaml"
    params:
        inputs=report_inputs_json,
        cfg=json.dumps(resolved_config(config)),
        repo=workflow.basedir,
    shell:
        "chexflow report --out {output.html} --model-card {output.card} --inputs-json {params.inputs:q}"
        " --study-config-json {params.cfg:q} --repo {params.repo:q} > {log} 2>&1"
