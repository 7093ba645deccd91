# Config access and input functions shared by the rules. The config was validated by the
# Snakefile; tiersep.config resolves presets and writes the effective config that every job reads.
import json
import os
import sys
from pathlib import Path

from tiersep import config as tiersep_config


def _load_effective_config():
    """Validate (one-line error naming file and key) and write the merged config jobs will use."""
    given = [os.path.relpath(f) if os.path.abspath(f).startswith(os.getcwd()) else str(f)
             for f in workflow.overwrite_configfiles or []]  # name files as the user sees them
    files = ["config/config.yaml", *given]
    try:
        cfg = tiersep_config.validate_config(config, files)
    except tiersep_config.ConfigError as err:
        sys.exit(f"tiersep: invalid config: {err}")
    path = Path(cfg["results_dir"]) / "config.yaml"
    text = tiersep_config.dump_preset({k: v for k, v in cfg.items() if not k.startswith("_")})
    if not path.is_file() or path.read_text() != text:  # keep mtime when unchanged
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return cfg, str(path)


# Jobs call the `tiersep` of the environment snakemake runs in, even when it is not activated
# (e.g. `.venv/bin/snakemake`); inside a container the image's own tiersep is found instead.
shell.prefix(f'export PATH="{os.path.dirname(sys.executable)}:$PATH"; ')

CFG, CONFIG_FILE = _load_effective_config()
RESULTS = CFG["results_dir"]
CONTAINER = CFG["container"]
CONDA_ENV = "../../envs/tiersep.yaml"  # for --sdm conda; relative to workflow/rules/


def _trials():
    if not CFG.get("sweep"):
        return {}
    from tiersep.train.sweep import expand_trials

    return expand_trials(CFG)


TRIALS = _trials()  # sweep trial name -> (preset name, {field: value})
TRAINED = list(CFG["tiers"]) + [t for t in TRIALS if t not in CFG["tiers"]]
ESTIMATED = TRAINED + [t for t in CFG["estimate_tiers"] if t not in TRAINED]


def base_preset_name(name):
    return TRIALS[name][0] if name in TRIALS else name


def preset_file(wildcards):
    return str(tiersep_config.preset_path(base_preset_name(wildcards.preset), CFG))


def preset_of(name):
    if name in TRIALS:
        from tiersep.train.sweep import resolve_trial

        return resolve_trial(name, CFG)
    return tiersep_config.load_preset(name, CFG)


def prepared_dir(rate):
    return f"{CFG['data']['prepared_dir']}/{CFG['data']['source']}/{rate}"


def data_for(wildcards):
    return prepared_dir(preset_of(wildcards.preset)["audio"]["sample_rate"])


def estimate_of(path):
    with open(path) as fh:
        return json.load(fh)


import tiersep.report as tiersep_report


def _report_output(name, category):
    """A report PNG flagged for `snakemake --report`, with its caption from workflow/report."""
    path = f"{RESULTS}/report/{name}"
    return report(path, caption=f"../report/{name[:-4]}.rst", category=category)


REPORT_FILES = [f"{RESULTS}/report/index.html", f"{RESULTS}/report/report.md"]

wildcard_constraints:
    preset=r"[A-Za-z0-9_.=+-]+",
    rate=r"\d+",
