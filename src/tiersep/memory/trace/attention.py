"""The attention kernel: which SDPA kernel CUDA runs for a preset, and models of its fused kernels.

scaled_dot_product_attention: CUDA picks a fused kernel (flash for fp16/bf16, memory-efficient for
fp32) where CPU may take the math path. `modelled_backend` is that choice for a preset and device;
the estimate decides it once (memory/conditions.py). The CPU trace replaces the call by a model of
torch's CUDA code (aten/src/ATen/native/transformers/cuda): the same tensors, layouts and order of
allocation (`fused_attention`, `math_attention_cuda`; emulation.py routes the calls here).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tiersep.model.step import autocast_dtype


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def choose_cuda_backend(requested: str, dtype: torch.dtype, head_dim: int, has_mask: bool, gpu=None) -> str:
    """The SDPA kernel CUDA runs on `gpu` (a gpu_catalogue entry; None: an sm80+ card, which runs
    every kernel), or ConfigError when the requested one cannot run there. auto takes flash, then
    efficient, then math, as torch tries them (sdp_utils.cpp)."""
    from tiersep.config import ConfigError

    half = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype)
    flash_ok = half is not None and head_dim <= 256 and not has_mask
    # memory-efficient: head dim a multiple of the GEMM alignment (8 for 16-bit, 4 for fp32)
    efficient_ok = dtype in (torch.float32, torch.float16, torch.bfloat16) and head_dim % (8 if half else 4) == 0
    flash_here = gpu is None or gpu.runs("flash", half)
    efficient_here = gpu is None or gpu.runs("efficient", half)
    if requested == "auto":
        return ("flash" if flash_ok and flash_here else "efficient" if efficient_ok and efficient_here else "math")
    if requested in ("flash", "efficient") and not (flash_here if requested == "flash" else efficient_here):
        dtype_name = half or "fp32"
        raise ConfigError(f"model.attention_backend: {requested} does not run on the {gpu.model} ({gpu.sm}, "
                          f"{gpu.generation}) with {dtype_name}: it runs {', '.join(k for k in gpu.kernels if gpu.runs(k, half))} "
                          f"there (tiersep.gpu_catalogue); set auto")
    if requested == "flash" and not flash_ok:
        raise ConfigError(f"model.attention_backend: flash needs fp16/bf16 (train.precision bf16 or fp16) and a head "
                         f"dim <= 256 on CUDA; got {str(dtype).replace('torch.', '')}, head dim {head_dim}")
    if requested == "efficient" and not efficient_ok:
        raise ConfigError(f"model.attention_backend: efficient needs a head dim divisible by "
                         f"{8 if half else 4}; got {head_dim}")
    return requested


def modelled_backend(preset: dict, device: str, gpu=None) -> str:
    """The SDPA kernel the estimate assumes (what torch picks on that device for this preset; on
    CUDA, on card `gpu`, a gpu_catalogue entry, or any sm80+ card when None)."""
    m, t = preset["model"], preset["train"]
    if device == "cuda":
        dtype = autocast_dtype(t["precision"]) or torch.float32
        return choose_cuda_backend(m["attention_backend"], dtype, m["attention_dim"] // m["n_heads"], False, gpu)
    # CPU: the flash kernel for CPU takes no dropout; otherwise the math path
    if m["attention_backend"] in ("auto", "flash"):
        return "flash" if m["dropout"] == 0 else "math"
    return m["attention_backend"]


class _FlashAttention(torch.autograd.Function):
    """_scaled_dot_product_flash_attention on CUDA (FlashAttention-2, flash_attn/flash_api.cpp):
    q, k, v [B, H, L, D] with D a multiple of 8 (the caller pads, as torch does). Sizes and layouts
    only: no values are computed."""

    @staticmethod
    def forward(ctx, q, k, v, dropout_p: float):
        B, H, L, _ = q.shape
        # mha_fwd on q.transpose(1, 2): out = empty_like keeps q's [B, H, L, D] memory layout
        out = torch.empty_like(q) if v.shape[-1] == q.shape[-1] else q.new_empty(B, H, L, v.shape[-1])
        lse = q.new_empty(B, H, L, dtype=torch.float32)
        rng_state = q.new_empty(2, dtype=torch.int64)
        unused = q.new_empty((), dtype=torch.int64)
        if dropout_p > 0:   # a fresh rng_state replaces the first
            rng_state = q.new_empty(2, dtype=torch.int64)
        ctx.save_for_backward(q, k, v, out, lse, rng_state, unused)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, _, _ = ctx.saved_tensors
        B, H, L, D = q.shape
        # _flash_attention_backward: the kernel wants [B, L, H, D] with a contiguous dout and out
        dout = grad_out.transpose(1, 2).contiguous()
        out_t = out.transpose(1, 2).contiguous()
        dq = torch.empty_like(q.transpose(1, 2))
        dk = torch.empty_like(k.transpose(1, 2))
        dv = torch.empty_like(v.transpose(1, 2))
        softmax_d = q.new_empty(B, H, _round_up(L, 128), dtype=torch.float32)
        dq_accum = q.new_empty(B, _round_up(L, 128), H, _round_up(D, 32 if D <= 128 else 64),
                               dtype=torch.float32)
        del dq_accum, softmax_d, out_t, dout   # mha_bwd's and then the wrapper's locals
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), None


class _CudnnAttention(_FlashAttention):
    """What torch 2.11 runs for `auto` on Hopper when the 16-bit head dim needs no padding (a multiple
    of 8): cuDNN attention, as the H200 event logs show it (tests/data/gpu/h200-2026-11-27/events/:
    `large`, `xlarge`, `small` 8 heads x 64, and `memory_optimized`'s of 2026-11-26). Forward as
    flash's (output and fp32 row statistics); backward allocates dq, dk, dv and then one workspace of
    B x H x L x (D + 1) fp32 (dq's fp32 accumulator and the rows' dout . out) + 256 bytes, freed on
    return: not FA2's softmax_d and dq_accum, whose L rounds up to 128 and D to 32."""

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, _, _ = ctx.saved_tensors
        B, H, L, D = q.shape
        dq = torch.empty_like(q.transpose(1, 2))
        dk = torch.empty_like(k.transpose(1, 2))
        dv = torch.empty_like(v.transpose(1, 2))
        workspace = q.new_empty(B * H * L * (D + 1) * 4 + 256, dtype=torch.uint8)
        del workspace
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), None


