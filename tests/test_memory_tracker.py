"""The storage tracker and the caching-allocator model, on a small stand-in module (no tiersep model)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from tiersep.memory.trace.allocator import MIB, CachingAllocatorModel, replay, segment_size
from tiersep.memory.trace.tracker import (BACKWARD, FORWARD, UPDATE, StorageTracker, cpu_block_bytes,
                                    cuda_block_bytes)


class StandIn(nn.Module):
    """Conv1d FFN + self-attention with dropout: the kinds of op the real model uses."""

    def __init__(self, dim=16, hidden=32, heads=2):
        super().__init__()
        self.conv = nn.Conv1d(dim, 2 * hidden, 3, padding=1)
        self.deconv = nn.ConvTranspose1d(hidden, dim, 3, padding=1)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.heads = heads

    def forward(self, x):  # x [N, L, dim]
        value, gate = self.conv(x.transpose(1, 2)).chunk(2, dim=1)
        x = x + self.deconv(F.dropout(value * F.silu(gate), 0.1)).transpose(1, 2)
        n, length, dim = x.shape
        q, k, v = self.qkv(x).reshape(n, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
        return x + out.transpose(1, 2).reshape(n, length, dim)


def run_step(fake: bool) -> StorageTracker:
    """Forward, backward and an AdamW step of the stand-in under a tracker."""
    import contextlib

    with FakeTensorMode() if fake else contextlib.nullcontext():
        torch.manual_seed(0)
        model = StandIn()
        opt = torch.optim.AdamW(model.parameters(), foreach=True)
        x = torch.randn(8, 50, 16)
        tracker = StorageTracker(cuda_block_bytes)
        tracker.register(list(model.parameters()) + [x])
        with tracker:
            tracker.phase = FORWARD
            model(x).square().mean().backward()
            opt.step()
        tracker.stop()
    return tracker


def test_block_rounding():
    assert cuda_block_bytes(0) == 0
    assert cuda_block_bytes(1) == 512
    assert cuda_block_bytes(512) == 512
    assert cuda_block_bytes(513) == 1024
    assert cpu_block_bytes(65) == 128


def test_tracker_counts_allocations_frees_and_not_views():
    tracker = StorageTracker(cuda_block_bytes)
    with tracker:
        a = torch.empty(1000)          # 4000 B -> 4096
        b = a.view(10, 100)            # a view: no new storage
        a.add_(1)                      # in place: no new storage
        c = a * 2                      # 4096 more
        assert tracker.live_bytes == 8192
        del a
        assert tracker.live_bytes == 8192   # the view b keeps a's storage alive
        del b
        assert tracker.live_bytes == 4096
        del c
    assert tracker.live_bytes == 0
    assert tracker.peak_bytes == 8192
    assert tracker.timeline.replay()[0] == 8192


def test_fake_and_real_tensors_dispatch_alike():
    """Fake tensors reach the tracker as real ones do (the same ops, storages and frees). This checks
    the counting only; how close a trace is to a GPU run is tests/test_memory_cuda_accuracy.py's."""
    real, fake = run_step(fake=False), run_step(fake=True)
    assert fake.peak_bytes == real.peak_bytes
    assert len(fake.timeline.events) == len(real.timeline.events)
    assert fake.peak_bytes > 0


def test_op_model_plans_order_sizes_and_internal_buffers():
    """An op model reorders an op's outputs, books a block size for one, and adds kernel-internal
    buffers; a view of a booked output is the same allocation."""
    def op_model(func, args, kwargs, outputs, tracker):
        if func._opname == "native_dropout":
            return [("out", 1), ("alloc", "scratch", 4096, "<scratch>"), ("free", "scratch"), ("out", 0, 8192)]
        return None

    with FakeTensorMode():
        x = torch.empty(1000)
        tracker = StorageTracker(cuda_block_bytes, op_model=op_model)
        with tracker:
            out, mask = torch.native_dropout(x, 0.5, True)
            view = out.view(10, 100)
        tracker.stop()
    tl = tracker.timeline
    assert [(tl.allocations[k].op, s, tl.allocations[k].nbytes) for k, s in tl.events] == [
        ("native_dropout.default", 1, 1024),        # the bool mask first
        ("<scratch>", 1, 4096), ("<scratch>", -1, 4096),
        ("native_dropout.default", 1, 8192)]        # the output, at the booked size
    assert tracker.key_of(view) == tracker.key_of(out)
    assert len(tl.phases) == len(tl.events)


