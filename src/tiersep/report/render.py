"""Render the collected results as one self-contained HTML page and a Markdown twin.

index.html carries its CSS inline and its plots as base64 PNG data URIs (it opens offline, from
anywhere, and its Content-Security-Policy forbids any fetch); report.md links the same PNGs, written
next to it. Layout text lives in templates/ (string.Template) and the plot captions in
workflow/report/*.rst, shared with Snakemake's own `--report`; `source_files()` lists both so the
workflow can re-render when only they change.
"""
from __future__ import annotations

import base64
import html
import re
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tiersep import config as C
from tiersep import io
from tiersep.report.collect import BREAKDOWN_KEYS, Collected, Tier, collect
from tiersep.report.plots import PLOTS
from tiersep.report.units import (MISSING, format_bytes, format_db, format_duration, format_int,
                                  format_percent, format_rate, format_seconds)

TEMPLATES_DIR = Path(__file__).resolve().parent / "templates"
TEMPLATE_FILES = ("index.html", "style.css", "report.md")
KIND_LABELS = {"tier": "tier", "trial": "sweep trial", "estimate": "estimate only",
               "found": "not in config"}


# ---- files the render reads and writes (for the workflow's input/output lists) -----------------
def caption_dir() -> Path | None:
    """workflow/report/ of the working directory (the Snakemake workdir), else of the checkout."""
    for folder in (Path.cwd() / "workflow" / "report", C.PACKAGE_DIR.parents[1] / "workflow" / "report"):
        if folder.is_dir():
            return folder
    return None


def source_files() -> list[Path]:
    """Every file besides the results that the rendered report depends on: templates and the
    plot captions. A workflow lists these as inputs of its report rule."""
    files = [TEMPLATES_DIR / name for name in TEMPLATE_FILES]
    folder = caption_dir()
    if folder is not None:
        files += [folder / f"{stem}.rst" for stem, _title in PLOTS if (folder / f"{stem}.rst").is_file()]
    return files


def output_files(out_dir: str | Path) -> list[Path]:
    """Every file render() writes into out_dir."""
    out_dir = Path(out_dir)
    return [out_dir / "index.html", out_dir / "report.md"] + [out_dir / f"{stem}.png" for stem, _ in PLOTS]


# ---- captions: a small subset of reStructuredText (paragraphs, '- ' lists, ``code``, *em*) -------
def read_captions() -> dict[str, str]:
    folder = caption_dir()
    if folder is None:
        return {}
    return {stem: (folder / f"{stem}.rst").read_text() for stem, _ in PLOTS if (folder / f"{stem}.rst").is_file()}


def _blocks(rst: str) -> list[tuple[str, list[str]]]:
    """[('p', [text]) | ('ul', [item, ...])] from blank-line separated paragraphs; a paragraph
    whose first line starts with '- ' is a list (other lines continue the item above them)."""
    blocks = []
    for chunk in re.split(r"\n\s*\n", rst.strip()):
        lines = [line.strip() for line in chunk.splitlines() if line.strip()]
        if not lines:
            continue
        if lines[0].startswith("- "):
            items: list[str] = []
            for line in lines:
                if line.startswith("- "):
                    items.append(line[2:])
                else:
                    items[-1] += " " + line
            blocks.append(("ul", items))
        else:
            blocks.append(("p", [" ".join(lines)]))
    return blocks


def _inline_html(text: str) -> str:
    text = html.escape(text)
    text = re.sub(r"``(.+?)``", r"<code>\1</code>", text)
    text = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", text)
    return re.sub(r"\*(.+?)\*", r"<em>\1</em>", text)


def caption_html(rst: str) -> str:
    out = []
    for kind, parts in _blocks(rst):
        if kind == "ul":
            out.append("<ul>" + "".join(f"<li>{_inline_html(p)}</li>" for p in parts) + "</ul>")
        else:
            out.append(f"<p>{_inline_html(parts[0])}</p>")
    return "\n".join(out)


def caption_markdown(rst: str) -> str:
    out = []
    for kind, parts in _blocks(rst):
        parts = [re.sub(r"``(.+?)``", r"`\1`", p) for p in parts]
        out.append("\n".join(f"- {p}" for p in parts) if kind == "ul" else parts[0])
    return "\n\n".join(out)


# ---- table model: one definition, rendered as HTML (grouped header) and Markdown ---------------
@dataclass
class Cell:
    text: str
    css: str = ""  # extra HTML classes
    title: str = ""  # HTML tooltip


