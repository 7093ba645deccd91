"""Plot captions: workflow/report/<plot>.rst (shared with `snakemake --report`), parsed by docutils
into an HTML fragment for the page and plain Markdown text for report.md."""
from __future__ import annotations

import re
from pathlib import Path

from docutils import nodes
from docutils.core import publish_doctree, publish_parts

# No file inclusion or raw HTML from a caption, and no docutils messages in the page or on stderr.
SETTINGS = {"file_insertion_enabled": False, "raw_enabled": False, "report_level": 5, "halt_level": 5,
            "input_encoding": "utf-8", "output_encoding": "unicode", "embed_stylesheet": False}


def caption_html(rst: str) -> str:
    """The caption's body as HTML (docutils' html5 writer): <p>, <ul>, <em>, <code>-like spans."""
    return publish_parts(rst, writer="html5", settings_overrides=SETTINGS)["body"].strip()


def _escape(text: str) -> str:
    """Caption text as Markdown text, never HTML (as tiersep.report.render.md_escape)."""
    return text.replace("&", "&amp;").replace("<", "&lt;")


def _code_span(text: str) -> str:
    """`text` as a Markdown code span (its content is shown as is, HTML included, never rendered)."""
    if "`" not in text:
        return f"`{text}`"
    fence = "`" * (max(len(run) for run in re.findall("`+", text)) + 1)  # longer than any run inside
    return f"{fence} {text} {fence}"


def _inline_markdown(node: nodes.Node) -> str:
    if isinstance(node, nodes.Text):
        return _escape(str(node).replace("\n", " "))
    inner = "".join(_inline_markdown(child) for child in node.children)
    if isinstance(node, nodes.literal):
        return _code_span(node.astext())
    if isinstance(node, nodes.strong):
        return f"**{inner}**"
    if isinstance(node, nodes.emphasis):
        return f"*{inner}*"
    return inner


def _block_markdown(node: nodes.Node) -> str:
    if isinstance(node, nodes.bullet_list):
        return "\n".join("- " + " ".join(_block_markdown(child) for child in item.children)
                         for item in node.children)
    if isinstance(node, nodes.paragraph):
        return _inline_markdown(node)
    return " ".join(_block_markdown(child) for child in node.children) if node.children else _escape(node.astext())


def caption_markdown(rst: str) -> str:
    """The caption as Markdown: paragraphs, '- ' lists, `code`, *emphasis*, **strong**; text
    HTML-escaped (render marks this as done, and report.md escapes every other text)."""
    doctree = publish_doctree(rst, settings_overrides=SETTINGS)
    return "\n\n".join(_block_markdown(node) for node in doctree.children).strip()


def read_captions(folder: Path | None, stems: list[str]) -> dict[str, str]:
    """{plot stem: RST text} for the stems that have a caption file in `folder`."""
    if folder is None:
        return {}
    return {stem: (folder / f"{stem}.rst").read_text() for stem in stems if (folder / f"{stem}.rst").is_file()}
