# What fits which GPU: every tier (tiers and estimate_tiers) x the config's fit_matrix.gpus (and
# budget_gib when it is a number), the nearest variant that fits each, estimated for cuda on this
# machine without touching CUDA (`tiersep fit --gpus`). The estimate job's records spare each
# preset's first trace. The report reads results/vram/fit_matrix.json.
rule fit_matrix:
    input:
        presets=preset_files(tiersep_fit_matrix.config_tiers(CFG)),
        estimates=[
            f"{RESULTS}/vram/{name}.json"
            for name in tiersep_config.tier_names(tiersep_fit_matrix.config_tiers(CFG))
        ],
        config=ancient(CONFIG_FILE),
    output:
        json=f"{RESULTS}/vram/fit_matrix.json",
    log:
        "logs/fit_matrix.log",
    benchmark:
        "benchmarks/fit_matrix.tsv"
    threads: 2
    resources:
        mem_mb=4000,
        runtime=30,
    params:
        gpus=fit_matrix_gpus() if FIT_MATRIX else "",
        estimate=CFG["estimate"],
        estimates=lambda wildcards, input: os.path.dirname(input.estimates[0]),
    shell:
        "tiersep fit --config {input.config} --gpus {params.gpus:q} --jobs {threads} "
        "--estimates {params.estimates} --json {output.json} > {log} 2>&1"
