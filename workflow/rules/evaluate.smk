# Separate every test track with a trained tier and score it (SI-SDR + museval SiSEC protocol).
# Only tiers whose train outcome is "trained" get here (see report_inputs).
rule evaluate:
    input:
        model=trained_model,
        data=data_for,
        preset=preset_file,
        config=ancient(CONFIG_FILE),
    output:
        scores=f"{RESULTS}/eval/{{preset}}/scores.json",
    log:
        "logs/evaluate/{preset}.log",
    benchmark:
        "benchmarks/evaluate/{preset}.tsv"
    threads: 2
    resources:
        gpu=1,
        mem_mb=lambda wildcards, attempt: attempt * 8000,
        runtime=6 * 60,
    params:
        outdir=lambda wildcards, output: os.path.dirname(output.scores),
        evaluate=CFG["evaluate"],
    shell:
        "tiersep evaluate --config {input.config} --preset {wildcards.preset} --model {input.model}"
        " --data {input.data} --out {params.outdir} > {log} 2>&1"
