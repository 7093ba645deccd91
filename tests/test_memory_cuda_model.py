"""CUDA emulation on a CPU trace: autocast policy, dropout and SDPA kernel models.

The strongest check needs no GPU: fake CUDA tensors run *forward* ops through the real AutocastCUDA
kernels (only autograd's backward needs a device), so the real model's forward under CUDA autocast on
fake CUDA tensors is the reference the emulation (fake CPU tensors + CudaEmulation) must reproduce.
"""
from __future__ import annotations

import collections

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tiersep import config as C
from tiersep.memory.cuda_model import (FP32, FP32_OUTPUT, LOWER_PRECISION, PROMOTE, CudaEmulation,
                                       _FusedAttention, choose_cuda_backend, cuda_autocast_ops, policy_of)
from tiersep.memory.tracker import FORWARD, StorageTracker, cuda_block_bytes


def small_preset(**fields):
    preset = C.load_preset("cpu_small")
    for key, value in {"audio.segment_samples": 4000, "model.n_heads": 2, "model.norm_groups": 4,
                       "model.emb_dim": 24, "model.attention_dim": 24}.items():
        preset = C.set_field(preset, key, value)
    for key, value in fields.items():
        preset = C.set_field(preset, key.replace("__", "."), value)
    return preset


def test_every_cuda_autocast_op_has_a_policy():
    registered = cuda_autocast_ops()
    missing = sorted(op for op in registered if policy_of(op) is None)
    assert not missing, f"ops with an AutocastCUDA kernel but no policy in cuda_model: {missing}"
    listed = LOWER_PRECISION | FP32 | FP32_OUTPUT | PROMOTE
    assert listed - registered == set(), f"policies for ops CUDA autocast does not touch: {listed - registered}"
    assert policy_of("__matmul__") == "lower" and policy_of("group_norm") == "fp32"
    assert policy_of("silu") is None


def _forward_allocations(preset, real_cuda: bool):
    """(peak, live at the end, multiset of (dtype, bytes)) of the model's forward with autocast."""
    from tiersep.model import build_model

    dtype = torch.bfloat16 if preset["train"]["precision"] == "bf16" else None
    with FakeTensorMode():
        device = "cuda" if real_cuda else "cpu"
        with torch.device(device):
            torch.manual_seed(0)
            model = build_model(preset).train()
        x = torch.empty(2, 2, preset["audio"]["segment_samples"], device=device)
        tracker = StorageTracker(cuda_block_bytes)
        tracker.register(list(model.parameters()) + [x])
        if real_cuda:   # CUDA autocast on fake CUDA tensors: the real AutocastCUDA kernels
            torch.set_autocast_enabled("cuda", dtype is not None)
            if dtype is not None:
                torch.set_autocast_dtype("cuda", dtype)
            try:
                with tracker:
                    tracker.phase = FORWARD
                    out = model(x)
            finally:
                torch.set_autocast_enabled("cuda", False)
        else:
            autocast = torch.autocast("cpu", dtype=dtype, enabled=dtype is not None)
            with CudaEmulation(preset["model"]["attention_backend"]), tracker, autocast:
                tracker.phase = FORWARD
                out = model(x)
        tracker.stop()
        live = tracker.live_bytes
        del out
    # tensors under 4 KiB (RoPE angle tables and the like) are left out: their count varies with
    # fake-tensor caching state from earlier tests, and their bytes are immaterial
    sizes = collections.Counter((a.dtype, a.nbytes) for a in tracker.timeline.allocations.values()
                                if a.phase == FORWARD and a.nbytes >= 4096)
    return tracker.peak_bytes, live, sizes


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_emulated_forward_matches_cuda_autocast(precision):
    # math attention: the fused-kernel choice needs a real device, the math path is composite
    preset = small_preset(train__precision=precision, model__dropout=0.1, model__attention_backend="math")
    cuda_peak, cuda_live, cuda_sizes = _forward_allocations(preset, real_cuda=True)
    emu_peak, emu_live, emu_sizes = _forward_allocations(preset, real_cuda=False)
    assert emu_sizes == cuda_sizes
    # saved activations at the end of forward, and the forward peak: within 0.1%
    assert emu_live == pytest.approx(cuda_live, rel=1e-3)
    assert emu_peak == pytest.approx(cuda_peak, rel=1e-3)


def test_cpu_dropout_differs_from_cuda_without_emulation():
    """The reason dropout is emulated: CPU saves a float noise tensor where CUDA saves a bool mask."""
    preset = small_preset(model__dropout=0.1, model__attention_backend="math")
    _, cuda_live, _ = _forward_allocations(preset, real_cuda=True)
    from tiersep.model import build_model

    with FakeTensorMode():
        model = build_model(preset).train()
        x = torch.empty(2, 2, preset["audio"]["segment_samples"])
        tracker = StorageTracker(cuda_block_bytes)
        tracker.register(list(model.parameters()) + [x])
        with tracker:
            out = model(x)
        tracker.stop()
        del out
    assert tracker.live_bytes > cuda_live * 1.05


def test_fused_attention_keeps_linear_state():
    n, h, length, d = 6, 2, 300, 16
    with FakeTensorMode():
        q, k, v = (torch.empty(n, h, length, d, requires_grad=True) for _ in range(3))
        tracker = StorageTracker(cuda_block_bytes)
        with tracker:
            out = _FusedAttention.apply(q, k, v, "efficient")
        tracker.stop()
    sizes = sorted(a.nbytes for a in tracker.timeline.allocations.values())
    # the output and the fp32 logsumexp (rows padded to 32); nothing of size L^2
    assert sizes == sorted([cuda_block_bytes(n * h * length * d * 4), cuda_block_bytes(n * h * 320 * 4)])
    assert out.shape == (n, h, length, d)


def test_flash_pads_head_dim_to_8():
    with FakeTensorMode():
        q, k, v = (torch.empty(4, 2, 50, 12, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        tracker = StorageTracker(cuda_block_bytes)
        with tracker:
            out = _FusedAttention.apply(q, k, v, "flash")
        tracker.stop()
    shapes = {a.shape for a in tracker.timeline.allocations.values()}
    assert (4, 2, 50, 16) in shapes           # padded copies of q, k, v
    assert out.shape == (4, 2, 50, 12)


def test_backend_choice():
    assert choose_cuda_backend("auto", torch.bfloat16, 16, False) == "flash"
    assert choose_cuda_backend("auto", torch.float32, 16, False) == "efficient"
    assert choose_cuda_backend("auto", torch.float32, 6, False) == "math"
    assert choose_cuda_backend("math", torch.bfloat16, 16, False) == "math"
    with pytest.raises(ValueError, match="model.attention_backend: flash needs"):
        choose_cuda_backend("flash", torch.float32, 16, False)
