"""The report's "What fits which GPU": results/vram/fit_matrix.json (tests/fixtures/results, made by
`tiersep fit --gpus` with the fixture config's 9 budgets) as a table of tiers x budgets, linked from
the estimates table, in report.md too; a damaged record is an invalid-record row and the page still
renders. The table in a real Chromium at 1300 px: tests/test_report.py's browser test."""
from __future__ import annotations

import html
import json
import re

from test_report import RESULTS, cells, copy_results, fixture_config, render_copy, row_html, rows_of

BUDGETS = ["0.5 GiB", "8 GiB", "12 GiB", "16 GiB", "24 GiB · your budget_gib", "40 GiB", "48 GiB", "96 GiB",
           "NVIDIA H100 80GB HBM3 (79.2 GiB)"]


def table_of(page: str, table_id: str) -> str:
    return page.split(f'<table id="{table_id}">', 1)[1].split("</table>", 1)[0]


def test_tiers_down_budgets_across(tmp_path):
    page, markdown = render_copy(tmp_path, RESULTS)
    table = table_of(page, "fit-matrix")
    headers = [html.unescape(h) for h in re.findall(r"<th[^>]*>([^<]*)</th>", table)]
    assert headers == ["Tier", *BUDGETS]
    assert re.findall(r'<tr data-tier="([^"]+)" id="([^"]+)"', table) == [
        ("test_tiny", "fit-test_tiny"), ("small", "fit-small"), ("large", "fit-large")]
    assert cells(row_html(page, "fit-matrix", "small")) == ["small", "no"] + ["as is"] * 8
    large = cells(row_html(page, "fit-matrix", "large"))
    assert large[0] == "large" and large[1] == "no"
    assert large[5] == "ckpt, bf16, 4.0 s*, 1x8" and large[8] == "ckpt, 1x8" and large[9] == "ckpt, bf16, 1x8"
    record = json.loads((RESULTS / "vram" / "fit_matrix.json").read_text())
    cell = record["tiers"][2]["cells"][4]
    titles = [html.unescape(t) for t in re.findall(r'title="([^"]*)"', row_html(page, "fit-matrix", "large"))]
    assert titles[4].startswith(f"peak {cell['peak_bytes'] / 2**30:.2f} GiB ±1.5 % (trace, cuda; class: fused "
                                "attention, checkpointed, expandable allocator, eager step); the gate books")
    assert "+33 % compute" in titles[4] and "audio.segment_samples: 441000 ->" in titles[4]
    assert titles[0].startswith("0.5 GiB: nothing fits; needs at least 2.92 GiB: the CUDA context (0.76 GiB)")
    assert 'class="wrap changes-input text"' in row_html(page, "fit-matrix", "large")
    assert "Marked with *: a shorter training segment" in page
    # report.md: the same table, with each cell's peak (no tooltips there) and * escaped
    section = markdown.split("## What fits which GPU", 1)[1].split("\n## ", 1)[0]
    assert "| Tier | 0.5 GiB | 8 GiB |" in section
    assert "| large | no (needs 2.92 GiB) | ckpt, bf16, 1.1 s\\*, 1x8 (7.22 GiB) |" in section


def test_does_not_fit_links_to_the_tiers_row(tmp_path):
    page, _markdown = render_copy(tmp_path, RESULTS)
    verdict = rows_of(page, "estimates", "large")[0][-1]
    assert verdict == "does not fit"
    assert '<a href="#fit-large">does not fit</a>' in row_html(page, "estimates", "large")
    assert 'id="fit-large"' in table_of(page, "fit-matrix")
    assert "<a href" not in row_html(page, "estimates", "small")   # it fits: nothing to link


def test_a_damaged_matrix_is_an_invalid_record_and_the_page_renders(tmp_path):
    results = copy_results(tmp_path)
    (results / "vram" / "fit_matrix.json").write_text('{"device": "cuda", "tiers": [}')
    page, markdown = render_copy(tmp_path, results, fixture_config(results))
    failures = rows_of(page, "failures", "(run)")
    assert [row[1] for row in failures] == ["invalid record"]
    assert failures[0][2].startswith(f"{results / 'vram' / 'fit_matrix.json'}: not valid JSON")
    assert 'id="fit-matrix"' not in page and "No fit matrix yet" in page and "No fit matrix yet" in markdown
    assert 'data-tier="fit_matrix"' not in page   # not a tier
    assert "<a href" not in row_html(page, "estimates", "large")


def test_names_in_the_matrix_are_text(tmp_path):
    results = copy_results(tmp_path)
    record = json.loads((results / "vram" / "fit_matrix.json").read_text())
    record["tiers"][0]["tier"] = '<img src=x onerror=alert(1)> "a"'
    record["budgets"][1]["label"] = "<b>8</b>"
    (results / "vram" / "fit_matrix.json").write_text(json.dumps(record))
    page, markdown = render_copy(tmp_path, results, fixture_config(results))
    assert "<img src=x" not in page and "<b>8</b>" not in page and "&lt;b&gt;8&lt;/b&gt;" in page
    assert re.search(r'id="fit-_3c_img_20_src_3d_x', page)   # an id of its own, no space or quote
    assert "<img src=x" not in markdown and "<b>8</b>" not in markdown


def test_a_small_budget_is_its_own_column_and_no_rerun_is_advised():
    """A budget_gib of more digits than a column label holds is still its own column, named so; the
    report once advised a rerun that could not help (0.001 GiB became a 0.000999999 GiB column)."""
    from tiersep.report.sections.fit_matrix import header, same_budget

    own = int(0.0012345678 * 2**30)   # budget_gib: 0.0012345678; its column is `--gpus 0.00123457`
    column = {"label": "0.00123457 GiB", "bytes": int(0.00123457 * 2**30), "gpu": None}
    assert column["bytes"] != own   # 6 significant digits: a few bytes apart
    assert same_budget(column, own) and header(column, own) == "0.00123457 GiB · your budget_gib"
    assert not same_budget({"label": "0.002 GiB", "bytes": int(0.002 * 2**30), "gpu": None}, own)
