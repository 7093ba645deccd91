"""The CUDA trace estimate against real device use on a GPU (no GPU needed), and the per-class
evidence the gate books from it.

Every measured configuration under tests/data/gpu (tiersep.memory.evidence.load_rows: on the
2026-11-22 H100, 11 with the native caching allocator, 3 steps, and 6 with expandable segments, 2
steps; plus the folders bench/gpu_evidence.py made on H200s on 2026-11-26 and 2026-11-27 and on an
H100 on 2026-11-27) is estimated as it ran (the model of the measured
commit, read from git; that GPU's calibration) and compared with what torch and the driver
reported on the GPU:
- allocated_peak_bytes vs torch.cuda.max_memory_allocated: within 0.5%;
- reserved_peak_bytes vs torch.cuda.max_memory_reserved and peak_bytes vs the device use
  (total - free): within 1.5% either way.
A configuration still out of bounds is a strict xfail (KNOWN_GAPS), and its class must book an
uncertainty that covers its error. The per-class uncertainties (memory/accuracy_evidence.json) and
the table in docs/memory.md must be what these comparisons give (`python -m
tiersep.memory.evidence --write` regenerates both).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tiersep.memory import accuracy, evidence

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "gpu"
ROWS = evidence.load_rows(DATA)

# Out of bounds, with the reason; strict: the day one passes, its mark must go.
KNOWN_GAPS = {
    "memory_optimized b2 ckpt-native": (
        "reserved +2.5%, device use +2.4% (native allocator, checkpointed): three cuDNN workspace requests "
        "miss a just-freed segment by 0.6-4 MiB. The model of 2026-11-22 (e74010960b93): the same "
        "configuration reads +5.6% on the H100 and the H200 of 2026-11-27 with today's model, byte-identical "
        "on both cards, so the 2.4% is not the card's"),
    # The H200 run of 2026-11-26 (bench/gpu_evidence.py; docs/memory.md, "Out of sample").
    "held-out small bf16 8h64 4s-native@h200-2026-11-26": (
        "reserved +2.07%, device use +1.98% (native allocator, 4 s segments, 8 heads x 64): an over-estimate "
        "(+5.2% until cuDNN attention's backward was booked); allocated +0.005%. Its event log "
        "(h200-2026-11-27/events/) gives the rest: cuDNN's weight-gradient workspaces are 3.4 MiB over the "
        "staged operands where the trace books the 4 MiB bound; with the logged sizes the trace gives the "
        "measured reserved peak to the byte"),
    "memory_optimized b2 ckpt-native@h200-2026-11-26": (
        "reserved +5.8%, device use +5.6% on the H200, as on the H100 of 2026-11-27 (+2.4% on the H100 of "
        "2026-11-22, an older model: the gap above): an over-estimate. Its event log says why: cuDNN's "
        "weight-gradient workspaces are 0 and 3 MiB over the staged operands (the trace books the 4 MiB bound), "
        "so the GPU serves them from segments the trace's cannot fit; with the logged sizes the trace gives "
        "the measured reserved and allocated peaks to the byte. No shape rule fits the 0-4.1 MiB seen"),
    "small compiled-native-compiled@h200-2026-11-26": (
        "allocated -16%, device use -24% (inductor's CUDA kernels keep buffers the CPU-traced graph does "
        "not): the compiled trace is not booked (memory/estimate.py books the eager step)"),
    "small compiled-exp-compiled@h200-2026-11-26": (
        "allocated -16%, device use -28%: as the native row; the compiled trace is not booked"),
    # The H200 run of 2026-11-27 (issue 31: fp16, and fp32/bf16 math rows of their own), all held out.
    "held-out memory_optimized fp16 ckpt-native@h200-2026-11-27": (
        "reserved +5.8%, device use +5.5% (native allocator, checkpointed, n_fft 2048): an over-estimate, as "
        "the bf16 row of this configuration (+5.6%); allocated +0.002%"),
    "held-out memory_optimized fp32 math 2s-native@h200-2026-11-27": (
        "reserved +9.1%, device use +9.5% (native allocator, fp32 math, n_fft 2048, a 139 GiB step): an "
        "over-estimate, +5.3% before the plan of _safe_softmax followed torch 2.11 (one full-size output); "
        "allocated +0.000%"),
    # The H100 run of 2026-11-27: the held-out configurations of both H200 runs on the other Hopper
    # card. Each gap reads the same as its H200 twin to 0.01%: the errors are the model's, not the card's.
    "held-out small bf16 8h64 4s-native@h100-2026-11-27": (
        "reserved +2.07%, device use +1.98%: an over-estimate, as on the H200"),
    "held-out memory_optimized fp16 ckpt-native@h100-2026-11-27": (
        "reserved +5.8%, device use +5.5%: an over-estimate, as on the H200 (+5.5%)"),
    # its second run: the in-sample configurations of the H200's 2026-11-26 run, byte-identical there too
    "memory_optimized b2 ckpt-native@h100-2026-11-27": (
        "reserved +5.8%, device use +5.6%: an over-estimate, as on the H200 (the 2026-11-22 H100 row, an "
        "older model, reads +2.4%)"),
    # The H200's fourth run of 2026-11-27: one held-out row for each eager Hopper class that had none.
    # Its math rows read within 0.02% once _safe_softmax was booked as torch 2.11 runs it (kernels.py).
    "held-out ultra_safe fp16 efficient ckpt-native@h200-2026-11-27": (
        "reserved +5.6%, device use +5.1% (native allocator, checkpointed, efficient fp16): an over-estimate, "
        "as memory_optimized's cuDNN fp16 checkpointed native row (+5.5%); allocated +0.002%"),
}
# Jobs of bench/gpu_evidence.py that ran out of memory on the GPU, by "name@folder", with what they ran
# when their manifest does not say (manifests list each job's preset and set since 2026-11-27).
FP32_MATH = {"train.precision": "fp32", "model.attention_backend": "math"}
OUT_OF_MEMORY = {
    # 5 s segments: fp32 score matrices asked 13.5 GiB more than the H200's 140 GiB
    "held-out memory_optimized fp32 math@h200-2026-11-27": ("memory_optimized", FP32_MATH),
    # 2 s segments: 139 GiB of device use on the H200, so not on an 80 GB H100
    "held-out memory_optimized fp32 math 2s@h100-2026-11-27": (
        "memory_optimized", {**FP32_MATH, "audio.segment_samples": 88064}),
}

_records: dict = {}


def record_of(row: dict) -> dict:
    """The estimate of a measured row, made once per test session (each takes 1-3 s)."""
    key = evidence.row_id(row)
    if key not in _records:
        try:
            _records[key] = evidence.estimate_row(row)
        except LookupError as err:    # a clone without history cannot show the measured model
            pytest.fail(str(err), pytrace=False)
    return _records[key]


def _case(row):
    key = evidence.row_id(row)
    marks = [pytest.mark.xfail(strict=True, reason=KNOWN_GAPS[key])] if key in KNOWN_GAPS else []
    return pytest.param(row, marks=marks, id=key)


def test_the_shared_configurations_are_all_here():
    modes = [(r["folder"], r["expandable_segments"]) for r in ROWS]
    assert modes.count(("h100-2026-11-22", False)) == 11 and modes.count(("h100-2026-11-22", True)) == 6
    assert modes.count(("h200-2026-11-26", False)) == 10 and modes.count(("h200-2026-11-26", True)) == 5
    assert modes.count(("h200-2026-11-27", False)) == 13 and modes.count(("h200-2026-11-27", True)) == 12
    assert modes.count(("h100-2026-11-27", False)) == 16 and modes.count(("h100-2026-11-27", True)) == 10
    assert modes.count(("h200-2026-11-28", False)) == 3 and modes.count(("h200-2026-11-28", True)) == 6
    assert sum(bool(r.get("held_out")) for r in ROWS) == 8 + 25 + 21 + 9
    assert len({evidence.row_id(r) for r in ROWS}) == len(ROWS), "two measured rows share an id"
    assert set(KNOWN_GAPS) <= {evidence.row_id(r) for r in ROWS}, "a known gap names no measured row"


@pytest.mark.parametrize("row", [_case(r) for r in ROWS])
def test_cuda_estimate_matches_the_gpu(row):
    record = record_of(row)
    assert record["allocator"] == {"expandable_segments": row["expandable_segments"]}
    checks = evidence.compare(row, record)
    assert all(ok for *_, ok in checks.values()), "\n" + evidence.table(row, checks)


@pytest.mark.parametrize("key", sorted(KNOWN_GAPS))
def test_a_known_gap_is_booked_by_its_class(key):
    """The gate books peak x (1 + the class's uncertainty): it must cover the gap's error, or the
    gate would trust a known over- or under-estimate as exact."""
    row = next(r for r in ROWS if evidence.row_id(r) == key)
    record = record_of(row)
    if row["compiled"]:    # the compiled trace read under the GPU: the gate must book the eager step
        from tiersep.memory import estimate

        with evidence.measured_model(row["commit"]):
            booked = estimate(evidence.preset_of(row), "trace", "cuda", calibration_spec=row["calibration"])
        assert booked["compiled"] is False and "so it is not booked" in booked["compiled_note"], booked["compiled_note"]
        assert booked["gate_required_bytes"] >= row["device_used_bytes"], (booked["gate_required_bytes"], row)
        return
    u, why = accuracy.uncertainty(accuracy.estimate_class(record))
    error = evidence.compare(row, record)["device"][2]
    # an estimate above the GPU is booked by itself; one below must be covered by the class
    assert u >= -error, f"{key}: its class books {u:.1%} ({why}), its device use is off by {error:+.2%}"
    assert record["uncertainty"] == u and record["gate_required_bytes"] == round(record["peak_bytes"] * (1 + u))


def test_the_evidence_and_its_table_are_current():
    """accuracy_evidence.json (what estimates book) and docs/memory.md's table are these comparisons."""
    built = evidence.build(ROWS, {evidence.row_id(r): record_of(r) for r in ROWS})
    stored = json.loads(accuracy.EVIDENCE_FILE.read_text())
    hint = "regenerate with: python -m tiersep.memory.evidence --write"
    assert stored == json.loads(json.dumps(built)), f"{accuracy.EVIDENCE_FILE} is stale; {hint}"
    assert evidence.doc_block(evidence.DOC.read_text()) == evidence.render(built), f"{evidence.DOC} table is stale; {hint}"


def out_of_memory_jobs(root: Path = DATA) -> list[dict]:
    """Every job a measurement folder's manifest lists as failed with CUDA out of memory."""
    found = []
    for folder in sorted(p for p in root.iterdir() if (p / "manifest.json").is_file()):
        info = json.loads((folder / "manifest.json").read_text())
        for run in info.get("runs") or [info]:
            for job in run.get("jobs", []):
                if job["status"] == "failed" and "out of memory" in job.get("why", ""):
                    found.append(dict(job, folder=folder.name, commit=run.get("commit", info["commit"]),
                                      total=info["memory_total_bytes"], calibration=str(folder / info["calibration"])))
    return found


@pytest.mark.parametrize("job", out_of_memory_jobs(), ids=lambda j: f"{j['name']}@{j['folder']}")
def test_what_ran_out_of_memory_on_a_gpu_is_refused_for_that_gpu(job):
    """An out-of-memory error is a measurement too, made by the card and not by us: the estimate of
    that configuration, with that card's calibration and its whole memory as the budget (no margin),
    must not fit."""
    from tiersep.memory import estimate

    key = f"{job['name']}@{job['folder']}"
    preset_name, changes = (job["preset"], job["set"]) if "preset" in job else OUT_OF_MEMORY[key]
    row = {"name": job["name"], "preset": preset_name, "set": changes, "folder": job["folder"],
           "source": "manifest.json", "expandable_segments": job["mode"] == "expandable"}
    with evidence.measured_model(job["commit"]):
        record = estimate(evidence.preset_of(row), "trace", "cuda", budget_bytes=job["total"], safety_margin=0.0,
                          calibration_spec=job["calibration"])
    assert record["fits"] is False, (key, record["peak_bytes"], job["total"])
    assert record["peak_bytes"] > job["total"], "the estimate itself, before its class's uncertainty, says no"


def test_every_out_of_memory_job_is_one_the_refusal_test_knows():
    jobs = out_of_memory_jobs()
    assert {f"{j['name']}@{j['folder']}" for j in jobs if "preset" not in j} == set(OUT_OF_MEMORY)
    assert len(jobs) >= 2
