# One training job per tier: a fresh process, or container, each time, so
# GPU memory goes back to the OS between tiers. A checkpoint: its outcome (trained, or refused by
# the fit gate) decides whether the tier is evaluated, so a tier that does not fit is shown as
# refused in the report and the run goes on (on_oversize: fail stops it instead).
#
# Crash safety and retries (exit codes: 3 refused with on_oversize fail, 4 out of memory, 75 preempted):
# - always `--resume`: the trainer continues from checkpoints/last.pt when one exists for this same
#   preset (a killed, preempted or failed attempt), and starts from scratch otherwise;
# - `retries: 1` + `--attempt`: after an out-of-memory failure (failure.json kind oom) the second
#   attempt halves the micro-batch and doubles accumulation (same effective batch);
# - only outcome.json is declared: Snakemake deletes a failed job's outputs, and metrics.csv,
#   memory.csv and checkpoints/ must survive a failed attempt for the resume.
#
# A data-parallel tier (train.ranks > 1) holds ranks/nodes GPUs (gpu=; Snakemake caps it at the
# --resources gpu=N given) and, on SLURM, train.nodes nodes (sbatch --nodes): `tiersep train`
# starts torchrun there, one process per rank. On several nodes (profiles/slurm only) it asks the
# SLURM plugin for nodes, tasks=nodes (one task per node: srun's torchrun), gres=gpu:<ranks per
# node> (per node; gpu= would be the job's total, so it is 0) and mpi=1 (the job runs in the batch
# step, not under the plugin's `srun -n1`), and `tiersep train` starts one torchrun per node under
# srun (docs/training.md#data-parallel-tiers). tasks_per_gpu=0 keeps the plugin from turning
# tasks into --ntasks-per-gpu.
checkpoint train:
    input:
        data=data_for,
        estimate=f"{RESULTS}/vram/{{preset}}.json",
        preset=preset_file,
        config=ancient(CONFIG_FILE),
    output:
        outcome=f"{RESULTS}/train/{{preset}}/outcome.json",
    log:
        "logs/train/{preset}.log",
    benchmark:
        "benchmarks/train/{preset}.tsv"
    retries: 1
    threads: 2
    resources:
        gpu=train_ranks_per_node,
        nodes=train_nodes,
        tasks=train_nodes,
        tasks_per_gpu=0,
        gres=train_gres,
        mpi=train_multi_node,
        mem_mb=host_mem_mb,
        runtime=24 * 60,
        vram_mb=lambda wildcards, input: int(
            estimate_bytes(input.estimate, "peak_bytes") / 2**20
        )
        + 1,
        attempt=lambda wildcards, attempt: attempt,
    params:
        outdir=lambda wildcards, output: os.path.dirname(output.outcome),
    shell:
        "tiersep train --config {input.config} --preset {wildcards.preset} --data {input.data}"
        " --out {params.outdir} --estimate {input.estimate} --resume --attempt {resources.attempt}"
        " --outcome {output.outcome} > {log} 2>&1"
