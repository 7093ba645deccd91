"""TF-Locoformer: shapes, the paper's parameter counts, STFT round trip, attention backends and
chunking, checkpointing, bf16 autocast, fake-tensor tracing, the loss, and a one-batch overfit.

Everything runs on the CPU with tiny dimensions (the paper-size models are only constructed).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend, sdpa_kernel

from tiersep.config import validate
from tiersep.model import TFLocoformer, build_loss, build_model, count_parameters
from tiersep.model.loss import SeparationLoss, default_resolutions
from tiersep.model.stft import istft, make_window, stft
from tiersep.model.tflocoformer import RMSGroupNorm, RotaryEmbedding, attend


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Every test here on one torch thread (see conftest.one_torch_thread)."""


def tiny_preset(**model) -> dict:
    raw = {
        "name": "tiny",
        "audio": {"sample_rate": 8000, "channels": 2, "segment_samples": 1024, "n_fft": 64, "hop": 32},
        "model": {"n_layers": 1, "emb_dim": 8, "attention_dim": 8, "n_heads": 2, "ffn_hidden": 16,
                  "norm_groups": 4, "dropout": 0.0, **model},
        "train": {"precision": "fp32"},
    }
    return validate(raw, "preset.schema.yaml", "tiny test preset")


def tiny_model(**kwargs) -> TFLocoformer:
    args = dict(n_sources=4, channels=2, n_fft=64, hop=32, n_layers=1, emb_dim=8, attention_dim=8,
                n_heads=2, ffn_hidden=16, norm_groups=4, dropout=0.0)
    args.update(kwargs)
    torch.manual_seed(0)
    return TFLocoformer(**args)


def paper_model(n_layers, emb_dim, ffn_hidden, kernel) -> TFLocoformer:
    """The paper's mono 2-speaker speech configuration (attention dim = emb dim, 4 heads)."""
    return TFLocoformer(n_sources=2, channels=1, n_fft=256, hop=64, n_layers=n_layers, emb_dim=emb_dim,
                        attention_dim=emb_dim, n_heads=4, ffn_hidden=ffn_hidden, conv_kernel=kernel,
                        conv_stride=1, norm_groups=4, dropout=0.0)


def expected_parameters(n_layers, emb, attn, ffn, kernel, channels, n_sources) -> int:
    """Closed-form count of the architecture as described, independent of the module code."""
    encoder = 2 * channels * emb * 9 + emb + 2 * emb          # Conv2d 3x3 + GroupNorm(1, emb)
    swiglu = emb * 2 * ffn * kernel + 2 * ffn + ffn * emb * kernel + emb
    attention = emb * 3 * attn + attn * emb                   # bias-free qkv and output
    path = 3 * emb + 2 * swiglu + attention                   # 3 RMSGroupNorm gains
    decoder = emb * 2 * channels * n_sources * 9 + 2 * channels * n_sources
    return encoder + n_layers * 2 * path + decoder


# ----------------------------------------------------------------------------------------------
# shapes and sizes


@pytest.mark.parametrize("channels, n_sources, length", [(2, 4, 1024), (1, 2, 1000), (2, 4, 777)])
def test_output_shape_and_length(channels, n_sources, length):
    model = tiny_model(channels=channels, n_sources=n_sources)
    mixture = torch.randn(3, channels, length)
    out = model(mixture)
    assert out.shape == (3, n_sources, channels, length)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


def test_build_model_follows_the_preset():
    preset = tiny_preset(emb_dim=12, attention_dim=16, n_heads=4, ffn_hidden=20, conv_kernel=3)
    model = build_model(preset)
    assert model.encoder[0].in_channels == 4 and model.decoder.out_channels == 16
    assert model.attention_backend == "auto" and len(model.blocks) == 1
    assert count_parameters(model) == expected_parameters(1, 12, 16, 20, 3, channels=2, n_sources=4)
    out = model(torch.randn(1, 2, 1024))
    assert out.shape == (1, 4, 2, 1024)


