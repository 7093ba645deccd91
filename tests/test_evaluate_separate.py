"""Chunked overlap-add separation: exact reconstruction, fixed chunk shape, inference settings."""
from __future__ import annotations

import pytest
import torch

from tiersep.separate.overlap_add import chunk_window, plan_chunks
from tiersep.separate.overlap_add import separate_track as separate


class PointwiseStems(torch.nn.Module):
    """Stem k = (k + 1) * x * |x| / 10: pointwise, so overlap-add must reproduce it exactly.
    Records what it sees so tests can check shapes and inference settings."""

    def __init__(self, n_src: int = 3):
        super().__init__()
        self.n_src = n_src
        self.calls: list[dict] = []

    def forward(self, x):  # [B, C, S] -> [B, n_src, C, S]
        self.calls.append({"shape": tuple(x.shape), "inference": torch.is_inference_mode_enabled(),
                           "training": self.training,
                           "autocast_cpu": torch.is_autocast_enabled("cpu"),
                           "matmul_dtype": (x[..., :4] @ x[..., :4].transpose(-1, -2)).dtype})
        gains = torch.arange(1, self.n_src + 1, dtype=x.dtype, device=x.device) / 10
        return gains[None, :, None, None] * (x * x.abs())[:, None]


def expected(mixture, n_src=3):
    gains = torch.arange(1, n_src + 1, dtype=torch.float32) / 10
    return gains[:, None, None] * (mixture * mixture.abs())[None]


@pytest.mark.parametrize("length,chunk,overlap", [
    (1000, 256, 0.25),    # not a multiple of the chunk or the hop
    (1000, 256, 0.0),     # plain concatenation
    (777, 100, 0.75),     # fades longer than half a chunk
    (50, 256, 0.25),      # track shorter than one chunk
    (256, 256, 0.5),      # exactly one chunk
    (4097, 1000, 0.1),
])
def test_overlap_add_reconstructs_a_pointwise_model_exactly(length, chunk, overlap):
    torch.manual_seed(length)
    mixture = torch.randn(2, length)
    model = PointwiseStems()
    out = separate(model, mixture, chunk, overlap)
    assert out.shape == (3, 2, length) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected(mixture), atol=1e-5, rtol=1e-5)
    # every call sees one fixed-size chunk: the model's memory cannot grow with the track
    assert {c["shape"] for c in model.calls} == {(1, 2, chunk)}
    assert len(model.calls) == len(plan_chunks(length, chunk, int(round(chunk * overlap))))


def test_chunks_cover_the_track_with_padding_at_both_ends():
    for length, chunk, overlap in [(1000, 256, 64), (10, 256, 64), (5000, 1000, 0), (777, 100, 75)]:
        starts = plan_chunks(length, chunk, overlap)
        hop = chunk - overlap
        assert starts[0] == -overlap and all(b - a == hop for a, b in zip(starts, starts[1:]))
        assert starts[-1] + chunk >= length + overlap     # the end gets at least `overlap` padding
        assert starts[-1] < length                         # no chunk entirely past the end


def test_window_is_positive_and_cross_fades_to_one():
    window = chunk_window(256, 64)
    assert (window > 0).all() and window[64:192].eq(1).all()
    # fade-out of one chunk + fade-in of the next sum to 1 (sin^2 + cos^2) before normalising
    torch.testing.assert_close(window[-64:] + window[:64], torch.ones(64))


def test_runs_in_inference_mode_and_eval_mode_and_restores_training():
    model = PointwiseStems()
    model.train()
    separate(model, torch.randn(2, 500), 200, 0.25)
    assert all(c["inference"] and not c["training"] for c in model.calls)
    assert model.training


def test_bf16_autocast_on_cpu_only_when_asked():
    model = PointwiseStems()
    mixture = torch.randn(2, 300)
    out = separate(model, mixture, 128, 0.25, precision="bf16")
    assert all(c["autocast_cpu"] and c["matmul_dtype"] == torch.bfloat16 for c in model.calls)
    assert out.dtype == torch.float32
    model.calls.clear()
    separate(model, mixture, 128, 0.25, precision="fp32")
    assert not any(c["autocast_cpu"] for c in model.calls)
    assert all(c["matmul_dtype"] == torch.float32 for c in model.calls)


def test_bad_arguments_are_clear_errors():
    model = PointwiseStems()
    with pytest.raises(ValueError, match="overlap"):
        separate(model, torch.randn(2, 100), 50, 1.0)
    with pytest.raises(ValueError, match="precision"):
        separate(model, torch.randn(2, 100), 50, 0.25, precision="fp8")
    with pytest.raises(ValueError, match="channels, samples"):
        separate(model, torch.randn(100), 50, 0.25)

    class WrongShape(torch.nn.Module):
        def forward(self, x):
            return x
    with pytest.raises(ValueError, match="model returned shape"):
        separate(WrongShape(), torch.randn(2, 100), 50, 0.25)


def test_real_tflocoformer_chunked_equals_one_pass_when_the_chunk_covers_the_track():
    """With one chunk and zero padding both ways, chunking must not change the model's output."""
    from tiersep.config import load_preset
    from tiersep.model import build_model

    preset = load_preset("cpu_tiny")
    torch.manual_seed(0)
    model = build_model(preset).eval()
    mixture = torch.randn(2, 2000) * 0.1
    assert plan_chunks(2000, 3000, 300) == [-300]                  # one chunk: pad 300, track, pad 700
    chunked = separate(model, mixture, 3000, 0.1)
    with torch.inference_mode():
        padded = torch.nn.functional.pad(mixture, (300, 700))[None]
        direct = model(padded)[0, :, :, 300:2300]
    torch.testing.assert_close(chunked, direct, atol=1e-5, rtol=1e-4)
    assert chunked.shape == (len(preset["model"]["sources"]), 2, 2000)
