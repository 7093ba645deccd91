# tiersep: prepare -> estimate -> train (one job per tier) -> evaluate -> report.
# Thin on purpose: every rule calls the `tiersep` CLI; logic and defaults live in src/tiersep and
# workflow/schemas. Run: snakemake --cores 1 --resources gpu=1   (see README.md)
from snakemake.utils import min_version, validate

min_version("9.0")

configfile: "config/config.yaml"

include: "workflow/rules/common.smk"  # validates first, with a one-line error naming file and key

report: "workflow/report/workflow.rst"

validate(config, "workflow/schemas/config.schema.yaml", set_default=True)  # the same schema, Draft 2020-12
include: "workflow/rules/data.smk"
include: "workflow/rules/estimate.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/report.smk"


rule all:
    default_target: True
    input:
        REPORT_FILES,
