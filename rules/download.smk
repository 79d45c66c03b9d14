# Download: one job per file of a source, verified by checksum, written atomically.


# A generated phantom release (demo only): nih_demo (fine-tuning) or nih_demo_pretrain (the
# pretraining corpus). SHA256SUMS is written last and lists every file; each download job checks
# its file against it.
rule make_demo_release:
    output:
        "data/demo/{demo}/SHA256SUMS",
    log:
        "logs/download/make_demo_release_{demo}.log",
    benchmark:
        "benchmarks/download/make_demo_release_{demo}.tsv"
    conda:
        "../envs/data.yaml"
    params:
        cfg=demo_release_json,
        out_dir=output_dir,
    shell:
        "chexflow make-demo-release --dataset {wildcards.demo} --config-json {params.cfg:q}"
        " --out {params.out_dir} > {log} 2>&1"


rule download_file:
    input:
        download_inputs,
    output:
        "data/raw/{dataset}/{file}",
    log:
        "logs/download/{dataset}/{file}.log",
    benchmark:
        "benchmarks/download/{dataset}/{file}.tsv"
    conda:
        "../envs/data.yaml"
    resources:
        downloads=1,
    params:
        mirror=download_mirror,
        source_args=source_args,
        dest=output_dir,
    shell:
        "chexflow download --dataset {wildcards.dataset} --file {wildcards.file:q}"
        " --dest {params.dest} --mirror {params.mirror:q}"
        " {params.source_args} > {log} 2>&1"
