"""What fits which GPU: for every tier and budget, the nearest variant that fits (`tiersep fit
--gpus`, the workflow's results/vram/fit_matrix.json, the report's "What fits which GPU").

Each tier gets one FitSearch (memory/fit/search.py): one trace of the preset, the analytic form scaled by
it for the search, and one trace per distinct chosen variant, kept across budgets. A cell is
therefore exactly what `tiersep fit --preset P --budget B` derives, judged by the gate's rule
(estimate.finish). A budget is a number of GiB or a GPU of the catalogue
(tiersep.gpu_catalogue): its memory, estimated with its own built-in calibration where one was
measured (memory/calibrations/), else the most conservative one. With `--jobs N` each tier's
budgets are split by family (`units`: the cards whose searches share traces) and the parts run in N
processes; a cell does not depend on which others its process searched.
"""
from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from pathlib import Path

from tiersep import gpu_catalogue
from tiersep.config import ConfigError

from .. import accuracy, calibration
from ..conditions import decide
from ..constants import GIB
from ..estimate import modelled_gpu
from .cost import recompute_fraction
from .search import FitSearch, Fitted, NothingFits, fitted_name, half_lever, runnable_on
from .settings import GateSettings

MAX_BUDGET_GIB = 4096   # as budget_gib in config.schema.yaml
SHORTER_SEGMENT_MARK = "*"
SHORTER_SEGMENT_NOTE = "marked with *: a shorter training segment, it changes what the model sees (less context per example)"


@dataclass(frozen=True)
class Budget:
    label: str                     # how the column is headed: "24 GiB", "T4"
    bytes: int
    gpu: str | None = None         # a GPU of the catalogue (tiersep.gpu_catalogue): its short name
    calibration: str | None = None  # the built-in calibration its cells are estimated with

    def as_record(self) -> dict:
        return {"label": self.label, "bytes": self.bytes, "gib": round(self.bytes / GIB, 3), "gpu": self.gpu}


# ---- budgets ------------------------------------------------------------------------------------
def calibration_for(entry: gpu_catalogue.GpuEntry) -> str:
    """The built-in calibration of a catalogue GPU: its own where one was measured, else the most
    conservative one (as `auto` picks for a card without one)."""
    known = calibration.builtin()
    return next((alias for alias in entry.aliases if alias in known), None) or calibration.most_conservative()


def budget_of(item, where: str) -> Budget:
    """A Budget from a number of GiB (int, float or its text) or a GPU of the catalogue (its memory,
    its calibration)."""
    given = item
    if isinstance(item, str):
        try:
            item = float(item)
        except ValueError:
            entry = gpu_catalogue.required(item.strip(), where, also="; or a number of GiB")
            return Budget(entry.model, entry.memory_bytes, entry.name, calibration_for(entry))
    if isinstance(item, bool) or not isinstance(item, (int, float)) or not math.isfinite(item) \
            or not 0 < item <= MAX_BUDGET_GIB:
        shown = given if isinstance(given, str) else repr(given)
        raise ConfigError(f"{where}: {shown[:80]} is not a budget (a number of GiB > 0 and <= {MAX_BUDGET_GIB}, "
                          "or a GPU name)")
    return Budget(f"{item:g} GiB", int(item * GIB))


def column_title(budget: dict) -> str:
    """A column's heading from its record: "T4 (14.9 GiB)" for a GPU, "24 GiB" for a number."""
    return f"{budget['label']} ({budget['bytes'] / GIB:.1f} GiB)" if budget.get("gpu") else budget["label"]


def parse_budgets(items: list, where: str) -> list[Budget]:
    """Budgets in the order given, each once; an empty list is refused."""
    if not items:
        raise ConfigError(f"{where}: no budget given (numbers of GiB or GPU names, e.g. 8,12,24,80)")
    budgets = []
    for item in items:
        budget = budget_of(item, where)
        if budget not in budgets:
            budgets.append(budget)
    return budgets


def split_gpus(text: str) -> list[str]:
    """`--gpus 8,12,t4,NVIDIA H100 80GB HBM3` -> its items; an empty item is refused."""
    items = [part.strip() for part in text.split(",")]
    if not text.strip():
        return []
    if any(not part for part in items):
        raise ConfigError(f"--gpus: {text[:80]!r} has an empty item (numbers of GiB or GPU names, comma-separated)")
    return items


