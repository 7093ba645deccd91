"""Make a CPU fake-tensor trace allocate what a CUDA run allocates, in the order it allocates it.

Fake CUDA tensors cannot run autograd without a GPU (the engine initialises the device), so the
trace runs on fake CPU tensors. Two layers correct where CPU and CUDA differ in memory:

`CudaEmulation`, a TorchFunctionMode above autograd (so autograd saves what it saves on CUDA):
1. Autocast. CPU and CUDA autocast have different op lists (e.g. CUDA runs group_norm, softmax,
   sum, pow, exp and the losses in fp32; CPU autocasts stft and cat and leaves group_norm alone).
   The trace keeps CPU autocast on as the *state* (so `torch.autocast(x.device.type, enabled=False)`
   in the model still opts out) but applies CUDA's *policy*: each call in an autocast region has its
   floating tensors cast per CUDA's list below, last argument first (the autocast wrapper's
   `cached_cast(args)...` pack is evaluated right to left by GCC), then runs with CPU autocast off.
   Every op with an AutocastCUDA kernel in this torch build must be in one of the lists (tests check
   it), so a torch upgrade that adds an op is caught rather than silently mis-modelled.
2. dropout: CUDA runs the fused native_dropout (output plus a bool mask for backward); CPU
   multiplies by a noise tensor of the input's dtype. nn.Dropout and F.dropout calls are modelled
   with native_dropout.
3. scaled_dot_product_attention: CUDA picks a fused kernel (flash for fp16/bf16, memory-efficient
   for fp32) where CPU may take the math path. The call is replaced by a model of torch's CUDA code
   (aten/src/ATen/native/transformers/cuda): the same tensors, layouts and order of allocation.

`CudaKernelMemory`, the tracker's op model below autograd (one aten op at a time): memory a CUDA
kernel allocates that the CPU kernel does not, and the order of its outputs: cuDNN convolution
workspaces, cuBLAS workspaces (one per thread that runs a GEMM: the main thread and autograd's
device thread), cuFFT's input clones, col2im/im2col's input-sized outputs, native_dropout's mask
before its output, the in-place gradient accumulation of autograd's InputBuffer (fake tensors
are tensor subclasses, for which autograd never accumulates in place), the softmax kernels' own
temporaries (cuda/SoftMax.cu: the backward's `grad * output`, contiguous copies of their inputs) and
the contiguous copies cuBLAS GEMMs make of operands whose strides it cannot take (cuda/Blas.cpp).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.weak import WeakIdKeyDictionary

# CUDA autocast policy, by aten op name (aten/src/ATen/autocast_mode.cpp, CUDA registrations).
LOWER_PRECISION = frozenset("""
    _convolution conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d conv_transpose3d
    convolution cudnn_convolution cudnn_convolution_transpose prelu addmm addmv addr matmul einsum mm
    mv linalg_vecdot linear addbmm baddbmm bmm chain_matmul linalg_multi_dot _thnn_fused_lstm_cell
    _thnn_fused_gru_cell lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell _cudnn_rnn
    _scaled_dot_product_flash_attention scaled_dot_product_attention
""".split())
FP32 = frozenset("""
    acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow softplus
    layer_norm native_layer_norm group_norm frobenius_norm nuclear_norm cosine_similarity
    poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss kl_div l1_loss
    smooth_l1_loss huber_loss mse_loss margin_ranking_loss multilabel_margin_loss soft_margin_loss
    triplet_margin_loss multi_margin_loss binary_cross_entropy binary_cross_entropy_with_logits dist
    pdist cdist renorm logsumexp upsample_nearest1d upsample_nearest2d upsample_nearest3d
    _upsample_nearest_exact1d _upsample_nearest_exact2d _upsample_nearest_exact3d upsample_linear1d
    upsample_bilinear2d _upsample_bilinear2d_aa upsample_trilinear3d upsample_bicubic2d
    _upsample_bicubic2d_aa
