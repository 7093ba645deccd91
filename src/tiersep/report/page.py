"""The report page as data: every section built once from the collected results (one module each
in tiersep.report.sections), then rendered by templates/index.html.j2 (HTML) and
templates/report.md.j2 (Markdown).
"""
from __future__ import annotations

from dataclasses import dataclass

from tiersep.report.collect import Collected
from tiersep.report.sections.estimates import estimates_table
from tiersep.report.sections.facts import datasets_table, devices_table, fact_rows, versions_table
from tiersep.report.sections.failures import failures_table
from tiersep.report.sections.fit_matrix import fit_matrix_table, row_anchor
from tiersep.report.sections.listen import ListenSection, listen_section
from tiersep.report.sections.memory import conditions_table, memory_table
from tiersep.report.sections.quality import frames_table, protocols, quality_table
from tiersep.report.sections.search import SearchSection, search_section
from tiersep.report.sections.table import Table
from tiersep.report.sections.tiers import Card, cards, tiers_table


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
    data_note: str
    cards: list[Card]
    tiers: Table
    memory: Table
    conditions: Table
    failures: Table
    quality: Table
    frames: Table
    listen: ListenSection
    estimates: Table
    fit_matrix: Table
    search: SearchSection | None  # None: no study under results/search/, no Search section
    figures: list[Figure]
    facts: list[tuple[str, str]]
    devices: Table
    versions: Table
    datasets: Table
    protocols: list[str]


def data_note(collected: Collected) -> str:
    """Said at the top, not only in the datasets table: tiers trained on the embedded synthetic set
    are toys that show the pipeline, not what a tier reaches on music."""
    synthetic = [d for d in collected.facts.get("datasets", []) if d.get("source") == "synthetic"]
    if not synthetic:
        return ""
    seconds = sorted({f"{d['train_seconds']:.0f} s at {d['sample_rate']} Hz" for d in synthetic
                      if d.get("train_seconds") and d.get("sample_rate")})
    amount = f" ({' and '.join(seconds)} of training audio)" if seconds else ""
    return (f"Trained on the embedded synthetic set{amount}: these tiers show the pipeline at work, not "
            "the quality a tier reaches on real music (see docs/data.md for MUSDB18).")


def build_page(collected: Collected, figures: list[Figure], search_figures: list[Figure] = ()) -> Page:
    tiers = collected.tiers
    facts = collected.facts
    # a tier's "does not fit" links to its row of What fits which GPU
    fit_rows = {row["tier"]: row_anchor(row["tier"]) for row in (collected.fit_matrix or {}).get("tiers", [])}
    search = search_section(collected.search)
    if search is not None:
        search.figures = list(search_figures)
    return Page(
        title=f"tiersep report: {len(tiers)} tiers",
        subtitle=f"config {facts['config_hash']} · commit {facts['git_commit']} · results folder "
                 f"{facts['results_dir']}",
        data_note=data_note(collected),
        cards=cards(tiers), tiers=tiers_table(tiers), memory=memory_table(tiers),
        conditions=conditions_table(tiers), failures=failures_table(collected), quality=quality_table(tiers),
        frames=frames_table(tiers), listen=listen_section(tiers), estimates=estimates_table(tiers, fit_rows),
        fit_matrix=fit_matrix_table(collected), search=search,
        figures=figures, facts=fact_rows(collected), devices=devices_table(collected),
        versions=versions_table(collected), datasets=datasets_table(collected), protocols=protocols(tiers))
