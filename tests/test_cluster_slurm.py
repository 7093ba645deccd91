"""The pipeline on a real single-node SLURM cluster through `snakemake --profile profiles/slurm`.

A session fixture starts munged, slurmctld and slurmd by hand (tests/slurm/start.sh; no systemd)
with one fake GPU (gres.conf: File=/dev/null) and no accounting database, and stops them by pid
at the end (tests/slurm/stop.sh). The test is skipped, with the reason, when the Debian packages
are missing: apt-get install -y slurmctld slurmd slurm-client munge

Every test that uses the test cluster lives in this file: `make test` runs the files on two pytest
workers, one file per worker (--dist loadfile), and a second cluster started by the other worker
would replace /etc/slurm/slurm.conf under the first.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import yaml

from conftest import REPO, copy_workflow, run_snakemake, tiny_config

SLURM_SCRIPTS = REPO / "tests" / "slurm"
SLURM_TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "sinfo", "srun")
APT_LINE = "apt-get install -y slurmctld slurmd slurm-client munge"
PROFILE = REPO / "profiles" / "slurm" / "config.yaml"
GPU_RULES = ("train", "evaluate")
LOCAL_RULES = ("all", "config")   # run by snakemake itself, never submitted
# snakemake with the plugin's status polls every 2 s instead of 2, 12, 22, ... s (the script says why)
FAST_POLLS = [sys.executable, str(SLURM_SCRIPTS / "snakemake_fast_polls.py")]


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A running single-node cluster; yields the environment its clients need (SLURM_CONF)."""
    missing = [tool for tool in SLURM_TOOLS if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"SLURM is not installed ({', '.join(missing)} missing); CI installs it with: {APT_LINE}")
    if os.geteuid() != 0:
        pytest.skip("the test cluster runs its daemons and jobs as root; run the tests as root")
    run_dir = tmp_path_factory.mktemp("slurm")
    start = subprocess.run([str(SLURM_SCRIPTS / "start.sh"), str(run_dir)], text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    try:
        if start.returncode == 2:  # a precondition, not a failure (e.g. a real cluster's config is there)
            pytest.skip(f"cannot start the test cluster: {start.stdout.strip()}")
        assert start.returncode == 0, f"tests/slurm/start.sh failed:\n{start.stdout}"
        yield {"SLURM_CONF": str(run_dir / "slurm.conf")}
    finally:
        subprocess.run([str(SLURM_SCRIPTS / "stop.sh"), str(run_dir)], timeout=60,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_profile_configures_squeue_status_requeue_and_leaves_resources_to_the_rules():
    profile = yaml.safe_load(PROFILE.read_text())
    assert profile["executor"] == "slurm"
    assert profile["slurm-status-command"] == "squeue", "sacct hangs or fails without an accounting database"
    assert profile["slurm-requeue"] is True
    assert int(profile["jobs"]) >= 1
    # resources and retries live once, in the rules: the profile repeats none of them
    assert "retries" not in profile
    for rule, settings in (profile.get("set-resources") or {}).items():
        assert not {"gpu", "mem_mb", "runtime"} & set(settings or {}), rule
    rules = {name: (REPO / "workflow" / "rules" / f"{name}.smk").read_text() for name in GPU_RULES}
    for name, text in rules.items():
        # a train job holds one GPU per data-parallel rank on its node (train.ranks / train.nodes)
        assert ("gpu=train_ranks_per_node," if name == "train" else "gpu=1,") in text, name
    assert "mem_mb=host_mem_mb" in rules["train"] and "retries: 1" in rules["train"]


@pytest.mark.slow
def test_pipeline_runs_on_slurm_with_every_job_through_sbatch(slurm_cluster, tmp_path):
    workdir = copy_workflow(tmp_path / "wf")
    tiny_config(workdir / "slurm-tiny.yaml")   # every rule, each as an sbatch job; no `large` traced
    started = time.monotonic()
    # The profile as users get it; test-only overrides: poll squeue every 2 s (the first after 2 s
    # instead of 40 s), and keep the SLURM logs of successful jobs so the test can look at them.
    proc = run_snakemake(workdir, "--profile", str(workdir / "profiles" / "slurm"), "--configfile", "slurm-tiny.yaml",
                         "--slurm-init-seconds-before-status-checks", "2",
                         "--slurm-keep-successful-logs",
                         timeout=600, env=slurm_cluster, program=FAST_POLLS)
    seconds = time.monotonic() - started
    print(f"pipeline on the test SLURM cluster: {seconds:.1f} s")
    assert (workdir / "results" / "report" / "index.html").is_file()

    # "Job 3 has been submitted with SLURM jobid 7 (log: .../slurm_logs/rule_train/<wildcards>/7.log)."
    submitted = {int(m.group(2)): (int(m.group(1)), m.group(3)) for m in re.finditer(
        r"Job (\d+) has been submitted with SLURM jobid (\d+) \(log: .*?/slurm_logs/rule_(\w+?)/", proc.stdout)}
    # Every job that ran (the DAG grows after the train checkpoint), less the local ones
    finished = re.findall(r"Finished jobid: \d+ \(Rule: (\w+)\)", proc.stdout)
    expected = {rule: finished.count(rule) for rule in set(finished) if rule not in LOCAL_RULES}
    by_rule: dict[str, list[int]] = {}
    for slurm_id, (_, rule) in submitted.items():
        by_rule.setdefault(rule, []).append(slurm_id)
    assert {rule: len(ids) for rule, ids in by_rule.items()} == expected, proc.stdout[-4000:]
    assert len({job for job, _ in submitted.values()}) == sum(expected.values())

    for slurm_id, (_, rule) in submitted.items():
        record = _scontrol_job(slurm_id, slurm_cluster)
        assert record["JobState"] == "COMPLETED", (slurm_id, rule, record)
        assert record["Comment"].startswith(f"rule_{rule}"), record["Comment"]
        log = workdir / ".snakemake" / "slurm_logs" / f"rule_{rule}"
        assert list(log.rglob(f"{slurm_id}.log")), f"no SLURM log for job {slurm_id} ({rule})"
        asks_gpu = "gpu:1" in record.get("TresPerJob", "")
        assert asks_gpu == (rule in GPU_RULES), f"{rule} job {slurm_id}: TresPerJob={record.get('TresPerJob')}"
    # Each train job's host memory is the rule's expression of the tier's estimate (first
    # attempt): max(8000, 1.25 x the gate's booking in MiB + 2048) MB.
    for slurm_id in by_rule["train"]:
        record = _scontrol_job(slurm_id, slurm_cluster)
        tier = record["Comment"].split("_wildcards_", 1)[1]
        peak = json.loads((workdir / "results" / "vram" / f"{tier}.json").read_text())["gate_required_bytes"]
        expected_mb = max(8000, int(1.25 * peak / 2**20) + 2048)
        assert _tres_mem_mb(record["TRES"]) == expected_mb, (tier, peak, record["TRES"])


def _tres_mem_mb(tres: str) -> float:
    """The mem= entry of a TRES string ("cpu=2,mem=8000M,node=1") in MB (SLURM prints 4096M as 4G)."""
    value, unit = re.search(r"mem=([\d.]+)([KMGT])", tres).groups()
    return float(value) * {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024**2}[unit]


def _scontrol_job(slurm_id: int, env: dict) -> dict[str, str]:
    """`scontrol show job -o ID` as {field: value} (finished jobs stay MinJobAge = 3600 s in the test cluster)."""
    out = subprocess.run(["scontrol", "show", "job", "-o", str(slurm_id)], text=True, check=True,
                         capture_output=True, env={**os.environ, **env}, timeout=30).stdout
    return dict(item.split("=", 1) for item in out.split() if "=" in item)


@pytest.mark.slow
def test_a_two_rank_cpu_tier_trains_in_one_sbatch_job(slurm_cluster, tmp_path):
    """A data-parallel CPU tier (train.ranks 2, train.device cpu) through profiles/slurm: one sbatch
    job on one node, in which `tiersep train` runs its two ranks under torchrun (gloo)."""
    workdir = copy_workflow(tmp_path / "wf")
    preset = yaml.safe_load((REPO / "tests" / "configs" / "presets" / "test_tiny.yaml").read_text())
    preset["name"] = "test_tiny_ddp"
    preset["train"].update({"ranks": 2, "batch_size": 1, "device": "cpu"})
    (workdir / "tests" / "configs" / "presets" / "test_tiny_ddp.yaml").write_text(yaml.safe_dump(preset))
    tiny_config(workdir / "ddp.yaml", tiers=["test_tiny_ddp"])
    target = "results/train/test_tiny_ddp/outcome.json"
    proc = run_snakemake(workdir, "--profile", str(workdir / "profiles" / "slurm"), "--configfile", "ddp.yaml",
                         "--slurm-init-seconds-before-status-checks", "2", target, timeout=600, env=slurm_cluster,
                         program=FAST_POLLS)
    assert json.loads((workdir / target).read_text())["status"] == "trained"
    run = json.loads((workdir / "results" / "train" / "test_tiny_ddp" / "run.json").read_text())
    assert (run["ranks"], run["effective_batch"], run["slurm_job_id"]) == (2, 2, run["per_rank"][1]["slurm_job_id"])
    assert [r["rank"] for r in run["per_rank"]] == [0, 1] and run["slurm_job_id"] is not None
    train_jobs = re.findall(r"submitted with SLURM jobid (\d+) \(log: .*?/slurm_logs/rule_train/", proc.stdout)
    assert len(train_jobs) == 1
    record = _scontrol_job(int(train_jobs[0]), slurm_cluster)
    assert record["JobState"] == "COMPLETED" and record["NumNodes"] == "1", record


# ---- the SLURM test cluster: one study in PostgreSQL, every trial its own SLURM job ------------

from test_search_hosts import postgres, study_of  # noqa: E402,F401,F811  (its PostgreSQL server, per module)
from test_search_support import trials_csv  # noqa: E402


@pytest.mark.slow
def test_the_slurm_test_cluster_runs_a_four_trial_study_with_each_trial_a_slurm_job(slurm_cluster, postgres,
                                                                                      tmp_path):
    import re

    import yaml

    from conftest import TINY_CONFIG, copy_workflow, run_snakemake
    from test_search_support import BASE_TRAIN
    from test_train_support import CPU_TINY_FILE

    workdir = copy_workflow(tmp_path / "wf")
    base = yaml.safe_load(open(CPU_TINY_FILE))
    base.update(name="search_base")
    base["audio"]["segment_samples"] = 4000
    base["train"].update(BASE_TRAIN, device="cpu")   # a CPU study: its trial jobs hold no GPU
    (workdir / "tests" / "configs" / "presets" / "search_base.yaml").write_text(yaml.safe_dump(base))
    config = yaml.safe_load(TINY_CONFIG.read_text())
    config["search"] = {"preset": "search_base", "trials": 4, "budget_gib": 4, "study": "slurm", "storage": postgres,
                        "space": {"train.lr": {"low": 1.0e-4, "high": 1.0e-2, "log": True},
                                  "model.emb_dim": {"choices": [16, 32]}}}
    (workdir / "search.yaml").write_text(yaml.safe_dump(config))
    started = time.monotonic()
    # two trial jobs at once on the 2-CPU node (one thread each); the profile as users get it, with
    # a 2 s first status check and SLURM's logs kept for the test
    proc = run_snakemake(workdir, "--set-threads", "search_trial=1", "--profile", str(workdir / "profiles" / "slurm"),
                         "--configfile", "search.yaml", "--slurm-init-seconds-before-status-checks", "2",
                         "--slurm-keep-successful-logs", "search_jobs", timeout=900, program=FAST_POLLS,
                         env={**slurm_cluster, "OMP_NUM_THREADS": "1",
                              "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])})
    print(f"4-trial study on the test SLURM cluster: {time.monotonic() - started:.1f} s")
    jobs = {int(m.group(1)) for m in re.finditer(
        r"submitted with SLURM jobid (\d+) \(log: .*?/slurm_logs/rule_search_trial/", proc.stdout)}
    assert len(jobs) == 4, proc.stdout[-4000:]

    trials = study_of(postgres, "slurm").trials
    folder = workdir / "results" / "search" / "slurm"
    rows = trials_csv(folder)
    assert len(trials) == 4 and len(rows) == 4, proc.stdout[-4000:]
    assert {r["state"] for r in rows} <= {"COMPLETE", "PRUNED", "INFEASIBLE"}, rows
    ran = [t for t in trials if "pid" in t.user_attrs]
    assert ran, "no trial ran a process"
    seen = set()
    for trial in ran:
        # the orchestrator that ran it was inside one of the search_trial jobs, one job per trial
        job = int(trial.user_attrs["owner_slurm_job"])
        assert job in jobs and job not in seen, (trial.number, job, jobs)
        seen.add(job)
        record = _scontrol_job(job, slurm_cluster)
        assert record["JobState"] == "COMPLETED" and record["Comment"].startswith("rule_search_trial"), record
        assert list((workdir / ".snakemake" / "slurm_logs" / "rule_search_trial").rglob(f"{job}.log"))
        run = folder / "trials" / str(trial.number) / "run.json"
        if run.is_file():   # a finished run records the SLURM job its trainer ran in
            assert json.loads(run.read_text())["slurm_job_id"] == str(job)
