# Separate every test track with a trained tier and score it (SI-SDR + museval SiSEC protocol).
rule evaluate:
    input:
        model=f"{RESULTS}/train/{{preset}}/model.pt",
        data=data_for,
        preset=preset_file,
    output:
        scores=f"{RESULTS}/eval/{{preset}}/scores.json",
    params:
        config=CONFIG_FILE,
        outdir=lambda wildcards, output: os.path.dirname(output.scores),
        evaluate=CFG["evaluate"],
    log:
        "logs/evaluate/{preset}.log",
    benchmark:
        "benchmarks/evaluate/{preset}.tsv"
    threads: 2
    resources:
        gpu=1,
        mem_mb=8000,
        runtime=6 * 60,
    container:
        CONTAINER
    conda:
        CONDA_ENV
    shell:
        "tiersep evaluate --config {params.config} --preset {wildcards.preset} --model {input.model}"
        " --data {input.data} --out {params.outdir} > {log} 2>&1"