""".split())
# Run in fp32 by passing dtype=float32 (no copy of the input; the output is fp32).
FP32_OUTPUT = frozenset("prod softmax log_softmax cumprod cumsum linalg_vector_norm linalg_matrix_norm sum norm".split())
PROMOTE = frozenset("addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add".split())

# Python-level names (torch.*, Tensor methods, torch.nn.functional) that differ from the aten name.
_ALIASES = {"__matmul__": "matmul", "__rmatmul__": "matmul", "__pow__": "pow", "__rpow__": "pow"}


def policy_of(name: str) -> str | None:
    name = _ALIASES.get(name, name)
    for label, names in (("lower", LOWER_PRECISION), ("fp32", FP32), ("fp32_output", FP32_OUTPUT),
                         ("promote", PROMOTE)):
        if name in names:
            return label
    return None


def cuda_autocast_ops() -> set[str]:
    """Names of the aten ops this torch build registers an AutocastCUDA kernel for."""
    regs = torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA")
    return {r.split("::", 1)[1].split(".", 1)[0] for r in regs}


def _eligible(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


# ------------------------------------------------------------------------------------------------
# SDPA kernel choice and models
# ------------------------------------------------------------------------------------------------
def choose_cuda_backend(requested: str, dtype: torch.dtype, head_dim: int, has_mask: bool) -> str:
    """The SDPA kernel CUDA runs (sm80+), or ConfigError when the requested one cannot run."""
    from tiersep.config import ConfigError

    half = dtype in (torch.float16, torch.bfloat16)
    flash_ok = half and head_dim <= 256 and not has_mask
    # memory-efficient: head dim a multiple of the GEMM alignment (8 for 16-bit, 4 for fp32)
    efficient_ok = dtype in (torch.float32, torch.float16, torch.bfloat16) and head_dim % (8 if half else 4) == 0
    if requested == "auto":
        return "flash" if flash_ok else "efficient" if efficient_ok else "math"
    if requested == "flash" and not flash_ok:
        raise ConfigError(f"model.attention_backend: flash needs fp16/bf16 (train.precision bf16) and a head "
                         f"dim <= 256 on CUDA; got {str(dtype).replace('torch.', '')}, head dim {head_dim}")
    if requested == "efficient" and not efficient_ok:
        raise ConfigError(f"model.attention_backend: efficient needs a head dim divisible by "
                         f"{8 if half else 4}; got {head_dim}")
    return requested


def modelled_backend(preset: dict, device: str) -> str:
    """The SDPA kernel the estimate assumes (what torch picks on that device for this preset)."""
    m, t = preset["model"], preset["train"]
    if device == "cuda":
        dtype = torch.bfloat16 if t["precision"] == "bf16" else torch.float32
        return choose_cuda_backend(m["attention_backend"], dtype, m["attention_dim"] // m["n_heads"], False)
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


def fused_attention(q, k, v, kind: str, dropout_p: float = 0.0):
    """at::scaled_dot_product_attention with a fused CUDA kernel, on [B, H, L, D] inputs: flash
    pads the head dim to a multiple of 8 (at::pad, so backward slices it off again) and slices the
    output back (slice, whose backward pads the gradient)."""
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


# ------------------------------------------------------------------------------------------------
# The mode
# ------------------------------------------------------------------------------------------------
class CudaEmulation(TorchFunctionMode):
    """Apply CUDA's autocast policy and SDPA kernel choice to a CPU trace (see module docstring)."""

    def __init__(self, attention_backend: str = "auto"):
        super().__init__()
        self.requested_backend = attention_backend
        self.kernels_used: dict[str, int] = {}
        self.unmodelled: set[str] = set()
        self._cast_cache = WeakIdKeyDictionary()   # autocast caches casts of leaf parameters

    def clear_cast_cache(self) -> None:
        self._cast_cache = WeakIdKeyDictionary()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        autocast_on = torch.is_autocast_enabled("cpu")
        target = torch.get_autocast_dtype("cpu") if autocast_on else None
        if name == "scaled_dot_product_attention":
            return self._sdpa(target, *args, **kwargs)
        if name == "dropout":
            return self._dropout(func, args, kwargs)
        if func is torch.Tensor.backward and len(args) == 1 and not any(kwargs.values()):
            return self._backward(args[0])
        if not autocast_on:
            return func(*args, **kwargs)
        policy = policy_of(name)
        if policy == "lower":
            args, kwargs = self._cast(args, kwargs, lambda t: target)
        elif policy == "fp32":
            args, kwargs = self._cast(args, kwargs, lambda t: torch.float32)
        elif policy == "fp32_output":
            if "dtype" not in kwargs and any(_eligible(t) and t.dtype != torch.float32
                                             for t in _tensors(args, kwargs)):
                kwargs = dict(kwargs, dtype=torch.float32)
        elif policy == "promote":
            widest = max((t.dtype for t in _tensors(args, kwargs) if _eligible(t)),
                         key=lambda d: torch.finfo(d).bits, default=None)
            if widest is not None:
                args, kwargs = self._cast(args, kwargs, lambda t: widest)
        with torch.autocast("cpu", enabled=False):
            return func(*args, **kwargs)

    def _backward(self, loss):
        """loss.backward() with this mode active: a handler runs with its mode popped, and
        activation checkpointing re-runs forward code (autocast, dropout, SDPA) inside backward."""
        try:
            from torch.autograd.graph import _engine_run_backward
        except ImportError:   # another torch: plain backward (checkpoint recompute then runs CPU-style)
            self.unmodelled.add("checkpoint recomputation ran without the CUDA emulation")
            return loss.backward()
        with self:
            _engine_run_backward((loss,), (torch.ones_like(loss),), False, False, (),
                                 allow_unreachable=True, accumulate_grad=True)

    @staticmethod
    def _dropout(func, args, kwargs):
        """CUDA's dropout is the fused native_dropout (output + bool mask saved for backward);
        CPU's multiplies by a noise tensor of the input's dtype (4x the mask's bytes in fp32).
        Takes F.dropout(input, p=0.5, training=True, inplace=False) and torch.dropout(input, p, train)."""
        names = ("input", "p", "training", "inplace")
        bound = dict(zip(names, args), **{("training" if k == "train" else k): v for k, v in kwargs.items()})
        x, p = bound["input"], bound.get("p", 0.5)
        if not (bound.get("training", True) and 0.0 < p < 1.0 and x.numel() > 0):
            return func(*args, **kwargs)
        out = torch.native_dropout(x, p, True)[0]
        return x.copy_(out) if bound.get("inplace", False) else out

    def _cast(self, args, kwargs, dtype_for):
        """Cast the eligible tensors of a call, the last argument first (see module docstring).
        Casts of leaf parameters are cached for the autocast region, as CUDA autocast does; not in
        backward (a checkpoint's recomputation runs under an autocast region of its own there)."""
        cache = None if _in_backward() else self._cast_cache

        def cast(t):
            if not _eligible(t):
                return t
            dtype = dtype_for(t)
            if t.dtype == dtype:
                return t
            if cache is not None and t.is_leaf and t.requires_grad:
                cached = cache.get(t)
                if cached is None or cached.dtype != dtype:
                    cached = cache[t] = t.to(dtype)
                return cached
            return t.to(dtype)
        leaves, spec = tree_flatten((args, kwargs))
        with torch.autocast("cpu", enabled=False):
            cast_leaves = [cast(t) for t in reversed(leaves)][::-1]
        return tree_unflatten(cast_leaves, spec)

    def _sdpa(self, target, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
              scale=None, enable_gqa=False):
        with torch.autocast("cpu", enabled=False):
            if target is not None:     # SDPA is on CUDA's lower-precision list
                query, key, value = self._cast((query, key, value), {}, lambda _: target)[0]
            kind = choose_cuda_backend(self.requested_backend, query.dtype, query.shape[-1],
                                       attn_mask is not None or is_causal)
            self.kernels_used[kind] = self.kernels_used.get(kind, 0) + 1
            if kind == "math" or attn_mask is not None or is_causal or enable_gqa:
                if attn_mask is not None or is_causal or enable_gqa:
                    self.unmodelled.add("sdpa with mask/causal/gqa (modelled as math)")
                return math_attention_cuda(query, key, value, dropout_p, scale)
            lead = query.shape[:-2]
            if query.dim() != 4:   # fused kernels take [B, H, L, D]; fold other leading dims
                query, key, value = (t.reshape(-1, 1, *t.shape[-2:]) for t in (query, key, value))
            out = fused_attention(query, key, value, kind, dropout_p)
            return out.reshape(*lead, *out.shape[-2:])


