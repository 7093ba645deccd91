"""What fits which GPU: results/vram/fit_matrix.json as a table, tiers down and budgets across.

A cell reads "as is", the levers the nearest fitting variant pulls ("ckpt, bf16, 4.1 s*, 1x8"), or
"no"; its tooltip (report.md: the text after it) gives the peak, the uncertainty and what the gate
booked, the cost, or why nothing fits. The config's own budget_gib is marked in its column header.
"""
from __future__ import annotations

import re

from tiersep.memory.fit.matrix import column_title
from tiersep.report.collect import Collected
from tiersep.report.sections.table import Cell, Column, Table, make_table
from tiersep.report.units import format_bytes

SEGMENT_NOTE = ("Marked with *: a shorter training segment, the variant changes what the model sees (less context per "
                "example), unlike the other levers, which keep the maths (checkpointing, micro-batches with "
                "accumulation, a fused attention kernel) or only its precision (bf16).")
EMPTY = "No fit matrix yet (results/vram/fit_matrix.json: the fit_matrix rule, `tiersep fit --gpus`)."


def row_anchor(tier: str) -> str:
    """The HTML id of a tier's row (the estimates table's "does not fit" links to it)."""
    return "fit-" + re.sub(r"[^A-Za-z0-9_.-]", lambda m: f"_{ord(m.group()):x}_", tier)


def _percent(value) -> str:
    return f"±{float(value) * 100:.1f} %"


def cell_details(cell: dict, budget: dict) -> str:
    """The tooltip: the peak and its uncertainty, what the gate booked, the cost; or why not."""
    if cell["status"] == "no":
        return f"{budget['label']}: nothing fits; {cell.get('reason') or 'no reason recorded'}"
    parts = [f"peak {format_bytes(cell['peak_bytes'])} {_percent(cell['uncertainty'])} (trace, cuda"
             + (f"; class: {cell['uncertainty_class']})" if cell.get("uncertainty_class") else ")")]
    if cell.get("gate_required_bytes") is not None and cell.get("margin_bytes") is not None:
        parts.append(f"the gate books {format_bytes(cell['gate_required_bytes'])} + "
                     f"{format_bytes(cell['margin_bytes'])} margin of {budget['label']}")
    cost = cell.get("cost") or {}
    if cost.get("extra_compute"):
        parts.append(f"checkpointing: +{cost['extra_compute'] * 100:.0f} % compute (recomputed FLOPs)")
    if cost.get("segment_seconds_lost"):
        parts.append(f"segment {cell.get('segment_seconds')} s, {cost['segment_seconds_lost']} s shorter")
    parts += cell.get("changes") or []
    return "; ".join(parts)


def matrix_cell(cell: dict, budget: dict) -> Cell:
    details = cell_details(cell, budget)
    if cell["status"] == "no":
        smallest = cell.get("smallest_budget_bytes")
        return Cell("no", css="fits-no wrap", title=details,
                    markdown="no" + (f" (needs {format_bytes(smallest)})" if smallest else ""))
    css = "fits-yes wrap" if cell["status"] == "as_is" else "wrap"
    return Cell(cell["short"], css=css + (" changes-input" if cell.get("changes_input") else ""), title=details,
                markdown=f"{cell['short']} ({format_bytes(cell['peak_bytes'])})".replace("*", "\\*"))


def same_budget(budget: dict, own_budget: int | None) -> bool:
    """Whether a column is the config's budget_gib: its bytes as written to 6 significant digits
    (a column label's precision), so 0.001 GiB is the column `--gpus 0.001` made."""
    return own_budget is not None and abs(budget["bytes"] - own_budget) <= max(own_budget * 1e-5, 1)


def header(budget: dict, own_budget: int | None) -> str:
    return column_title(budget) + (" · your budget_gib" if same_budget(budget, own_budget) else "")


def fit_matrix_table(collected: Collected) -> Table:
    matrix = collected.fit_matrix
    if matrix is None:
        return Table("fit-matrix", "Tier", [], [], empty=EMPTY)
    own = collected.facts.get("budget_bytes")
    columns = [Column("", header(budget, own), lambda row, i=i, budget=budget: matrix_cell(row["cells"][i], budget),
                      numeric=False)
               for i, budget in enumerate(matrix["budgets"])]
    table = make_table("fit-matrix", "Tier", columns, matrix["tiers"], key=lambda row: row["tier"],
                       row_anchor=lambda row: row_anchor(row["tier"]), split_markdown=False)
    calibration = matrix.get("calibration") or {}
    table.notes.append(
        f"Each cell is what tiersep fit --preset TIER --budget B derives: the nearest variant whose trace "
        f"estimate passes the fit gate's own rule ({matrix['safety_margin']:.0%} of the budget kept free), on "
        f"cuda with the {calibration.get('name', 'configured')} calibration. Levers, "
        "least intrusive first: a fused attention kernel, a smaller micro-batch with more accumulation "
        "(shown as micro-batch x accumulation), checkpointing (ckpt), bf16, a shorter segment.")
    if any(c.get("changes_input") for row in matrix["tiers"] for c in row["cells"]):
        table.notes.append(SEGMENT_NOTE)
    if own is not None and not any(same_budget(b, own) for b in matrix["budgets"]):
        table.notes.append(f"Your budget_gib ({format_bytes(own)}) is not a column: fit_matrix.json was made "
                           "with other budgets; run the fit_matrix rule again.")
    return table
