"""estimate(), the 80.89 GiB check, trace against real CPU steps (a dispatch check, and the allocator's
own events and RSS as the independent reference), the xlarge RAM check, analytic."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tiersep import config as C
from tiersep.memory import estimate
from tiersep.memory.measure import measure_step
from tiersep.memory.trace import modelled_backend, trace_step

GIB = 2**30
REQUIRED = {"preset", "parameters", "peak_bytes", "largest_allocation_bytes", "breakdown", "budget_bytes",
            "fits", "method", "device", "attention_backend", "margin_bytes", "uncertainty", "seconds"}


def tiny(**fields) -> dict:
    """A configuration whose real CPU step takes well under a second."""
    preset = C.load_preset("cpu_tiny")
    base = {"audio.segment_samples": 2000, "audio.n_fft": 64, "audio.hop": 16, "model.emb_dim": 16,
            "model.ffn_hidden": 32, "model.attention_dim": 16, "model.n_heads": 2, "train.batch_size": 2}
    for key, value in {**base, **{k.replace("__", "."): v for k, v in fields.items()}}.items():
        preset = C.set_field(preset, key, value)
    return preset


@pytest.mark.parametrize("method,device", [("trace", "cuda"), ("trace", "cpu"), ("analytic", "cuda"),
                                           ("measure", "cpu")])
def test_record_fields_and_breakdown(method, device):
    record = estimate(tiny(), method=method, device=device, budget_bytes=None)
    assert REQUIRED <= set(record)
    assert record["fits"] is None and record["margin_bytes"] is None
    assert all(v >= 0 for v in record["breakdown"].values())
    # overhead is peak minus the tensors by definition, so check it against its parts instead
    live = sum(v for k, v in record["breakdown"].items() if k != "overhead")
    overhead = record["breakdown"]["overhead"]
    if device == "cuda":   # the calibration's CUDA context, plus the allocator's reserve above the tensors
        context = record["calibration"]["context_bytes"]
        assert overhead == context + record["reserved_peak_bytes"] - live
        if method == "trace":
            detail = record["overhead_detail"]
            assert detail["cuda_context"] == context and detail["allocator_cache"] >= 0
            assert sum(detail.values()) == overhead
    else:   # no context on a CPU: the peak is the allocated peak, every byte of it a tensor
        assert overhead == 0 and live == record["peak_bytes"] == record["allocated_peak_bytes"]
    assert record["method"] == method and record["device"] == device
    json.dumps(record)   # serialisable as is
    if device == "cuda":   # the torch counters' predictions sit below the whole-process peak
        assert record["allocated_peak_bytes"] <= record["reserved_peak_bytes"] < record["peak_bytes"]


def test_fits_against_a_budget():
    record = estimate(tiny(), device="cuda", budget_bytes=4 * GIB, safety_margin=0.1)
    assert record["fits"] is True and record["margin_bytes"] == int(0.4 * GIB)
    peak = record["peak_bytes"]
    tight = estimate(tiny(), device="cuda", budget_bytes=int(peak / 0.95), safety_margin=0.1)
    assert tight["fits"] is False   # fits without the margin, not with it


@pytest.fixture(scope="module")
def large():
    return C.load_preset("large")


def test_math_attention_reproduces_the_80_89_gib_allocation(large):
    """The seeds' old memory_optimized (= large) with math SDPA: one 431 x 12 x 2049^2 x 4 B tensor."""
    preset = C.set_field(large, "model.attention_backend", "math")
    record = estimate(preset, device="cuda")
    expected = 431 * 12 * 2049**2 * 4
    assert record["largest_allocation_bytes"] == pytest.approx(expected, abs=512)
    assert f"{record['largest_allocation_bytes'] / GIB:.2f}" == "80.89"
    assert record["attention_backend"] == "math"


def test_efficient_attention_has_no_score_matrix(large):
    preset = C.set_field(large, "model.attention_backend", "efficient")
    record = estimate(preset, device="cuda")
    assert record["attention_backend"] == "efficient"
    assert record["largest_allocation_bytes"] < 10 * GIB
    # auto with fp32 on CUDA is the same kernel (flash needs 16-bit inputs)
    assert modelled_backend(large, "cuda") == "efficient"
    assert modelled_backend(C.set_field(large, "train.precision", "bf16"), "cuda") == "flash"


