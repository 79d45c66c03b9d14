# Scaling study (config `scaling:`, in `rule all` only when scaling.enabled): the pretraining
# workload of a fixed size per rank (weak scaling), one job per world size, with the real trainer
# and launcher, then a table (images/s, speedup, efficiency, time per epoch) and a plot.
#
# World size -> ranks: `resources.tasks` is the `world` wildcard. On a workstation
# `chexflow launch` starts that many local ranks. Under profiles/slurm the rule's set-resources
# entry turns it into GPUs and nodes from the same wildcard (resource expressions there see
# `wildcards`): gpu = tasks = world (one rank per GPU, --ntasks-per-gpu=1) on
# nodes = ceil(world / GPUs per node), and `mpi` is the site's `srun --mpi=pmix ...` line. So
# world_sizes [1, 2, 4, 8, 16] on 4-GPU nodes runs 1 node x 1, 1 x 2, 1 x 4, 2 x 4, 4 x 4 GPUs.
# A measurement takes the whole workstation (threads: all cores) so no other job skews it; the
# job's cores are shared evenly by its ranks on a node (--job-threads): on a workstation world 1
# uses all cores and world 2 half each (do more ranks on the same machine help?), on a cluster
# every rank brings its own GPU and cores.


rule scale_pretrain:
    input:
        unpack(pretrain_inputs),
    output:
        "results/scaling/world{world}/throughput.json",
    log:
        "logs/scaling/world{world}.log",
    benchmark:
        "benchmarks/scaling/world{world}.tsv"
    wildcard_constraints:
        world="[1-9][0-9]*",
    conda:
        "../envs/train.yaml"
    # all the cores Snakemake may use locally (Snakemake caps a rule's threads at --cores); not
    # `workflow.cores`, which fails under a cluster executor (no --cores): there the profile's
    # cpus_per_task gives each rank its cores
    threads: 1024
    resources:
        tasks=scaling_tasks,
        mpi="chexflow launch",
    params:
        cfg=train_config_json("pretrain"),
        scaling=study_json("scaling"),
        backend=train_backend("pretrain"),
        out_dir=output_dir,
    shell:
        "CHEXFLOW_BACKEND={params.backend} {resources.mpi} -n {resources.tasks}"
        " chexflow scale-point --config-json {params.cfg:q} --scaling-json {params.scaling:q}"
        " --world {wildcards.world} --job-threads {threads} --manifest {input.manifest}"
        " --out-dir {params.out_dir} > {log} 2>&1"


rule summarize_scaling:
    input:
        scaling_points(),
    output:
        csv=report("results/scaling/scaling.csv", caption="../report/scaling_table.rst", category="Scaling"),
        json="results/scaling/scaling.json",
        plot=report("results/scaling/scaling.png", caption="../report/scaling_plot.rst", category="Scaling"),
    log:
        "logs/scaling/summary.log",
    benchmark:
        "benchmarks/scaling/summary.tsv"
    conda:
        "../envs/report.yaml"
    shell:
        "chexflow scale-summary --out-csv {output.csv} --out-json {output.json} --out-plot {output.plot}"
        " {input} > {log} 2>&1"
