"""What a finished search leaves and how the report shows it, from real short studies (real Optuna,
real `tiersep train` and `tiersep evaluate` processes on a tiny prepared dataset, CPU):

- a two-objective study writes its Pareto front as presets, the best trial for each budget of
  fit_matrix.gpus and best.json, and evaluates the best trials on the test set like tiers;
- the best trial's model.pt separates a song with `tiersep separate`, and its preset loads as a tier;
- a one-objective study with a pruned and an infeasible trial renders a Search section whose table,
  plots and packing figure hold what trials.csv says, in a real headless Chromium too.
"""
from __future__ import annotations

import base64
import html
import io as stdio
import json
import re
import shutil
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from test_report import RESULTS, WIDTH, Chromium, cells, fixture_config
from test_search_support import (booking, env, fresh_allowance, load_study, search_workspace, trials_csv,
                                 write_search_config)
from test_train_support import REPO

pytestmark = pytest.mark.slow   # two studies of real training and evaluation: about 6 minutes on 2 cores
GIB = 2**30
MARGIN = 0.08


def search(config: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tiersep.cli", "search", "--config", str(config)],
                          capture_output=True, text=True, cwd=REPO, env=env(), timeout=timeout)


def enqueue(folder: Path, directions: list[str], params: list[dict]) -> None:
    """Create the study with these trials first in line (Optuna's own enqueue), so the test knows
    which configurations run."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    folder.mkdir(parents=True)
    study = optuna.create_study(study_name="search", directions=directions,
                                storage=JournalStorage(JournalFileBackend(str(folder / "journal.log"))))
    for p in params:
        study.enqueue_trial(p)


def just_over(nbytes: int) -> float:
    """A budget in GiB 1 % above the least that a booking of `nbytes` fits (the gate keeps the margin
    free). The CPU booking shrinks with the budget (the malloc mode it allows), never grows, so it
    fits; a configuration that books more than 1 % over it does not (checked with the gate)."""
    return round(nbytes / (1 - MARGIN) * 1.01 / GIB, 4)


def gate_passes(ws: dict, params: dict, budget_gib: float) -> bool:
    from tiersep.memory import DoesNotFit, GateSettings, gate

    from test_search_support import base_preset

    try:
        gate(base_preset(ws, **params), "cpu", int(budget_gib * GIB), GateSettings(MARGIN, "auto"))
        return True
    except DoesNotFit:
        return False


def with_gpus(config: Path, gpus: list[float]) -> None:
    raw = yaml.safe_load(config.read_text())
    raw["fit_matrix"] = {"gpus": gpus}
    config.write_text(yaml.safe_dump(raw, sort_keys=False))


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    fresh_allowance()      # the budgets below are 1 % over bookings: one allowance for the module
    return search_workspace(tmp_path_factory.mktemp("search-report"))


@pytest.fixture(scope="module")
def two(ws):
    """Two objectives over batch size and width: four configurations of growing booking, the last
    over the study's budget; budgets of fit_matrix.gpus: one only the smallest fits, and the study's."""
    configs = [{"train.batch_size": bs, "model.emb_dim": emb} for bs, emb in ((2, 16), (4, 64), (8, 16), (16, 16))]
    budget = just_over(booking(ws, configs[2]))
    small = just_over(booking(ws, configs[0]))
    assert [gate_passes(ws, c, budget) for c in configs] == [True, True, True, False]
    config = write_search_config(ws, "two", trials=4, parallel=2, budget_gib=budget, on_oversize="skip",
                                 evaluate=True,
                                 objectives=["si_sdr", "predicted_peak"],
                                 space={"train.batch_size": {"choices": [2, 4, 8, 16]},
                                        "model.emb_dim": {"choices": [16, 64]}})
    with_gpus(config, [small, budget])
    folder = ws["root"] / "results-two" / "search" / "search"
    enqueue(folder, ["maximize", "minimize"], configs)
    done = search(config)
    assert done.returncode == 0, done.stderr[-3000:]
    return {"config": config, "folder": folder, "budgets": [small, budget], "stderr": done.stderr}


@pytest.fixture(scope="module")
def one(ws):
    """One objective, the median pruner, one trial at a time: two good trials, one that cannot learn
    (lr 1e-9: pruned at its first validation) and one over the budget (INFEASIBLE, no process)."""
    budget = just_over(booking(ws, {"train.batch_size": 2}))
    assert gate_passes(ws, {"train.batch_size": 2}, budget) and not gate_passes(ws, {"train.batch_size": 16}, budget)
    config = write_search_config(ws, "one", trials=4, parallel=1, pruner="median", budget_gib=budget,
                                 evaluate=True,
                                 on_oversize="skip", space={"train.lr": {"choices": [5.0e-3, 1.0e-9]},
                                                            "train.batch_size": {"choices": [2, 16]},
                                                            "train.steps": {"choices": [12, 400]}})
    folder = ws["root"] / "results-one" / "search" / "search"
    # the bad trial gets 400 steps: its 12 could end within one poll of step 4, and a run that
    # finished before the pruner's signal stands (tests/test_search.py's pruner test lost that race)
    enqueue(folder, ["maximize"], [{"train.lr": lr, "train.batch_size": bs, "train.steps": steps}
                                   for lr, bs, steps in ((5.0e-3, 2, 12), (5.0e-3, 2, 12), (1.0e-9, 2, 400),
                                                         (5.0e-3, 16, 12))])
    done = search(config)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["state"] for r in trials_csv(folder)] == ["COMPLETE", "COMPLETE", "PRUNED", "INFEASIBLE"]
    return {"config": config, "folder": folder}


def feasible(folder: Path) -> dict[int, tuple[float, int]]:
    """{trial: (validation SI-SDR, booking bytes)} of the feasible COMPLETE trials, from the journal."""
    return {t.number: (t.values[0], t.user_attrs["booking_bytes"]) for t in load_study(folder, "search").trials
            if t.state.name == "COMPLETE" and not any(v > 0 for v in t.constraints.values())}


def trained_preset(folder: Path, number: int) -> dict:
    return yaml.safe_load((folder / "trials" / f"{number}.preset.yaml").read_text())


# ---- outputs ------------------------------------------------------------------------------------
def test_a_rewrite_drops_only_the_presets_it_wrote(two, tmp_path):
    """Writing the outputs again (as every finished trial does) drops a stale preset of an earlier
    write, and keeps a file of the user's in best/ and pareto/, even one named like a trial's."""
    from tiersep.config import load_config
    from tiersep.search import outputs

    folder = tmp_path / two["folder"].name
    shutil.copytree(two["folder"], folder)
    stale = folder / "best" / "999gib.yaml"
    stale.write_text(f"# trial 0 of study {folder.name}: the best trial that fits 999 GiB; ...\n{{}}\n")
    mine = {folder / "best" / "mine.yaml": "# my notes on this study\nname: mine\n",
            folder / "pareto" / "99.yaml": "name: my_own_tier\n"}
    for path, text in mine.items():
        path.write_text(text)
    study = load_study(folder, "search")
    index = outputs.write(study, ["maximize", "minimize"], folder, load_config(two["config"]), "cpu")
    assert not stale.exists()
    assert all(path.read_text() == text for path, text in mine.items())
    assert sorted(p.name for p in (folder / "best").glob("*gib.yaml")) == sorted(
        Path(b["preset"]).name for b in index["budgets"] if b.get("preset"))


def test_two_objectives_write_the_pareto_front_and_each_budgets_best(two):
    folder = two["folder"]
    rows = trials_csv(folder)
    assert [r["state"] for r in rows] == ["COMPLETE", "COMPLETE", "COMPLETE", "INFEASIBLE"], rows
    scored = feasible(folder)
    assert set(scored) == {0, 1, 2}
    # the front, by brute force: no other trial at least as good on both and better on one
    front = sorted(n for n, (q, m) in scored.items()
                   if not any(q2 >= q and m2 <= m and (q2 > q or m2 < m) for q2, m2 in scored.values()))
    assert sorted(int(p.stem) for p in (folder / "pareto").glob("*.yaml")) == front and front
    for n in front:   # the preset the trial trained, with a header line saying where it came from
        text = (folder / "pareto" / f"{n}.yaml").read_text()
        assert text.startswith(f"# trial {n} of study search: on the Pareto front")
        assert yaml.safe_load(text) == trained_preset(folder, n)
    index = json.loads((folder / "best.json").read_text())
    assert [p["trial"] for p in index["pareto"]] == sorted(front, key=lambda n: scored[n][1])
    assert index["best"]["trial"] == max(scored, key=lambda n: scored[n][0])
    # each budget's best: the best SI-SDR among the trials whose booking + margin fits it
    assert [b["budget_gib"] for b in index["budgets"]] == two["budgets"]
    evaluated = {index["best"]["trial"]}
    for item, gib in zip(index["budgets"], two["budgets"]):
        budget = int(gib * GIB)
        fitting = [n for n, (_q, m) in scored.items() if m + int(MARGIN * budget) <= budget]
        assert fitting, item
        expected = max(fitting, key=lambda n: scored[n][0])
        assert item["trial"] == expected, (item, scored)
        path = folder / item["preset"]
        assert path == folder / "best" / f"{gib:g}gib.yaml"
        assert yaml.safe_load(path.read_text()) == trained_preset(folder, expected)
        evaluated.add(expected)
    assert index["budgets"][0]["trial"] == 0   # only the smallest configuration fits the small budget
    # the best and each budget's best are evaluated on the test set like a tier; the others are not
    for n in range(4):
        scores = folder / "eval" / str(n) / "scores.json"
        assert scores.is_file() == (n in evaluated), n
        if n in evaluated:
            record = json.loads(scores.read_text())
            assert record["overall"]["si_sdr"] is not None and "evaluate" in (folder / "eval" / f"{n}.log").read_text()
    assert index["best"]["scores"] == f"eval/{index['best']['trial']}/scores.json"
    assert "evaluating trial" in two["stderr"]


def test_the_best_trials_preset_is_a_tier_and_its_model_separates_a_song(ws, two, tmp_path):
    from tiersep import config as C

    folder = two["folder"]
    index = json.loads((folder / "best.json").read_text())
    best = index["best"]["trial"]
    preset_file = folder / index["budgets"][-1]["preset"]
    cfg = C.load_config(two["config"], overrides={"tiers": [str(preset_file)]})
    assert C.load_preset(cfg["tiers"][0], cfg)["model"] == trained_preset(folder, index["budgets"][-1]["trial"])["model"]
    song = next((ws["root"] / "data" / "prepared" / "synthetic" / "8000" / "test").glob("*/mixture.wav"))
    shutil.copy(song, tmp_path / "song.wav")
    out = tmp_path / "separated"
    done = subprocess.run([sys.executable, "-m", "tiersep.cli", "separate", "--config", str(two["config"]),
                           "--model", str(folder / "trials" / str(best) / "model.pt"), "--device", "cpu",
                           str(tmp_path / "song.wav"), "--out", str(out)],
                          capture_output=True, text=True, cwd=REPO, env=env(), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    import soundfile as sf

    stems = trained_preset(folder, best)["model"]["sources"]
    written = {p.stem for p in (out / "song").glob("*.wav")}
    assert written == set(stems), written
    assert sf.info(str(out / "song" / f"{stems[0]}.wav")).frames > 0


# ---- the report ---------------------------------------------------------------------------------
def render_with(tmp_path: Path, study_folder: Path) -> tuple[Path, str, str]:
    from tiersep.report import render

    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    shutil.copytree(study_folder, results / "search" / "search")
    out = tmp_path / "report"
    render(fixture_config(results), results, out)
    return out, (out / "index.html").read_text(), (out / "report.md").read_text()


def table_rows(page: str, table_id: str) -> dict[str, list[str]]:
    table = page.split(f'<table id="{table_id}">', 1)[1].split("</table>", 1)[0]
    return {html.unescape(key): cells(row) for key, row in
            re.findall(r'<tr data-tier="([^"]+)"[^>]*>(.*?)</tr>', table, re.S)}


def test_the_search_section_shows_states_reasons_plots_and_what_packing_saved(one, tmp_path):
    from PIL import Image

    from tiersep.report.plots import PLOTS, SEARCH_PLOTS

    out, page, md = render_with(tmp_path, one["folder"])
    rows = trials_csv(one["folder"])
    shown = table_rows(page, "search-trials")
    assert list(shown) == [r["number"] for r in rows]
    for row in rows:
        text = shown[row["number"]]
        assert row["state"] in text and row["reason"] in text, (row, text)
        assert re.search(rf'<tr data-tier="{row["number"]}" data-status="{row["state"].lower()}">', page), row
    assert "pruned at step 4" in shown["2"] and any(c.startswith("does not fit: booked") for c in shown["3"])
    assert shown["3"][-1] == "—"   # an infeasible trial ran for no time at all
    # the packing figure, from the trials' start and end: the three that ran, one at a time here
    spans = [(datetime.fromisoformat(r["started"]), datetime.fromisoformat(r["ended"]))
             for r in rows if r["state"] != "INFEASIBLE"]
    packing = re.search(r'<p class="note" id="search-packing">(.*?)</p>', page, re.S).group(1)
    assert packing.startswith("3 trials ran") and "1.00 trials side by side" in packing, packing
    assert all(s2 >= e1 for (_s1, e1), (s2, _e2) in zip(spans, spans[1:]))   # parallel: 1
    # one objective: no Pareto front; every budget's best is the best trial, evaluated on test
    assert "No Pareto front: the study has one objective" in page
    budgets = table_rows(page, "search-budgets")
    best = json.loads((one["folder"] / "best.json").read_text())["best"]
    scores = json.loads((one["folder"] / "eval" / str(best["trial"]) / "scores.json").read_text())
    assert len(budgets) == 8 and all(r[1] == str(best["trial"]) for r in budgets.values())   # r[0]: the budget
    assert all(f"{scores['overall']['si_sdr']:.2f}" in r[4] for r in budgets.values())
    # the three figures: written, embedded in the section, linked from report.md with their captions
    section = page.split('<h2 id="search-section">', 1)[1].split("<h2", 1)[0]
    images = re.findall(r'<img src="data:image/png;base64,([^"]+)" alt="([^"]+)"', section)
    assert [alt for _data, alt in images] == [title for _stem, title in SEARCH_PLOTS]
    for (data, _alt), (stem, title) in zip(images, SEARCH_PLOTS):
        assert base64.b64decode(data) == (out / f"{stem}.png").read_bytes()
        assert Image.open(stdio.BytesIO(base64.b64decode(data))).width > 300
        assert f"![{title}]({stem}.png)" in md
    assert len(re.findall(r"<img ", page)) == len(PLOTS) + len(SEARCH_PLOTS)
    assert "## Search" in md and "| 2 | 1e-09 | 2 | 400 | PRUNED | pruned at step 4 |" in md


def test_the_search_plots_draw_what_trials_csv_holds(one):
    """The timeline and the history are drawn from trials.csv: a pruned bar, an infeasible cross."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    from tiersep.report import plots
    from tiersep.report.search import read_trials

    _fields, trials = read_trials(one["folder"] / "trials.csv")
    drawn = {}
    original = plots._png

    def keep(fig):   # look at the figure before it becomes bytes
        ax = fig.axes[0]
        drawn[ax.get_title()] = ax
        return original(fig)

    plots._png = keep
    try:
        from tiersep.report.search import Study

        study = Study("search", one["folder"], _fields, trials)
        plots.make_search_plots(study)
    finally:
        plots._png = original
    timeline = next(ax for title, ax in drawn.items() if title.startswith("Timeline"))
    bars = [p for p in timeline.patches if p.get_width() > 0]
    assert len(bars) == 3   # the three trials that ran; the infeasible one is a marker
    colors = sorted(matplotlib.colors.to_hex(b.get_facecolor()) for b in bars)
    assert colors == sorted([plots.STATE_COLORS["COMPLETE"]] * 2 + [plots.STATE_COLORS["PRUNED"]])
    assert any(t.get_text() == "pruned at step 4" for t in timeline.texts)
    crosses = [line for line in timeline.lines if line.get_marker() == "x"]
    assert len(crosses) == 1 and list(crosses[0].get_ydata()) == [3]
    history = next(ax for title, ax in drawn.items() if title.startswith("Optimisation history"))
    assert len(history.collections) == 2   # the two COMPLETE trials with a score


