# Config access and input functions shared by the rules. The config is validated here, once;
# the `config` rule writes the merged result that every job reads.
import json
import os
import shlex
import sys
from pathlib import Path

from tiersep import config as tiersep_config


def _validated_config():
    """The merged config, validated with defaults filled (one-line error naming file and key)."""
    given = [
        os.path.relpath(f) if os.path.abspath(f).startswith(os.getcwd()) else str(f)
        for f in workflow.overwrite_configfiles or []
    ]  # name files as the user sees them
    files = ["config/config.yaml", *given]
    # the files read again as tiersep reads them (YAML 1.2 numbers: 1e-4 is a float), then --config
    config.update(
        tiersep_config.read_config_files(files, workflow.config_settings.config)
    )
    try:
        return tiersep_config.validate_config(config, files)
    except tiersep_config.ConfigError as err:
        sys.exit(f"tiersep: invalid config: {err}")


# Jobs call the `tiersep` of the environment snakemake runs in, even when it is not activated
# (e.g. `.venv/bin/snakemake`); inside a container the image's own tiersep is found instead.
shell.prefix(f'export PATH="{os.path.dirname(sys.executable)}:$PATH"; ')

CFG = _validated_config()

# A run killed with SIGKILL left its lock: remove it when no snakemake or tiersep process of this
# directory is alive (tiersep/lock.py), before Snakemake takes its own. Not in cluster jobs: their
# main process holds the lock on another machine.
if workflow.is_main_process:
    from tiersep.lock import remove_stale_lock

    _unlocked = remove_stale_lock(os.getcwd())
    if _unlocked:
        print(f"tiersep: {_unlocked}", file=sys.stderr)
RESULTS = CFG["results_dir"]
CONTAINER = CFG["container"]
# Written by the `config` rule when missing, and again before any job of a run starts (onstart).
# An input of every job, marked ancient: a config change reruns only the jobs whose own settings
# (their params) changed, in the same run, and `snakemake -n` lists them.
CONFIG_FILE = f"{RESULTS}/config.yaml"
MERGED_CONFIG = json.dumps(
    {k: v for k, v in CFG.items() if not k.startswith("_")}, sort_keys=True
)
# The merged config as the `config` job reads it, from this file and not from params or its command's
# text, since either would make a config change rerun that job. Snakemake then skips the params check
# of every job below it (their config input is ancient), so the first run would only rewrite it.
MERGED_FILE = ".snakemake/tiersep/merged-config.json"
if workflow.is_main_process and (
    not os.path.isfile(MERGED_FILE) or Path(MERGED_FILE).read_text() != MERGED_CONFIG
):
    os.makedirs(os.path.dirname(MERGED_FILE), exist_ok=True)
    Path(f"{MERGED_FILE}.tmp").write_text(MERGED_CONFIG)
    os.replace(f"{MERGED_FILE}.tmp", MERGED_FILE)


def write_merged_config(log="logs/config.log"):
    """`tiersep config`: CONFIG_FILE from the merged, validated config (temporary + rename)."""
    # shell() formats {names} from these locals
    merged, out = f"@{MERGED_FILE}", CONFIG_FILE
    os.makedirs(os.path.dirname(log), exist_ok=True)
    shell("tiersep config --merged {merged:q} --out {out:q} > {log:q} 2>&1")


# Tier names as results/ knows them: a tier listed as a preset file goes by its stem
TRAINED = tiersep_config.tier_names(CFG["tiers"])
ESTIMATED = TRAINED + [
    t for t in tiersep_config.tier_names(CFG["estimate_tiers"]) if t not in TRAINED
]


def preset_file(wildcards):
    return str(tiersep_config.preset_path(wildcards.preset, CFG))


def preset_files(names):
    return [str(tiersep_config.preset_path(name, CFG)) for name in names]


def preset_of(name):
    return tiersep_config.load_preset(name, CFG)


def prepared_dir(rate):
    return f"{CFG['data']['prepared_dir']}/{CFG['data']['source']}/{rate}"


def data_for(wildcards):
    return prepared_dir(preset_of(wildcards.preset)["audio"]["sample_rate"])


def estimate_of(path):
    """The estimate record at `path` for a resource function, or {} when it is missing or damaged:
    a resource function must never raise (the train job itself distrusts such a record and
    estimates again)."""
    try:
        with open(path) as fh:
            record = json.load(fh)
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def estimate_bytes(path, *keys):
    """The first of `keys` that the estimate at `path` holds as a finite positive number, else 0."""
    record = estimate_of(path)
    for key in keys:
        value = record.get(key)
        if (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and 0 < value < float("inf")
        ):
            return value
    return 0


def train_outcome(preset):
    """outcome.json of a tier's train checkpoint: trained, or refused by the fit gate. Until the
    job has run this raises, and Snakemake plans the rest of the DAG again afterwards.
    """
    path = checkpoints.train.get(preset=preset).output.outcome
    try:
        with open(path) as fh:
            outcome = json.load(fh)
    except (OSError, ValueError):
        outcome = None
    if not isinstance(outcome, dict) or "status" not in outcome:
        # damaged: the tier is not evaluated (the report shows its records); rerun its train job
        # with `snakemake --forcerun <path>` to replace it
        print(
            f"tiersep: {path}: not a train outcome record; {preset} is not evaluated",
            file=sys.stderr,
        )
        return {"status": "damaged"}
    return outcome


