"""The report: rendered from a results tree made by a real run of the pipeline on a tiny config
(tests/fixtures/results, remade by tests/fixtures/make_report_results.py: two CPU tiers trained and
evaluated, one batch-size variant out of memory on its retry, one refused as GPU-sized, one estimate-only
tier, and `small` with a run.json built from the real H100 measurements), its content checked,
opened in a real headless Chromium, and re-rendered by a real snakemake when only a caption changes
(tests/test_pipeline_e2e.py)."""
from __future__ import annotations

import base64
import html
import io as stdio
import json
import re
import shutil
from pathlib import Path

import pytest

from tiersep import config as C
from tiersep.report import collect, output_files, render, source_files
from tiersep.report.captions import caption_html, caption_markdown
from tiersep.report.collect import Tier, git_commit, manifest_summary
from tiersep.report.memory import start_shortfalls
from tiersep.report.plots import PLOTS, SEARCH_PLOTS, pareto_front
from tiersep.report.render import TEMPLATE_FILES, TEMPLATES_DIR, caption_dir
from tiersep.report.units import (format_bytes, format_db, format_duration, format_int, format_percent,
                                  format_rate)

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
RESULTS = FIXTURES / "results"
FIXTURE_CONFIG = FIXTURES / "report" / "config.yaml"
GPU_TIER = "small"  # its run.json is the H100 measurement of `small` (see make_report_results.py)
ERROR = r"[+-]\d+\.\d %"


def fixture_config(results: Path = RESULTS, presets: Path = FIXTURES / "report" / "presets") -> dict:
    """The fixture's config with its relative paths made absolute (tests may run from anywhere)."""
    return C.load_config(FIXTURE_CONFIG, overrides={
        "presets_dir": str(presets), "results_dir": str(results),
        "data": {"prepared_dir": str(FIXTURES / "report" / "prepared")}})


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def row_html(page: str, table_id: str, tier: str, nth: int = 0) -> str:
    table = page.split(f'<table id="{table_id}">', 1)[1].split("</table>", 1)[0]
    matches = re.findall(rf'<tr data-tier="{re.escape(html.escape(tier))}"[^>]*>(.*?)</tr>', table, re.S)
    assert len(matches) > nth, f"no row {nth} for {tier} in #{table_id}"
    return matches[nth]


def rows_of(page: str, table_id: str, tier: str) -> list[list[str]]:
    table = page.split(f'<table id="{table_id}">', 1)[1].split("</table>", 1)[0]
    return [cells(r) for r in re.findall(rf'<tr data-tier="{re.escape(html.escape(tier))}"[^>]*>(.*?)</tr>',
                                         table, re.S)]


def cells(row: str) -> list[str]:
    return [html.unescape(re.sub(r"<[^>]+>", "", c)).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)]


def copy_results(tmp_path: Path) -> Path:
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    return results


def render_copy(tmp_path: Path, results: Path, cfg: dict | None = None) -> tuple[str, str]:
    render(cfg or fixture_config(results), results, tmp_path / "report")
    return (tmp_path / "report" / "index.html").read_text(), (tmp_path / "report" / "report.md").read_text()


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> tuple[Path, str, str]:
    out = tmp_path_factory.mktemp("report")
    render(fixture_config(), RESULTS, out)
    return out, (out / "index.html").read_text(), (out / "report.md").read_text()


# ---- content ------------------------------------------------------------------------------------
EXPECTED_STATUS = {
    "test_tiny": "evaluated", "small": "trained", "test_tiny--batch_size1": "evaluated",
    "test_tiny--batch_size4": "failed", "test_tiny--batch_size4096": "refused", "large": "estimate",
}


def test_every_tier_is_a_row_in_order_with_its_status(rendered):
    _out, page, _md = rendered
    table = page.split('<table id="tiers">', 1)[1].split("</table>", 1)[0]
    rows = re.findall(r'<tr data-tier="([^"]+)" data-status="([^"]+)"', table)
    cfg = fixture_config()
    expected_order = cfg["tiers"] + cfg["estimate_tiers"]
    assert len(expected_order) == len(EXPECTED_STATUS)
    assert [html.unescape(name) for name, _ in rows] == expected_order
    assert {html.unescape(name): status for name, status in rows} == EXPECTED_STATUS


def test_failed_and_refused_tiers_show_their_reason(rendered):
    _out, page, md = rendered
    for tier in ("test_tiny--batch_size4", "test_tiny--batch_size4096"):
        failure = read_json(RESULTS / "train" / tier / "failure.json")
        assert html.escape(failure["message"]) in row_html(page, "failures", tier)
        assert failure["message"].replace("|", "\\|") in md
    oom = cells(row_html(page, "tiers", "test_tiny--batch_size4"))
    assert "failed: out of memory (attempt 2)" in oom
    assert "2 × 2" in oom  # the retry's halved micro-batch, not the preset's 4 x 1
    oom_failure = cells(row_html(page, "failures", "test_tiny--batch_size4"))
    attempted = read_json(RESULTS / "train" / "test_tiny--batch_size4" / "failure.json")["attempted_allocation_bytes"]
    assert format_bytes(attempted) in oom_failure
    refused = cells(row_html(page, "tiers", "test_tiny--batch_size4096"))
    # a refusal is the job's outcome, not a failure: Snakemake does not retry it
    assert "refused before training" in refused and "attempt 2" not in " ".join(refused)


