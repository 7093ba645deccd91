# The merged config every job reads (Snakemake's config after --configfile/--config, validated).
# This rule makes it when it is missing; a run that starts jobs writes it again first (onstart in
# common.smk). No params, and its input is ancient: a config change must not rerun this job (see
# MERGED_FILE in common.smk).
rule config:
    input:
        merged=ancient(MERGED_FILE),
    output:
        CONFIG_FILE,
    log:
        "logs/config.log",
    localrule: True
    shell:
        "tiersep config --merged @{input.merged} --out {output} > {log} 2>&1"


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
