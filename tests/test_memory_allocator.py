"""The CUDA caching-allocator model: replays of real H100 allocator event logs, and its rules one by one.

The logs and the expandable-segments measurements are real (tests/data/gpu/h100-2026-11-22, torch
2.11.0+cu130); nothing here needs a GPU.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from conftest import load_script
from tiersep.memory.trace.allocator import (MIB, AllocatorConfig, CachingAllocatorModel, EventLogError,
                                      load_event_log, load_expandable_reference, replay,
                                      replay_events, round_size)
from tiersep.memory.trace.tracker import SETUP, Allocation, Timeline

DATA = Path(__file__).resolve().parent / "data" / "gpu" / "h100-2026-11-22"
LOGS = sorted((DATA / "events").glob("*.events.json.gz"))
BENCH = Path(__file__).resolve().parents[1] / "bench" / "allocator_replay.py"


def test_the_three_recorded_logs_are_there():
    assert [p.name.split(".")[0] for p in LOGS] == ["small_as_shipped", "small_bf16_ckpt",
                                                    "ultra_safe_fp32_ckpt_b2"]


@pytest.fixture(scope="module", params=LOGS, ids=lambda p: p.name.split(".")[0])
def log(request):
    return load_event_log(request.param)


# -- replays of the recorded logs ------------------------------------------------------------------

def test_native_replay_creates_the_recorded_segments_and_peaks(log):
    r = replay_events(log)
    recorded = [size for _, size in log.recorded_segments]
    assert len(recorded) > 50 and len(set(recorded)) > 5     # a non-trivial sequence
    assert r.segments == recorded                             # same count, every size exact
    assert r.address_mismatches == 0                          # every alloc lands where it did on the GPU
    assert r.reserved_peak == log.result["reserved"]
    assert r.allocated_peak == log.result["alloc"]


def test_native_replay_with_its_own_addresses(log):
    """Segment addresses only break best-fit ties between equal-sized blocks of different segments."""
    r = replay_events(log, recorded_addresses=False)
    assert r.segments == [size for _, size in log.recorded_segments]
    assert r.reserved_peak == log.result["reserved"]
    assert r.allocated_peak == pytest.approx(log.result["alloc"], rel=1e-5)  # measured: 0 to -4e-6


def test_state_before_the_log_is_the_cublas_workspace_and_one_gemm_operand(log):
    """The log starts after a 256x256 GEMM: a 32 MiB large segment full with the cuBLAS workspace and
    a 2 MiB small segment whose first 256 KiB block is still allocated."""
    prelog = [(total, used, small) for _, total, used, small in log.prelog_blocks()]
    assert prelog == [(32 * MIB, 32 * MIB, False), (2 * MIB, 256 * 1024, True)]


def test_expandable_replay_matches_the_run_measured_with_expandable_segments(log):
    measured = load_expandable_reference(DATA / "expandable_segments.jsonl", log.name)
    r = replay_events(log, expandable_segments=True)
    # One 20 MiB page is 0.8 per mille of the smallest peak (2468 MiB): exact means page-exact.
    assert r.reserved_peak == measured["max_memory_reserved"]
    assert r.allocated_peak == measured["max_memory_allocated"]
    assert r.reserved_peak < log.result["reserved"]           # less fragmentation than native
    assert all(size % (2 * MIB) == 0 for size in r.segments)


# -- rules -----------------------------------------------------------------------------------------

def test_rounding():
    assert [round_size(n) for n in (1, 512, 513, 1536)] == [512, 512, 1024, 1536]
    four = AllocatorConfig(roundup_power2_divisions=AllocatorConfig.power2_divisions(4))
    assert round_size(5 * MIB + 1, four) == 6 * MIB           # 4 steps between 4 and 8 MiB
    assert round_size(4 * MIB, four) == 4 * MIB               # powers of two stay
    assert round_size(1200, four) == 1536                     # <= 4 x 512 B: plain 512 B rounding
    per_interval = AllocatorConfig.power2_divisions({256: 4, 1024: 8, ">": 2})
    assert per_interval[:8] == (4,) * 8 and per_interval[8] == 4 and per_interval[10:] == (2,) * 6
    assert per_interval[9] == 0
    with pytest.raises(ValueError, match="power of two"):
        AllocatorConfig.power2_divisions({300: 4})


def test_pool_choice_and_segment_sizes():
    m = CachingAllocatorModel()
    m.malloc("a", 1 * MIB)                    # small pool: a 2 MiB segment
    m.malloc("b", 1 * MIB + 1)                # large pool, 1-10 MiB: a 20 MiB segment
    m.malloc("c", 21 * MIB)                   # >= 10 MiB: its own segment, rounded up to 2 MiB
    m.malloc("d", 10 * MIB)                   # fits the rest of b's segment: no new segment
    m.malloc("e", 10 * MIB)                   # no cached block fits: a 10 MiB segment
    assert [n for _, n in m.device_allocs] == [2 * MIB, 20 * MIB, 22 * MIB, 10 * MIB]
    m.malloc("f", 1 * MIB)                    # fits the small segment's 1 MiB rest
    m.malloc("g", 512)                        # small pool full: a new 2 MiB segment
    assert [n for _, n in m.device_allocs][4:] == [2 * MIB]


def test_large_block_is_split_only_when_more_than_1_mib_remains():
    m = CachingAllocatorModel()
    m.malloc("a", 19 * MIB)                   # 20 MiB segment, exactly 1 MiB would remain: kept whole
    assert m.stats.allocated == 20 * MIB
    m.free("a")
    m.malloc("b", 19 * MIB - 512)             # 1 MiB + 512 B would remain: split
    assert m.stats.allocated == 19 * MIB - 512
    m.malloc("c", 1 * MIB + 512)              # fits the split-off rest exactly
    assert m.stats.reserved == 20 * MIB


def test_best_fit_by_size_then_address():
    m = CachingAllocatorModel()
    addr = {k: m.malloc(k, n * MIB) for k, n in (("a", 30), ("b", 24), ("c", 24), ("d", 40))}
    for k in "abcd":
        m.free(k)
    assert m.malloc("x", 22 * MIB) == addr["b"]      # smallest fitting block, lower address of a tie
    assert m.malloc("y", 23 * MIB) == addr["c"]
    assert m.malloc("z", 25 * MIB) == addr["a"]
    assert m.stats.segments == 4


def test_freed_neighbours_merge():
    m = CachingAllocatorModel()
    for k in "abc":
        m.malloc(k, 6 * MIB)                  # three blocks of one 20 MiB segment
    m.free("a")
    m.free("c")                               # merges with the 2 MiB rest
    m.malloc("big", 8 * MIB)                  # fits the merged 8 MiB tail
    m.free("big")
    m.free("b")                               # a + b + tail: one free 20 MiB block again
    start = m.malloc("all", 20 * MIB)
    assert m.stats.segments == 1 and start == m.device_allocs[0][0]


def test_max_split_size():
    m = CachingAllocatorModel(config=AllocatorConfig(max_split_size=40 * MIB))
    m.malloc("a", 60 * MIB)
    m.free("a")
    m.malloc("b", 30 * MIB)                   # below max_split_size: an oversize block is not used
    assert m.stats.segments == 2
    m.free("b")
    m.malloc("c", 40 * MIB)                   # oversize, but the 60 MiB block is >= 40 + 20 MiB
    assert m.stats.segments == 3
    m.free("c")
    m.malloc("d", 50 * MIB)                   # within 20 MiB: served from the 60 MiB block, unsplit
    assert m.stats.segments == 3 and m.stats.allocated == 60 * MIB
    m.malloc("e", 39 * MIB)                   # the cached 40 MiB block is oversize too: not used
    assert m.stats.segments == 4
    # With the default (unlimited) the 60 MiB block is split for the 30 MiB request.
    n = CachingAllocatorModel()
    n.malloc("a", 60 * MIB)
    n.free("a")
    n.malloc("b", 30 * MIB)
    assert n.stats.segments == 1 and n.stats.allocated == 30 * MIB


def test_expandable_segments_map_pages_at_the_end():
    m = CachingAllocatorModel(expandable_segments=True)
    a = m.malloc("a", 30 * MIB)               # two 20 MiB pages mapped; split at 512 B granularity
    assert m.stats.reserved == 40 * MIB and m.stats.allocated == 30 * MIB
    b = m.malloc("b", 8 * MIB)                # fits the mapped 10 MiB rest
    assert b == a + 30 * MIB and m.stats.reserved == 40 * MIB
    c = m.malloc("c", 4 * MIB)                # 2 MiB mapped rest + one more page
    assert c == b + 8 * MIB and m.stats.reserved == 60 * MIB
    m.malloc("s", 3000)                       # the small pool grows in 2 MiB pages
    assert m.stats.reserved == 62 * MIB
    assert [n for _, n in m.device_allocs] == [40 * MIB, 20 * MIB, 2 * MIB]


def test_expandable_best_fit_prefers_a_hole_to_the_growing_end():
    m = CachingAllocatorModel(expandable_segments=True)
    hole = m.malloc("hole", 12 * MIB)
    m.malloc("b", 18 * MIB)                   # 30 of 40 MiB mapped: a free 10 MiB block at the end
    m.free("hole")
    # Plain best fit would take the 10 MiB end block; torch counts it as able to grow to the whole
    # unmapped address space, so the 12 MiB hole wins.
    assert m.malloc("x", 9 * MIB) == hole
    assert m.stats.reserved == 40 * MIB


def test_replay_of_a_timeline_in_both_modes():
    big = [Allocation((30 + 2 * k) * MIB, SETUP, "op") for k in range(6)]
    timeline = Timeline(allocations=dict(enumerate(big)),
                        events=[(0, 1), (1, 1), (0, -1), (2, 1), (1, -1), (3, 1), (2, -1),
                                (4, 1), (3, -1), (5, 1), (4, -1), (5, -1)])
    native = replay(timeline)
    expandable = replay(timeline, expandable_segments=True)
    # Each request is larger than every freed block: native cudaMallocs one segment per request.
    assert native.peak_reserved == sum(30 + 2 * k for k in range(6)) * MIB
    assert native.peak_allocated == expandable.peak_allocated == (38 + 40) * MIB
    # Expandable (worked by hand): 0 maps 40 MiB; 1 takes 30-62 (80 mapped); 2 takes 62-96 (100);
    # freeing 0 and 1 leaves a 62 MiB hole for 3 (0-36); freed 2 merges into 36-100, taken by 4
    # (36-74); 5 (40 MiB) fits neither the 36 MiB hole nor 74-100 and maps one more page.
    assert expandable.peak_reserved == 120 * MIB


# -- errors ----------------------------------------------------------------------------------------

def _write(tmp_path, name, payload: bytes):
    path = tmp_path / name
    path.write_bytes(payload)
    return path


def test_corrupt_logs_give_one_line_naming_file_and_field(tmp_path):
    good = json.loads(gzip.decompress(LOGS[0].read_bytes()))
    truncated = _write(tmp_path, "cut.events.json.gz", LOGS[0].read_bytes()[:5000])
    with pytest.raises(EventLogError) as err:
        load_event_log(truncated)
    assert str(truncated) in str(err.value) and "\n" not in str(err.value)
    good["events"][7] = ["alloc", -4, 512]
    bad = _write(tmp_path, "bad.events.json.gz", gzip.compress(json.dumps(good).encode()))
    with pytest.raises(EventLogError, match=r"bad\.events\.json\.gz: events\[7\]: expected"):
        load_event_log(bad)
    del good["segments_at_end"]
    missing = _write(tmp_path, "m.events.json", json.dumps(good).encode())
    with pytest.raises(EventLogError, match=r"m\.events\.json: segments_at_end: missing"):
        load_event_log(missing)


def test_free_of_an_unknown_block_names_the_event(tmp_path):
    data = {"result": {"name": "x"}, "segments_at_end": [], "events": [["free_completed", 4096, 512]]}
    path = _write(tmp_path, "x.events.json", json.dumps(data).encode())
    with pytest.raises(EventLogError, match=r"x\.events\.json: events\[0\]: free_completed of 0x1000"):
        replay_events(load_event_log(path))


# -- the bench -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bench():
    return load_script(BENCH)


def test_bench_reports_json_last(bench, capsys):
    path = DATA / "events" / "small_bf16_ckpt.events.json.gz"
    assert bench.main([str(path)]) == 0
    report = json.loads(capsys.readouterr().out.splitlines()[-1])
    log = load_event_log(path)
    assert report["reserved_peak_bytes"] == log.result["reserved"]
    assert report["allocated_peak_bytes"] == log.result["alloc"]
    assert report["segments"] == report["recorded"]["segments"] == [s for _, s in log.recorded_segments]
    assert report["reserved_peak_error"] == 0 and report["segments_match"] is True
    assert bench.main([str(path), "--expandable-segments"]) == 0
    report = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert report["mode"] == "expandable"
    assert report["recorded"]["reserved_peak_bytes"] == 2587885568   # expandable_segments.jsonl
    assert report["reserved_peak_error"] == 0


def test_bench_exits_2_on_a_corrupt_log(bench, tmp_path, capsys):
    path = _write(tmp_path, "broken.events.json.gz", b"\x1f\x8b not gzip")
    assert bench.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and str(path) in err


def test_a_pre_log_segment_that_was_cached_free(tmp_path):
    """A segment that predates the log and whose start the log allocates was free when it began."""
    seg = 1 << 40
    data = {"result": {"name": "x", "reserved": 2 * MIB, "alloc": 1024},
            "segments_at_end": [[seg, 2 * MIB, "small"]],
            "events": [["alloc", seg, 1000], ["alloc", seg + 1024, 3000]]}
    log = load_event_log(_write(tmp_path, "x.events.json", json.dumps(data).encode()))
    r = replay_events(log)
    assert r.prelog == [(seg, 2 * MIB, 0, True)]
    assert r.segments == [] and r.address_mismatches == 0
    assert r.reserved_peak == 2 * MIB and r.allocated_peak == 1024 + 3072