@dataclass
class Column:
    group: str
    header: str
    cell: Callable[[Tier], Cell | str]
    numeric: bool = True  # right-aligned; text columns are left-aligned


def _cell(value: Cell | str) -> Cell:
    return value if isinstance(value, Cell) else Cell(value)


def _status_cell(tier: Tier) -> Cell:
    return Cell(tier.status_text, css="status-cell")  # drawn as a coloured badge by table_html


def _fits_cell(tier: Tier) -> Cell:
    if tier.failure and tier.failure.get("kind") == "refused":
        return Cell("refused", css="fits-no")
    fits = (tier.estimate or {}).get("fits")
    if tier.estimate is None:
        return Cell(MISSING, css="na")
    if fits is None:
        return Cell("no budget", css="na")
    return Cell("fits", css="fits-yes") if fits else Cell("does not fit", css="fits-no")


def _measured_on(tier: Tier) -> str:
    device = tier.measured_device
    if device is None or (tier.peak_allocated is None and tier.peak_reserved is None):
        return MISSING
    return f"{device}, peak RSS" if tier.measured_device_type == "cpu" else f"{device}, allocator"


def _error_cell(tier: Tier, measured: float | None) -> Cell:
    if measured is None or tier.estimated_peak is None:
        return Cell(MISSING, css="na")
    if not tier.devices_match:
        return Cell("not comparable †", css="na",
                    title=f"estimate made for {tier.estimate_device_type}, measured on {tier.measured_device_type}")
    return Cell(format_percent(tier.relative_error(measured)))


def _overall(tier: Tier, key: str) -> str:
    return format_db(((tier.scores or {}).get("overall") or {}).get(key))


def _adapted_cell(tier: Tier) -> str:
    """What on_oversize: adapt changed before training (run.json `adapted`), or "no"."""
    if not tier.run:
        return MISSING
    changes = (tier.run.get("adapted") or {}).get("changes")
    return "; ".join(changes) if changes else "no"


def _yes_no(value) -> str:
    return MISSING if value is None else ("yes" if value else "no")


TIER_COLUMNS = [
    Column("Configuration", "Kind", lambda t: KIND_LABELS.get(t.kind, t.kind), numeric=False),
    Column("Configuration", "Status", _status_cell, numeric=False),
    Column("Configuration", "Parameters", lambda t: format_int(t.parameters)),
    Column("Configuration", "Segment", lambda t: format_seconds(t.segment_seconds)),
    Column("Configuration", "Batch × accum.",
           lambda t: MISSING if t.batch[0] is None else f"{t.batch[0]} × {t.batch[1]}"),
    Column("Configuration", "Precision", lambda t: t.setting("train", "precision") or MISSING, numeric=False),
    Column("Configuration", "Attention", lambda t: t.attention_backend or MISSING, numeric=False),
    Column("Configuration", "Checkpointing", lambda t: _yes_no(t.setting("model", "checkpointing")),
           numeric=False),
    Column("Configuration", "Adapted to budget", lambda t: _adapted_cell(t), numeric=False),
    Column("Memory", "Estimated peak", lambda t: format_bytes(t.estimated_peak)),
    Column("Memory", "Estimated for", lambda t: t.estimate_device_type or MISSING, numeric=False),
    Column("Memory", "Measured on", _measured_on, numeric=False),
    Column("Memory", "Peak allocated", lambda t: format_bytes(t.peak_allocated)),
    Column("Memory", "Peak reserved", lambda t: format_bytes(t.peak_reserved)),
    Column("Memory", "Error vs allocated", lambda t: _error_cell(t, t.peak_allocated)),
    Column("Memory", "Error vs reserved", lambda t: _error_cell(t, t.peak_reserved)),
    Column("Memory", "Fits budget", _fits_cell, numeric=False),
    Column("Training", "Steps", lambda t: format_int(t.steps)),
    Column("Training", "Wall time", lambda t: format_duration(t.wall_seconds)),
    Column("Training", "Steps/s", lambda t: format_rate(t.steps_per_s)),
    Column("Test quality (mean of stems, dB)", "SI-SDR", lambda t: _overall(t, "si_sdr")),
    Column("Test quality (mean of stems, dB)", "SDR", lambda t: _overall(t, "sdr")),
    Column("Test quality (mean of stems, dB)", "SI-SDR impr.", lambda t: _overall(t, "si_sdr_improvement")),
    Column("Test quality (mean of stems, dB)", "SDR impr.", lambda t: _overall(t, "sdr_improvement")),
]


