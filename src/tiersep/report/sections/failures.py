"""Failures and refusals: failed and refused tiers, an OOM a retry recovered from, presets that do
not load and records that cannot be read, each naming the file and field."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from tiersep.report.collect import Collected, Tier
from tiersep.report.sections.table import Cell, Column, Table, make_table
from tiersep.report.units import MISSING, format_bytes, format_int


@dataclass
class Failure:
    tier: Tier | None
    kind: str
    record: dict
    note: str = ""

    def value(self, key: str, fallback: Callable[[Tier], object] | None = None):
        """The failure record's `key`; for a training failure, else what the tier says."""
        value = self.record.get(key)
        if value is None and fallback is not None and self.tier is not None and "kind" in self.record:
            value = fallback(self.tier)
        return value


def failures(collected: Collected) -> list[Failure]:
    """Every failure, refusal, OOM a retry recovered from, preset that does not load and record
    that could not be read."""
    out = []
    for tier in collected.tiers:
        if tier.failure is not None:
            out.append(Failure(tier, tier.failure.get("kind", "error"), tier.failure))
        elif tier.earlier_failure is not None and tier.run is not None:
            out.append(Failure(tier, tier.earlier_failure.get("kind", "error"), tier.earlier_failure,
                               f" (recovered: attempt {tier.run.get('attempt')} succeeded)"))
        if tier.preset_error:
            out.append(Failure(tier, "preset error", {"message": tier.preset_error}))
        out += [Failure(tier, "invalid record", {"message": problem}) for problem in tier.problems]
    out += [Failure(None, "invalid record", {"message": p}) for p in collected.facts.get("problems", [])]
    return out


def failures_table(collected: Collected) -> Table:
    columns = [
        Column("", "Kind", lambda f: f.kind + f.note, numeric=False),
        Column("", "Reason", lambda f: Cell(str(f.record.get("message") or MISSING), css="message",
                                             title=str(f.record.get("full_message") or "")), numeric=False),
        Column("", "Attempt", lambda f: format_int(f.value("attempt"))),
        Column("", "Device", lambda f: str(f.value("device", lambda t: t.measured_device) or MISSING),
               numeric=False),
        Column("", "Micro-batch", lambda f: format_int(f.value("batch_size", lambda t: t.batch[0]))),
        Column("", "Attempted allocation", lambda f: format_bytes(f.value("attempted_allocation_bytes"))),
        Column("", "Predicted peak", lambda f: format_bytes(f.value("estimate_peak_bytes", lambda t: t.estimated_peak))),
        Column("", "Free at start", lambda f: format_bytes(f.value("start_free_bytes"))),
    ]
    return make_table("failures", "Tier", columns, failures(collected),
                      key=lambda f: f.tier.name if f.tier else "(run)",
                      status=lambda f: f.tier.status if f.tier else "invalid",
                      empty="No tier failed or was refused. Every record could be read.", split_markdown=False)