def _tensors(args, kwargs):
    return [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]


# ------------------------------------------------------------------------------------------------
# Kernel-internal memory (the tracker's op model)
# ------------------------------------------------------------------------------------------------
# aten ops that run a cuBLAS routine: the first one on a thread creates that thread's handle and
# its workspace (CUBLAS_WORKSPACE_CONFIG), which lives as long as the process.
CUBLAS_OPS = frozenset("mm addmm bmm baddbmm addbmm addmv mv dot vdot _addmm_activation".split())
MIB = 2**20


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _collapsible(sizes, strides) -> bool:
    """Whether dims (outermost first) can be viewed as one (reshape without a copy)."""
    dims = [(n, s) for n, s in zip(sizes, strides) if n != 1]
    return all(dims[i][1] == dims[i + 1][1] * dims[i + 1][0] for i in range(len(dims) - 1))


def _contiguous_strides(shape) -> list[int]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.insert(0, step)
        step *= max(n, 1)
    return strides


def _fft_needs_copy(shape, strides, dims) -> bool:
    """_exec_fft permutes the batch dims first (by stride) and reshapes them into one: a copy
    unless they collapse."""
    dims = {d % len(shape) for d in dims}
    batch = sorted((d for d in range(len(shape)) if d not in dims), key=lambda d: -strides[d])
    return not _collapsible([shape[d] for d in batch], [strides[d] for d in batch])


