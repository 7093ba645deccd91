"""The real `snakemake` on a tiny config, through every rule to the report (issue: pipeline spine).

One workflow copy is run once (conftest's session-scoped finished_tree) and then probed: contract
files, a tier the fit gate refuses shown as refused while the run finishes, a second run that does
nothing, `snakemake report` rebuilding only the report, dry-run and lint."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest
import yaml

from conftest import BIN, FINISHED_CONFIG, FINISHED_RUN, REPO, TINY_CONFIG, copy_finished, run_snakemake

pytestmark = pytest.mark.slow
CONFIG = FINISHED_CONFIG
RUN = FINISHED_RUN


@pytest.fixture(scope="module")
def finished(finished_tree):
    return finished_tree


def test_dry_run_lists_every_stage(workflow_copy):
    """Training is a checkpoint: evaluate jobs are planned once each tier's outcome is known."""
    out = run_snakemake(workflow_copy, "-n", *RUN).stdout
    for rule in ("config", "prepare", "estimate", "report"):
        assert f"rule {rule}:" in out, rule
    assert "checkpoint train:" in out and "involves checkpoint jobs" in out


def test_lint_is_clean(workflow_copy):
    out = run_snakemake(workflow_copy, "--lint", *CONFIG).stdout
    assert "Congratulations, your workflow is in a good condition!" in out


