"""`tiersep separate`: separate songs with a trained tier, within a memory budget, in blocks.

Up front, before any song is written: the options (formats, filename template), the songs (files,
folders searched recursively), the output folder (tiersep.outputs: new, empty or a separate folder;
one writer at a time), the model (weights-only, its own preset or the one named), each song's probe
(a song ffmpeg cannot read fails alone), and the plan (chunk and batch under the budget, or a
refusal naming the estimate). --out is made if new and locked before the model loads (a run that
writes nothing into a folder it made removes it again). Then each song streams through
separate/song.py into temporaries that are renamed, with the JSON sidecar that records how it was
made, when the song is complete. A failed song is reported and the others go on; the command then
exits 2 naming the failures.
"""
from __future__ import annotations

import contextlib
import copy
import errno
import os
import sys
import time
from pathlib import Path

import torch

from tiersep import config as C
from tiersep.config import ConfigError
from tiersep.gpu_lease import current_record as gpu_lease_record
from tiersep.memory import GateSettings
from tiersep.memory.constants import GIB
from tiersep.outputs import LOCK_INSIDE, STAMP, OutputRefused, claim, exclusive
from tiersep.gpu_catalogue import BF16_SM
from tiersep.model.step import resolve_precision

from .audio import SongError, probe, song_name
from .options import Options, preflight, render
from .plan import BLOCK_FRAMES, SeparationRequest, budget_for, choose, separation_device
from .progress import SongProgress
from .song import StreamSettings, complement_name, separate_song
from .stems import SongFiles, disk_bytes

SIDECAR = {"stem": "separate", "ext": "json"}     # the sidecar's path: the template with these
SIDECAR_KEY = "<sidecar>"                          # its entry among a song's output paths
BAND_NOTE_SHARE = 1e-4      # a band above the model's with this share of the energy (-40 dB) is noted


class SongsFailed(ConfigError):
    """Some songs could not be separated (the others were written); exit 2, one line naming them."""


def load_separator(model_path: Path, preset: dict | None) -> tuple[torch.nn.Module, dict, int | None]:
    """The trained model (weights-only) and its preset: the one given (the file must match it), or
    the preset the file was trained with."""
    from tiersep.model.weights import load_model, load_model_file

    if preset is None:
        stored = load_model_file(model_path).get("preset")
        if not isinstance(stored, dict):
            raise ConfigError(f"{model_path}: carries no preset; name it with --preset NAME")
        preset = C.validate(copy.deepcopy(stored), "preset.schema.yaml", f"{model_path} (its preset)")
        C.check_preset(preset, f"{model_path} (its preset)")
    model, step = load_model(model_path, preset)
    return model, preset, step


def separate(cfg: dict, opts: Options, songs: list[Path] | None = None) -> dict:
    """Separate every song of opts.inputs into opts.out (see module docstring); returns the summary.
    `songs`: what preflight(opts) returned, when the caller ran it already (the CLI, before torch)."""
    songs = preflight(opts) if songs is None else songs
    with _held(opts.out):                              # a second writer stops here, before its model loads
        return _separate(cfg, opts, songs)


@contextlib.contextmanager
def _held(out: Path):
    """Make --out separate's folder (if new) and hold its lock (inside it: its parent need not be
    writable) for the block. Two runs racing for a new --out both make it; the lock lets one in and
    refuses the other at once. A run that made the folder and leaves nothing in it (a refused
    plan, a bad model, no song written) removes it again: a refusal creates nothing."""
    made = [p for p in (out, *out.parents) if not p.exists()]   # what claim() is about to make
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(exclusive(claim(out, "separate"), inside=True))
        except OSError as err:
            raise OutputRefused(f"--out {out}: cannot write it ({_os_error(err)})") from None
        try:
            yield
        finally:
            if made:
                _unmake(out, made)


def _unmake(out: Path, made: list[Path]) -> None:
    """Remove --out, made by this run, when it holds only tiersep's stamp and lock (and the folders
    above it that this run made, when left empty). Called under the lock; the stamp goes first,
    then the lock file, so a run arriving meanwhile either meets the lock or makes its own."""
    try:
        if set(os.listdir(out)) - {STAMP, LOCK_INSIDE}:
            return
    except OSError:
        return
    for name in (STAMP, LOCK_INSIDE):
        with contextlib.suppress(OSError):
            (out / name).unlink()
    for folder in made:                  # --out first, then the folders above it
        try:
            folder.rmdir()
        except OSError:
            return


