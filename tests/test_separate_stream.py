"""The pieces of `tiersep separate` that bound its memory, against their whole-track references:
streamed overlap-add == evaluate's separate(), streamed resampling == prepare's torchaudio
resampling, the inference trace against a real model call (a dispatch check, and the allocator's own
events), and the plan."""
from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tiersep import config as C
from tiersep.memory import GateSettings
from tiersep.separate.overlap_add import OverlapAdd, ShiftAverage
from tiersep.separate.overlap_add import separate_track as separate
from tiersep.memory.inference import trace_inference
from tiersep.memory.trace.tracker import StorageTracker, cpu_block_bytes
from tiersep.model import build_model
from tiersep.separate.plan import SeparationRequest, choose, estimate_for
from tiersep.separate.resample import StreamResampler
from tiersep.separate.options import Options, check_options, render
from tiersep.separate.song import shift_delays

REPO = Path(__file__).resolve().parents[1]
TIERSEP = str(Path(sys.executable).parent / "tiersep")


class PointwiseStems(torch.nn.Module):
    """Stem k = (k + 1) * x * |x| / 10: pointwise, so any chunking or delay gives the same output."""

    def forward(self, x):  # [B, C, S] -> [B, 3, C, S]
        gains = torch.arange(1, 4, dtype=x.dtype) / 10
        return gains[None, :, None, None] * (x * x.abs())[:, None]


def stream(model, mixture, blocks, **kwargs) -> torch.Tensor:
    """Push `mixture` [C, S] through OverlapAdd in blocks of the given sizes (cycled)."""
    sep = OverlapAdd(model, **kwargs) if "passes" not in kwargs else kwargs["passes"]
    outs, i, k = [], 0, 0
    while i < mixture.shape[1]:
        n = blocks[k % len(blocks)]
        outs.append(sep.push(mixture[:, i:i + n]))
        i, k = i + n, k + 1
    outs.append(sep.close())
    return torch.cat([o for o in outs if o is not None], dim=-1)


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return build_model(C.load_preset("cpu_tiny")).eval()


@pytest.mark.parametrize("length,chunk,overlap,batch,blocks", [
    (20000, 4000, 0.25, 1, [777, 5000, 1]),
    (20000, 4000, 0.25, 3, [4000]),
    (3000, 4000, 0.5, 2, [100]),          # shorter than one chunk: padded
    (16001, 4000, 0.0, 2, [16001]),       # one block holding the whole track
])
def test_streamed_overlap_add_equals_the_whole_track_version(tiny_model, length, chunk, overlap, batch, blocks):
    torch.manual_seed(length)
    mixture = torch.randn(2, length) * 0.1
    whole = separate(tiny_model, mixture, chunk, overlap, batch=batch)
    streamed = stream(tiny_model, mixture, blocks, chunk_samples=chunk, overlap=overlap, batch=batch)
    assert streamed.shape == whole.shape == (4, 2, length)
    assert torch.equal(streamed, whole)      # the same arithmetic in the same order: bit for bit


def test_the_stream_holds_a_bounded_buffer_not_the_track(tiny_model):
    sep = OverlapAdd(tiny_model, 4000, 0.25, batch=2)
    longest_buffer = 0
    for _ in range(30):
        sep.push(torch.randn(2, 3000) * 0.1)
        held = sep.acc.shape[-1] if sep.acc is not None else 0
        longest_buffer = max(longest_buffer, held, sep.inbuf.shape[-1])
    sep.close()
    assert longest_buffer <= 2 * 3000 + 4000           # a batch of hops and a chunk, not 90 000 samples


def test_shifted_passes_average_to_the_pointwise_result_for_any_delay():
    torch.manual_seed(1)
    mixture = torch.randn(2, 9001)
    expected = separate(PointwiseStems(), mixture, 1000, 0.25)
    passes = [OverlapAdd(PointwiseStems(), 1000, 0.25, batch=b, delay=d) for b, d in ((1, 0), (2, 37), (3, 500))]
    averaged = stream(None, mixture, [333, 2048], passes=ShiftAverage(passes))
    torch.testing.assert_close(averaged, expected, atol=1e-6, rtol=1e-6)


def test_shift_delays_are_seeded_and_within_half_a_second():
    assert shift_delays(1, 5, 8000) == [0]
    assert shift_delays(4, 5, 8000) == shift_delays(4, 5, 8000) != shift_delays(4, 6, 8000)
    assert all(0 <= d <= 4000 for d in shift_delays(16, 0, 8000))


