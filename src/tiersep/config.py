"""Load, validate and resolve the pipeline config and presets.

The JSON schemas in workflow/schemas/ are the single home of every default: this module fills them in
while validating, so the rest of the code reads `cfg["evaluate"]["overlap"]` and never states a
default of its own. Errors name the file, the key and what is allowed, on one line.
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
import re
import reprlib
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft202012Validator, validators

from tiersep.resources import resource_dir

PACKAGE_DIR = Path(__file__).resolve().parent
# The schemas live once, in workflow/schemas (a wheel carries them inside the package).
SCHEMA_DIRS = (resource_dir("schemas"), Path.cwd() / "workflow" / "schemas")


class ConfigError(ValueError):
    """A config or preset that does not validate; the message is one line for the user.
    Subclasses may set `exit_code` (the CLI exits with it; 2 when absent)."""

    def __init__(self, message: str, key_path: tuple = ()):
        super().__init__(message)
        self.key_path = key_path


class DoesNotFit(ConfigError):
    """Nothing the user asked for fits the memory budget (exit 3, as a refused train): the fit gate's
    refusal (memory/fit/gate.py, with its estimate, the budget and what would fit), a separation plan
    or a fit search that finds nothing. The message says what fits."""

    exit_code = 3

    def __init__(self, message: str, estimate: dict | None = None, budget_bytes: int | None = None,
                 suggestion: list[str] | None = None, fitted: dict | None = None):
        super().__init__(message)
        self.estimate, self.budget_bytes, self.suggestion = estimate, budget_bytes, suggestion
        self.fitted = fitted  # the variant that fits (what on_oversize: adapt trains), if any


# Bounds on what one YAML input may cost to read: configs and presets are a few KiB with no
# aliases, so these only stop a mistaken or hostile file (a "billion laughs" alias bomb expands
# to 9^9 nodes from 81 aliases, hence the cap on the expanded size as well as on the aliases).
MAX_YAML_BYTES = 1 << 20
MAX_YAML_ALIASES = 100
MAX_YAML_DEPTH = 64
MAX_YAML_NODES = 1_000_000   # after expanding aliases; 1 MiB of plain YAML holds at most ~0.5 M


class YamlLimitError(yaml.YAMLError):
    """A YAML input over one of the limits above; the message is one line."""


def _schema_path(name: str) -> Path:
    for folder in SCHEMA_DIRS:
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(f"schema {name} not found in {', '.join(map(str, SCHEMA_DIRS))}")


class YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2 floats: 1e-4, 5E-4, .5 and -2e+3 are numbers.

    PyYAML follows YAML 1.1, where a float needs a dot (1.0e-4), so `lr: 4e-3` or
    `--set train.lr=4e-3` were read as the string '4e-3'. Integers, booleans and null keep their
    meaning; a quoted '1e-4' stays a string.

    Bounded: at most MAX_YAML_ALIASES aliases, MAX_YAML_DEPTH levels of nesting and
    MAX_YAML_NODES nodes once aliases are expanded (YamlLimitError otherwise).
    """

    def __init__(self, stream):
        super().__init__(stream)
        self._aliases = 0
        self._depth = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_YAML_ALIASES:
                raise YamlLimitError(f"more than {MAX_YAML_ALIASES} YAML aliases")
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise YamlLimitError(f"nested deeper than {MAX_YAML_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self):
        node = super().compose_document()
        if self._aliases:   # without aliases the size is bounded by the text's
            _expanded_size(node, {}, set())
        return node

    def construct_yaml_int(self, node):
        try:
            return super().construct_yaml_int(node)
        except ValueError:   # Python refuses to read an int of more than 4300 digits
            raise yaml.constructor.ConstructorError(
                None, None, f"an integer of {len(node.value)} digits", node.start_mark) from None


def _expanded_size(node, sizes: dict, open_: set) -> int:
    """Nodes in `node` with every alias expanded (an alias is the anchored node object itself);
    YamlLimitError when it passes MAX_YAML_NODES or an alias refers to a node that contains it."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_:
        raise YamlLimitError("a YAML alias refers to a node that contains it (recursive)")
    open_.add(key)
    size = 1
    if isinstance(node, yaml.SequenceNode):
        size += sum(_expanded_size(child, sizes, open_) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        size += sum(_expanded_size(k, sizes, open_) + _expanded_size(v, sizes, open_) for k, v in node.value)
    open_.discard(key)
    if size > MAX_YAML_NODES:
        raise YamlLimitError(f"more than {MAX_YAML_NODES} YAML nodes once its aliases are expanded")
    sizes[key] = size
    return size


# The YAML 1.2 core schema's float (https://yaml.org/spec/1.2.2/#1023-core-schema), tried after
# PyYAML's own int and float patterns, so what those read is unchanged.
YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?$"),
    list("-+0123456789."))
YamlLoader.add_constructor("tag:yaml.org,2002:int", YamlLoader.construct_yaml_int)


def load_yaml(text: str):
    """Parse YAML text the way every tiersep input is read (configs, presets, --set, schemas).
    Raises yaml.YAMLError, YamlLimitError when over the limits above."""
    if len(text) > MAX_YAML_BYTES:
        raise YamlLimitError(f"longer than the limit of {MAX_YAML_BYTES} characters")
    return yaml.load(text, Loader=YamlLoader)  # noqa: S506 - a SafeLoader subclass


def load_schema(name: str) -> dict:
    return load_yaml(_schema_path(name).read_text())


def _with_defaults(validator_class):
    """A validator that writes each property's `default` into the instance before validating it."""
    validate_properties = validator_class.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for key, sub in properties.items():
                if "default" in sub and key not in instance:
                    instance[key] = copy.deepcopy(sub["default"])
        yield from validate_properties(validator, properties, instance, schema)

    # jsonschema's "integer" takes 16000.0 (and YAML 1.2 reads 1.6e4 as that float), which then
    # fails deep in torch; tiersep's integers are ints (never bools).
    integers_are_ints = validator_class.TYPE_CHECKER.redefine(
        "integer", lambda _checker, value: isinstance(value, int) and not isinstance(value, bool))
    return validators.extend(validator_class, {"properties": set_defaults}, type_checker=integers_are_ints)


_DefaultingValidator = _with_defaults(Draft202012Validator)


def _where(path) -> str:
    where = ".".join(str(p) if not isinstance(p, int) else f"[{p}]" for p in path)
    return where.replace(".[", "[") or "(top level)"


def short_repr(value: Any) -> str:
    """repr of a value a user wrote, short enough for a one-line message (a key or a value may be
    a whole file's line or content)."""
    text = _SHORT_REPR.repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxstring = 40
_SHORT_REPR.maxother = 40


# What str.splitlines() breaks a line at: a key or value holding one must not split a message.
_LINE_BREAKS = {ord(c): repr(c)[1:-1] for c in "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"}


def escape_line_breaks(text: str) -> str:
    """`text` with its line breaks written as escapes (\\n, \\x1d, ...)."""
    return text.translate(_LINE_BREAKS)


def _check_numbers(node: Any, source: str | Path, path: tuple = ()) -> None:
    """NaN and +-inf pass every jsonschema range check (NaN compares false with everything), and no
    tiersep field means them; an int beyond 64 bits passes a field without a maximum, then
    overflows in torch or numpy. Refuse them wherever they are."""
    if isinstance(node, float) and not math.isfinite(node):
        raise ConfigError(f"{source}: {_where(path)}: {node} is not a finite number", path)
    if isinstance(node, int) and not isinstance(node, bool) and not -2**63 <= node < 2**63:
        raise ConfigError(f"{source}: {_where(path)}: {short_repr(node)} is too large (beyond a 64-bit integer)", path)
    if isinstance(node, dict):
        for key, value in node.items():
            _check_numbers(value, source, path + (key,))
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            _check_numbers(value, source, path + (i,))


def _describe(error) -> str:
    """'key.sub[2]: <what is wrong> (allowed: ...)' for one jsonschema error."""
    where = _where(error.absolute_path)
    schema = error.schema if isinstance(error.schema, dict) else {}
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        extra = sorted((k for k in error.instance if k not in allowed), key=str) \
            if isinstance(error.instance, dict) else []
        # a file that is not a preset (any text file read as YAML) is all unknown keys: name a few
        named = ", ".join(short_repr(k) for k in extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
        return f"{where}: unknown key {named} (allowed keys: {', '.join(allowed)})"
    allowed = []
    for bound in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        if bound in schema:
            allowed.append(f"{bound} {schema[bound]}")
    if "enum" in schema:
        allowed.append("one of " + ", ".join(map(str, schema["enum"])))
    hint = f" (allowed: {'; '.join(allowed)})" if allowed and error.validator not in ("enum",) else ""
    if error.validator == "oneOf" and "description" in schema:
        hint = f" (allowed: {schema['description'].strip()})"
    message = error.message
    full = repr(error.instance)
    if len(full) > 60 and full in message:   # jsonschema quotes the whole value
        message = message.replace(full, short_repr(error.instance))
    return f"{where}: {message}{hint}"


def validate(instance: Any, schema_name: str, source: str | Path) -> dict:
    """Validate `instance` in place against a schema, filling defaults; raise ConfigError."""
    if instance is None:
        instance = {}
    if not isinstance(instance, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level, got {type(instance).__name__}")
    _check_numbers(instance, source)
    validator = _DefaultingValidator(load_schema(schema_name))
    errors = sorted(validator.iter_errors(instance), key=lambda e: (len(e.path), list(map(str, e.path))))
    if errors:
        raise ConfigError(f"{source}: {_describe(errors[0])}", tuple(errors[0].absolute_path))
    return instance


def _read_yaml(path: Path) -> Any:
    """A config or preset file's YAML; every way it can fail is a one-line ConfigError."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_YAML_BYTES + 1)   # bounded: /dev/zero or a data file named by mistake
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except OSError as err:   # a folder, no permission, ...
        raise ConfigError(f"{path}: cannot read it ({err.strerror or err})") from None
    if len(data) > MAX_YAML_BYTES:
        raise ConfigError(f"{path}: larger than the limit of {MAX_YAML_BYTES // 2**20} MiB for a "
                          "config or preset file")
    try:
        return load_yaml(data.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not a YAML text file ({err.reason} at byte {err.start})") from None
    except yaml.reader.ReaderError as err:   # control characters: binary data that decoded
        raise ConfigError(f"{path}: not a YAML text file ({err.reason} at byte {err.position})") from None
    except YamlLimitError as err:
        raise ConfigError(f"{path}: refused: {err}") from None
    except yaml.MarkedYAMLError as err:   # name the line and column, as an editor shows them
        mark = err.problem_mark or err.context_mark
        where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        what = "; ".join(p for p in (err.context, err.problem) if p) or str(err).splitlines()[0]
        raise ConfigError(f"{path}{where}: not valid YAML ({what})") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({str(err).splitlines()[0]})") from None


def load_config(path: str | Path, overrides: dict | None = None) -> dict:
    """Read, validate and default-fill a pipeline config file."""
    path = Path(path)
    cfg = _read_yaml(path) or {}
    if overrides:
        cfg = deep_merge(cfg, overrides)
    cfg = validate(cfg, "config.schema.yaml", path)
    cfg["_source"] = str(path)
    cfg = sweep_as_search(cfg)
    check_config(cfg)
    return cfg


def read_config_files(files: list[str | Path], overrides: dict | None = None) -> dict:
    """The config Snakemake merges from `files` (later files win, key by key) and the --config
    `overrides`, with every file read by tiersep's YAML rules: Snakemake reads files as YAML 1.1,
    where `lr: 1e-4` in a search space would be the string '1e-4'. Missing files are skipped."""
    merged: dict = {}
    for file in files:
        if Path(file).is_file():
            merged = deep_merge(merged, _read_yaml(Path(file)) or {})
    return deep_merge(merged, dict(overrides or {}))


def validate_config(cfg: dict, files: list[str | Path]) -> dict:
    """Validate a config dict merged from `files` (as Snakemake holds it); errors name the file
    that set the offending key (the last one that has it)."""
    cfg = {k: v for k, v in copy.deepcopy(cfg).items() if not k.startswith("_")}
    try:
        cfg = validate(cfg, "config.schema.yaml", " + ".join(map(str, files)))
    except ConfigError as err:
        owner = next((f for f in reversed(files) if _has_key(_read_yaml(Path(f)), err.key_path)), None)
        if owner is None:
            raise
        raise ConfigError(f"{owner}{str(err).split(' + '.join(map(str, files)), 1)[1]}", err.key_path) from None
    cfg["_source"] = str(files[-1])
    cfg = sweep_as_search(cfg)
    check_config(cfg)
    return cfg


def sweep_as_search(cfg: dict) -> dict:
    """`sweep:` is a thin alias of `search:` (docs/search.md#a-grid-sweep): its one preset, each grid
    field's values as choices, the grid sampler, one trial per grid point and no pruner (every point
    trains to its end, as a sweep did). The search is the only engine that runs it; the config
    leaves here with `search` set and `sweep` null, so a merged config read again stays the same."""
    sweep = cfg.get("sweep")
    if not sweep:
        return cfg
    source = cfg.get("_source", "config")
    if cfg.get("search"):
        raise ConfigError(f"{source}: sweep: a sweep is a grid search; give sweep or search, not both "
                          "(search.sampler: grid; docs/search.md)")
    if len(sweep["presets"]) > 1:
        raise ConfigError(f"{source}: sweep.presets: one preset per sweep (it is the grid search's base "
                          "preset); give one config per preset, or vary the fields in sweep.grid")
    search = {"preset": sweep["presets"][0], "study": "sweep", "sampler": "grid", "pruner": "none",
              "space": {field: {"choices": list(values)} for field, values in sweep["grid"].items()},
              "trials": math.prod(len(values) for values in sweep["grid"].values())}
    filled = validate({"search": search}, "config.schema.yaml", f"{source} (sweep as search)")
    return {**cfg, "sweep": None, "search": filled["search"]}


def _has_key(node: Any, key_path: tuple) -> bool:
    for part in key_path:
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            return False
    return bool(key_path) or node is not None


def check_config(cfg: dict) -> None:
    """Cross-field checks the schema cannot express; every preset named must load."""
    source = cfg.get("_source", "config")
    data = cfg["data"]
    if data["source"] in ("musdb18hq", "musdb18") and not data["root"]:
        raise ConfigError(f"{source}: data.root: required when data.source is {data['source']} "
                          "(the folder holding train/ and test/)")
    synth = data["synthetic"]
    if synth["valid_tracks"] >= synth["train_tracks"]:
        raise ConfigError(f"{source}: data.synthetic.valid_tracks: must be below train_tracks "
                          f"({synth['train_tracks']})")
    _check_tier_names(cfg)
    for name in all_preset_names(cfg):
        load_preset(name, cfg)


def all_preset_names(cfg: dict) -> list[str]:
    return list(cfg["tiers"]) + [t for t in cfg["estimate_tiers"] if t not in cfg["tiers"]]


def is_preset_file(entry: str) -> bool:
    """Whether a tier entry is a path to a preset YAML rather than a preset name."""
    return entry.endswith((".yaml", ".yml")) or "/" in entry


def tier_name(entry: str) -> str:
    """The name a tier entry goes by in results/ and the report: a preset name as it is, a preset
    file by its stem (`tiers: [my/fast.yaml]` trains results/train/fast)."""
    return Path(entry).stem if is_preset_file(entry) else entry


def tier_names(entries: list[str]) -> list[str]:
    return [tier_name(entry) for entry in entries]


def _check_tier_names(cfg: dict) -> None:
    """Two different tier entries must not share a name (two files with one stem, or a file named
    like a preset)."""
    seen: dict[str, str] = {}
    for entry in list(cfg["tiers"]) + list(cfg["estimate_tiers"]):
        if tier_name(entry) == "fit_matrix":   # results/vram/fit_matrix.json is the fit matrix's
            raise ConfigError(f"{cfg.get('_source', 'config')}: tiers: a tier may not be named fit_matrix "
                              "(results/vram/fit_matrix.json is what fits which GPU); rename the preset")
        other = seen.setdefault(tier_name(entry), entry)
        if other != entry:
            raise ConfigError(f"{cfg.get('_source', 'config')}: tiers: {other!r} and {entry!r} would both "
                              f"be the tier {tier_name(entry)!r} in results/; rename one preset file")


SHIPPED_PRESETS = resource_dir("presets")


def preset_path(name: str, cfg: dict | None = None) -> Path:
    """A preset name resolves to <presets_dir>/<name>.yaml, else to the shipped preset of that name
    (so a config with its own presets_dir can still list the seed tiers); a path to a .yaml file is
    taken as is, and any other path is refused (it would be read as YAML, its lines shown back)."""
    if name.endswith((".yaml", ".yml")):
        return Path(name)
    if "/" in name:
        raise ConfigError(f"{name[:200]}: a preset given as a path must be a .yaml or .yml file")
    presets_dir = Path(cfg["presets_dir"]) if cfg else Path("config/presets")
    path = presets_dir / f"{name}.yaml"
    shipped = SHIPPED_PRESETS / f"{name}.yaml"
    if path.is_file() or shipped.is_file():
        return path if path.is_file() else shipped
    # a tier the config lists as a preset file, called by its tier name (the workflow's jobs do)
    files = [e for e in (cfg or {}).get("tiers", []) + (cfg or {}).get("estimate_tiers", [])
             if is_preset_file(e) and tier_name(e) == name]
    return Path(files[0]) if files else path


def load_preset(name: str, cfg: dict | None = None) -> dict:
    """Load a preset by name (or path), validate it and fill its defaults."""
    path = preset_path(name, cfg)
    if not path.is_file():
        known = sorted(p.stem for p in path.parent.glob("*.yaml")) if path.parent.is_dir() else []
        raise ConfigError(f"{path}: preset {name!r} not found (known presets: {', '.join(known) or 'none'})")
    preset = validate(_read_yaml(path), "preset.schema.yaml", path)
    check_preset(preset, path)
    return preset


# No track is longer, and an estimate's work grows with the segment (2**40 samples: hours of tracing).
MAX_SEGMENT_SECONDS = 600


def check_preset(preset: dict, source: str | Path) -> None:
    """Cross-field checks the schema cannot express, each one the model, loss or trace would
    otherwise fail on with a traceback."""
    audio, model, train = preset["audio"], preset["model"], preset["train"]
    train["betas"] = [float(b) for b in train["betas"]]   # torch's AdamW refuses betas [0, 0.999]
    if audio["hop"] > audio["n_fft"]:
        raise ConfigError(f"{source}: audio.hop: {audio['hop']} exceeds audio.n_fft {audio['n_fft']}")
    if audio["segment_samples"] < audio["n_fft"]:
        raise ConfigError(f"{source}: audio.segment_samples: {audio['segment_samples']} is shorter "
                          f"than audio.n_fft {audio['n_fft']}")
    if audio["segment_samples"] > MAX_SEGMENT_SECONDS * audio["sample_rate"]:
        raise ConfigError(f"{source}: audio.segment_samples: {audio['segment_samples']} is longer than "
                          f"{MAX_SEGMENT_SECONDS // 60} minutes at audio.sample_rate {audio['sample_rate']}")
    if model["attention_dim"] % model["n_heads"]:
        raise ConfigError(f"{source}: model.attention_dim: {model['attention_dim']} is not divisible "
                          f"by model.n_heads {model['n_heads']}")
    if (model["attention_dim"] // model["n_heads"]) % 2:
        raise ConfigError(f"{source}: model.attention_dim: head size "
                          f"{model['attention_dim'] // model['n_heads']} must be even (RoPE)")
    if model["emb_dim"] % model["norm_groups"]:
        raise ConfigError(f"{source}: model.norm_groups: {model['norm_groups']} does not divide "
                          f"model.emb_dim {model['emb_dim']}")
    if model["conv_kernel"] < model["conv_stride"]:
        raise ConfigError(f"{source}: model.conv_kernel: {model['conv_kernel']} is smaller than "
                          f"model.conv_stride {model['conv_stride']}")
    if train["augment"]["gain_min"] > train["augment"]["gain_max"]:
        raise ConfigError(f"{source}: train.augment.gain_min: above gain_max")
    resolutions = train["loss"]["stft_resolutions"]
    if resolutions == [] and train["loss"]["stft_l1"] > 0:
        raise ConfigError(f"{source}: train.loss.stft_resolutions: empty while train.loss.stft_l1 > 0 "
                          "(null = the preset's own)")
    for i, (size, hop) in enumerate(resolutions or []):
        if hop > size:
            raise ConfigError(f"{source}: train.loss.stft_resolutions[{i}]: hop {hop} exceeds n_fft {size}")


def deep_merge(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def set_field(preset: dict, dotted: str, value: Any) -> dict:
    """Return a copy of `preset` with `section.field` set (used by the search and fit)."""
    out = copy.deepcopy(preset)
    section, field = dotted.split(".", 1)
    node = out[section]
    *parents, leaf = field.split(".")
    for part in parents:
        node = node[part]
    node[leaf] = value
    return out


def preset_hash(preset: dict) -> str:
    return hashlib.sha256(json.dumps(preset, sort_keys=True).encode()).hexdigest()[:12]


def configured_budget_bytes(cfg: dict, override_gib: float | None = None) -> int | None:
    """The configured fit-gate budget in bytes (budget_gib, or override_gib), or None for auto.

    auto means the free memory of the GPU a train job runs on, read by that job right before its
    gate (train/plan.py): a prepare, estimate, fit or report job must not open a CUDA context to
    find it, as that takes about 0.5-1 GiB from a training job running beside it."""
    value = override_gib if override_gib is not None else cfg["budget_gib"]
    if value == "auto":
        return None
    return max(1, int(float(value) * 2**30))   # a positive budget below one byte is one byte


budget_bytes = configured_budget_bytes  # the name train/plan.py and report/collect.py call


def dump_preset(preset: dict) -> str:
    return yaml.safe_dump(preset, sort_keys=False)
