# Two commands on a fresh machine (see README.md):
#   make run    set up, then run the embedded default pipeline to results/report/index.html
#   make test   set up (with the test extras and the system packages the tests use), then run pytest
# The virtual environment lives in .venv; PYTHON picks the interpreter that creates it.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
SNAKEMAKE_ARGS ?= --cores 1 --resources gpu=1
PYTEST_ARGS ?=
# The suite runs on two pytest workers, one test file at a time each (a file's module fixtures are
# built once), the longest files first in the order tests/conftest.py gives them
# (--no-loadscope-reorder: not by their number of tests); TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2

.PHONY: run test setup setup-test system-deps test-system-deps report clean

# A run killed with SIGKILL leaves .snakemake/locks behind: tiersep.lock unlocks it when no
# snakemake or tiersep process of this directory is alive (a live run is never unlocked).
run: setup
	$(BIN)/python -m tiersep.lock --snakemake $(BIN)/snakemake
	$(BIN)/snakemake $(SNAKEMAKE_ARGS)

report: setup
	$(BIN)/python -m tiersep.lock --snakemake $(BIN)/snakemake
	$(BIN)/snakemake report $(SNAKEMAKE_ARGS)

test: setup-test
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=30 $(PYTEST_ARGS)

setup: system-deps $(VENV)/.installed

setup-test: setup test-system-deps $(VENV)/.installed-test

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[cluster]'
	@# torch and torchaudio are separate wheels: a pair that does not load together stops here, in one line
	@$(BIN)/python -c "import torchaudio.functional" 2>/dev/null || { echo "setup: torchaudio does not load with this torch ($$($(BIN)/python -m pip list 2>/dev/null | grep -E '^torch(audio)? ' | tr -s ' ' | paste -sd, -)); pyproject.toml pins the pair" >&2; exit 1; }
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet -e '.[cluster,test]'
	touch $@

# musdb and museval import stempeg, which needs ffmpeg and ffprobe on PATH even for wav files.
system-deps:
	@sh workflow/scripts/system-deps.sh ffmpeg

# The report test drives a real headless Chromium; the cluster test starts a real SLURM; the
# many-host search test starts a real PostgreSQL server.
test-system-deps:
	@sh workflow/scripts/system-deps.sh ffmpeg chromium slurm postgresql

clean:
	rm -rf results logs benchmarks .snakemake data/prepared
