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

Only tiersep's own folders are replaced (docs/data.md, "What prepare refuses"): out_dir must be new,
empty, or a prepared set (a valid manifest.json, any settings) holding nothing else; never /, home,
the working directory, the source or a folder around it. The whole check-build-rename runs under
the folder's one-writer lock (tiersep.outputs.exclusive), whose holder first removes temporaries a
killed prepare left, and refuses up front when the disk cannot hold the result.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import math
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import soundfile as sf
from tqdm import tqdm

from tiersep.data.errors import DataError
from tiersep.data.ingest import (SPLITS, STEM_FILES, Source, SourceTrack, TrackProblem, open_source,
                                 read_track_audio, root_fingerprint)
from tiersep.data.synthetic import generator_settings, raw_root, synthetic_root
from tiersep.io import atomic_dir, read_json, write_json
from tiersep.outputs import OutputRefused, exclusive, forbidden, user_entries
from tiersep.records import RecordError, validate_record

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
    if not isinstance(manifest, dict):
        return None, f"{MANIFEST} is not a JSON object"
    if manifest.get("format") != MANIFEST_FORMAT:
        return None, f"manifest format {manifest.get('format')} (this version writes {MANIFEST_FORMAT})"
    if request is not None:
        built_for = dict(manifest.get("request", {}))
        if "fingerprint" in request and request["fingerprint"] is None:
            built_for["fingerprint"] = None  # the source folder is gone: trust what was built from it
        changed = sorted(k for k in set(request) | set(built_for) if request.get(k) != built_for.get(k))
        if changed:
            return None, f"prepared for other settings ({', '.join(changed)} changed)"
    try:
        for track in manifest.get("tracks", []):
            for stem, entry in track["files"].items():
                file = Path(out_dir) / entry["path"]
                if not file.is_file() or file.stat().st_size != entry["bytes"]:
                    return None, f"{file} is missing or changed"
    except (KeyError, TypeError, AttributeError):  # a damaged manifest: rebuild, never a traceback
        return None, f"{MANIFEST} lacks its track files"
    return manifest, ""


def prepare(cfg: dict, out_dir: Path, sample_rate: int, progress: bool = True) -> dict:
    """Prepare cfg's data source at `sample_rate` into `out_dir`; returns the manifest."""
    out_dir = Path(out_dir)
    refuse_out_dir(cfg, out_dir)
    request = request_of(cfg, sample_rate)
    manifest, why = check_prepared(out_dir, request)
    if manifest is not None:
        return _nothing_to_do(out_dir, manifest, request)
    refuse_foreign(out_dir)  # before any work; checked again under the lock
    start = time.perf_counter()
    source = open_source(cfg, progress=progress)  # before the lock: a bad source creates nothing
    try:
        with exclusive(out_dir, "--out"):
            # again, under the lock: a prepare we did not wait for may have finished it meanwhile
            manifest, why = check_prepared(out_dir, request)
            if manifest is not None:
                return _nothing_to_do(out_dir, manifest, request)
            refuse_foreign(out_dir)
            check_free_space(out_dir, estimate_bytes(source.tracks, sample_rate))
            if out_dir.exists():
                print(f"{out_dir}: rebuilding ({why})")
            return _build(cfg, out_dir, request, source, sample_rate, start, progress)
    except OSError as err:  # a folder that cannot be written, a disk that filled up meanwhile, ...
        where = f"{err.filename}: " if err.filename else ""
        raise DataError(f"--out {out_dir}: prepare failed: {where}{err.strerror or err}") from None


def _nothing_to_do(out_dir: Path, manifest: dict, request: dict) -> dict:
    print(f"{out_dir}: already prepared ({len(manifest['tracks'])} tracks of {request['source']} at "
          f"{request['sample_rate']} Hz); nothing to do")
    return manifest