def test_numbers_are_formatted_from_the_results(rendered):
    _out, page, md = rendered
    name = "test_tiny"  # trained on this CPU and evaluated
    run = read_json(RESULTS / "train" / name / "run.json")
    est = read_json(RESULTS / "vram" / f"{name}.json")
    scores = read_json(RESULTS / "eval" / name / "scores.json")
    row = cells(row_html(page, "tiers", name))
    booked = run["estimate"]["cpu_process"]["run_rss_bytes"]  # the gate's booking before exit, as the RSS
    expected = [format_bytes(booked), format_bytes(run["peak_rss_bytes"]),
                format_int(run["steps"]), format_duration(run["wall_seconds"]),
                format_rate(run["steps_per_s"] * run["batch_size"] * run["grad_accum"]),   # samples/s
                format_db(scores["overall"]["si_sdr"]), format_db(scores["overall"]["sdr"]),
                format_db(scores["overall"]["si_sdr_improvement"]), format_int(est["parameters"]),
                "fp32", "fits RAM", "flash (CPU)"]   # issue 32: what the budget is, and a CPU kernel
    for text in expected:
        assert text in row, f"{text!r} not in {row}"
    # the formats themselves: binary units, signed percentages, thousands separators
    assert re.fullmatch(r"\d+\.\d\d (KiB|MiB|GiB)", format_bytes(run["peak_rss_bytes"]))
    assert format_int(run["parameters"]) == f"{run['parameters']:,}"
    for stem, values in scores["per_stem"].items():
        assert format_db(values["si_sdr"]) in cells(row_html(page, "quality", name))
    assert f"| {name} | {format_bytes(booked)} | {format_bytes(run['peak_rss_bytes'])} |" in md
    large = read_json(RESULTS / "vram" / "large.json")  # estimate only: the estimate's own peak
    assert format_bytes(large["peak_bytes"]) in cells(row_html(page, "tiers", "large"))


def test_gpu_estimate_beside_its_h100_measurement(rendered):
    """The memory table of the CUDA tier: device use, allocated and reserved, each with its signed
    error; the figures are the H100's (tests/data/gpu/h100-2026-11-22/README.md: all under)."""
    _out, page, md = rendered
    run = read_json(RESULTS / "train" / GPU_TIER / "run.json")
    est = run["estimate"]  # what the gate used, made for cuda like the run
    rows = {r[2]: r for r in rows_of(page, "memory", GPU_TIER)}  # tier, device, compared, ...
    pairs = {"device use": ("peak_bytes", "peak_device_bytes"),
             "allocated": ("allocated_peak_bytes", "peak_allocated_bytes"),
             "reserved": ("reserved_peak_bytes", "peak_reserved_bytes")}
    for quantity, (est_key, run_key) in pairs.items():
        row = rows[quantity]
        assert row[3:6] == [format_bytes(est[est_key]), format_bytes(run[run_key]),
                            format_percent(est[est_key] / run[run_key] - 1)], quantity
    assert [rows[q][5] for q in pairs] == ["-7.1 %", "-1.0 %", "-3.9 %"]  # the H100 figures
    tier_row = cells(row_html(page, "tiers", GPU_TIER))
    assert "-7.1 % (device use)" in tier_row and format_bytes(run["peak_device_bytes"]) in tier_row
    assert format_bytes(est["peak_bytes"]) in tier_row  # the estimate the error was computed from
    assert "-7.1 %" in md


def test_default_shaped_cpu_tiers_have_numeric_errors(rendered):
    """estimate.device auto: a CPU tier is estimated for the CPU, so its memory rows compare: the
    gate's booking before exit with the process's peak RSS before exit (the headline), in bytes of
    the same thing."""
    _out, page, _md = rendered
    for tier in ("test_tiny", "test_tiny--batch_size1"):
        run = read_json(RESULTS / "train" / tier / "run.json")
        est = read_json(RESULTS / "vram" / f"{tier}.json")
        assert est["device"] == run["device_type"] == "cpu"
        rows = {r[2]: r for r in rows_of(page, "memory", tier)}
        booked = run["estimate"]["cpu_process"]["run_rss_bytes"]   # the gate's booking before exit
        assert booked < run["estimate"]["gate_required_bytes"]       # less the pages touched at exit
        assert rows["process RSS"][3:6] == [format_bytes(booked), format_bytes(run["peak_rss_bytes"]),
                                            format_percent(booked / run["peak_rss_bytes"] - 1)]
        assert re.fullmatch(ERROR, rows["process RSS"][5])
        assert "live tensors" in rows  # a row saying which unit it is in, even when not measured
        tier_row = cells(row_html(page, "tiers", tier))
        assert f"{rows['process RSS'][5]} (process RSS)" in tier_row


