"""The report page as data: every value computed and formatted once from the collected results,
then rendered by templates/index.html.j2 (HTML) and templates/report.md.j2 (Markdown).

A Table is a list of columns (grouped under a header) and rows of formatted cells; tables whose
optional columns are empty for every row leave those columns out.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from tiersep.report import memory
from tiersep.report.collect import BREAKDOWN_KEYS, Collected, Tier
from tiersep.report.units import (MISSING, format_bytes, format_db, format_duration, format_int,
                                  format_percent, format_rate, format_seconds)

KIND_LABELS = {"tier": "tier", "trial": "sweep trial", "estimate": "estimate only", "found": "not in config"}
FEW_FRAMES = 0.5  # a track and stem with fewer valid museval frames than this share is flagged
NOT_COMPARABLE_NOTE = ("† Not comparable: no estimate was made for the device the tier trained on "
                       "(e.g. a CUDA estimate of a tier trained on CPU). Both figures are shown, no error "
                       "is computed.")


# ---- the model ------------------------------------------------------------------------------------
@dataclass
class Cell:
    text: str
    css: str = ""    # extra HTML classes of the cell
    title: str = ""  # HTML tooltip
    badge: str = ""  # HTML classes of a badge drawn around the text (the status)


@dataclass
class Column:
    group: str
    header: str
    value: Callable[[object], Cell | str]  # row subject -> its cell
    numeric: bool = True                   # right-aligned; text columns are left-aligned
    optional: bool = False                 # left out when no row has a value


@dataclass
class Row:
    key: str          # the first column (a tier name, a track, a manifest)
    cells: list[Cell]
    status: str = ""  # the tier's status (HTML data-status), when the row is a tier
    css: str = ""


@dataclass
class Table:
    id: str
    first_header: str
    columns: list[Column]
    rows: list[Row]
    empty: str = "Nothing yet."
    notes: list[str] = field(default_factory=list)
    split_markdown: bool = True  # Markdown: one table per column group (wide tables wrap badly)

    @property
    def groups(self) -> list[tuple[str, int]]:
        spans: list[tuple[str, int]] = []
        for column in self.columns:
            if spans and spans[-1][0] == column.group:
                spans[-1] = (column.group, spans[-1][1] + 1)
            else:
                spans.append((column.group, 1))
        return spans

    @property
    def grouped(self) -> bool:
        return any(group for group, _ in self.groups)

    def markdown_blocks(self) -> list[dict]:
        """[{title, headers, rows}]: per column group (or one block), leaving out the rows with no
        value at all in it."""
        blocks: dict[str, list[int]] = {}
        for index, column in enumerate(self.columns):
            blocks.setdefault(column.group if self.split_markdown else "", []).append(index)
        out = []
        for group, indices in blocks.items():
            rows = [[row.key] + [row.cells[i].text for i in indices] for row in self.rows]
            kept = [r for r in rows if not all(text == MISSING for text in r[1:])]
            out.append({"title": group if len(blocks) > 1 else "",
                        "headers": [self.first_header] + [self.columns[i].header for i in indices],
                        "rows": kept})
        return out


@dataclass
class Card:
    value: str
    label: str
    detail: str = ""


@dataclass
class Figure:
    stem: str
    title: str
    png_base64: str
    caption_html: str
    caption_markdown: str


@dataclass
class Page:
    title: str
    subtitle: str
    cards: list[Card]
    tiers: Table
    memory: Table
    conditions: Table
    failures: Table
    quality: Table
    frames: Table
    estimates: Table
    figures: list[Figure]
    facts: list[tuple[str, str]]
    devices: Table
    versions: Table
    datasets: Table
    protocols: list[str]


def make_table(table_id: str, first_header: str, columns: list[Column], subjects: list, key, status=None,
               row_css=None, **kwargs) -> Table:
    rows = [Row(key(s), [_cell(c.value(s)) for c in columns], status(s) if status else "",
                row_css(s) if row_css else "") for s in subjects]
    kept = [i for i, c in enumerate(columns) if not c.optional or any(r.cells[i].text != MISSING for r in rows)]
    for row in rows:
        row.cells = [row.cells[i] for i in kept]
    return Table(table_id, first_header, [columns[i] for i in kept], rows, **kwargs)


def _cell(value: Cell | str) -> Cell:
    return value if isinstance(value, Cell) else Cell(value)


# ---- the tiers table ----------------------------------------------------------------------------------
def _status(tier: Tier) -> Cell:
    return Cell(tier.status_text, badge=f"status status-{tier.status}")


def _fits(tier: Tier) -> Cell:
    if tier.failure and tier.failure.get("kind") == "refused":
        return Cell("refused", css="fits-no")
    if tier.estimate is None:
        return Cell(MISSING, css="na")
    fits = tier.estimate.get("fits")
    if fits is None:
        return Cell("no budget", css="na")
    return Cell("fits", css="fits-yes") if fits else Cell("does not fit", css="fits-no")


def _estimated(tier: Tier) -> Cell:
    """The estimate of what `_measured` shows (the headline comparison), else the estimate record's
    peak_bytes: the Memory columns of a row always compare like with like."""
    comparison = memory.headline(tier)
    if comparison is not None and comparison.estimated is not None:
        return Cell(format_bytes(comparison.estimated), title=f"{comparison.quantity}: {comparison.estimated_as}")
    return Cell(format_bytes(tier.estimated_peak), title=f"peak_bytes of results/vram/{tier.name}.json")


def _measured(tier: Tier) -> Cell:
    value, what = memory.measured_peak(tier)
    if value is None:
        return Cell(MISSING, css="na")
    return Cell(format_bytes(value), title=f"{what} on {tier.measured_device}")


def _headline_error(tier: Tier) -> Cell:
    reason = memory.not_comparable(tier)
    if reason is not None:
        return Cell("not comparable †" if reason != "no estimate" else MISSING, css="na", title=reason)
    comparison = memory.headline(tier)
    if comparison is None or comparison.error is None:
        return Cell(MISSING, css="na")
    return Cell(f"{format_percent(comparison.error)} ({comparison.quantity})", css="wrap",
                title=f"estimate {format_bytes(comparison.estimated)} vs measured {format_bytes(comparison.measured)}")


def _adapted(tier: Tier) -> str:
    """What on_oversize: adapt changed before training (run.json `adapted`); the column is left
    out when no tier was adapted."""
    changes = ((tier.run or {}).get("adapted") or {}).get("changes")
    return "; ".join(changes) if changes else MISSING


def _yes_no(value) -> str:
    return MISSING if value is None else ("yes" if value else "no")


def _db(tier: Tier, key: str) -> str:
    return format_db(((tier.scores or {}).get("overall") or {}).get(key))


QUALITY = "Test quality (dB, mean of stems)"
# Headers may hold soft hyphens (U+00AD) where a long word may break in a narrow column (HTML);
# the Markdown filter drops them.
TIER_COLUMNS = [
    Column("Configuration", "Kind", lambda t: KIND_LABELS.get(t.kind, t.kind), numeric=False),
    Column("Configuration", "Status", _status, numeric=False),
    Column("Configuration", "Para\u00admeters", lambda t: format_int(t.parameters)),
    Column("Configuration", "Segment", lambda t: format_seconds(t.segment_seconds)),
    Column("Configuration", "Batch × accum.",
           lambda t: MISSING if t.batch[0] is None else f"{t.batch[0]} × {t.batch[1]}"),
    Column("Configuration", "Preci\u00adsion", lambda t: t.setting("train", "precision") or MISSING, numeric=False),
    Column("Configuration", "Atten\u00adtion", lambda t: t.attention_backend or MISSING, numeric=False),
    Column("Configuration", "Check\u00adpointing", lambda t: _yes_no(t.setting("model", "checkpointing")),
           numeric=False),
    Column("Configuration", "Adapted to budget", _adapted, numeric=False, optional=True),  # on_oversize: adapt
    Column("Memory", "Estimated peak", _estimated),
    Column("Memory", "Measured peak", _measured),
    Column("Memory", "Estimate error", _headline_error),
    Column("Memory", "Fits budget", _fits, numeric=False),
    Column("Training", "Steps", lambda t: format_int(t.steps)),
    Column("Training", "Wall time", lambda t: format_duration(t.wall_seconds)),
    Column("Training", "Steps/s", lambda t: format_rate(t.steps_per_s)),
    Column(QUALITY, "SI-SDR", lambda t: _db(t, "si_sdr")),
    Column(QUALITY, "SI-SDR impr.", lambda t: _db(t, "si_sdr_improvement")),
    Column(QUALITY, "SDR", lambda t: _db(t, "sdr")),
    Column(QUALITY, "SDR impr.", lambda t: _db(t, "sdr_improvement")),
]


def tiers_table(tiers: list[Tier]) -> Table:
    table = make_table("tiers", "Tier", TIER_COLUMNS, tiers, key=lambda t: t.name, status=lambda t: t.status)
    if any(memory.not_comparable(t) not in (None, "no estimate") for t in tiers):
        table.notes.append(NOT_COMPARABLE_NOTE)
    return table


# ---- estimate beside measurement ------------------------------------------------------------------------
def memory_table(tiers: list[Tier]) -> Table:
    """One row per compared quantity of every trained tier; a tier with nothing to compare says why."""
    rows = []
    for tier in tiers:
        if tier.run is None:
            continue
        _estimate, source = memory.comparable_estimate(tier)
        reason = memory.not_comparable(tier)
        if reason is not None:
            value, what = memory.measured_peak(tier)
            rows.append((tier, Cell(f"{what}: {reason}", css="na"), format_bytes(tier.estimated_peak),
                         format_bytes(value), Cell("not comparable †" if reason != "no estimate" else MISSING,
                                                   css="na", title=reason), MISSING))
            continue
        for c in memory.comparisons(tier):
            error = Cell(format_percent(c.error)) if c.error is not None else Cell(MISSING, css="na")
            rows.append((tier, Cell(c.quantity, title=f"estimate {c.estimated_as}; measured {c.measured_as}"),
                         format_bytes(c.estimated), format_bytes(c.measured), error, source))
    columns = [Column("", "Device", lambda r: r[0].measured_device_type or MISSING, numeric=False),
               Column("", "Compared", lambda r: r[1], numeric=False),
               Column("", "Estimated", lambda r: r[2]),
               Column("", "Measured", lambda r: r[3]),
               Column("", "Error", lambda r: r[4]),
               Column("", "Estimate from", lambda r: r[5], numeric=False)]
    table = make_table("memory", "Tier", columns, rows, key=lambda r: r[0].name, status=lambda r: r[0].status,
                       empty="No tier has trained yet.", split_markdown=False)
    table.notes = [
        "Error = estimate / measured − 1 (negative: the estimate was too low), only where the estimate "
        "was made for the device the tier trained on.",
        "CUDA — device use: estimate peak_bytes (caching allocator reserved peak + CUDA context) vs "
        "measured peak_device_bytes (device total − free, what nvidia-smi shows); allocated: "
        "allocated_peak_bytes vs torch.cuda.max_memory_allocated (live tensors); reserved: "
        "reserved_peak_bytes vs torch.cuda.max_memory_reserved.",
        "CPU — process RSS: what the fit gate books for the process before exit "
        "(cpu_process.run_rss_bytes: gate_required_bytes less the library pages touched only at "
        "interpreter exit) vs the measured peak resident set size before exit; live tensor bytes: estimate peak_bytes vs the tensor bytes "
        "the trainer counted (peak_allocated_bytes; not recorded by trainers that logged the RSS there).",
    ]
    if any(memory.not_comparable(t) not in (None, "no estimate") for t in tiers):
        table.notes.append(NOT_COMPARABLE_NOTE)
    return table


def _compile(run: dict) -> str:
    state = run.get("compile")
    if not isinstance(state, dict):
        return MISSING if "compiled" not in run else _yes_no(run["compiled"])
    text = "compiled" if state.get("compiled") else "not compiled"
    details = [str(state[k]) for k in ("mode", "reason") if state.get(k)]
    if state.get("requested") is not None:
        details.insert(0, f"requested {state['requested']}")
    return text + (f" ({'; '.join(details)})" if details else "")


def _settings(value) -> str:
    if not isinstance(value, dict) or not value:
        return MISSING
    return ", ".join(f"{k}={v}" for k, v in value.items())


def conditions_table(tiers: list[Tier]) -> Table:
    """How each trained tier ran: the free memory it started with (flagged when well below the
    run's best start), the process's own RSS at start (CPU), compile state, allocator and malloc
    settings, the measured CUDA context."""
    shortfalls = memory.start_shortfalls(tiers)
    trained = [t for t in tiers if t.run is not None or t.failure is not None]

    def start(tier: Tier) -> Cell:
        free = (tier.run or tier.failure or {}).get("start_free_bytes")
        if tier.name in shortfalls:
            return Cell(f"{format_bytes(free)} ⚑ {format_bytes(shortfalls[tier.name])} below the best start",
                        css="flag", title="started with more than 2% or 256 MiB less free memory than the best "
                                          "start of this run (another process or a leftover context held it)")
        return Cell(format_bytes(free))

    columns = [Column("", "Device", lambda t: t.measured_device or MISSING, numeric=False),
               Column("", "Free at start", start, numeric=False),
               Column("", "Process at start", lambda t: format_bytes((t.run or {}).get("start_rss_bytes")),
                      optional=True),  # CPU: the RSS before training, part of every RSS peak
               Column("", "Compile", lambda t: _compile(t.run or {}), numeric=False, optional=True),
               Column("", "Allocator", lambda t: _settings((t.run or {}).get("allocator")), numeric=False,
                      optional=True),
               Column("", "malloc", lambda t: _settings((t.run or {}).get("malloc")), numeric=False, optional=True),
               Column("", "CUDA context", lambda t: format_bytes((t.run or {}).get("context_bytes")), optional=True)]
    return make_table("conditions", "Tier", columns, trained, key=lambda t: t.name, status=lambda t: t.status,
                      row_css=lambda t: "flagged" if t.name in shortfalls else "",
                      empty="No tier has run yet.", split_markdown=False)


# ---- failures ---------------------------------------------------------------------------------------------
@dataclass
class Failure:
    tier: Tier | None
    kind: str
    record: dict
    note: str = ""

    def value(self, key: str, fallback: Callable[[Tier], object] | None = None):
        """The failure record's `key`; for a training failure, else what the tier says."""
        value = self.record.get(key)
        if value is None and fallback is not None and self.tier is not None and "kind" in self.record:
            value = fallback(self.tier)
        return value


def failures(collected: Collected) -> list[Failure]:
    """Every failure, refusal, OOM a retry recovered from, preset that does not load and record
    that could not be read."""
    out = []
    for tier in collected.tiers:
        if tier.failure is not None:
            out.append(Failure(tier, tier.failure.get("kind", "error"), tier.failure))
        elif tier.earlier_failure is not None and tier.run is not None:
            out.append(Failure(tier, tier.earlier_failure.get("kind", "error"), tier.earlier_failure,
                               f" (recovered: attempt {tier.run.get('attempt')} succeeded)"))
        if tier.preset_error:
            out.append(Failure(tier, "preset error", {"message": tier.preset_error}))
        out += [Failure(tier, "invalid record", {"message": problem}) for problem in tier.problems]
    out += [Failure(None, "invalid record", {"message": p}) for p in collected.facts.get("problems", [])]
    return out


def failures_table(collected: Collected) -> Table:
    columns = [
        Column("", "Kind", lambda f: f.kind + f.note, numeric=False),
        Column("", "Reason", lambda f: Cell(str(f.record.get("message") or MISSING), css="message",
                                             title=str(f.record.get("full_message") or "")), numeric=False),
        Column("", "Attempt", lambda f: format_int(f.value("attempt"))),
        Column("", "Device", lambda f: str(f.value("device", lambda t: t.measured_device) or MISSING),
               numeric=False),
        Column("", "Micro-batch", lambda f: format_int(f.value("batch_size", lambda t: t.batch[0]))),
        Column("", "Attempted allocation", lambda f: format_bytes(f.value("attempted_allocation_bytes"))),
        Column("", "Estimated peak", lambda f: format_bytes(f.value("estimate_peak_bytes", lambda t: t.estimated_peak))),
        Column("", "Free at start", lambda f: format_bytes(f.value("start_free_bytes"))),
    ]
    return make_table("failures", "Tier", columns, failures(collected),
                      key=lambda f: f.tier.name if f.tier else "(run)",
                      status=lambda f: f.tier.status if f.tier else "invalid",
                      empty="No tier failed or was refused. Every record could be read.", split_markdown=False)


# ---- quality ------------------------------------------------------------------------------------------------
def stems_of(tiers: list[Tier]) -> list[str]:
    for tier in tiers:
        if tier.scores:
            return list(tier.scores.get("sources") or tier.scores.get("per_stem") or [])
    return []


def _frames_text(frames: tuple[int, int] | None) -> Cell:
    if frames is None:
        return Cell(MISSING, css="na", title="scores.json without frame counts")
    valid, total = frames
    few = total and valid < FEW_FRAMES * total
    return Cell(f"{valid} / {total}", css="flag" if few else "",
                title="museval frames whose SDR is defined / all 1 s frames")


def quality_table(tiers: list[Tier]) -> Table:
    evaluated = [t for t in tiers if t.scores]
    stems = stems_of(evaluated)

    def stem_value(stem: str, key: str):
        return lambda t: format_db(((t.scores.get("per_stem") or {}).get(stem) or {}).get(key))

    columns = [Column("Test set", "Tracks", lambda t: format_int(t.scores.get("tracks"))),
               Column("Test set", "Valid frames", lambda t: _frames_text(t.frames))]
    for stem in stems:
        columns += [Column(stem, "SI-SDR", stem_value(stem, "si_sdr")),
                    Column(stem, "SDR", stem_value(stem, "sdr")),
                    Column(stem, "SI-SDR impr.", stem_value(stem, "si_sdr_improvement"))]
    columns += [Column("mean of stems", "SI-SDR", lambda t: _db(t, "si_sdr")),
                Column("mean of stems", "SDR", lambda t: _db(t, "sdr")),
                Column("mean of stems", "SI-SDR impr.", lambda t: _db(t, "si_sdr_improvement")),
                Column("mean of stems", "SDR impr.", lambda t: _db(t, "sdr_improvement")),
                Column("mean of stems", "SI-SDR of mixture", lambda t: _db(t, "si_sdr_mixture"))]
    return make_table("quality", "Tier", columns, evaluated, key=lambda t: t.name, status=lambda t: t.status,
                      empty="No tier has been evaluated yet.")


def few_frames(tier: Tier) -> list[tuple[str, str, int, int]]:
    """(track, stem, valid, total) where fewer than half the track's frames were valid."""
    out = []
    for track, stems in ((tier.scores or {}).get("per_track") or {}).items():
        for stem, entry in stems.items():
            if "frames" in entry and entry["frames"] and entry["valid_frames"] < FEW_FRAMES * entry["frames"]:
                out.append((track, stem, entry["valid_frames"], entry["frames"]))
    return out


def frames_table(tiers: list[Tier]) -> Table:
    """Per evaluated tier and test track: valid / total museval frames of each stem."""
    evaluated = [t for t in tiers if t.scores]
    stems = stems_of(evaluated)
    rows = [(tier, track, entries) for tier in evaluated
            for track, entries in (tier.scores.get("per_track") or {}).items()]

    def stem_cell(stem: str):
        def cell(row) -> Cell:
            entry = row[2].get(stem) or {}
            return _frames_text((entry["valid_frames"], entry["frames"]) if "frames" in entry else None)
        return cell

    columns = [Column("", "Track", lambda r: r[1], numeric=False)]
    columns += [Column("", stem, stem_cell(stem)) for stem in stems]
    table = make_table("frames", "Tier", columns, rows, key=lambda r: r[0].name, status=lambda r: r[0].status,
                       row_css=lambda r: "flagged" if any(
                           few[0] == r[1] for few in few_frames(r[0])) else "",
                       empty="No tier has been evaluated yet.", split_markdown=False)
    flagged = [f"{tier.name}: {track} ({stem} {valid}/{total})" for tier in evaluated
               for track, stem, valid, total in few_frames(tier)]
    table.notes.append(
        "museval scores 1 s frames and leaves out every frame in which a reference stem (or an estimate) "
        "is silent; a track's SDR is the median over the frames left. Fewer than half valid: "
        + ("; ".join(flagged) + " (⚑): their medians rest on few frames." if flagged else "no track."))
    return table


# ---- estimates ------------------------------------------------------------------------------------------------
def _estimate_field(key: str, fmt: Callable = str) -> Callable[[Tier], str]:
    def cell(tier: Tier) -> str:
        value = (tier.estimate or {}).get(key)
        return MISSING if value is None else fmt(value)
    return cell


def _method(tier: Tier) -> str:
    """e.g. "trace (cuda, compiled)": how the estimate was made, and for which step."""
    if not tier.estimate:
        return MISSING
    step = ", compiled" if tier.estimate.get("compiled") else ""
    return f"{tier.estimate.get('method')} ({tier.estimate.get('device')}{step})"


def _device_model(tier: Tier) -> str:
    """The calibration and the caching-allocator mode a CUDA estimate modelled (one column: the
    estimates table must fit a laptop window)."""
    estimate = tier.estimate or {}
    calibration, allocator = estimate.get("calibration"), estimate.get("allocator")
    parts = []
    if isinstance(calibration, dict):
        parts.append(f"{calibration.get('name')} ({calibration.get('source')})")
    elif calibration is not None:
        parts.append(str(calibration))
    if isinstance(allocator, dict) and "expandable_segments" in allocator:
        parts.append("expandable segments" if allocator["expandable_segments"] else "native allocator")
    return "; ".join(parts) or MISSING


HYPHENATED = {"activations": "acti\u00advations", "optimizer": "opti\u00admizer", "gradients": "gradi\u00adents"}
ESTIMATE_COLUMNS = [
    Column("Estimate", "Method (device)", _method, numeric=False),
    Column("Estimate", "Atten\u00adtion modelled", _estimate_field("attention_backend"), numeric=False),
    Column("Estimate", "Device model", _device_model, numeric=False, optional=True),
    *[Column("Breakdown", HYPHENATED.get(key, key),
             lambda t, key=key: format_bytes(((t.estimate or {}).get("breakdown") or {}).get(key)))
      for key in BREAKDOWN_KEYS],
    Column("Peak", "Estimated peak", lambda t: format_bytes(t.estimated_peak)),
    Column("Peak", "Gate books", _estimate_field("gate_required_bytes", format_bytes), optional=True),
    Column("Peak", "Largest allo\u00adcation", _estimate_field("largest_allocation_bytes", format_bytes)),
    Column("Peak", "Uncer\u00adtainty", _estimate_field("uncertainty", lambda v: f"±{float(v) * 100:.1f} %")),
    Column("Budget", "Budget", lambda t: format_bytes((t.estimate or {}).get("budget_bytes"))
           if (t.estimate or {}).get("budget_bytes") is not None else str((t.estimate or {}).get("budget") or MISSING)),
    Column("Budget", "Kept free", _estimate_field("margin_bytes", format_bytes)),
    Column("Budget", "Verdict", _fits, numeric=False),
]


def estimates_table(tiers: list[Tier]) -> Table:
    return make_table("estimates", "Tier", ESTIMATE_COLUMNS, [t for t in tiers if t.estimate],
                      key=lambda t: t.name, status=lambda t: t.status, empty="No estimate yet.")


# ---- headline ---------------------------------------------------------------------------------------------------
def cards(tiers: list[Tier]) -> list[Card]:
    status = [t.status for t in tiers]
    out = [Card(str(len(tiers)), "tiers"),
           Card(str(status.count("evaluated")), "trained and evaluated"),
           Card(str(status.count("trained") + status.count("incomplete")), "trained, not evaluated"),
           Card(str(status.count("failed") + status.count("invalid")), "failed or unreadable"),
           Card(str(status.count("refused")), "refused before training"),
           Card(str(status.count("estimate")), "estimate only")]
    evaluated = [t for t in tiers if t.overall("si_sdr_improvement") is not None]
    if evaluated:
        best = max(evaluated, key=lambda t: t.overall("si_sdr_improvement"))
        gain = best.overall("si_sdr_improvement")
        out.append(Card(f"{gain:+.1f} dB", f"SI-SDR over the mixture, best tier ({best.name})",
                        f"{format_db(best.overall_si_sdr)} dB SI-SDR; the mixture scores "
                        f"{format_db(best.overall('si_sdr_mixture'))} dB"))
        tracks, frames = best.scores.get("tracks"), best.frames
        detail = (f"{frames[0]} of {frames[1]} museval frames valid, all stems" if frames
                  else "frame counts not recorded")
        out.append(Card(f"{tracks}", "test tracks", detail))
    return out


# ---- run facts ---------------------------------------------------------------------------------------------------
def budget_bytes(collected: Collected) -> float | None:
    if collected.facts.get("budget_bytes"):
        return float(collected.facts["budget_bytes"])
    budgets = [t.estimate.get("budget_bytes") for t in collected.tiers if t.estimate]
    budgets = [b for b in budgets if b]
    return float(budgets[0]) if budgets else None


def fact_rows(collected: Collected) -> list[tuple[str, str]]:
    facts = collected.facts
    budget = budget_bytes(collected)
    settings = facts.get("estimate_settings") or {}
    return [("Config hash", facts["config_hash"]),
            ("Config file", str(facts.get("config_source") or MISSING)),
            ("Git commit", facts["git_commit"]),
            ("Results folder", facts["results_dir"]),
            ("Memory budget", f"{format_bytes(budget)} (budget_gib: {facts.get('budget_setting')})"
             if budget else f"none (budget_gib: {facts.get('budget_setting')})"),
            ("Estimates", ", ".join(f"{k} {v}" for k, v in settings.items()) or MISSING)]


def _text_columns(keys: list[str]) -> list[Column]:
    return [Column("", key, lambda r, key=key: r[key], numeric=False, optional=True) for key in keys]


def devices_table(collected: Collected) -> Table:
    rows = [{"tier": d["tier"], "Device": d["device"], "Host": d.get("host") or MISSING,
             "PID": format_int(d.get("pid")), "SLURM job": str(d.get("slurm_job_id") or MISSING),
             "Free at start": format_bytes(d.get("start_free_bytes"))} for d in collected.facts["devices"]]
    return make_table("devices", "Tier", _text_columns(["Device", "Host", "PID", "SLURM job", "Free at start"]),
                      rows, key=lambda r: r["tier"], empty="No tier has run yet.", split_markdown=False)


def versions_table(collected: Collected) -> Table:
    rows = [{"key": k, "Tiers": ", ".join(v)} for k, v in collected.facts["versions"].items()]
    return make_table("versions", "Versions", _text_columns(["Tiers"]), rows, key=lambda r: r["key"],
                      empty="No run.json with versions yet.", split_markdown=False)


def datasets_table(collected: Collected) -> Table:
    rows = [{"path": s["path"], "Source": str(s.get("source", MISSING)),
             "Rate": f"{s['sample_rate']} Hz" if s.get("sample_rate") else MISSING,
             "Stems": s.get("stems", MISSING), "Tracks": s.get("tracks", MISSING),
             "Skipped": str(s.get("skipped", 0))} for s in collected.facts["datasets"]]
    return make_table("datasets", "Manifest", _text_columns(["Source", "Rate", "Stems", "Tracks", "Skipped"]),
                      rows, key=lambda r: r["path"], empty="No prepared dataset manifest found.",
                      split_markdown=False)


def protocols(tiers: list[Tier]) -> list[str]:
    """The distinct evaluation protocols (scores.json 'protocol') of the evaluated tiers."""
    return list(dict.fromkeys(str(t.scores["protocol"]) for t in tiers if t.scores and t.scores.get("protocol")))


def build_page(collected: Collected, figures: list[Figure]) -> Page:
    tiers = collected.tiers
    facts = collected.facts
    return Page(
        title=f"tiersep report: {len(tiers)} tiers",
        subtitle=f"config {facts['config_hash']} · commit {facts['git_commit']} · results {facts['results_dir']}",
        cards=cards(tiers), tiers=tiers_table(tiers), memory=memory_table(tiers),
        conditions=conditions_table(tiers), failures=failures_table(collected), quality=quality_table(tiers),
        frames=frames_table(tiers), estimates=estimates_table(tiers), figures=figures,
        facts=fact_rows(collected), devices=devices_table(collected), versions=versions_table(collected),
        datasets=datasets_table(collected), protocols=protocols(tiers))

