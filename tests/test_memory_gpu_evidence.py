"""bench/gpu_evidence.py's dry run: the GPU evidence plan on a CPU (no GPU figure comes out)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import load_script
from tiersep.memory import evidence
from tiersep.memory.trace.allocator import load_event_log

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "gpu_evidence.py"


@pytest.fixture(scope="module")
def bench():
    return load_script(BENCH)


@pytest.fixture(scope="module")
def dry_folder(tmp_path_factory):
    """The command as a user runs it, in dry mode: every job in its own process, the event logs,
    calibrate, the skipped compiled and MERL jobs (the measure jobs run in-process below)."""
    out = tmp_path_factory.mktemp("evidence")
    done = subprocess.run([sys.executable, str(BENCH), "--dry-run", "--out", str(out), "--only", "events",
                           "calibrate", "compiled", "merl"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    folders = list(out.iterdir())
    assert len(folders) == 1 and folders[0].name.startswith("cpu-dry-run-")
    return folders[0], done.stdout


def test_the_plan_covers_every_open_question(bench):
    jobs = {(j["name"], j["kind"], j["mode"]) for j in bench.plan(type("A", (), {
        "commit": "x", "dry_run": False, "reference": None})())}
    for name in ("small bf16 math", "small fp32 math", "memory_optimized b2 ckpt"):
        assert (name, "events", "native") in jobs                   # the allocator's own sequence
    for name in ("small bf16 math", "small fp32 math"):
        assert {(name, "measure", "native"), (name, "measure", "expandable")} <= jobs
    assert {("small compiled", "compiled", "native"), ("small compiled", "compiled", "expandable")} <= jobs
    assert {("calibrate", "calibrate", "native"), ("merl", "merl", "native")} <= jobs
    # issue 31: fp16 with each kernel an old card may run it with, and math rows of each dtype, held out
    assert {("held-out small fp16", "measure", "native"), ("held-out small fp16 efficient 6h", "measure", "native"),
            ("held-out small fp16 math", "measure", "native"), ("held-out small fp16 math", "measure", "expandable"),
            ("held-out memory_optimized fp16 ckpt", "measure", "native"),
            ("held-out small fp32 math 8h64", "measure", "native"), ("held-out small bf16 math b2", "measure", "native"),
            ("small fp16", "events", "native")} <= jobs


def test_a_dry_run_writes_the_shared_format_and_says_what_it_skipped(bench, dry_folder):
    folder, printed = dry_folder
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["dry_run"] is True and manifest["gpu"] is None
    status = {(j["name"], j["kind"]): j for j in manifest["jobs"]}
    for name in ("small bf16 math", "small fp32 math", "memory_optimized b2 ckpt"):
        assert status[(name, "events")]["status"] == "ok"
        log = load_event_log(folder / "events" / f"{bench._slug(name)}.events.json.gz")
        assert log.result["dry_run"] is True and log.events and log.events[0][0] == "alloc"
    for key in (("calibrate", "calibrate"), ("small compiled", "compiled"), ("merl", "merl")):
        assert status[key]["status"] == "skipped" and status[key]["why"]       # said, never passed
    assert "skipped: dry run: tiersep calibrate needs CUDA" in printed
    assert evidence.load_rows(folder.parent) == []                  # a dry run is no evidence


def test_a_measure_job_writes_a_row_the_evidence_could_read(bench, tmp_path):
    plan = bench.plan(type("A", (), {"commit": "c0ffee", "dry_run": True, "reference": None})())
    job = next(dict(j) for j in plan if (j["name"], j["kind"], j["mode"]) == ("small bf16 math", "measure", "expandable"))
    row = bench.run_job(job, tmp_path)["row"]
    assert row["held_out"] is False
    held_out = bench.run_job(dict(plan[0]), tmp_path)["row"]      # the held-out rows come first
    assert held_out["held_out"] is True and held_out["name"].startswith("held-out")
    assert row["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True" and row["commit"] == "c0ffee"
    assert row["preset"] == "cpu_tiny" and row["stands_for"] == "small" and row["dry_run"] is True
    assert row["cpu_live_peak_bytes"] > 0 and "max_memory_allocated" not in row     # no GPU counter
    assert row["tiersep_trace_estimate"]["attention_backend"] == "math"
