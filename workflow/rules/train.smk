# One training job per tier (and per sweep trial): a fresh process, or container, each time, so
# GPU memory goes back to the OS between tiers. vram_mb carries the estimate for cluster profiles.
#
# Crash safety and retries (exit codes: 3 refused by the fit gate, 4 out of memory, 75 preempted):
# - always `--resume`: the trainer continues from checkpoints/last.pt when one exists for this same
#   preset (a killed, preempted or failed attempt), and starts from scratch otherwise;
# - `retries: 1` + `--attempt`: after an out-of-memory failure (failure.json kind oom) the second
#   attempt halves the micro-batch and doubles accumulation (same effective batch);
# - only model.pt and run.json are declared outputs: Snakemake deletes a failed job's outputs, and
#   metrics.csv, memory.csv and checkpoints/ must survive a failed attempt for the resume.
rule train:
    input:
        data=data_for,
        estimate=f"{RESULTS}/vram/{{preset}}.json",
        preset=preset_file,
    output:
        model=f"{RESULTS}/train/{{preset}}/model.pt",
        run=f"{RESULTS}/train/{{preset}}/run.json",
    params:
        config=CONFIG_FILE,
        outdir=lambda wildcards, output: os.path.dirname(output.model),
    log:
        "logs/train/{preset}.log",
    benchmark:
        "benchmarks/train/{preset}.tsv"
    retries: 1
    threads: 2
    resources:
        gpu=1,
        mem_mb=8000,
        runtime=24 * 60,
        vram_mb=lambda wildcards, input: int(estimate_of(input.estimate)["peak_bytes"] / 2**20) + 1,
        attempt=lambda wildcards, attempt: attempt,
    container:
        CONTAINER
    conda:
        CONDA_ENV
    shell:
        "tiersep train --config {params.config} --preset {wildcards.preset} --data {input.data}"
        " --out {params.outdir} --estimate {input.estimate} --resume --attempt {resources.attempt}"
        " > {log} 2>&1"