@pytest.mark.parametrize("orig,new", [(44100, 8000), (22050, 8000), (48000, 8000), (96000, 8000),
                                      (8000, 44100), (8000, 22050), (8000, 8000)])
def test_streamed_resampling_equals_prepares_whole_track_resampling(orig, new):
    import torchaudio.functional as AF

    from tiersep.data.prepare import RESAMPLING

    torch.manual_seed(orig + new)
    signal = torch.randn(2, orig * 2 + 13)
    whole = AF.resample(signal, orig, new, **RESAMPLING)
    resampler = StreamResampler(orig, new)
    outs, i = [], 0
    for n in [1, 999, 4096, 5, 20000] * 20:
        if i < signal.shape[1]:
            outs.append(resampler.push(signal[:, i:i + n]))
            i += n
    outs.append(resampler.close())
    streamed = torch.cat([o for o in outs if o is not None], dim=1)
    assert streamed.shape == whole.shape
    torch.testing.assert_close(streamed, whole, atol=1e-6, rtol=0)


INFERENCE_CALLS = [("cpu_tiny", 8000, 1), ("cpu_small", 20000, 3)]


def model_call(preset: dict, chunk: int, batch: int):
    """(the real model, the model call of separate on one batch of chunks)."""
    model = build_model(preset).eval()

    def call():
        with torch.inference_mode():
            pieces = torch.empty(batch, 2, chunk)
            estimates = model(pieces)
            del pieces, estimates
    return model, call


@pytest.mark.parametrize("name,chunk,batch", INFERENCE_CALLS)
def test_inference_trace_dispatch_check_against_a_tracked_model_call(name, chunk, batch):
    """A dispatch check, not an accuracy figure: the same StorageTracker as the trace, on real
    tensors. The accuracy reference is the allocator's (the test below)."""
    preset = C.load_preset(name)
    traced = trace_inference(preset, "cpu", chunk, batch)
    model, call = model_call(preset, chunk, batch)
    tracker = StorageTracker(cpu_block_bytes)
    tracker.register(list(model.parameters()) + list(model.buffers()))
    with tracker:
        call()
    assert abs(traced.allocated_peak - tracker.peak_bytes) <= 1024       # bytes, of tens of MB


# The CPU allocator's own peak (torch.profiler, profile_memory; tests/memory_reference.py) over the
# model call, plus the weights. Measured 2026-11-26 (torch 2.11): the same to the byte in three calls
# (spread 0): 7966328 and 89494496 B. The inference trace reads -7.25% and -11.30%, a real miss the
# dispatch check cannot see: at the allocator's peak, inside the decoder's conv_transpose1d,
# aten::_convolution allocates 28 MB of its own (cpu_small) below the dispatcher. Asserted at the
# measured values +-memory_reference.MACHINE_MARGIN, so a fix or a worse miss both fail here and must be stated.
INFERENCE_MISS = {"cpu_tiny": -0.0725, "cpu_small": -0.1130}


@pytest.mark.parametrize("name,chunk,batch", INFERENCE_CALLS)
def test_inference_trace_against_the_allocators_own_events(name, chunk, batch):
    from memory_reference import profiled_peak, storage_bytes

    preset = C.load_preset(name)
    traced = trace_inference(preset, "cpu", chunk, batch).allocated_peak
    model, call = model_call(preset, chunk, batch)
    measured = storage_bytes(list(model.parameters()) + list(model.buffers())) + profiled_peak(call)
    error = traced / measured - 1
    print(f"{name}: trace {traced} B, allocator {measured} B ({error:+.4%})")
    from memory_reference import MACHINE_MARGIN

    assert error == pytest.approx(INFERENCE_MISS[name], abs=MACHINE_MARGIN)


def test_inference_trace_of_cuda_replays_the_allocator():
    preset = C.load_preset("cpu_small")
    traced = trace_inference(preset, "cuda", 20000, 2)
    assert traced.reserved_peak >= traced.allocated_peak > traced.weights > 0
    assert traced.kernels                            # SDPA modelled as a fused CUDA kernel


