# One comparison report from every estimate, every train outcome (trained or refused) and every
# evaluated tier. `snakemake report` rebuilds only this when the results are there; its templates
# and captions are inputs, so editing one re-renders the report and nothing else. Outputs are
# flagged for `snakemake --report` too.
rule report:
    input:
        estimates=expand(f"{RESULTS}/vram/{{preset}}.json", preset=ESTIMATED),
        outcomes=report_inputs,
        fit_matrix=FIT_MATRIX,
        sources=[str(p) for p in tiersep_report.source_files()],
        config=ancient(CONFIG_FILE),
    output:
        html=report(
            f"{RESULTS}/report/index.html",
            caption="../report/index.rst",
            category="Report",
        ),
        md=f"{RESULTS}/report/report.md",
        plots=[
            _report_output(p.name, "Plots")
            for p in tiersep_report.output_files(".")
            if p.suffix == ".png"
        ],
    log:
        "logs/report.log",
    benchmark:
        "benchmarks/report.tsv"
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    params:
        results=lambda wildcards, input: os.path.dirname(
            os.path.dirname(input.estimates[0])
        ),
        outdir=lambda wildcards, output: os.path.dirname(output.html),
    shell:
        "tiersep report --config {input.config} --results {params.results} --out {params.outdir} > {log} 2>&1"
