"""Render the collected results as one self-contained HTML page and a Markdown twin.

The page is built once as data (tiersep.report.page) and rendered by two jinja2 templates in
templates/: index.html.j2 (CSS inline from style.css, plots as base64 PNG data URIs, a
Content-Security-Policy that forbids any fetch: it opens offline, from anywhere) and report.md.j2
(linking the same PNGs, written next to it). Plot captions are workflow/report/*.rst, shared with
Snakemake's own `--report` and parsed by docutils; `source_files()` lists templates and captions so
the workflow re-renders when only they change.
"""
from __future__ import annotations

import base64
from pathlib import Path

from markupsafe import Markup

from tiersep import io
from tiersep.resources import resource_dir
from tiersep.report.collect import Collected, collect
from tiersep.report.plots import PLOTS, SEARCH_PLOTS

TEMPLATES_DIR = Path(__file__).resolve().parent / "templates"
TEMPLATE_FILES = ("index.html.j2", "style.css", "report.md.j2")


# ---- files the render reads and writes (for the workflow's input/output lists) -----------------
def caption_dir() -> Path | None:
    """workflow/report/ of the working directory (the Snakemake workdir), else the shipped captions."""
    for folder in (Path.cwd() / "workflow" / "report", resource_dir("captions")):
        if folder.is_dir():
            return folder
    return None


def source_files() -> list[Path]:
    """Every file besides the results that the rendered report depends on: templates and the
    plot captions. A workflow lists these as inputs of its report rule."""
    files = [TEMPLATES_DIR / name for name in TEMPLATE_FILES]
    folder = caption_dir()
    if folder is not None:
        files += [folder / f"{stem}.rst" for stem, _title in PLOTS + SEARCH_PLOTS
                  if (folder / f"{stem}.rst").is_file()]
    return files


def output_files(out_dir: str | Path) -> list[Path]:
    """Every file render() writes into out_dir (the Search section's plots too: a fixed set)."""
    out_dir = Path(out_dir)
    return [out_dir / "index.html", out_dir / "report.md"] + [out_dir / f"{stem}.png" for stem, _ in PLOTS + SEARCH_PLOTS]


# ---- templates -------------------------------------------------------------------------------------
def md_escape(text: str) -> str:
    """Text as Markdown text, never HTML: a Markdown viewer renders raw HTML, and a tier, track or
    file name is text. `<` opens every tag, comment and declaration, so it is escaped, and `&` so an
    entity in a name shows as written. A lone `>` opens nothing: it stays, so a message such as
    "micro-batch 2 > 0" reads as the trainer wrote it."""
    return text.replace("&", "&amp;").replace("<", "&lt;")


def _md_text(value) -> Markup:
    """Any text report.md interpolates (jinja's finalize): escaped once; Markup is already done."""
    return value if isinstance(value, Markup) else Markup(md_escape(str(value)))


def _md_cell(value) -> Markup:
    """A Markdown table cell: HTML escaped, pipes escaped, on one line, no soft hyphens (HTML line
    breaks)."""
    return _md_text(str(value).replace("|", "\\|").replace("\n", " ").replace("\u00ad", ""))


def environment():
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES_DIR), undefined=jinja2.StrictUndefined,
                             autoescape=lambda name: bool(name) and name.endswith(".html.j2"),
                             keep_trailing_newline=True)
    env.filters["md"] = _md_cell
    return env


def markdown_environment():
    """report.md's environment: every {{ }} passes through _md_text (jinja's finalize), so no
    interpolation can carry raw HTML; the `md` filter makes table cells."""
    env = environment()
    env.finalize = _md_text
    return env


def figures(pngs: dict[str, bytes], captions: dict[str, str], plots=PLOTS):
    from tiersep.report.captions import caption_html, caption_markdown
    from tiersep.report.page import Figure

    return [Figure(stem, title, base64.b64encode(pngs[stem]).decode("ascii"),
                   caption_html(captions[stem]) if stem in captions else "",
                   Markup(caption_markdown(captions[stem])) if stem in captions else "")
            for stem, title in plots]


def render_pages(collected: Collected, pngs: dict[str, bytes], captions: dict[str, str]) -> tuple[str, str]:
    """(index.html, report.md) of the collected results: one page model, two templates."""
    from tiersep.report.page import build_page

    page = build_page(collected, figures(pngs, captions), figures(pngs, captions, SEARCH_PLOTS))
    markdown = markdown_environment().get_template("report.md.j2").render(page=page)
    while "\n\n\n" in markdown:  # template blocks leave blank lines; Markdown needs one
        markdown = markdown.replace("\n\n\n", "\n\n")
    return environment().get_template("index.html.j2").render(page=page), markdown.strip() + "\n"


def render(cfg: dict, results_dir: str | Path, out_dir: str | Path) -> None:
    """Write out_dir/index.html, out_dir/report.md and the plots (PNG) from whatever results exist.

    out_dir is the report's own folder (tiersep.outputs): new, empty, stamped by an earlier report,
    or holding nothing but the report's files; anything else is refused (OutputRefused) before a
    file is written. One report writes into it at a time (OutputBusy)."""
    from tiersep.outputs import claim, exclusive, only_names
    from tiersep.report.captions import read_captions
    from tiersep.report.plots import make_plots, make_search_plots  # matplotlib only when rendering
    from tiersep.report.sections.facts import budget_bytes

    out_dir = claim(Path(out_dir), "report", known=only_names({p.name for p in output_files(out_dir)}))
    with exclusive(out_dir):
        collected = collect(cfg, results_dir)
        pngs = {**make_plots(collected.tiers, budget_bytes(collected)), **make_search_plots(collected.search)}
        page, markdown = render_pages(collected, pngs, read_captions(caption_dir(), [stem for stem, _ in
                                                                                     PLOTS + SEARCH_PLOTS]))
        for stem, data in pngs.items():  # PNGs first: report.md never points at a missing picture
            with io.atomic_path(out_dir / f"{stem}.png") as tmp:
                tmp.write_bytes(data)
        io.write_text(out_dir / "report.md", markdown)
        io.write_text(out_dir / "index.html", page)
