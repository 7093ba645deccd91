"""The report never hides a bad number and writes only into a folder of its own (issue 19).

Real results trees (a copy of tests/fixtures/results, damaged in place) and the real `tiersep
report` CLI in a subprocess: NaN/inf scores are invalid records naming file and field, a damaged
metrics.csv or memory.csv is an invalid record instead of a crash, names from disk and records
carry no raw HTML into report.md or index.html, and --out refuses a user's folder and a second
writer."""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import BIN, REPO
from tiersep import config as C
from tiersep.records import RecordError, read_record, validate_record
from tiersep.report import collect, output_files


def png_files(out: Path) -> list[Path]:
    """Every plot the report writes: its six, and the Search section's three (placeholders without a study)."""
    return sorted(p for p in output_files(out) if p.suffix == ".png")


FIXTURES = REPO / "tests" / "fixtures"
RESULTS = FIXTURES / "results"
STEMS = ("drums", "bass", "other", "vocals")


def copy_results(where: Path) -> Path:
    results = where / "results"
    shutil.copytree(RESULTS, results)
    return results


def fixture_config(results: Path) -> dict:
    return C.load_config(FIXTURES / "report" / "config.yaml", overrides={
        "presets_dir": str(FIXTURES / "report" / "presets"), "results_dir": str(results),
        "data": {"prepared_dir": str(FIXTURES / "report" / "prepared")}})


