"""A deep tier's step traced with five blocks and extended to its depth (memory/trace/depth.py).

The extension must give the timeline the trace of every block gives, event for event: the real
tiers' variants against their full-depth traces (record_step given the model builder never extends),
and `extend` alone against made-up stacks of identical blocks written out at each depth.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from conftest import load_script
from tiersep import config as C
from tiersep.memory.trace import depth, record_step, step, summarize
from tiersep.memory.trace.tracker import Allocation, Timeline, cuda_block_bytes
from tiersep.model import build_loss, build_model

BENCH = Path(__file__).resolve().parents[1] / "bench" / "depth_extension.py"
SEGMENT = 22016     # a short segment: the events of a step do not depend on its length, its bytes do


# ---- extend alone, on made-up stacks of identical blocks --------------------------------------

class MadeUp:
    """A step of `n` identical blocks written out event by event: weights arriving, a forward that
    frees each block's input in the next block, a backward that frees the gradient of the block
    after, per-parameter norms stacked by clipping. Each event's tag is the block whose work made it
    (None: outside the blocks), as BlockTagger records it."""

    def __init__(self, n: int):
        self.tl, self.tags, self.owner, self.aggregates = Timeline(), [], {}, {}
        blocks = list(range(n))
        weights = [self.alloc(b, 512 * (3 if b is None else 1), "<registered>", "setup") for b in [None] + blocks + [None]]
        x = self.alloc(None, 4096, "conv", "forward")
        saved = {}
        for b in blocks:
            saved[b] = self.alloc(b, 2048, "mul", "forward")
            y = self.alloc(b, 4096, "add", "forward")
            self.free(x, b)
            x = y
        out = self.alloc(None, 8192, "decoder", "forward")
        self.free(x, None)                        # outside the blocks: counts as the last block's
        g = self.alloc(None, 8192, "grad", "backward")
        self.free(out, None)
        for b in reversed(blocks):
            g_in = self.alloc(b, 4096, "grad_in", "backward")
            self.free(g, b)                       # the gradient the block after made
            self.free(saved[b], b)
            g = g_in
        self.free(g, None)
        owners = [self.owner[w] for w in weights]
        norms = [self.alloc(o, 512, "_foreach_norm", "update") for o in owners]
        stack = self.alloc(None, cuda_block_bytes(len(norms) * 64), "stack.default", "update", shape=(len(norms),))
        self.aggregates[stack] = ("stack.default", owners, (len(norms),), 64)
        for key in norms:
            self.free(key, None)
        self.free(stack, None)

    def alloc(self, tag, nbytes, op, phase, shape=()):
        key = len(self.tl.allocations)
        self.tl.allocations[key] = Allocation(nbytes, phase, op, shape, "float32")
        self.tl.events.append((key, +1))
        self.tl.phases.append(phase)
        self.tags.append(tag)
        self.owner[key] = tag
        return key

    def free(self, key, tag):
        self.tl.events.append((key, -1))
        self.tl.phases.append(self.tl.allocations[key].phase)
        self.tags.append(tag)


def _bench():
    return load_script(BENCH)


canonical = _bench().canonical     # the bench's: keys renamed in order of first appearance


@pytest.mark.parametrize("target", [6, 8, 12])
def test_extend_gives_the_timeline_of_the_deeper_stack(target):
    five = MadeUp(5)
    extended = depth.extend(five.tl, five.tags, five.owner, five.aggregates, 5, target)
    assert canonical(extended.timeline) == canonical(MadeUp(target).tl)
    # the template block's tensors have one copy per added block, and the traced events keep their order
    assert all(len(c) == target - 5 for c in extended.copies.values()) and len(extended.copies) == 5
    assert extended.index == sorted(extended.index)
    assert [extended.timeline.events[i][1] for i in extended.index] == [s for _, s in five.tl.events]


def test_blocks_that_do_not_allocate_alike_cannot_be_extended():
    five = MadeUp(5)
    odd = five.alloc(3, 1024, "extra", "update")      # the template's neighbour allocates once more
    five.free(odd, 3)
    with pytest.raises(depth.CannotExtend, match="blocks 3 and 2 do not allocate alike"):
        depth.extend(five.tl, five.tags, five.owner, five.aggregates, 5, 8)


def test_a_template_run_between_untagged_runs_cannot_be_extended():
    five = MadeUp(5)
    for tag in (None, 1, None, 2, None, 3, None):    # which way do the blocks run here? Nothing says
        five.free(five.alloc(tag, 512, "lonely", "update"), tag)
    with pytest.raises(depth.CannotExtend, match="lie between blocks None and None"):
        depth.extend(five.tl, five.tags, five.owner, five.aggregates, 5, 8)


# ---- the real tiers ------------------------------------------------------------------------

def preset_of(name: str, **fields) -> dict:
    preset = C.load_preset(name)
    for key, value in {"audio.segment_samples": SEGMENT, **fields}.items():
        preset = C.set_field(preset, key, value)
    return preset


def full_depth(preset: dict):
    """record_step of every block: given the model builder, record_step never extends."""
    return record_step(preset, "cuda", model_and_loss=lambda p: (build_model(p), build_loss(p)))


@pytest.fixture
def extensions(monkeypatch):
    """Each extension record_step made: (blocks traced, blocks wanted, the error when it fell back)."""
    made, real = [], step._extended

    def spy(traced, target):
        blocks = 1 + max(block for *_, block in traced.tracker.ranges)
        try:
            out = real(traced, target)
        except depth.CannotExtend as err:
            made.append((blocks, target, str(err)))
            raise
        made.append((blocks, target, None))
        return out

    monkeypatch.setattr(step, "_extended", spy)
    return made


@pytest.mark.parametrize("name, fields", [
    # the most frugal variant on a card without bf16: checkpointed fp16, the efficient kernel, 1 x 16
    ("xlarge", {"model.checkpointing": True, "train.precision": "fp16", "model.attention_backend": "efficient",
                "train.batch_size": 1, "train.grad_accum": 16}),
    # as written: no checkpointing, 8 x 2 micro-batches (the untraced one derived from the traced)
    ("xlarge", {}),
    # checkpointed bf16 on the flash kernel, micro-batches of 2
    ("large", {"model.checkpointing": True, "train.precision": "bf16", "train.batch_size": 2, "train.grad_accum": 4}),
    # fp32 math attention, the EMA copy of the weights, no checkpointing, 2 micro-batches
    ("xlarge", {"train.precision": "fp32", "model.attention_backend": "math", "train.ema": {"decay": 0.999, "every": 1},
                "train.batch_size": 1, "train.grad_accum": 2}),
], ids=["xlarge-frugal-fp16", "xlarge-written", "large-ckpt-bf16", "xlarge-fp32-math-ema"])
def test_a_deep_tier_extended_from_five_blocks_is_its_full_depth_trace(name, fields, extensions):
    preset = preset_of(name, **fields)
    extended = record_step(preset, "cuda")
    assert extensions == [(depth.TRACED_BLOCKS, preset["model"]["n_layers"], None)]
    full = full_depth(preset)
    assert extensions == [(depth.TRACED_BLOCKS, preset["model"]["n_layers"], None)]    # the full trace: none
    assert canonical(extended.timeline) == canonical(full.timeline)
    assert extended.parameters == full.parameters and extended.step_start == full.step_start
    assert dataclasses.asdict(summarize(extended, "cuda")) == dataclasses.asdict(summarize(full, "cuda"))


def test_where_the_blocks_do_not_repeat_the_whole_depth_is_traced(extensions, monkeypatch):
    """With four blocks traced the template's next neighbour is the last block, which allocates
    otherwise: the extension refuses, and record_step traces every block."""
    monkeypatch.setattr(step, "TRACED_BLOCKS", 4)
    preset = preset_of("large", **{"model.checkpointing": True, "train.precision": "bf16"})
    fell_back = record_step(preset, "cuda")
    assert extensions == [(4, 8, "blocks 3 and 2 do not allocate alike")]
    assert dataclasses.asdict(summarize(fell_back, "cuda")) == dataclasses.asdict(summarize(full_depth(preset), "cuda"))


def test_shallow_tiers_cpu_traces_and_compiled_steps_are_traced_whole(extensions):
    record_step(preset_of("small"), "cuda")                       # 3 blocks: nothing to extend
    record_step(preset_of("large"), "cpu")                        # the CPU trace is measured against real CPU steps
    assert extensions == []
