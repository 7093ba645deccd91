"""The real snakemake CLI with the SLURM executor plugin's job-status polls every POLL_SECONDS.

The plugin waits its `init_seconds_before_status_checks` before the first poll, then 10 s longer
after every poll that finds no job finished (up to 180 s): sensible on a cluster, but on the test
cluster, whose jobs take seconds, most of a test's wall time went to waiting for the next poll.
Tests only; everything else (sbatch, squeue, the profile) is the plugin as users get it.
"""
import sys

from snakemake_executor_plugin_slurm import Executor

POLL_SECONDS = 2

# the base class keeps the interval behind this property; the plugin sets it after every poll
Executor.next_seconds_between_status_checks = property(lambda self: POLL_SECONDS, lambda self, value: None)

if __name__ == "__main__":
    from snakemake.cli import main

    sys.exit(main(sys.argv[1:]))
