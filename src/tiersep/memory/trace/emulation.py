"""Make a CPU fake-tensor trace allocate what a CUDA run allocates, above autograd.

Fake CUDA tensors cannot run autograd without a GPU (the engine initialises the device), so the
trace runs on fake CPU tensors. Two layers correct where CPU and CUDA differ in memory: this one,
above autograd, and the kernels' own memory below it (kernels.py).

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
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.weak import WeakIdKeyDictionary

from .attention import auto_kernel, choose_cuda_backend, fused_attention, math_attention_cuda
from .cuda_autocast import eligible, policy_of
from .kernels import in_backward


def _modelled_gpu_has_bf16(*args, **kwargs) -> bool:
    return True


class CudaEmulation(TorchFunctionMode):
    """Apply CUDA's autocast policy and SDPA kernel choice to a CPU trace (see module docstring)."""

    def __init__(self, attention_backend: str = "auto"):
        super().__init__()
        self.requested_backend = attention_backend
        self.kernels_used: dict[str, int] = {}
        self.unmodelled: set[str] = set()
        self._cast_cache = WeakIdKeyDictionary()   # autocast caches casts of leaf parameters
        self._asked = []

    def __enter__(self):
        # torch.autocast("cuda", bf16) asks the GPU whether it has bf16, and asking starts a CUDA
        # context (0.6 GiB on an H200, bench/gpu_search_check.py) in the process that estimates: the
        # search's orchestrator, or a job before it leases its GPU. The trace answers for the GPU it
        # models, an sm80+ one, which has it.
        self._asked.append(torch.cuda.is_bf16_supported)     # a list: the mode is entered nested
        torch.cuda.is_bf16_supported = _modelled_gpu_has_bf16
        return super().__enter__()

    def __exit__(self, *exc):
        torch.cuda.is_bf16_supported = self._asked.pop()
        return super().__exit__(*exc)

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
            if "dtype" not in kwargs and any(eligible(t) and t.dtype != torch.float32
                                             for t in _tensors(args, kwargs)):
                kwargs = dict(kwargs, dtype=torch.float32)
        elif policy == "promote":
            widest = max((t.dtype for t in _tensors(args, kwargs) if eligible(t)),
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
        cache = None if in_backward() else self._cast_cache

        def cast(t):
            if not eligible(t):
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
            masked = attn_mask is not None or is_causal
            kind = (auto_kernel(query.dtype, query.shape[-1], value_dim=value.shape[-1], has_mask=masked)
                    if self.requested_backend == "auto" else
                    choose_cuda_backend(self.requested_backend, query.dtype, query.shape[-1], masked))
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