def _batch_matrix_copied(t: torch.Tensor, transposed: bool, m: int, n: int) -> bool:
    """prepare_batch_matrix_for_cublas: whether cuBLAS gets a contiguous clone of batch matrix `t`."""
    st = t.stride()
    fast, lead = (2, 1) if transposed else (1, 2)
    if st[fast] == 1 and st[lead] >= max(1, m):
        return False
    if st[lead] == 1 and st[fast] >= max(1, n):
        return False
    return not (t.is_contiguous() and st[1] != 0 and st[2] != 0)


def _matrix_copied(t: torch.Tensor) -> bool:
    """prepare_matrix_for_cublas: whether cuBLAS gets a contiguous clone of matrix `t`."""
    import torch._prims_common as prims

    if prims.is_non_overlapping_and_dense_or_false(t):
        return False
    (s0, s1), (n0, n1) = t.stride(), t.shape
    return not ((s0 == 1 and s1 >= max(1, n0)) or (s1 == 1 and s0 >= max(1, n1)))


def _conv_bytes(x, w, y) -> tuple[int, int, int]:
    return _nbytes(x), _nbytes(w), _nbytes(y)



def cudnn_workspace(kind: str, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes of the workspace cuDNN's heuristics-chosen engine asks for (torch.backends.cudnn
    benchmark off). kind: fwd (x * w -> y), dgrad (dy * w -> dx) or wgrad (x, dy -> dw), named as for
    the convolution (x, w, y).

    Read off the H100 event logs in tests/data/gpu (bench/trace_vs_events.py lists every
    convolution with the workspace it got): the engines cuDNN 9 picks on Hopper stage the operands
    in the workspace, so it is about x + w + y bytes (bf16 and fp32/TF32 alike), except fp32 forward
    (x + w) and a transposed 2-D convolution's forward (a few MiB); the weight gradient adds split-K
    partial sums (1.5-4.1 MiB seen in bf16, 7.9-8.7 MiB in fp32; booked as 4 and 8 MiB). These are
    fits to what was seen, not cuDNN's rules: other GPUs and cuDNN versions pick other engines."""
    nx, nw, ny = _conv_bytes(x, w, y)
    half = x.dtype in (torch.float16, torch.bfloat16)
    staged = nx + nw + ny
    if x.dim() == 3:                        # 1-D convolutions (run as 2-D with height 1)
        if kind == "fwd":
            return staged + 147 if half else nx + nw + 16
        if kind == "dgrad":
            return staged + 147
        return staged + (4 if half else 8) * MIB
    # 2-D (the encoder and decoder, fp32)
    if kind == "fwd":
        return staged + 147 if x.shape[1] > 4 else nx + nw + 16
    if kind == "dgrad":
        return 6 * MIB
    return staged + 6 * MIB if x.shape[0] > 1 and x.shape[1] > 4 else 0


