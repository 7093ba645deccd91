"""Hyperparameter sweeps: the config's `sweep` grid expanded into named trials.

A trial is one preset with some fields overridden; its name is what Snakemake uses as the {preset}
wildcard of the train/evaluate rules and what `tiersep train --preset` accepts, e.g.

    sweep: {presets: [cpu_tiny], grid: {train.lr: [1.0e-3, 3.0e-3], train.seed: [0, 1]}}
    -> cpu_tiny--lr1e-3--seed0, cpu_tiny--lr1e-3--seed1, cpu_tiny--lr3e-3--seed0, ...

Each trial runs as its own job (its own process), so no trial inherits another's memory.
"""
from __future__ import annotations

import itertools
import re

from tiersep import config as C

SEPARATOR = "--"
_NAME_OK = re.compile(r"^[A-Za-z0-9_.-]+$")


def format_value(value) -> str:
    """Short, filename-safe text for a grid value: 0.001 -> 1e-3, 0.01 -> 0.01, True -> true."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        plain = f"{value:g}"
        mantissa, exponent = f"{value:e}".split("e")
        mantissa = mantissa.rstrip("0").rstrip(".")
        scientific = f"{mantissa}e{int(exponent)}"
        return scientific if len(scientific) < len(plain) else plain
    return str(value)


def _short_keys(grid: dict) -> dict[str, str]:
    """'train.lr' -> 'lr'; the full dotted name when two grid keys share their last part."""
    lasts = [key.rsplit(".", 1)[-1] for key in grid]
    return {key: (last if lasts.count(last) == 1 else key) for key, last in zip(grid, lasts)}


def expand_trials(cfg: dict) -> dict[str, tuple[str, dict]]:
    """{trial_name: (preset_name, {dotted_field: value})} for every preset x grid point, in order.

    Empty when the config has no sweep.
    """
    sweep = cfg.get("sweep")
    if not sweep:
        return {}
    grid = sweep["grid"]
    short = _short_keys(grid)
    trials: dict[str, tuple[str, dict]] = {}
    for preset_name in sweep["presets"]:
        for values in itertools.product(*grid.values()):
            overrides = dict(zip(grid, values))
            parts = [f"{short[key]}{format_value(value)}" for key, value in overrides.items()]
            name = SEPARATOR.join([preset_name, *parts])
            if not _NAME_OK.match(name):
                raise C.ConfigError(f"{cfg.get('_source', 'config')}: sweep: trial name {name!r} "
                                    "has characters outside A-Z a-z 0-9 _ . - (use simpler grid values)")
            if name in trials:
                raise C.ConfigError(f"{cfg.get('_source', 'config')}: sweep: two grid points give the "
                                    f"same trial name {name!r} (duplicate values?)")
            trials[name] = (preset_name, overrides)
    return trials


def resolve_trial(name: str, cfg: dict) -> dict:
    """The preset dict of a trial: its base preset with the grid values set, validated, renamed."""
    trials = expand_trials(cfg)
    if name not in trials:
        raise C.ConfigError(f"{cfg.get('_source', 'config')}: sweep: no trial named {name!r} "
                            f"(trials: {', '.join(trials) or 'none'})")
    preset_name, overrides = trials[name]
    preset = C.load_preset(preset_name, cfg)
    for key, value in overrides.items():
        try:
            preset = C.set_field(preset, key, value)
        except (KeyError, TypeError):
            raise C.ConfigError(f"{cfg.get('_source', 'config')}: sweep.grid: {key}: "
                                f"no such preset field in {preset_name}") from None
    preset["name"] = name
    source = f"{C.preset_path(preset_name, cfg)} (sweep trial {name})"
    preset = C.validate(preset, "preset.schema.yaml", source)
    C.check_preset(preset, source)
    return preset


def trial_names(cfg: dict) -> list[str]:
    """Names of every trial of the sweep, in order (for Snakemake's expand)."""
    return list(expand_trials(cfg))