def config_tiers(cfg: dict) -> list[str]:
    """The tier entries a config's matrix covers: its tiers, then its estimate_tiers."""
    return list(cfg["tiers"]) + [t for t in cfg["estimate_tiers"] if t not in cfg["tiers"]]


def config_budgets(cfg: dict) -> list[Budget]:
    """The config's fit_matrix.gpus, then its budget_gib when that is a number not already listed;
    a bad entry is one line naming the config file and key."""
    where = f"{cfg.get('_source', 'config')}: fit_matrix.gpus"
    budgets = parse_budgets(list(cfg["fit_matrix"]["gpus"]), where)
    own = cfg.get("budget_gib")
    if own != "auto" and own is not None and all(b.bytes != int(own * GIB) for b in budgets):
        budgets.append(budget_of(own, f"{cfg.get('_source', 'config')}: budget_gib"))
    return budgets


def gpus_argument(budgets: list[Budget]) -> str:
    """`--gpus` for these budgets (what the workflow's fit_matrix job is given)."""
    # a number as its label has it (6 significant digits): bytes / GiB of 0.001 GiB read 0.000999999
    return ",".join(b.gpu if b.gpu is not None else b.label.removesuffix(" GiB") for b in budgets)


# ---- cells --------------------------------------------------------------------------------------
def levers(original: dict, variant: dict) -> list[str]:
    """The levers a variant pulls, in the order fit tries them."""
    pulled = []
    if original["model"]["attention_backend"] != variant["model"]["attention_backend"]:
        pulled.append("attention")
    if original["train"]["batch_size"] != variant["train"]["batch_size"]:
        pulled.append("micro_batch")
    if original["model"]["checkpointing"] != variant["model"]["checkpointing"]:
        pulled.append("checkpointing")
    if original["train"]["precision"] != variant["train"]["precision"]:
        pulled.append("precision")
    if original["audio"]["segment_samples"] != variant["audio"]["segment_samples"]:
        pulled.append("segment")
    return pulled


def short_levers(original: dict, variant: dict) -> str:
    """e.g. "ckpt, bf16, 4.1 s*, 1x8": the levers pulled, then the micro-batch x accumulation it
    trains with; * marks a shorter segment."""
    pulled = levers(original, variant)
    words = {"attention": "fused attn", "checkpointing": "ckpt", "precision": variant["train"]["precision"]}
    parts = [words[lever] for lever in pulled if lever in words]
    if "segment" in pulled:
        a = variant["audio"]
        parts.append(f"{a['segment_samples'] / a['sample_rate']:.1f} s{SHORTER_SEGMENT_MARK}")
    t = variant["train"]
    return ", ".join(parts + [f"{t['batch_size']}x{t['grad_accum']}"])


def fitting_cell(search: FitSearch, found: Fitted, budget: Budget) -> dict:
    original, variant, record = search.user_preset, found.variant, found.record
    rate = original["audio"]["sample_rate"]
    seconds = variant["audio"]["segment_samples"] / rate
    pulled = levers(original, variant)
    return {
        "status": "fitted" if found.changes else "as_is",
        "short": short_levers(original, variant) if found.changes else "as is",
        "levers": pulled,
        "changes": found.changes,
        "preset": cell_preset_name(original, budget),
        "peak_bytes": int(record["peak_bytes"]),
        "gate_required_bytes": int(record["gate_required_bytes"]),
        "margin_bytes": int(record["margin_bytes"]),
        "uncertainty": record["uncertainty"],
        "uncertainty_class": accuracy.class_label(record["uncertainty_class"]) if record.get("uncertainty_class")
        else None,
        "attention_backend": record.get("attention_backend"),
        "gpu": (record.get("gpu") or {}).get("model"),
        "batch_size": variant["train"]["batch_size"],
        "grad_accum": variant["train"]["grad_accum"],
        "precision": variant["train"]["precision"],
        "checkpointing": variant["model"]["checkpointing"],
        "segment_seconds": round(seconds, 3),
        "changes_input": "segment" in pulled,
        "cost": {"extra_compute": round(recompute_fraction(variant), 4) if "checkpointing" in pulled else 0.0,
                 "segment_seconds_lost": round(original["audio"]["segment_samples"] / rate - seconds, 3)},
        "reason": None,
        "smallest_budget_bytes": None,
    }