class CudaKernelMemory:
    """The StorageTracker op model for CUDA (see the module docstring and tracker.py)."""

    def __init__(self, cublas_workspace_bytes: int):
        self.cublas_workspace_bytes = cublas_workspace_bytes
        self.workspaces_created: list[str] = []
        self._handlers = {
            "native_dropout": self._native_dropout,
            "convolution": self._convolution,
            "convolution_backward": self._convolution_backward,
            "_fft_r2c": self._fft, "_fft_c2c": self._fft, "_fft_c2r": self._fft,
            "col2im": self._col2im, "im2col": self._im2col,
            "add": self._add,
            "_safe_softmax": self._safe_softmax,
            "_softmax": self._softmax, "_log_softmax": self._softmax,
            "_softmax_backward_data": self._softmax_backward, "_log_softmax_backward_data": self._softmax_backward,
            "bmm": self._bmm, "baddbmm": self._bmm,
            "mm": self._mm, "addmm": self._mm,
        }

    def __call__(self, func, args, kwargs, outputs, tracker):
        name = func._opname
        handler = self._handlers.get(name)
        plan = handler(func, args, kwargs, outputs) if handler is not None else None
        if name in CUBLAS_OPS:
            thread = "autograd thread" if _in_backward() else "main thread"
            if thread not in self.workspaces_created:
                self.workspaces_created.append(thread)
                # the handle is created after the output and the operand copies are allocated (the
                # GEMM call asks for it), and keeps its workspace
                plan = plan or [("out", i) for i in range(len(outputs))]
                at = next((i for i, step in enumerate(plan) if step[0] == "free"), len(plan))
                plan.insert(at, ("alloc", f"cublas workspace ({thread})", self.cublas_workspace_bytes,
                                 f"<cublas workspace: {thread}>"))
        return plan

    @staticmethod
    def _temporaries(plan, named_sizes):
        """Book kernel-local tensors: allocated in order, freed in reverse (C++ scope exit)."""
        named = [(name, n) for name, n in named_sizes if n > 0]
        plan += [("alloc", name, n, f"<{name}>") for name, n in named]
        return plan + [("free", name) for name, _ in reversed(named)]

    @staticmethod
    def _native_dropout(func, args, kwargs, outputs):
        return [("out", 1), ("out", 0)]        # dropout_cuda allocates the mask first

    @staticmethod
    def _workspace(plan, label, nbytes):
        if nbytes > 0:
            plan += [("alloc", label, nbytes, f"<{label}>"), ("free", label)]
        return plan

    def _convolution(self, func, args, kwargs, outputs):
        x, w, transposed = args[0], args[1], args[6]
        y = outputs[0]
        # a transposed convolution runs cuDNN's backward-data on its input
        ws = cudnn_workspace("dgrad", y, w, x) if transposed else cudnn_workspace("fwd", x, w, y)
        return self._workspace([("out", 0)], "cudnn workspace", ws)

    def _convolution_backward(self, func, args, kwargs, outputs):
        dy, x, w, transposed = args[0], args[1], args[2], args[7]
        plan = []
        if outputs[0] is not None:
            ws = cudnn_workspace("fwd", dy, w, x) if transposed else cudnn_workspace("dgrad", x, w, dy)
            plan.append(("out", 0))
            self._workspace(plan, "cudnn workspace", ws)
        if outputs[1] is not None:
            ws = cudnn_workspace("wgrad", dy, w, x) if transposed else cudnn_workspace("wgrad", x, w, dy)
            plan.append(("out", 1))
            self._workspace(plan, "cudnn workspace", ws)
        return plan

    @staticmethod
    def _fft(func, args, kwargs, outputs):
        """cuda/SpectralOps.cpp: c2r clones its input (cuFFT overwrites it); _exec_fft copies an
        input whose batch dims do not collapse into one."""
        x, dims = args[0], args[1]
        plan = [("out", 0)]
        temps = []
        if func._opname == "_fft_c2r":        # the transform runs on a contiguous clone
            temps.append(_nbytes(x))
            copy = _fft_needs_copy(x.shape, _contiguous_strides(x.shape), dims)
        else:
            copy = _fft_needs_copy(x.shape, x.stride(), dims)
        if copy:
            temps.append(_nbytes(x))
        for i, n in enumerate(temps):
            plan.append(("alloc", f"fft temp {i}", n, "<cufft input copy>"))
        for i in reversed(range(len(temps))):
            plan.append(("free", f"fft temp {i}"))
        return plan

    @staticmethod
    def _col2im(func, args, kwargs, outputs):
        """col2im_cuda: output = empty_like(input), resized down in place (the block keeps the
        input's size); input.contiguous() meanwhile."""
        x, y = args[0], outputs[0]
        plan = [("out", 0, max(_nbytes(x), _nbytes(y)))]
        if not x.is_contiguous():
            plan += [("alloc", "col2im input", _nbytes(x), "<contiguous input>"), ("free", "col2im input")]
        return plan

    @staticmethod
    def _im2col(func, args, kwargs, outputs):
        """im2col_cuda: output = empty_like(input), then resized up (a new block, the first freed)."""
        x, y = args[0], outputs[0]
        grows = _nbytes(y) > _nbytes(x)
        plan = [("alloc", "im2col first output", _nbytes(x), "<empty_like input>") if grows
                else ("out", 0, _nbytes(x))]
        if not x.is_contiguous():
            plan.append(("alloc", "im2col input", _nbytes(x), "<contiguous input>"))
        if grows:
            plan += [("out", 0), ("free", "im2col first output")]
        if not x.is_contiguous():
            plan.append(("free", "im2col input"))
        return plan

    @staticmethod
    def _safe_softmax(func, args, kwargs, outputs):
        """at::_safe_softmax (the math SDPA path) is composite below autograd: softmax, then
        where(all(self == -inf, dim), 0, softmax), all of it alive until the where returns."""
        x, y = args[0], outputs[0]
        rows = list(x.shape)
        rows[args[1] % x.dim()] = 1
        plan = [("alloc", "softmax", _nbytes(y), "<softmax>")]
        if not x.is_contiguous():   # host_softmax: input.contiguous()
            plan += [("alloc", "softmax input", _nbytes(x), "<softmax: contiguous input>"),
                     ("free", "softmax input")]
        plan += [("alloc", "-inf", 4, "<scalar>"),
                ("alloc", "masked", x.numel(), "<softmax: self == -inf>"),
                ("alloc", "masked rows", math.prod(rows), "<softmax: masked rows>"),
                ("alloc", "zero", y.element_size(), "<scalar>"),
                ("out", 0)]
        return plan + [("free", name) for name in ("zero", "masked rows", "masked", "-inf", "softmax")]

    def _softmax(self, func, args, kwargs, outputs):
        """softmax_cuda_out / log_softmax_cuda_out (cuda/SoftMax.cu host_softmax): the output is
        allocated first (a structured kernel), then input.contiguous() for the kernel."""
        x = args[0]
        return self._temporaries([("out", 0)], [("softmax input copy", 0 if x.is_contiguous() else _nbytes(x))])

    def _softmax_backward(self, func, args, kwargs, outputs):
        """softmax_backward_cuda_out: `Tensor tmp = grad * output;` (a full-size temporary in the
        promoted dtype, fp32 on the math SDPA path) handed to host_softmax_backward, which takes
        tmp.contiguous() and output.contiguous(); log_softmax's backward passes grad itself."""
        grad, out = args[0], args[1]
        temps = []
        if func._opname == "_softmax_backward_data":
            dtype = torch.promote_types(grad.dtype, out.dtype)
            shape = torch.broadcast_shapes(grad.shape, out.shape)
            temps.append(("softmax backward grad * output", math.prod(shape) * dtype.itemsize))
            # tmp takes grad's layout (TensorIterator): a copy when that is not contiguous
            temps.append(("softmax backward tmp copy", 0 if grad.is_contiguous() else math.prod(shape) * dtype.itemsize))
        else:
            temps.append(("log_softmax backward grad copy", 0 if grad.is_contiguous() else _nbytes(grad)))
        temps.append(("softmax backward output copy", 0 if out.is_contiguous() else _nbytes(out)))
        return self._temporaries([("out", 0)], temps)

    def _bmm(self, func, args, kwargs, outputs):
        """baddbmm_out_cuda_impl (cuda/Blas.cpp): cuBLAS's strided-batched GEMM takes each matrix with
        one unit stride and a leading dimension at least its extent; a result or operand that does
        not qualify is cloned contiguous first (the result copied back), a copy no fake tensor sees."""
        if func._opname == "bmm":
            b1, b2 = args[0], args[1]
        else:
            b1, b2 = args[1], args[2]
        result = outputs[0]
        if result.numel() == 0 or b1.shape[2] == 0:
            return [("out", 0)]
        rs, rz = result.stride(), result.shape
        temps = []
        if rs[1] == 1 and (rz[2] == 1 or rs[2] >= max(1, rz[1])):
            transposed = False
        elif rs[2] == 1 and (rz[1] == 1 or rs[1] >= max(1, rz[2])):
            transposed = True
        else:
            transposed = False
            temps.append(("bmm result copy", _nbytes(result)))
        lead = 1 if transposed else 2
        m, n = rz[2 if transposed else 1], rz[lead]
        k = (b2 if transposed else b1).shape[lead]
        first, second = (b2, b1) if transposed else (b1, b2)
        temps.append(("bmm operand copy 1", _nbytes(first) if _batch_matrix_copied(first, transposed, m, k) else 0))
        temps.append(("bmm operand copy 2", _nbytes(second) if _batch_matrix_copied(second, transposed, k, n) else 0))
        return self._temporaries([("out", 0)], temps)

    def _mm(self, func, args, kwargs, outputs):
        """addmm_out_cuda_impl / cublasCommonArgs (cuda/Blas.cpp): an operand that is neither dense
        nor a matrix with one unit stride is cloned contiguous; with a contiguous result the GEMM
        runs transposed, so mat2 is prepared first."""
        mat1, mat2 = (args[0], args[1]) if func._opname == "mm" else (args[1], args[2])
        first, second = (mat2, mat1) if outputs[0].is_contiguous() else (mat1, mat2)
        temps = [(f"mm operand copy {i}", _nbytes(t) if _matrix_copied(t) else 0)
                 for i, t in enumerate((first, second), 1)]
        return self._temporaries([("out", 0)], temps)

    @staticmethod
    def _add(func, args, kwargs, outputs):
        """autograd's InputBuffer sums two gradients for one input in place (old.add_(new)) when it
        holds the last reference to a dense `old`; for a fake tensor it never does. The tracker
        books the sum in old's block when old is freed right after the add."""
        if (func._overloadname != "Tensor" or torch.is_grad_enabled() or not _in_backward()
                or kwargs.get("alpha", 1) != 1 or len(args) != 2):
            return None
        old, new = args
        if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)) or old.shape != new.shape \
                or old.dtype != new.dtype or outputs[0].shape != old.shape:
            return None
        import torch._prims_common as prims
        if not prims.is_non_overlapping_and_dense_or_false(old):
            return None
        # autograd also needs the last reference to old's storage: here one more is counted, that
        # of the Python storage object this query makes
        if torch._C._storage_Use_Count(old.untyped_storage()._cdata) > 2:
            return None
        return [("accumulate", 0, old)]
