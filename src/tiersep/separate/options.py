"""The options of `tiersep separate` and the checks made before any work: torch-free, so that the
CLI refuses a bad option, song, --out or --model before torch is imported (and before a GPU lease)."""
from __future__ import annotations

import os
import string
from dataclasses import dataclass
from pathlib import Path

from tiersep.config import ConfigError
from tiersep.outputs import check, check_writable

from .audio import BITS, FORMATS, find_songs

TEMPLATE_FIELDS = ("song", "songext", "stem", "ext")


@dataclass
class Options:
    model: Path
    inputs: list
    out: Path
    preset: dict | None         # check the model against this preset (else: the model's own)
    stems: str | None           # two-stem mode: this stem and its complement
    budget_gib: float | None    # None: the free memory of the device
    device: str
    overlap: float
    shifts: int
    seed: int
    format: str
    bits: str
    clip: str
    filename: str
    chunk_seconds: float        # the longest chunk tried
    min_chunk_seconds: float
    max_batch: int


def options_from(cfg: dict, **given) -> Options:
    """Options from the CLI (`given`; None = not given) over the config's `separate` section."""
    section = cfg["separate"]
    defaults = {"stems": section["stems"], "device": section["device"], "overlap": section["overlap"],
                "shifts": section["shifts"], "seed": section["seed"], "format": section["format"],
                "bits": str(section["bits"]), "clip": section["clip"], "filename": section["filename"],
                "chunk_seconds": section["chunk_seconds"], "min_chunk_seconds": section["min_chunk_seconds"],
                "max_batch": section["max_batch"],
                "budget_gib": None if section["budget_gib"] == "auto" else section["budget_gib"]}
    merged = {**defaults, **{k: v for k, v in given.items() if v is not None}}
    merged.setdefault("preset", None)
    merged["model"], merged["out"] = Path(merged["model"]), Path(merged["out"])
    return Options(**merged)


def check_options(opts: Options) -> None:
    """Refuse impossible combinations and a bad --filename before anything is done."""
    if opts.format not in FORMATS or opts.bits not in BITS:
        raise ConfigError(f"--format {opts.format} --bits {opts.bits}: allowed formats {', '.join(FORMATS)}, "
                          f"bits {', '.join(BITS)}")
    if opts.format == "flac" and opts.bits == "32f":
        raise ConfigError("--bits 32f: flac holds integer samples; use --bits 16 or 24, or --format wav")
    fields = {name for _, name, _, _ in string.Formatter().parse(opts.filename) if name is not None}
    unknown = sorted(fields - set(TEMPLATE_FIELDS))
    if unknown or not {"stem"} <= fields or not fields & {"song", "songext"}:
        raise ConfigError(f"--filename {opts.filename!r}: use the fields {{song}} and {{stem}} (and optionally "
                          f"{{songext}}, {{ext}}); {'unknown: ' + ', '.join(unknown) if unknown else 'one is missing'}")
    render(opts.filename, "song", "wav", "vocals", "wav")


def render(template: str, song: str, songext: str, stem: str, ext: str) -> Path:
    """The relative output path of one file; a path leaving the output folder is refused."""
    try:
        text = template.format(song=song, songext=songext, stem=stem, ext=ext)
    except (ValueError, IndexError, KeyError) as err:
        raise ConfigError(f"--filename {template!r}: not a valid template ({err})") from None
    path = Path(text)
    if path.is_absolute() or not path.parts or any(p in ("", ".", "..") for p in path.parts):
        raise ConfigError(f"--filename {template!r}: gives {text!r}, which is not a path inside --out")
    return path


def check_inputs_outside_out(opts: Options) -> None:
    """An INPUT folder that is --out, or inside it, is refused: stems are never songs."""
    out = os.path.realpath(opts.out)
    for given in opts.inputs:
        where = os.path.realpath(Path(given).expanduser())
        if Path(given).expanduser().is_dir() and (where == out or where.startswith(out.rstrip(os.sep) + os.sep)):
            inside = "is" if where == out else "is inside"
            raise ConfigError(f"--out {opts.out}: the INPUT folder {given} {inside} it; give the stems a folder "
                              "of their own (it may be inside the INPUT folder)")


def preflight(opts: Options) -> list[Path]:
    """The songs to separate, after every check that needs no model: the options, the INPUTs, --out
    (tiersep.outputs: a refused folder before any work) and that --model is a file."""
    check_options(opts)
    check_inputs_outside_out(opts)
    songs = find_songs(opts.inputs, skip=opts.out)
    check(opts.out, "separate")
    check_writable(opts.out)
    require_model_file(opts.model)
    return songs


def require_model_file(path) -> None:
    """model/weights.py's refusal of a --model that is not a file, without importing torch (separate's
    preflight and evaluate's CLI check it before their lease and torch)."""
    if not Path(path).is_file():
        raise ConfigError(f"{path}: model file not found")
