"""The report's Listen section: the excerpts evaluate wrote into the fixture run
(tests/fixtures/results/eval/<tier>/listen/, made by tests/fixtures/make_report_results.py) played
in a real headless Chromium, the page's size, and damaged excerpts shown as invalid records while
the report still renders."""
from __future__ import annotations

import html
import json
import os
import re
import shutil
from pathlib import Path

import pytest

from test_report import RESULTS, Chromium, cells, copy_results, fixture_config, render_copy, row_html
from test_report_safety import failure_reasons, tiersep_report
from tiersep.evaluate.listen import MAX_BYTES
from tiersep.report import render

WIDTH = 1300
LISTENED = sorted(p.parent.parent.name for p in (RESULTS / "eval").glob("*/listen/listen.json"))


def listen_record(results: Path, tier: str) -> dict:
    return json.loads((results / "eval" / tier / "listen" / "listen.json").read_text())


def audio_tags(page: str) -> list[str]:
    return re.findall(r"<audio\b[^>]*>", page)


def test_the_fixture_run_wrote_an_excerpt_for_every_evaluated_tier():
    evaluated = sorted(p.parent.name for p in (RESULTS / "eval").glob("*/scores.json"))
    assert LISTENED == evaluated and len(LISTENED) == 2
    total = sum(p.stat().st_size for p in (RESULTS / "eval").glob("*/listen/*"))
    assert total < 300_000   # what the repository carries for them


PLAY_CHECK = """(async () => {
  const check = async (a) => {
    if (a.readyState < 1 && !a.error) {
      await new Promise(resolve => {
        a.addEventListener('loadedmetadata', resolve, {once: true});
        a.addEventListener('error', resolve, {once: true});
        setTimeout(resolve, 8000);
      });
    }
    let played = 0, playError = null;
    if (!a.error) {
      a.muted = true;
      try {
        await a.play();
        // the clock moves once audio is decoded and running: wait for it (a loaded machine is slow)
        const until = Date.now() + 10000;
        while (a.currentTime === 0 && Date.now() < until) await new Promise(r => setTimeout(r, 50));
        played = a.currentTime;
        a.pause();
      } catch (e) { playError = String(e); }
    }
    const box = a.getBoundingClientRect();
    return {tier: a.closest('table').dataset.tier, role: a.dataset.role, stem: a.dataset.stem || null,
            duration: a.duration, ready: a.readyState, error: a.error ? a.error.code : null,
            played, playError, width: box.width, right: box.right};
  };
  const audios = [...document.querySelectorAll('audio')];
  return {
    audios: await Promise.all(audios.map(check)),
    tables: [...document.querySelectorAll('table.listen')].map(t => ({
      right: t.getBoundingClientRect().right, wrapperScroll: t.parentElement.scrollWidth,
      wrapperClient: t.parentElement.clientWidth})),
    viewport: document.documentElement.clientWidth,
    pageWidth: document.documentElement.scrollWidth,
  };
})()"""


def open_in_chromium(page: Path, profile: Path) -> tuple[dict, list[dict]]:
    binary = shutil.which("chromium")
    if binary is None:
        pytest.skip("chromium is not installed (Debian: apt-get install -y chromium)")
    browser = Chromium(binary, profile, timeout=40)
    try:
        session = browser.open_page(page.as_uri(), WIDTH)
        # as if the reader clicked: a page may start audio only after a user gesture
        state = browser.send("Runtime.evaluate", {"expression": PLAY_CHECK, "awaitPromise": True,
                                                  "returnByValue": True, "userGesture": True},
                             session=session)["result"]["value"]
    finally:
        browser.close()
    return state, browser.events


def test_every_excerpt_plays_in_headless_chromium(tmp_path):
    """Each <audio> of the Listen section loads from its data: URI, knows its length (that of the
    excerpt), and plays; the section fits a 1300 px window; the CSP blocks nothing."""
    out = tmp_path / "report"
    render(fixture_config(), RESULTS, out)
    state, events = open_in_chromium(out / "index.html", tmp_path / "profile")

    expected = [(tier, entry["role"], entry["stem"]) for tier in LISTENED
                for entry in listen_record(RESULTS, tier)["files"]]
    assert [(a["tier"], a["role"], a["stem"]) for a in state["audios"]] == expected
    for audio in state["audios"]:
        seconds = listen_record(RESULTS, audio["tier"])["seconds"]
        assert audio["error"] is None and audio["playError"] is None, audio
        assert audio["ready"] >= 1 and audio["duration"] == pytest.approx(seconds, abs=0.05), audio
        assert audio["played"] > 0, audio   # decoded and running: the clock only moves on decoded audio
        assert audio["width"] > 200 and audio["right"] <= WIDTH, audio
    assert state["viewport"] == WIDTH and state["pageWidth"] <= WIDTH
    for table in state["tables"]:
        assert table["right"] <= WIDTH and table["wrapperScroll"] <= table["wrapperClient"], table
    refused = [e["params"] for e in events if e["method"] in ("Log.entryAdded", "Runtime.exceptionThrown")
               and (e["method"] == "Runtime.exceptionThrown" or e["params"]["entry"]["level"] == "error")]
    assert not refused, refused   # e.g. "Refused to load media ... Content Security Policy"
    fetched = [e["params"]["request"]["url"] for e in events if e["method"] == "Network.requestWillBeSent"]
    assert all(url.startswith(("data:", "file:")) for url in fetched)