def no_cell(search: FitSearch, err: NothingFits) -> dict:
    """A budget nothing fits, with the least budget that would and why."""
    floor, smallest = err.floor, err.smallest_budget_bytes
    if smallest is None or floor is None:
        reason = str(err).split(". ")[0]
    else:
        context = (floor.get("calibration") or {}).get("context_bytes", 0)
        a = search.preset["audio"]
        segment = search.frugal()["audio"]["segment_samples"] / a["sample_rate"]
        reason = (f"needs at least {smallest / GIB:.2f} GiB: the CUDA context ({context / GIB:.2f} GiB) and "
                  f"the smallest step ({(floor['peak_bytes'] - context) / GIB:.2f} GiB: micro-batch 1, "
                  f"checkpointing, bf16, a {segment:.2f} s segment) with the {search.margin:.0%} margin")
    return {"status": "no", "short": "no", "levers": [], "changes": [], "preset": None, "peak_bytes": None,
            "gate_required_bytes": None, "margin_bytes": None, "uncertainty": None, "uncertainty_class": None,
            "attention_backend": None,
            "batch_size": None, "grad_accum": None, "precision": None, "checkpointing": None,
            "segment_seconds": None, "changes_input": False, "cost": None, "reason": reason,
            "smallest_budget_bytes": smallest}


def cell_of(search: FitSearch, budget: Budget) -> tuple[dict, dict | None]:
    """(the cell's record, the preset that fits or None)."""
    try:
        found = search.fit(budget.bytes)
    except NothingFits as err:
        return no_cell(search, err), None
    return fitting_cell(search, found, budget), found.variant


# ---- the matrix ---------------------------------------------------------------------------------
def settings_for(budget: Budget, settings: GateSettings) -> GateSettings:
    """A GPU of the catalogue is estimated with its calibration; a number of GiB with the config's."""
    return settings.calibrated(budget.calibration) if budget.calibration is not None else settings


def row(tier: str, preset: dict, budgets: list[Budget], settings: GateSettings,
        estimate_record: dict | None = None, progress=None) -> tuple[dict, dict[str, dict], int]:
    """(a tier's row of the record, {budget label: the preset that fits}, traces run): one
    FitSearch per calibration, its traces kept across the budgets; `estimate_record`, the tier's
    own estimate, spares its first trace where it was made alike (FitSearch.reusable)."""
    searches: dict[tuple, FitSearch] = {}
    shared: dict = {}      # traces by the preset as it runs: cards that run the same one share them
    cells, presets = [], {}
    for budget in budgets:
        cell_settings = settings_for(budget, settings)
        used = calibration.resolve(cell_settings.calibration_spec)["used"]
        card = gpu_catalogue.by_name()[budget.gpu] if budget.gpu is not None else None
        key = (used["name"], used["source"], card.name if card is not None else None)
        if key not in searches:
            searches[key] = FitSearch(preset, "cuda", cell_settings, estimate_record, gpu=card, shared=shared)
        cell, fitted = cell_of(searches[key], budget)
        cells.append(cell)
        if fitted is not None:
            presets[budget.label] = as_cell_preset(fitted, preset, budget)
        if progress:
            progress(tier, budget, cell)
    original = next(iter(searches.values())).original
    return ({"tier": tier, "preset": preset["name"],
             "original": {"peak_bytes": int(original["peak_bytes"]), "uncertainty": original["uncertainty"],
                          "attention_backend": original.get("attention_backend")},
             "cells": cells},
            presets, sum(s.traced_here for s in searches.values()))


def family(preset: dict, budget: Budget, settings: GateSettings) -> tuple:
    """What a budget's search shares traces by (FitSearch's `shared`): its calibration, and the kernel,
    precision and allocator its card runs the preset with and its 16-bit lever with. Budgets of one
    family are searched in one process; a tier's families can be searched in parallel (`build`)."""
    spec = settings_for(budget, settings).calibration_spec
    cal = calibration.resolve(spec)
    card = gpu_catalogue.by_name()[budget.gpu] if budget.gpu is not None else modelled_gpu(None, cal, spec)
    runnable, _why = runnable_on(preset, card)
    lever = dict(runnable, train=dict(runnable["train"], precision=half_lever(card)))
    conditions = [(form, decide(form, "cuda", gpu=card)) for form in (runnable, lever)]
    # as FitSearch.traced keys what cards share: the preset as it runs there (Conditions.applied)
    runs = tuple((FitSearch._key(c.applied(form)), c.expandable_segments) for form, c in conditions)
    return cal["used"]["name"], cal["used"]["source"], runs


