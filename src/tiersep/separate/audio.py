"""Songs in and stems out through ffmpeg and soundfile, in blocks: no song is ever held whole.

- `find_songs`: files and folders (searched recursively) -> the audio files, by suffix.
- `probe`: ffprobe's view of a file (rate, channels, declared duration); a file ffmpeg cannot read,
  an empty file and more than two channels are one-line `SongError`s before any work.
- `Decoder`: ffmpeg decodes the first audio stream (a MUSDB `.stem.mp4`'s mixture is stream 0) to
  32-bit float on a pipe at the file's own rate; read in blocks of [C, n] float32.
- `Encoder`: wav (16/24-bit PCM or float32) and flac through soundfile, mp3 through an ffmpeg pipe,
  into the path it is given (the caller's temporary name).
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf

from tiersep.config import ConfigError

# What a folder is searched for (case-insensitive); a file named on the command line is tried
# whatever its suffix.
SUFFIXES = (".wav", ".flac", ".ogg", ".oga", ".opus", ".mp3", ".m4a", ".aac", ".mp4", ".aif", ".aiff")
FORMATS = ("wav", "flac", "mp3")
BITS = ("16", "24", "32f")
SUBTYPES = {"16": "PCM_16", "24": "PCM_24", "32f": "FLOAT"}
MP3_BITRATE = "320k"            # demucs's default --mp3-bitrate
# A decoded song shorter than its header's duration by more than this is noted as truncated
# (VBR files without a duration header are estimated by ffprobe, hence the slack).
TRUNCATION_SLACK_S = 1.0
# A failed write with less free than this on the file's disk is a full disk
FULL_DISK_BYTES = 1 << 20


class SongError(Exception):
    """One song cannot be separated; the message is one line naming the file."""


@dataclass
class AudioInfo:
    path: Path
    rate: int
    channels: int
    seconds: float | None      # declared by the file (ffprobe), not yet decoded
    codec: str


def song_name(path: Path) -> str:
    """The song's name in output paths: the file name without its audio suffix(es)."""
    name = path.name
    for suffix in (".stem.mp4", *SUFFIXES):
        if name.lower().endswith(suffix) and len(name) > len(suffix):
            return name[:-len(suffix)]
    return path.stem or name


def find_songs(inputs: list[str], skip: Path | None = None) -> list[Path]:
    """The audio files of `inputs` (files as given, folders searched recursively, sorted), each once,
    none from inside `skip` (the output folder: earlier stems are not songs). A missing input, an
    unreadable folder or a folder without audio files is a ConfigError (one line)."""
    songs: list[Path] = []
    skip = os.path.realpath(skip) + os.sep if skip is not None else None
    for given in inputs:
        path = Path(given).expanduser()
        if path.is_dir():
            try:
                found = sorted(p for p in path.rglob("*") if p.suffix.lower() in SUFFIXES and p.is_file()
                               and not p.name.startswith(".")
                               and not (skip and os.path.realpath(p).startswith(skip)))
            except OSError as err:
                raise ConfigError(f"INPUT {given}: cannot read it ({err.strerror or err})") from None
            if not found:
                raise ConfigError(f"INPUT {given}: a folder without audio files (looked for "
                                  f"{', '.join(SUFFIXES)}, in subfolders too)")
            songs += found
        elif path.is_file():
            songs.append(path)
        else:
            raise ConfigError(f"INPUT {given}: no such file or folder")
    unique = {}
    for song in songs:
        unique.setdefault(os.path.realpath(song), song)
    return list(unique.values())