def test_an_estimate_for_another_device_is_not_compared(tmp_path):
    """As a run with estimate.device: cuda leaves it: a CUDA estimate of a tier trained on CPU (and
    a trainer that kept no estimate of its own): both figures shown, no error."""
    results = copy_results(tmp_path)
    run_path, est_path = results / "train" / "test_tiny" / "run.json", results / "vram" / "test_tiny.json"
    run_path.write_text(json.dumps({**read_json(run_path), "estimate": None}))
    est_path.write_text(json.dumps({**read_json(est_path), "device": "cuda"}))
    page, md = render_copy(tmp_path, results)
    row = cells(row_html(page, "tiers", "test_tiny"))
    assert "not comparable †" in row and not any(re.fullmatch(ERROR + r".*", c) for c in row)
    memory_row = cells(row_html(page, "memory", "test_tiny"))
    assert "peak RSS: not comparable (estimated for cuda, trained on cpu)" in memory_row
    assert format_bytes(read_json(run_path)["peak_rss_bytes"]) in memory_row
    assert "† Not comparable: no estimate was made for the device the tier trained on" in page
    assert "† Not comparable" in md


def test_start_baseline_shortfalls_are_flagged():
    """2% of the best start or 256 MiB, whichever is smaller; per host and kind of device."""
    gib, mib = 2**30, 2**20

    def tier(name, free, host="node1", device="cuda"):
        return Tier(name, "tier", run={"start_free_bytes": free, "host": host, "device_type": device})

    # the H100 sweep: a trial started while estimate jobs held CUDA contexts (83.37 vs 84.47 GB)
    tiers = [tier("a", 84.47e9), tier("b", 83.37e9), tier("c", 84.47e9 - 200 * mib),
             tier("d", 4 * gib, device="cpu"), tier("e", 4 * gib - 100 * mib, device="cpu"),
             tier("f", 70e9, host="node2")]
    flagged = start_shortfalls(tiers)
    assert set(flagged) == {"b", "e"}  # c: 200 MiB < 256 MiB; e: 100 MiB > 2% of 4 GiB; f: other host
    assert flagged["b"] == pytest.approx(1.1e9)


def test_start_compile_and_allocator_are_shown_when_recorded(tmp_path):
    results = copy_results(tmp_path)
    path = results / "train" / GPU_TIER / "run.json"
    run = read_json(path)
    run.update({"host": "gpu-node", "start_free_bytes": 84_470_000_000,
                "allocator": {"expandable_segments": True},
                "compile": {"requested": "auto", "compiled": False, "mode": None,
                            "reason": "dynamo fails in the complex RoPE"}})
    path.write_text(json.dumps(run))
    other = results / "train" / "test_tiny--batch_size1" / "run.json"
    trial = read_json(other)
    other.write_text(json.dumps({**trial, "host": "gpu-node", "device_type": "cuda",
                                 "device": "cuda:0 (NVIDIA H100 80GB HBM3)", "start_free_bytes": 83_370_000_000}))
    page, _md = render_copy(tmp_path, results)
    row = cells(row_html(page, "conditions", GPU_TIER))
    assert "not compiled (requested auto; dynamo fails in the complex RoPE)" in row
    assert "expandable_segments=True" in row and format_bytes(run["context_bytes"]) in row
    cpu = read_json(results / "train" / "test_tiny" / "run.json")
    assert format_bytes(cpu["start_rss_bytes"]) in cells(row_html(page, "conditions", "test_tiny"))
    flagged = cells(row_html(page, "conditions", "test_tiny--batch_size1"))
    assert any(c.startswith(format_bytes(83_370_000_000)) and "1.02 GiB below the best start" in c for c in flagged)


def test_scores_show_their_frames(rendered):
    """The page states the test tracks and the museval frames each score rests on."""
    _out, page, md = rendered
    scores = read_json(RESULTS / "eval" / "test_tiny" / "scores.json")
    entries = [e for stems in scores["per_track"].values() for e in stems.values()]
    valid, total = sum(e["valid_frames"] for e in entries), sum(e["frames"] for e in entries)
    row = cells(row_html(page, "quality", "test_tiny"))
    assert row[1:3] == [str(scores["tracks"]), f"{valid} / {total}"]
    for track, stems in scores["per_track"].items():
        frame_row = next(r for r in rows_of(page, "frames", "test_tiny") if r[1] == track)
        assert frame_row[2:] == [f"{stems[s]['valid_frames']} / {stems[s]['frames']}" for s in scores["sources"]]
    assert f"{scores['tracks']} test tracks" not in page  # the card says it with its own words:
    card = re.search(r'<div class="value">(\d+)</div><div class="label">test tracks</div>'
                     r'<div class="detail">(\d+) of (\d+) museval frames valid', page)
    assert card and int(card.group(1)) == scores["tracks"]
    assert "museval frames valid" in md


def test_tracks_with_few_valid_frames_are_flagged(tmp_path):
    results = copy_results(tmp_path)
    path = results / "eval" / "test_tiny" / "scores.json"
    scores = read_json(path)
    track = next(iter(scores["per_track"]))
    entry = scores["per_track"][track]["bass"]
    entry["valid_frames"] = entry["frames"] // 2 - 1 if entry["frames"] > 2 else 0
    path.write_text(json.dumps(scores))
    page, md = render_copy(tmp_path, results)
    frames = page.split('<table id="frames">', 1)[1].split("</table>", 1)[0]
    flagged = re.findall(r'<tr data-tier="test_tiny"[^>]*class="flagged"[^>]*>(.*?)</tr>', frames, re.S)
    assert len(flagged) == 1 and track in cells(flagged[0])
    note = f"test_tiny: {track} (bass {entry['valid_frames']}/{entry['frames']})"
    assert note in html.unescape(page) and note in md