def units(tiers: list[tuple[str, dict]], budgets: list[Budget], settings: GateSettings,
          split: bool) -> list[tuple[int, list[int]]]:
    """The matrix's work, in the tiers' order: (tier index, its budgets' indices). `split`: a tier's
    budgets by family, so that one tier's row, too, can use several processes; else whole rows."""
    out = []
    for i, (_tier, preset) in enumerate(tiers):
        if not split:
            out.append((i, list(range(len(budgets)))))
            continue
        groups: dict[tuple, list[int]] = {}
        for j, budget in enumerate(budgets):
            groups.setdefault(family(preset, budget, settings), []).append(j)
        out.extend((i, part) for part in groups.values())
    return out


def joined(parts: list[tuple[list[int], tuple]], budgets: list[Budget]) -> tuple[dict, dict[str, dict], int]:
    """One tier's row from its parts [(budget indices, row())], cells in the budgets' order; the
    "original" of the part holding the first budget, as one row() of every budget states it."""
    cells, presets, traces, first = [None] * len(budgets), {}, 0, None
    for indices, (one, part_presets, part_traces) in parts:
        for j, cell in zip(indices, one["cells"]):
            cells[j] = cell
        presets.update(part_presets)
        traces += part_traces
        first = one if 0 in indices else first
    ordered = {b.label: presets[b.label] for b in budgets if b.label in presets}
    return dict(first, cells=cells), ordered, traces


def _row_job(job: tuple) -> tuple[dict, dict[str, dict], int]:
    import torch

    torch.set_num_threads(1)   # the trace is Python-bound; one thread per worker process
    return row(*job)


def trace_weight(preset: dict) -> int:
    """How long a tier's traces take, relatively: ops per step (blocks x micro-batches traced)."""
    return preset["model"]["n_layers"] * (2 if preset["train"]["batch_size"] * preset["train"]["grad_accum"] > 1 else 1)