def _ffprobe(path: Path) -> dict:
    cmd = ["ffprobe", "-v", "error", "-select_streams", "a:0", "-show_entries",
           "stream=sample_rate,channels,codec_name,duration:format=duration,format_name", "-of", "json", str(path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
    if proc.returncode != 0:
        raise SongError(f"{path}: not an audio file ffmpeg can read ({_last_line(proc.stderr, path)})")
    try:
        return json.loads(proc.stdout)
    except ValueError:
        raise SongError(f"{path}: ffprobe gave no readable description") from None


def probe(path: Path) -> AudioInfo:
    """What the file says it holds (SongError when it is empty, unreadable, or not mono/stereo)."""
    try:
        size = path.stat().st_size
    except OSError as err:
        raise SongError(f"{path}: cannot read it ({err.strerror or err})") from None
    if size == 0:
        raise SongError(f"{path}: the file is empty (0 bytes)")
    info = _ffprobe(path)
    streams = info.get("streams") or []
    if not streams:
        raise SongError(f"{path}: has no audio stream")
    stream = streams[0]
    rate, channels = int(stream.get("sample_rate") or 0), int(stream.get("channels") or 0)
    if rate <= 0 or channels <= 0:
        raise SongError(f"{path}: holds no audio (sample rate {rate}, {channels} channels)")
    if channels > 2:
        raise SongError(f"{path}: has {channels} channels; tiersep separates mono and stereo songs "
                        f"(down-mix it first, e.g. ffmpeg -i IN -ac 2 OUT.wav)")
    declared = stream.get("duration") or (info.get("format") or {}).get("duration")
    try:
        seconds = float(declared) if declared not in (None, "N/A") else None
    except ValueError:
        seconds = None
    return AudioInfo(path, rate, channels, seconds, str(stream.get("codec_name", "?")))


class Decoder:
    """Iterate a song as float32 blocks [C, n] at its own rate (ffmpeg on a pipe). After the loop:
    `frames` decoded and `notes` (decode errors ffmpeg recovered from, a truncated file). A failed
    decode, or one that yields nothing, is a SongError."""

    def __init__(self, info: AudioInfo, block_frames: int):
        self.info, self.block_frames = info, block_frames
        self.frames, self.notes = 0, []

    def __iter__(self):
        info = self.info
        cmd = ["ffmpeg", "-v", "error", "-nostdin", "-i", str(info.path), "-map", "0:a:0", "-vn",
               "-f", "f32le", "-acodec", "pcm_f32le", "-ac", str(info.channels), "-"]
        frame_bytes = 4 * info.channels
        # ffmpeg's messages go to a file: a pipe could fill up and stall it
        with tempfile.TemporaryFile() as errors:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errors, stdin=subprocess.DEVNULL)
            try:
                while True:
                    data = _read_exactly(proc.stdout, self.block_frames * frame_bytes)
                    usable = len(data) - len(data) % frame_bytes
                    if usable:
                        self.frames += usable // frame_bytes
                        yield np.frombuffer(data[:usable], dtype="<f4").reshape(-1, info.channels).T
                    if len(data) < self.block_frames * frame_bytes:
                        break
                code = proc.wait()
            finally:
                if proc.poll() is None:       # the consumer stopped early (an error downstream)
                    proc.kill()
                    proc.wait()
                proc.stdout.close()
            errors.seek(0)
            text = errors.read().decode(errors="replace")
        if code != 0:
            raise SongError(f"{info.path}: ffmpeg could not decode it ({_last_line(text, info.path)})")
        if self.frames == 0:
            raise SongError(f"{info.path}: decodes to no audio samples")
        if text.strip():
            lines = [line for line in text.splitlines() if line.strip()]
            self.notes.append(f"ffmpeg reported {len(lines)} decode error(s) and went on "
                              f"({_last_line(text, info.path)})")
        decoded = self.frames / info.rate
        if info.seconds is not None and decoded < info.seconds - TRUNCATION_SLACK_S:
            self.notes.append(f"decoded {decoded:.2f} s, but the file declares {info.seconds:.2f} s "
                              "(truncated?)")


def _read_exactly(stream, count: int) -> bytes:
    parts, got = [], 0
    while got < count:
        part = stream.read(count - got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def _last_line(text: str, path: Path) -> str:
    """ffmpeg's last message, without the file name it repeats, shortened to one line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    line = lines[-1] if lines else "no message"
    line = line.replace(f"{path}: ", "")
    return line[:200]


def write_failure(path: Path, detail: str) -> SongError:
    """Why writing `path` failed, in words: libsndfile says only "System error." for a full disk."""
    folder = path.parent
    try:
        stats = os.statvfs(folder)
        free = stats.f_bavail * stats.f_frsize
    except OSError:
        free = None
    if free is not None and free < FULL_DISK_BYTES:
        return SongError(f"{path}: no space left on {folder} ({free // 1024} KiB free); free some space or "
                         "give --out on another disk")
    import resource

    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        return SongError(f"{path}: cannot write it ({detail}); the file size limit of this process is "
                         f"{limit} bytes (ulimit -f)")
    return SongError(f"{path}: cannot write it ({detail})")


class Encoder:
    """Write [C, n] float32 blocks to `path` as `fmt` (wav, flac, mp3) with `bits` (16, 24, 32f;
    flac takes 16 or 24, mp3 ignores it). Samples are written as given: the caller clips. A failed
    write is a SongError naming `shown` (the final path; default `path`) and the cause."""

    def __init__(self, path: Path, fmt: str, bits: str, rate: int, channels: int, shown: Path | None = None):
        self.path, self.fmt, self.shown = Path(path), fmt, Path(shown or path)
        self.proc = self.file = None
        if fmt == "mp3":
            cmd = ["ffmpeg", "-v", "error", "-nostdin", "-y", "-f", "f32le", "-ar", str(rate), "-ac",
                   str(channels), "-i", "pipe:0", "-c:a", "libmp3lame", "-b:a", MP3_BITRATE, "-f", "mp3",
                   str(self.path)]
            self.errors = tempfile.TemporaryFile()
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=self.errors)
        else:
            try:
                self.file = sf.SoundFile(str(self.path), "w", samplerate=rate, channels=channels,
                                         subtype=SUBTYPES[bits], format=fmt.upper())
            except sf.SoundFileRuntimeError as err:
                raise write_failure(self.shown, str(err)) from None

    def write(self, block: np.ndarray) -> None:
        frames = np.ascontiguousarray(np.asarray(block, dtype=np.float32).T)    # [n, C]
        if self.proc is not None:
            try:
                self.proc.stdin.write(frames.astype("<f4", copy=False).tobytes())
            except BrokenPipeError:
                self.close()          # raises with ffmpeg's message
        else:
            try:
                self.file.write(frames)
            except sf.SoundFileRuntimeError as err:
                raise write_failure(self.shown, str(err)) from None

    def close(self) -> None:
        if self.file is not None:
            file, self.file = self.file, None
            try:
                file.close()
            except sf.SoundFileRuntimeError as err:
                raise write_failure(self.shown, str(err)) from None
        if self.proc is not None:
            proc, self.proc = self.proc, None
            try:
                proc.stdin.close()
            except BrokenPipeError:
                pass
            code = proc.wait()
            self.errors.seek(0)
            text = self.errors.read().decode(errors="replace")
            self.errors.close()
            if code != 0:
                message = _last_line(text, self.path)
                if "No space left" in message or "File too large" in message:
                    raise write_failure(self.shown, message)
                raise SongError(f"{self.shown}: ffmpeg could not encode mp3 ({message})")

    def abort(self) -> None:
        """Stop without caring for the result (the caller removes the file)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
            self.errors.close()
        if self.file is not None:
            file, self.file = self.file, None
            try:
                file.close()
            except sf.SoundFileRuntimeError:
                pass          # a full disk fails the header's last write too; the file goes anyway