def test_headline_is_the_improvement_over_the_mixture(rendered):
    _out, page, md = rendered
    best = max(("test_tiny", "test_tiny--batch_size1"),
               key=lambda t: read_json(RESULTS / "eval" / t / "scores.json")["overall"]["si_sdr_improvement"])
    overall = read_json(RESULTS / "eval" / best / "scores.json")["overall"]
    card = re.search(r'<div class="card"><div class="value">([^<]+)</div><div class="label">SI-SDR over the '
                     rf'mixture, best tier \({re.escape(best)}\)</div><div class="detail">([^<]+)</div>', page)
    assert card, "no improvement card"
    assert card.group(1) == f"{overall['si_sdr_improvement']:+.1f} dB"
    assert card.group(2).startswith(f"{format_db(overall['si_sdr'])} dB SI-SDR")
    assert f"SI-SDR over the mixture, best tier ({best}): **{overall['si_sdr_improvement']:+.1f} dB**" in md


def test_estimate_only_tiers_show_breakdown_and_largest_allocation(rendered):
    _out, page, md = rendered
    for tier in ("large", GPU_TIER):
        est = read_json(RESULTS / "vram" / f"{tier}.json")
        row = cells(row_html(page, "estimates", tier))
        for key, value in est["breakdown"].items():
            assert format_bytes(value) in row, key
        assert format_bytes(est["largest_allocation_bytes"]) in row
        mode = "expandable segments" if est["allocator"]["expandable_segments"] else "native allocator"
        assert f"{est['calibration']['name']} ({est['calibration']['source']}); {mode}" in row
        assert ("does not fit" if est["fits"] is False else "fits" if est["fits"] else "no budget") in row
        assert f"| {tier} |" in md


def test_images_are_embedded_and_written_next_to_the_markdown(rendered):
    from PIL import Image

    out, page, md = rendered
    sources = re.findall(r'<img src="([^"]+)"', page)
    assert len(sources) == len(PLOTS)
    for (stem, title), src in zip(PLOTS, sources):
        assert src.startswith("data:image/png;base64,")
        data = base64.b64decode(src.split(",", 1)[1])
        assert data == (out / f"{stem}.png").read_bytes()
        image = Image.open(stdio.BytesIO(data))
        assert image.format == "PNG" and image.width > 300 and image.height > 100
        assert f"![{title}]({stem}.png)" in md


def test_page_is_self_contained(rendered):
    _out, page, _md = rendered
    assert not re.search(r"<(script|link|iframe|object|embed)\b", page, re.I)
    for attribute in re.findall(r'(?:src|href|action)\s*=\s*"([^"]*)"', page, re.I):
        assert attribute.startswith(("data:", "#")), attribute
    assert not re.search(r"url\(|@import|srcset", page)
    assert "default-src 'none'" in page  # and the browser may fetch nothing else anyway
    # (a URL may appear as text, e.g. in torch's OOM message, but never where a browser loads it)


def test_run_facts(rendered):
    _out, page, md = rendered
    cfg = fixture_config()
    from tiersep.report.collect import config_hash

    assert config_hash(cfg) in page and re.fullmatch(r"[0-9a-f]{12}", config_hash(cfg))
    assert f"commit {git_commit().split('+')[0]}" in page  # this checkout's HEAD
    assert re.fullmatch(r"[0-9a-f]{12}(\+dirty)?", git_commit(REPO))
    run = read_json(RESULTS / "train" / "test_tiny" / "run.json")
    assert "cuda:0 (NVIDIA H100 80GB HBM3)" in page and f"torch {run['versions']['torch']}" in page
    for tier in ("test_tiny", "test_tiny--batch_size4"):  # every job's own process, on the record
        record = read_json(RESULTS / "train" / tier / ("run.json" if tier == "test_tiny" else "failure.json"))
        assert str(record["pid"]) in cells(row_html(page, "devices", tier))   # an id: no thousands separator
    manifest_path = next((FIXTURES / "report" / "prepared").glob("*/*/manifest.json"))
    manifest = read_json(manifest_path)
    counts = ", ".join(f"{split} {len(names)} ({sum(t['samples'] for t in manifest['tracks'] if t['split'] == split) / manifest['sample_rate']:.0f} s)"
                       for split, names in manifest["splits"].items())
    assert counts in page and f"{manifest['sample_rate']} Hz" in md
    assert "SLURM job" not in page  # no column that is empty for every tier


def test_stems_come_from_the_manifest_prepare_writes(rendered):
    """prepare writes `stems` (the files of a track, mixture first); the report read `sources`, a
    key no manifest has, so the column was always empty."""
    _out, page, _md = rendered
    manifest_path = next((FIXTURES / "report" / "prepared").glob("*/*/manifest.json"))
    assert read_json(manifest_path)["stems"] == ["mixture", "drums", "bass", "other", "vocals"]
    row = cells(row_html(page, "datasets", str(manifest_path)))
    assert "drums, bass, other, vocals" in row


def test_captions_come_from_workflow_report(rendered):
    _out, page, md = rendered
    folder = caption_dir()
    assert folder is not None
    for stem, _title in PLOTS:
        rst = (folder / f"{stem}.rst").read_text()
        assert caption_html(rst) in page
        assert caption_markdown(rst) in md


