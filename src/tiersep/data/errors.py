"""The one error type of the data stage."""
from __future__ import annotations

from tiersep.config import ConfigError


class DataError(ConfigError):
    """A source or prepared folder that cannot be used (missing stem, wrong channels, NaN, empty
    split, no ffmpeg, offline download, ...). The message names the track and file and is one line.

    It subclasses ConfigError so that the CLI reports it like any other user error (exit code 2,
    one line on stderr) rather than with a traceback."""
