"""Write config/README.md: every config and preset key with its type, default and description.

Read from workflow/schemas/config.schema.yaml and preset.schema.yaml, the one place defaults live,
so the reference is regenerated rather than edited:

    python workflow/scripts/config_reference.py            # rewrite config/README.md
    python workflow/scripts/config_reference.py --check    # exit 1 when config/README.md is stale

A key the schema gives no description takes its text from EXTRA_DESCRIPTIONS below (moved from the
old README tables); a description written into the schema later wins, and tests/test_docs.py then
asks for the entry here to be deleted, so each text lives in one place.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
SCHEMAS = REPO / "workflow" / "schemas"
OUTPUT = REPO / "config" / "README.md"

# Descriptions of keys the schemas leave undescribed, by (schema file, dotted key).
EXTRA_DESCRIPTIONS = {
    ("config", "data"): "Where the audio comes from and where prepared data go (docs/data.md).",
    ("config", "data.synthetic"): "Settings of the embedded synthetic MUSDB18-HQ-layout set.",
    ("config", "data.synthetic.seed"): "Seed of the synthetic set: the same seed writes the same audio.",
    ("config", "data.synthetic.train_tracks"): "Tracks in the synthetic train subset (validation included).",
    ("config", "data.synthetic.track_seconds"): "Length of every synthetic track in seconds.",
    ("config", "results_dir"): "Where results go (vram/, train/, eval/, report/, config.yaml).",
    ("config", "estimate"): "How the peak-memory estimates are made (docs/memory.md).",
    ("config", "evaluate"): "How the test tracks are separated and scored (docs/evaluation.md).",
    ("config", "evaluate.save_estimates"): "Also write the separated stems as estimates/<track>/<stem>.wav.",
    ("config", "sweep.presets"): "The one preset the grid varies (the search's base preset); several are refused.",
    ("config", "sweep.grid"): "Preset field (section.field) -> the values it takes; each grid point is one trial.",
    ("preset", "name"): "The preset's name (for a file in presets_dir: the file name without .yaml).",
    ("preset", "description"): "Free text shown with the tier.",
    ("preset", "audio"): "The audio the model sees: rate, channels, segment and STFT.",
    ("preset", "audio.sample_rate"): "Rate the tier trains and is evaluated at; picks its prepared folder.",
    ("preset", "audio.channels"): "Audio channels of the mixture and of every stem.",
    ("preset", "audio.n_fft"): "STFT frame size in samples; F = n_fft/2 + 1 frequency bins.",
    ("preset", "audio.hop"): "STFT hop in samples; T = 1 + segment_samples/hop frames.",
    ("preset", "audio.window"): "STFT window.",
    ("preset", "model"): "The TF-Locoformer network (docs/training.md, The model).",
    ("preset", "model.sources"): "The stems the model separates, in output order.",
    ("preset", "model.n_layers"): "Number of TF-Locoformer blocks (each has a frequency and a time path).",
    ("preset", "model.emb_dim"): "Channels per TF bin in the blocks.",
    ("preset", "model.attention_dim"): "q/k/v width; a multiple of n_heads with an even head size (RoPE).",
    ("preset", "model.n_heads"): "Attention heads.",
    ("preset", "model.ffn_hidden"): "Hidden width H of each SwiGLU FFN (its first convolution outputs 2H).",
    ("preset", "model.conv_kernel"): "Kernel of the FFN's Conv1d and ConvTranspose1d.",
    ("preset", "model.conv_stride"): "Stride of those convolutions (at most conv_kernel).",
    ("preset", "model.norm_groups"): "RMSGroupNorm groups; must divide emb_dim.",
    ("preset", "model.dropout"): "Dropout in the FFNs, on the attention weights and after the attention "
                                 "output. On a CPU, attention dropout > 0 makes SDPA use the math kernel.",
    ("preset", "model.rope_base"): "RoPE base frequency.",
    ("preset", "model.eps"): "Epsilon of GroupNorm and RMSGroupNorm.",
    ("preset", "train"): "The optimiser, schedule, precision and run settings (docs/training.md).",
    ("preset", "train.device"): "Where to train: auto (CUDA when a GPU is visible), cpu or cuda.",
    ("preset", "train.grad_accum"): "Micro-batches accumulated per optimizer step "
                                    "(effective batch = batch_size x grad_accum).",
    ("preset", "train.precision"): ("fp32, bf16 autocast, or fp16 autocast with a gradient scaler (norms, RoPE, STFT stay fp32; "
                                    "docs/training.md#fp16); auto: bf16 on a GPU with native bf16 (sm80+), fp16 on "
                                    "an older one, fp32 on a CPU (docs/memory.md#gpus)."),
    ("preset", "train.lr"): "AdamW learning rate (after the linear warm-up).",
    ("preset", "train.weight_decay"): "AdamW weight decay.",
    ("preset", "train.betas"): "AdamW betas.",
    ("preset", "train.schedule"): "Learning-rate schedule after the linear warm-up.",
    ("preset", "train.min_lr_ratio"): "Floor of the decay, as a fraction of lr (cosine and plateau).",
    ("preset", "train.steps"): "Optimisation steps.",
    ("preset", "train.warmup_steps"): "Steps of linear learning-rate warm-up.",
    ("preset", "train.num_workers"): "Data-loading processes (the batches are the same whatever the number).",
    ("preset", "train.seed"): "Weights, dropout and data are all seeded from it.",
    ("preset", "train.checkpoint_every"): "Steps between checkpoints/last.pt writes.",
    ("preset", "train.validate_every"): "Steps between validations.",
    ("preset", "train.loss"): "Loss weights: waveform L1 plus multi-resolution complex-STFT L1.",
    ("preset", "train.augment"): "Training-data augmentation (docs/data.md, Training loader).",
    ("preset", "train.augment.gain_min"): "Lowest random gain applied to each stem.",
    ("preset", "train.augment.gain_max"): "Highest random gain applied to each stem.",
    ("preset", "train.augment.channel_swap"): "Swap each stem's left and right channels with probability 1/2.",
}

SCHEMA_FILES = {"config": "config.schema.yaml", "preset": "preset.schema.yaml"}

HEADER = """\
# Configuration reference

