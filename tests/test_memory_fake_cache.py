"""A trace does not depend on the traces before it in its process (memory/trace/step.py,
_fresh_fake_mode). FakeTensorMode's dispatch cache is kept across traces, which makes a tier's later
traces cheaper (bench/results/fit_matrix_catalogue_cpu.md), but only the entries whose hit gives
the storage a miss gives: a trace after others records the timeline of a trace from an empty cache,
event for event. Keeping every entry would not: hann_window's miss keeps the storage of a window one
sample longer, and a hit builds a compact one."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tiersep import config as C
from tiersep.memory.trace import step


def one_second(segments: int = 1) -> dict:
    preset = C.load_preset("small")
    preset["audio"]["segment_samples"] = segments * preset["audio"]["sample_rate"]
    preset["train"].update(batch_size=1, grad_accum=1)
    return preset


def events(preset: dict) -> list[tuple]:
    """The trace's timeline in order: (bytes, op, shape, +1 alloc | -1 free)."""
    timeline = step.record_step(preset, "cuda").timeline
    return [(timeline.allocations[key].nbytes, timeline.allocations[key].op, timeline.allocations[key].shape, sign)
            for key, sign in timeline.events]


def test_a_trace_after_others_is_the_trace_from_an_empty_cache_and_hits_it():
    FakeTensorMode.cache_clear()
    first = events(one_second())
    first_misses = FakeTensorMode.cache_misses
    events(one_second(2))                      # another segment: other activation shapes
    misses = FakeTensorMode.cache_misses
    again = events(one_second())
    assert again == first
    # the repeat found the first trace's entries: a tenth of its misses or fewer
    assert FakeTensorMode.cache_misses - misses <= first_misses / 10, (first_misses, FakeTensorMode.cache_misses - misses)


def test_keeping_every_entry_would_book_the_window_compactly(monkeypatch):
    monkeypatch.setattr(step, "_hit_is_a_miss", lambda entry: True)
    FakeTensorMode.cache_clear()
    first, again = events(one_second()), events(one_second())
    differ = [(a, b) for a, b in zip(first, again) if a != b]
    assert differ and {a[1] for a, _b in differ} == {"hann_window.default"}, differ[:3]
    assert all(b[0] < a[0] for a, b in differ)    # a smaller storage on a hit: less booked
    FakeTensorMode.cache_clear()


@pytest.mark.parametrize("shape, stride, dtype", [
    ((3, 4), (4, 1), torch.float32), ((3, 4), (1, 3), torch.bfloat16), ((2, 3, 5), (30, 10, 2), torch.float16),
    ((4, 1), (1, 7), torch.complex64), ((0, 5), (5, 1), torch.float32), ((7,), (0,), torch.float64)])
def test_the_least_storage_is_what_empty_strided_allocates(shape, stride, dtype):
    made = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    assert step._least_storage_bytes(shape, stride, dtype) == made.untyped_storage().nbytes()


def test_past_its_bound_the_cache_is_emptied(monkeypatch):
    FakeTensorMode.cache_clear()
    events(one_second())
    entries = len(FakeTensorMode.cache)
    kept = sum(step._hit_is_a_miss(entry) for entry in FakeTensorMode.cache.values())
    step._keep_what_a_miss_gives()
    # within the bound: what a hit gives as a miss does stays (the windows' entries go)
    assert 100 < len(FakeTensorMode.cache) == kept < entries
    monkeypatch.setattr(step, "MAX_CACHED_OPS", 100)
    step._keep_what_a_miss_gives()
    assert len(FakeTensorMode.cache) == 0