def test_page_size_stays_within_the_cap(tmp_path, capsys):
    """At most 2 MB of audio per tier (4/3 of it as base64) on top of the rest of the page."""
    out = tmp_path / "report"
    render(fixture_config(), RESULTS, out)
    page = (out / "index.html").read_text()
    uris = re.findall(r'<audio [^>]*src="(data:[^"]+)"', page)
    audio_bytes = {tier: listen_record(RESULTS, tier)["bytes"] for tier in LISTENED}
    embedded = sum(len(uri) for uri in uris)
    rest = len(page.encode()) - embedded
    with capsys.disabled():
        print(f"\nindex.html: {len(page.encode())} bytes, {embedded} of them audio "
              f"({', '.join(f'{t}: {b} bytes encoded' for t, b in audio_bytes.items())}), rest {rest}")
    assert embedded == pytest.approx(sum(audio_bytes.values()) * 4 / 3, rel=0.01)
    assert len(page.encode()) <= len(LISTENED) * MAX_BYTES * 4 / 3 + rest
    assert rest < 1_500_000


def test_report_md_says_where_to_listen(tmp_path):
    _page, md = render_copy(tmp_path, RESULTS)
    section = md.split("## Listen", 1)[1].split("\n## ", 1)[0]
    assert "open index.html next to this file" in section and "data:" not in md and "<audio" not in md
    for tier in LISTENED:
        record = listen_record(RESULTS, tier)
        assert re.search(rf"\| {re.escape(tier)} \| {re.escape(record['track'])} \| 0\.0 s to "
                         rf"{record['seconds']:.1f} s of the track .* \| {re.escape(str(RESULTS))}/eval/"
                         rf"{re.escape(tier)}/listen \(", section), tier


def test_names_in_the_excerpt_are_text(tmp_path):
    results = copy_results(tmp_path)
    path = results / "eval" / "test_tiny" / "listen" / "listen.json"
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, "track": "<script>alert(1)</script> & co"}))
    page, md = render_copy(tmp_path, results)
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt; &amp; co" in page
    assert "<script>" not in md and "&lt;script>alert(1)&lt;/script> &amp; co" in md
    assert len(audio_tags(page)) == sum(len(listen_record(RESULTS, t)["files"]) for t in LISTENED)


# ---- damaged excerpts --------------------------------------------------------------------------
def _set(field, value):
    def damage(folder: Path) -> None:
        record = json.loads((folder / "listen.json").read_text())
        record[field] = value
        (folder / "listen.json").write_text(json.dumps(record))
    return damage


def _replace_file(make):
    def damage(folder: Path) -> None:
        target = folder / "vocals.estimate.ogg"
        data = target.read_bytes()
        target.unlink()
        make(target, data)
    return damage


DAMAGES = {
    "listen.json cut short": (lambda f: (f / "listen.json").write_text('{"track": "Alpha'),
                              r"listen/listen\.json: not valid JSON"),
    "listen.json not UTF-8": (lambda f: (f / "listen.json").write_bytes(b"\xff\xfe{}"),
                              r"listen/listen\.json: not valid JSON \(not UTF-8"),
    "over the cap": (_set("bytes", MAX_BYTES + 1),
                     rf"listen/listen\.json: bytes: {MAX_BYTES + 1} is greater than the maximum of {MAX_BYTES}"),
    "totals that do not add up": (_set("bytes", 1000), r"listen/listen\.json: bytes: 1000, but the files add up to"),
    "a path outside the folder": (_set("files", [{"role": "mixture", "stem": None, "file": "../../scores.json",
                                                  "bytes": 10}]),
                                  r"listen/listen\.json: files/0/file: '\.\./\.\./scores\.json' does not match"),
    "a NaN": (_set("gain", float("nan")), r"listen/listen\.json: gain: NaN is not a finite number"),
    "a missing file": (lambda f: (f / "vocals.estimate.ogg").unlink(),
                       r"listen/vocals\.estimate\.ogg: listed in listen\.json but missing"),
    "a file cut short": (_replace_file(lambda t, data: t.write_bytes(data[: len(data) // 2])),
                         r"listen/vocals\.estimate\.ogg: \d+ bytes, listen\.json says \d+"),
    "a file that is not Ogg": (_replace_file(lambda t, data: t.write_bytes(b"ID3" + data[3:])),
                               r"listen/vocals\.estimate\.ogg: not an Ogg file"),
    "a link": (_replace_file(lambda t, data: os.symlink(t.parent / "vocals.reference.ogg", t)),
               r"listen/vocals\.estimate\.ogg: listed in listen\.json but a link"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_excerpt_is_an_invalid_record_and_the_report_renders(tmp_path, damage):
    make, message = DAMAGES[damage]
    results = copy_results(tmp_path)
    make(results / "eval" / "test_tiny" / "listen")
    page, md = render_copy(tmp_path, results)
    reason = cells(row_html(page, "failures", "test_tiny"))
    assert reason[1] == "invalid record" and re.search(rf"^{re.escape(str(results))}/eval/test_tiny/{message}",
                                                       reason[2]), reason
    assert "invalid record" in cells(row_html(page, "tiers", "test_tiny"))
    tiers_heard = {html.unescape(t) for t in re.findall(r'<table class="listen" data-tier="([^"]+)"', page)}
    assert tiers_heard == set(LISTENED) - {"test_tiny"}   # the other tier still plays
    assert "test_tiny: its excerpt could not be read (see Failures and refusals)." in page
    assert "test_tiny: its excerpt could not be read" in md and re.search(message, md)


def test_the_cli_renders_with_a_damaged_excerpt(tmp_path):
    """The real `tiersep report`: exit 0, the problem among the failures."""
    results = copy_results(tmp_path)
    (results / "eval" / "test_tiny" / "listen" / "mixture.ogg").unlink()
    done = tiersep_report(tmp_path, results, tmp_path / "report")
    assert done.returncode == 0, done.stderr
    page = (tmp_path / "report" / "index.html").read_text()
    assert f"{results}/eval/test_tiny/listen/mixture.ogg: listed in listen.json but missing" in failure_reasons(page)