def build(tiers: list[tuple[str, dict]], budgets: list[Budget], settings: GateSettings, jobs: int = 1,
          progress=None, estimates: dict[str, dict] | None = None) -> tuple[dict, dict]:
    """(the fit_matrix record of `tiers` [(tier name, preset)] x `budgets`, {(tier, budget label):
    the preset that fits}). `jobs` > 1: each tier's budgets by family (`units`) in that many worker
    processes, heaviest first: a part traces what its family needs, so one tier uses them too.
    `estimates`: tier -> its estimate record, used instead of tracing the preset where alike."""
    import torch

    start = time.time()
    work = units(tiers, budgets, settings, split=jobs > 1)
    jobs_list = [(tiers[i][0], tiers[i][1], [budgets[j] for j in part], settings, (estimates or {}).get(tiers[i][0]))
                 for i, part in work]
    if jobs > 1 and len(work) > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        # heaviest first; a part's traces: about one per budget, and the preset's and its anchor's
        order = sorted(range(len(work)), key=lambda u: -trace_weight(tiers[work[u][0]][1]) * (len(work[u][1]) + 2))
        done: list = [None] * len(work)
        with ProcessPoolExecutor(min(jobs, len(work)), mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {pool.submit(_row_job, jobs_list[u]): u for u in order}
            for future in as_completed(futures):     # each part's cells reported as it ends
                u = futures[future]
                done[u] = future.result()
                if progress:
                    for j, cell in zip(work[u][1], done[u][0]["cells"]):
                        progress(tiers[work[u][0]][0], budgets[j], cell)
        results = [joined([(part, one) for (i, part), one in zip(work, done) if i == k], budgets)
                   for k in range(len(tiers))]
    else:
        results = [row(*job, progress=progress) for job in jobs_list]
    used = calibration.resolve(settings.calibration_spec)
    record = {
        "device": "cuda", "method": "trace", "safety_margin": settings.safety_margin,
        "calibration": dict(used["used"], context_bytes=used["context_bytes"]),
        "budgets": [b.as_record() for b in budgets],
        "tiers": [one for one, _presets, _traces in results],
        "traces": sum(traces for _one, _presets, traces in results),
        "seconds": round(time.time() - start, 2), "torch": torch.__version__,
        "notes": [SHORTER_SEGMENT_NOTE],
    }
    presets = {(tier, label): preset for (tier, _p), (_one, cells, _t) in zip(tiers, results)
               for label, preset in cells.items()}
    return record, presets


def cell_preset_name(original: dict, budget: Budget) -> str:
    """`P_fit_24gib` (as `tiersep fit --budget 24` names it), `P_fit_t4` for a GPU."""
    if budget.gpu is None:
        return fitted_name(original, budget.bytes)
    return f"{original['name']}_fit_" + "_".join(re.findall(r"[a-z0-9]+", budget.gpu.lower()))


def as_cell_preset(fitted: dict, original: dict, budget: Budget) -> dict:
    """The preset a cell writes (`--out DIR`): named for its tier and budget, also when it fits as is."""
    preset = dict(fitted, name=cell_preset_name(original, budget))
    if fitted["name"] == original["name"]:
        preset["description"] = f"{original['name']} as is: it fits {budget.label} (cuda)."
    return preset


# ---- presets ------------------------------------------------------------------------------------
def written_by_fit(path: Path) -> bool:
    """Whether the file at `path` is a preset `tiersep fit` wrote (its name is the file's stem and its
    description says what it was fitted to): only such a file is replaced."""
    from tiersep.config import load_yaml

    try:
        preset = load_yaml(path.read_text())
    except Exception:   # noqa: BLE001 - unreadable or not YAML: not ours
        return False
    if not isinstance(preset, dict):
        return False
    description = str(preset.get("description", ""))
    return preset.get("name") == path.stem and (" fitted to " in description or " as is: it fits " in description)


def write_presets(out_dir: str | Path, presets: dict) -> list[Path]:
    """Write every cell's preset as OUT_DIR/<name>.yaml; a file of that name that fit did not write is
    refused first (nothing is written then)."""
    from tiersep.config import dump_preset
    from tiersep.io import write_text

    out_dir = Path(out_dir)
    paths = {out_dir / f"{preset['name']}.yaml": preset for preset in presets.values()}
    for path in paths:
        if path.exists() and not (path.is_file() and written_by_fit(path)):
            raise ConfigError(f"--out {out_dir}: {path.name} exists and is not a preset tiersep fit wrote; "
                              "refused (move it, or choose another folder)")
    for path, preset in paths.items():
        write_text(path, dump_preset(preset))
    return list(paths)


# ---- the table ----------------------------------------------------------------------------------
def cell_text(cell: dict) -> str:
    """One line of the printed table: the verdict, the peak and uncertainty, the cost."""
    if cell["status"] == "no":
        smallest = cell["smallest_budget_bytes"]
        return "no" + (f" (needs {smallest / GIB:.2f} GiB)" if smallest else f" ({cell['reason']})")
    text = f"{cell['short']}: {cell['peak_bytes'] / GIB:.2f} GiB ±{cell['uncertainty'] * 100:.1f} %"
    cost = cell["cost"] or {}
    extra = []
    if cost.get("extra_compute"):
        extra.append(f"+{cost['extra_compute'] * 100:.0f} % compute")
    if cost.get("segment_seconds_lost"):
        extra.append(f"{cost['segment_seconds_lost']:.2f} s of segment lost")
    return text + (f" ({', '.join(extra)})" if extra else "")


def table_lines(record: dict) -> list[str]:
    """The matrix as text: one block per tier, one line per budget."""
    width = max(len(column_title(b)) for b in record["budgets"])
    lines = [f"what fits which GPU (cuda, {record['calibration']['name']}, {record['safety_margin']:.0%} margin; "
             f"{record['traces']} traces, {record['seconds']:.1f} s)"]
    for row in record["tiers"]:
        original = row["original"]
        lines.append(f"{row['tier']} (as is {original['peak_bytes'] / GIB:.2f} GiB):")
        for budget, cell in zip(record["budgets"], row["cells"]):
            lines.append(f"  {column_title(budget):<{width}}  {cell_text(cell)}")
    if any(c["changes_input"] for row in record["tiers"] for c in row["cells"]):
        lines.append(SHORTER_SEGMENT_NOTE)
    return lines
