"""How `tiersep separate` runs within a memory budget: the device, the budget, the chunk and batch.

The budget (`budget_for`): on CUDA the memory free on the GPU before this process's CUDA context
(free now + the calibrated context that the estimate books), on a CPU the available RAM; `--budget`
overrides either. What is booked against it is the inference estimate (memory/inference.py) of one
model call on a batch of chunks: on CUDA the predicted device use, on a CPU the whole process's
peak RSS, the stream's host buffers (`host_bytes`) included. As the fit gate, a plan fits when
booking + safety margin x budget <= budget.

`choose` picks, for a `SeparationRequest` (what the command asks, built once in separate/run.py),
the longest chunk (at most the requested one, at least `min_chunk`) that fits with a batch of one,
then the largest batch of such chunks that fits (at most the requested one, and no more than the
longest song has chunks): memory grows with both, and the chunk matters more for quality. A budget
that does not fit the shortest chunk is refused before any song is touched.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tiersep.config import DoesNotFit
from tiersep.device import resolve_device
from tiersep.memory import GateSettings
from tiersep.memory.constants import GIB

from .overlap_add import overlap_samples, plan_chunks

BYTES = 4                  # float32 samples
BLOCK_FRAMES = 1 << 16     # frames per block: decoded (song rate), and separated stems handed on (model rate)


@dataclass(frozen=True)
class SeparationRequest:
    """What one `tiersep separate` asks of the plan, in samples at the model's rate: the user's
    limits and settings (the options), and what the songs need."""
    max_chunk: int          # the longest chunk tried (--chunk)
    min_chunk: int          # the shortest chunk accepted (separate.min_chunk_seconds)
    max_batch: int          # the most chunks per model call (--batch)
    overlap: float          # the fraction of a chunk shared with the next
    shifts: int             # passes at shifted offsets, averaged
    longest_samples: int    # the longest song: no batch beyond its chunks
    rate_ratio: float       # the song rate furthest from the model's, over it (the stream's blocks scale with it)
    two_stem: bool = False  # --stems: a stem and its complement (the mixture is kept for it)
    above_band: bool = False  # a song above the model's rate: its band above the model's is kept (song.py)


@dataclass
class Plan:
    device: torch.device
    budget_bytes: int | None
    budget_source: str
    chunk_samples: int
    batch: int
    estimate: dict                                 # the inference estimate of the chosen chunk and batch
    tried: list = field(default_factory=list)      # [{chunk_samples, batch, required_bytes, fits}]


def separation_device(wanted: str) -> torch.device:
    """--device: auto = CUDA when a GPU is visible, else the CPU; cuda without a GPU is a one-line
    error (tiersep.device.resolve_device)."""
    return resolve_device(wanted, "--device cuda: no CUDA device is visible to this process")


def budget_for(device: torch.device, override_gib: float | None, calibration_spec: str) -> tuple[int, str]:
    """(budget bytes, where it comes from): see the module docstring."""
    if override_gib is not None:
        return max(1, int(override_gib * GIB)), f"--budget {override_gib:g} GiB"
    if device.type == "cuda":
        from tiersep.memory import calibration

        free, _ = torch.cuda.mem_get_info(device)
        context = calibration.resolve(calibration_spec)["context_bytes"]
        return int(free + context), (f"free on {torch.cuda.get_device_name(device)} before this process's "
                                     f"CUDA context ({free / GIB:.2f} GiB free + {context / 2**20:.0f} MiB context)")
    import psutil

    return int(psutil.virtual_memory().available), "available RAM (psutil)"


def host_bytes(channels: int, n_src: int, chunk: int, batch: int, hop: int, shifts: int, rate_ratio: float,
               two_stem: bool, above_band: bool = False) -> int:
    """Host memory of the stream around the model calls, by what each stage holds at most (float32
    samples; r = the song's rate over the model's, or its inverse, whichever is larger):
    - per pass (OverlapAdd, model rate): the input kept for the next chunks and its copy, a batch of
      chunks and their stack, and the overlap-add buffer spanning a batch of hops and a chunk three
      times (the buffer, a weighted estimate, the finished span); with shifts, the passes' finished
      spans waiting to be averaged;
    - per song: a decoded block in three forms (bytes, view, copy) and resampled with its copy; the
      stems of a block through the resampler back (its input, its buffer and copy) and at the song's
      rate three times (resampled, channel-averaged or clipped, laid out for the encoder); in
      two-stem mode the decoded mixture waiting for its stems (a span and a block at the song's rate);
      for a song above the model's rate, the band above the model's (song.py's _AboveBand): the
      mixture waiting for its band below, that band through a resampler, and the band above waiting
      for the stems (a span and a block at the song's rate, three times)."""
    span = batch * hop + chunk
    block = BLOCK_FRAMES
    r = max(rate_ratio, 1.0 / rate_ratio)
    per_pass = 2 * channels * (chunk + block) + 2 * channels * chunk * batch + 3 * n_src * channels * span
    averaging = (shifts > 1) * 2 * n_src * channels * span
    song = (3 * channels * block + 2 * channels * block * r + 3 * n_src * channels * block
            + 3 * n_src * channels * block * r + two_stem * channels * (span + block) * r
            + above_band * 3 * channels * (span + block) * r)
    return int(BYTES * (shifts * per_pass + averaging + song))


def estimate_for(preset: dict, device: torch.device, chunk: int, batch: int, budget: int | None,
                 request: SeparationRequest, settings: GateSettings) -> dict:
    """The inference estimate of one chunk size and batch, with the stream's host buffers."""
    from tiersep.memory.inference import estimate_inference

    n_src, channels = len(preset["model"]["sources"]), preset["audio"]["channels"]
    hop = chunk - overlap_samples(chunk, request.overlap)
    host = host_bytes(channels, n_src, chunk, batch, hop, request.shifts, request.rate_ratio, request.two_stem,
                      request.above_band)
    return estimate_inference(preset, device.type, chunk, batch, budget, settings.safety_margin,
                              settings.calibration_spec, host)


def choose(preset: dict, device: torch.device, budget: int, budget_source: str, request: SeparationRequest,
           settings: GateSettings) -> Plan:
    """The plan for this request (see module docstring); DoesNotFit when nothing fits."""
    max_chunk, max_batch, overlap = request.max_chunk, request.max_batch, request.overlap
    min_chunk = min(request.min_chunk, max_chunk)
    tried, cache = [], {}

    def estimate(chunk: int, batch: int) -> dict:
        if (chunk, batch) not in cache:
            record = estimate_for(preset, device, chunk, batch, budget, request, settings)
            cache[chunk, batch] = record
            tried.append({"chunk_samples": chunk, "batch": batch,
                          "required_bytes": record["gate_required_bytes"], "fits": record["fits"]})
        return cache[chunk, batch]

    def largest(low: int, high: int, fits, step: int) -> int:
        """The largest value in [low, high] that fits, to within `step` (fits(low) is known true)."""
        while high - low > step:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if fits(middle) else (low, middle - 1)
        return low

    def chunk_fits(chunk: int) -> bool:
        return estimate(chunk, 1)["fits"]

    if not chunk_fits(min_chunk):
        record = estimate(min_chunk, 1)
        raise DoesNotFit(_refusal(preset, device, record, budget, budget_source, settings.safety_margin, min_chunk))
    chunk = max_chunk if chunk_fits(max_chunk) else largest(min_chunk, max_chunk, chunk_fits,
                                                            max(1, (max_chunk - min_chunk) // 64))
    chunks_needed = len(plan_chunks(request.longest_samples, chunk, overlap_samples(chunk, overlap)))
    top = max(1, min(max_batch, chunks_needed))
    batch_fits = lambda b: estimate(chunk, b)["fits"]   # noqa: E731
    batch = top if batch_fits(top) else largest(1, top, batch_fits, 0)
    return Plan(device, budget, budget_source, chunk, batch, estimate(chunk, batch), tried)


def _refusal(preset: dict, device: torch.device, record: dict, budget: int, source: str, margin: float,
             chunk: int) -> str:
    rate = preset["audio"]["sample_rate"]
    booked = record["gate_required_bytes"]
    what = "the process's peak RSS" if device.type == "cpu" else "the device use"
    return (f"preset {preset['name']}: the shortest chunk ({chunk / rate:g} s, batch 1) needs an estimated "
            f"{booked / GIB:.2f} GiB ({what}, trace on {device.type}) + {margin:.0%} margin, more than the "
            f"budget of {budget / GIB:.2f} GiB ({source}); free memory or raise --budget")
