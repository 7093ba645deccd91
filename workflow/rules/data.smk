# The merged config every job reads (Snakemake's config after --configfile/--config, validated).
rule config:
    output:
        CONFIG_FILE,
    log:
        "logs/config.log",
    localrule: True
    params:
        merged=lambda wildcards: MERGED_CONFIG,  # a function: braces in a value are not wildcards
    shell:
        "tiersep config --merged {params.merged:q} --out {output} > {log} 2>&1"


# Ingest + validate + resample once. One job per (source, rate); the folder is one output, so a
# second run does no work. params carry the data settings, so changing them re-prepares.
rule prepare:
    input:
        config=ancient(CONFIG_FILE),
    output:
        directory(f"{CFG['data']['prepared_dir']}/{CFG['data']['source']}/{{rate}}"),
    log:
        "logs/prepare/{rate}.log",
    benchmark:
        "benchmarks/prepare/{rate}.tsv"
    threads: 1
    resources:
        mem_mb=4000,
        runtime=60,
    params:
        data=CFG["data"],
    shell:
        "tiersep prepare --config {input.config} --out {output} --sample-rate {wildcards.rate} > {log} 2>&1"
