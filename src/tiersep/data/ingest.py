"""Find, check and read the tracks of a source (synthetic, musdb18hq, musdb18, musdb-sample).

The real `musdb` parser decides which tracks exist and the split (musdb's official train/valid
split of the train subset, unless `data.valid_tracks` names the validation tracks; the synthetic
set names its own). musdb is lenient where we must not be: it silently drops a missing stem file,
returns zero tracks for an empty root, and decodes through ffmpeg to 16-bit PCM (quantising float
WAVs, about 250x slower than soundfile). So every track folder is checked here first (files,
channels, rates, lengths; NaN/Inf when read), and audio is read from the files musdb lists with
soundfile (WAV) or stempeg (stems .mp4, musdb's own decoder) at full precision.

A user's folder may be at any sample rate (studio stems at 48 or 96 kHz, say), track by track:
prepare resamples each track once from its own rate. Only the files of one track must agree.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import soundfile as sf

from tiersep.data.errors import DataError
from tiersep.data.synthetic import ensure_synthetic, generator_settings, publish_dir, raw_root
from tiersep.outputs import exclusive
from tiersep.data.tracks import BASE_STEMS

STEM_FILES = ("mixture", *BASE_STEMS)  # MUSDB files; stem index in .stem.mp4
SPLITS = ("train", "valid", "test")
DOWNLOAD_TIMEOUT_S = 60.0  # per socket operation of the musdb-sample download
DECODER_SLACK = 2048  # an AAC decode may end this many samples short of the stream length (padded)


class TrackProblem(Exception):
    """One track that cannot be used; the message names the track and the file."""


@dataclass
class SourceTrack:
    name: str
    subset: str  # musdb subset: train | test
    split: str  # train | valid | test
    is_wav: bool
    path: Path  # the track folder (wav) or the .stem.mp4 file
    rate: int
    samples: int  # the true length (for .stem.mp4: the stream length, decoder padding removed)
    channels: int = 2

    def file(self, stem: str) -> Path:
        return self.path / f"{stem}.wav" if self.is_wav else self.path


@dataclass
class Source:
    name: str
    root: Path
    is_wav: bool
    expected_rate: int | None  # None: any rate, as long as each track's files agree
    description: dict  # manifest fields: source (name), version, root, parser, generator | fingerprint
    tracks: list[SourceTrack] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)


# ----------------------------------------------------------------------------- ffmpeg, musdb
def require_ffmpeg() -> None:
    """musdb and museval import stempeg, which needs ffmpeg and ffprobe on PATH even for WAVs."""
    missing = [tool for tool in ("ffmpeg", "ffprobe") if shutil.which(tool) is None]
    if missing:
        raise DataError(f"{' and '.join(missing)} not found on PATH; musdb needs ffmpeg and ffprobe "
                        "(install them with `apt-get install ffmpeg`, `conda install -c conda-forge "
                        "ffmpeg` or `brew install ffmpeg`)")


def import_musdb():
    require_ffmpeg()
    import musdb

    return musdb


def musdb_version() -> str:
    from importlib.metadata import version

    return version("musdb")


# ----------------------------------------------------------------------------- the sources
def open_source(cfg: dict, progress: bool = True) -> Source:
    """Resolve `cfg["data"]["source"]` to a folder, parse it with musdb, check every track."""
    data = cfg["data"]
    name = data["source"]
    valid_names = data["valid_tracks"]
    if name == "synthetic":
        root, info = ensure_synthetic(cfg, progress=progress)
        settings = generator_settings(cfg)
        description = {"source": name, "version": f"tiersep.data.synthetic v{settings['version']}",
                       "root": str(root.resolve()), "generator": settings,
                       "valid_tracks_from": "data.valid_tracks" if valid_names else "generator"}
        valid_names = valid_names or info["valid_tracks"]
        source = Source(name, root, True, settings["sample_rate"], description)
    elif name in ("musdb18hq", "musdb18"):
        root = Path(data["root"]).expanduser()
        is_wav = name == "musdb18hq"
        description = {"source": name, "version": "MUSDB18-HQ (wav)" if is_wav else "MUSDB18 (stems .mp4)",
                       "root": str(root.resolve()), "fingerprint": root_fingerprint(root, is_wav),
                       "valid_tracks_from": "data.valid_tracks" if valid_names else "musdb official split"}
        source = Source(name, root, is_wav, None, description)
    elif name == "musdb-sample":
        root = ensure_musdb_sample(cfg)
        description = {"source": name, "version": "MUSDB18 7-second preview (stems .mp4)",
                       "root": str(root.resolve()),
                       "valid_tracks_from": "data.valid_tracks" if valid_names else "musdb official split"}
        source = Source(name, root, False, None, description)
    else:  # the schema forbids it; kept for callers that bypass it
        raise DataError(f"data.source: unknown source {name!r}")
    description["parser"] = f"musdb {musdb_version()}"
    scan(source, valid_names, data["skip_invalid"])
    return source


def root_fingerprint(root: Path, is_wav: bool) -> str:
    """A cheap identity of a user's dataset folder: every track file's relative path and size. A
    broken or looping symlink is recorded as such (not followed): the track check reports it."""
    if not root.is_dir():
        raise DataError(f"data.root: {root} does not exist or is not a folder")
    entries = []
    try:
        for subset in ("train", "test"):
            folder = root / subset
            if not folder.is_dir():
                continue
            for track in sorted(os.scandir(folder), key=lambda e: e.name):
                if is_wav and _entry_is_dir(track):
                    try:
                        files = sorted(os.scandir(track.path), key=lambda e: e.name)
                    except PermissionError:  # one unreadable track: check_wav_track reports it
                        entries.append(f"{subset}/{track.name}:unreadable")
                        continue
                    for f in files:
                        entries.append(f"{subset}/{track.name}/{f.name}:{_entry_size(f)}")
                elif not is_wav and track.name.endswith(".stem.mp4"):
                    entries.append(f"{subset}/{track.name}:{_entry_size(track)}")
    except OSError as err:  # an unreadable folder: one line, not a traceback
        raise DataError(f"data.root: cannot read {err.filename or root} ({err.strerror or err})") from None
    return hashlib.sha256("\n".join(entries).encode()).hexdigest()[:16]


def _entry_is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()
    except OSError:  # a symlink loop (ELOOP): not a track folder
        return False


def _entry_size(entry: os.DirEntry) -> int | str:
    try:
        return entry.stat().st_size
    except OSError:
        if entry.is_symlink():
            return "broken-link"  # dangling or looping; check_wav_track / check_stem_track name it
        raise


def broken_link(path: Path) -> str | None:
    """Why `path` is a symlink that leads nowhere ("a broken symlink to X", "a symlink loop"), or None."""
    try:
        if not path.is_symlink():
            return None
    except OSError:  # an unreadable folder: the caller's next look says so
        return None
    try:
        os.stat(path)
        return None
    except OSError as err:
        if err.errno == errno.ELOOP:
            return "a symlink loop (it leads back to itself)"
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        return f"a broken symlink (to {target}: {err.strerror or err})"


def ensure_musdb_sample(cfg: dict) -> Path:
    """musdb's 7-second preview set, downloaded once to <raw>/musdb-sample. The download goes to a
    temporary folder that is removed on failure, so an offline attempt leaves nothing behind."""
    root = raw_root(cfg) / "musdb-sample"
    if (root / "train").is_dir() and (root / "test").is_dir():
        return root
    musdb = import_musdb()
    import yaml

    url = yaml.safe_load((Path(musdb.__path__[0]) / "configs" / "mus.yaml").read_text())["sample-url"]
    tmp = Path(tempfile.mkdtemp(prefix="tiersep-musdb-sample-"))
    previous_timeout = socket.getdefaulttimeout()
    try:
        socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)  # musdb calls urlopen without a timeout
        try:
            musdb.DB(root=str(tmp), download=True)
        except Exception as err:  # URLError, timeout, HTTP error, bad zip: all mean "no sample set"
            reason = getattr(err, "reason", None) or err
            raise DataError(f"data.source musdb-sample: could not download the MUSDB18 7-second preview "
                            f"from {url} ({type(err).__name__}: {reason}); it needs internet access. "
                            "Offline, use data.source: synthetic (the default), or point data.root at a "
                            "local MUSDB18-HQ (data.source: musdb18hq) or MUSDB18 (data.source: musdb18)"
                            ) from None
        socket.setdefaulttimeout(previous_timeout)
        root.parent.mkdir(parents=True, exist_ok=True)
        # under the folder's lock, whose holder removes the staging folders a killed run left
        with exclusive(root, "data.source musdb-sample", wait=True):
            staging = Path(tempfile.mkdtemp(prefix=".musdb-sample.", suffix=".tmp", dir=root.parent))
            try:
                shutil.move(str(tmp), str(staging / "set"))  # a copy when the temp dir is another filesystem
                publish_dir(staging / "set", root, lambda p: (p / "train").is_dir() and (p / "test").is_dir())
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        return root
    finally:
        socket.setdefaulttimeout(previous_timeout)
        shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------- checking tracks
def candidates(root: Path, subset: str, is_wav: bool) -> list[tuple[str, Path]]:
    """(track name, path) of every track under root/subset, as musdb would see them."""
    folder = root / subset
    if not folder.is_dir():
        return []
    if is_wav:
        return [(p.name, p) for p in sorted(folder.iterdir()) if p.is_dir()]
    return [(p.name[: -len(".stem.mp4")], p) for p in sorted(folder.iterdir())
            if p.name.endswith(".stem.mp4") and (p.is_file() or p.is_symlink())]


def check_wav_track(name: str, folder: Path, expected_rate: int | None, source: str) -> tuple[int, int]:
    """Header checks of one MUSDB18-HQ track folder; returns (rate, samples) or raises TrackProblem."""
    infos = {}
    for stem in STEM_FILES:
        path = folder / f"{stem}.wav"
        link = broken_link(path)
        if link:
            raise TrackProblem(f"track {name!r}: stem file {path} is {link}")
        try:
            present = path.is_file()
        except OSError as err:  # an unreadable track folder
            raise TrackProblem(f"track {name!r}: cannot read {path} ({err.strerror or err})") from None
        if not present:
            raise TrackProblem(f"track {name!r}: missing stem file {path}")
        try:
            infos[stem] = sf.info(str(path))
        except Exception as err:  # libsndfile's error for a corrupt or non-audio file
            raise TrackProblem(f"track {name!r}: cannot read {path} ({str(err).strip() or type(err).__name__})") from None
    return check_streams(name, {stem: (folder / f"{stem}.wav", i.channels, i.samplerate, i.frames)
                                for stem, i in infos.items()}, expected_rate, source)


def check_stem_track(name: str, path: Path, expected_rate: int | None, source: str) -> tuple[int, int]:
    """ffprobe checks of one MUSDB18 .stem.mp4 (5 streams: mixture, drums, bass, other, vocals)."""
    import stempeg

    link = broken_link(path)
    if link:
        raise TrackProblem(f"track {name!r}: {path} is {link}")
    try:
        info = stempeg.Info(str(path))
    except Exception as err:
        stderr = getattr(err, "stderr", b"") or b""
        detail = stderr.decode(errors="replace").strip().splitlines()[-1:] or [type(err).__name__]
        raise TrackProblem(f"track {name!r}: cannot read {path} ({detail[0]})") from None
    if info.nb_audio_streams != len(STEM_FILES):
        raise TrackProblem(f"track {name!r}: {path} has {info.nb_audio_streams} audio streams, expected "
                           f"{len(STEM_FILES)} ({', '.join(STEM_FILES)}); a stem is missing")
    # duration x rate, not duration_ts: the latter counts in the stream's time base, not samples
    streams = {stem: (Path(f"{path}[{stem}]"), info.channels(k), info.sample_rate(k),
                      int(round(info.duration(k) * info.sample_rate(k))))
               for k, stem in enumerate(STEM_FILES)}
    return check_streams(name, streams, expected_rate, source)


def check_streams(name: str, streams: dict, expected_rate: int | None, source: str) -> tuple[int, int]:
    """streams: stem -> (path, channels, rate, samples). The same rules for WAV files and mp4 streams:
    stereo, one rate and one length per track; that rate is `expected_rate` unless it is None."""
    mix_path, _, mix_rate, mix_samples = streams["mixture"]
    for stem, (path, channels, rate, samples) in streams.items():
        if channels != 2:
            kind = {1: "mono (1 channel)"}.get(channels, f"{channels} channels")
            raise TrackProblem(f"track {name!r}: {path} is {kind}; MUSDB stems must be stereo (2 channels)")
        if rate != mix_rate:
            raise TrackProblem(f"track {name!r}: mixed sample rates: {path} is {rate} Hz but "
                               f"{mix_path.name} is {mix_rate} Hz")
        if samples != mix_samples:
            raise TrackProblem(f"track {name!r}: stem length mismatch: {path} has {samples} samples but "
                               f"{mix_path.name} has {mix_samples}")
    if expected_rate is not None and mix_rate != expected_rate:
        raise TrackProblem(f"track {name!r}: wrong sample rate: {mix_path} is {mix_rate} Hz, expected "
                           f"{expected_rate} Hz for source {source}")
    if mix_samples <= 0:
        raise TrackProblem(f"track {name!r}: {mix_path} has no samples")
    return mix_rate, mix_samples


def scan(source: Source, valid_names: list[str] | None, skip_invalid: bool) -> None:
    """Check every track folder, then let musdb parse the good ones and assign the splits."""
    root, is_wav = source.root, source.is_wav
    if not root.is_dir():
        raise DataError(f"data.root: {root} does not exist or is not a folder")
    layout = ("<subset>/<Artist - Title>/{mixture,drums,bass,other,vocals}.wav" if is_wav
              else "<subset>/<Artist - Title>.stem.mp4")
    try:
        found = {subset: candidates(root, subset, is_wav) for subset in ("train", "test")}
    except OSError as err:  # an unreadable subset folder
        raise DataError(f"data.root: cannot read {err.filename or root} ({err.strerror or err})") from None
    if not any(found.values()):
        hint = ""
        if is_wav and any(candidates(root, s, False) for s in ("train", "test")):
            hint = "; it holds .stem.mp4 files: use data.source musdb18"
        elif not is_wav and any(candidates(root, s, True) for s in ("train", "test")):
            hint = "; it holds track folders: use data.source musdb18hq"
        raise DataError(f"{source.name}: no tracks under {root} (empty root; expected {root}/{layout} "
                        f"for subsets train and test){hint}")
    good: dict[str, dict[str, tuple[Path, int, int]]] = {"train": {}, "test": {}}
    for subset, tracks in found.items():
        for name, path in tracks:
            try:
                check = check_wav_track if is_wav else check_stem_track
                rate, samples = check(name, path, source.expected_rate, source.name)
            except TrackProblem as problem:
                if not skip_invalid:
                    raise DataError(f"{source.name}: {problem}") from None
                source.skipped.append({"name": name, "subset": subset, "reason": str(problem)})
                continue
            good[subset][name] = (path, rate, samples)

    splits = musdb_splits(source, good, valid_names)
    for split in SPLITS:
        if not splits[split]:
            raise DataError(empty_split_message(source, split, found, valid_names))
        for name in splits[split]:
            subset = "test" if split == "test" else "train"
            path, rate, samples = good[subset][name]
            source.tracks.append(SourceTrack(name, subset, split, is_wav, path, rate, samples))


def empty_split_message(source: Source, split: str, found: dict, valid_names) -> str:
    subset = "test" if split == "test" else "train"
    n_skipped = sum(1 for s in source.skipped if s["subset"] == subset)
    skipped = f" ({n_skipped} {subset} tracks skipped as invalid)" if n_skipped else ""
    if split == "valid" and valid_names is None:
        return (f"{source.name}: split valid is empty: none of musdb's official validation tracks "
                f"(e.g. 'Actions - One Minute Smile') is under {source.root / 'train'}{skipped}; name the "
                "validation tracks in data.valid_tracks")
    if split == "train" and not (found["train"]):
        return f"{source.name}: split train is empty: no tracks under {source.root / 'train'}"
    return (f"{source.name}: split {split} is empty: no usable tracks for it under "
            f"{source.root / subset}{skipped}")


@contextlib.contextmanager
def musdb_view(source: Source, good: dict) -> Iterator[Path]:
    """The root musdb should parse: the real one, or (when tracks were skipped) a temporary folder
    of links to the good tracks only, because musdb runs ffprobe on every mixture it lists and a
    corrupt one would stop it."""
    if not source.skipped:
        yield source.root
        return
    with tempfile.TemporaryDirectory(prefix="tiersep-musdb-view-") as tmp:
        for subset, tracks in good.items():
            (Path(tmp) / subset).mkdir()
            for path, _rate, _samples in tracks.values():
                os.symlink(path.resolve(), Path(tmp) / subset / path.name)
        yield Path(tmp)


def musdb_splits(source: Source, good: dict, valid_names: list[str] | None) -> dict[str, list[str]]:
    """Track names per split as musdb parses them (official valid split or `valid_names`)."""
    musdb = import_musdb()
    with musdb_view(source, good) as root:
        def names(**kwargs) -> list[str]:
            return [t.name for t in musdb.DB(root=str(root), is_wav=source.is_wav, **kwargs)]

        test = names(subsets="test")
        if valid_names is None:
            train, valid = names(subsets="train", split="train"), names(subsets="train", split="valid")
        else:
            all_train = names(subsets="train")
            skipped = {s["name"] for s in source.skipped if s["subset"] == "train"}  # already reported
            unknown = [n for n in valid_names if n not in all_train and n not in skipped]
            if unknown:
                raise DataError(f"data.valid_tracks: {', '.join(map(repr, unknown))} not found under "
                                f"{source.root / 'train'} (train tracks: {', '.join(map(repr, all_train[:5]))}"
                                f"{', ...' if len(all_train) > 5 else ''})")
            valid = [n for n in all_train if n in valid_names]
            train = [n for n in all_train if n not in valid_names]
    for subset, listed in (("train", train + valid), ("test", test)):
        if sorted(listed) != sorted(good[subset]):  # musdb and our scan must agree
            extra = sorted(set(listed) ^ set(good[subset]))
            raise DataError(f"{source.name}: musdb parsed a different set of {subset} tracks than found "
                            f"under {source.root / subset} (differing: {', '.join(map(repr, extra[:5]))})")
    return {"train": train, "valid": valid, "test": test}


# ----------------------------------------------------------------------------- reading audio
def read_track_audio(track: SourceTrack) -> np.ndarray:
    """All five files of a track (mixture, drums, bass, other, vocals) as float32 [5, C, S],
    S = the track's true length; raises TrackProblem for unreadable audio and NaN/Inf samples."""
    if track.is_wav:
        audio = np.stack([read_wav(track, stem) for stem in STEM_FILES])
    else:
        audio = decode_stems(track)
    for stem, part in zip(STEM_FILES, audio):
        finite = np.isfinite(part)
        if not finite.all():
            first = int(np.argmin(finite.all(axis=0)))
            where = track.file(stem) if track.is_wav else f"{track.path}[{stem}]"
            raise TrackProblem(f"track {track.name!r}: {where} contains NaN or Inf samples (first at sample {first})")
    return audio