def test_wrong_channel_count_is_a_clear_error():
    with pytest.raises(ValueError, match="2 channels"):
        tiny_model()(torch.randn(1, 1, 1024))
    with pytest.raises(ValueError, match="too short for n_fft 64"):
        tiny_model()(torch.randn(1, 2, 32))


@pytest.mark.parametrize("name, layers, emb, ffn, kernel, paper_millions", [
    ("M", 6, 128, 384, 4, 15.0),
    # The paper's tables give S as 5.0M; the reference code's WHAMR! small config builds 5.03M.
    ("S", 4, 96, 128, 8, 5.0),
])
def test_paper_speech_configs_parameter_counts(name, layers, emb, ffn, kernel, paper_millions):
    count = count_parameters(paper_model(layers, emb, ffn, kernel))
    assert count == expected_parameters(layers, emb, emb, ffn, kernel, channels=1, n_sources=2)
    assert abs(count / (paper_millions * 1e6) - 1) < 0.01, f"{name}: {count:,} parameters"


# ----------------------------------------------------------------------------------------------
# building blocks against their definitions


@pytest.mark.parametrize("window", ["hann", "sqrt_hann", "hamming"])
@pytest.mark.parametrize("n_fft, hop, length", [(64, 16, 1000), (256, 128, 4001)])
def test_istft_inverts_stft_and_matches_torch(window, n_fft, hop, length):
    signal = torch.randn(2, 3, length)
    win = make_window(window, n_fft)
    spec = stft(signal, n_fft, hop, win)
    assert spec.shape == (2, 3, n_fft // 2 + 1, 1 + length // hop)
    back = istft(spec, n_fft, hop, win, length)
    assert torch.allclose(back, signal, atol=1e-5)
    reference = torch.istft(spec.reshape(6, *spec.shape[-2:]), n_fft, hop, window=win, length=length)
    assert torch.allclose(back.reshape(6, length), reference, atol=1e-5)


def test_rope_matches_rotate_half_formulation():
    rope = RotaryEmbedding(8, 10000.0)
    x = torch.randn(3, 2, 11, 8)
    position = torch.arange(11.0)[:, None]
    freq = 10000.0 ** (-torch.arange(0, 8, 2) / 8)
    angle = (position * freq).repeat_interleave(2, dim=-1)  # [L, d]: f0 f0 f1 f1 ...
    half = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)  # (-x1, x0, -x3, x2, ...)
    expected = x * angle.cos() + half * angle.sin()
    assert torch.allclose(rope(x), expected, atol=1e-5)
    # relative positions only: scores between rotated q and k depend on the offset
    q, k = torch.randn(1, 1, 1, 8).expand(1, 1, 11, 8), torch.randn(1, 1, 1, 8).expand(1, 1, 11, 8)
    scores = rope(q) @ rope(k).transpose(-1, -2)  # [1, 1, L, L]
    assert torch.allclose(scores[0, 0, 0, 3], scores[0, 0, 5, 8], atol=1e-5)


def complex_rope(x, head_dim, base):
    """The complex-number RoPE the model used before (kept here only as a reference)."""
    exponent = torch.arange(0, head_dim, 2).float() / head_dim
    angles = torch.arange(x.shape[-2]).float()[:, None] * base ** -exponent  # [L, d/2]
    turn = torch.polar(torch.ones_like(angles), angles)
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * turn).flatten(-2).to(x.dtype)


@pytest.mark.parametrize("head_dim, length, base", [(8, 11, 10000.0), (64, 2049, 10000.0), (16, 700, 500.0)])
def test_real_rope_equals_the_complex_formula(head_dim, length, base):
    x = torch.randn(3, 2, length, head_dim)
    real, reference = RotaryEmbedding(head_dim, base)(x), complex_rope(x, head_dim, base)
    assert not torch.equal(real, x)  # it did turn the pairs
    assert (real - reference).abs().max() <= 1e-6 * reference.abs().max()
    # a bf16 input is turned in fp32 and handed back in bf16: at most a bf16 rounding apart
    half = RotaryEmbedding(head_dim, base)(x.bfloat16())
    assert half.dtype == torch.bfloat16
    assert (half.float() - complex_rope(x.bfloat16(), head_dim, base).float()).abs().max() \
        <= 2 ** -7 * reference.abs().max()


