"""`tiersep prepare`: turn a source into training-ready files, exactly once.

out_dir (= <data.prepared_dir>/<source>/<sample_rate>) receives
    manifest.json
    {train,valid,test}/<Artist - Title>/{mixture,drums,bass,other,vocals}.wav
each a stereo float32 WAV at `sample_rate` (soundfile reads any range of it without decoding the
rest), resampled once from the track's own rate (tracks of one source may differ: the manifest
records each track's `source_rate` and all of them in `source_sample_rates`). The folder is built
under a temporary name and renamed at the end, so a failure leaves nothing; a folder whose manifest
matches the request is left alone ("nothing to do"). Tracks are processed one at a time, one stem
at a time, so memory does not grow with the dataset.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import platform
import shutil
import time
from pathlib import Path

import numpy as np
import soundfile as sf
from tqdm import tqdm

from tiersep.data.errors import DataError
from tiersep.data.ingest import (STEM_FILES, Source, SourceTrack, TrackProblem, open_source, read_track_audio,
                                 root_fingerprint)
from tiersep.data.synthetic import generator_settings
from tiersep.io import atomic_dir, read_json, write_json
from tiersep.records import validate_record

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
# Windowed-sinc resampling (Kaiser window): better alias rejection than torchaudio's default
# (Hann, width 6) at negligible cost (a 4-minute stereo stem, 44.1 -> 8 kHz, in ~0.1 s).
RESAMPLING = {"lowpass_filter_width": 16, "rolloff": 0.945, "resampling_method": "sinc_interp_kaiser",
              "beta": 14.769656459379492}


def request_of(cfg: dict, sample_rate: int) -> dict:
    """What the prepared folder depends on; a folder built for another request is rebuilt."""
    data = cfg["data"]
    request = {"format": MANIFEST_FORMAT, "source": data["source"], "sample_rate": int(sample_rate),
               "skip_invalid": bool(data["skip_invalid"]), "valid_tracks": data["valid_tracks"],
               "resampling": RESAMPLING}
    if data["source"] == "synthetic":
        request["generator"] = generator_settings(cfg)
    elif data["source"] in ("musdb18hq", "musdb18"):
        root = Path(data["root"]).expanduser()
        request["root"] = str(root.resolve())
        # None when the root is gone: a folder prepared from it is still usable (see check_prepared)
        request["fingerprint"] = root_fingerprint(root, data["source"] == "musdb18hq") if root.is_dir() else None
    return request


def check_prepared(out_dir: Path, request: dict | None = None) -> tuple[dict | None, str]:
    """(manifest, "") when out_dir is a complete prepared folder (for `request`, if given);
    otherwise (None, why not)."""
    path = Path(out_dir) / MANIFEST
    if not path.is_file():
        return None, f"no {MANIFEST}"
    try:
        manifest = read_json(path)
    except (OSError, ValueError) as err:
        return None, f"unreadable {MANIFEST} ({err})"
    if manifest.get("format") != MANIFEST_FORMAT:
        return None, f"manifest format {manifest.get('format')} (this version writes {MANIFEST_FORMAT})"
    if request is not None:
        built_for = dict(manifest.get("request", {}))
        if "fingerprint" in request and request["fingerprint"] is None:
            built_for["fingerprint"] = None  # the source folder is gone: trust what was built from it
        changed = sorted(k for k in set(request) | set(built_for) if request.get(k) != built_for.get(k))
        if changed:
            return None, f"prepared for other settings ({', '.join(changed)} changed)"
    for track in manifest.get("tracks", []):
        for stem, entry in track["files"].items():
            file = Path(out_dir) / entry["path"]
            if not file.is_file() or file.stat().st_size != entry["bytes"]:
                return None, f"{file} is missing or changed"
    return manifest, ""


def prepare(cfg: dict, out_dir: Path, sample_rate: int, progress: bool = True) -> dict:
    """Prepare cfg's data source at `sample_rate` into `out_dir`; returns the manifest."""
    out_dir = Path(out_dir)
    request = request_of(cfg, sample_rate)
    manifest, why = check_prepared(out_dir, request)
    if manifest is not None:
        print(f"{out_dir}: already prepared ({len(manifest['tracks'])} tracks of {request['source']} at "
              f"{sample_rate} Hz); nothing to do")
        return manifest
    if out_dir.exists():
        print(f"{out_dir}: rebuilding ({why})")
    start = time.perf_counter()
    source = open_source(cfg, progress=progress)  # before atomic_dir: a bad source creates no folder
    tracks, skipped = [], list(source.skipped)
    with atomic_dir(out_dir) as tmp:
        for track in tqdm(source.tracks, desc=f"prepare {source.name} @ {sample_rate} Hz", unit="track",
                          disable=not progress):
            try:
                tracks.append(prepare_track(track, tmp, sample_rate))
            except TrackProblem as problem:
                if not cfg["data"]["skip_invalid"]:
                    raise DataError(f"{source.name}: {problem}") from None
                skipped.append({"name": track.name, "subset": track.subset, "reason": str(problem)})
        splits = {split: [t["name"] for t in tracks if t["split"] == split] for split in ("train", "valid", "test")}
        for split, names in splits.items():
            if not names:
                raise DataError(f"{source.name}: split {split} is empty after skipping invalid tracks "
                                f"({len(skipped)} skipped: {skipped[0]['reason'] if skipped else ''})")
        manifest = build_manifest(request, source, sample_rate, tracks, splits, skipped,
                                  time.perf_counter() - start)
        write_json(tmp / MANIFEST, validate_record("manifest", manifest, Path(out_dir) / MANIFEST))
    seconds = time.perf_counter() - start
    size = sum(f["bytes"] for t in tracks for f in t["files"].values())
    rates = "/".join(map(str, manifest["source_sample_rates"]))
    print(f"{out_dir}: prepared {len(tracks)} tracks ({', '.join(f'{k} {len(v)}' for k, v in splits.items())}"
          f"{f'; {len(skipped)} skipped' if skipped else ''}) from {rates} Hz, {size / 2**20:.1f} MiB "
          f"in {seconds:.1f} s")
    return manifest


