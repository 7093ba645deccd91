"""Search: the config's study (results/search/<study>/, tiersep.report.search), when there is one.

The trials table with each trial's state and one-line reason; the best trial for each GPU budget and
the Pareto front (best.json) with their test-set scores; and what running trials side by side saved.
The section's figures (history, Pareto front, timeline) are drawn by tiersep.report.plots.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tiersep.report.search import Study, Trial
from tiersep.report.sections.table import Cell, Column, Table, make_table
from tiersep.report.units import MISSING, format_db, format_duration, format_int

GIB = 2**30


@dataclass
class SearchSection:
    name: str
    folder: str
    summary: str
    trials: Table
    budgets: Table
    pareto: Table
    packing: str
    figures: list = field(default_factory=list)   # tiersep.report.page.Figure, set by build_page


def _gib(value: float | None) -> str:
    return MISSING if value is None else f"{value:.3f} GiB"


def _state(trial: Trial) -> Cell:
    return Cell(trial.state, badge=f"status status-{trial.state.lower()}")


def trials_table(study: Study) -> Table:
    columns = [Column("Sampled", field, lambda t, f=field: t.params.get(f) or MISSING, numeric=False)
               for field in study.fields]
    columns += [
        Column("Outcome", "State", _state, numeric=False),
        Column("Outcome", "Reason", lambda t: Cell(t.reason or MISSING, css="message"), numeric=False),
        Column("Outcome", "Levers (repaired)", lambda t: Cell(t.levers or MISSING, css="wrap"), numeric=False,
               optional=True),
        Column("Memory", "Booked", lambda t: _gib(t.booking_gib)),
        Column("Memory", "Measured peak", lambda t: _gib(t.measured_peak_gib)),
        Column("Training", "Steps", lambda t: format_int(t.steps)),
        Column("Training", "Val SI-SDR", lambda t: format_db(t.si_sdr)),
        Column("Training", "Time", lambda t: format_duration(t.seconds) if t.ran else MISSING),
    ]
    return make_table("search-trials", "Trial", columns, study.trials, key=lambda t: str(t.number),
                      status=lambda t: t.state.lower(), split_markdown=False,
                      empty="The study has no trial yet.")


def _test(study: Study, trial) -> str:
    if trial is None:
        return MISSING
    return format_db(study.test_si_sdr(trial))


def budgets_table(study: Study) -> Table:
    index = study.index or {}
    columns = [
        Column("", "Trial", lambda b: MISSING if b.get("trial") is None else str(b["trial"])),
        Column("", "Val SI-SDR", lambda b: format_db(b.get("si_sdr"))),
        Column("", "Booked", lambda b: _gib(b.get("booking_gib"))),
        Column("", "Test SI-SDR", lambda b: _test(study, b.get("trial"))),
        Column("", "Preset", lambda b: Cell(b.get("preset") or b.get("reason") or MISSING, css="wrap"),
               numeric=False),
    ]
    table = make_table("search-budgets", "GPU budget", columns, index.get("budgets") or [], key=lambda b: b["label"],
                       split_markdown=False, empty="No best.json yet: it is written when the study ends.")
    if index.get("device") == "cpu":
        table.notes.append("This study ran on a CPU: its bookings are the predicted RSS of the train process, "
                           "compared here with the GPU budgets as they are.")
    return table


def pareto_table(study: Study) -> Table:
    index = study.index or {}
    columns = [
        Column("", "Val SI-SDR", lambda p: format_db(p.get("si_sdr"))),
        Column("", "Booked", lambda p: _gib(p.get("booking_gib"))),
        Column("", "Test SI-SDR", lambda p: _test(study, p.get("trial"))),
        Column("", "Preset", lambda p: Cell(p.get("preset") or MISSING, css="wrap"), numeric=False),
    ]
    two = len(index.get("objectives") or []) == 2
    return make_table("search-pareto", "Trial", columns, index.get("pareto") or [], key=lambda p: str(p["trial"]),
                      split_markdown=False,
                      empty="No Pareto front: the study has one objective (search.objectives: [si_sdr, predicted_peak] "
                            "gives two)." if not two else "No feasible trial has completed yet.")


def packing_text(study: Study) -> str:
    packed = study.packing()
    if packed is None:
        return "No trial ran a process yet."
    run, wall, n = packed
    side = run / wall if wall > 0 else 1.0
    saved = max(0.0, run - wall)
    return (f"{n} trials ran {format_duration(run)} of trial time in {format_duration(wall)} of wall time "
            f"(the time during which at least one ran): {side:.2f} trials side by side on average. One after "
            f"another they would have taken {format_duration(run)}; running them side by side saved "
            f"{format_duration(saved)} ({saved / run:.0%}). From each trial's start and end in trials.csv; "
            "infeasible trials ran nothing and count 0.")


def search_section(study: Study | None) -> SearchSection | None:
    if study is None:
        return None
    counts = ", ".join(f"{n} {state}" for state, n in study.counts().items())
    index = study.index or {}
    objectives = " and ".join(index.get("objectives") or []) or "see search.objectives"
    best = index.get("best")
    summary = (f"Study {study.name}: {len(study.trials)} trials ({counts or 'none yet'}); objectives: {objectives}."
               + (f" Best trial: {best['trial']}, validation SI-SDR {format_db(best['si_sdr'])}, test SI-SDR "
                  f"{_test(study, best['trial'])}, preset {study.folder}/best.yaml." if best else ""))
    return SearchSection(study.name, str(study.folder), summary, trials_table(study), budgets_table(study),
                         pareto_table(study), packing_text(study))
