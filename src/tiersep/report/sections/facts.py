"""Run facts: the config, the commit, the budget, devices, software versions and datasets."""
from __future__ import annotations

from tiersep.report.collect import Collected
from tiersep.report.sections.table import Column, Table, make_table
from tiersep.report.units import MISSING, format_bytes


def budget_bytes(collected: Collected) -> float | None:
    if collected.facts.get("budget_bytes"):
        return float(collected.facts["budget_bytes"])
    budgets = [t.estimate.get("budget_bytes") for t in collected.tiers if t.estimate]
    budgets = [b for b in budgets if b]
    return float(budgets[0]) if budgets else None


def fact_rows(collected: Collected) -> list[tuple[str, str]]:
    facts = collected.facts
    budget = budget_bytes(collected)
    settings = facts.get("estimate_settings") or {}
    return [("Config hash", facts["config_hash"]),
            ("Config file", str(facts.get("config_source") or MISSING)),
            ("Git commit", facts["git_commit"]),
            ("Results folder", facts["results_dir"]),
            ("Memory budget", f"{format_bytes(budget)} (budget_gib: {facts.get('budget_setting')})"
             if budget else f"none (budget_gib: {facts.get('budget_setting')})"),
            ("Estimates", ", ".join(f"{k} {v}" for k, v in settings.items()) or MISSING)]


def _text_columns(keys: list[str]) -> list[Column]:
    return [Column("", key, lambda r, key=key: r[key], numeric=False, optional=True) for key in keys]


def devices_table(collected: Collected) -> Table:
    rows = [{"tier": d["tier"], "Device": d["device"], "Host": d.get("host") or MISSING,
             "PID": str(d["pid"]) if d.get("pid") is not None else MISSING,   # an id, not a quantity
             "SLURM job": str(d.get("slurm_job_id") or MISSING),
             "Free at start": format_bytes(d.get("start_free_bytes"))} for d in collected.facts["devices"]]
    return make_table("devices", "Tier", _text_columns(["Device", "Host", "PID", "SLURM job", "Free at start"]),
                      rows, key=lambda r: r["tier"], empty="No tier has run yet.", split_markdown=False)


def versions_table(collected: Collected) -> Table:
    rows = [{"key": k, "Tiers": ", ".join(v)} for k, v in collected.facts["versions"].items()]
    return make_table("versions", "Versions", _text_columns(["Tiers"]), rows, key=lambda r: r["key"],
                      empty="No run.json with versions yet.", split_markdown=False)


def datasets_table(collected: Collected) -> Table:
    rows = [{"path": s["path"], "Source": str(s.get("source", MISSING)),
             "Rate": f"{s['sample_rate']} Hz" if s.get("sample_rate") else MISSING,
             "Stems": s.get("stems", MISSING), "Tracks": s.get("tracks", MISSING),
             "Skipped": str(s.get("skipped", 0))} for s in collected.facts["datasets"]]
    return make_table("datasets", "Manifest", _text_columns(["Source", "Rate", "Stems", "Tracks", "Skipped"]),
                      rows, key=lambda r: r["path"], empty="No prepared dataset manifest found.",
                      split_markdown=False)