def trained_model(wildcards):
    train_outcome(wildcards.preset)
    return f"{RESULTS}/train/{wildcards.preset}/model.pt"


def train_ranks_per_node(wildcards):
    """GPUs a train job holds on its machine: the tier's data-parallel ranks per node,
    train.ranks / train.nodes (docs/training.md). A train.device: cpu tier uses none and
    holds one, as every CPU train job does (one at a time with gpu=1). A tier on several
    nodes holds 0 here: gpu= is sbatch --gpus, the job's total, so it asks for its GPUs per
    node with train_gres instead (and it runs only inside a SLURM job of its nodes)."""
    train = preset_of(wildcards.preset)["train"]
    if train["nodes"] > 1:
        return 0
    if train["device"] == "cpu":
        return 1
    return max(1, train["ranks"] // train["nodes"])


def train_nodes(wildcards):
    """Machines a train job asks SLURM for (train.nodes, sbatch --nodes)."""
    return preset_of(wildcards.preset)["train"]["nodes"]


def train_gres(wildcards):
    """A GPU tier on several nodes: gpu:<ranks per node> (sbatch --gres, per node); else "" (none)."""
    train = preset_of(wildcards.preset)["train"]
    if train["nodes"] > 1 and train["device"] != "cpu":
        return f"gpu:{train['ranks'] // train['nodes']}"
    return ""


def train_multi_node(wildcards):
    """1 for a tier on several nodes (the SLURM plugin's `mpi`: sbatch --ntasks=<nodes>, and the job
    runs in the batch step, where `tiersep train` starts srun itself), else 0."""
    return int(preset_of(wildcards.preset)["train"]["nodes"] > 1)


def host_mem_mb(wildcards, input, attempt):
    """Host memory of a train job from its estimate: 1.25 x what the gate books + 2 GiB, at least
    8 GB, times the attempt. On CPU the booking is the process's RSS; on a GPU host RAM >= the
    device's use leaves room for checkpoints and pinned batches."""
    booked = estimate_bytes(input.estimate, "gate_required_bytes", "peak_bytes")
    return attempt * max(8000, int(1.25 * booked / 2**20) + 2048)


def report_inputs(wildcards):
    """Per trained tier its train outcome, and its scores when it trained."""
    files = []
    for preset in TRAINED:
        files.append(f"{RESULTS}/train/{preset}/outcome.json")
        if train_outcome(preset)["status"] == "trained":
            files.append(f"{RESULTS}/eval/{preset}/scores.json")
    return files


import tiersep.report as tiersep_report


def _report_output(name, category):
    """A report PNG flagged for `snakemake --report`, with its caption from workflow/report."""
    path = f"{RESULTS}/report/{name}"
    return report(path, caption=f"../report/{name[:-4]}.rst", category=category)


REPORT_FILES = [f"{RESULTS}/report/index.html", f"{RESULTS}/report/report.md"]


from tiersep.memory.fit import matrix as tiersep_fit_matrix

# What fits which GPU (fit_matrix.enabled): its record, an input of the report
FIT_MATRIX = [f"{RESULTS}/vram/fit_matrix.json"] if CFG["fit_matrix"]["enabled"] else []


def fit_matrix_gpus():
    """The fit_matrix job's --gpus: fit_matrix.gpus, then budget_gib when it is a number; a bad
    entry stops the workflow here, naming the config file and key."""
    try:
        return tiersep_fit_matrix.gpus_argument(tiersep_fit_matrix.config_budgets(CFG))
    except tiersep_config.ConfigError as err:
        sys.exit(f"tiersep: invalid config: {err}")


# Your own songs separated by each trained tier (separate.smk)
def separate_tiers():
    """The tiers that separate (separate.tiers, default: every trained tier)."""
    wanted = CFG["separate"]["tiers"]
    tiers = TRAINED if wanted is None else wanted
    unknown = [t for t in tiers if t not in TRAINED]
    if unknown:
        sys.exit(
            f"tiersep: invalid config: separate.tiers: {', '.join(unknown)} is not a trained tier "
            f"(trained: {', '.join(TRAINED)})"
        )
    return tiers


def separated_folders(wildcards):
    """A folder per separating tier that trained (a refused tier has no model to separate with)."""
    if not CFG["separate"]["inputs"]:
        return []
    return [
        f"{RESULTS}/separated/{tier}"
        for tier in separate_tiers()
        if train_outcome(tier)["status"] == "trained"
    ]


wildcard_constraints:
    preset=r"[A-Za-z0-9_.=+-]+",
    rate=r"\d+",


# The search (search.smk): its folder, and the resources of a trial job
SEARCH_DIR = (
    f"{RESULTS}/search/{CFG['search']['study'] if CFG.get('search') else 'search'}"
)


def search_base():
    return tiersep_config.load_preset(CFG["search"]["preset"], CFG)


def search_slots():
    return range(CFG["search"]["trials"]) if CFG.get("search") else []


def search_gpus(wildcards):
    """One GPU per trial job; none for a CPU study (train.device: cpu)."""
    return 0 if search_base()["train"]["device"] == "cpu" else 1


def search_mem_mb(wildcards, attempt):
    """Host memory of a trial job: like a train job's, from the budget every admitted trial fits
    (search.budget_gib; 8 GB and up when it is auto)."""
    budget = CFG["search"]["budget_gib"]
    booked = 0 if budget == "auto" else budget * 2**30
    return attempt * max(8000, int(1.25 * booked / 2**20) + 2048)
