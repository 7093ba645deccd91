"""Reading a prepared folder (see prepare.py for its layout): the manifest, track names, whole
tracks (evaluation) and partial reads at any offset (training segments; soundfile seeks, so a
segment costs its own length, not the track's)."""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import soundfile as sf

from tiersep.data.errors import DataError
from tiersep.io import read_json

SPLITS = ("train", "valid", "test")
BASE_STEMS = ("drums", "bass", "other", "vocals")  # the MUSDB stems; their sum is the mixture
DERIVED_STEMS = {"accompaniment": ("drums", "bass", "other")}  # musdb's targets built from stems


def load_manifest(prepared_dir) -> dict:
    path = Path(prepared_dir) / "manifest.json"
    try:
        return read_json(path)
    except FileNotFoundError:
        raise DataError(f"{path}: not found; is {prepared_dir} a folder written by `tiersep prepare`?") from None
    except (OSError, ValueError) as err:
        raise DataError(f"{path}: unreadable ({err})") from None


@functools.lru_cache(maxsize=32)
def _cached_manifest(prepared_dir: str, mtime_ns: int) -> dict:
    return load_manifest(prepared_dir)


def manifest_of(prepared_dir) -> dict:
    """load_manifest, cached per process while the file is unchanged (loaders call this often)."""
    path = Path(prepared_dir) / "manifest.json"
    try:
        mtime = path.stat().st_mtime_ns
    except FileNotFoundError:
        return load_manifest(prepared_dir)  # raises the clear error
    return _cached_manifest(str(Path(prepared_dir)), mtime)


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r} (one of {', '.join(SPLITS)})")


def track_names(prepared_dir, split: str) -> list[str]:
    check_split(split)
    return list(manifest_of(prepared_dir)["splits"][split])


def track_samples(prepared_dir, split: str) -> dict[str, int]:
    """name -> length in samples, for the tracks of one split."""
    check_split(split)
    return {t["name"]: t["samples"] for t in manifest_of(prepared_dir)["tracks"] if t["split"] == split}


def check_sources(sources) -> None:
    known = set(BASE_STEMS) | set(DERIVED_STEMS)
    unknown = [s for s in sources if s not in known]
    if unknown:
        raise DataError(f"model.sources: {', '.join(map(repr, unknown))} not in a MUSDB prepared folder "
                        f"(available: {', '.join(sorted(known))})")


def stem_path(prepared_dir, split: str, name: str, stem: str) -> Path:
    return Path(prepared_dir) / split / name / f"{stem}.wav"


def read_file(path: Path, start: int = 0, frames: int = -1) -> np.ndarray:
    """float32 [C, frames] from `start`; zero-padded past the end of the file."""
    try:
        audio = sf.read(str(path), start=start, frames=frames, dtype="float32", always_2d=True)[0].T
    except Exception as err:
        raise DataError(f"{path}: cannot read ({err})") from None
    if frames >= 0 and audio.shape[1] < frames:
        audio = np.pad(audio, ((0, 0), (0, frames - audio.shape[1])))
    return np.ascontiguousarray(audio)


def read_stem(prepared_dir, split: str, name: str, stem: str, start: int = 0, frames: int = -1) -> np.ndarray:
    """One stem (or a derived one, e.g. accompaniment) as float32 [C, frames]."""
    if stem in DERIVED_STEMS:
        parts = [read_stem(prepared_dir, split, name, s, start, frames) for s in DERIVED_STEMS[stem]]
        return np.sum(parts, axis=0, dtype=np.float32)
    return read_file(stem_path(prepared_dir, split, name, stem), start, frames)


def read_track(prepared_dir, split: str, name: str, sources) -> tuple[np.ndarray, np.ndarray]:
    """A whole track: (mixture float32 [C, S], stems float32 [n_src, C, S]) in `sources` order."""
    check_split(split)
    check_sources(sources)
    if name not in track_samples(prepared_dir, split):
        raise DataError(f"{prepared_dir}: no track {name!r} in split {split}")
    mixture = read_stem(prepared_dir, split, name, "mixture")
    stems = np.stack([read_stem(prepared_dir, split, name, s) for s in sources])
    return mixture, stems