def test_rope_along_an_inner_axis():
    """Attention turns q and k while still [N, L, H, d] (positions on axis -3), so that they stay
    laid out like v in memory; same values as turning the [N, H, L, d] transpose."""
    rope = RotaryEmbedding(8, 10000.0)
    x = torch.randn(3, 11, 2, 8)  # [N, L, H, d]
    inner = rope(x, seq_dim=-3)
    assert torch.equal(inner, rope(x.transpose(1, 2)).transpose(1, 2))
    assert inner.is_contiguous() and not torch.equal(inner, x)


def test_rms_group_norm_definition():
    norm = RMSGroupNorm(8, 2, eps=1e-5)
    with torch.no_grad():
        norm.gain.copy_(torch.arange(1.0, 9.0))
    x = torch.randn(5, 8)
    groups = x.view(5, 2, 4)
    rms = groups.pow(2).mean(-1, keepdim=True).sqrt()
    expected = (groups / (rms + 1e-5)).view(5, 8) * torch.arange(1.0, 9.0)
    assert torch.allclose(norm(x), expected, atol=1e-6)
    assert norm(x.bfloat16()).dtype == torch.float32  # computed in fp32 whatever comes in


def test_input_normalisation_makes_the_model_scale_equivariant():
    model = tiny_model().eval()
    mixture = torch.randn(2, 2, 1024)
    with torch.no_grad():
        # atol at the scale of the compared outputs (7x the unit-scale 1e-5): near-zero samples
        # carry float rounding of the scaled signal (1.9e-5 seen on torch 2.11)
        assert torch.allclose(model(mixture * 7.0), model(mixture) * 7.0, rtol=1e-4, atol=7e-5)
        assert torch.isfinite(model(torch.zeros(1, 2, 1024))).all()  # silence stays finite
    unnormalised = tiny_model(normalize_input=False).eval()
    with torch.no_grad():
        assert not torch.allclose(unnormalised(mixture * 7.0), unnormalised(mixture) * 7.0, rtol=1e-2)


def test_swiglu_ffn_keeps_length_for_strided_convs():
    model = tiny_model(conv_kernel=6, conv_stride=3)
    out = model(torch.randn(1, 2, 1000))
    assert out.shape == (1, 4, 2, 1000)


# ----------------------------------------------------------------------------------------------
# attention backends and chunking


def cpu_has(backend: SDPBackend) -> bool:
    q = torch.randn(1, 1, 4, 8)
    try:
        with sdpa_kernel([backend]):
            F.scaled_dot_product_attention(q, q, q)
        return True
    except RuntimeError:
        return False


def test_attention_backends_give_the_same_output():
    model = tiny_model().eval()
    mixture = torch.randn(2, 2, 1024)
    outputs = {}
    for backend in ("auto", "math", "flash", "efficient"):
        model.attention_backend = backend
        if backend == "efficient" and not cpu_has(SDPBackend.EFFICIENT_ATTENTION):
            with pytest.raises(RuntimeError, match="attention_backend='efficient'"):
                model(mixture)
            continue
        with torch.no_grad():
            outputs[backend] = model(mixture)
    assert {"auto", "math", "flash"} <= set(outputs)
    for backend, out in outputs.items():
        assert torch.allclose(out, outputs["math"], atol=1e-5, rtol=1e-4), backend


@pytest.mark.filterwarnings("ignore:.*(kernel not used|do not support non-zero dropout)")
def test_flash_with_dropout_on_cpu_is_an_error_not_a_fallback():
    model = tiny_model(dropout=0.1, attention_backend="flash").train()
    if cpu_has(SDPBackend.FLASH_ATTENTION):
        q = torch.randn(1, 1, 4, 8)
        try:  # some builds may support it; then there is nothing to check
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                F.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
            pytest.skip("this torch runs CPU flash attention with dropout")
        except RuntimeError:
            pass
    with pytest.raises(RuntimeError, match="attention_backend='flash'.*dropout 0.1"):
        model(torch.randn(1, 2, 1024))