def _breakdown(key: str) -> Callable[[Tier], str]:
    return lambda t: format_bytes(((t.estimate or {}).get("breakdown") or {}).get(key))


def _estimate_field(key: str, fmt: Callable = str) -> Callable[[Tier], str]:
    def cell(tier: Tier) -> str:
        value = (tier.estimate or {}).get(key)
        return MISSING if value is None else fmt(value)
    return cell


ESTIMATE_COLUMNS = [
    Column("Estimate", "Method", _estimate_field("method"), numeric=False),
    Column("Estimate", "Device", _estimate_field("device"), numeric=False),
    Column("Estimate", "Attention modelled", _estimate_field("attention_backend"), numeric=False),
    *[Column("Breakdown", key, _breakdown(key)) for key in BREAKDOWN_KEYS],
    Column("Peak", "Estimated peak", lambda t: format_bytes(t.estimated_peak)),
    Column("Peak", "Largest allocation", _estimate_field("largest_allocation_bytes", format_bytes)),
    Column("Peak", "Uncertainty", _estimate_field("uncertainty", lambda v: f"±{float(v) * 100:.1f} %")),
    Column("Budget", "Budget", _estimate_field("budget_bytes", format_bytes)),
    Column("Budget", "Margin", _estimate_field("margin_bytes", format_bytes)),
    Column("Budget", "Verdict", _fits_cell, numeric=False),
    Column("Budget", "Took", _estimate_field("seconds", lambda v: f"{float(v):.1f} s")),
]


def _failure_record(tier: Tier) -> tuple[dict, str]:
    if tier.failure is not None:
        return tier.failure, ""
    return tier.earlier_failure, f" (recovered: attempt {tier.run.get('attempt')} succeeded)"


FAILURE_COLUMNS = [
    Column("Failure", "Kind", lambda t: _failure_record(t)[0].get("kind", "error") + _failure_record(t)[1],
           numeric=False),
    Column("Failure", "Reason", lambda t: Cell(str(_failure_record(t)[0].get("message") or MISSING),
                                               css="message",
                                               title=str(_failure_record(t)[0].get("full_message") or "")),
           numeric=False),
    Column("Failure", "Attempt", lambda t: format_int(_failure_record(t)[0].get("attempt"))),
    Column("Failure", "Device", lambda t: str(_failure_record(t)[0].get("device") or t.measured_device or MISSING),
           numeric=False),
    Column("Failure", "Micro-batch",
           lambda t: format_int(_failure_record(t)[0].get("batch_size") or t.batch[0])),
    Column("Failure", "Attempted allocation",
           lambda t: format_bytes(_failure_record(t)[0].get("attempted_allocation_bytes"))),
    Column("Failure", "Estimated peak",
           lambda t: format_bytes(_failure_record(t)[0].get("estimate_peak_bytes") or t.estimated_peak)),
    Column("Failure", "Free at start", lambda t: format_bytes(_failure_record(t)[0].get("start_free_bytes"))),
]


def _quality_columns(stems: list[str]) -> list[Column]:
    def stem_value(stem: str, key: str) -> Callable[[Tier], str]:
        return lambda t: format_db(((t.scores.get("per_stem") or {}).get(stem) or {}).get(key))

    columns = [Column("Test set", "Tracks", lambda t: format_int(t.scores.get("tracks")))]
    for stem in stems:
        columns += [Column(stem, "SI-SDR", stem_value(stem, "si_sdr")),
                    Column(stem, "SDR", stem_value(stem, "sdr")),
                    Column(stem, "SI-SDR impr.", stem_value(stem, "si_sdr_improvement"))]
    columns += [Column("mean of stems", "SI-SDR", lambda t: _overall(t, "si_sdr")),
                Column("mean of stems", "SDR", lambda t: _overall(t, "sdr")),
                Column("mean of stems", "SI-SDR impr.", lambda t: _overall(t, "si_sdr_improvement")),
                Column("mean of stems", "SDR impr.", lambda t: _overall(t, "sdr_improvement")),
                Column("mean of stems", "SI-SDR of mixture", lambda t: _overall(t, "si_sdr_mixture"))]
    return columns


def _class_attr(classes: str) -> str:
    return f' class="{classes}"' if classes else ""


