"""CUDA's autocast policy by aten op name, for a trace that runs on the CPU (emulation.py applies it).

CPU and CUDA autocast have different op lists (e.g. CUDA runs group_norm, softmax, sum, pow, exp and
the losses in fp32; CPU autocasts stft and cat and leaves group_norm alone). Every op with an
AutocastCUDA kernel in this torch build must be in one of the lists (tests check it), so a torch
upgrade that adds an op is caught rather than silently mis-modelled.
"""
from __future__ import annotations

import torch

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


def eligible(t) -> bool:
    """A tensor autocast may cast: floating, not float64."""
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