def prepare_track(track: SourceTrack, out_root: Path, sample_rate: int) -> dict:
    """Read, check, resample and write one track into out_root/<split>/<name>/; returns its
    manifest entry. Only this track is in memory; a track that fails part-way leaves no folder."""
    stems = read_track_audio(track)  # [5, C, S]
    n_files, channels, _ = stems.shape
    # one resampling call per track: torchaudio builds its sinc kernel on every call
    stems = resample(stems.reshape(n_files * channels, -1), track.rate, sample_rate)
    stems = stems.reshape(n_files, channels, -1)  # [5, C, S']
    folder = out_root / track.split / track.name
    folder.mkdir(parents=True)
    files = {}
    try:
        for stem, audio in zip(STEM_FILES, stems):
            path = folder / f"{stem}.wav"
            sf.write(str(path), audio.T, sample_rate, subtype="FLOAT")
            files[stem] = {"path": f"{track.split}/{track.name}/{stem}.wav", "sha256": sha256(path),
                           "bytes": path.stat().st_size}
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    samples = stems.shape[2]
    return {"name": track.name, "split": track.split, "subset": track.subset, "samples": samples,
            "rate": sample_rate, "channels": channels, "seconds": round(samples / sample_rate, 3),
            "source_rate": track.rate, "source_samples": track.samples, "files": files}


def resample(audio: np.ndarray, orig_rate: int, new_rate: int) -> np.ndarray:
    """float32 [..., S] at orig_rate -> float32 [..., ceil(S * new / orig)] at new_rate (a copy when equal)."""
    if orig_rate == new_rate:
        return audio.copy()
    import torch
    import torchaudio.functional as AF

    with torch.inference_mode():
        out = AF.resample(torch.from_numpy(np.ascontiguousarray(audio)), orig_rate, new_rate, **RESAMPLING)
    return out.numpy().astype(np.float32, copy=False)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def build_manifest(request: dict, source: Source, sample_rate: int, tracks: list[dict],
                   splits: dict, skipped: list[dict], seconds: float) -> dict:
    from importlib.metadata import version

    import tiersep

    return {
        "format": MANIFEST_FORMAT,
        "request": request,
        **source.description,  # source (name), version, root, parser, generator | fingerprint, ...
        "sample_rate": sample_rate,
        "channels": 2,
        "stems": list(STEM_FILES),
        "source_sample_rates": sorted({t["source_rate"] for t in tracks}),
        "splits": splits,
        "tracks": tracks,
        "skipped": skipped,
        "resampling": {"method": "torchaudio.functional.resample", **RESAMPLING},
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(seconds, 3),
        "versions": {"tiersep": tiersep.__version__, "python": platform.python_version(),
                     "numpy": np.__version__, "soundfile": sf.__version__,
                     "libsndfile": sf.__libsndfile_version__, "torchaudio": version("torchaudio"),
                     "musdb": version("musdb"), "stempeg": version("stempeg")},
    }