def table_html(table_id: str, columns: list[Column], tiers: list[Tier]) -> str:
    groups: list[tuple[str, int]] = []
    for column in columns:
        if groups and groups[-1][0] == column.group:
            groups[-1] = (column.group, groups[-1][1] + 1)
        else:
            groups.append((column.group, 1))
    esc = html.escape
    head_groups = "".join(f'<th class="group" colspan="{n}">{esc(g)}</th>' for g, n in groups)
    heads = "".join(f"<th{_class_attr('' if c.numeric else 'text')}>{esc(c.header)}</th>" for c in columns)
    rows = []
    for tier in tiers:
        cells = []
        for column in columns:
            cell = _cell(column.cell(tier))
            classes = " ".join(c for c in (cell.css, "" if column.numeric else "text") if c)
            title = f' title="{esc(cell.title)}"' if cell.title else ""
            text = esc(cell.text)
            if "status-cell" in classes:
                text = f'<span class="status status-{tier.status}">{text}</span>'
            cells.append(f"<td{_class_attr(classes)}{title}>{text}</td>")
        rows.append(f'<tr data-tier="{esc(tier.name)}" data-status="{tier.status}">'
                    f'<td class="first">{esc(tier.name)}</td>{"".join(cells)}</tr>')
    return (f'<div class="scroll"><table id="{table_id}">\n<thead><tr><th class="first" rowspan="2">Tier</th>'
            f"{head_groups}</tr>\n<tr>{heads}</tr></thead>\n<tbody>\n" + "\n".join(rows)
            + "\n</tbody></table></div>")


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table_markdown(columns: list[Column], tiers: list[Tier], split_groups: bool = True) -> str:
    """Markdown pipe tables; with split_groups one table per column group (wide tables wrap badly),
    leaving out the tiers that have no value at all in that group."""
    groups: dict[str, list[Column]] = {}
    for column in columns:
        groups.setdefault(column.group if split_groups else "", []).append(column)
    out = []
    for group, cols in groups.items():
        rows = [(tier, [_cell(c.cell(tier)).text for c in cols]) for tier in tiers]
        kept = [(tier, texts) for tier, texts in rows if not all(t == MISSING for t in texts)]
        lines = [f"**{group}**\n"] if group and len(groups) > 1 else []
        if not kept:
            out.append("\n".join(lines + ["No values yet."]))
            continue
        lines.append("| Tier | " + " | ".join(_md_escape(c.header) for c in cols) + " |")
        lines.append("|---|" + "|".join("---:" if c.numeric else "---" for c in cols) + "|")
        lines += [f"| {_md_escape(tier.name)} | " + " | ".join(map(_md_escape, texts)) + " |"
                  for tier, texts in kept]
        if len(kept) < len(rows):
            lines.append(f"\n({len(rows) - len(kept)} tiers without values left out.)")
        out.append("\n".join(lines))
    return "\n\n".join(out)


# ---- page pieces ---------------------------------------------------------------------------------
def _counts(tiers: list[Tier]) -> list[tuple[str, str]]:
    status = [t.status for t in tiers]
    cards = [("tiers", str(len(tiers))),
             ("trained and evaluated", str(status.count("evaluated"))),
             ("trained, not evaluated", str(status.count("trained") + status.count("incomplete"))),
             ("failed", str(status.count("failed"))),
             ("refused by the fit gate", str(status.count("refused"))),
             ("estimate only", str(status.count("estimate")))]
    evaluated = [t for t in tiers if t.overall_si_sdr is not None]
    if evaluated:
        best = max(evaluated, key=lambda t: t.overall_si_sdr)
        cards.append((f"best SI-SDR ({best.name})", f"{format_db(best.overall_si_sdr)} dB"))
    return cards


def _budget(collected: Collected) -> float | None:
    if collected.facts.get("budget_bytes"):
        return float(collected.facts["budget_bytes"])
    budgets = [t.estimate.get("budget_bytes") for t in collected.tiers if t.estimate]
    budgets = [b for b in budgets if b]
    return float(budgets[0]) if budgets else None


def _subtitle(collected: Collected) -> str:
    facts = collected.facts
    return (f"config {facts['config_hash']} · commit {facts['git_commit']} · "
            f"results {facts['results_dir']}")


def _fact_rows(collected: Collected) -> list[tuple[str, str]]:
    facts = collected.facts
    budget = _budget(collected)
    settings = facts.get("estimate_settings") or {}
    rows = [("Config hash", facts["config_hash"]),
            ("Config file", str(facts.get("config_source") or MISSING)),
            ("Git commit", facts["git_commit"]),
            ("Results folder", facts["results_dir"]),
            ("Memory budget", f"{format_bytes(budget)} (budget_gib: {facts.get('budget_setting')})"
             if budget else f"none (budget_gib: {facts.get('budget_setting')})"),
            ("Estimates", ", ".join(f"{k} {v}" for k, v in settings.items()) or MISSING)]
    return rows