def read_wav(track: SourceTrack, stem: str) -> np.ndarray:
    path = track.file(stem)
    try:
        audio = sf.read(str(path), dtype="float32", always_2d=True)[0].T  # [S, C] -> [C, S]
    except Exception as err:
        raise TrackProblem(f"track {track.name!r}: cannot read {path} ({err})") from None
    if audio.shape[1] != track.samples:
        raise TrackProblem(f"track {track.name!r}: {path} holds {audio.shape[1]} samples, its header "
                           f"says {track.samples} (truncated file?)")
    return audio


def decode_stems(track: SourceTrack) -> np.ndarray:
    """Decode the five streams of a .stem.mp4 with stempeg (as musdb does, but to float32, not
    16-bit, and in one call: stempeg probes the file on every call), trimmed to the streams' true
    length: AAC decoding adds padding at the end. -> float32 [5, C, S]."""
    import stempeg

    try:
        audio, _rate = stempeg.read_stems(str(track.path), dtype=np.float32, ffmpeg_format="f32le",
                                          always_3d=True)  # [5, S', C]
    except Exception as err:
        raise TrackProblem(f"track {track.name!r}: cannot decode {track.path} ({err})") from None
    audio = np.ascontiguousarray(audio.transpose(0, 2, 1))  # [5, C, S']
    short = track.samples - audio.shape[2]
    if short > DECODER_SLACK:
        raise TrackProblem(f"track {track.name!r}: {track.path} decodes to {audio.shape[2]} samples, "
                           f"its streams say {track.samples} (stem length mismatch or damaged file)")
    if short > 0:
        audio = np.pad(audio, ((0, 0), (0, 0), (0, short)))
    return audio[:, :, : track.samples]
