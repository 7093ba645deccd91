# Peak-VRAM estimate of every preset before anything trains; the train job gates on it.
rule estimate:
    input:
        preset=preset_file,
    output:
        json=f"{RESULTS}/vram/{{preset}}.json",
    params:
        config=CONFIG_FILE,
        estimate=CFG["estimate"],
        budget=CFG["budget_gib"],
    log:
        "logs/estimate/{preset}.log",
    benchmark:
        "benchmarks/estimate/{preset}.tsv"
    threads: 1
    resources:
        mem_mb=3000,
        runtime=15,
    container:
        CONTAINER
    conda:
        CONDA_ENV
    shell:
        "tiersep estimate --config {params.config} --preset {wildcards.preset} --out {output.json} > {log} 2>&1"
