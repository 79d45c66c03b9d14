# Shards: a patient-wise split, one shard job per source archive, then a gather into the manifest.


rule split_dataset:
    input:
        split_inputs,
    output:
        "data/shards/{dataset}/splits.csv",
    log:
        "logs/shards/{dataset}/split.log",
    benchmark:
        "benchmarks/shards/{dataset}/split.tsv"
    conda:
        "../envs/data.yaml"
    params:
        cfg=shard_config_json,
    shell:
        "chexflow split --config-json {params.cfg:q} --raw data/raw/{wildcards.dataset}" " --out {output} > {log} 2>&1"


rule write_shards:
    input:
        raw=part_inputs,
        splits="data/shards/{dataset}/splits.csv",
    output:
        "data/shards/{dataset}/parts/{part}/manifest.json",
    log:
        "logs/shards/{dataset}/{part}.log",
    benchmark:
        "benchmarks/shards/{dataset}/{part}.tsv"
    conda:
        "../envs/data.yaml"
    params:
        cfg=shard_config_json,
        out_dir=output_dir,
        source_args=source_args,
    shell:
        "chexflow shards --config-json {params.cfg:q} --part {wildcards.part}"
        " --raw data/raw/{wildcards.dataset} --splits {input.splits}"
        " --out {params.out_dir} {params.source_args} > {log} 2>&1"


rule gather_shards:
    input:
        parts=part_manifests,
        splits="data/shards/{dataset}/splits.csv",
    output:
        "data/shards/{dataset}/manifest.json",
    log:
        "logs/shards/{dataset}/gather.log",
    benchmark:
        "benchmarks/shards/{dataset}/gather.tsv"
    conda:
        "../envs/data.yaml"
    params:
        cfg=gather_config_json,
    shell:
        "chexflow gather --config-json {params.cfg:q} --splits {input.splits} --out {output}"
        " {input.parts} > {log} 2>&1"
