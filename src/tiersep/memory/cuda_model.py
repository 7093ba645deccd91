"""Make a CPU fake-tensor trace allocate what a CUDA run would: autocast dtypes and SDPA kernels.

Fake CUDA tensors cannot run autograd without a GPU (the engine initialises the device), so the
trace runs on fake CPU tensors and this TorchFunctionMode (above autograd, so autograd saves what it
would save on CUDA) corrects the two places where CPU and CUDA differ in memory:

1. Autocast. CPU and CUDA autocast have different op lists (e.g. CUDA runs group_norm, softmax,
   sum, pow, exp and the losses in fp32; CPU autocasts stft and cat and leaves group_norm alone).
   The trace keeps CPU autocast on as the *state* (so `torch.autocast(x.device.type, enabled=False)`
   in the model still opts out) but applies CUDA's *policy*: each call in an autocast region has its
   floating tensors cast per CUDA's list below, then runs with CPU autocast off. Every op with an
   AutocastCUDA kernel in this torch build must be in one of the lists (tests check it), so a torch
   upgrade that adds an op is caught rather than silently mis-modelled.

2. dropout: CUDA runs the fused native_dropout (output plus a bool mask for backward); CPU
   multiplies by a noise tensor of the input's dtype. nn.Dropout and F.dropout calls are modelled
   with native_dropout.

3. scaled_dot_product_attention. CUDA picks a fused kernel (flash for fp16/bf16, memory-efficient
   for fp32; cuDNN attention on some Hopper builds, which keeps the same O(L) state as flash) where
   CPU may take the math path (always when dropout > 0). The call is replaced by a kernel model:
   fused kernels allocate their output and an fp32 logsumexp of O(L) (flash pads the head dim to a
   multiple of 8 with copies), and in backward dq/dk/dv plus their fp32 scratch; math materialises
   the B*H*L*L scores in fp32 (torch's math path upcasts fp16/bf16) with CUDA's fused dropout
   (bool mask) rather than CPU's float noise tensor.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map
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


# ------------------------------------------------------------------------------------------------
# SDPA kernel models
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


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class _FusedAttention(torch.autograd.Function):
    """Memory model of a fused SDPA kernel (values are not computed: the trace only needs sizes)."""

    @staticmethod
    def forward(ctx, q, k, v, kind: str):
        B, H, L, D = q.shape
        Dv = v.shape[-1]
        if kind == "flash" and D % 8:
            # at::scaled_dot_product_attention pads the head dim to a multiple of 8 for flash
            pad = _round_up(D, 8) - D
            q, k, v = (F.pad(t, (0, pad)) for t in (q, k, v))
        # Both kernels write the output as [B, L, H, D] and hand it back transposed.
        out = q.new_empty(B, L, H, v.shape[-1]).transpose(1, 2)
        lse_len = L if kind == "flash" else _round_up(L, 32)
        lse = q.new_empty(B, H, lse_len, dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kind, ctx.head_dims = kind, (D, Dv)
        return out[..., :Dv]

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        B, H, L, Dp = q.shape
        D, Dv = ctx.head_dims
        if ctx.kind == "flash":
            if grad_out.shape[-1] != out.shape[-1]:
                grad_out = F.pad(grad_out, (0, out.shape[-1] - grad_out.shape[-1]))
            # FA2 backward: fp32 dq accumulator and softmax row sums, rows rounded to 128
            scratch = [q.new_empty(B, _round_up(L, 128), H, _round_up(Dp, 32), dtype=torch.float32),
                       q.new_empty(B, H, _round_up(L, 128), dtype=torch.float32)]
        else:
            # cutlass memory-efficient backward: delta = rowsum(dO * O) and an fp32 grad_q accumulator
            scratch = [q.new_empty(B, H, _round_up(L, 32), dtype=torch.float32),
                       q.new_empty(B, H, L, Dp, dtype=torch.float32)]
        dq = q.new_empty(B, L, H, Dp).transpose(1, 2)
        dk = k.new_empty(B, k.shape[2], H, Dp).transpose(1, 2)
        dv = v.new_empty(B, v.shape[2], H, v.shape[-1]).transpose(1, 2)
        del scratch
        return dq[..., :D], dk[..., :D], dv[..., :Dv], None


def math_attention_cuda(q, k, v, dropout_p: float, scale: float | None):
    """at::_scaled_dot_product_attention_math as it runs on CUDA (fused native_dropout)."""
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
        def cast(t):
            if not _eligible(t):
                return t
            dtype = dtype_for(t)
            if t.dtype == dtype:
                return t
            if t.is_leaf and t.requires_grad:
                cached = self._cast_cache.get(t)
                if cached is None or cached.dtype != dtype:
                    cached = self._cast_cache[t] = t.to(dtype)
                return cached
            return t.to(dtype)
        with torch.autocast("cpu", enabled=False):
            return tree_map(cast, args), tree_map(cast, kwargs)

    def _sdpa(self, target, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
              scale=None, enable_gqa=False):
        with torch.autocast("cpu", enabled=False):
            if target is not None:     # SDPA is on CUDA's lower-precision list
                query, key, value = (self._cast((t,), {}, lambda _: target)[0][0] for t in (query, key, value))
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
            out = _FusedAttention.apply(query, key, value, kind)
            return out.reshape(*lead, *out.shape[-2:])


def _tensors(args, kwargs):
    out = []
    tree_map(lambda t: out.append(t) if isinstance(t, torch.Tensor) else None, (args, kwargs))
    return out
