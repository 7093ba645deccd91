# Ingest + validate + resample once. One job per (source, rate); the folder is one output, so a
# second run does no work. params carry the data settings, so changing them re-prepares.
rule prepare:
    output:
        directory(f"{CFG['data']['prepared_dir']}/{CFG['data']['source']}/{{rate}}"),
    params:
        config=CONFIG_FILE,
        data=CFG["data"],
    log:
        "logs/prepare/{rate}.log",
    benchmark:
        "benchmarks/prepare/{rate}.tsv"
    threads: 1
    resources:
        mem_mb=4000,
        runtime=60,
    container:
        CONTAINER
    conda:
        CONDA_ENV
    shell:
        "tiersep prepare --config {params.config} --out {output} --sample-rate {wildcards.rate} > {log} 2>&1"
