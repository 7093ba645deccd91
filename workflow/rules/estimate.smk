# Peak-memory estimate of every preset before anything trains; the train job gates on it. Each
# trained tier is estimated for the device it trains on (estimate.device auto). No estimate job
# touches CUDA: budget_gib auto is checked by the train job, on its GPU. One job writes every
# tier's record: starting Python and torch, most of one estimate's time, is paid once (issue 24).
rule estimate:
    input:
        presets=preset_files(ESTIMATED),
        config=ancient(CONFIG_FILE),
    output:
        json=expand(f"{RESULTS}/vram/{{preset}}.json", preset=ESTIMATED),
    log:
        "logs/estimate/estimate.log",
    benchmark:
        "benchmarks/estimate/estimate.tsv"
    threads: 1
    resources:
        mem_mb=3000,
        runtime=15 * len(ESTIMATED),
    params:
        estimate=CFG["estimate"],
        budget=CFG["budget_gib"],
        presets=" ".join(f"--preset {shlex.quote(name)}" for name in ESTIMATED),
        # a function: Snakemake would read {preset} in a plain string as a wildcard
        out=lambda wildcards: shlex.quote(f"{RESULTS}/vram/{{preset}}.json"),
    shell:
        "tiersep estimate --config {input.config} {params.presets} --out {params.out} > {log} 2>&1"