def _build(cfg: dict, out_dir: Path, request: dict, source: Source, sample_rate: int, start: float,
           progress: bool) -> dict:
    tracks, skipped, notes = [], list(source.skipped), []
    # replace=True: refuse_foreign() has just found out_dir empty, new, or a tiersep prepared set
    with atomic_dir(out_dir, replace=True) as tmp:
        for track in tqdm(source.tracks, desc=f"prepare {source.name} @ {sample_rate} Hz", unit="track",
                          disable=not progress):
            try:
                tracks.append(prepare_track(track, tmp, sample_rate, notes))
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
                                  time.perf_counter() - start, notes)
        write_json(tmp / MANIFEST, validate_record("manifest", manifest, Path(out_dir) / MANIFEST))
    seconds = time.perf_counter() - start
    size = sum(f["bytes"] for t in tracks for f in t["files"].values())
    rates = "/".join(map(str, manifest["source_sample_rates"]))
    print(f"{out_dir}: prepared {len(tracks)} tracks ({', '.join(f'{k} {len(v)}' for k, v in splits.items())}"
          f"{f'; {len(skipped)} skipped' if skipped else ''}) from {rates} Hz, {size / 2**20:.1f} MiB "
          f"in {seconds:.1f} s{f'; {len(notes)} note(s) in {MANIFEST}' if notes else ''}")
    return manifest


# ----------------------------------------------------------------------------- what --out may be
def source_root(cfg: dict) -> tuple[str, Path] | None:
    """(what to call it, folder) of the source prepare reads, or None."""
    data = cfg["data"]
    if data["source"] in ("musdb18hq", "musdb18") and data.get("root"):
        return "data.root", Path(data["root"]).expanduser()
    if data["source"] == "synthetic":
        return "the synthetic source folder", synthetic_root(cfg)
    if data["source"] == "musdb-sample":
        return "the musdb-sample source folder", raw_root(cfg) / "musdb-sample"
    return None


def refuse_out_dir(cfg: dict, out_dir: Path) -> None:
    """Refuse (OutputRefused, one line) an --out that can never be a prepared folder: /, home, the
    working directory or an ancestor, a file, or a folder that is, holds or lies in the source."""
    why = forbidden(out_dir)
    if why:
        raise OutputRefused(f"--out {out_dir}: refused, {why}; give a folder of its own, e.g. "
                            f"data/prepared/<source>/<rate>")
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputRefused(f"--out {out_dir}: is a file, not a folder")
    ancestor = nearest_existing(out_dir)
    if not ancestor.is_dir():
        raise OutputRefused(f"--out {out_dir}: cannot be made, {ancestor} is a file")
    named = source_root(cfg)
    if named is None:
        return
    what, root = named
    out_real, root_real = Path(os.path.realpath(out_dir)), Path(os.path.realpath(root))
    if out_real == root_real:
        raise OutputRefused(f"--out {out_dir}: refused, it is {what} ({root}); prepare would replace "
                            "the source with its copy: give another folder, e.g. data/prepared/<source>/<rate>")
    if root_real in out_real.parents:
        raise OutputRefused(f"--out {out_dir}: refused, it is inside {what} ({root}); give a folder "
                            "outside the source")
    if out_real in root_real.parents:
        raise OutputRefused(f"--out {out_dir}: refused, it holds {what} ({root}); give a folder "
                            "outside the source")


def refuse_foreign(out_dir: Path) -> None:
    """Refuse (OutputRefused) an existing folder that is neither empty nor a tiersep prepared set
    holding nothing else: prepare replaces the folder whole, so it must be one tiersep made."""
    if not out_dir.is_dir():
        return
    names = user_entries(out_dir)  # tiersep's stamp and temporary names do not count
    if not names:
        return
    manifest, why = read_prepared_manifest(out_dir)
    if manifest is not None:
        known = {MANIFEST, *SPLITS, *manifest.get("splits", {})}
        names = [n for n in names if n not in known]
        if not names:
            return
        why = ""
    shown = ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    raise OutputRefused(f"--out {out_dir}: holds files tiersep did not make ({shown}{why}); prepare "
                        "replaces its folder whole, so it never writes over them: give a new or empty folder")


def read_prepared_manifest(out_dir: Path) -> tuple[dict | None, str]:
    """(manifest, "") when out_dir/manifest.json is a tiersep manifest record (for any settings);
    otherwise (None, "; why its manifest.json is not tiersep's") or (None, "") without one."""
    path = out_dir / MANIFEST
    if not path.is_file():
        return None, ""
    try:
        manifest = read_json(path)
        validate_record("manifest", manifest, path)
    except (OSError, ValueError, RecordError) as err:
        return None, f"; its {MANIFEST} is not a tiersep manifest: {str(err).splitlines()[0][:160]}"
    if manifest.get("stems") != list(STEM_FILES) or "request" not in manifest:
        return None, f"; its {MANIFEST} is not a tiersep manifest: no request or other stems"
    return manifest, ""


