"""Data stage: sources -> prepared folder -> training segments.

- synthetic.py: deterministic synthetic MUSDB18-HQ (the default source; runs anywhere)
- ingest.py:    find, check and read a source's tracks through the real musdb parser
- prepare.py:   `prepare(cfg, out_dir, sample_rate)`: resample once, write float32 WAVs + manifest
- tracks.py:    read a prepared folder (manifest, names, whole tracks, partial reads)
- dataset.py:   `SegmentDataset`, `make_loader`, `validation_segments` for training
Submodules are imported on use (musdb needs ffmpeg at import; torch is heavy).
"""
from tiersep.data.errors import DataError

__all__ = ["DataError"]
