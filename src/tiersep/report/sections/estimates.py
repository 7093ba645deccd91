"""Memory estimates: how each estimate was made, the device model, the breakdown, what the gate
books and the verdict against the budget."""
from __future__ import annotations

from typing import Callable

from tiersep.report.collect import BREAKDOWN_KEYS, Tier
from tiersep.report.sections.table import Column, Table, make_table
from tiersep.report.sections.tiers import fits_cell
from tiersep.report.units import MISSING, format_bytes


def _estimate_field(key: str, fmt: Callable = str) -> Callable[[Tier], str]:
    def cell(tier: Tier) -> str:
        value = (tier.estimate or {}).get(key)
        return MISSING if value is None else fmt(value)
    return cell


def _attention_modelled(tier: Tier) -> str:
    """The kernel the estimate modelled; on a CPU estimate, torch's CPU kernel of that name."""
    value = (tier.estimate or {}).get("attention_backend")
    if value is None:
        return MISSING
    return f"{value} (CPU)" if tier.estimate.get("device") == "cpu" else str(value)


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


def _uncertainty(tier: Tier) -> str:
    """e.g. "±1.5 % (flash, bf16, native, eager, Hopper)": what the gate books on top of the peak, and the class
    whose GPU evidence it comes from (memory/accuracy.py); "no evidence" where none exists."""
    estimate = tier.estimate or {}
    value = estimate.get("uncertainty")
    if value is None:
        return MISSING
    cls = estimate.get("uncertainty_class")
    if not isinstance(cls, dict):
        return f"±{float(value) * 100:.1f} %"
    ckpt = ", checkpointed" if cls.get("checkpointing") else ""
    evidence = str(estimate.get("uncertainty_evidence"))
    none = "; no evidence" if "no GPU measurement" in evidence else \
        "; none out of sample" if "no out-of-sample" in evidence else ""
    dtype = f", {cls['dtype']}" if cls.get("dtype") else ""
    generation = f", {cls['generation']}" if cls.get("generation") else ""
    return (f"±{float(value) * 100:.1f} % ({cls.get('attention')}{dtype}{ckpt}, {cls.get('allocator')}, "
            f"{cls.get('step')}{generation}{none})")


def _ranks(tier: Tier) -> str:
    """A data-parallel tier's ranks, e.g. "4 (2 nodes), per rank": its other figures are one rank's
    (memory/trace/ranks.py); empty for one rank, so the column shows only when a tier has several."""
    estimate = tier.estimate or {}
    ranks = estimate.get("ranks") or 1
    if ranks <= 1:
        return MISSING
    nodes = estimate.get("nodes") or 1
    return f"{ranks}" + (f" ({nodes} nodes)" if nodes > 1 else "") + ", per rank"


HYPHENATED = {"activations": "acti\u00advations", "optimizer": "opti\u00admizer", "gradients": "gradi\u00adents"}
ESTIMATE_COLUMNS = [
    Column("Estimate", "Method (device)", _method, numeric=False),
    Column("Estimate", "Atten\u00adtion modelled", _attention_modelled, numeric=False),
    Column("Estimate", "Device model", _device_model, numeric=False, optional=True),
    Column("Estimate", "Ranks", _ranks, numeric=False, optional=True),
    *[Column("Breakdown", HYPHENATED.get(key, key),
             lambda t, key=key: format_bytes(((t.estimate or {}).get("breakdown") or {}).get(key)))
      for key in BREAKDOWN_KEYS],
    Column("Peak", "Predicted peak", lambda t: format_bytes(t.estimated_peak)),
    Column("Peak", "Booked by the gate", _estimate_field("gate_required_bytes", format_bytes), optional=True),
    Column("Peak", "Largest allo\u00adcation", _estimate_field("largest_allocation_bytes", format_bytes)),
    Column("Peak", "Uncer\u00adtainty", _uncertainty, numeric=False),
    Column("Budget", "Budget", lambda t: format_bytes((t.estimate or {}).get("budget_bytes"))
           if (t.estimate or {}).get("budget_bytes") is not None else str((t.estimate or {}).get("budget") or MISSING)),
    Column("Budget", "Kept free", _estimate_field("margin_bytes", format_bytes)),
    Column("Budget", "Verdict", fits_cell, numeric=False),
]


def estimates_table(tiers: list[Tier], fit_rows: dict[str, str] | None = None) -> Table:
    """`fit_rows`: tier -> the HTML id of its row in "What fits which GPU", where its "does not fit"
    links to (what would fit)."""
    table = make_table("estimates", "Tier", ESTIMATE_COLUMNS, [t for t in tiers if t.estimate],
                       key=lambda t: t.name, status=lambda t: t.status, empty="No estimate yet.")
    verdict = next((i for i, c in enumerate(table.columns) if c.header == "Verdict"), None)
    for row in table.rows:
        if verdict is not None and row.key in (fit_rows or {}) and row.cells[verdict].text == "does not fit":
            row.cells[verdict].href = "#" + fit_rows[row.key]
            row.cells[verdict].title = "what would fit: this tier's row in What fits which GPU"
    if table.rows:
        table.notes.append(NAMES_NOTE)
    return table


# One name for each quantity, the same in every table (issue 32: "estimated" named three figures).
NAMES_NOTE = ("Predicted peak: the estimate's own figure, the device use of a CUDA step, the live tensor bytes "
              "of a CPU step. Booked by the gate: what the fit gate reserves against the budget when this "
              "estimate was made (on CUDA the predicted peak x (1 + its uncertainty); on CPU the whole "
              "process's resident set). A train job books again on its own machine: the tiers table's Estimate "
              "is that booking on CPU and the predicted device use on CUDA, each beside its measurement.")