def test_captions_are_parsed_by_docutils():
    rst = ("A *first* paragraph with ``code``\nover two lines.\n\n- an item that\n  continues\n- **two**\n\n"
           "A last paragraph.\n")
    assert caption_markdown(rst) == ("A *first* paragraph with `code` over two lines.\n\n"
                                     "- an item that continues\n- **two**\n\nA last paragraph.")
    page = caption_html(rst)
    assert "<em>first</em>" in page and '<span class="docutils literal">code</span>' in page
    assert re.search(r"<li><p>an item that\ncontinues</p></li>", page) and "<strong>two</strong>" in page
    assert caption_html("<script>x</script>") == "<p>&lt;script&gt;x&lt;/script&gt;</p>"  # text, not markup


def test_source_files_list_templates_and_captions():
    files = source_files()
    assert all(path.is_file() for path in files)
    assert {p.name for p in files if p.parent == TEMPLATES_DIR} == set(TEMPLATE_FILES)
    assert {p.name for p in TEMPLATES_DIR.iterdir()} == set(TEMPLATE_FILES)  # nothing unlisted
    assert {p.stem for p in files if p.suffix == ".rst"} == {stem for stem, _ in PLOTS + SEARCH_PLOTS}


def test_outputs_are_written_atomically(rendered):
    from tiersep.outputs import STAMP

    out, _page, _md = rendered   # the report's files and its stamp; no temporary left
    assert sorted(p.name for p in out.iterdir()) == sorted([STAMP] + [p.name for p in output_files(out)])


# ---- partial and odd results -------------------------------------------------------------------
def test_empty_results_still_render(tmp_path):
    (tmp_path / "results").mkdir()
    cfg = fixture_config(tmp_path / "results")
    render(cfg, tmp_path / "results", tmp_path / "report")
    page = (tmp_path / "report" / "index.html").read_text()
    statuses = dict(re.findall(r'<tr data-tier="([^"]+)" data-status="([^"]+)"', page))
    assert set(statuses.values()) == {"missing"}
    assert "not run yet" in page and "no estimate yet" in page
    assert len(re.findall(r'<img src="data:image/png;base64,', page)) == len(PLOTS)
    assert "No tier failed or was refused." in page


def test_odd_results_render(tmp_path):
    """Results of a trial no longer in the config, a run still going (no run.json yet), and a
    score that is NaN (a damaged scores.json: tiersep writes an undefined score as null) all
    render; the NaN is an invalid record, never a quiet dash."""
    results = copy_results(tmp_path)
    shutil.copytree(results / "train" / "test_tiny", results / "train" / "test_tiny--lr1e-3")
    (results / "train" / "test_tiny--batch_size1" / "run.json").unlink()
    shutil.rmtree(results / "eval" / "test_tiny--batch_size1")
    scores_path = results / "eval" / "test_tiny" / "scores.json"
    scores = read_json(scores_path)
    scores["overall"]["si_sdr"] = float("nan")
    scores_path.write_text(json.dumps(scores))  # json writes NaN, as Python's json module does

    cfg = fixture_config(results)
    tiers = {t.name: t for t in collect(cfg, results).tiers}
    old = tiers["test_tiny--lr1e-3"]
    assert old.kind == "found" and old.status == "trained" and old.preset is None
    run = read_json(results / "train" / "test_tiny" / "run.json")
    assert old.batch == (run["batch_size"], run["grad_accum"])  # from its run.json
    assert list(tiers)[-1] == "test_tiny--lr1e-3"
    running = tiers["test_tiny--batch_size1"]
    last = max(row["step"] for row in running.metrics)
    assert running.status_text == f"incomplete (last step {int(last)})"
    from tiersep.report.memory import measured_peak

    assert measured_peak(running) == (max(row["peak"] for row in running.memory), "peak RSS")

    render(cfg, results, tmp_path / "report")
    page = (tmp_path / "report" / "index.html").read_text()
    assert "not in config" in cells(row_html(page, "tiers", "test_tiny--lr1e-3"))
    assert cells(row_html(page, "tiers", "test_tiny"))[2] == "invalid record"


def test_a_failure_recovered_by_the_retry_is_not_the_status(tmp_path):
    """The trainer deletes failure.json when a retry starts and records the OOM it recovered from
    in run.json (recovered_from, downshifted_from)."""
    results = copy_results(tmp_path)
    run_path = results / "train" / "test_tiny" / "run.json"
    run = read_json(run_path)
    oom = {"kind": "oom", "message": "CUDA out of memory. Tried to allocate 2.00 GiB.", "attempt": 1,
           "device": run["device"], "batch_size": 2, "grad_accum": 1}
    run_path.write_text(json.dumps({**run, "attempt": 2, "batch_size": 1, "grad_accum": 2, "recovered_from": oom,
                                    "downshifted_from": {"batch_size": 2, "grad_accum": 1}}))
    collected = collect(fixture_config(results), results)
    tier = {t.name: t for t in collected.tiers}["test_tiny"]
    assert tier.status == "evaluated" and tier.failure is None
    assert tier.status_text == "trained and evaluated on attempt 2 (after an out-of-memory failure)"
    assert tier.batch == (1, 2)
    from tiersep.report.page import failures_table

    row = next(r for r in failures_table(collected).rows if r.key == "test_tiny")
    assert row.cells[0].text == "oom (recovered: attempt 2 succeeded)"


