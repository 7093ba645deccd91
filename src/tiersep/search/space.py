"""The search space: `search.space` of the config checked against the base preset, as Optuna
distributions.

A dimension is a dotted preset field with a range, `{low, high}` (integers when both bounds and the
step are integers, floats otherwise; `log` and `step` as Optuna's), or `{choices: [...]}`. Every bad
dimension is found here, before any trial, and ends in one line naming the key (ConfigError, exit 2):
an unknown field, low > high, log with low <= 0, log with a step, empty choices, a step that does
not divide high - low, or a bound or choice the preset's schema refuses.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from optuna.distributions import (BaseDistribution, CategoricalDistribution, FloatDistribution,
                                  IntDistribution)

from tiersep import config as C


@dataclass(frozen=True)
class Dimension:
    field: str                       # dotted preset field, e.g. train.lr
    kind: str                        # float, int or categorical
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    step: float | int | None = None
    choices: tuple = ()

    def distribution(self) -> BaseDistribution:
        if self.kind == "categorical":
            return CategoricalDistribution(list(self.choices))
        if self.kind == "int":
            return IntDistribution(self.low, self.high, log=self.log, step=self.step or 1)
        return FloatDistribution(self.low, self.high, log=self.log, step=self.step)

    def grid_values(self) -> list | None:
        """Every value of the dimension for the grid sampler; None for a float range without a step."""
        if self.kind == "categorical":
            return list(self.choices)
        if self.kind == "int":
            return list(range(self.low, self.high + 1, self.step or 1))
        if self.step is None:
            return None
        count = round((self.high - self.low) / self.step)
        return [self.low + i * self.step for i in range(count + 1)]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _has_field(preset: dict, dotted: str) -> bool:
    node: Any = preset
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _dimension(key: str, spec: dict, where: str) -> Dimension:
    """One dimension from its config entry; ConfigError naming `where` on anything bad."""
    numeric = [k for k in ("low", "high") if k in spec]
    if "choices" in spec:
        if numeric:
            raise C.ConfigError(f"{where}: give either choices or low/high, not both")
        if not spec["choices"]:
            raise C.ConfigError(f"{where}: choices: empty (give at least one value)")
        bad = [c for c in spec["choices"] if not (c is None or isinstance(c, (bool, int, float, str)))]
        if bad:
            raise C.ConfigError(f"{where}: choices: {C.escape_line_breaks(repr(bad[0]))[:60]} is not a number, "
                                "string, boolean or null")
        if spec.get("log") or spec.get("step") is not None:
            raise C.ConfigError(f"{where}: log and step apply to a low/high range, not to choices")
        return Dimension(key, "categorical", choices=tuple(spec["choices"]))
    if len(numeric) < 2:
        raise C.ConfigError(f"{where}: needs low and high (a range) or choices (a list)")
    low, high, log, step = spec["low"], spec["high"], spec["log"], spec["step"]
    if low > high:
        raise C.ConfigError(f"{where}: low {low} is above high {high}")
    if log and low <= 0:
        raise C.ConfigError(f"{where}: log: needs low > 0 (low is {low})")
    if log and step is not None:
        raise C.ConfigError(f"{where}: log and step cannot be combined (Optuna samples one or the other)")
    kind = "int" if _is_int(low) and _is_int(high) and (step is None or _is_int(step)) else "float"
    if step is not None:
        ratio = (high - low) / step
        if abs(ratio - round(ratio)) > 1e-9 * max(1.0, abs(ratio)):
            raise C.ConfigError(f"{where}: step {step} does not divide high - low ({high} - {low})")
    return Dimension(key, kind, low, high, bool(log), step)


def _check_values(dim: Dimension, base: dict, preset_name: str, where: str) -> None:
    """Each bound or choice, set alone into the base preset, must pass the preset's schema, and an
    integer field must get integers (a float range on model.n_layers would fail every trial)."""
    current = base
    for part in dim.field.split("."):
        current = current[part]
    values = list(dim.choices) if dim.kind == "categorical" else [dim.low, dim.high]
    if _is_int(current) and dim.kind == "float":
        raise C.ConfigError(f"{where}: {dim.field} is an integer field of {preset_name}; give integer "
                            "low, high and step")
    for value in values:
        try:
            C.validate(C.set_field(base, dim.field, value), "preset.schema.yaml", "x")
        except C.ConfigError as err:
            why = str(err).split(": ", 1)[-1]
            raise C.ConfigError(f"{where}: value {C.escape_line_breaks(repr(value))[:60]} is refused by the preset "
                                f"schema ({why})") from None


def parse_space(search: dict, base: dict, source: str) -> dict[str, Dimension]:
    """{field: Dimension} of `search.space`, checked against the base preset `base` (validated,
    defaults filled); ConfigError (one line naming `source` and the key) on the first bad one."""
    dims = {}
    for key, spec in search["space"].items():
        where = f"{source}: search.space.{key}"
        if not _has_field(base, key):
            raise C.ConfigError(f"{where}: no such preset field in {base['name']}")
        dim = _dimension(key, spec, where)
        _check_values(dim, base, base["name"], where)
        dims[key] = dim
    return dims


def grid(dims: dict[str, Dimension], source: str) -> dict[str, list]:
    """The grid sampler's search space; ConfigError for a float range without a step."""
    out = {}
    for key, dim in dims.items():
        values = dim.grid_values()
        if values is None:
            raise C.ConfigError(f"{source}: search.space.{key}: the grid sampler needs choices or a step "
                                "for a float range")
        out[key] = values
    return out


def grid_size(dims: dict[str, Dimension], source: str) -> int:
    return math.prod(len(v) for v in grid(dims, source).values())


def trial_preset(base: dict, params: dict, name: str, source: str) -> dict:
    """The base preset with a trial's sampled `params` set, renamed, validated and checked
    (ConfigError when a combination breaks a cross-field rule, e.g. attention_dim % n_heads)."""
    preset = base
    for key, value in params.items():
        preset = C.set_field(preset, key, value)
    preset["name"] = name
    preset = C.validate(preset, "preset.schema.yaml", source)
    C.check_preset(preset, source)
    return preset
