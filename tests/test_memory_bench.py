"""bench/estimator_accuracy.py: the parts of its GPU mode that run without a GPU (sizing, tables)."""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import load_script
from tiersep.memory.trace import trace_step

GIB = 2**30
BENCH = Path(__file__).resolve().parents[1] / "bench" / "estimator_accuracy.py"


@pytest.fixture(scope="module")
def bench():
    return load_script(BENCH)


def test_seed_preset_is_shortened_to_fit_the_gpu(bench):
    overrides = bench.shrink_to_gpu("small", 2 * GIB)     # small needs ~6 GiB as it is
    segment = overrides["audio.segment_samples"]
    assert segment < 88200 and segment % 256 == 0
    assert trace_step(bench.load("small", overrides), "cuda").reserved_peak <= 0.8 * 2 * GIB
    assert bench.shrink_to_gpu("cpu_tiny", 80 * GIB) == {}


def test_cuda_table_reports_errors_and_ooms(bench):
    row = {"name": "small", "allocator": "native", "kernel": "flash", "measured_allocated": 5 * GIB,
           "trace_allocated": 5.1 * GIB, "measured_reserved": 6 * GIB, "trace_reserved": 5.7 * GIB,
           "measured_device": 6.8 * GIB, "trace_peak": 6.8 * 1.01 * GIB, "outside_torch": 600 * 2**20,
           "overhead_booked": 512 * 2**20, "analytic_peak": 6.5 * GIB, "step_seconds": 0.5}
    oom = {"name": "xlarge", "allocator": "native", "kernel": "flash", "oom": "CUDA out of memory",
           "trace_allocated": 7000 * GIB, "trace_reserved": 7100 * GIB, "trace_peak": 7101 * GIB,
           "analytic_peak": 7200 * GIB}
    table, worst = bench.cuda_table([row, oom])
    assert worst == pytest.approx({"allocated": 0.02, "reserved": 0.05, "device": 0.01})
    assert "+2.00%" in table and "-5.00%" in table and "+1.00%" in table
    assert "| xlarge | native | flash | OOM |" in table


def test_cpu_mode_refuses_cuda_without_a_gpu(bench, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the refusal path does not apply")
    assert bench.main(["--device", "cuda"]) == 2
    assert "needs a visible CUDA GPU" in capsys.readouterr().err
