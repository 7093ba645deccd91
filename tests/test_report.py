"""The report: rendered from a hand-made results tree (tests/fixtures/results: three tiers trained
and evaluated, one out of memory, one refused by the fit gate, five estimated only), its content
checked, opened in a real headless Chromium, and re-rendered by a real snakemake when only a caption
changes. Regenerate the fixture with tests/fixtures/make_report_results.py."""
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
from tiersep.report import ReportInputError, collect, output_files, render, source_files
from tiersep.report.collect import git_commit, manifest_summary
from tiersep.report.plots import PLOTS, pareto_front
from tiersep.report.render import (TEMPLATE_FILES, TEMPLATES_DIR, caption_dir, caption_html,
                                   caption_markdown)
from tiersep.report.units import (format_bytes, format_db, format_duration, format_int, format_percent,
                                  format_rate)

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
RESULTS = FIXTURES / "results"
FIXTURE_CONFIG = FIXTURES / "report" / "config.yaml"


def fixture_config(results: Path = RESULTS) -> dict:
    """The fixture's config with its relative paths made absolute (tests may run from anywhere)."""
    return C.load_config(FIXTURE_CONFIG, overrides={
        "presets_dir": str(REPO / "config" / "presets"), "results_dir": str(results),
        "data": {"prepared_dir": str(FIXTURES / "report" / "prepared")}})


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def row_html(page: str, table_id: str, tier: str) -> str:
    table = page.split(f'<table id="{table_id}">', 1)[1].split("</table>", 1)[0]
    match = re.search(rf'<tr data-tier="{re.escape(html.escape(tier))}"[^>]*>(.*?)</tr>', table, re.S)
    assert match, f"no row for {tier} in #{table_id}"
    return match.group(1)