# cutlass memory-efficient backward (mem_eff_attention/kernel_backward.h), the kernel torch picks for
# sm80+: 64x64 blocks for a head dim up to 64 (128x64 above), split keys enabled.
_EFF_BLOCK_I, _EFF_BLOCK_J = 64, 64


def efficient_backward_workspace(B: int, H: int, L: int, D: int, dtype: torch.dtype) -> int:
    """Bytes of the cutlass backward's workspace: per (batch, head), a grad-Q accumulator tile
    (64 x 64 fp32 plus a 16-byte lock) for each block of 64 queries and 64 head-dim columns
    (kNeedsAccumGradQ: split keys); grad-K/V accumulators for fp16/bf16 outside registers."""
    block_i = _EFF_BLOCK_I if D <= 64 else 128
    half = dtype in (torch.float16, torch.bfloat16)
    gq = math.ceil(L / block_i) * math.ceil(D / _EFF_BLOCK_J) * (16 + block_i * _EFF_BLOCK_J * 4) // 4
    gkv = 0
    if half and D > block_i:    # kNeedsAccumGradK/V: output not kept in registers
        gkv = 2 * _round_up(L, _EFF_BLOCK_J) * _round_up(D, block_i)
    return B * H * _round_up(gq + gkv, 4) * 4


class _EfficientAttention(torch.autograd.Function):
    """_scaled_dot_product_efficient_attention on CUDA (cutlass, attention.cu and
    attention_backward.cu): q, k, v [B, H, L, D]; sizes and layouts only."""

    @staticmethod
    def forward(ctx, q, k, v, dropout_p: float):
        B, H, L, _ = q.shape
        Dv = v.shape[-1]
        half = q.dtype in (torch.float16, torch.bfloat16)
        out = q.new_empty(B, L, H, Dv)                       # [B, M, num_heads, Kv], handed back transposed
        lse = q.new_empty(B, H, _round_up(L, 32), dtype=torch.float32)   # kAlignLSE = 32
        if half and Dv > _EFF_BLOCK_J:   # kNeedsOutputAccumulatorBuffer: more than one value iteration
            accum = q.new_empty(B, L, H, Dv, dtype=torch.float32)
            del accum
        # the dropout seed and offset are host scalars outside CUDA graph capture
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.dropout_p = dropout_p
        return out.transpose(1, 2)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        B, H, L, D = q.shape
        dout = grad_out.transpose(1, 2).contiguous()          # [B, L, H, Dv]
        dq = q.new_empty(B, L, H, D)
        dk = k.new_empty(B, k.shape[2], H, D)
        dv = v.new_empty(B, v.shape[2], H, v.shape[-1])
        if q.dtype in (torch.float16, torch.bfloat16):      # kKernelComputesDelta
            delta = q.new_empty(B, H, L, dtype=torch.float32)
        else:   # (dout.float() * out.float()).sum(-1).transpose(-2, -1).contiguous(), one expression
            product = dout * out
            rowsum = product.sum(-1)
            delta = rowsum.transpose(-2, -1).contiguous()
            del rowsum, product
        workspace = q.new_empty(efficient_backward_workspace(B, H, L, D, q.dtype), dtype=torch.uint8)
        del delta, workspace, dout
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), None


