"""TF-Locoformer (Saijo, Wichern, Germain, Pan, Le Roux; IWAENC 2024) for multi-channel,
multi-source separation.

Follows the reference separator (merlresearch/tf-locoformer) layer for layer, generalised from mono
speech to C audio channels and n_src sources: the C channels' real and imaginary STFT parts are the
encoder's 2C input channels, and the decoder predicts 2C channels per source.

    mixture [B, C, S] --STFT--> [B, 2C, T, F] --Conv2d 3x3 + GroupNorm(1)--> [B, E, T, F]
        --N x (frequency path over F, then time path over T)-->
        --ConvTranspose2d 3x3--> [B, n_src * 2 * C, T, F] --iSTFT--> [B, n_src, C, S]

Each path, on sequences of one axis (macaron, no 1/2 factor, as the reference code):
    x = x + SwiGLUConvDeconv(RMSGroupNorm(x))
    x = x + MHSA_with_RoPE(RMSGroupNorm(x))
    x = x + SwiGLUConvDeconv(RMSGroupNorm(x))

Precision: under bf16 autocast the linear layers and convolutions of the blocks run in bf16, while
the STFT/iSTFT, encoder, decoder, norms and RoPE run in fp32 (autocast off locally), and the residual
stream stays fp32. Everything avoids data-dependent control flow so the memory estimator can trace a
training step on fake tensors, and torch.compile captures the forward as one graph (fullgraph=True,
checkpointing included): no complex arithmetic outside the FFT calls, which inductor cannot
generate code for (see tiersep.model.compile for the trainer's entry point).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from .stft import istft_from_parts, make_window, stft

# The `model.attention_backend` setting -> SDPA kernels allowed (None: torch chooses).
SDPA_BACKENDS = {
    "auto": None,
    "flash": [SDPBackend.FLASH_ATTENTION],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    "math": [SDPBackend.MATH],
}
# Keeps the scale of a silent mixture finite when it is divided by its standard deviation.
NORMALIZE_FLOOR = 1e-8


def fp32_region(x: Tensor):
    """Autocast off for the enclosed ops (norms, RoPE, STFT, encoder, decoder stay in fp32)."""
    return torch.autocast(x.device.type, enabled=False)


# ----------------------------------------------------------------------------------------------
# normalisation and feed-forward


class RMSGroupNorm(nn.Module):
    """RMS-normalise the channels of each TF bin in `groups` groups; learnable gain, no bias; fp32.

    As the reference: x / (rms + eps), with rms = ||x_group||_2 / sqrt(group size).
    """

    def __init__(self, dim: int, groups: int, eps: float):
        super().__init__()
        if dim % groups:
            raise ValueError(f"model.norm_groups: {groups} does not divide model.emb_dim {dim}")
        self.groups, self.eps = groups, eps
        self.gain = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:  # x [..., E]
        with fp32_region(x):
            grouped = x.float().unflatten(-1, (self.groups, -1))  # [..., G, E/G]
            rms = grouped.norm(dim=-1, keepdim=True) * grouped.shape[-1] ** -0.5  # [..., G, 1]
            return (grouped / (rms + self.eps)).flatten(-2) * self.gain  # [..., E]


class SwiGLUConvDeconv(nn.Module):
    """SwiGLU feed-forward with local context: Conv1d(E -> 2H, k, s), value * SiLU(gate),
    ConvTranspose1d(H -> E, k, s), along the sequence axis; length kept by pad-and-crop."""

    def __init__(self, dim: int, hidden: int, kernel: int, stride: int, dropout: float):
        super().__init__()
        if kernel < stride:
            raise ValueError(f"model.conv_kernel: {kernel} is smaller than model.conv_stride {stride}")
        self.conv = nn.Conv1d(dim, 2 * hidden, kernel, stride=stride)
        self.deconv = nn.ConvTranspose1d(hidden, dim, kernel, stride=stride)
        self.dropout = nn.Dropout(dropout)
        self.kernel, self.stride, self.overlap = kernel, stride, kernel - stride

    def forward(self, x: Tensor) -> Tensor:  # x [B, S1, S2, E], sequences along S2
        b, s1, s2, e = x.shape
        x = x.reshape(b * s1, s2, e).transpose(1, 2)  # [N, E, L]
        # Pad `overlap` in front and enough behind that the strided conv covers every position
        # and the deconv returns at least overlap + L samples.
        # (integer ceil division: exact, and symbolic lengths under torch.compile stay integers)
        padded = -(-(s2 + 2 * self.overlap - self.kernel) // self.stride) * self.stride + self.kernel
        x = F.pad(x, (self.overlap, padded - s2 - self.overlap))  # [N, E, L_pad]
        value, gate = self.conv(x).chunk(2, dim=1)  # [N, H, L_conv] each
        x = self.dropout(value * F.silu(gate))
        x = self.deconv(x)  # [N, E, >= overlap + L]
        x = x[..., self.overlap:self.overlap + s2].transpose(1, 2)  # [N, L, E]
        return self.dropout(x).reshape(b, s1, s2, e)


# ----------------------------------------------------------------------------------------------
# attention


class RotaryEmbedding(nn.Module):
    """RoPE on interleaved pairs (x0, x1), (x2, x3), ... as rotary-embedding-torch does, in fp32.

    Each pair is turned by the angle position * frequency with real arithmetic
    (x0 cos - x1 sin, x0 sin + x1 cos): the same values as one complex multiply, but without
    complex tensors, which torch.compile's inductor cannot generate code for. Stateless: angles
    are recomputed from positions, so nothing device- or length-bound is stored.
    """

    def __init__(self, head_dim: int, base: float):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"model.attention_dim / model.n_heads = {head_dim}: must be even for RoPE")
        self.head_dim, self.base = head_dim, base

    def forward(self, x: Tensor, seq_dim: int = -2) -> Tensor:  # x [..., L, (heads...,) d]
        """Turn x, whose positions run along `seq_dim` (counted from the end, -2 or below)."""
        with fp32_region(x):
            length, device = x.shape[seq_dim], x.device
            exponent = torch.arange(0, self.head_dim, 2, device=device).float() / self.head_dim
            inv_freq = self.base ** -exponent  # [d/2]
            angles = torch.arange(length, device=device).float()[:, None] * inv_freq  # [L, d/2]
            angles = angles.reshape(length, *[1] * (-seq_dim - 2), -1)  # lined up with x's axes
            cos, sin = angles.cos(), angles.sin()
            even, odd = x.float().unflatten(-1, (-1, 2)).unbind(-1)  # [..., d/2] each
            turned = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
            return turned.flatten(-2).to(x.dtype)  # x's shape, contiguous


def attend(q: Tensor, k: Tensor, v: Tensor, dropout_p: float, backend: str, chunk: int) -> Tensor:
    """SDPA with the kernel(s) `backend` names, over at most `chunk` sequences per call.

    q, k, v [N, H, L, d] -> [N, H, L, d]. Fused CUDA kernels cap the sequence batch (launch grid),
    so N > chunk is split rather than left to fail or fall back. A kernel that cannot run these
    inputs is an error naming the setting, never a silent switch to the O(L^2) math path.
    """
    kernels = SDPA_BACKENDS[backend]
    with sdpa_kernel(kernels) if kernels else contextlib.nullcontext():
        try:
            if q.shape[0] <= chunk:
                return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
            return torch.cat([
                F.scaled_dot_product_attention(qc, kc, vc, dropout_p=dropout_p)
                for qc, kc, vc in zip(q.split(chunk), k.split(chunk), v.split(chunk))
            ])
        except torch.OutOfMemoryError:
            raise        # out of memory is not a missing kernel: the trainer's OOM handling must see it
        except RuntimeError as err:
            if kernels is None:
                raise
            raise RuntimeError(
                f"model.attention_backend={backend!r}: scaled_dot_product_attention has no {backend} "
                f"kernel for these inputs (device {q.device.type}, dtype {q.dtype}, head size "
                f"{q.shape[-1]}, dropout {dropout_p}); choose another backend, or 'auto' to let torch "
                f"pick (torch said: {str(err).strip().splitlines()[0]})"
            ) from err


class MultiHeadSelfAttention(nn.Module):
    """q, k, v from one bias-free Linear(E, 3A); RoPE on q and k; SDPA; bias-free Linear(A, E)."""

    def __init__(self, dim: int, attention_dim: int, n_heads: int, dropout: float, rope_base: float,
                 backend: str, chunk: int):
        super().__init__()
        if attention_dim % n_heads:
            raise ValueError(f"model.attention_dim: {attention_dim} is not divisible by "
                             f"model.n_heads {n_heads}")
        if backend not in SDPA_BACKENDS:
            raise ValueError(f"model.attention_backend: {backend!r} (allowed: {', '.join(SDPA_BACKENDS)})")
        self.n_heads, self.dropout, self.backend, self.chunk = n_heads, dropout, backend, chunk
        self.to_qkv = nn.Linear(dim, 3 * attention_dim, bias=False)
        self.rope = RotaryEmbedding(attention_dim // n_heads, rope_base)
        self.to_out = nn.Linear(attention_dim, dim, bias=False)
        self.out_dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:  # x [N, L, E]
        n, length, _ = x.shape
        qkv = self.to_qkv(x).reshape(n, length, 3, self.n_heads, -1)  # [N, L, 3, H, d]
        q, k, v = qkv.unbind(2)  # [N, L, H, d] each
        # RoPE before moving the heads forward: q and k come out laid out [N, L, H, d] in memory,
        # as v is, so SDPA's fused kernels take all three without copying (and saving) any.
        q, k = self.rope(q, seq_dim=-3), self.rope(k, seq_dim=-3)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [N, H, L, d] each
        out = attend(q, k, v, self.dropout if self.training else 0.0, self.backend, self.chunk)
        out = out.transpose(1, 2).reshape(n, length, -1)  # [N, L, A]
        return self.out_dropout(self.to_out(out))  # [N, L, E]


# ----------------------------------------------------------------------------------------------
# blocks


class LocoformerPath(nn.Module):
    """Macaron path over the sequences along axis 2 of [B, S1, S2, E] (batch B*S1, length S2)."""

    def __init__(self, dim: int, attention_dim: int, n_heads: int, ffn_hidden: int, kernel: int,
                 stride: int, groups: int, dropout: float, eps: float, rope_base: float,
                 backend: str, chunk: int):
        super().__init__()
        self.norm_ffn_pre = RMSGroupNorm(dim, groups, eps)
        self.ffn_pre = SwiGLUConvDeconv(dim, ffn_hidden, kernel, stride, dropout)
        self.norm_attn = RMSGroupNorm(dim, groups, eps)
        self.attn = MultiHeadSelfAttention(dim, attention_dim, n_heads, dropout, rope_base, backend, chunk)
        self.norm_ffn_post = RMSGroupNorm(dim, groups, eps)
        self.ffn_post = SwiGLUConvDeconv(dim, ffn_hidden, kernel, stride, dropout)

    def forward(self, x: Tensor) -> Tensor:  # x [B, S1, S2, E]
        b, s1, s2, e = x.shape
        x = x + self.ffn_pre(self.norm_ffn_pre(x))
        x = x + self.attn(self.norm_attn(x).reshape(b * s1, s2, e)).reshape(b, s1, s2, e)
        x = x + self.ffn_post(self.norm_ffn_post(x))
        return x


class TFLocoformerBlock(nn.Module):
    """Frequency path (sequences over F) then time path (sequences over T)."""

    def __init__(self, **path_kwargs):
        super().__init__()
        self.freq_path = LocoformerPath(**path_kwargs)
        self.time_path = LocoformerPath(**path_kwargs)

    def forward(self, x: Tensor) -> Tensor:  # x [B, T, F, E]
        x = self.freq_path(x)  # sequences of length F, batch B*T
        x = self.time_path(x.transpose(1, 2))  # [B, F, T, E]: sequences of length T, batch B*F
        return x.transpose(1, 2)  # [B, T, F, E]


# ----------------------------------------------------------------------------------------------
# the model


class TFLocoformer(nn.Module):
    """mixture [B, C, S] -> source waveforms [B, n_src, C, S] (float32, same length)."""

    def __init__(self, *, n_sources: int = 4, channels: int = 2, n_fft: int = 2048, hop: int = 512,
                 window: str = "hann", n_layers: int = 4, emb_dim: int = 96, attention_dim: int = 96,
                 n_heads: int = 4, ffn_hidden: int = 384, conv_kernel: int = 4, conv_stride: int = 1,
                 norm_groups: int = 4, dropout: float = 0.1, rope_base: float = 10000.0,
                 eps: float = 1e-5, attention_backend: str = "auto", attention_chunk: int = 16384,
                 checkpointing: bool = False, normalize_input: bool = True):
        super().__init__()
        make_window(window, 8)  # fail early on an unknown window name
        self.n_sources, self.channels = n_sources, channels
        self.n_fft, self.hop, self.window = n_fft, hop, window
        self.checkpointing, self.normalize_input = checkpointing, normalize_input
        # With checkpointing: a context-manager factory entered around each block's forward and
        # its recomputation (the CPU trainer's heap trim, tiersep.malloc.trimmed_heap); None: none
        self.checkpoint_context = None

        self.encoder = nn.Sequential(
            nn.Conv2d(2 * channels, emb_dim, 3, padding=1),
            nn.GroupNorm(1, emb_dim, eps=eps),
        )
        self.blocks = nn.ModuleList([
            TFLocoformerBlock(dim=emb_dim, attention_dim=attention_dim, n_heads=n_heads,
                              ffn_hidden=ffn_hidden, kernel=conv_kernel, stride=conv_stride,
                              groups=norm_groups, dropout=dropout, eps=eps, rope_base=rope_base,
                              backend=attention_backend, chunk=attention_chunk)
            for _ in range(n_layers)
        ])
        self.decoder = nn.ConvTranspose2d(emb_dim, 2 * channels * n_sources, 3, padding=1)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The reference recipe's init (ESPnet `init: xavier_uniform`): Xavier-uniform weights,
        zero biases, GroupNorm at its defaults, RMSGroupNorm gains at one."""
        for name, param in self.named_parameters():
            if param.dim() > 1:
                nn.init.xavier_uniform_(param)
            elif name.endswith("bias"):
                nn.init.zeros_(param)
        self.encoder[1].reset_parameters()

    @property
    def attention_backend(self) -> str:
        """The SDPA kernel setting every attention layer uses (auto, flash, efficient, math)."""
        return self.blocks[0].freq_path.attn.backend if len(self.blocks) else "auto"

    @attention_backend.setter
    def attention_backend(self, backend: str) -> None:
        if backend not in SDPA_BACKENDS:
            raise ValueError(f"model.attention_backend: {backend!r} (allowed: {', '.join(SDPA_BACKENDS)})")
        for module in self.modules():
            if isinstance(module, MultiHeadSelfAttention):
                module.backend = backend

    def forward(self, mixture: Tensor) -> Tensor:  # mixture [B, C, S]
        if mixture.dim() != 3 or mixture.shape[1] != self.channels:
            raise ValueError(f"TFLocoformer expects a mixture [batch, {self.channels} channels, samples], "
                             f"got shape {tuple(mixture.shape)}")
        b, c, length = mixture.shape
        if length <= self.n_fft // 2:  # the centred STFT reflects n_fft/2 samples at each end
            raise ValueError(f"TFLocoformer: a mixture of {length} samples is too short for n_fft "
                             f"{self.n_fft} (needs more than {self.n_fft // 2})")
        with fp32_region(mixture):
            mixture = mixture.float()
            scale = None
            if self.normalize_input:  # the reference recipe's normalize_variance
                scale = mixture.std(dim=(1, 2), keepdim=True).clamp_min(NORMALIZE_FLOOR)  # [B, 1, 1]
                mixture = mixture / scale
            window = make_window(self.window, self.n_fft, device=mixture.device)
            spec = stft(mixture, self.n_fft, self.hop, window)  # [B, C, F, T] complex
            n_freq, n_frames = spec.shape[-2:]
            x = torch.view_as_real(spec).permute(0, 4, 1, 3, 2)  # [B, 2 (re, im), C, T, F]
            x = self.encoder(x.reshape(b, 2 * c, n_frames, n_freq))  # [B, E, T, F]

        x = x.movedim(1, -1)  # [B, T, F, E]
        for block in self.blocks:
            if self.checkpointing and torch.is_grad_enabled():
                context = self.checkpoint_context
                contexts = {"context_fn": lambda: (context(), context())} if context else {}
                x = checkpoint(block, x, use_reentrant=False, **contexts)
            else:
                x = block(x)
        x = x.movedim(-1, 1)  # [B, E, T, F]

        with fp32_region(x):
            x = self.decoder(x.float())  # [B, n_src * 2 * C, T, F]
            x = x.reshape(b, self.n_sources, 2, c, n_frames, n_freq)
            parts = x.permute(0, 1, 3, 4, 5, 2)  # [B, n_src, C, T, F, 2 (re, im)]
            estimates = istft_from_parts(parts, self.n_fft, self.hop, window, length)  # [B, n_src, C, S]
            if scale is not None:
                estimates = estimates * scale[:, None]  # [B, 1, 1, 1] broadcast
        return estimates


def build_model(preset: dict) -> TFLocoformer:
    """The model a (validated, default-filled) preset describes, fp32 parameters on the CPU."""
    audio, m = preset["audio"], preset["model"]
    return TFLocoformer(
        n_sources=len(m["sources"]), channels=audio["channels"], n_fft=audio["n_fft"],
        hop=audio["hop"], window=audio["window"], n_layers=m["n_layers"], emb_dim=m["emb_dim"],
        attention_dim=m["attention_dim"], n_heads=m["n_heads"], ffn_hidden=m["ffn_hidden"],
        conv_kernel=m["conv_kernel"], conv_stride=m["conv_stride"], norm_groups=m["norm_groups"],
        dropout=m["dropout"], rope_base=m["rope_base"], eps=m["eps"],
        attention_backend=m["attention_backend"], attention_chunk=m["attention_chunk"],
        checkpointing=m["checkpointing"], normalize_input=m["normalize_input"],
    )


def count_parameters(model: nn.Module) -> int:
    """Number of parameters (shared ones once)."""
    return sum(p.numel() for p in model.parameters())
