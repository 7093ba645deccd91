# A hyperparameter search (config `search:`): `snakemake --cores 2 search`. One job, the
# orchestrator that owns the Optuna study; it starts each trial as its own `tiersep train` process
# (docs/search.md). `rule all` never asks for it; a rerun continues the study from its storage.
# When the study ends it writes the Pareto presets, each GPU budget's best and their index best.json,
# and evaluates those trials on the test set (eval/<n>/), all inside the same job.
SEARCH_DIR = f"{RESULTS}/search/{CFG['search']['study'] if CFG.get('search') else 'search'}"


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
