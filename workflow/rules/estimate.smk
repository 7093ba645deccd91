# Peak-memory estimate of every preset before anything trains; the train job gates on it. Each
# trained tier is estimated for the device it trains on (estimate.device auto). No estimate job
# touches CUDA: budget_gib auto is checked by the train job, on its GPU.
rule estimate:
    input:
        preset=preset_file,
        config=ancient(CONFIG_FILE),
    output:
        json=f"{RESULTS}/vram/{{preset}}.json",
    log:
        "logs/estimate/{preset}.log",
    benchmark:
        "benchmarks/estimate/{preset}.tsv"
    threads: 1
    resources:
        mem_mb=3000,
        runtime=15,
    params:
        estimate=CFG["estimate"],
        budget=CFG["budget_gib"],
    shell:
        "tiersep estimate --config {input.config} --preset {wildcards.preset} --out {output.json} > {log} 2>&1"