def test_a_corrupt_result_is_a_failure_row_naming_the_file(tmp_path):
    """A record that cannot be read stops nothing: the report renders, and the failures table
    names the file (before: collect raised and no report was written at all)."""
    results = copy_results(tmp_path)
    (results / "vram" / "large.json").write_text('{"peak_bytes": ')
    page, md = render_copy(tmp_path, results)
    reason = cells(row_html(page, "failures", "large"))[2]
    assert re.match(rf"{re.escape(str(results))}/vram/large\.json: not valid JSON", reason)
    assert "invalid record" in cells(row_html(page, "tiers", "large"))


def test_a_record_breaking_its_schema_is_a_failure_row_naming_file_and_field(tmp_path):
    results = copy_results(tmp_path)
    path = results / "train" / "test_tiny" / "run.json"
    run = read_json(path)
    del run["peak_allocated_bytes"]
    path.write_text(json.dumps(run))
    page, md = render_copy(tmp_path, results)
    assert cells(row_html(page, "failures", "test_tiny"))[1:3] == [
        "invalid record", f"{path}: peak_allocated_bytes: missing (required)"]
    assert "invalid record" in cells(row_html(page, "tiers", "test_tiny"))
    assert f"{path}: peak_allocated_bytes: missing (required)" in md


def test_a_preset_that_fails_to_load_is_a_failure_row(tmp_path):
    """Collected as preset_error, then dropped from the page: now a failure with the message."""
    presets = tmp_path / "presets"
    shutil.copytree(FIXTURES / "report" / "presets", presets)
    cfg = fixture_config(presets=presets)  # loads (and checks) every preset ...
    (presets / "large.yaml").write_text((presets / "large.yaml").read_text().replace("n_layers: 8", "n_layers: 0"))
    page, md = render_copy(tmp_path, RESULTS, cfg)  # ... that is broken by the time the report runs
    row = cells(row_html(page, "failures", "large"))
    assert row[1] == "preset error" and "large.yaml: model.n_layers: 0 is less than the minimum" in row[2]
    assert "preset does not load" in cells(row_html(page, "tiers", "large"))
    assert "large.yaml: model.n_layers" in md


def test_fixture_scores_follow_the_evaluation_schema():
    """Keeps the fixture honest: its scores.json files pass the evaluator's own schema."""
    from tiersep.evaluate.schema import validate_scores

    paths = sorted((RESULTS / "eval").glob("*/scores.json"))
    assert paths, RESULTS / "eval"   # an empty glob would check nothing
    for path in paths:
        validate_scores(read_json(path), path)


def test_manifest_summary_accepts_split_mappings(tmp_path):
    summary = manifest_summary(tmp_path / "manifest.json", {
        "source": "musdb18hq", "sample_rate": 44100,
        "tracks": {"train": [{"name": "A", "samples": 441000}], "test": ["B", "C"]}})
    assert summary["tracks"] == "train 1 (10 s), test 2"


# ---- helpers ------------------------------------------------------------------------------------
def test_pareto_front():
    points = [(1.0, 2.0), (2.0, 1.5), (3.0, 4.0), (0.5, 0.0), (4.0, 4.0)]
    assert pareto_front(points) == [3, 0, 2]


def test_units():
    assert format_bytes(None) == "—"
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(80.89 * 2**30) == "80.89 GiB"
    assert format_bytes(2**29, digits=0) == "512 MiB"
    assert format_percent(0.0312) == "+3.1 %" and format_percent(-0.25) == "-25.0 %"
    assert format_duration(61.8) == "1 min 02 s" and format_duration(7500) == "2 h 05 min"
    assert format_rate(4.854) == "4.85" and format_rate(0.41234) == "0.412" and format_rate(123.4) == "123"
    assert format_db(float("nan")) == "—"


def test_git_commit_outside_a_repository(tmp_path):
    assert git_commit(tmp_path) == "unknown"