def _devices(collected: Collected) -> list[dict]:
    out = []
    for device in collected.facts["devices"]:
        out.append({"Tier": device["tier"], "Device": device["device"],
                    "Host": device.get("host") or MISSING, "PID": format_int(device.get("pid")),
                    "SLURM job": str(device.get("slurm_job_id") or MISSING),
                    "Free at start": format_bytes(device.get("start_free_bytes"))})
    return _drop_empty_columns(out)


def _drop_empty_columns(rows: list[dict]) -> list[dict]:
    """Leave out the columns no row has a value in (e.g. SLURM job ids outside a cluster)."""
    keep = [k for k in (rows[0] if rows else {}) if any(r[k] != MISSING for r in rows)]
    return [{k: r[k] for k in keep} for r in rows]


def _versions(collected: Collected) -> list[dict]:
    return [{"Versions": key, "Tiers": ", ".join(names)} for key, names in collected.facts["versions"].items()]


def _datasets(collected: Collected) -> list[dict]:
    rows = []
    for summary in collected.facts["datasets"]:
        rows.append({"Manifest": summary["path"], "Source": str(summary.get("source", MISSING)),
                     "Rate": f"{summary['sample_rate']} Hz" if summary.get("sample_rate") else MISSING,
                     "Stems": summary.get("stems", MISSING), "Tracks": summary.get("tracks", MISSING),
                     "Skipped": str(summary.get("skipped", 0))})
    return rows


def _records_html(rows: list[dict], table_id: str, empty: str) -> str:
    if not rows:
        return f'<p class="note">{html.escape(empty)}</p>'
    keys = list(rows[0])
    head = "".join(f'<th class="text">{html.escape(k)}</th>' for k in keys)
    body = "\n".join((f'<tr data-tier="{html.escape(r["Tier"])}">' if "Tier" in r else "<tr>")
                     + "".join(f'<td class="text">{html.escape(str(r[k]))}</td>' for k in keys) + "</tr>"
                     for r in rows)
    return f'<div class="scroll"><table id="{table_id}"><thead><tr>{head}</tr></thead><tbody>\n{body}\n</tbody></table></div>'