def test_out_of_memory_in_attention_stays_an_out_of_memory_error(monkeypatch):
    """A CUDA OOM inside a named SDPA kernel (the H200's fp32 math attention asked 13.5 GiB more,
    2026-11-27) must reach the trainer as torch.OutOfMemoryError, its retry's trigger, not as "no
    math kernel for these inputs". Mocked: no CUDA allocation can run out here, so SDPA raises
    torch's own OutOfMemoryError with the message the H200 printed."""
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 13.50 GiB.")

    monkeypatch.setattr(F, "scaled_dot_product_attention", out_of_memory)
    model = tiny_model(attention_backend="math")
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 13.50 GiB"):
        model(torch.randn(1, 2, 1024))


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="attention_backend"):
        tiny_model(attention_backend="fastest")


def test_chunked_attention_equals_unchunked():
    # frequency path: batch*frames = 2 * 33 sequences; time path: 2 * 33 -> chunks of 7 split both
    mixture = torch.randn(2, 2, 1024)
    results = []
    for chunk in (7, 16384):
        model = tiny_model(attention_chunk=chunk)
        out = model(mixture)
        out.square().mean().backward()
        results.append((out.detach(), [p.grad.clone() for p in model.parameters()]))
    (out_a, grads_a), (out_b, grads_b) = results
    assert torch.allclose(out_a, out_b, atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6, rtol=1e-5) for a, b in zip(grads_a, grads_b))


def test_attend_splits_large_sequence_batches(monkeypatch):
    calls = []
    original = F.scaled_dot_product_attention

    def counting(q, *args, **kwargs):
        calls.append(q.shape[0])
        return original(q, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counting)
    q = torch.randn(10, 2, 5, 4)
    out = attend(q, q, q, 0.0, "math", chunk=4)
    assert calls == [4, 4, 2]
    assert torch.allclose(out, original(q, q, q), atol=1e-6)


# ----------------------------------------------------------------------------------------------
# training behaviour


def loss_and_grads(checkpointing: bool, context=None):
    model = tiny_model(n_layers=2, dropout=0.1, checkpointing=checkpointing).train()
    model.checkpoint_context = context
    loss_fn = SeparationLoss(1.0, 1.0, default_resolutions(64))
    torch.manual_seed(1)
    mixture, stems = torch.randn(2, 2, 1024), torch.randn(2, 4, 2, 1024)
    torch.manual_seed(2)  # same dropout masks in both runs
    loss = loss_fn(model(mixture), stems)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_checkpointing_gives_the_same_loss_and_gradients():
    loss_plain, grads_plain = loss_and_grads(False)
    loss_ckpt, grads_ckpt = loss_and_grads(True)
    assert torch.allclose(loss_plain, loss_ckpt, atol=1e-6)
    for name, grad in grads_plain.items():
        assert torch.allclose(grad, grads_ckpt[name], atol=1e-6, rtol=1e-5), name
    assert any(g.abs().sum() > 0 for g in grads_plain.values())


def test_the_checkpoint_context_wraps_each_blocks_forward_and_recomputation():
    """The CPU trainer's heap trim (cpu_process.trimmed_heap) is entered before each checkpointed
    block runs, in the forward and again in backward's recomputation, and changes no gradient."""
    import contextlib

    entered = []

    @contextlib.contextmanager
    def count():
        entered.append(torch.is_grad_enabled())
        yield

    loss_plain, grads_plain = loss_and_grads(True)
    loss_ctx, grads_ctx = loss_and_grads(True, count)
    assert len(entered) == 2 * 2          # 2 blocks: forward + recomputation each
    assert torch.equal(loss_plain, loss_ctx)
    assert all(torch.equal(g, grads_ctx[n]) for n, g in grads_plain.items())
    with torch.no_grad():                 # no checkpointing without autograd: no context either
        model = tiny_model(n_layers=2, checkpointing=True).eval()
        model.checkpoint_context = count
        model(torch.randn(1, 2, 1024))
    assert len(entered) == 4