def test_snakefmt_is_clean():
    """The Snakefile and the rules are formatted as the Snakemake community formats them."""
    snakefmt = BIN / "snakefmt"
    assert snakefmt.is_file(), "snakefmt is a test dependency (pip install -e '.[test]')"
    proc = subprocess.run([str(snakefmt), "--check", "Snakefile", "workflow/"], cwd=REPO, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.returncode == 0, proc.stdout


def test_every_contract_file_is_produced(finished):
    res = finished / "results"
    prepared = finished / "data" / "prepared" / "synthetic" / "8000"
    assert json.loads((prepared / "manifest.json").read_text())["tracks"]
    for preset in ("test_tiny", "large"):
        record = json.loads((res / "vram" / f"{preset}.json").read_text())
        for key in ("parameters", "peak_bytes", "largest_allocation_bytes", "breakdown", "budget_bytes",
                    "fits", "method", "device", "attention_backend"):
            assert key in record, (preset, key)
        assert set(record["breakdown"]) >= {"weights", "gradients", "optimizer", "activations", "transient", "overhead"}
    run_dir = res / "train" / "test_tiny"
    for name in ("model.pt", "checkpoints/last.pt", "metrics.csv", "memory.csv", "run.json"):
        assert (run_dir / name).is_file(), name
    assert not (run_dir / "failure.json").exists()
    run = json.loads((run_dir / "run.json").read_text())
    for key in ("pid", "host", "start_free_bytes", "peak_allocated_bytes", "peak_reserved_bytes",
                "wall_seconds", "steps", "versions"):
        assert key in run, key
    assert (run_dir / "memory.csv").read_text().splitlines()[0] == "step,allocated,reserved,peak,device"
    assert json.loads((run_dir / "outcome.json").read_text())["status"] == "trained"
    assert (finished / "results" / "config.yaml").is_file()   # the config rule's merged config
    scores = json.loads((res / "eval" / "test_tiny" / "scores.json").read_text())
    assert set(scores["per_stem"]) == {"vocals", "drums", "bass", "other"}
    html = (res / "report" / "index.html").read_text()
    assert "test_tiny" in html and "large" in html
    assert (res / "report" / "report.md").is_file()
    # what fits which GPU: every tier at budget_gib (tiny.yaml's fit_matrix.gpus), in the report
    from tiersep.records import read_record

    matrix = read_record("fit_matrix", res / "vram" / "fit_matrix.json")
    assert [b["label"] for b in matrix["budgets"]] == ["24 GiB"]
    assert [row["tier"] for row in matrix["tiers"]] == ["test_tiny", "test_gpu_sized", "large"]
    assert matrix["tiers"][2]["cells"][0]["status"] == "fitted"   # large: 523 GiB as is
    assert '<table id="fit-matrix">' in html and '<a href="#fit-large">does not fit</a>' in html
    for folder in ("logs", "benchmarks"):
        assert any((finished / folder).rglob("*")), folder


def test_a_refused_tier_is_an_outcome_not_a_crash(finished):
    """test_gpu_sized is refused on this CPU: the run finished (the fixture), the tier was neither
    trained nor evaluated, and the report shows it as refused with the reason."""
    run_dir = finished / "results" / "train" / "test_gpu_sized"
    outcome = json.loads((run_dir / "outcome.json").read_text())
    assert outcome["status"] == "refused" and "is GPU-sized" in outcome["reason"]
    assert json.loads((run_dir / "failure.json").read_text())["kind"] == "refused"
    assert not (run_dir / "model.pt").exists()
    assert not (finished / "results" / "eval" / "test_gpu_sized").exists()
    html = (finished / "results" / "report" / "index.html").read_text()
    section = html[html.index("test_gpu_sized"):]
    assert "refused" in section.lower() and "GPU-sized" in html


def test_on_oversize_fail_stops_the_run(finished_tree, tmp_path):
    """The strict choice: the refusal fails the train job (exit 3) and the run stops.
    Run in a copy of the finished tree without test_gpu_sized's train outcome and log, so only that
    train job runs: preparing data and estimating in a fresh copy, which this test is not about,
    made it 42 s (now 16 s, 2 busy cores)."""
    wf = copy_finished(finished_tree, tmp_path / "wf")
    shutil.rmtree(wf / "results" / "train" / "test_gpu_sized")
    (wf / "logs" / "train" / "test_gpu_sized.log").unlink()   # the log checked below is this run's
    target = "results/train/test_gpu_sized/outcome.json"
    proc = run_snakemake(wf, target, "--cores", "2", "--resources", "gpu=1", *CONFIG,
                         "--config", "on_oversize=fail", check=False)
    assert proc.returncode != 0
    assert "rule prepare:" not in proc.stdout and "rule estimate:" not in proc.stdout, proc.stdout[-3000:]
    log = (wf / "logs" / "train" / "test_gpu_sized.log").read_text()
    assert "refused: preset test_gpu_sized is GPU-sized" in log
    assert not (wf / "results" / "train" / "test_gpu_sized" / "outcome.json").exists()


def test_second_run_does_nothing(finished):
    out = run_snakemake(finished, *RUN).stdout
    assert "Nothing to be done" in out


def _jobs(dry_run_output: str) -> dict[str, int]:
    """{rule: count} from the 'Job stats' table of a snakemake dry run."""
    if "Nothing to be done" in dry_run_output:
        return {}
    table = dry_run_output.split("Job stats:", 1)[1]
    return {rule: int(n) for rule, n in re.findall(r"^(\w+)\s+(\d+)$", table, re.M)
            if rule not in ("total", "all")}


def test_report_target_rebuilds_only_the_report(finished):
    shutil.rmtree(finished / "results" / "report")
    assert _jobs(run_snakemake(finished, "report", "-n", *RUN).stdout) == {"report": 1}
    run_snakemake(finished, "report", *RUN)  # target first: --configfile takes several values
    assert (finished / "results" / "report" / "index.html").is_file()


def test_a_caption_change_rerenders_only_the_report(finished):
    page = finished / "results" / "report" / "index.html"
    run_snakemake(finished, *RUN)  # whatever ran before, start from a finished tree
    caption = finished / "workflow" / "report" / "training_curves.rst"
    caption.write_text(caption.read_text() + "\nA sentence added to check the re-render.\n")
    later = page.stat().st_mtime + 5
    os.utime(caption, (later, later))  # strictly newer than the report, whatever the clock resolution
    assert _jobs(run_snakemake(finished, "-n", *RUN).stdout) == {"report": 1}
    run_snakemake(finished, *RUN)
    assert "A sentence added to check the re-render." in page.read_text()


def test_bad_config_stops_before_any_job(workflow_copy):
    bad = workflow_copy / "bad.yaml"
    cfg = yaml.safe_load(TINY_CONFIG.read_text())
    cfg["evaluate"]["overlap"] = 2
    bad.write_text(yaml.safe_dump(cfg))
    proc = run_snakemake(workflow_copy, *RUN[:4], "--configfile", "bad.yaml", check=False)
    assert proc.returncode != 0
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("tiersep: invalid config: bad.yaml: evaluate.overlap: 2 is greater than the maximum")
    assert not (workflow_copy / "results" / "vram").exists()
    assert not (workflow_copy / ".snakemake" / "log").exists() or "rule " not in proc.stdout