def config_file(tmp_path: Path, results: Path) -> Path:
    """The fixture config with absolute paths, as a file for the CLI."""
    cfg = yaml.safe_load((FIXTURES / "report" / "config.yaml").read_text())
    cfg["presets_dir"] = str(FIXTURES / "report" / "presets")
    cfg["data"]["prepared_dir"] = str(FIXTURES / "report" / "prepared")
    cfg["results_dir"] = str(results)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def tiersep_report(tmp_path: Path, results: Path, out: Path) -> subprocess.CompletedProcess:
    """The real CLI, run from tmp_path (not the repository: git_commit is 'unknown' there)."""
    return subprocess.run([str(BIN / "tiersep"), "report", "--config", str(config_file(tmp_path, results)),
                           "--results", str(results), "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)


def tier(results: Path, name: str):
    return {t.name: t for t in collect(fixture_config(results), results).tiers}[name]


def failure_reasons(page: str) -> list[str]:
    """The Reason cells of index.html's failures table, unescaped."""
    import html

    table = page.split('<table id="failures">', 1)[1].split("</table>", 1)[0]
    return [html.unescape(re.sub(r"<[^>]+>", "", cell)).strip()
            for cell in re.findall(r'<td class="message text"[^>]*>(.*?)</td>', table, re.S)]


# ---- NaN and inf are invalid records ----------------------------------------------------------
def _scores_field(scores: dict, where: str) -> tuple[dict, str, str]:
    """(the dict holding the field, its key, its path as the error names it)."""
    track = next(iter(scores["per_track"]))
    if where == "overall":
        return scores["overall"], "si_sdr", "overall/si_sdr"
    if where == "per_stem":
        return scores["per_stem"]["bass"], "sdr", "per_stem/bass/sdr"
    return scores["per_track"][track]["vocals"], "sar", f"per_track/{track}/vocals/sar"


@pytest.mark.parametrize("value, token", [(math.nan, "NaN"), (math.inf, "Infinity"), (-math.inf, "-Infinity")])
@pytest.mark.parametrize("where", ["overall", "per_stem", "per_track"])
def test_a_non_finite_score_makes_the_tier_an_invalid_record(tmp_path, value, token, where):
    results = copy_results(tmp_path)
    path = results / "eval" / "test_tiny" / "scores.json"
    scores = json.loads(path.read_text())
    holder, key, field = _scores_field(scores, where)
    holder[key] = value
    path.write_text(json.dumps(scores, indent=2))  # Python's json writes the token NaN / Infinity
    assert f": {token}" in path.read_text()

    found = tier(results, "test_tiny")
    assert found.status == "invalid" and found.status_text == "invalid record"
    assert found.problems == [f"{path}: {field}: {token} is not a finite number"]
    assert found.scores is None  # never shown as a number nor as "no value"


def test_a_nan_score_is_a_failure_row_and_the_report_still_renders(tmp_path):
    results = copy_results(tmp_path)
    path = results / "eval" / "test_tiny" / "scores.json"
    scores = json.loads(path.read_text())
    scores["overall"]["si_sdr_improvement"] = math.nan  # the headline number
    path.write_text(json.dumps(scores))
    out = tmp_path / "report"
    proc = tiersep_report(tmp_path, results, out)
    assert proc.returncode == 0, proc.stderr
    page, md = (out / "index.html").read_text(), (out / "report.md").read_text()
    assert f"{path}: overall/si_sdr_improvement: NaN is not a finite number" in failure_reasons(page)
    assert re.search(r'<tr data-tier="test_tiny" data-status="invalid">.*?invalid record', page, re.S)
    assert f"| {path}: overall/si_sdr_improvement: NaN is not a finite number |" in md
    for text in (page, md):
        assert "Every record could be read" not in text


def test_every_record_kind_refuses_non_finite_numbers(tmp_path):
    """The rule is the records module's, not the report's: run, estimate, failure and manifest
    records too, at any depth (list indices are fields), and JSON's 1e999 overflows to inf."""
    run_path = RESULTS / "train" / "test_tiny" / "run.json"
    run = json.loads(run_path.read_text())
    with pytest.raises(RecordError, match=rf"^{re.escape(str(run_path))}: lr: NaN is not a finite number$"):
        validate_record("run", {**run, "lr": math.nan}, run_path)
    estimate_path = RESULTS / "vram" / "large.json"
    estimate = json.loads(estimate_path.read_text())
    with pytest.raises(RecordError, match=r"large\.json: extra/2/x: -Infinity is not a finite number$"):
        validate_record("estimate", {**estimate, "extra": [1, 2.5, {"x": -math.inf}]}, estimate_path)
    written = tmp_path / "large.json"
    written.write_text(estimate_path.read_text().replace('"peak_bytes": ', '"peak_bytes": 1e999, "was": ', 1))
    with pytest.raises(RecordError, match=rf"^{re.escape(str(written))}: peak_bytes: Infinity is not a finite"):
        read_record("estimate", written)
    assert read_record("estimate", estimate_path)["peak_bytes"] > 0  # the real record passes


def test_records_that_cannot_be_read_are_one_line(tmp_path):
    """Binary, too deeply nested and over-long integers are invalid records, not tracebacks."""
    path = tmp_path / "scores.json"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00\x00garbage")
    with pytest.raises(RecordError, match=rf"^{re.escape(str(path))}: not valid JSON \(not UTF-8 text"):
        read_record("scores", path)
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(RecordError, match=rf"^{re.escape(str(path))}: not valid JSON"):
        read_record("scores", path)
    path.write_text('{"tracks": ' + "9" * 10_000 + "}")
    with pytest.raises(RecordError, match=rf"^{re.escape(str(path))}: not valid JSON"):
        read_record("scores", path)


# ---- a damaged metrics.csv or memory.csv is an invalid record ---------------------------------
GARBAGE = bytes(range(256)) * 8  # not UTF-8 (0x80 alone), NUL bytes too: what a binary file holds


@pytest.mark.parametrize("log, content, problem", [
    ("metrics", GARBAGE, r"not a CSV the trainer wrote \(not UTF-8 text: invalid start byte at byte 128\)"),
    ("memory", GARBAGE, r"not a CSV the trainer wrote \(not UTF-8 text: invalid start byte at byte 128\)"),
    # a crashed disk leaves a block of zeros after the last good line
    ("metrics", None, r"not a CSV the trainer wrote \(NUL byte at offset \d+\)"),
    ("memory", b"allocated,reserved,peak\n1,2,3\n", r"expected a CSV header with a 'step' column"),
    ("metrics", b"step,time_s,loss\n1,0.1,0.5\nstep two,0.2,0.4\n", r"line 3: step 'step two' is not a finite number"),
    ("memory", b"step,allocated,reserved,peak,device\nnan,1,2,3,\n", r"line 2: step 'nan' is not a finite number"),
], ids=["binary-metrics", "binary-memory", "nul-metrics", "no-step-column", "text-step", "nan-step"])
def test_a_damaged_training_log_makes_the_tier_an_invalid_record(tmp_path, log, content, problem):
    results = copy_results(tmp_path)
    path = results / "train" / "test_tiny" / f"{log}.csv"
    path.write_bytes(content if content is not None else path.read_bytes() + b"\0" * 4096)
    found = tier(results, "test_tiny")
    assert found.status == "invalid" and found.status_text == "invalid record"
    assert len(found.problems) == 1 and re.fullmatch(rf"{re.escape(str(path))}: {problem}", found.problems[0])
    assert getattr(found, log) == []  # none of the file's rows is used


def test_a_diverged_loss_is_still_a_row(tmp_path):
    """'nan' in a value column is what the trainer logs for a diverged loss: not a damaged file."""
    results = copy_results(tmp_path)
    path = results / "train" / "test_tiny" / "metrics.csv"
    lines = path.read_text().splitlines()
    header = lines[0].split(",")
    row = lines[1].split(",")
    row[header.index("loss")] = "nan"
    path.write_text("\n".join([lines[0], ",".join(row), *lines[2:]]) + "\n")
    found = tier(results, "test_tiny")
    assert found.problems == [] and found.status == "evaluated"
    assert math.isnan(found.metrics[0]["loss"]) and len(found.metrics) == len(lines) - 1


def test_damaged_logs_render_as_failure_rows(tmp_path):
    """Before: a binary metrics.csv stopped the whole report with a UnicodeDecodeError."""
    results = copy_results(tmp_path)
    metrics = results / "train" / "test_tiny" / "metrics.csv"
    metrics.write_bytes(GARBAGE)
    memory = results / "train" / "test_tiny--batch_size1" / "memory.csv"
    memory.write_bytes(memory.read_bytes()[:200] + b"\0" * 512)
    out = tmp_path / "report"
    proc = tiersep_report(tmp_path, results, out)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    page = (out / "index.html").read_text()
    reasons = failure_reasons(page)
    assert any(r.startswith(f"{metrics}: not a CSV the trainer wrote (not UTF-8") for r in reasons), reasons
    assert any(r.startswith(f"{memory}: not a CSV the trainer wrote (NUL byte") for r in reasons), reasons
    for name in ("test_tiny", "test_tiny--batch_size1"):
        assert re.search(rf'<tr data-tier="{name}" data-status="invalid">', page)
    assert (out / "report.md").is_file() and sorted(out.glob("*.png")) == png_files(out)


# ---- no raw HTML from names and messages ------------------------------------------------------
RAW_TAG = re.compile(r"<\s*/?\s*(script|img|b|i)\b", re.I)


def test_names_and_messages_carry_no_html_into_either_page(tmp_path):
    """Folder names are any text but '/', so a found tier may be named like a tag; a track name
    and a failure message are any text of a record. report.md and index.html show them as text."""
    base = tmp_path / "a<i>b"  # the results folder's path is on the page too (subtitle, facts)
    base.mkdir()
    results = copy_results(base)
    bold, script, dollar, pipe = "<b>found", "<script>alert(1)", "a$\\frac$b", "x|y"
    for name in (bold, dollar, pipe):
        shutil.copytree(results / "train" / "test_tiny", results / "train" / name)
    shutil.copytree(results / "train" / "test_tiny--batch_size4", results / "train" / script)
    failure = results / "train" / script / "failure.json"
    failure.write_text(json.dumps({**json.loads(failure.read_text()),
                                   "message": "<script>alert(2)</script> & more"}))
    scores = json.loads((results / "eval" / "test_tiny" / "scores.json").read_text())
    first = next(iter(scores["per_track"]))
    scores["per_track"] = {("<img src=x onerror=alert(3)>" if track == first else track): entry
                           for track, entry in scores["per_track"].items()}
    (results / "eval" / bold).mkdir()
    (results / "eval" / bold / "scores.json").write_text(json.dumps({**scores, "preset": bold}))

    out = base / "report"
    proc = tiersep_report(base, results, out)
    assert proc.returncode == 0, proc.stderr
    page, md = (out / "index.html").read_text(), (out / "report.md").read_text()

    assert not RAW_TAG.search(md), RAW_TAG.search(md)
    for text in ("&lt;b>found", "&lt;img src=x onerror=alert(3)>", "&lt;script>alert(2)&lt;/script> &amp; more",
                 "&lt;script>alert(1)", "a&lt;i>b/results"):
        assert text in md, text
    assert "x\\|y" in md and "a$\\frac$b" in md

    assert not re.search(r"<\s*/?\s*(script|b|i)\b", page, re.I)
    assert all(tag.startswith('<img src="data:image/png;base64,') for tag in re.findall(r"<img\b[^>]*>", page))
    for text in ("&lt;b&gt;found", "&lt;img src=x onerror=alert(3)&gt;", "&lt;script&gt;alert(2)&lt;/script&gt; &amp; more",
                 "a&lt;i&gt;b/results"):
        assert text in page, text
    assert sorted(out.glob("*.png")) == png_files(out)  # a '$' in a tier name is not mathtext to the plots

    # the Markdown tables are intact: every row has its header's number of cells
    table: list[int] = []
    for line in md.splitlines() + [""]:
        if line.startswith("|"):
            table.append(len(re.findall(r"(?<!\\)\|", line)))
        elif table:
            assert len(set(table)) == 1, table
            table = []


# ---- the report's output folder is its own ----------------------------------------------------
def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def listing(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b"" for p in sorted(folder.rglob("*"))}


@pytest.mark.parametrize("where", ["Documents", "results", "."])
def test_report_refuses_a_folder_holding_other_files(tmp_path, where):
    """`--out ~/Documents` by mistake: refused with one line, nothing written anywhere."""
    results = copy_results(tmp_path)
    documents = tmp_path / "Documents"
    (documents / "thesis").mkdir(parents=True)
    (documents / "thesis" / "main.tex").write_text("\\documentclass{article}\n")
    (documents / "notes.txt").write_text("mine\n")
    config_file(tmp_path, results)
    before = listing(tmp_path)
    proc = tiersep_report(tmp_path, results, Path(where))  # relative to the working directory, tmp_path
    assert proc.returncode == 2, proc.stderr
    line = one_line(proc.stderr)
    assert line.startswith(f"tiersep report: error: --out {where}: ")
    assert {"Documents": "'notes.txt', 'thesis'", "results": "'eval', 'train'",
            ".": "it is the working directory"}[where] in line
    assert listing(tmp_path) == before  # no stamp, no lock file, no index.html: nothing
    assert "wrote" not in proc.stdout


def test_report_adopts_an_earlier_report_folder(tmp_path):
    """A results/report written before stamps holds only the report's own files: it is the
    report's, and is rendered over."""
    from tiersep.outputs import STAMP, read_stamp
    from tiersep.report import output_files

    results = copy_results(tmp_path)
    out = results / "report"
    out.mkdir()
    for path in output_files(out):
        path.write_bytes(b"from an earlier report\n")
    proc = tiersep_report(tmp_path, results, out)
    assert proc.returncode == 0, proc.stderr
    assert (out / "index.html").read_text().startswith("<!DOCTYPE html>")
    assert all(path.read_bytes() != b"from an earlier report\n" for path in output_files(out))
    assert read_stamp(out)["stage"] == "report"
    assert sorted(p.name for p in out.iterdir()) == sorted([STAMP] + [p.name for p in output_files(out)])


def test_a_second_report_writer_stops_at_once(tmp_path):
    """Another process holds the folder's lock: exit 5 naming it, and the folder is not written;
    once the holder is done the report renders."""
    from tiersep.outputs import exclusive

    results = copy_results(tmp_path)
    out = tmp_path / "report"
    with exclusive(out):
        proc = tiersep_report(tmp_path, results, out)
    assert proc.returncode == 5, proc.stderr
    line = one_line(proc.stderr)
    assert line.startswith(f"tiersep report: error: --out {out}: in use by pid {os.getpid()} on ")
    assert not (out / "index.html").exists() and not list(out.glob("*.png"))
    proc = tiersep_report(tmp_path, results, out)
    assert proc.returncode == 0, proc.stderr
    assert (out / "index.html").is_file()
