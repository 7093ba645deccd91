# tiersep: prepare -> estimate -> train (one job per tier) -> evaluate -> report.
# Thin on purpose: every rule calls the `tiersep` CLI; logic and defaults live in src/tiersep and
# workflow/schemas. Run: snakemake --cores 1 --resources gpu=1   (see README.md)
from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


include: "workflow/rules/common.smk"  # validates the config once: one line naming file and key


# results/config.yaml, which every job reads, written again before the first job of a run: not in a
# dry run (nothing is written) nor in cluster jobs (Snakemake runs no hooks there).
onstart:
    if os.path.exists(CONFIG_FILE):
        write_merged_config()


# Every rule runs in the same software: the project's Apptainer image (--sdm apptainer) or conda
# environment (--sdm conda).
container: CONTAINER


conda: "envs/tiersep.yaml"


report: "workflow/report/workflow.rst"


include: "workflow/rules/data.smk"
include: "workflow/rules/estimate.smk"
include: "workflow/rules/fit_matrix.smk"  # what fits which GPU (fit_matrix.enabled)
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/separate.smk"  # a target of its own: snakemake --cores 1 separate
include: "workflow/rules/search.smk"  # a target of its own: snakemake --cores 2 search
include: "workflow/rules/report.smk"


rule all:
    default_target: True
    input:
        REPORT_FILES,
