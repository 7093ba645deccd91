"""The `tiersep` command: one subcommand per pipeline stage.

Every Snakemake rule is a thin call of one of these; each also works by hand. Stage logic lives in
the stage subpackages; this module only parses arguments, resolves config and presets, and maps
failures to exit codes and one-line messages.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from pathlib import Path

import yaml

import tiersep
from tiersep import config as C

DEFAULT_CONFIG = "config/config.yaml"

EXAMPLES = """\
stages (what `snakemake` runs, in order):
  tiersep prepare  --config config/config.yaml --out data/prepared/synthetic/8000 --sample-rate 8000
  tiersep estimate --config config/config.yaml --preset large --out results/vram/large.json
  tiersep fit      --config config/config.yaml --preset large --budget 24 --out large_24g.yaml
  tiersep train    --config config/config.yaml --preset cpu_tiny --data data/prepared/synthetic/8000 --out results/train/cpu_tiny
  tiersep evaluate --config config/config.yaml --preset cpu_tiny --model results/train/cpu_tiny/model.pt --data data/prepared/synthetic/8000 --out results/eval/cpu_tiny
  tiersep report   --config config/config.yaml --results results --out results/report
A preset NAME is a file config/presets/NAME.yaml (the config's presets_dir) or a path to a preset YAML
(a search's trials and best preset are such files under results/search/<study>/).
"""


def _parse_set(text: str) -> tuple[str, object]:
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise argparse.ArgumentTypeError(f"--set expects section.field=value, got {C.short_repr(text)}")
    key, value = text.split("=", 1)
    try:
        return key, C.load_yaml(value)  # YAML 1.2 numbers: train.lr=4e-3 is a float
    except yaml.YAMLError as err:   # (NaN and inf are refused when the preset is validated)
        raise argparse.ArgumentTypeError(C.escape_line_breaks(f"{key}: not a YAML value ({str(err).splitlines()[0]})")) from None


def _schema_number(schema_name: str, dotted: str, kind):
    """An argparse type for a CLI number (kind int or float) with the range the schema gives
    `dotted`: the bounds are read from the schema (when the option is used), so the CLI and the
    file accept the same values."""
    def parse(text: str):
        node = C.load_schema(schema_name)
        for part in dotted.split("."):
            node = node["properties"][part]
        if "oneOf" in node:   # budget_gib: auto or a number
            node = next(branch for branch in node["oneOf"] if branch.get("type") == "number")
        low, high, above = node.get("minimum"), node.get("maximum"), node.get("exclusiveMinimum")
        allowed = " and ".join(f"{sign} {bound:g}" for sign, bound in ((">", above), (">=", low), ("<=", high))
                               if bound is not None)
        what = "an integer" if kind is int else "a finite number"
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{C.short_repr(text)} is not {what} ({allowed})") from None
        if kind is int and not -2**63 <= value < 2**63:   # as in a config (C._check_numbers)
            raise argparse.ArgumentTypeError(f"{C.short_repr(value)} is too large (beyond a 64-bit integer)")
        if not math.isfinite(value) or (low is not None and value < low) or \
                (high is not None and value > high) or (above is not None and value <= above):
            raise argparse.ArgumentTypeError(f"{value} is out of range ({what} {allowed}, as {dotted} in "
                                             f"{schema_name})")
        return value

    return parse


def _whole_number(low: int, high: int | None, why: str):
    """An argparse type for an integer option within [low, high]; `why` explains the range."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{C.short_repr(text)} is not an integer >= {low}") from None
        if value < low or (high is not None and value > high):
            bounds = f">= {low}" if high is None else f"{low} to {high}"
            raise argparse.ArgumentTypeError(f"{value}: must be {bounds} ({why})")
        return value

    return parse


def _study_name(text: str) -> str:
    """An argparse type for --study: the schema's pattern for search.study (it names a folder)."""
    import re

    pattern = C.load_schema("config.schema.yaml")["properties"]["search"]["properties"]["study"]["pattern"]
    if not re.match(pattern, text):
        raise argparse.ArgumentTypeError(f"{C.short_repr(text)}: letters, digits, _ . - only, not starting with . or -")
    return text


_attempt = _whole_number(1, None, "Snakemake counts attempts from 1")
_jobs = _whole_number(1, 64, "processes")


def resolve_preset(name: str, cfg: dict, sets: list[tuple[str, object]] | None = None) -> dict:
    """A preset by name or path, with --set overrides applied and re-validated."""
    preset = C.load_preset(name, cfg)
    for key, value in sets or []:
        try:
            preset = C.set_field(preset, key, value)
        except (KeyError, TypeError):
            raise C.ConfigError(f"--set {key}: no such preset field") from None
    if sets:
        preset = C.validate(preset, "preset.schema.yaml", f"{name} (with --set)")
        C.check_preset(preset, f"{name} (with --set)")
    return preset


def cmd_prepare(args, cfg):
    from tiersep.data.prepare import prepare

    rate = args.sample_rate if args.sample_rate is not None else \
        C.load_preset(cfg["tiers"][0], cfg)["audio"]["sample_rate"]
    prepare(cfg, Path(args.out), rate)
    return 0


def estimate_device(cfg: dict, name: str, preset: dict, wanted: str | None) -> str:
    """The device an estimate models (estimate.device): auto = a trained tier's own training device
    (train.device; its auto means cuda when NVML sees a GPU, no CUDA context opened), cuda for the
    estimate-only tiers."""
    from tiersep import gpu_info

    wanted = wanted or cfg["estimate"]["device"]
    if wanted != "auto":
        return wanted
    if name not in cfg["tiers"] + C.tier_names(cfg["tiers"]):
        return "cuda"
    train_device = preset["train"]["device"]
    if train_device == "auto":
        return "cuda" if gpu_info.name() is not None else "cpu"
    return train_device


def estimate_budget(cfg: dict, device: str, override_gib: float | None) -> int | None:
    """The budget an estimate is judged against: the configured GPU budget on cuda (auto: none
    here, the train job checks it on its GPU), the machine's available RAM on cpu."""
    if device == "cpu" and override_gib is None:
        import psutil

        return int(psutil.virtual_memory().available)
    return C.budget_bytes(cfg, override_gib)


def cmd_estimate(args, cfg):
    names = args.preset or []
    if not names:
        raise C.ConfigError("--preset: required (one preset, or several with an --out holding {preset})")
    if len(names) > 1 and "{preset}" not in args.out:
        raise C.ConfigError(f"--out {args.out}: with several --preset, a path holding {{preset}} (e.g. "
                            "results/vram/{preset}.json): one record per preset")
    if args.inference:
        if len(names) > 1:
            raise C.ConfigError("--inference: one --preset at a time")
        args.preset, args.out = names[0], args.out.replace("{preset}", C.tier_name(names[0]))
        return cmd_estimate_inference(args, cfg)
    # every preset resolved first: a bad name is one line before torch is imported (3 s)
    presets = [(name, resolve_preset(name, cfg, args.set)) for name in names]
    # several presets in one process: the imports and torch's start are paid once (issue 24)
    for name, preset in presets:
        _estimate_one(args, cfg, name, preset, args.out.replace("{preset}", C.tier_name(name)))
    return 0


def _estimate_one(args, cfg, name: str, preset: dict, out: str) -> None:
    from tiersep.io import write_json
    from tiersep.memory import GateSettings, estimate
    from tiersep.records import validate_record

    device = estimate_device(cfg, name, preset, args.device)
    method = args.method or cfg["estimate"]["method"]
    if method == "measure" and device == "cuda":
        lease_gpu("cuda", "estimate")   # a measured step runs on the GPU: on one of its own
        import torch

        if not torch.cuda.is_available():
            named = "--method measure" if args.method else f"{cfg.get('_source', 'config')}: estimate.method: measure"
            raise C.ConfigError(f"{named} on device cuda needs a GPU, and torch sees none (use --method "
                                "trace or analytic, which model cuda without one, or --device cpu)")
    card, calibration_spec, budget = estimate_target(cfg, args, device)
    settings = GateSettings.from_config(cfg, calibration_spec)
    record = estimate(
        preset,
        method=method,
        device=device,
        budget_bytes=budget,
        safety_margin=settings.safety_margin,
        calibration_spec=settings.calibration_spec,
        gpu=card,
    )
    if device == "cuda" and card is None and args.budget is None and cfg["budget_gib"] == "auto":
        record["budget"] = "auto (checked at train time)"
    write_json(out, validate_record("estimate", record, out))
    gib = record["peak_bytes"] / 2**30
    verdict = {True: "fits", False: "DOES NOT FIT", None: "no budget"}[record["fits"]]
    per_rank = f" per rank of {record['ranks']}" if record.get("ranks", 1) > 1 else ""
    print(f"{preset['name']}: peak {gib:.2f} GiB{per_rank} ({record['method']}, {record['device']}{on_card(record)}, "
          f"{record['precision']}, {record['attention_backend']} attention) -> {verdict}; wrote {out}")


def gpu_target(cfg: dict, args, device: str):
    """`--gpu NAME`: (its catalogue entry, the calibration to use, the budget: --budget or the card's
    memory); without it (None, --calibration, None)."""
    if not getattr(args, "gpu", None):
        return None, args.calibration, None
    from tiersep import gpu_catalogue
    from tiersep.memory.fit.matrix import calibration_for

    if device != "cuda":
        raise C.ConfigError(f"--gpu {args.gpu}: models a GPU, but the estimate's device is {device} (--device cuda)")
    card = gpu_catalogue.required(args.gpu, "--gpu")
    budget = C.budget_bytes(cfg, args.budget) if args.budget is not None else card.memory_bytes
    return card, args.calibration or calibration_for(card), budget


def estimate_target(cfg: dict, args, device: str):
    """`gpu_target` for an estimate (training or separation): without --gpu, the budget is the one
    `estimate_budget` judges against."""
    card, calibration_spec, budget = gpu_target(cfg, args, device)
    return card, calibration_spec, budget if card is not None else estimate_budget(cfg, device, args.budget)


def on_card(record: dict) -> str:
    """", <model>" of the catalogue card an estimate record models ("" for none, or any sm80+ card)."""
    gpu = record.get("gpu") or {}
    return f", {gpu['model']}" if gpu.get("name") else ""


def cmd_fit(args, cfg):
    if args.gpus is not None:
        return cmd_fit_matrix(args, cfg)
    if not args.preset or len(args.preset) > 1:
        raise C.ConfigError("--preset: one preset with --budget (several only with --gpus)")
    if args.out is None:
        raise C.ConfigError("--out: required with --budget (the preset YAML to write)")
    args.preset = args.preset[0]
    preset = resolve_preset(args.preset, cfg, args.set)   # before torch's import: a bad name is one quick line
    from tiersep.io import write_text
    from tiersep.memory.fit import FitSearch, GateSettings, NothingFits

    device = estimate_device(cfg, args.preset, preset, args.device)
    card, calibration_spec, budget = gpu_target(cfg, args, device)
    budget = budget if card is not None else C.budget_bytes(cfg, args.budget)
    if budget is None:
        raise C.ConfigError("--budget: no budget (auto found no GPU); give a number of GiB")
    try:
        found = FitSearch(preset, device, GateSettings.from_config(cfg, calibration_spec), gpu=card).fit(budget)
    except NothingFits as err:
        raise C.DoesNotFit(str(err)) from None
    fitted, changes, record = found.variant, found.changes, found.record
    write_text(args.out, C.dump_preset(fitted))
    print(f"{preset['name']} -> {fitted['name']} under {budget / 2**30:.1f} GiB (trace estimate "
          f"{record['peak_bytes'] / 2**30:.3f} GiB ±{record['uncertainty']:.1%}):")
    for change in changes or ["nothing to change: it already fits"]:
        print(f"  - {change}")
    print(f"wrote {args.out}")
    return 0


def cmd_fit_matrix(args, cfg):
    """`fit --gpus`: the nearest fitting variant of each preset for every budget, as a table;
    --json writes the fit_matrix record, --out DIR one preset per cell that fits."""
    if args.device not in (None, "auto", "cuda"):
        raise C.ConfigError(f"--device {args.device}: --gpus budgets are GPU memory, estimated for cuda")
    # presets named on the command line first: a bad name is one line before torch's import (3 s)
    named = [(C.tier_name(entry), resolve_preset(entry, cfg, args.set)) for entry in args.preset or []]
    from tiersep.io import write_json
    from tiersep.memory.fit import GateSettings
    from tiersep.memory.fit import matrix as fit_matrix
    from tiersep.records import validate_record

    budgets = fit_matrix.parse_budgets(fit_matrix.split_gpus(args.gpus), "--gpus")   # one line when bad
    tiers = named or [(C.tier_name(entry), resolve_preset(entry, cfg, args.set))
                      for entry in fit_matrix.config_tiers(cfg)]
    estimates = _estimate_records(args.estimates, [t for t, _ in tiers])
    with _cells_bar(len(tiers) * len(budgets)) as progress:
        record, presets = fit_matrix.build(tiers, budgets, GateSettings.from_config(cfg, args.calibration),
                                           jobs=args.jobs, progress=progress, estimates=estimates)
    print("\n".join(fit_matrix.table_lines(record)))
    if args.out:
        written = fit_matrix.write_presets(args.out, presets)
        print(f"wrote {len(written)} presets into {args.out}")
    if args.json:
        write_json(args.json, validate_record("fit_matrix", record, args.json))
        print(f"wrote {args.json}")
    return 0


@contextlib.contextmanager
def _cells_bar(total: int):
    """fit --gpus on a terminal: a bar of the cells searched, on stderr (the progress callback of
    matrix.build). Elsewhere (a log, a pipe) nothing: the table on stdout is the output."""
    if not sys.stderr.isatty():
        yield None
        return
    from tqdm import tqdm

    with tqdm(total=total, desc="fit --gpus", unit="cell", leave=False, file=sys.stderr) as bar:
        yield lambda _tier, _budget, _cell: bar.update(1)


def _estimate_records(folder: str | None, tiers: list[str]) -> dict[str, dict]:
    """fit --estimates DIR: DIR/<tier>.json of each tier that can be read (the search checks that
    it was made alike before it uses one instead of a trace)."""
    from tiersep.records import RecordError, read_record

    records = {}
    for tier in tiers if folder else []:
        try:
            record = read_record("estimate", Path(folder) / f"{tier}.json")
        except RecordError as err:   # damaged: traced instead
            print(f"tiersep fit: {C.escape_line_breaks(str(err))}; tracing {tier} instead", file=sys.stderr)
            continue
        if record is not None:
            records[tier] = record
    return records


def cmd_calibrate(args, cfg):
    from tiersep.io import write_json
    from tiersep.memory.calibration import measure

    lease_gpu("cuda", "calibrate")   # measures a GPU that no other job is using
    record = measure(progress=lambda line: print(line, file=sys.stderr))
    write_json(args.out, record)
    print(f"{record['name']}: context {record['context_bytes'] / 2**20:.0f} MiB, cuBLAS workspace "
          f"{record['cublas_workspace_bytes'] / 2**20:.0f} MiB; wrote {args.out} (use it with "
          f"--calibration {args.out} or estimate.calibration: {args.out})")
    return 0


def lease_gpu(wanted_device: str, job: str, count: int = 1):
    """Lease this job's own GPUs (`count`: one per local rank) before anything starts CUDA
    (tiersep.gpu_lease): for device cuda, or auto with a GPU visible; None on a CPU. Only train,
    evaluate and separate open CUDA (and calibrate and a measured estimate, which run a step there)."""
    from tiersep import gpu_lease

    return gpu_lease.lease_for_device(wanted_device, job, count)


def load_trainer():
    """The train command's function; importing it is what a train process imports before it builds
    anything (memory/cpu_booking.py's probe imports it the same way)."""
    from tiersep.train.trainer import train

    return train


def cmd_train(args, cfg):
    from tiersep.data.tracks import load_manifest

    preset = resolve_preset(args.preset, cfg, args.set)
    load_manifest(args.data)   # a folder prepare did not write: one line, before torch and the lease
    t = preset["train"]
    lease_gpu(t["device"], "train", count=max(1, t.get("ranks", 1) // t.get("nodes", 1)))
    train = load_trainer()   # after the lease: nothing may start CUDA before it
    return train(cfg, preset, Path(args.data), Path(args.out), resume=args.resume,
                 estimate_path=Path(args.estimate) if args.estimate else None, attempt=args.attempt,
                 outcome_path=Path(args.outcome) if args.outcome else None)


def cmd_evaluate(args, cfg):
    from tiersep.data.tracks import load_manifest
    from tiersep.evaluate.schema import EVAL_FILES
    from tiersep.outputs import check, only_names
    from tiersep.separate.options import require_model_file

    preset = resolve_preset(args.preset, cfg, args.set)
    # before torch and the lease, in evaluate's own order: --out, --model, --data (prepare's manifest)
    check(Path(args.out), "evaluate", known=only_names(EVAL_FILES))
    require_model_file(args.model)
    load_manifest(args.data)
    lease_gpu(preset["train"]["device"], "evaluate")
    from tiersep.evaluate.run import evaluate   # after the lease, as in cmd_train

    evaluate(cfg, preset, Path(args.model), Path(args.data), Path(args.out))
    return 0


def cmd_estimate_inference(args, cfg):
    """`estimate --inference`: the memory of separation (one model call on a batch of chunks)."""
    preset = resolve_preset(args.preset, cfg, args.set)   # before torch's import, as cmd_estimate
    from tiersep.io import write_json
    from tiersep.memory import GateSettings
    from tiersep.memory.inference import estimate_inference
    from tiersep.records import validate_record

    device = estimate_device(cfg, args.preset, preset, args.device)
    if (args.method or "trace") != "trace":
        raise C.ConfigError(f"--inference: only --method trace models separation (not {args.method})")
    rate = preset["audio"]["sample_rate"]
    seconds = args.chunk if args.chunk is not None else cfg["separate"]["chunk_seconds"]
    chunk = max(preset["audio"]["n_fft"], int(round(seconds * rate)))
    card, calibration_spec, budget = estimate_target(cfg, args, device)
    settings = GateSettings.from_config(cfg, calibration_spec)
    record = estimate_inference(preset, device, chunk, args.batch or 1, budget_bytes=budget,
                                safety_margin=settings.safety_margin, calibration_spec=settings.calibration_spec,
                                gpu=card)
    write_json(args.out, validate_record("estimate", record, args.out))
    verdict = {True: "fits", False: "DOES NOT FIT", None: "no budget"}[record["fits"]]
    print(f"{preset['name']}: separation of {chunk / rate:g} s chunks x {record['batch']}: "
          f"{record['gate_required_bytes'] / 2**30:.2f} GiB booked ({record['device']}{on_card(record)}, {record['precision']}, "
          f"{record['attention_backend']} attention) -> {verdict}; wrote {args.out}")
    return 0


def cmd_separate(args, cfg):
    from tiersep.separate.options import options_from, preflight

    preset = resolve_preset(args.preset, cfg) if args.preset else None
    opts = options_from(cfg, model=args.model, inputs=args.inputs, out=args.out, preset=preset,
                        stems=args.stems, budget_gib=args.budget, device=args.device, overlap=args.overlap,
                        shifts=args.shifts, seed=args.seed, format=args.format, bits=args.bits,
                        clip=args.clip, filename=args.filename, chunk_seconds=args.chunk, max_batch=args.batch)
    songs = preflight(opts)                      # before the lease and torch's import
    lease_gpu(opts.device, "separate")
    from tiersep.separate.run import separate

    summary = separate(cfg, opts, songs)
    print(f"separated {len(summary['songs'])} song(s) into {args.out}")
    return 0


def cmd_config(args, cfg):
    """--check: validate files as `snakemake --configfile` merges them (Snakemake's own message for
    a YAML syntax error names neither file nor line). Else write the merged config the workflow's
    jobs read (Snakemake's config, validated again)."""
    import json

    from tiersep.io import write_text

    if args.check:
        for file in args.check:
            if not Path(file).is_file():
                raise C.ConfigError(f"{file}: file not found")
        files = ([DEFAULT_CONFIG] if Path(DEFAULT_CONFIG).is_file() else []) + list(args.check)
        C.validate_config(C.read_config_files(files), files)
        print(f"{' + '.join(files)}: a valid config")
        return 0
    if not (args.merged and args.out):
        raise C.ConfigError("give --check FILE..., or both --merged and --out")
    text = Path(args.merged[1:]).read_text() if args.merged.startswith("@") else args.merged
    merged = C.validate(json.loads(text), "config.schema.yaml", "the workflow's merged config")
    C.check_config(merged)
    write_text(args.out, C.dump_preset(merged))
    return 0


def cmd_search(args, cfg):
    from tiersep.search import run_search

    return run_search(cfg, study=args.study, trials=args.trials, parallel=args.parallel, storage=args.storage,
                      single=args.single_trial)


def cmd_report(args, cfg):
    from tiersep.report import render

    render(cfg, Path(args.results), Path(args.out))
    print(f"wrote {Path(args.out) / 'index.html'} and {Path(args.out) / 'report.md'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand and its arguments. Long because argparse declares them one call at a time,
    and one place for all of them is what `tiersep --help` and the docs test read."""
    parser = argparse.ArgumentParser(
        prog="tiersep", description="Train TF-Locoformer separators at several GPU-memory tiers: "
        "prepare data, estimate peak VRAM, train, evaluate, report.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"tiersep {tiersep.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    budget_gib = _schema_number("config.schema.yaml", "budget_gib", float)

    def add(name, func, help_text):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--config", default=DEFAULT_CONFIG,
                       help=f"pipeline config YAML, validated against workflow/schemas (default {DEFAULT_CONFIG})")
        p.set_defaults(func=func)
        return p

    def add_preset(p, many: str = ""):
        if many:   # repeatable, optional: `many` says what it means then
            p.add_argument("--preset", action="append", metavar="NAME", help="preset name in the config's "
                           f"presets_dir or a preset YAML path; {many}")
        else:
            p.add_argument("--preset", required=True, metavar="NAME",
                           help="preset name in the config's presets_dir or a preset YAML path")
        p.add_argument("--set", action="append", type=_parse_set, default=[], metavar="SECTION.FIELD=VALUE",
                       help="override one preset field (repeatable), e.g. --set train.lr=1e-3")

    p = add("prepare", cmd_prepare, "Ingest the configured source (synthetic or MUSDB18), validate it, "
            "resample it once and write the prepared folder with manifest.json.")
    p.add_argument("--out", required=True, help="prepared folder, e.g. data/prepared/synthetic/8000")
    p.add_argument("--sample-rate", type=_schema_number("preset.schema.yaml", "audio.sample_rate", int),
                   help="target rate in Hz (default: the first tier's audio.sample_rate)")

    p = add("estimate", cmd_estimate, "Estimate the peak memory of one training step of a preset and "
            "judge it against the budget; writes the results/vram JSON record.")
    p.add_argument("--preset", action="append", metavar="NAME", help="preset name in the config's presets_dir "
                   "or a preset YAML path; repeatable: several presets in one process (issue 24)")
    p.add_argument("--set", action="append", type=_parse_set, default=[], metavar="SECTION.FIELD=VALUE",
                   help="override one preset field (repeatable), e.g. --set train.lr=1e-3")
    p.add_argument("--out", required=True, help="output JSON, e.g. results/vram/NAME.json "
                   "(results/vram/{preset}.json with several --preset: one record each)")
    p.add_argument("--method", choices=["trace", "analytic", "measure"],
                   help="trace: one real step on fake tensors (default from config); analytic: closed form; "
                   "measure: real steps on the device present")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"],
                   help="device the estimate models (default from config estimate.device)")
    p.add_argument("--budget", type=budget_gib, metavar="GIB", help="budget in GiB (default: config budget_gib)")
    p.add_argument("--calibration", metavar="NAME|FILE", help="GPU calibration for cuda estimates: auto, "
                   "a built-in GPU name, or a `tiersep calibrate` JSON (default from config)")
    p.add_argument("--gpu", metavar="NAME", help="model this GPU of the catalogue (t4, v100-16gb, a100-40gb, "
                   "h100...; `tiersep.gpu_catalogue`): the attention kernel and precision that run there, "
                   "and its memory as the budget unless --budget is given (training, or with --inference separation)")
    p.add_argument("--inference", action="store_true", help="estimate separation instead of training: one "
                   "model call (eval mode, no autograd) on --batch chunks of --chunk seconds")
    p.add_argument("--chunk", type=_schema_number("config.schema.yaml", "separate.chunk_seconds", float),
                   metavar="SECONDS", help="with --inference: chunk length (default: config separate.chunk_seconds)")
    p.add_argument("--batch", type=_schema_number("config.schema.yaml", "separate.max_batch", int), metavar="N",
                   help="with --inference: chunks per model call (default 1)")

    p = add("fit", cmd_fit, "Derive a variant of a preset that fits a memory budget (segment, micro-batch "
            "with accumulation, checkpointing, bf16) and write it as a preset YAML. With --gpus: what fits "
            "which GPU, the nearest variant for every budget (a table; exit 0 even where nothing fits).")
    add_preset(p, many="repeatable with --gpus (default there: every tier of the config)")
    budget_or_gpus = p.add_mutually_exclusive_group(required=True)
    budget_or_gpus.add_argument("--budget", type=budget_gib, metavar="GIB", help="budget in GiB")
    budget_or_gpus.add_argument("--gpu", metavar="NAME", help="one GPU of the catalogue: its memory is the "
                                "budget, its attention kernels and precision are modelled (t4: fp16, no flash)")
    budget_or_gpus.add_argument("--gpus", metavar="LIST", help="comma-separated budgets: "
                                "numbers of GiB and GPUs of the catalogue (their memory; docs/memory.md "
                                "\"GPUs\"), e.g. 8,12,16,24,40,48,80,96 or t4,v100-16gb,rtx3090,a100-40gb,h100")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"],
                   help="device the estimate models (default from config estimate.device; --gpus: cuda)")
    p.add_argument("--calibration", metavar="NAME|FILE", help="GPU calibration for cuda estimates "
                   "(default from config estimate.calibration)")
    p.add_argument("--out", help="output preset YAML (required with --budget); with --gpus a folder for one "
                   "preset per budget that fits, <preset>_fit_<budget>gib.yaml")
    p.add_argument("--json", metavar="FILE", help="with --gpus: write the matrix record, e.g. "
                   "results/vram/fit_matrix.json")
    p.add_argument("--jobs", type=_jobs, default=1, metavar="N", help="with --gpus: N processes at once, "
                   "each searching a preset for a family of GPUs (those that run it alike; default 1)")
    p.add_argument("--estimates", metavar="DIR", help="with --gpus: DIR/<preset>.json, the presets' own "
                   "trace estimates (the workflow's results/vram), used instead of tracing them again "
                   "where made for cuda with the same settings, calibration and torch")

    p = add("calibrate", cmd_calibrate, "Measure this machine's GPU for the estimates: the CUDA context "
            "after init, after cuBLAS and after a tiny training step, the cuBLAS workspace, the GPU's "
            "name and memory, driver, torch and CUDA versions (a few seconds; needs a GPU).")
    p.add_argument("--out", required=True, help="calibration JSON to write, e.g. calibration/my_gpu.json")

    p = add("train", cmd_train, "Train one preset in this process (refused before allocating anything "
            "when the estimate does not fit). Exit codes: 0 done, 3 refused, 4 out of memory, "
            "75 preempted (checkpoint written; rerun with --resume).")
    add_preset(p)
    p.add_argument("--data", required=True, help="prepared folder from `tiersep prepare`")
    p.add_argument("--out", required=True, help="run folder, e.g. results/train/NAME")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoints/last.pt if present")
    p.add_argument("--estimate", help="results/vram JSON to gate on (default: estimate now)")
    p.add_argument("--attempt", type=_attempt, default=1, help="Snakemake attempt number; after an OOM, "
                   "attempt 2+ halves the micro-batch and doubles accumulation")
    p.add_argument("--outcome", metavar="FILE", help="write the outcome (trained or refused) to FILE; a "
                   "refusal then exits 0 unless the config's on_oversize is fail (the workflow's checkpoint)")

    p = add("evaluate", cmd_evaluate, "Separate every test track with a trained model (chunked "
            "overlap-add) and score it: SI-SDR and museval BSSEval v4 (SiSEC medians).")
    add_preset(p)
    p.add_argument("--model", required=True, help="model.pt from `tiersep train`")
    p.add_argument("--data", required=True, help="prepared folder")
    p.add_argument("--out", required=True, help="output folder, e.g. results/eval/NAME")

    p = add("separate", cmd_separate, "Separate your own songs (files or folders: wav, flac, ogg, mp3, m4a, "
            ".stem.mp4) with a trained model, streamed in blocks within a memory budget: the longest chunk and "
            "largest batch that fit are chosen from the inference estimate. Writes OUT/<song>/<stem>.<ext> and a "
            "JSON sidecar per song. Exit codes: 0 done, 2 bad input (a song that failed: the others are "
            "written), 3 the budget does not fit the shortest chunk, 5 OUT is in use by another run.")
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="audio files, or folders searched recursively")
    p.add_argument("--model", required=True, help="model.pt from `tiersep train`")
    p.add_argument("--out", required=True, help="output folder (new, empty, or an earlier separate's)")
    p.add_argument("--preset", metavar="NAME", help="check the model against this preset (default: the "
                   "preset stored in the model file)")
    p.add_argument("--stems", metavar="STEM", help="write this stem and its complement no_STEM (mixture minus "
                   "stem) instead of every stem")
    p.add_argument("--budget", type=_schema_number("config.schema.yaml", "separate.budget_gib", float),
                   metavar="GIB", help="memory budget in GiB (default: the free GPU memory, or the available RAM)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], help="default: config separate.device (auto)")
    p.add_argument("--overlap", type=_schema_number("config.schema.yaml", "separate.overlap", float),
                   metavar="X", help="fraction of a chunk shared with the next (default 0.25)")
    p.add_argument("--shifts", type=_schema_number("config.schema.yaml", "separate.shifts", int), metavar="N",
                   help="average N passes with random shifts of up to 0.5 s (default 1: no shift)")
    p.add_argument("--seed", type=_schema_number("config.schema.yaml", "separate.seed", int), metavar="N",
                   help="seed of the random shifts (default 0)")
    p.add_argument("--format", choices=["wav", "flac", "mp3"], help="output format (default wav)")
    p.add_argument("--bits", choices=["16", "24", "32f"], help="wav: 16/24-bit PCM or 32f float; flac: 16 or 24 "
                   "(default 16)")
    p.add_argument("--clip", choices=["rescale", "clamp", "none"], help="beyond full scale: one gain for the "
                   "song's stems, clip samples, or write as computed (default rescale)")
    p.add_argument("--filename", metavar="TEMPLATE", help="path of each stem under --out, with {song}, "
                   "{songext}, {stem}, {ext} (default '{song}/{stem}.{ext}')")
    p.add_argument("--chunk", type=_schema_number("config.schema.yaml", "separate.chunk_seconds", float),
                   metavar="SECONDS", help="the longest chunk to try (default 10); a shorter one is used "
                   "when it does not fit the budget")
    p.add_argument("--batch", type=_schema_number("config.schema.yaml", "separate.max_batch", int), metavar="N",
                   help="the most chunks per model call (default 4)")

    p = sub.add_parser("config", help="Check your config files (--check), or write the merged, validated "
                       "config every job reads (a workflow rule).",
                       description="--check: validate config files merged over config/config.yaml as "
                       "`snakemake --configfile` merges them; a bad one ends in one line naming the file, "
                       "the line or key. --merged/--out: the workflow's rule.")
    p.add_argument("--check", nargs="+", metavar="FILE", help="config files to check, in --configfile order")
    p.add_argument("--merged", metavar="JSON", help="the merged config as JSON, or @FILE holding it")
    p.add_argument("--out", help="YAML to write, e.g. results/config.yaml")
    p.set_defaults(func=cmd_config, config=None)

    p = add("search", cmd_search, "Hyperparameter search over the config's `search:` space: every trial "
            "estimated before launch (runs, runs repaired, or told infeasible without a process), each one "
            "its own `tiersep train`, pruned early, resumable (docs/search.md).")
    p.add_argument("--study", type=_study_name, metavar="NAME", help="study name and folder under "
                   "results/search/ (default: search.study)")
    p.add_argument("--trials", type=_whole_number(1, None, "trials"), metavar="N",
                   help="trials in the study (default: search.trials)")
    p.add_argument("--parallel", type=_whole_number(1, None, "trials at once"), metavar="P",
                   help="trials running at once (default: search.parallel)")
    p.add_argument("--storage", metavar="URL", help="Optuna storage: a journal file path, or an RDB URL "
                   "such as postgresql://... (default: search.storage, else results/search/<study>/journal.log)")
    p.add_argument("--single-trial", action="store_true", help="run one trial of the study (told infeasible "
                   "ones do not count) and end: a worker of a study shared by several orchestrators, e.g. one "
                   "SLURM job per trial (the search_jobs target; docs/search.md)")

    p = add("report", cmd_report, "Render the comparison report (index.html, report.md) from whatever "
            "results exist.")
    p.add_argument("--results", default="results", help="results folder (default results)")
    p.add_argument("--out", required=True, help="report folder, e.g. results/report")
    return parser


# Arguments that name a file or folder tiersep reads (an OSError under one is the user's input).
INPUT_ARGS = ("config", "preset", "model", "data", "estimate", "calibration", "results")


def _names_an_input(err: OSError, args) -> bool:
    """Whether `err` is about a path the user gave as an input, or one inside such a folder."""
    if not isinstance(err.filename, (str, bytes, os.PathLike)) or not err.filename:
        return False
    failed = os.path.abspath(os.fsdecode(err.filename))
    for name in INPUT_ARGS:
        given = getattr(args, name, None)
        if isinstance(given, str) and given:
            given = os.path.abspath(given)
            if failed == given or failed.startswith(given.rstrip(os.sep) + os.sep):
                return True
    return False


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 done; 2 bad input (one line naming the file, field or option); 3 does not fit
    the budget (fit, or a refused train); train's own codes (4, 75) and subclasses' `exit_code`
    (5: the output folder is busy; 6: no GPU came free within the lease timeout); 130 interrupted.
    Anything else is a bug and keeps its traceback."""
    args = build_parser().parse_args(argv)
    try:
        if args.config == DEFAULT_CONFIG and not Path(DEFAULT_CONFIG).is_file():
            cfg = C.validate({}, "config.schema.yaml", "the built-in defaults")   # outside a checkout
        else:
            cfg = C.load_config(args.config) if args.config else None
        return args.func(args, cfg) or 0
    except C.ConfigError as err:
        # one line, whatever a path, key or value holds
        print(f"tiersep {args.command}: error: {C.escape_line_breaks(str(err))}", file=sys.stderr)
        return getattr(err, "exit_code", 2)
    except OSError as err:
        if not _names_an_input(err, args):
            raise
        print(C.escape_line_breaks(f"tiersep {args.command}: error: {os.fsdecode(err.filename)}: cannot read it "
                         f"({err.strerror or err})"), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"tiersep {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
