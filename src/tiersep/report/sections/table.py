"""The parts of a section: a Table is a list of columns (grouped under a header) and rows of
formatted cells; tables whose optional columns are empty for every row leave those columns out."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from tiersep.report.units import MISSING


@dataclass
class Cell:
    text: str
    css: str = ""    # extra HTML classes of the cell
    title: str = ""  # HTML tooltip
    badge: str = ""  # HTML classes of a badge drawn around the text (the status)
    href: str = ""   # HTML: the text links here (e.g. "#fit-large", a row of another table)
    markdown: str = ""  # report.md's text of the cell, when it says more than the HTML text (no tooltips)


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
    anchor: str = ""  # HTML id of the row, for links to it


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
            rows = [[row.key] + [row.cells[i].markdown or row.cells[i].text for i in indices] for row in self.rows]
            kept = [r for r in rows if not all(text == MISSING for text in r[1:])]
            out.append({"title": group if len(blocks) > 1 else "",
                        "headers": [self.first_header] + [self.columns[i].header for i in indices],
                        "rows": kept})
        return out


def make_table(table_id: str, first_header: str, columns: list[Column], subjects: list, key, status=None,
               row_css=None, row_anchor=None, **kwargs) -> Table:
    rows = [Row(key(s), [_cell(c.value(s)) for c in columns], status(s) if status else "",
                row_css(s) if row_css else "", row_anchor(s) if row_anchor else "") for s in subjects]
    kept = [i for i, c in enumerate(columns) if not c.optional or any(r.cells[i].text != MISSING for r in rows)]
    for row in rows:
        row.cells = [row.cells[i] for i in kept]
    return Table(table_id, first_header, [columns[i] for i in kept], rows, **kwargs)


def _cell(value: Cell | str) -> Cell:
    return value if isinstance(value, Cell) else Cell(value)
