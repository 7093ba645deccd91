# One training job per tier (and per sweep trial): a fresh process, or container, each time, so
# GPU memory goes back to the OS between tiers. vram_mb carries the estimate for cluster profiles.
rule train:
    input:
        data=data_for,
        estimate=f"{RESULTS}/vram/{{preset}}.json",
        preset=preset_file,
    output:
        model=f"{RESULTS}/train/{{preset}}/model.pt",
        run=f"{RESULTS}/train/{{preset}}/run.json",
        metrics=f"{RESULTS}/train/{{preset}}/metrics.csv",
        memory=f"{RESULTS}/train/{{preset}}/memory.csv",
    params:
        config=CONFIG_FILE,
        outdir=lambda wildcards, output: os.path.dirname(output.model),
    log:
        "logs/train/{preset}.log",
    benchmark:
        "benchmarks/train/{preset}.tsv"
    threads: 2
    resources:
        gpu=1,
        mem_mb=8000,
        runtime=24 * 60,
        vram_mb=lambda wildcards, input: int(estimate_of(input.estimate)["peak_bytes"] / 2**20) + 1,
    container:
        CONTAINER
    shell:
        "tiersep train --config {params.config} --preset {wildcards.preset} --data {input.data}"
        " --out {params.outdir} --estimate {input.estimate} > {log} 2>&1"
