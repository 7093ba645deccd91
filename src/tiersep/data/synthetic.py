"""A deterministic synthetic MUSDB18-HQ: small, musically structured, separable, made anywhere.

Writes the real MUSDB18-HQ layout, `root/{train,test}/<Artist - Title>/{mixture,drums,bass,other,
vocals}.wav` (stereo, float32 WAV so that mixture.wav is *exactly* the float32 sum of the four stem
files), which `ingest` then reads through the real `musdb` parser like any user's MUSDB18-HQ.

Each track draws its own tempo, key, mode, chord progression, voice range, panning and gains, and
verse / chorus sections of four bars. As in MUSDB18's full mixes, all four stems play through the
whole track and their silences are short (at most MAX_REST_S): a drum stop or bass rest ending a
phrase, a vocal breath. So museval's SiSEC protocol, which drops every 1 s frame in which a
reference stem is silent, scores (nearly) every frame.
- drums: kick / snare / hi-hat on a 16th-note grid (noise and pitched transients), busier in a
  chorus (extra kicks, 16th and open hats, a crash), tom fills and stops at phrase ends;
- bass: low harmonic notes on the chord roots, fifths and octaves;
- vocals: a harmonic voice singing two-bar phrases (higher in a chorus) with glides, vibrato,
  vowel formants, consonant bursts and breaths;
- other: sustained chord pads and/or plucked arpeggios (both in a chorus).
The stems differ in timbre, register and rhythm, so a separator can learn them.

Where it lives: `<data.prepared_dir>/../raw/synthetic-<key>/`, key = hash of the generator
settings (seed, rate, sizes, generator version). The folder is built under a temporary name and
renamed (as tiersep.io.atomic_dir does, but never replacing a complete folder that a parallel job
may be reading), and reused by later runs whose settings match (its `tiersep_synthetic.json`).
One generator at a time per folder (a waiting `tiersep.outputs` lock beside it, whose holder first
removes the temporaries a killed generator left); a folder there without the marker is a user's
and is never removed.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile as sf
from tqdm import tqdm

from tiersep.data.errors import DataError
from tiersep.data.tracks import BASE_STEMS
from tiersep.io import read_json, write_json
from tiersep.outputs import exclusive

GENERATOR_VERSION = 2
STEMS = BASE_STEMS  # MUSDB stem order; mixture = sum in this order
MARKER = "tiersep_synthetic.json"  # written last: its presence means the folder is complete

MAJOR = (0, 2, 4, 5, 7, 9, 11)
MINOR = (0, 2, 3, 5, 7, 8, 10)
# Chord progressions as scale degrees (0 = tonic), one chord per bar.
PROGRESSIONS = {
    "major": ((0, 4, 5, 3), (0, 3, 4, 3), (1, 4, 0, 5), (0, 5, 3, 4), (0, 3, 0, 4)),
    "minor": ((0, 5, 2, 6), (0, 3, 4, 0), (0, 6, 5, 6), (0, 3, 6, 2), (0, 5, 3, 4)),
}
# Vowel formants (Hz) for the voice: F1, F2, F3 (Peterson & Barney style averages).
VOWELS = {
    "a": (730, 1090, 2440), "e": (530, 1840, 2480), "i": (300, 2250, 3000),
    "o": (570, 840, 2410), "u": (320, 870, 2240),
}
FORMANT_BANDWIDTHS = (130.0, 160.0, 220.0)
FORMANT_GAINS = (1.0, 0.55, 0.3)
ADJECTIVES = ("Amber", "Velvet", "Hollow", "Silver", "Paper", "Static", "Golden", "Quiet", "Neon",
              "Crimson", "Distant", "Northern", "Electric", "Wooden", "Restless", "Sunday")
NOUNS = ("Harbor", "Orchard", "Lanterns", "Comets", "Meadow", "Engines", "Rivers", "Foxes", "Signals",
         "Gardens", "Tides", "Owls", "Satellites", "Valleys", "Choir", "Machines")
TITLES = ("Lines", "Glow", "Drift", "Morning", "Echoes", "Fever", "Window", "Motion", "Weather",
          "Letters", "Static", "Shore", "Spark", "Circles", "Heights", "Rain")


# ----------------------------------------------------------------------------- settings, cache
def generator_settings(cfg: dict) -> dict:
    """Everything the generated audio depends on (the cache key is its hash)."""
    synth = cfg["data"]["synthetic"]
    return {"generator": "tiersep.data.synthetic", "version": GENERATOR_VERSION,
            "seed": int(synth["seed"]), "sample_rate": int(synth["sample_rate"]),
            "train_tracks": int(synth["train_tracks"]), "valid_tracks": int(synth["valid_tracks"]),
            "test_tracks": int(synth["test_tracks"]), "track_seconds": float(synth["track_seconds"])}


def settings_key(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


def raw_root(cfg: dict) -> Path:
    """Raw (unprepared) datasets live next to the prepared ones: <prepared_dir>/../raw."""
    return Path(cfg["data"]["prepared_dir"]).parent / "raw"


def synthetic_root(cfg: dict) -> Path:
    return raw_root(cfg) / f"synthetic-{settings_key(generator_settings(cfg))}"


def read_marker(root: Path) -> dict | None:
    try:
        info = read_json(Path(root) / MARKER)
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and "settings" in info else None


def ensure_synthetic(cfg: dict, progress: bool = True) -> tuple[Path, dict]:
    """The generated MUSDB18-HQ-layout folder for this config (generated now unless already there)
    and its description (settings, tracks, which train tracks form the validation split)."""
    settings = generator_settings(cfg)
    root = synthetic_root(cfg)
    info = read_marker(root)
    if info is not None and info.get("settings") == settings:
        return root, info
    try:
        return _generate_once(root, settings, progress)
    except OSError as err:  # a raw folder that cannot be made or written: one line
        where = f"{err.filename}: " if err.filename else ""
        raise DataError(f"data.prepared_dir: cannot write the synthetic set to {root.parent} "
                        f"({where}{err.strerror or err})") from None


def _generate_once(root: Path, settings: dict, progress: bool) -> tuple[Path, dict]:
    root.parent.mkdir(parents=True, exist_ok=True)
    # One generator per folder: parallel prepares at two rates share it, and the lock's holder
    # removes the temporaries a killed generator left (`.synthetic-<key>.XXXXXXXX.tmp`).
    with exclusive(root, "data.synthetic", wait=True):
        info = read_marker(root)  # made by the process we waited for
        if info is not None and info.get("settings") == settings:
            return root, info
        refuse_foreign(root)
        tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.", suffix=".tmp", dir=root.parent))
        try:
            info = generate(tmp, settings, progress=progress)
            publish_dir(tmp, root, lambda folder: (read_marker(folder) or {}).get("settings") == settings)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return root, read_marker(root)


def refuse_foreign(final: Path) -> None:
    """A non-empty folder at `final` without the generator's marker is not tiersep's: never remove it."""
    if final.is_dir() and read_marker(final) is None and any(final.iterdir()):
        names = sorted(p.name for p in final.iterdir())
        raise DataError(f"{final}: holds files tiersep did not make ({', '.join(map(repr, names[:3]))}"
                        f"{', ...' if len(names) > 3 else ''}; no {MARKER}); tiersep never removes them: "
                        "move them away or change data.prepared_dir")
    if final.exists() and not final.is_dir():
        raise DataError(f"{final}: is a file, not the generated folder; move it away or change data.prepared_dir")


def publish_dir(staging: Path, final: Path, is_complete) -> None:
    """Rename a finished folder into place, unless another process (e.g. a parallel `prepare` at
    another rate) already put a complete one there: that one is kept, never deleted under its
    readers. An incomplete folder there is replaced only when it carries the generator's marker
    (it is tiersep's); anything else is refused. `staging` must be on the same filesystem as `final`."""
    try:
        os.rename(staging, final)  # fails when `final` exists and is not empty
    except OSError:
        if is_complete(final):
            return
        refuse_foreign(final)
        if final.exists():
            shutil.rmtree(final)  # tiersep's own stale folder (its marker says so), or an empty one
        os.rename(staging, final)


# ----------------------------------------------------------------------------- the dataset
def track_name(rng: np.random.Generator, index: int) -> str:
    """'Artist - Title' as MUSDB names tracks; the index keeps names unique."""
    artist = f"{rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}"
    return f"{artist} - {rng.choice(TITLES)} {index + 1:02d}"


def plan_tracks(settings: dict) -> list[dict]:
    """Names and subsets of every track; the last `valid_tracks` train tracks are the valid split."""
    names_rng = np.random.default_rng(np.random.SeedSequence([settings["seed"], 7919]))
    n_train, n_valid = settings["train_tracks"], settings["valid_tracks"]
    plan = []
    for i in range(n_train + settings["test_tracks"]):
        subset = "train" if i < n_train else "test"
        plan.append({"index": i, "name": track_name(names_rng, i), "subset": subset,
                     "valid": subset == "train" and i >= n_train - n_valid})
    return plan


def synth_entry(settings: dict, entry: dict) -> tuple[dict[str, np.ndarray], dict]:
    """The stems and parameters of one planned track (its own random stream: any track can be made
    alone, in any order)."""
    sr = settings["sample_rate"]
    rng = np.random.default_rng(np.random.SeedSequence([settings["seed"], entry["index"]]))
    return synth_track(rng, sr, int(round(settings["track_seconds"] * sr)))


def generate(root: Path, settings: dict, progress: bool = True) -> dict:
    """Write every track of the synthetic set under `root`; returns what the marker file holds."""
    start = time.perf_counter()
    root = Path(root)
    sr = settings["sample_rate"]
    plan = plan_tracks(settings)
    for entry in tqdm(plan, desc="generate synthetic MUSDB", unit="track", disable=not progress):
        stems, params = synth_entry(settings, entry)
        folder = root / entry["subset"] / entry["name"]
        folder.mkdir(parents=True)
        mixture = np.zeros_like(stems["drums"])  # [S, 2] float32
        for name in STEMS:
            mixture += stems[name]
            sf.write(folder / f"{name}.wav", stems[name], sr, subtype="FLOAT")
        sf.write(folder / "mixture.wav", mixture, sr, subtype="FLOAT")
        entry.update(params)
    info = {"settings": settings, "tracks": plan,
            "valid_tracks": [t["name"] for t in plan if t["valid"]],
            "seconds": round(time.perf_counter() - start, 3)}
    write_json(root / MARKER, info)
    return info


# ----------------------------------------------------------------------------- one track
def midi_hz(midi):
    return 440.0 * 2.0 ** ((np.asarray(midi, dtype=np.float64) - 69.0) / 12.0)


def pan_gains(pan: float) -> np.ndarray:
    """Constant-power left/right gains for pan in [-1, 1]."""
    theta = (pan + 1.0) * np.pi / 4.0
    return np.array([np.cos(theta), np.sin(theta)])


def place(buffer: np.ndarray, start: int, sound: np.ndarray, gains: np.ndarray) -> None:
    """Add a mono `sound` into the stereo `buffer` [S, 2] at `start` with per-channel gains."""
    if start >= len(buffer):
        return
    end = min(len(buffer), start + len(sound))
    buffer[start:end] += sound[: end - start, None] * gains[None, :]


def envelope(length: int, sr: int, attack: float, release: float) -> np.ndarray:
    """Linear attack and release ramps over `length` samples (release ends at the last sample)."""
    env = np.ones(length)
    a, r = max(1, int(attack * sr)), max(1, int(release * sr))
    a, r = min(a, length), min(r, length)
    env[:a] *= np.linspace(0.0, 1.0, a, endpoint=False)
    env[length - r:] *= np.linspace(1.0, 0.0, r)
    return env


# Every stem plays through the whole track, as in a full mix; its silences are short by design: a
# drum stop or a bass rest at a section's end, a vocal breath at a phrase's end, none longer than
# MAX_REST_S. So every 1 s frame holds all four stems, and museval (which drops a frame when any
# reference is exactly silent in it) scores every frame.
MAX_REST_S = 0.6
SECTION_BARS = 4  # verse / chorus sections
PHRASE_BARS = 2  # a vocal phrase, ended by a breath; drum fills and stops end phrases too


def rest_16ths(song: dict, want: int) -> int:
    """`want` 16th notes of rest, shortened to at most MAX_REST_S (and at least one 16th)."""
    return max(1, min(want, int(MAX_REST_S * song["sr"] / song["sixteenth"])))


def clip_to_rests(rests: list[tuple[int, int]], start16: int, length16: int) -> int:
    """How many 16ths of a note starting at `start16` sound before a rest (0: it starts in one)."""
    for rest_start, rest_length in rests:
        if rest_start <= start16 < rest_start + rest_length:
            return 0
        if start16 < rest_start < start16 + length16:
            length16 = rest_start - start16
    return length16


def plan_sections(rng: np.random.Generator, n_bars: int) -> list[str]:
    """'verse' or 'chorus' for every bar, in sections of SECTION_BARS bars (a track is an excerpt:
    it may open with either)."""
    parts = [str(rng.choice(["verse", "chorus"])) for _ in range(-(-n_bars // SECTION_BARS))]
    return [parts[b // SECTION_BARS] for b in range(n_bars)]


def plan_breaks(rng: np.random.Generator, song: dict) -> tuple[set[int], dict[str, list[tuple[int, int]]]]:
    """At the end of every phrase (PHRASE_BARS bars) but the last: a drum stop of a beat or two, or
    a tom fill (bar index), or neither; independently, maybe a short bass rest.
    -> (fill bars, {stem: rests})."""
    n_bars = len(song["parts"])
    fills, rests = set(), {"drums": [], "bass": []}
    for end_bar in range(PHRASE_BARS, n_bars, PHRASE_BARS):
        end16, roll = end_bar * 16, rng.random()
        if roll < 0.3:
            length = rest_16ths(song, int(rng.choice([4, 8])))
            rests["drums"].append((end16 - length, length))
        elif roll < 0.65:
            fills.add(end_bar - 1)
        if rng.random() < 0.3:
            length = rest_16ths(song, int(rng.choice([2, 4])))
            rests["bass"].append((end16 - length, length))
    return fills, rests


def synth_track(rng: np.random.Generator, sr: int, n: int) -> tuple[dict[str, np.ndarray], dict]:
    """Four stereo stems [n, 2] float32 of one track, and its musical parameters."""
    bpm = float(rng.uniform(84, 144))
    bar = 4 * 60.0 / bpm * sr  # samples per bar (float: the grid does not drift)
    n_bars = int(np.ceil(n / bar))
    key = int(rng.integers(12))
    mode = str(rng.choice(["major", "minor"]))
    scale = MAJOR if mode == "major" else MINOR
    progression = PROGRESSIONS[mode][rng.integers(len(PROGRESSIONS[mode]))]
    song = {"sr": sr, "n": n, "bar": bar, "sixteenth": bar / 16, "key": key, "scale": scale,
            "chords": [progression[b % len(progression)] for b in range(n_bars)],
            "parts": plan_sections(rng, n_bars)}
    song["fills"], song["rests"] = plan_breaks(rng, song)

    stems = {"drums": drums(rng, song), "bass": bass(rng, song), "other": other(rng, song),
             "vocals": vocals(rng, song)}
    # Level each stem (RMS over where it plays), then random gains; then one scale for the mix.
    gains_db = {"drums": rng.uniform(-5, 1), "bass": rng.uniform(-5, 1),
                "other": rng.uniform(-6, 0), "vocals": rng.uniform(-3, 3)}
    for name, x in stems.items():
        playing = np.abs(x).max(axis=1) > 1e-4
        rms = np.sqrt(np.mean(x[playing] ** 2)) if playing.any() else 1.0
        stems[name] = x * (10 ** ((gains_db[name] - 20.0) / 20.0) / max(rms, 1e-9))
    peak = np.abs(sum(stems.values())).max()
    scale_to = rng.uniform(0.5, 0.9) / max(peak, 1e-9)
    stems = {k: (v * scale_to).astype(np.float32) for k, v in stems.items()}
    seconds = song["sixteenth"] / sr
    params = {"bpm": round(bpm, 2), "key": key, "mode": mode, "progression": list(progression),
              "gains_db": {k: round(float(v), 2) for k, v in gains_db.items()},
              "sections": song["parts"][::SECTION_BARS],
              "rests_s": {k: [[round(s * seconds, 3), round(length * seconds, 3)] for s, length in v]
                          for k, v in song["rests"].items()}}
    return stems, params


# ----------------------------------------------------------------------------- instruments
def chord_midi(song: dict, degree: int, base: int) -> list[int]:
    """Triad on a scale degree, as MIDI notes from octave `base` upwards."""
    scale = song["scale"]
    notes = []
    for step in (0, 2, 4):
        d = degree + step
        notes.append(base + song["key"] + scale[d % 7] + 12 * (d // 7))
    return notes


def kick(rng, sr):
    t = np.arange(int(0.4 * sr)) / sr
    f_start, f_end = rng.uniform(110, 160), rng.uniform(42, 60)
    freq = f_end + (f_start - f_end) * np.exp(-t / 0.035)
    body = np.sin(2 * np.pi * np.cumsum(freq) / sr) * np.exp(-t / rng.uniform(0.12, 0.22))
    click = rng.standard_normal(len(t)) * np.exp(-t / 0.003) * 0.3
    return body + click


def snare(rng, sr):
    t = np.arange(int(0.3 * sr)) / sr
    f = rng.uniform(170, 240)
    tone = (np.sin(2 * np.pi * f * t) + 0.5 * np.sin(2 * np.pi * 1.63 * f * t)) * np.exp(-t / 0.05)
    noise = np.diff(rng.standard_normal(len(t) + 1)) * np.exp(-t / rng.uniform(0.08, 0.16))
    return 0.5 * tone + 0.6 * noise


def hat(rng, sr, open_hat: bool):
    t = np.arange(int((0.35 if open_hat else 0.06) * sr)) / sr
    noise = np.diff(rng.standard_normal(len(t) + 2), n=2)  # second difference: a high-pass
    return 0.3 * noise * np.exp(-t / (0.12 if open_hat else 0.015))


def crash(rng, sr):
    t = np.arange(int(1.2 * sr)) / sr
    noise = np.diff(rng.standard_normal(len(t) + 2), n=2)
    return 0.12 * noise * np.exp(-t / 0.35) * (1 + 0.3 * np.sin(2 * np.pi * 7.0 * t))


def tom(rng, sr, pitch):
    t = np.arange(int(0.35 * sr)) / sr
    freq = pitch * (1 + 0.4 * np.exp(-t / 0.02))
    return np.sin(2 * np.pi * np.cumsum(freq) / sr) * np.exp(-t / 0.15)


def drums(rng, song):
    """Kick, snare and hi-hat on a 16th grid; a chorus is busier (extra kicks, 16th hats, open hats,
    a crash on its first beat); sections end in a tom fill or a short stop."""
    sr, n, sixteenth = song["sr"], song["n"], song["sixteenth"]
    out = np.zeros((n, 2))
    kicks, snares = {0, 8}, {4, 12}
    extra_kicks = {int(s) for s in rng.choice([3, 6, 10, 11, 14], size=rng.integers(1, 3), replace=False)}
    verse_hat_every = int(rng.choice([2, 4]))  # 8ths or quarters in a verse, 16ths in a chorus
    hat_pan, snare_pan = pan_gains(rng.uniform(-0.6, 0.6)), pan_gains(rng.uniform(-0.2, 0.2))
    crash_pan, centre = pan_gains(rng.uniform(-0.5, 0.5)), pan_gains(0.0)
    tom_pitches = rng.uniform(90, 220, size=3)
    for b, part in enumerate(song["parts"]):
        chorus = part == "chorus"
        if chorus and b % SECTION_BARS == 0:
            place(out, int(round(b * 16 * sixteenth)), crash(rng, sr), crash_pan)
        for s in range(16):
            if not clip_to_rests(song["rests"]["drums"], b * 16 + s, 1):
                continue
            start = max(0, int(round((b * 16 + s) * sixteenth + rng.normal(0, 0.002) * sr)))
            if b in song["fills"] and s >= 12:
                place(out, start, tom(rng, sr, tom_pitches[(s - 12) % 3]) * 0.8,
                      pan_gains(-0.5 + 0.33 * (s - 12)))
                continue
            if s in kicks or (chorus and s in extra_kicks):
                place(out, start, kick(rng, sr) * rng.uniform(0.85, 1.0), centre)
            if s in snares:
                place(out, start, snare(rng, sr) * rng.uniform(0.8, 1.0), snare_pan)
            if s % (1 if chorus else verse_hat_every) == 0:
                accent = 1.0 if s % 4 == 0 else 0.6
                open_hat = chorus and s == 14 and rng.random() < 0.5
                place(out, start, hat(rng, sr, open_hat=open_hat) * accent, hat_pan)
    return out


def harmonic_sum(phase: np.ndarray, amplitude) -> np.ndarray:
    """sum_k amplitude(k) * sin(k * phase) for k = 1..K, by the Chebyshev recurrence
    sin(k x) = 2 cos(x) sin((k-1) x) - sin((k-2) x): one multiply-add per harmonic, not one sine.
    phase: [L]; amplitude(k) -> scalar or [L]."""
    two_cos = 2.0 * np.cos(phase)
    previous, current = np.zeros_like(phase), np.sin(phase)
    total = amplitude(1) * current
    k = 2
    while True:
        a = amplitude(k)
        if a is None:
            return total
        previous, current = current, two_cos * current - previous
        total += a * current
        k += 1


def harmonic_tone(freq, t, n_harmonics, tilt, decay_per_harmonic=0.0):
    """Harmonics k*freq with amplitude k^-tilt, higher ones decaying faster. t: [L] -> [L]."""
    def amplitude(k):
        if k > n_harmonics:
            return None
        if decay_per_harmonic:
            return k ** -tilt * np.exp(-decay_per_harmonic * k * t)
        return k ** -tilt
    return harmonic_sum(2 * np.pi * freq * t, amplitude)


BASS_PATTERNS = (  # (start 16th, length in 16ths, interval above the root)
    ((0, 4, 0), (4, 4, 0), (8, 4, 0), (12, 4, 0)),
    ((0, 2, 0), (2, 2, 12), (4, 2, 0), (6, 2, 12), (8, 2, 0), (10, 2, 12), (12, 2, 0), (14, 2, 12)),
    ((0, 6, 0), (6, 2, 7), (8, 6, 0), (14, 2, 7)),
    ((0, 3, 0), (3, 3, 0), (6, 2, 7), (8, 4, 0), (12, 2, 12), (14, 2, 7)),
)


def bass(rng, song):
    """Low harmonic notes on the chord roots (fifths, octaves) in one pattern per track."""
    sr, n, sixteenth = song["sr"], song["n"], song["sixteenth"]
    out = np.zeros((n, 2))
    pattern = BASS_PATTERNS[rng.integers(len(BASS_PATTERNS))]
    gains = pan_gains(rng.uniform(-0.1, 0.1))
    tilt, brightness = rng.uniform(1.0, 1.6), rng.uniform(2.0, 6.0)
    n_harmonics = int(min(10, 0.45 * sr / 130))
    for b in range(len(song["parts"])):
        root = chord_midi(song, song["chords"][b], 24)[0]
        root += 12 if root < 31 else 0  # keep roots in E1..D#2 (41-78 Hz) or one octave above
        for start16, length16, interval in pattern:
            length16 = clip_to_rests(song["rests"]["bass"], b * 16 + start16, length16)
            if not length16:
                continue
            length = int(length16 * sixteenth * 0.92)
            t = np.arange(length) / sr
            note = harmonic_tone(midi_hz(root + interval), t, n_harmonics, tilt, brightness)
            note *= envelope(length, sr, 0.004, 0.02) * np.exp(-t / 0.5)
            place(out, int(round((b * 16 + start16) * sixteenth)), note * 0.8, gains)
    return out


def other(rng, song):
    """Chord pads (slow attack, detuned for stereo width) and/or plucked arpeggios, one style per
    track in the verses; a chorus has both."""
    sr, n, bar = song["sr"], song["n"], song["bar"]
    out = np.zeros((n, 2))
    style = str(rng.choice(["pad", "pluck", "both"]))
    n_harmonics = int(min(8, 0.45 * sr / 500))
    arp_step = int(rng.choice([2, 4]))  # 8ths or 16ths... in 16ths
    arp_order = rng.permutation(3)
    pluck_pans = rng.uniform(-0.7, 0.7, size=2)
    for b, part in enumerate(song["parts"]):
        start = int(round(b * bar))
        layers = "both" if part == "chorus" else style
        if layers in ("pad", "both"):
            length = int(bar * 1.05)
            t = np.arange(length) / sr
            env = envelope(length, sr, 0.15, 0.2) * (1 + 0.1 * np.sin(2 * np.pi * 4.5 * t))
            for note in chord_midi(song, song["chords"][b], 48 + 12 * (song["key"] < 6)):
                for channel, cents in ((0, -7.0), (1, 7.0)):  # detuned voices: a wide stereo pad
                    freq = midi_hz(note + cents / 100)
                    voice = harmonic_tone(freq, t, n_harmonics, 2.0) * env * 0.25
                    place(out, start, voice, np.eye(2)[channel])
        if layers in ("pluck", "both"):
            notes = chord_midi(song, song["chords"][b], 60)
            sixteenth = bar / 16
            for i, s in enumerate(range(0, 16, arp_step)):
                note = notes[arp_order[i % 3]] + 12 * (i % 6 >= 3)
                length = int(0.5 * sr)
                t = np.arange(length) / sr
                pluck = harmonic_tone(midi_hz(note), t, n_harmonics, 1.0, 3.0) * np.exp(-t / 0.25)
                pluck *= envelope(length, sr, 0.002, 0.05) * 0.5
                place(out, int(round(b * bar + s * sixteenth)), pluck, pan_gains(pluck_pans[i % 2]))
    return out


def formant_gain(freq: np.ndarray, formants) -> np.ndarray:
    """Resonance gain of a vowel at the given frequencies (sum of three Lorentzian peaks)."""
    gain = np.full(freq.shape, 0.02)
    for centre, width, g in zip(formants, FORMANT_BANDWIDTHS, FORMANT_GAINS):
        gain += g / (1.0 + ((freq - centre) / (width / 2)) ** 2)
    return gain


def melody(rng, song, low: int) -> list[tuple[int, int, int]]:
    """(start 16th, length in 16ths, MIDI note) of a vocal line: phrases of PHRASE_BARS bars sung
    through, each ended by a breath, with now and then a short rest inside; never two rests in a
    row, so no silence is longer than MAX_REST_S. A chorus sits two scale steps higher."""
    scale, key = song["scale"], song["key"]
    n16 = len(song["parts"]) * 16
    degree = 7 + int(rng.integers(-2, 3))  # around the octave above `low`
    notes = []
    for phrase_start in range(0, n16, PHRASE_BARS * 16):
        end = min(phrase_start + PHRASE_BARS * 16, n16) - rest_16ths(song, int(rng.integers(1, 5)))
        lift = 2 if song["parts"][phrase_start // 16] == "chorus" else 0
        s, after_rest = phrase_start, True  # a phrase opens with a note: the breath came before it
        while s < end:
            rest = rest_16ths(song, int(rng.choice([1, 2])))
            if not after_rest and s + rest < end and rng.random() < 0.1:
                s, after_rest = s + rest, True
                continue
            length = min(int(rng.choice([2, 2, 3, 4, 4, 6, 8])), end - s)
            degree = int(np.clip(degree + rng.choice([-2, -1, -1, 0, 1, 1, 2]), 0, 11))
            sung = degree + lift
            notes.append((s, length, low + key + scale[sung % 7] + 12 * (sung // 7)))
            s, after_rest = s + length, False
    return notes


def vocals(rng, song):
    """A harmonic voice: melody with glides and vibrato, through vowel formants."""
    sr, n, sixteenth = song["sr"], song["n"], song["sixteenth"]
    out = np.zeros((n, 2))
    low = int(rng.choice([45, 52]))  # a lower or higher voice (melody around A3..A4 or E4..E5)
    gains = pan_gains(rng.uniform(-0.15, 0.15))
    vibrato_rate, vibrato_depth = rng.uniform(4.8, 6.5), rng.uniform(0.25, 0.6)
    previous = None
    for start16, length16, note in melody(rng, song, low):
        length = int(length16 * sixteenth)
        t = np.arange(length) / sr
        glide_from = note if previous is None else previous
        previous = note
        semitones = note + (glide_from - note) * np.exp(-t / 0.03)
        semitones = semitones + vibrato_depth * np.clip((t - 0.15) / 0.2, 0, 1) * np.sin(
            2 * np.pi * vibrato_rate * t + rng.uniform(0, 2 * np.pi))
        f0 = midi_hz(semitones)  # [L]
        phase = 2 * np.pi * np.cumsum(f0) / sr
        n_harmonics = int(min(40, 0.45 * sr / f0.max()))
        formants = VOWELS[str(rng.choice(list(VOWELS)))]
        # glottal tilt 1/k times the vowel's resonances at each harmonic's (moving) frequency
        voice = harmonic_sum(phase, lambda k: None if k > n_harmonics else formant_gain(k * f0, formants) / k)
        voice *= envelope(length, sr, 0.03, 0.06) * (1 + 0.05 * np.sin(2 * np.pi * 3.0 * t))
        start = int(round(start16 * sixteenth))
        if rng.random() < 0.35:  # a consonant ('s', 't'): a short high-passed noise burst
            t_burst = np.arange(int(0.04 * sr)) / sr
            burst = np.diff(rng.standard_normal(len(t_burst) + 1)) * np.exp(-t_burst / 0.01)
            place(out, start, burst * 0.15, gains)
            start += len(burst) // 2
        place(out, start, voice * 0.5, gains)
    return out