def nearest_existing(path: Path) -> Path:
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


# ----------------------------------------------------------------------------- disk space
WAV_HEADER_BYTES = 4096  # a float WAV's header is ~80 bytes; generous for PEAK/fact chunks
MANIFEST_BYTES_PER_TRACK = 4096  # five paths and hashes per track (~1.5 kB), generously
SPACE_MARGIN = 0.05  # refuse unless need x (1 + margin) + MIN_MARGIN_BYTES fits
MIN_MARGIN_BYTES = 16 * 2**20
# Tests only: pretend this many bytes are free (the refusal cannot be reached on a real disk
# without filling it). Nothing else sets it.
FREE_BYTES_ENV = "TIERSEP_TEST_FREE_BYTES"


def estimate_bytes(tracks: list[SourceTrack], sample_rate: int) -> int:
    """Bytes the prepared folder will take: 5 float32 WAVs per track at the new rate, the manifest."""
    total = 65536
    for track in tracks:
        samples = math.ceil(track.samples * sample_rate / track.rate)
        total += len(STEM_FILES) * (track.channels * samples * 4 + WAV_HEADER_BYTES) + MANIFEST_BYTES_PER_TRACK
    return total


def free_bytes(folder: Path) -> tuple[Path, int]:
    """(the nearest existing folder, its free bytes for an unprivileged writer)."""
    where = nearest_existing(folder)
    if os.environ.get(FREE_BYTES_ENV):
        return where, int(os.environ[FREE_BYTES_ENV])
    return where, shutil.disk_usage(where).free


def check_free_space(out_dir: Path, need: int, free: tuple[Path, int] | None = None,
                     what: str = "the prepared set", label: str | None = None) -> None:
    """Refuse (DataError, one line: `label`, default "--out OUT_DIR") before writing when `need`
    bytes of `what` and a margin do not fit beside `out_dir`. (prepare: the old folder, if any, is
    removed only after the new one is complete, so the new one needs all of it.)"""
    where, available = free or free_bytes(Path(out_dir).parent)
    margin = max(int(need * SPACE_MARGIN), MIN_MARGIN_BYTES)
    if need + margin > available:
        raise DataError(f"{label or f'--out {out_dir}'}: not enough free disk space: {what} needs about "
                        f"{_size(need)} (+ {_size(margin)} margin) but {where} has {_size(available)} free; "
                        "free some space or give --out on another disk")


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


# ----------------------------------------------------------------------------- one track
def prepare_track(track: SourceTrack, out_root: Path, sample_rate: int, notes: list[str] | None = None) -> dict:
    """Read, check, resample and write one track into out_root/<split>/<name>/; returns its
    manifest entry. Only this track is in memory; a track that fails part-way leaves no folder.
    A silent mixture or stem is kept (MUSDB has tracks without vocals) but noted in `notes`."""
    stems = read_track_audio(track)  # [5, C, S]
    for note in silence_notes(track, stems):
        if notes is not None:
            notes.append(note)
        loud = note.split(": ", 1)[1].startswith("mixture")
        tqdm.write(f"tiersep prepare: {'WARNING' if loud else 'warning'}: {note}"
                   f"{'; this track cannot teach the model anything: remove it from the source' if loud else ''}",
                   file=sys.stderr)
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


def silence_notes(track: SourceTrack, stems: np.ndarray) -> list[str]:
    """One line per all-zero file of a track (`<subset>/<name>: vocals is silent (all zeros)`)."""
    return [f"{track.subset}/{track.name}: {stem} is silent (all zeros)"
            for stem, audio in zip(STEM_FILES, stems) if not audio.any()]


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
                   splits: dict, skipped: list[dict], seconds: float, notes: list[str] | None = None) -> dict:
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
        "notes": list(notes or []),  # one line each: silent mixtures and stems (kept, but worth knowing)
        "resampling": {"method": "torchaudio.functional.resample", **RESAMPLING},
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(seconds, 3),
        "versions": {"tiersep": tiersep.__version__, "python": platform.python_version(),
                     "numpy": np.__version__, "soundfile": sf.__version__,
                     "libsndfile": sf.__libsndfile_version__, "torchaudio": version("torchaudio"),
                     "musdb": version("musdb"), "stempeg": version("stempeg")},
    }