def _records_markdown(rows: list[dict], empty: str) -> str:
    if not rows:
        return empty
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(_md_escape(str(r[k])) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


DEVICE_NOTE = ("† Estimate made for one device, measured on another (e.g. a CUDA estimate for a tier "
               "trained on CPU, where the measured peak is the process's resident set size): both are "
               "shown, but no error is computed.")


def _failed_tiers(tiers: list[Tier]) -> list[Tier]:
    return [t for t in tiers if t.failure is not None or t.earlier_failure is not None]


def _stems(tiers: list[Tier]) -> list[str]:
    for tier in tiers:
        if tier.scores:
            return list(tier.scores.get("sources") or tier.scores.get("per_stem") or [])
    return []


def _protocols(tiers: list[Tier]) -> list[str]:
    """The distinct evaluation protocols (scores.json 'protocol') of the evaluated tiers."""
    return list(dict.fromkeys(str(t.scores["protocol"]) for t in tiers if t.scores and t.scores.get("protocol")))


def render_html(collected: Collected, pngs: dict[str, bytes], captions: dict[str, str]) -> str:
    tiers = collected.tiers
    esc = html.escape
    cards = "".join(f'<div class="card"><div class="value">{esc(v)}</div><div class="label">{esc(k)}</div></div>'
                    for k, v in _counts(tiers))
    failed = _failed_tiers(tiers)
    evaluated = [t for t in tiers if t.scores]
    estimated = [t for t in tiers if t.estimate]
    figures = []
    for stem, title in PLOTS:
        data = base64.b64encode(pngs[stem]).decode("ascii")
        caption = caption_html(captions[stem]) if stem in captions else ""
        figures.append(f'<figure id="plot-{stem}"><img src="data:image/png;base64,{data}" alt="{esc(title)}">'
                       f"<figcaption><p><strong>{esc(title)}.</strong></p>{caption}</figcaption></figure>")
    facts = ('<dl class="facts">' + "".join(f"<dt>{esc(k)}</dt><dd>{esc(v)}</dd>" for k, v in _fact_rows(collected))
             + "</dl>"
             + "<h3>Devices</h3>" + _records_html(_devices(collected), "devices", "No tier has run yet.")
             + "<h3>Software versions (from run.json)</h3>"
             + _records_html(_versions(collected), "versions", "No run.json with versions yet.")
             + "<h3>Dataset</h3>"
             + _records_html(_datasets(collected), "datasets", "No prepared dataset manifest found."))
    mismatch = any(t.estimated_peak and (t.peak_allocated or t.peak_reserved) and not t.devices_match for t in tiers)
    template = string.Template((TEMPLATES_DIR / "index.html").read_text())
    return template.substitute(
        title=esc(f"tiersep report: {len(tiers)} tiers"),
        subtitle=esc(_subtitle(collected)),
        style=(TEMPLATES_DIR / "style.css").read_text(),
        summary=f'<div class="cards">{cards}</div>',
        tiers_table=table_html("tiers", TIER_COLUMNS, tiers),
        tiers_notes=f'<p class="note">{esc(DEVICE_NOTE)}</p>' if mismatch else "",
        failures=(table_html("failures", FAILURE_COLUMNS, failed) if failed
                  else '<p class="note">No tier failed or was refused.</p>'),
        quality=(table_html("quality", _quality_columns(_stems(tiers)), evaluated)
                 + "".join(f'<p class="note">Protocol: {esc(p)}</p>' for p in _protocols(evaluated))
                 if evaluated else '<p class="note">No tier has been evaluated yet.</p>'),
        estimates=(table_html("estimates", ESTIMATE_COLUMNS, estimated) if estimated
                   else '<p class="note">No estimate yet.</p>'),
        plots="\n".join(figures),
        facts=facts,
    )


def render_markdown(collected: Collected, captions: dict[str, str]) -> str:
    tiers = collected.tiers
    failed = _failed_tiers(tiers)
    evaluated = [t for t in tiers if t.scores]
    estimated = [t for t in tiers if t.estimate]
    mismatch = any(t.estimated_peak and (t.peak_allocated or t.peak_reserved) and not t.devices_match for t in tiers)
    plots = []
    for stem, title in PLOTS:
        caption = caption_markdown(captions[stem]) if stem in captions else ""
        plots.append(f"### {title}\n\n![{title}]({stem}.png)\n\n{caption}".rstrip())
    facts = ("\n".join(f"- **{k}:** {v}" for k, v in _fact_rows(collected))
             + "\n\n### Devices\n\n" + _records_markdown(_devices(collected), "No tier has run yet.")
             + "\n\n### Software versions (from run.json)\n\n"
             + _records_markdown(_versions(collected), "No run.json with versions yet.")
             + "\n\n### Dataset\n\n" + _records_markdown(_datasets(collected), "No prepared dataset manifest found."))
    template = string.Template((TEMPLATES_DIR / "report.md").read_text())
    return template.substitute(
        title=f"tiersep report: {len(tiers)} tiers",
        subtitle=_subtitle(collected),
        summary=" · ".join(f"{k}: **{v}**" for k, v in _counts(tiers)),
        tiers=table_markdown(TIER_COLUMNS, tiers) + (f"\n\n{DEVICE_NOTE}" if mismatch else ""),
        failures=table_markdown(FAILURE_COLUMNS, failed, split_groups=False) if failed
        else "No tier failed or was refused.",
        quality=table_markdown(_quality_columns(_stems(tiers)), evaluated)
        + "".join(f"\n\nProtocol: {p}" for p in _protocols(evaluated)) if evaluated
        else "No tier has been evaluated yet.",
        estimates=table_markdown(ESTIMATE_COLUMNS, estimated) if estimated else "No estimate yet.",
        plots="\n\n".join(plots),
        facts=facts,
    ).rstrip() + "\n"


def render(cfg: dict, results_dir: str | Path, out_dir: str | Path) -> None:
    """Write out_dir/index.html, out_dir/report.md and the plots (PNG) from whatever results exist."""
    from tiersep.report.plots import make_plots  # matplotlib only when rendering

    out_dir = Path(out_dir)
    collected = collect(cfg, results_dir)
    pngs = make_plots(collected.tiers, _budget(collected))
    captions = read_captions()
    page = render_html(collected, pngs, captions)
    markdown = render_markdown(collected, captions)
    for stem, data in pngs.items():  # PNGs first: report.md never points at a missing picture
        with io.atomic_path(out_dir / f"{stem}.png") as tmp:
            tmp.write_bytes(data)
    io.write_text(out_dir / "report.md", markdown)
    io.write_text(out_dir / "index.html", page)