def test_accumulate_takes_over_the_operand_freed_right_after():
    """("accumulate", i, operand): the output lives in operand's block when operand is freed next."""
    def op_model(func, args, kwargs, outputs, tracker):
        return [("accumulate", 0, args[0])] if func._opname == "add" else None

    with FakeTensorMode():
        tracker = StorageTracker(cuda_block_bytes, op_model=op_model)
        with tracker:
            a = torch.empty(1000)
            b = torch.empty(1000)
            first = tracker.key_of(a)
            a = a + b            # the old a dies right after: the sum takes its block
            c = a + b            # a outlives it (d comes first): a block of its own
            d = torch.empty(10)
            del a
        tracker.stop()
    tl = tracker.timeline
    allocs = [k for k, s in tl.events if s > 0]
    assert len(allocs) == 4                       # a, b, c, d
    assert tracker.key_of(c) == allocs[2] and (first, -1) in tl.events
    assert tl.events.count((first, -1)) == 1 and d.numel() == 10


def test_phases_are_labelled():
    tracker = run_step(fake=True)
    phases = {a.phase for a in tracker.timeline.allocations.values()}
    assert {FORWARD, BACKWARD, UPDATE} <= phases
    # AdamW's first step creates its state (exp_avg, exp_avg_sq) in the update phase
    update = [a for a in tracker.timeline.allocations.values() if a.phase == UPDATE]
    params = sum(cuda_block_bytes(p.numel() * 4) for p in StandIn().parameters())
    assert sum(a.nbytes for a in update) >= 2 * params


def test_segment_sizes():
    assert segment_size(512) == 2 * MIB
    assert segment_size(1 * MIB) == 2 * MIB
    assert segment_size(1 * MIB + 512) == 20 * MIB
    assert segment_size(10 * MIB) == 10 * MIB
    assert segment_size(11 * MIB) == 12 * MIB


def test_allocator_reuses_splits_and_merges():
    m = CachingAllocatorModel()
    m.malloc(1, 4096)
    m.malloc(2, 4096)                      # same 2 MiB small segment
    assert m.stats.reserved == 2 * MIB and m.stats.allocated == 8192
    m.malloc(3, 30 * MIB)                  # own 30 MiB segment
    assert m.stats.reserved == 32 * MIB
    m.free(3)
    m.malloc(4, 29 * MIB + 512)            # reuses the cached 30 MiB block; rest < 1 MiB: not split
    assert m.stats.reserved == 32 * MIB
    assert m.stats.allocated == 8192 + 30 * MIB
    m.free(4)
    m.malloc(5, 10 * MIB)                  # rest 20 MiB > 1 MiB: split
    m.malloc(6, 20 * MIB)                  # fits the split-off rest exactly
    assert m.stats.reserved == 32 * MIB
    m.free(5)
    m.free(6)                              # merged back into one 30 MiB free block
    m.malloc(7, 30 * MIB)
    assert m.stats.reserved == 32 * MIB
    assert m.stats.peak_allocated == 8192 + 30 * MIB


def test_replay_of_a_trace_bounds_allocated_by_reserved():
    tracker = run_step(fake=True)
    stats = replay(tracker.timeline)
    assert stats.peak_allocated >= tracker.peak_bytes
    assert stats.peak_reserved >= stats.peak_allocated
