"""The headline cards and the tiers table: one row per tier, its configuration, memory (estimate
beside measurement of the same quantity), training and test quality."""
from __future__ import annotations

from dataclasses import dataclass

from tiersep.report import memory
from tiersep.report.collect import Tier
from tiersep.report.sections.table import Cell, Column, Table, make_table
from tiersep.report.units import (MISSING, format_bytes, format_db, format_duration, format_int,
                                  format_percent, format_rate, format_seconds)

KIND_LABELS = {"tier": "tier", "estimate": "estimate only", "found": "not in config"}
NOT_COMPARABLE_NOTE = ("† Not comparable: no estimate was made for the device the tier trained on "
                       "(e.g. a CUDA estimate of a tier trained on CPU). Both figures are shown, no error "
                       "is computed.")


def _status(tier: Tier) -> Cell:
    return Cell(tier.status_text, badge=f"status status-{tier.status}")


def fits_cell(tier: Tier, say_budget: bool = False) -> Cell:
    """The estimate's verdict. `say_budget`: name what it was judged against (the tiers table has
    no budget column beside it)."""
    if tier.failure and tier.failure.get("kind") == "refused":
        return Cell("refused", css="fits-no")
    if tier.estimate is None:
        return Cell(MISSING, css="na")
    fits = tier.estimate.get("fits")
    if fits is None:
        return Cell("no budget", css="na")
    # a CPU estimate is judged against the available RAM, a CUDA one against the GPU budget
    what = (" RAM" if tier.estimate.get("device") == "cpu" else " GPU budget") if say_budget else ""
    title = f"budget {format_bytes(tier.estimate.get('budget_bytes'))}"
    return (Cell(f"fits{what}", css="fits-yes", title=title) if fits
            else Cell(f"does not fit{what}", css="fits-no", title=title))


def attention_text(tier: Tier) -> str:
    """The attention kernel; on a CPU, torch's CPU kernel of that name (no GPU kernel ran)."""
    backend = tier.attention_backend
    if not backend:
        return MISSING
    device = tier.measured_device_type or (tier.estimate or {}).get("device")
    return f"{backend} (CPU)" if device == "cpu" else backend


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


def yes_no(value) -> str:
    return MISSING if value is None else ("yes" if value else "no")


def overall_db(tier: Tier, key: str) -> str:
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
    Column("Configuration", "Atten\u00adtion", attention_text, numeric=False),
    Column("Configuration", "Check\u00adpointing", lambda t: yes_no(t.setting("model", "checkpointing")),
           numeric=False),
    Column("Configuration", "Adapted to budget", _adapted, numeric=False, optional=True),  # on_oversize: adapt
    # data-parallel tiers: the column is left out when every tier is one process
    Column("Configuration", "Ranks", lambda t: str(t.ranks) if t.ranks > 1 else MISSING, optional=True),
    Column("Memory", "Estimate", _estimated),
    Column("Memory", "Measured", _measured),
    Column("Memory", "Estimate error", _headline_error),
    Column("Memory", "Fits budget", lambda t: fits_cell(t, say_budget=True), numeric=False),
    Column("Training", "Steps", lambda t: format_int(t.steps)),
    Column("Training", "Wall time", lambda t: format_duration(t.wall_seconds)),
    Column("Training", "Samples/s", lambda t: format_rate(t.samples_per_s)),  # steps/s x effective batch
    Column(QUALITY, "SI-SDR", lambda t: overall_db(t, "si_sdr")),
    Column(QUALITY, "SI-SDR impr.", lambda t: overall_db(t, "si_sdr_improvement")),
    Column(QUALITY, "SDR", lambda t: overall_db(t, "sdr")),
    Column(QUALITY, "SDR impr.", lambda t: overall_db(t, "sdr_improvement")),
]


def tiers_table(tiers: list[Tier]) -> Table:
    table = make_table("tiers", "Tier", TIER_COLUMNS, tiers, key=lambda t: t.name, status=lambda t: t.status)
    if any(memory.not_comparable(t) not in (None, "no estimate") for t in tiers):
        table.notes.append(NOT_COMPARABLE_NOTE)
    return table


# ---- headline ---------------------------------------------------------------------------------------------------
@dataclass
class Card:
    value: str
    label: str
    detail: str = ""


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
