# A hyperparameter search (config `search:`): `snakemake --cores 2 search`. One job, the
# orchestrator that owns the Optuna study; it starts each trial as its own `tiersep train` process
# (docs/search.md). `rule all` never asks for it; a rerun continues the study from its storage.
# When the study ends it writes the Pareto presets, each GPU budget's best and their index best.json,
# and evaluates those trials on the test set (eval/<n>/), all inside the same job.


rule search:
    input:
        config=ancient(CONFIG_FILE),
    output:
        trials=f"{SEARCH_DIR}/trials.csv",
        index=f"{SEARCH_DIR}/best.json",
    log:
        "logs/search.log",
    threads: 2
    shell:
        "tiersep search --config {input.config} > {log} 2>&1"


# The same search with every trial its own cluster job: `snakemake --profile profiles/slurm
# search_jobs`, the study in PostgreSQL (search.storage: postgresql://...; docs/search.md#on-a-cluster).
# search.trials jobs, each an orchestrator with --single-trial beside its one `tiersep train`:
# it claims a trial in the shared study (infeasible ones are told on the way, without a job of
# their own), prunes it through SIGUSR1 on its own node, and ends. A job asks for the search's
# budget, which every admitted trial fits; a requeued job takes its own trial back from its checkpoint.
rule search_trial:
    input:
        data=lambda wildcards: prepared_dir(search_base()["audio"]["sample_rate"]),
        config=ancient(CONFIG_FILE),
    output:
        done=f"{SEARCH_DIR}/jobs/{{slot}}.done",
    log:
        "logs/search/{slot}.log",
    threads: 2
    resources:
        gpu=search_gpus,
        mem_mb=search_mem_mb,
        runtime=24 * 60,
    shell:
        "tiersep search --config {input.config} --single-trial > {log} 2>&1 && touch {output.done}"


rule search_jobs:
    input:
        expand(f"{SEARCH_DIR}/jobs/{{slot}}.done", slot=search_slots()),
    localrule: True