def _separate(cfg: dict, opts: Options, songs: list[Path]) -> dict:
    model, preset, step = load_separator(opts.model, opts.preset)
    sources = list(preset["model"]["sources"])
    if opts.stems is not None and opts.stems not in sources:
        raise ConfigError(f"--stems {opts.stems}: this model separates {', '.join(sources)}")
    names = [opts.stems, complement_name(opts.stems)] if opts.stems else sources
    infos, paths, failures = _probe_songs(songs, opts, names)
    if not infos:
        raise _failed(failures, len(songs))

    rate = preset["audio"]["sample_rate"]
    device, plan = _plan(cfg, opts, preset, infos)
    if preset["train"]["precision"] == "auto":   # as trained on this device (model/step.py resolve_precision)
        bf16 = device.type == "cuda" and torch.cuda.get_device_capability(device) >= BF16_SM
        preset = dict(preset, train=dict(preset["train"], precision=resolve_precision("auto", device.type, bf16)))
    malloc = _apply_malloc(plan)
    model = model.to(device)
    print(f"tiersep separate: {preset['name']} on {device.type}: chunk {plan.chunk_samples / rate:g} s x batch "
          f"{plan.batch}, booked {plan.estimate['gate_required_bytes'] / GIB:.2f} GiB (predicted peak "
          f"{_gib_or_mib(plan.estimate['peak_bytes'])}) within {plan.budget_bytes / GIB:.2f} GiB "
          f"({plan.budget_source})", file=sys.stderr)
    settings = StreamSettings(plan.chunk_samples, plan.batch, opts.overlap, preset["train"]["precision"],
                              opts.shifts, opts.seed, BLOCK_FRAMES)
    from tiersep.probe import MemoryProbe

    probe_ = MemoryProbe(device)
    records = []
    for number, (song, info) in enumerate(infos.items(), 1):
        try:
            records.append(_one_song(model, preset, step, info, paths[song], settings, opts, plan, probe_,
                                     malloc, f"[{number}/{len(infos)}] {song_name(info.path)}"))
        except (SongError, OSError) as err:
            failures[song] = _song_failure(err, song)
            print(f"tiersep separate: failed: {failures[song]}", file=sys.stderr)
        except torch.OutOfMemoryError as err:
            failures[song] = f"{song}: out of memory on {device} ({_song_failure(err, song)[:160]})"
            print(f"tiersep separate: failed: {failures[song]}", file=sys.stderr)
    if failures:
        raise _failed(failures, len(songs))
    return {"songs": records, "chunk_samples": plan.chunk_samples, "batch": plan.batch}


def _probe_songs(songs: list[Path], opts: Options, names: list[str]) -> tuple[dict, dict, dict]:
    """(song -> AudioInfo, song -> {stem: final path, SIDECAR_KEY: path}, song -> failure) for the
    songs ffmpeg can read and whose output paths no earlier song has taken."""
    infos, paths, failures, owners = {}, {}, {}, {}
    for song in songs:
        try:
            info = probe(song)
        except SongError as err:
            failures[song] = str(err)
            print(f"tiersep separate: failed: {err}", file=sys.stderr)
            continue
        name = song_name(song)
        suffix = song.name[len(name):].lstrip(".")
        try:
            wanted = {stem: opts.out / render(opts.filename, name, suffix, stem, opts.format) for stem in names}
            wanted[SIDECAR_KEY] = opts.out / render(opts.filename, name, suffix, **SIDECAR)
        except ConfigError as err:                 # a name such as '...mp3': this song alone fails
            failures[song] = f"{song}: its name cannot make an output path ({err}); rename the file"
            print(f"tiersep separate: failed: {failures[song]}", file=sys.stderr)
            continue
        clash = next((owners[p] for p in wanted.values() if p in owners), None)
        if clash is not None:
            failures[song] = f"{song}: its outputs are those of {clash} too (--filename {opts.filename!r}); rename one"
            print(f"tiersep separate: failed: {failures[song]}", file=sys.stderr)
            continue
        owners.update({p: song for p in wanted.values()})
        infos[song], paths[song] = info, wanted
    return infos, paths, failures


def _plan(cfg: dict, opts: Options, preset: dict, infos: dict):
    from tiersep.device import configure_cuda_allocator

    configure_cuda_allocator(preset)                    # before CUDA starts: the mode the estimate models
    device = separation_device(opts.device)
    settings = GateSettings.from_config(cfg)
    budget, source = budget_for(device, opts.budget_gib, settings.calibration_spec)
    plan = choose(preset, device, budget, source, separation_request(opts, preset, infos), settings)
    return device, plan


def separation_request(opts: Options, preset: dict, infos: dict) -> SeparationRequest:
    """What the options ask of the plan for these songs, in samples at the model's rate."""
    rate = preset["audio"]["sample_rate"]
    seconds = [i.seconds for i in infos.values()]
    n_fft = preset["audio"]["n_fft"]                    # the model needs more than n_fft / 2 samples
    return SeparationRequest(
        max_chunk=max(n_fft, int(round(opts.chunk_seconds * rate))),
        min_chunk=max(n_fft, int(round(opts.min_chunk_seconds * rate))),
        max_batch=opts.max_batch, overlap=opts.overlap, shifts=opts.shifts,
        longest_samples=int(max(seconds) * rate) + 1 if None not in seconds else 10**12,
        rate_ratio=_rate_ratio(infos, rate), two_stem=opts.stems is not None,
        above_band=any(i.rate > rate for i in infos.values()))