# ---- the page in a real browser ------------------------------------------------------------------
class Chromium:
    """Headless Chromium driven over the DevTools protocol on a pipe (--remote-debugging-pipe:
    the browser reads NUL-terminated JSON commands on fd 3 and answers on fd 4). Standard library only."""

    def __init__(self, binary: str, profile: Path, timeout: float = 20.0, start_timeout: float = 120.0):
        import fcntl
        import os
        import subprocess

        # the first reply waits for the browser's own start too: on a loaded 2-core CI machine two
        # browsers starting at once once took over 20 s (stop 45's CI run)
        self.timeout, self.start_timeout = timeout, start_timeout
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()

        def wire_fds():  # in the child, before exec: our pipe ends become its fds 3 and 4
            r = fcntl.fcntl(to_child_r, fcntl.F_DUPFD, 10)  # first out of the way of 3 and 4
            w = fcntl.fcntl(from_child_w, fcntl.F_DUPFD, 10)
            os.dup2(r, 3)  # dup2 copies are inheritable; all other pipe ends close on exec
            os.dup2(w, 4)

        self.proc = subprocess.Popen(
            [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-extensions",
             "--disable-dev-shm-usage", "--mute-audio", "--hide-scrollbars", f"--user-data-dir={profile}",
             "--remote-debugging-pipe", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            preexec_fn=wire_fds, close_fds=False, start_new_session=True)
        os.close(to_child_r)
        os.close(from_child_w)
        self._buffer = b""
        self._last_id = 0
        self.events: list[dict] = []

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        import os

        self._last_id += 1
        message = {"id": self._last_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_child, json.dumps(message).encode() + b"\0")
        wanted = self._last_id
        return self._wait(lambda m: m.get("id") == wanted, f"the reply to {method}",
                          self.start_timeout if wanted == 1 else self.timeout)

    def wait_event(self, method: str) -> dict:
        for i, event in enumerate(self.events):
            if event["method"] == method:
                return self.events.pop(i)["params"]
        return self._wait(lambda m: m.get("method") == method, f"event {method}")

    def _wait(self, match, what: str, timeout: float | None = None) -> dict:
        import os
        import select
        import time

        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([self._from_child], [], [], left)[0]:
                    raise TimeoutError(f"chromium: no {what} within {timeout} s")
                chunk = os.read(self._from_child, 1 << 20)
                if not chunk:
                    raise RuntimeError(f"chromium exited: {self.proc.stderr.read().decode()[-2000:]}")
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            message = json.loads(raw)
            if match(message):
                if "error" in message:
                    raise RuntimeError(f"chromium: {what}: {message['error']}")
                return message.get("result", message.get("params", {}))
            if "method" in message:
                self.events.append(message)

    def open_page(self, url: str, width: int, height: int = 900) -> str:
        """A new tab showing `url` at `width` x `height` CSS px, loaded, with the Page, Runtime, Log
        and Network events recorded; returns its session id."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.send(f"{domain}.enable", session=session)
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}, session=session)
        self.send("Page.navigate", {"url": url}, session=session)
        self.wait_event("Page.loadEventFired")
        return session

    def close(self) -> None:
        import os
        import signal
        import subprocess

        try:
            os.write(self._to_child, json.dumps({"id": 0, "method": "Browser.close"}).encode() + b"\0")
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the browser's own process group, started above
            self.proc.wait()
        finally:
            os.close(self._to_child)
            os.close(self._from_child)
            self.proc.stderr.close()


PAGE_CHECK = """(async () => {
  const images = [...document.images];
  await Promise.all(images.map(i => i.decode().catch(() => null)));
  const rows = [...document.querySelectorAll('#tiers tbody tr')];
  return {
    images: images.map(i => ({complete: i.complete, width: i.naturalWidth, height: i.naturalHeight,
                              shown: i.getBoundingClientRect().width,
                              top: i.getBoundingClientRect().top + window.scrollY,
                              left: i.getBoundingClientRect().left,
                              bottom: i.getBoundingClientRect().bottom + window.scrollY})),
    rows: rows.map(r => r.dataset.tier),
    tableHeight: document.querySelector('#tiers').getBoundingClientRect().height,
    failureRows: document.querySelectorAll('#failures tbody tr').length,
    // What fits which GPU: a row per tier, and the estimates' "does not fit" leads to one
    fitRows: [...document.querySelectorAll('#fit-matrix tbody tr')].map(r => r.id),
    fitLinks: [...document.querySelectorAll('#estimates a')].map(a => [a.getAttribute('href'),
      !!document.getElementById(a.getAttribute('href').slice(1))]),
    // laid-out widths: a table wider than its scrolling wrapper, or than the window, is cut off
    tables: [...document.querySelectorAll('table')].map(t => ({
      id: t.id, right: t.getBoundingClientRect().right, width: t.getBoundingClientRect().width,
      wrapperScroll: t.parentElement.scrollWidth, wrapperClient: t.parentElement.clientWidth})),
    viewport: document.documentElement.clientWidth,
    pageWidth: document.documentElement.scrollWidth,
  };
})()"""
WIDTH = 1300  # a laptop browser window


def test_page_renders_in_headless_chromium(rendered, tmp_path):
    """Open index.html in Debian's chromium at 1300 px: every plot decodes, every table fits the
    window (none cut off or scrolling sideways), nothing is fetched but the page itself and its data:
    URIs, no console error, and the screenshot is not blank."""
    from PIL import Image, ImageStat

    binary = shutil.which("chromium")
    if binary is None:
        pytest.skip("chromium is not installed (Debian: apt-get install -y chromium)")
    out, _page, _md = rendered
    browser = Chromium(binary, tmp_path / "profile")
    try:
        session = browser.open_page((out / "index.html").as_uri(), WIDTH)
        state = browser.send("Runtime.evaluate", {"expression": PAGE_CHECK, "awaitPromise": True,
                                                  "returnByValue": True}, session=session)["result"]["value"]
        size = browser.send("Page.getLayoutMetrics", session=session)["cssContentSize"]
        shot = browser.send("Page.captureScreenshot", {
            "format": "png", "captureBeyondViewport": True,
            "clip": {"x": 0, "y": 0, "width": WIDTH, "height": size["height"], "scale": 1}}, session=session)
    finally:
        browser.close()

    assert state["rows"] == list(EXPECTED_STATUS) and state["tableHeight"] > 150
    assert state["failureRows"] == 2
    assert state["fitRows"] == ["fit-test_tiny", "fit-small", "fit-large"]   # 10 columns, checked below
    assert state["fitLinks"] == [["#fit-large", True]]
    assert state["viewport"] == WIDTH and state["pageWidth"] <= WIDTH
    assert len(state["tables"]) >= 10
    for table in state["tables"]:
        assert table["right"] <= WIDTH and table["wrapperScroll"] <= table["wrapperClient"], table
    assert len(state["images"]) == len(PLOTS)
    for image, (stem, _title) in zip(state["images"], PLOTS):
        assert image["complete"] and image["width"] > 300 and image["shown"] > 300, (stem, image)
        assert image["width"] == Image.open(out / f"{stem}.png").width
    errors = [e["params"] for e in browser.events
              if e["method"] in ("Runtime.exceptionThrown", "Runtime.consoleAPICalled", "Log.entryAdded")
              and (e["method"] == "Runtime.exceptionThrown" or e["params"].get("type") in ("error", "assert")
                   or e["params"].get("entry", {}).get("level") == "error")]
    assert not errors, errors
    fetched = [e["params"]["request"]["url"] for e in browser.events if e["method"] == "Network.requestWillBeSent"]
    assert fetched and all(url.startswith(("data:", "file:")) for url in fetched), fetched

    screenshot = Image.open(stdio.BytesIO(base64.b64decode(shot["data"]))).convert("RGB")
    (tmp_path / "screenshot.png").write_bytes(base64.b64decode(shot["data"]))  # kept for a human look
    assert screenshot.width == WIDTH and screenshot.height >= 2000
    assert ImageStat.Stat(screenshot.convert("L")).stddev[0] > 20  # not one flat colour
    for image in state["images"]:  # every plot's area in the screenshot holds a drawing
        box = (int(image["left"]), int(image["top"]), int(image["left"] + image["shown"]), int(image["bottom"]))
        region = screenshot.crop(box).convert("L")
        assert ImageStat.Stat(region).stddev[0] > 10 and len(region.getcolors(1 << 16) or []) > 20, box


def test_the_page_reads_right_the_first_time(rendered):
    """Issue 32 (a new user's first read): the header names the results folder once, the toy nature
    of synthetic-set tiers is said before the first table, malloc settings are words, and a CPU
    tier's attention is torch's CPU kernel."""
    _out, page, md = rendered
    header = page.split("<header>", 1)[1].split("</header>", 1)[0]
    assert "results results" not in header and f"results folder {RESULTS}" in html.unescape(header)
    note = page.split('id="data-note">', 1)[1].split("</p>", 1)[0]
    assert page.index('id="data-note"') < page.index('<table id="tiers">')
    assert "embedded synthetic set" in note and "not the quality a tier reaches on real music" in note
    assert re.search(r"\(\d+ s at \d+ Hz of training audio\)", note), note
    assert "embedded synthetic set" in md.split("## Tiers", 1)[0]
    conditions = page.split('<table id="conditions">', 1)[1].split("</table>", 1)[0]
    assert "applied=" not in conditions and "reason=" not in conditions
    assert "glibc" in conditions or "tuned" in conditions
    row = cells(row_html(page, "tiers", "test_tiny"))   # trained on this CPU
    assert any(c.endswith("(CPU)") for c in row), row


def test_the_quality_plot_spreads_two_close_tiers_over_several_ticks():
    """Two CPU tiers 14 % apart got one tick on a log axis and a mixture line that stretched the plot."""
    from tiersep.report.plots import _pyplot, _quality_x_axis

    plt = _pyplot()
    fig, ax = plt.subplots()
    peaks = [1.02 * 2**30, 1.16 * 2**30]
    _quality_x_axis(ax, peaks)
    low, high = ax.get_xlim()
    ticks = [t for t in ax.get_xticks() if low <= t <= high]
    labels = {ax.xaxis.get_major_formatter()(t, 0) for t in ticks}
    assert ax.get_xscale() == "linear" and len(ticks) >= 3 and len(labels) == len(ticks)
    assert low < peaks[0] and peaks[1] < high
    plt.close(fig)
    fig, ax = plt.subplots()
    _quality_x_axis(ax, [50 * 2**20, 20 * 2**30])   # a wide range stays logarithmic
    assert ax.get_xscale() == "log"
    plt.close(fig)


def test_training_curves_draw_the_ema_validation_beside_the_raw_one(monkeypatch):
    """A tier trained with train.ema has *_ema columns in metrics.csv: both panels draw them."""
    from tiersep.report import plots

    figures = []
    monkeypatch.setattr(plots, "_png", lambda fig: figures.append(fig) or b"")
    rows = [{"step": 1.0, "loss": 0.5}, {"step": 2.0, "loss": 0.4, "val_loss": 0.45, "val_sdr": 1.0,
                                         "val_si_sdr": 0.5, "val_loss_ema": 0.44, "val_si_sdr_ema": 0.7}]
    plots.plot_curves([Tier("t", "tier", metrics=rows)], {"t": "C0"})
    loss_ax, val_ax = figures[0].axes
    ema = {line.get_label(): list(line.get_ydata()) for ax in (loss_ax, val_ax) for line in ax.get_lines()
           if "EMA" in line.get_label()}
    assert ema == {"t valid, EMA": [0.44], "t SI-SDR, EMA": [0.7]}