def cells(row: str) -> list[str]:
    return [html.unescape(re.sub(r"<[^>]+>", "", c)) for c in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> tuple[Path, str, str]:
    out = tmp_path_factory.mktemp("report")
    render(fixture_config(), RESULTS, out)
    return out, (out / "index.html").read_text(), (out / "report.md").read_text()


# ---- content ------------------------------------------------------------------------------------
EXPECTED_STATUS = {
    "cpu_tiny": "evaluated", "cpu_small": "evaluated", "small--batch_size1": "evaluated",
    "small--batch_size4": "failed", "small--batch_size32": "refused",
    "ultra_safe": "estimate", "small": "estimate", "memory_optimized": "estimate", "large": "estimate",
    "xlarge": "estimate",
}


def test_every_tier_is_a_row_in_order_with_its_status(rendered):
    _out, page, _md = rendered
    table = page.split('<table id="tiers">', 1)[1].split("</table>", 1)[0]
    rows = re.findall(r'<tr data-tier="([^"]+)" data-status="([^"]+)"', table)
    from tiersep.train.sweep import trial_names

    cfg = fixture_config()
    expected_order = cfg["tiers"] + trial_names(cfg) + cfg["estimate_tiers"]
    assert [html.unescape(name) for name, _ in rows] == expected_order
    assert {html.unescape(name): status for name, status in rows} == EXPECTED_STATUS


def test_failed_and_refused_tiers_show_their_reason(rendered):
    _out, page, md = rendered
    for tier in ("small--batch_size4", "small--batch_size32"):
        failure = read_json(RESULTS / "train" / tier / "failure.json")
        assert html.escape(failure["message"]) in row_html(page, "failures", tier)
        assert failure["message"] in md
    oom = cells(row_html(page, "tiers", "small--batch_size4"))
    assert "failed: out of memory (attempt 2)" in oom
    assert "2 × 2" in oom  # the retry's halved micro-batch, not the preset's 4 x 1
    oom_failure = cells(row_html(page, "failures", "small--batch_size4"))
    attempted = read_json(RESULTS / "train" / "small--batch_size4" / "failure.json")["attempted_allocation_bytes"]
    assert format_bytes(attempted) in oom_failure
    refused = cells(row_html(page, "tiers", "small--batch_size32"))
    assert "refused by the fit gate" in refused and "refused" in refused


def test_numbers_are_formatted_from_the_results(rendered):
    _out, page, md = rendered
    name = "small--batch_size1"  # trained on CUDA and estimated for CUDA: errors are computed
    run = read_json(RESULTS / "train" / name / "run.json")
    est = read_json(RESULTS / "vram" / f"{name}.json")
    scores = read_json(RESULTS / "eval" / name / "scores.json")
    row = cells(row_html(page, "tiers", name))
    allocated, reserved = run["peak_allocated_bytes"], run["peak_reserved_bytes"]
    expected = [format_bytes(est["peak_bytes"]), format_bytes(allocated), format_bytes(reserved),
                format_percent((est["peak_bytes"] - allocated) / allocated),
                format_percent((est["peak_bytes"] - reserved) / reserved),
                format_int(run["steps"]), format_duration(run["wall_seconds"]), format_rate(run["steps_per_s"]),
                format_db(scores["overall"]["si_sdr"]), format_db(scores["overall"]["sdr"]),
                format_db(scores["overall"]["si_sdr_improvement"]), format_int(est["parameters"]),
                f"{run['device']}, allocator", "bf16", "fits"]
    for text in expected:
        assert text in row, f"{text!r} not in {row}"
    # the formats themselves: binary units, signed percentages, thousands separators
    assert re.fullmatch(r"\d+\.\d\d (KiB|MiB|GiB)", format_bytes(allocated))
    assert re.fullmatch(r"[+-]\d+\.\d %", format_percent((est["peak_bytes"] - allocated) / allocated))
    assert format_int(run["steps"]) == f"{run['steps']:,}"
    for stem, values in scores["per_stem"].items():
        assert format_db(values["si_sdr"]) in cells(row_html(page, "quality", name))
    assert format_percent((est["peak_bytes"] - allocated) / allocated) in md


def test_cpu_measurement_is_not_compared_with_a_cuda_estimate(rendered):
    _out, page, md = rendered
    run = read_json(RESULTS / "train" / "cpu_tiny" / "run.json")
    row = cells(row_html(page, "tiers", "cpu_tiny"))
    assert f"{run['device']}, peak RSS" in row and "cuda" in row  # measured on, estimated for
    assert format_bytes(run["peak_allocated_bytes"]) in row  # both shown ...
    assert format_bytes(read_json(RESULTS / "vram" / "cpu_tiny.json")["peak_bytes"]) in row
    assert row.count("not comparable †") == 2  # ... but no error computed
    assert not any(re.fullmatch(r"[+-]\d+\.\d %", c) for c in row)
    assert "† Estimate made for one device, measured on another" in page
    assert "† Estimate made for one device, measured on another" in md


def test_estimate_only_tiers_show_breakdown_and_largest_allocation(rendered):
    _out, page, md = rendered
    for tier in ("ultra_safe", "large", "xlarge"):
        est = read_json(RESULTS / "vram" / f"{tier}.json")
        row = cells(row_html(page, "estimates", tier))
        for key, value in est["breakdown"].items():
            assert format_bytes(value) in row, key
        assert format_bytes(est["largest_allocation_bytes"]) in row
        assert ("fits" if est["fits"] else "does not fit") in row
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
    assert "cuda:0 (NVIDIA GeForce RTX 4090)" in page and "torch 2.11.0+cu128" in page
    for tier in ("cpu_tiny", "small--batch_size4"):  # every job's own process, on the record
        record = read_json(RESULTS / "train" / tier / ("run.json" if tier == "cpu_tiny" else "failure.json"))
        assert format_int(record["pid"]) in cells(row_html(page, "devices", tier))
    assert "train 6 (72 s), valid 2 (24 s), test 3 (36 s)" in page  # both prepared manifests
    assert page.count("train 6 (72 s)") == 2 and "44100 Hz" in md
    assert "SLURM job" not in page  # no column that is empty for every tier


def test_captions_come_from_workflow_report(rendered):
    _out, page, md = rendered
    folder = caption_dir()
    assert folder is not None
    for stem, _title in PLOTS:
        rst = (folder / f"{stem}.rst").read_text()
        assert caption_html(rst) in page
        assert caption_markdown(rst) in md


def test_source_files_list_templates_and_captions():
    files = source_files()
    assert all(path.is_file() for path in files)
    assert {p.name for p in files if p.parent == TEMPLATES_DIR} == set(TEMPLATE_FILES)
    assert {p.name for p in TEMPLATES_DIR.iterdir()} == set(TEMPLATE_FILES)  # nothing unlisted
    assert {p.stem for p in files if p.suffix == ".rst"} == {stem for stem, _ in PLOTS}


def test_outputs_are_written_atomically(rendered):
    out, _page, _md = rendered
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in output_files(out))


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


def _copy_results(tmp_path: Path) -> Path:
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    return results


def test_odd_results_render(tmp_path):
    """Results of a trial no longer in the config, a run still going (no run.json yet), and a
    score that is NaN (museval gives NaN for silent frames) all render."""
    results = _copy_results(tmp_path)
    shutil.copytree(results / "train" / "cpu_tiny", results / "train" / "cpu_tiny--lr1e-3")
    (results / "train" / "cpu_small" / "run.json").unlink()
    shutil.rmtree(results / "eval" / "cpu_small")
    scores_path = results / "eval" / "small--batch_size1" / "scores.json"
    scores = read_json(scores_path)
    scores["overall"]["si_sdr"] = float("nan")
    scores_path.write_text(json.dumps(scores))  # json writes NaN, as Python's json module does

    cfg = fixture_config(results)
    tiers = {t.name: t for t in collect(cfg, results).tiers}
    old = tiers["cpu_tiny--lr1e-3"]
    assert old.kind == "found" and old.status == "trained" and old.preset is None
    assert old.batch == (4, 1)  # from its run.json
    assert list(tiers)[-1] == "cpu_tiny--lr1e-3"
    running = tiers["cpu_small"]
    last = max(row["step"] for row in running.metrics)
    assert running.status_text == f"incomplete (last step {int(last)})"
    assert running.peak_allocated == max(row["peak"] for row in running.memory)

    render(cfg, results, tmp_path / "report")
    page = (tmp_path / "report" / "index.html").read_text()
    assert "not in config" in cells(row_html(page, "tiers", "cpu_tiny--lr1e-3"))
    assert "—" in cells(row_html(page, "quality", "small--batch_size1"))