def _rate_ratio(infos: dict, rate: int) -> float:
    """The song rate furthest from the model's, as a ratio (the stream's blocks scale with it)."""
    return max((i.rate / rate for i in infos.values()), key=lambda x: max(x, 1 / x))


def _apply_malloc(plan) -> dict | None:
    """On a CPU, the malloc mode the plan booked: glibc's own, or the tuned settings when only they
    fit (as the trainer applies the CPU gate's choice)."""
    from tiersep.malloc import configure_malloc

    booked = plan.estimate.get("cpu_process")
    if booked is None:
        return None
    if booked["malloc"] == "tuned":
        return {"mode": "tuned", **configure_malloc()}
    return {"mode": booked["malloc"], "applied": False, "reason": "glibc's own malloc: its booking fits the budget"}


def _one_song(model, preset, step, info, paths, settings, opts, plan, probe_, malloc, title) -> dict:
    from tiersep.io import to_json
    from tiersep.probe import versions

    began = time.perf_counter()
    sidecar = paths.pop(SIDECAR_KEY)
    check_song_space(info, paths, opts)
    files, result = _write_stems(model, preset, info, paths, settings, opts, plan, probe_, title)
    try:
        files.finish()
        clipping = files.report()
        clipping["passes"] = 1 if files.gain == 1.0 else 2
        taken = time.perf_counter() - began
        measured = probe_.peaks()[1] if plan.device.type == "cpu" else probe_.record()["peak_device_bytes"]
        record = {
            "song": song_name(info.path), "input": os.path.abspath(info.path), "codec": info.codec,
            "sample_rate": info.rate, "channels": info.channels, "seconds": result["seconds"],
            "model": os.path.abspath(opts.model), "tier": preset["name"], "preset": preset, "step": step,
            "stems": {stem: os.path.abspath(path) for stem, path in paths.items()},
            "settings": {"stems": opts.stems, "format": opts.format, "bits": opts.bits, "clip": opts.clip,
                         "overlap": opts.overlap, "shifts": opts.shifts, "seed": opts.seed,
                         "filename": opts.filename, "device": plan.device.type,
                         "precision": preset["train"]["precision"]},
            "chunk_samples": plan.chunk_samples, "chunk_seconds": plan.chunk_samples / preset["audio"]["sample_rate"],
            "batch": plan.batch, "gpu_lease": gpu_lease_record(),
            "memory": {"budget_bytes": plan.budget_bytes, "budget_source": plan.budget_source,
                       "booked_bytes": plan.estimate["gate_required_bytes"],
                       "booked": "the process's peak RSS, booked as the CPU gate books it (allowance + a factor "
                       "x the live tensors + the stream's buffers)" if plan.device.type == "cpu"
                       else "device use (allocator reserved peak + CUDA context) x (1 + uncertainty)",
                       "predicted_peak_bytes": plan.estimate["peak_bytes"],
                       "predicted_peak": "the live tensor bytes of one model call" if plan.device.type == "cpu"
                       else "device use (allocator reserved peak + CUDA context)",
                       "measured_peak_bytes": int(measured),
                       "measured": "this process's peak RSS so far (VmHWM)" if plan.device.type == "cpu"
                       else "this process's device use so far (NVML/cudaMemGetInfo)",
                       "malloc": malloc, "tried": plan.tried},
            "band": result["band"], "clipping": clipping, "notes": result["notes"],
            "seconds_taken": round(taken, 3), "real_time_factor": round(taken / max(result["seconds"], 1e-9), 4),
            "versions": versions(),
        }
        # the sidecar is on disk before any stem is renamed: a full disk fails the song whole
        files.attach(sidecar, (to_json(record) + "\n").encode())
        remove_replaced_stems(sidecar, paths, opts.out)
        files.commit()
    except BaseException:
        files.abort()
        raise
    print(_summary(record, paths[next(iter(paths))].parent), file=sys.stderr)
    return record