def test_a_cuda_inference_estimate_books_the_device_use_with_the_calibrated_context():
    from tiersep.memory.inference import estimate_inference
    from tiersep.records import validate_record

    preset = C.load_preset("cpu_small")
    record = validate_record("estimate", estimate_inference(preset, "cuda", 20000, 2, budget_bytes=2**30), "test")
    context = record["calibration"]["context_bytes"]
    assert record["peak_bytes"] == record["reserved_peak_bytes"] + context
    # never measured on a GPU: booked with the uncertainty of a class without evidence
    assert record["uncertainty"] == 0.10 and "no GPU measurement" in record["uncertainty_evidence"]
    assert record["gate_required_bytes"] == round(record["peak_bytes"] * 1.10)
    assert record["breakdown"]["overhead"] == record["peak_bytes"] - record["allocated_peak_bytes"]
    assert record["fits"] is True and "cpu_process" not in record


def test_plan_takes_the_longest_chunk_and_largest_batch_that_fit():
    preset = C.load_preset("cpu_tiny")
    cpu = torch.device("cpu")
    settings = GateSettings(0.08, "auto")
    request = SeparationRequest(max_chunk=80000, min_chunk=8000, max_batch=4, overlap=0.25, shifts=1,
                                longest_samples=10**9, rate_ratio=1.0)
    shortest = estimate_for(preset, cpu, 8000, 1, None, request, settings)["gate_required_bytes"]
    longest = estimate_for(preset, cpu, 80000, 1, None, request, settings)["gate_required_bytes"]
    budget = int((shortest + longest) / 2 / 0.92)
    plan = choose(preset, cpu, budget, "test", request, settings)
    assert 8000 < plan.chunk_samples < 80000 and plan.batch == 1
    assert plan.estimate["fits"] and plan.estimate["gate_required_bytes"] + 0.08 * budget <= budget
    roomy = choose(preset, cpu, 64 * 2**30, "test", request, settings)
    assert (roomy.chunk_samples, roomy.batch) == (80000, 4)
    short_song = choose(preset, cpu, 64 * 2**30, "test", replace(request, longest_samples=30000), settings)
    assert short_song.batch == 1                     # one chunk covers the longest song
    with pytest.raises(C.DoesNotFit, match=r"shortest chunk \(1 s, batch 1\) needs an estimated"):
        choose(preset, cpu, int(shortest * 0.9), "test", request, settings)


def options(**changes) -> Options:
    base = dict(model=Path("m.pt"), inputs=[], out=Path("o"), preset=None, stems=None, budget_gib=None,
                device="cpu", overlap=0.25, shifts=1, seed=0, format="wav", bits="16", clip="rescale",
                filename="{song}/{stem}.{ext}", chunk_seconds=10, min_chunk_seconds=1, max_batch=4)
    return Options(**{**base, **changes})


@pytest.mark.parametrize("changes,message", [
    ({"filename": "{song}.{ext}"}, "use the fields {song} and {stem}"),
    ({"filename": "{song}/{stem}/{bpm}.{ext}"}, "unknown: bpm"),
    ({"filename": "/abs/{song}/{stem}.{ext}"}, "not a path inside --out"),
    ({"filename": "../{song}/{stem}.{ext}"}, "not a path inside --out"),
    ({"filename": "{song}/{stem!z}"}, "not a valid template"),
    ({"format": "flac", "bits": "32f"}, "flac holds integer samples"),
])
def test_bad_options_are_one_line_errors(changes, message):
    with pytest.raises(C.ConfigError, match=message.replace("{", r"\{").replace("}", r"\}").replace("(", r"\(")):
        check_options(options(**changes))


def test_templates_render_inside_the_output_folder():
    assert render("{song}/{stem}.{ext}", "A - B", "mp3", "vocals", "wav") == Path("A - B/vocals.wav")
    assert render("{stem}/{song}.{songext}.{ext}", "x", "flac", "bass", "mp3") == Path("bass/x.flac.mp3")


def test_estimate_inference_writes_a_valid_estimate_record(tmp_path):
    import json

    from tiersep.records import validate_record

    out = tmp_path / "inference.json"
    proc = subprocess.run([TIERSEP, "estimate", "--preset", "cpu_small", "--inference", "--device", "cpu",
                           "--chunk", "4", "--batch", "2", "--budget", "8", "--out", str(out)],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = validate_record("estimate", json.loads(out.read_text()), out)
    assert record["mode"] == "inference" and record["chunk_samples"] == 32000 and record["batch"] == 2
    assert record["breakdown"]["gradients"] == record["breakdown"]["optimizer"] == 0
    assert record["fits"] is True and record["gate_required_bytes"] == record["cpu_process"]["rss_bytes"]
    assert "separation of 4 s chunks x 2" in proc.stdout