def test_a_failure_recovered_by_the_retry_is_not_the_status(tmp_path):
    """The trainer deletes failure.json when a retry starts and records the OOM it recovered from
    in run.json (recovered_from, downshifted_from)."""
    results = _copy_results(tmp_path)
    run_path = results / "train" / "small--batch_size1" / "run.json"
    run = read_json(run_path)
    oom = {"kind": "oom", "message": "CUDA out of memory. Tried to allocate 2.00 GiB.", "attempt": 1,
           "device": run["device"], "batch_size": 2, "grad_accum": 1}
    run_path.write_text(json.dumps({**run, "attempt": 2, "batch_size": 1, "grad_accum": 2, "recovered_from": oom,
                                    "downshifted_from": {"batch_size": 2, "grad_accum": 1}}))
    tier = {t.name: t for t in collect(fixture_config(results), results).tiers}["small--batch_size1"]
    assert tier.status == "evaluated" and tier.failure is None
    assert tier.status_text == "trained and evaluated on attempt 2 (after an out-of-memory failure)"
    assert tier.batch == (1, 2)
    from tiersep.report.render import FAILURE_COLUMNS, table_html

    assert "recovered: attempt 2 succeeded" in table_html("failures", FAILURE_COLUMNS, [tier])


def test_a_corrupt_result_is_an_error_naming_the_file(tmp_path):
    results = _copy_results(tmp_path)
    (results / "vram" / "large.json").write_text('{"peak_bytes": ')
    with pytest.raises(ReportInputError, match=r"vram/large\.json: not valid JSON"):
        collect(fixture_config(results), results)


def test_fixture_scores_follow_the_evaluation_schema():
    """Keeps the hand-made fixture honest: its scores.json files pass the evaluator's own schema."""
    from tiersep.evaluate.schema import validate_scores

    for path in sorted((RESULTS / "eval").glob("*/scores.json")):
        validate_scores(read_json(path))


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

    def __init__(self, binary: str, profile: Path, timeout: float = 20.0):
        import fcntl
        import os
        import subprocess

        self.timeout = timeout
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
        return self._wait(lambda m: m.get("id") == wanted, f"the reply to {method}")

    def wait_event(self, method: str) -> dict:
        for i, event in enumerate(self.events):
            if event["method"] == method:
                return self.events.pop(i)["params"]
        return self._wait(lambda m: m.get("method") == method, f"event {method}")

    def _wait(self, match, what: str) -> dict:
        import os
        import select
        import time

        deadline = time.monotonic() + self.timeout
        while True:
            while b"\0" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([self._from_child], [], [], left)[0]:
                    raise TimeoutError(f"chromium: no {what} within {self.timeout} s")
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
  };
})()"""


def test_page_renders_in_headless_chromium(rendered, tmp_path):
    """Open index.html in Debian's chromium: every plot decodes, the tables are laid out, nothing is
    fetched but the page itself and its data: URIs, no console error, and the screenshot is not blank."""
    from PIL import Image, ImageStat

    binary = shutil.which("chromium")
    if binary is None:
        pytest.skip("chromium is not installed (Debian: apt-get install -y chromium)")
    out, _page, _md = rendered
    browser = Chromium(binary, tmp_path / "profile")
    try:
        target = browser.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = browser.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            browser.send(f"{domain}.enable", session=session)
        browser.send("Emulation.setDeviceMetricsOverride",
                     {"width": 1280, "height": 900, "deviceScaleFactor": 1, "mobile": False}, session=session)
        browser.send("Page.navigate", {"url": (out / "index.html").as_uri()}, session=session)
        browser.wait_event("Page.loadEventFired")
        state = browser.send("Runtime.evaluate", {"expression": PAGE_CHECK, "awaitPromise": True,
                                                  "returnByValue": True}, session=session)["result"]["value"]
        size = browser.send("Page.getLayoutMetrics", session=session)["cssContentSize"]
        shot = browser.send("Page.captureScreenshot", {
            "format": "png", "captureBeyondViewport": True,
            "clip": {"x": 0, "y": 0, "width": 1280, "height": size["height"], "scale": 1}}, session=session)
    finally:
        browser.close()

    assert state["rows"] == list(EXPECTED_STATUS) and state["tableHeight"] > 200
    assert state["failureRows"] == 2
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
    assert screenshot.width == 1280 and screenshot.height >= 2000
    assert ImageStat.Stat(screenshot.convert("L")).stddev[0] > 20  # not one flat colour
    for image in state["images"]:  # every plot's area in the screenshot holds a drawing
        box = (int(image["left"]), int(image["top"]), int(image["left"] + image["shown"]), int(image["bottom"]))
        region = screenshot.crop(box).convert("L")
        assert ImageStat.Stat(region).stddev[0] > 10 and len(region.getcolors(1 << 16) or []) > 20, box
