#!/usr/bin/env bash
# Run by Snakemake (--sdm conda) inside the new envs/tiersep.yaml environment, from the workflow's
# working directory: install the tiersep package itself; its dependencies are in the env file.
set -euo pipefail
if [ ! -f pyproject.toml ] || ! grep -q '^name = "tiersep"' pyproject.toml; then
    echo "tiersep post-deploy: run snakemake from the tiersep repository (no pyproject.toml in $PWD)" >&2
    exit 1
fi
python -m pip install --no-deps -e .
