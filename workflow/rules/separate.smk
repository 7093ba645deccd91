# Your own songs (config `separate.inputs`) separated by each trained tier:
# `snakemake --cores 1 separate` writes results/separated/<tier>/<song>/<stem>.<ext> and a JSON
# sidecar per song. One job per tier, a fresh `tiersep separate` process (or container) as in
# training, which chooses its chunk and batch under the memory budget itself. `rule all` never asks
# for it, and with no inputs (the default) the target has nothing to do.
import shlex


def separate_tiers():
    """The tiers that separate (separate.tiers, default: every trained tier)."""
    wanted = CFG["separate"]["tiers"]
    tiers = TRAINED if wanted is None else wanted
    unknown = [t for t in tiers if t not in TRAINED]
    if unknown:
        sys.exit(f"tiersep: invalid config: separate.tiers: {', '.join(unknown)} is not a trained tier "
                 f"(trained: {', '.join(TRAINED)})")
    return tiers


def separated_folders(wildcards):
    """A folder per separating tier that trained (a refused tier has no model to separate with)."""
    if not CFG["separate"]["inputs"]:
        return []
    return [f"{RESULTS}/separated/{tier}" for tier in separate_tiers()
            if train_outcome(tier)["status"] == "trained"]


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
