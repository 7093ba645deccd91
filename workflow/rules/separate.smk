# Your own songs (config `separate.inputs`) separated by each trained tier:
# `snakemake --cores 1 separate` writes results/separated/<tier>/<song>/<stem>.<ext> and a JSON
# sidecar per song. One job per tier, a fresh `tiersep separate` process (or container) as in
# training, which chooses its chunk and batch under the memory budget itself. `rule all` never asks
# for it, and with no inputs (the default) the target has nothing to do.
rule separate:
    input:
        separated_folders,


rule separate_tier:
    input:
        model=trained_model,
        preset=preset_file,
        config=ancient(CONFIG_FILE),
    output:
        directory(f"{RESULTS}/separated/{{preset}}"),
    log:
        "logs/separate/{preset}.log",
    benchmark:
        "benchmarks/separate/{preset}.tsv"
    threads: 2
    resources:
        gpu=1,
        mem_mb=lambda wildcards, attempt: attempt * 8000,
        runtime=6 * 60,
    params:
        inputs=" ".join(shlex.quote(path) for path in CFG["separate"]["inputs"]),
        settings=CFG["separate"],
    shell:
        "tiersep separate --config {input.config} --preset {wildcards.preset} --model {input.model}"
        " --out {output} {params.inputs} > {log} 2>&1"