def test_bf16_autocast_forward_runs_and_stays_close_to_fp32():
    model = tiny_model().eval()
    mixture = torch.randn(2, 2, 1024)
    with torch.no_grad():
        fp32 = model(mixture)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16 = model(mixture)
    assert bf16.dtype == torch.float32 and torch.isfinite(bf16).all()
    relative = (bf16 - fp32).norm() / fp32.norm()
    assert 0 < relative < 0.05  # bf16 did run (not identical), and the fp32 islands keep it close


@pytest.mark.parametrize("checkpointing, precision", [(False, "fp32"), (True, "bf16")])
def test_training_step_traces_under_fake_tensors(checkpointing, precision):
    preset = tiny_preset(checkpointing=checkpointing, dropout=0.1)
    with FakeTensorMode():
        model = build_model(preset)
        loss_fn = build_loss(preset)
        mixture, stems = torch.randn(2, 2, 1024), torch.randn(2, 4, 2, 1024)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            estimates = model(mixture)
        loss = loss_fn(estimates.float(), stems)
        loss.backward()
        assert estimates.shape == (2, 4, 2, 1024) and estimates.dtype == torch.float32
        assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())


def test_loss_terms():
    preset = tiny_preset()
    preset["train"]["loss"] = {"time_l1": 1.0, "stft_l1": 0.0, "stft_resolutions": None}
    time_only = build_loss(preset)
    estimates, targets = torch.randn(2, 4, 2, 512), torch.randn(2, 4, 2, 512)
    assert torch.allclose(time_only(estimates, targets), (estimates - targets).abs().mean())
    assert time_only(targets, targets) == 0

    preset["train"]["loss"] = {"time_l1": 0.0, "stft_l1": 2.0, "stft_resolutions": [[32, 8], [64, 16]]}
    stft_only = build_loss(preset)
    assert stft_only.resolutions == [(32, 8), (64, 16)]
    terms = []
    for size, hop in [(32, 8), (64, 16)]:  # STFT of each signal separately, then the difference
        window = torch.hann_window(size)
        spec = [torch.stft(x.reshape(-1, 512), size, hop, window=window, normalized=True,
                           pad_mode="constant", return_complex=True) for x in (estimates, targets)]
        terms.append(torch.view_as_real(spec[0] - spec[1]).abs().mean())
    assert torch.allclose(stft_only(estimates, targets), 2.0 * torch.stack(terms).mean(), atol=1e-6)

    assert default_resolutions(256) == [(128, 32), (256, 64), (512, 128)]
    assert build_loss(tiny_preset()).resolutions == default_resolutions(64)


def test_overfits_one_batch():
    """50 AdamW steps on one batch of distinct stems cut the loss by at least 10x."""
    torch.manual_seed(0)
    t = torch.arange(1024) / 8000
    stems = torch.stack([
        torch.sin(2 * math.pi * 220 * t),
        0.5 * torch.sign(torch.sin(2 * math.pi * 90 * t)),
        0.3 * torch.randn(1024),
        0.3 * torch.sin(2 * math.pi * 1500 * t),
    ])[None, :, None].repeat(1, 1, 2, 1) * torch.tensor([1.0, 0.6])[:, None]  # [1, 4, 2, S]
    mixture = stems.sum(1)  # [1, 2, S]
    model = tiny_model(emb_dim=16, attention_dim=16, ffn_hidden=32, hop=32)
    loss_fn = SeparationLoss(1.0, 1.0, default_resolutions(64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(50):
        optimizer.zero_grad()
        loss = loss_fn(model(mixture), stems)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    silent = loss_fn(torch.zeros_like(stems), stems).item()  # what predicting nothing scores
    assert losses[-1] < losses[0] / 10, losses[::10]
    assert losses[-1] < silent / 10
