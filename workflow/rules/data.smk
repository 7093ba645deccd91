# The merged config every job reads (Snakemake's config after --configfile/--config, validated).
# This rule makes it when it is missing; a run that starts jobs writes it again first (onstart in
# common.smk). It has no params on purpose, and its command reads the merged config from a global
# of the Snakefile, outside the command's text: a config change must not rerun this job, or
# Snakemake would skip the params check of every job below it (their config input is ancient) and
# the first run would do nothing but rewrite this file.
rule config:
    output:
        CONFIG_FILE,
    log:
        "logs/config.log",
    localrule: True
    shell:
        "tiersep config --merged {MERGED_CONFIG:q} --out {output} > {log} 2>&1"


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