def _write_stems(model, preset, info, paths, settings, opts, plan, probe_, title) -> tuple[SongFiles, dict]:
    """Separate the song into its stems' temporaries: (the files, not committed; separate_song's
    result). With rescale, a song whose stems went beyond full scale is separated a second time
    with the gain the first pass found (stems.py): the disk holds only one set of stems."""
    gain, label = 1.0, title
    while True:
        files = SongFiles(paths, opts.format, opts.bits, info.rate, info.channels, opts.clip, gain)
        try:
            with SongProgress(label, info.seconds, info.rate) as progress:
                result = separate_song(model, preset, info, files, settings, plan.device, opts.stems,
                                       on_frames=progress.advance, on_block=probe_.sample)
            needed = files.rescale_gain()
            if gain != 1.0 or needed == 1.0:
                return files, result
        except BaseException:
            files.abort()
            raise
        files.abort()
        gain, label = needed, f"{title} (again, scaled by {needed:.3f})"
        print(f"{title}: its stems went beyond full scale: separating it again, scaled by {gain:.3f} "
              "(--clip rescale)", file=sys.stderr)


def remove_replaced_stems(sidecar: Path, paths: dict, out: Path) -> list[Path]:
    """Remove the stems an earlier run of this song wrote that this run did not (another --stems):
    only files its sidecar lists, inside --out, so the folder matches the new sidecar. Nothing
    else is ever removed."""
    from tiersep.io import read_json

    try:
        earlier = read_json(sidecar).get("stems")
    except (OSError, ValueError, AttributeError):
        return []
    if not isinstance(earlier, dict):
        return []
    inside = os.path.realpath(out) + os.sep
    keep = {os.path.realpath(p) for p in paths.values()}
    removed = []
    for listed in earlier.values():
        if not isinstance(listed, str):
            continue
        path = Path(listed) if os.path.isabs(listed) else out / listed   # relative: sidecars before 0.x
        real = os.path.realpath(path)
        if real.startswith(inside) and real not in keep and path.is_file() and not path.is_symlink():
            path.unlink()
            removed.append(path)
    return removed


def check_song_space(info, paths: dict, opts: Options) -> None:
    """Refuse this song (SongError, one line) when its stems would not fit on --out's disk, as
    `prepare` refuses a set. A song whose file declares no duration is not checked (a full disk
    then fails it half-way, leaving no file)."""
    from tiersep.data.errors import DataError
    from tiersep.data.prepare import check_free_space

    if info.seconds is None:
        return
    frames = int(info.seconds * info.rate) + 1
    need = disk_bytes(len(paths), frames, info.channels, info.rate, opts.format, opts.bits)
    try:
        check_free_space(next(iter(paths.values())), need, what=f"writing its {len(paths)} stems",
                         label=str(info.path))
    except DataError as err:
        raise SongError(str(err)) from None


def _gib_or_mib(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.2f} MiB"


def _summary(record: dict, folder: Path) -> str:
    mem = record["memory"]
    lines = [f"{record['song']}: {record['seconds']:.1f} s in {record['seconds_taken']:.1f} s "
             f"(real-time factor {record['real_time_factor']:.2f}), peak {mem['measured_peak_bytes'] / GIB:.2f} GiB "
             f"of {mem['budget_bytes'] / GIB:.2f} GiB -> {folder}"]
    clipped = {s: v for s, v in record["clipping"]["stems"].items() if v["clipped_samples"]}
    if clipped:
        worst = max(clipped, key=lambda s: clipped[s]["peak"])
        action = {"rescale": f"all stems scaled by {record['clipping']['gain']:.3f}",
                  "clamp": "clamped to full scale", "none": "written as computed"}[record["clipping"]["mode"]]
        lines.append(f"  note: {len(clipped)} stem(s) went beyond full scale (peak {clipped[worst]['peak']:.2f} in "
                     f"{worst}): {action}")
    band = record["band"]
    if band["above_band_energy_share"] >= BAND_NOTE_SHARE:
        lines.append(f"  note: {100 * band['above_band_energy_share']:.2f}% of the song's energy is above the model's "
                     f"band ({band['model_band_hz']:g} Hz), which it cannot separate: kept in {band['kept_in']}, so "
                     "the stems hold the whole band")
    lines += [f"  note: {note}" for note in record["notes"]]
    return "\n".join(lines)


def _song_failure(err: BaseException, song: Path) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    if isinstance(err, OSError) and err.filename and str(err.filename) not in text:
        text = f"{err.filename}: {_os_error(err)}"
    return text if str(song) in text else f"{song}: {text}"


def _os_error(err: OSError) -> str:
    """An OSError in words; a full disk named as such (its folder and what is free there)."""
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        where = Path(err.filename).parent if err.filename else None
        return f"no space left on {where}" if where else "no space left on the device"
    return err.strerror or str(err)


def _failed(failures: dict, total: int) -> SongsFailed:
    messages = list(failures.values())
    if len(messages) == 1 and total == 1:
        return SongsFailed(messages[0])
    shown = "; ".join(messages[:3]) + (f"; and {len(messages) - 3} more" if len(messages) > 3 else "")
    return SongsFailed(f"{len(messages)} of {total} songs failed: {shown}")
