"""`tiersep evaluate`: separate every test track with a trained tier and score it as SiSEC does.

Per track and stem: SI-SDR over the whole track, museval BSSEval v4 SDR/SIR/ISR/SAR (1 s windows
and hops; median over frames), and the mixture-as-estimate baseline (SI-SDR and SDR). Per stem:
median over tracks. Overall: mean over stems of the per-stem medians (how papers report "avg").

Separation runs in this process (model on its device, one chunk at a time); museval scoring runs in
worker processes and overlaps with the separation of the next tracks.
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
from tqdm import tqdm

from tiersep.config import ConfigError
from tiersep.device import choose_device
from tiersep.evaluate import listen, metrics
from tiersep.evaluate.schema import EVAL_FILES
from tiersep.evaluate.scoring import (TrackTask, aggregate_scores, available_cores, museval_peak_bytes,
                                      resolve_workers, score_tracks, write_scores)
from tiersep.gpu_lease import current_record as gpu_lease_record
from tiersep.io import atomic_dir
from tiersep.model.weights import load_model
from tiersep.outputs import check, claim, exclusive, only_names
from tiersep.separate.overlap_add import separate_track


def protocol_text(rate: int, cfg_eval: dict) -> str:
    return (
        "Chunked overlap-add separation of each whole test track "
        f"({cfg_eval['chunk_seconds']} s chunks, {cfg_eval['overlap']} overlap, sin^2 cross-fade). "
        "SI-SDR (Le Roux 2019): whole track, mean removed per channel, both channels as one signal. "
        f"SDR/SIR/ISR/SAR: museval BSSEval v4 (bss_eval_images, time-invariant 512-tap filters), "
        f"1 s windows and hops at {rate} Hz; per track the median over frames skipping NaN "
        "(frames where any reference or estimate is silent, and frames museval stores as NaN); "
        "per stem the median over tracks; overall = mean over stems of the per-stem medians. "
        "Baseline: the mixture as the estimate of every stem (SDR by the exact v4 per-frame "
        "formula, the same NaN frames). improvement = score - baseline score (of the medians)."
    )


# ---------------------------------------------------------------------------------------------
# Device
# ---------------------------------------------------------------------------------------------
def resolve_device(preset: dict) -> torch.device:
    return choose_device(preset, "evaluate")


# ---------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------


def evaluate(cfg: dict, preset: dict, model_path: Path, data_dir: Path, out_dir: Path) -> dict:
    """Load model.pt and evaluate it on the test split of `data_dir`; see `evaluate_model`."""
    check(out_dir, "evaluate", known=only_names(EVAL_FILES))   # a refused folder before any work
    model, step = load_model(Path(model_path), preset)
    return evaluate_model(cfg, preset, model, Path(data_dir), Path(out_dir),
                          model_path=Path(model_path), step=step)


def evaluate_model(cfg: dict, preset: dict, model: torch.nn.Module, data_dir: Path, out_dir: Path,
                   model_path: Path | None = None, step: int | None = None) -> dict:
    """Separate and score the test tracks into out_dir (see `_evaluate`). out_dir must be tiersep's
    (tiersep.outputs.claim: new, empty or an evaluation folder) and is held by this process alone
    until scores.json is written."""
    out_dir = claim(out_dir, "evaluate", known=only_names(EVAL_FILES))
    with exclusive(out_dir):
        return _evaluate(cfg, preset, model, Path(data_dir), out_dir, model_path, step)


def _evaluate(cfg: dict, preset: dict, model: torch.nn.Module, data_dir: Path, out_dir: Path,
              model_path: Path | None, step: int | None) -> dict:
    """Separate and score the test tracks; write out_dir/scores.json (last, it marks completion),
    out_dir/museval/<track>.json and, when evaluate.save_estimates, out_dir/estimates/<track>/<stem>.wav.
    Returns the scores dict. Long because separation and scoring share one ExitStack: the atomic
    output folders, the progress bar and the torch thread budget live exactly as long as both."""
    from tiersep.data.tracks import read_track, track_samples

    began = time.perf_counter()
    settings = cfg["evaluate"]
    sources = list(preset["model"]["sources"])
    rate = int(preset["audio"]["sample_rate"])
    data_dir, out_dir = Path(data_dir), Path(out_dir)
    names = _test_tracks(data_dir, rate, settings["max_tracks"])

    device = resolve_device(preset)
    precision = preset["train"]["precision"]
    model = model.to(device)
    chunk = max(1, int(round(settings["chunk_seconds"] * rate)))
    longest = max(track_samples(data_dir, "test")[name] for name in names)
    workers = resolve_workers(settings["workers"], len(names),
                              museval_peak_bytes(len(sources), preset["audio"]["channels"], longest))
    si_sdrs: dict[str, dict] = {}

    with contextlib.ExitStack() as stack:
        if workers > 1 and device.type == "cpu":
            # Separation shares the cores with the museval workers; an oversubscribed OpenMP pool
            # spin-waits (measured 10x slower), so torch keeps only the cores the workers leave.
            stack.enter_context(_torch_threads(max(1, available_cores() - workers)))
        # inside evaluate's own folder (claimed by `evaluate`): an earlier evaluation's are replaced
        museval_dir = stack.enter_context(atomic_dir(out_dir / "museval", replace=True))
        estimates_dir = (stack.enter_context(atomic_dir(out_dir / "estimates", replace=True))
                         if settings["save_estimates"] else None)
        offer_excerpt = stack.enter_context(listen.excerpt_writer(out_dir / "listen", preset["name"], sources,
                                                                  rate, settings))
        bar = stack.enter_context(tqdm(total=len(names), desc=f"evaluate {preset['name']}", unit="track"))

        def tasks():
            for index, name in enumerate(names):
                bar.set_postfix_str(f"separating {index + 1}/{len(names)}")
                mixture, stems = read_track(data_dir, "test", name, sources)      # [C, S], [n, C, S]
                estimates = separate_track(model, mixture, chunk, settings["overlap"], precision, device,
                                     progress=True).numpy()                      # [n, C, S]
                si_sdrs[name] = {s: {"si_sdr": metrics.si_sdr(estimates[i], stems[i]),
                                     "si_sdr_mixture": metrics.si_sdr(mixture, stems[i])}
                                 for i, s in enumerate(sources)}
                if estimates_dir is not None:
                    _write_estimates(estimates_dir / name, estimates, sources, rate)
                offer_excerpt(name, mixture, estimates, stems)   # the first track: the report's Listen
                yield TrackTask(name, estimates, stems, mixture, sources, rate)

        results = score_tracks(tasks(), workers, on_result=lambda r: bar.update(1))

        skipped = {}
        for result in results:
            name = result["name"]
            if result["error"]:
                skipped[name] = result["error"]
            else:
                (museval_dir / f"{name}.json").write_text(result["museval_json"])

    aggregated = aggregate_scores(results, si_sdrs, sources)  # museval's EvalStore medians
    scores = {"preset": preset["name"], "sources": sources, "sample_rate": rate,
              "tracks": len(aggregated["per_track"]), **aggregated,
              "protocol": protocol_text(rate, settings), "seconds": time.perf_counter() - began,
              "skipped": skipped, "model": str(model_path) if model_path else None, "step": step,
              "device": device.type, "precision": precision, "chunk_seconds": settings["chunk_seconds"],
              "overlap": settings["overlap"], "workers": workers, "museval_version": _museval_version(),
              "gpu_lease": gpu_lease_record()}
    scores = _json_ready(scores)
    write_scores(out_dir / "scores.json", scores)
    _print_summary(scores)
    return scores


def _test_tracks(data_dir: Path, rate: int, max_tracks: int | None) -> list[str]:
    """The test tracks to evaluate (the first max_tracks), from a folder prepared at `rate`."""
    from tiersep.data.tracks import track_names

    _check_rate(data_dir, rate)
    names = track_names(data_dir, "test")[:max_tracks]
    if not names:
        raise ConfigError(f"{data_dir}: the test split has no tracks to evaluate")
    return names


@contextlib.contextmanager
def _torch_threads(count: int):
    before = torch.get_num_threads()
    torch.set_num_threads(min(count, before))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _check_rate(data_dir: Path, rate: int) -> None:
    from tiersep.data.tracks import load_manifest

    have = load_manifest(data_dir).get("sample_rate")
    if have is not None and int(have) != rate:
        raise ConfigError(f"{data_dir}: prepared at {have} Hz but the preset's audio.sample_rate is {rate}; "
                          "prepare the data at the preset's rate")


def _write_estimates(folder: Path, estimates: np.ndarray, sources: list[str], rate: int) -> None:
    # Inside an atomic_dir: the whole estimates/ folder appears only when evaluation succeeds.
    folder.mkdir(parents=True, exist_ok=True)
    for i, source in enumerate(sources):
        sf.write(folder / f"{source}.wav", estimates[i].T, rate, subtype="FLOAT")   # [S, C]


def _museval_version() -> str:
    from importlib.metadata import version

    return version("museval")


def _finite_or_none(value) -> float | None:
    """JSON has no NaN/inf: an undefined score is written as null."""
    value = float(value)
    return value if np.isfinite(value) else None


def _json_ready(value):
    """Replace NaN/inf by None recursively (scores.json is strict JSON)."""
    if isinstance(value, dict):
        return {k: _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    if isinstance(value, (float, np.floating)):
        return _finite_or_none(value)
    return value


def _print_summary(scores: dict) -> None:
    def fmt(value):
        return "  n/a" if value is None else f"{value:5.2f}"

    print(f"{scores['preset']}: {scores['tracks']} tracks, {scores['seconds']:.1f} s")
    print(f"  {'stem':<14}{'SI-SDR':>8}{'SI-SDRi':>9}{'SDR':>8}{'SDRi':>8}")
    for stem, s in list(scores["per_stem"].items()) + [("overall (mean)", scores["overall"])]:
        print(f"  {stem:<14}{fmt(s['si_sdr']):>8}{fmt(s['si_sdr_improvement']):>9}"
              f"{fmt(s['sdr']):>8}{fmt(s['sdr_improvement']):>8}")
    for name, why in scores["skipped"].items():
        print(f"  note: {name}: {why}")