def cudnn_takes(head_dim: int, value_dim: int | None = None) -> bool:
    """Whether cuDNN attention takes a 16-bit call that `auto` would give flash, where torch tries
    cuDNN first (gpu_catalogue.GpuEntry.prefers_cudnn): a head dim needing no padding (a multiple of
    8) up to 256, the same for values. Otherwise flash runs. Read off torch's own choice on an H200
    (bench/results/sdpa_kernels_h200.md: cuDNN for 8, 16, 24, 40, 64, 128-256; flash for 12; above
    256 neither). Its backward workspace (_CudnnAttention) is measured at head dim 16 only."""
    value_dim = head_dim if value_dim is None else value_dim
    return head_dim % 8 == 0 and head_dim == value_dim and head_dim <= 256


def auto_kernel(dtype: torch.dtype, head_dim: int, gpu=None, value_dim: int | None = None,
                has_mask: bool = False) -> str:
    """The SDPA kernel torch's `auto` runs on `gpu` (a gpu_catalogue entry): choose_cuda_backend's,
    with cuDNN attention where the card tries it first and `cudnn_takes` the call. gpu None: the
    card the trace's own `auto` models (emulation.CudaEmulation), an sm80+ card that tries cuDNN
    first, as the Hopper cards measured."""
    kind = choose_cuda_backend("auto", dtype, head_dim, has_mask, gpu)
    prefers = gpu is None or gpu.prefers_cudnn
    return "cudnn" if kind == "flash" and prefers and cudnn_takes(head_dim, value_dim) else kind


def fused_attention(q, k, v, kind: str, dropout_p: float = 0.0):
    """at::scaled_dot_product_attention with a fused CUDA kernel (`kind`: flash, cudnn or
    efficient), on [B, H, L, D] inputs: flash pads the head dim to a multiple of 8 (at::pad, so
    backward slices it off again) and slices the output back (slice, whose backward pads the
    gradient). cudnn is what `auto` runs where the card tries cuDNN first (Hopper, the generation
    measured, and datacenter Blackwell) and `cudnn_takes` the call (the caller decides:
    emulation.CudaEmulation); an estimate for another card traces its preset with attention_backend
    flash there (conditions.Conditions.applied), so it keeps FA2's buffers."""
    if kind == "cudnn":
        return _CudnnAttention.apply(q, k, v, dropout_p)
    if kind == "flash":
        D, Dv = q.shape[-1], v.shape[-1]
        pad = (-D) % 8
        if pad:
            q, k, v = F.pad(q, (0, pad)), F.pad(k, (0, pad)), F.pad(v, (0, (-Dv) % 8))
        out = _FlashAttention.apply(q, k, v, dropout_p)
        return out[..., :Dv] if out.shape[-1] != Dv else out
    return _EfficientAttention.apply(q, k, v, dropout_p)


def math_attention_cuda(q, k, v, dropout_p: float, scale: float | None):
    """at::_scaled_dot_product_attention_math as it runs on CUDA (transformers/attention.cpp, torch
    2.11): fp16/bf16 q, k, v are copied to fp32 first (allowFP16BF16ReductionMathSDP is off by
    default), so the scores, _safe_softmax (fp32 in, fp32 accumulation) and dropout (at::dropout is
    the fused native_dropout on CUDA) are fp32 whatever the autocast dtype. What a fake tensor does
    not see is in CudaKernelMemory: softmax's backward temporary and cuBLAS's operand copies."""
    origin = q.dtype
    if origin in (torch.float16, torch.bfloat16):
        q, k, v = q.float(), k.float(), v.float()
    factor = math.sqrt(scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    query = q * factor   # a local of the C++ kernel: alive until it returns
    attn = torch.matmul(query, k.transpose(-2, -1) * factor)   # [B, H, L, L]: the big one
    attn = torch._safe_softmax(attn, -1)
    if dropout_p > 0:
        attn, _mask = torch.native_dropout(attn, dropout_p, True)
    # The kernel returns (matmul(attn, v).to(origin), attn.to(origin)); GCC evaluates the tuple's
    # arguments right to left, so the weights' copy exists while the output is computed.
    weights = attn.to(origin)
    out = torch.matmul(attn, v).to(origin)
    del weights, query
    return out