def test_the_search_section_in_headless_chromium(two, tmp_path):
    """The report with a two-objective study opened in Debian's chromium at 1300 px: the Search
    section's tables fit the window, its plots decode, no console error, nothing fetched."""
    from tiersep.report.plots import PLOTS, SEARCH_PLOTS

    binary = shutil.which("chromium")
    if binary is None:
        pytest.skip("chromium is not installed (Debian: apt-get install -y chromium)")
    out, page, _md = render_with(tmp_path, two["folder"])
    pareto = table_rows(page, "search-pareto")
    assert sorted(pareto, key=int) == sorted(p.stem for p in (two["folder"] / "pareto").glob("*.yaml"))
    check = """(async () => {
      const images = [...document.images];
      await Promise.all(images.map(i => i.decode().catch(() => null)));
      return {
        images: images.map(i => ({alt: i.alt, complete: i.complete, width: i.naturalWidth,
                                  shown: i.getBoundingClientRect().width})),
        states: [...document.querySelectorAll('#search-trials tbody tr')].map(r => r.dataset.status),
        budgets: document.querySelectorAll('#search-budgets tbody tr').length,
        tables: [...document.querySelectorAll('table')].map(t => ({
          id: t.id, right: t.getBoundingClientRect().right,
          wrapperScroll: t.parentElement.scrollWidth, wrapperClient: t.parentElement.clientWidth})),
        pageWidth: document.documentElement.scrollWidth,
      };
    })()"""
    browser = Chromium(binary, tmp_path / "profile")
    try:
        session = browser.open_page((out / "index.html").as_uri(), WIDTH)
        state = browser.send("Runtime.evaluate", {"expression": check, "awaitPromise": True,
                                                  "returnByValue": True}, session=session)["result"]["value"]
    finally:
        browser.close()
    assert state["states"] == [r["state"].lower() for r in trials_csv(two["folder"])]
    assert state["budgets"] == 2 and state["pageWidth"] <= WIDTH
    for table in state["tables"]:
        assert table["right"] <= WIDTH and table["wrapperScroll"] <= table["wrapperClient"], table
    assert len(state["images"]) == len(PLOTS) + len(SEARCH_PLOTS)
    for image in state["images"]:
        assert image["complete"] and image["width"] > 300 and image["shown"] > 300, image
    errors = [e for e in browser.events if e["method"] == "Runtime.exceptionThrown"
              or e["params"].get("type") == "error" or e["params"].get("entry", {}).get("level") == "error"]
    assert not errors, errors
    fetched = [e["params"]["request"]["url"] for e in browser.events if e["method"] == "Network.requestWillBeSent"]
    assert all(url.startswith(("data:", "file:")) for url in fetched), fetched


def test_a_trials_csv_the_search_cannot_have_written_is_a_failure_row_not_a_section(tmp_path):
    study = tmp_path / "study"
    study.mkdir()
    (study / "trials.csv").write_text("number,state\n0,EXPLODED\n")
    _out, page, md = render_with(tmp_path, study)
    assert 'id="search-section"' not in page and "## Search" not in md
    assert "trials.csv: line 2: number '0' / state 'EXPLODED' is not a trial of tiersep search" in html.unescape(page)