<!-- Generated by workflow/scripts/config_reference.py from workflow/schemas/; do not edit by hand.
     Regenerate: .venv/bin/python workflow/scripts/config_reference.py -->

Every key of the pipeline config and of a preset, with its type, its default and what it does.
The defaults live in the JSON schemas ([config](../workflow/schemas/config.schema.yaml),
[preset](../workflow/schemas/preset.schema.yaml), Draft 2020-12) and nowhere else; this page is
generated from them.

**The config.** [`config.yaml`](config.yaml) is the embedded default (a synthetic set, two CPU
tiers); [`musdb18hq.yaml`](musdb18hq.yaml) trains the GPU tiers on a local MUSDB18-HQ. Give your
own file with `snakemake --configfile my.yaml ...`: it is merged over `config/config.yaml`. The
merged config is validated before any job starts (an unknown key, a wrong type or an out-of-range
value stops the run with one line naming the file and the key), every missing key takes its
default, and the result is written to `<results_dir>/config.yaml`, the file every job reads.

**A preset** (a tier) is a YAML file in `presets_dir` ([`presets/`](presets/)), named in `tiers`
or `estimate_tiers` by its file name, or given as a path. `audio`, `model` and `train` hold every
field the model, the data and the optimiser need; a missing field takes its default when the preset
is loaded. `tiersep estimate|fit|train|evaluate --set section.field=value` overrides one field on
the command line; a search (`search.space`, or a grid in `sweep.grid`) varies fields across trials.
The seed tiers are described in [docs/training.md](../docs/training.md#presets-tiers).
"""


def load_schema(kind: str) -> dict:
    return yaml.safe_load((SCHEMAS / SCHEMA_FILES[kind]).read_text())


def value_text(value) -> str:
    """A value as YAML writes it inline: null, true, 0.001, [a, b], {}."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return "[" + ", ".join(value_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {value_text(v)}" for k, v in value.items()) + "}"
    return str(value) if value != "" else '""'


def bounds_text(node: dict) -> str:
    """Numeric bounds: [0, 0.9], (0, 4096], >= 1, < 1 (empty when unbounded)."""
    low = ("[", node["minimum"]) if "minimum" in node else ("(", node["exclusiveMinimum"]) \
        if "exclusiveMinimum" in node else None
    high = (node["maximum"], "]") if "maximum" in node else (node["exclusiveMaximum"], ")") \
        if "exclusiveMaximum" in node else None
    if low and high:
        return f"{low[0]}{value_text(low[1])}, {value_text(high[0])}{high[1]}"
    if low:
        return f"{'≥' if low[0] == '[' else '>'} {value_text(low[1])}"
    if high:
        return f"{'≤' if high[1] == ']' else '<'} {value_text(high[0])}"
    return ""


def type_text(node: dict) -> str:
    """What a value may be, in words: `one of a, b`, `number in [0, 1]`, `list of string`, ..."""
    if "const" in node:
        return f"`{value_text(node['const'])}`"
    if "enum" in node:
        return "one of " + ", ".join(f"`{value_text(v)}`" for v in node["enum"])
    for key in ("oneOf", "anyOf"):
        if key in node:
            return " or ".join(type_text(option) for option in node[key])
    types = node.get("type")
    if isinstance(types, list):
        return " or ".join(type_text({**node, "type": t}) for t in types)
    if types in ("integer", "number"):
        bounds = bounds_text(node)
        return f"{types} in {bounds}" if bounds.startswith(("[", "(")) else f"{types} {bounds}".strip()
    if types == "string":
        return f"string matching `{node['pattern']}`" if "pattern" in node else "string"
    if types == "array":
        return array_text(node)
    if types == "object":
        if "properties" in node:
            return "object (keys below)"
        values = type_text(node.get("additionalProperties", {})) or "any value"
        names = node.get("propertyNames", {}).get("pattern")
        return f"mapping of {'`' + names + '`' if names else 'names'} to {values}"
    return types or ""


def array_text(node: dict) -> str:
    if "prefixItems" in node:
        return "[" + ", ".join(type_text(item) for item in node["prefixItems"]) + "]"
    items = node.get("items")
    if items and "enum" in items:
        text = "list of " + ", ".join(f"`{value_text(v)}`" for v in items["enum"])
    else:
        text = f"list of {type_text(items)}" if items else "list"
    notes = []
    if node.get("minItems"):
        notes.append(f"at least {node['minItems']}")
    if node.get("uniqueItems"):
        notes.append("no repeats")
    return f"{text} ({', '.join(notes)})" if notes else text


def object_properties(node: dict) -> tuple[dict, set]:
    """(properties, required) of an object node, looking inside oneOf/anyOf (e.g. sweep)."""
    if "properties" in node:
        return node["properties"], set(node.get("required", []))
    for key in ("oneOf", "anyOf"):
        for option in node.get(key, []):
            if "properties" in option:
                return option["properties"], set(option.get("required", []))
    return {}, set()


def description_of(kind: str, key: str, node: dict) -> str:
    text = node.get("description") or EXTRA_DESCRIPTIONS.get((kind, key))
    if not text:
        raise SystemExit(f"workflow/schemas/{SCHEMA_FILES[kind]}: {key}: no description (add one to "
                         "the schema, or to EXTRA_DESCRIPTIONS in workflow/scripts/config_reference.py)")
    return " ".join(text.split())


def default_text(node: dict, required: bool) -> str:
    if "default" in node:
        return f"`{value_text(node['default'])}`"
    return "**required**" if required else "none"


def cell(text: str) -> str:
    """Table-cell Markdown: pipes escaped; outside `code`, <word> escaped so it is not read as HTML."""
    parts = text.replace("|", "\\|").split("`")
    return "`".join(part if i % 2 else part.replace("<", "\\<") for i, part in enumerate(parts))


def sections(kind: str, node: dict, prefix: str = "") -> list[tuple[str, list[tuple[str, str, str, str]]]]:
    """[(section title, rows)]: one table per object, its keys as (key, type, default, description);
    nested objects get their own section after their parent's."""
    props, required = object_properties(node)
    rows, nested = [], []
    for name, child in props.items():
        key = f"{prefix}{name}"
        rows.append((f"`{key}`", cell(type_text(child)), cell(default_text(child, name in required)),
                     cell(description_of(kind, key, child))))
        if object_properties(child)[0]:
            nested.extend(sections(kind, child, f"{key}."))
    return [(prefix.rstrip(".") or "top level", rows)] + nested


def render() -> str:
    lines = [HEADER]
    for kind, title in (("config", "Config keys"), ("preset", "Preset keys")):
        schema = load_schema(kind)
        lines += [f"## {title} (`workflow/schemas/{SCHEMA_FILES[kind]}`)", ""]
        for section, rows in sections(kind, schema):
            lines += [f"### {section}", "", "| key | type | default | description |", "| --- | --- | --- | --- |"]
            lines += [f"| {' | '.join(row)} |" for row in rows]
            lines.append("")
    return "\n".join(lines)


def all_keys(kind: str) -> set[str]:
    """Every dotted key the schema defines."""
    keys = set()
    for _, rows in sections(kind, load_schema(kind)):
        keys.update(row[0].strip("`") for row in rows)
    return keys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that config/README.md is current")
    parser.add_argument("--out", type=Path, default=OUTPUT, help="where to write (default config/README.md)")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not args.out.is_file() or args.out.read_text() != text:
            print(f"{args.out}: out of date with workflow/schemas; run workflow/scripts/config_reference.py",
                  file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