def test_xlarge_traces_with_little_ram():
    """Fake tensors allocate nothing: a multi-TiB step traces in a fresh process with < 2.5 GiB RSS
    (1.8 GiB measured since the trace follows the real allocation sequence over several steps; it
    was 0.65 GiB with one step). How long it takes is a benchmark: bench/estimate_time.py."""
    code = textwrap.dedent("""
        import json, resource, time
        from tiersep import config as C
        from tiersep.memory.trace import trace_step
        start = time.time()
        r = trace_step(C.load_preset("xlarge"), "cuda")
        print(json.dumps({"seconds": time.time() - start, "peak": r.allocated_peak,
                          "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["peak"] > 1024 * GIB          # it did trace the real sizes
    assert result["rss"] < 2.5 * GIB


STEPS = [
    {},                                                                     # fp32, flash (CPU, no dropout)
    {"model__dropout": 0.1, "train__precision": "bf16"},                    # math SDPA, CPU autocast
    {"model__checkpointing": True, "model__dropout": 0.1, "train__grad_accum": 2},
    {"train__ema": {"decay": 0.999, "every": 1}},                           # the EMA copy and its update
    {"model__dropout": 0.1, "train__precision": "fp16"},                    # fp16 autocast, GradScaler
]


@pytest.mark.parametrize("fields", STEPS)
def test_cpu_trace_dispatch_check_against_a_tracked_real_step(fields):
    """A dispatch check, not an accuracy figure: `measure` counts the real step with the same
    StorageTracker and Timeline.replay() as the trace, so this catches only a difference between
    fake and real dispatch. The accuracy reference is the allocator's (the test below)."""
    preset = tiny(**fields)
    traced = trace_step(preset, "cpu")
    measured = measure_step(preset, "cpu")
    assert traced.allocated_peak == pytest.approx(measured.allocated_peak, rel=0.03)
    assert traced.largest_allocation == measured.largest_allocation


@pytest.fixture(scope="module")
def allocator_reference(tmp_path_factory):
    """STEPS measured in one fresh process by tests/cpu_step_reference.py: the CPU allocator's own
    peak (torch.profiler, profile_memory) and the RSS growth of a step (tuned malloc)."""
    presets = tmp_path_factory.mktemp("steps") / "presets.json"
    presets.write_text(json.dumps([tiny(**fields) for fields in STEPS]))
    out = subprocess.run([sys.executable, str(Path(__file__).parent / "cpu_step_reference.py"), str(presets)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.strip().splitlines()]


# Measured 2026-11-26 (torch 2.11, 2 shared cores), ten fresh processes: the profiler's peak is the same
# to the byte in every one (41957560, 64075352, 76846700 B), so the spread is 0 and the tolerance is
# what the trace's 64-byte rounding adds (it counts c10's aligned blocks, the profiler the bytes
# asked for): the trace reads +0.0072% and +0.0048%; allowed: memory_reference.MACHINE_MARGIN.
# The checkpointed step is a known miss, -1.52% (the trace, and the tracker: 75678848 / 75678912):
# checkpointing moves the peak into the recomputation's backward, where kernels allocate below the
# dispatcher, which no dispatch mode sees (likely cause, not yet pinned down: the profiler's peak holds
# 1.6 MB that aten::convolution_backward makes with its own aten::empty). Asserted at its measured value, so a fix or a worse
# miss (beyond MACHINE_MARGIN) both fail here and must be stated.
KNOWN_MISS = {2: -0.0152}
# RSS growth of the measured step / the trace's live bytes above the resident ones, in four fresh
# processes: 0.797-0.827, 0.862-0.866, 0.874-0.914, and 0.786 for the first in a later run (one run
# of the third fell outside 0.854-0.934 once, its figure not kept). Below 1: allocations under 64 KiB
# come from heap pages the earlier steps left resident, a larger share of the smaller steps. RSS is
# the coarse reference (the allocator's events are the fine one): allowed 0.70-1.00 for every step,
# which a trace 30% off either way leaves.
# The EMA step (the fourth in the process) read 0.581 and 0.561 in two fresh processes: the same step as
# the first plus an in-place EMA update, so less RSS growth comes from the heap pages the three larger
# steps before it left resident; its fine reference is the profiler's (+0.0072%, as the first).
# The fp16 step (the fifth; the real step with its GradScaler, which the trace leaves out) read
# +0.0047% against the profiler (64075364 B: 12 B above the same step in bf16, the scaler's scalars)
# and an RSS growth of 0.786 in one fresh process (2026-11-27): allowed as the EMA step's, after
# larger steps left heap pages resident.
RSS_FACTOR = {0: (0.70, 1.00), 1: (0.70, 1.00), 2: (0.70, 1.00), 3: (0.45, 1.00), 4: (0.45, 1.00)}


@pytest.mark.parametrize("case", range(len(STEPS)))
def test_cpu_trace_against_the_allocators_own_events_and_rss(allocator_reference, case):
    preset = tiny(**STEPS[case])
    estimated = trace_step(preset, "cpu").allocated_peak
    measured = allocator_reference[case]
    error = estimated / measured["profiled_peak_bytes"] - 1
    growth = measured["rss_growth_bytes"] / (estimated - measured["resident_bytes"])
    print(f"{STEPS[case]}: trace {estimated} B, profiler {measured['profiled_peak_bytes']} B ({error:+.4%}); "
          f"RSS growth {measured['rss_growth_bytes']} B = {growth:.3f} x the trace's step bytes")
    from memory_reference import MACHINE_MARGIN

    assert error == pytest.approx(KNOWN_MISS.get(case, 0.0), abs=MACHINE_MARGIN)
    low, high = RSS_FACTOR[case]
    assert low <= growth <= high


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_estimate_grows_by_the_ema_copy(device):
    """train.ema adds one fp32 copy of the weights, alive through every step: the CPU estimate grows
    by exactly its blocks (the profiler check above holds it to the real step), and on CUDA the
    allocated peak does; the record names it. Its update (in place) allocates nothing."""
    from tiersep.memory.trace.tracker import cpu_block_bytes, cuda_block_bytes
    from tiersep.model import build_model

    plain = C.load_preset("cpu_tiny")
    ema = C.set_field(plain, "train.ema", {"decay": 0.999, "every": 4})
    block = cpu_block_bytes if device == "cpu" else cuda_block_bytes
    copy = sum(block(p.numel() * p.element_size()) for p in build_model(plain).parameters())
    without, with_ema = estimate(plain, "trace", device), estimate(ema, "trace", device)
    assert without["ema"] is None and with_ema["ema"] == {"decay": 0.999, "every": 4, "copy_bytes": copy}
    assert with_ema["breakdown"]["weights"] - without["breakdown"]["weights"] == copy
    assert with_ema["allocated_peak_bytes"] - without["allocated_peak_bytes"] == copy
    if device == "cpu":
        assert with_ema["peak_bytes"] - without["peak_bytes"] == copy
        # the booking's live part grows by factor x the copy; the whole booking may not, where the
        # process allowance (its exit) is the larger figure: on the CI machine, 1164 MiB
        booked, plain_booked = with_ema["cpu_process"], without["cpu_process"]
        grown = booked["run_rss_bytes"] - plain_booked["run_rss_bytes"]
        assert abs(grown - booked["live_factor"] * copy) <= 1
        assert with_ema["gate_required_bytes"] >= without["gate_required_bytes"]
    assert estimate(ema, "analytic", device)["ema"]["copy_bytes"] == copy


@pytest.mark.parametrize("name,device", [("cpu_tiny", "cpu"), ("small", "cuda"), ("cpu_small", "cuda")])
def test_analytic_within_ten_percent_of_trace(name, device):
    preset = C.load_preset(name)
    traced = estimate(preset, "trace", device, compiled=False)     # analytic models the eager step
    closed = estimate(preset, "analytic", device)
    assert closed["seconds"] < 1.0
    assert closed["peak_bytes"] == pytest.approx(traced["peak_bytes"], rel=0.10)


def test_calibration_covers_every_mode():
    from tiersep.memory.analytic import all_modes, load_calibration

    modes = load_calibration()["modes"]
    assert set(all_modes()) <= set(modes)
    assert all(v >= 0 for mode in modes.values() for v in mode["coef"].values())
