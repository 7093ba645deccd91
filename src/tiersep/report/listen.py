"""Read a tier's excerpt for the Listen section: results/eval/<tier>/listen/listen.json (validated
against workflow/schemas/records/listen.schema.yaml, its 2 MB cap included) and the audio files it
lists, which the page embeds as data: URIs.

Like every record, an excerpt that cannot be used is a problem of its tier, one line naming the
file: a damaged listen.json, a listed file that is missing, not a plain file, of another size than
recorded (cut short, replaced) or not Ogg. Nothing of it reaches the page then.
"""
from __future__ import annotations

import base64
from dataclasses import dataclass
from pathlib import Path

from tiersep.records import RecordError, read_record

OGG_MAGIC = b"OggS"   # every Ogg page starts with it


@dataclass
class Clip:
    role: str          # mixture, estimate, reference
    stem: str | None   # None for the mixture
    path: Path
    data: bytes


@dataclass
class Listen:
    record: dict
    folder: Path
    clips: list[Clip]

    def data_uri(self, clip: Clip) -> str:
        mime = self.record["mime"].replace(" ", "")   # a URI holds no space: audio/ogg;codecs=opus
        return f"data:{mime};base64,{base64.b64encode(clip.data).decode('ascii')}"


def _read_clip(folder: Path, entry: dict) -> Clip:
    path = folder / entry["file"]   # a plain name: the schema allows no folder in it
    if path.is_symlink() or not path.is_file():
        raise RecordError(f"{path}: listed in listen.json but {'a link' if path.is_symlink() else 'missing'}")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise RecordError(f"{path}: cannot be read ({err.strerror or err})") from None
    if len(data) != entry["bytes"]:
        raise RecordError(f"{path}: {len(data)} bytes, listen.json says {entry['bytes']}")
    if not data.startswith(OGG_MAGIC):
        raise RecordError(f"{path}: not an Ogg file")
    return Clip(entry["role"], entry["stem"], path, data)


def read_listen(folder: Path) -> Listen | None:
    """The excerpt in `folder`, or None when evaluate wrote none; RecordError (one line naming the
    file) when it cannot be used."""
    record = read_record("listen", folder / "listen.json")
    if record is None:
        return None
    return Listen(record, folder, [_read_clip(folder, entry) for entry in record["files"]])
