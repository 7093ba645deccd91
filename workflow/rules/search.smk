# A hyperparameter search (config `search:`): `snakemake --cores 2 search`. One job, the
# orchestrator that owns the Optuna study; it starts each trial as its own `tiersep train` process
# (docs/search.md). `rule all` never asks for it; a rerun continues the study from its storage.
rule search:
    input:
        config=ancient(CONFIG_FILE),
    output:
        trials=f"{RESULTS}/search/{CFG['search']['study'] if CFG.get('search') else 'search'}/trials.csv",
    log:
        "logs/search.log",
    threads: 2
    shell:
        "tiersep search --config {input.config} > {log} 2>&1"
