"""The comparison report: one self-contained HTML page and a Markdown twin from whatever results
exist (estimates, training runs, failures, evaluation scores, the dataset manifest).

Importing this package is cheap (no matplotlib, no torch): a Snakefile may call source_files() and
output_files() while it is parsed.
"""
from tiersep.report.collect import Collected, ReportInputError, Tier, collect
from tiersep.report.plots import PLOTS
from tiersep.report.render import output_files, render, source_files

__all__ = ["Collected", "PLOTS", "ReportInputError", "Tier", "collect", "output_files", "render",
           "source_files"]
