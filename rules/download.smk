# Download: one job per file of a source, verified by checksum, written atomically.


rule make_demo_release:
    output:
        demo_release_files(),
    log:
        "logs/download/make_demo_release.log",
    benchmark:
        "benchmarks/download/make_demo_release.tsv"
    conda:
        "../envs/data.yaml"
    params:
        cfg=stage_json("demo_release"),
        out_dir=output_dir,
    shell:
        "chexflow make-demo-release --config-json {params.cfg:q} --out {params.out_dir} > {log} 2>&1"


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
        source_args=download_args,
        dest=output_dir,
    shell:
        "chexflow download --dataset {wildcards.dataset} --file {wildcards.file:q}"
        " --dest {params.dest} --mirror {params.mirror:q}"
        " {params.source_args} > {log} 2>&1"
