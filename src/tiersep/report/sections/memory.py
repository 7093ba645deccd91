"""Memory: every compared quantity of each trained tier (estimate beside measurement), and how each
tier ran (free memory at start, compile, allocator and malloc settings, the CUDA context)."""
from __future__ import annotations

from tiersep.report import memory
from tiersep.report.collect import Tier
from tiersep.report.sections.table import Cell, Column, Table, make_table
from tiersep.report.sections.tiers import NOT_COMPARABLE_NOTE, yes_no
from tiersep.report.units import MISSING, format_bytes, format_percent


def memory_table(tiers: list[Tier]) -> Table:
    """One row per compared quantity of every trained tier; a tier with nothing to compare says why."""
    rows = []
    for tier in tiers:
        if tier.run is None:
            continue
        _estimate, source = memory.comparable_estimate(tier)
        reason = memory.not_comparable(tier)
        if reason is not None:
            value, what = memory.measured_peak(tier)
            rows.append((tier, Cell(f"{what}: {reason}", css="na"), format_bytes(tier.estimated_peak),
                         format_bytes(value), Cell("not comparable †" if reason != "no estimate" else MISSING,
                                                   css="na", title=reason), MISSING))
            continue
        for c in memory.comparisons(tier):
            error = Cell(format_percent(c.error)) if c.error is not None else Cell(MISSING, css="na")
            rows.append((tier, Cell(c.quantity, title=f"estimate {c.estimated_as}; measured {c.measured_as}"),
                         format_bytes(c.estimated), format_bytes(c.measured), error, source))
    columns = [Column("", "Device", lambda r: r[0].measured_device_type or MISSING, numeric=False),
               Column("", "Compared", lambda r: r[1], numeric=False),
               Column("", "Estimated", lambda r: r[2]),
               Column("", "Measured", lambda r: r[3]),
               Column("", "Error", lambda r: r[4]),
               Column("", "Estimate from", lambda r: r[5], numeric=False)]
    table = make_table("memory", "Tier", columns, rows, key=lambda r: r[0].name, status=lambda r: r[0].status,
                       empty="No tier has trained yet.", split_markdown=False)
    table.notes = [
        "Error = estimate / measured − 1 (negative: the estimate was too low), only where the estimate "
        "was made for the device the tier trained on.",
        "CUDA — device use: estimate peak_bytes (caching allocator reserved peak + CUDA context) vs "
        "measured peak_device_bytes (device total − free, what nvidia-smi shows); allocated: "
        "allocated_peak_bytes vs torch.cuda.max_memory_allocated (live tensors); reserved: "
        "reserved_peak_bytes vs torch.cuda.max_memory_reserved.",
        "CPU — process RSS: what the fit gate books for the process before exit "
        "(cpu_process.run_rss_bytes: the booked process without the library pages touched only at "
        "interpreter exit) vs the measured peak resident set size before exit; live tensor bytes: estimate peak_bytes vs the tensor bytes "
        "the trainer counted (peak_allocated_bytes; not recorded by trainers that logged the RSS there).",
    ]
    if any(memory.not_comparable(t) not in (None, "no estimate") for t in tiers):
        table.notes.append(NOT_COMPARABLE_NOTE)
    return table


def _compile(run: dict) -> str:
    state = run.get("compile")
    if not isinstance(state, dict):
        return MISSING if "compiled" not in run else yes_no(run["compiled"])
    text = "compiled" if state.get("compiled") else "not compiled"
    details = [str(state[k]) for k in ("mode", "reason") if state.get(k)]
    if state.get("requested") is not None:
        details.insert(0, f"requested {state['requested']}")
    return text + (f" ({'; '.join(details)})" if details else "")


def _settings(value) -> str:
    if not isinstance(value, dict) or not value:
        return MISSING
    return ", ".join(f"{k}={v}" for k, v in value.items())


def malloc_cell(malloc) -> Cell:
    """The host malloc a CPU run used, in words; the gate's reason on hover (run.json `malloc`)."""
    if not isinstance(malloc, dict) or not malloc:
        return Cell(MISSING, css="na")
    if malloc.get("applied"):
        words = "tuned (mmap threshold set)"
    else:
        words = "glibc's own" if malloc.get("allocator") == "glibc" else str(malloc.get("allocator") or "default")
    if malloc.get("trim_heap"):
        words += ", heap trimmed per block"
    return Cell(words, title=str(malloc.get("reason") or ""))


def conditions_table(tiers: list[Tier]) -> Table:
    """How each trained tier ran: the free memory it started with (flagged when well below the
    run's best start), the process's own RSS at start (CPU), compile state, allocator and malloc
    settings, the measured CUDA context."""
    shortfalls = memory.start_shortfalls(tiers)
    trained = [t for t in tiers if t.run is not None or t.failure is not None]

    def start(tier: Tier) -> Cell:
        free = (tier.run or tier.failure or {}).get("start_free_bytes")
        if tier.name in shortfalls:
            return Cell(f"{format_bytes(free)} ⚑ {format_bytes(shortfalls[tier.name])} below the best start",
                        css="flag", title="started with more than 2% or 256 MiB less free memory than the best "
                                          "start of this run (another process or a leftover context held it)")
        return Cell(format_bytes(free))

    columns = [Column("", "Device", lambda t: t.measured_device or MISSING, numeric=False),
               Column("", "Free at start", start, numeric=False),
               Column("", "Process at start", lambda t: format_bytes((t.run or {}).get("start_rss_bytes")),
                      optional=True),  # CPU: the RSS before training, part of every RSS peak
               Column("", "Compile", lambda t: _compile(t.run or {}), numeric=False, optional=True),
               Column("", "Allocator", lambda t: _settings((t.run or {}).get("allocator")), numeric=False,
                      optional=True),
               Column("", "malloc", lambda t: malloc_cell((t.run or {}).get("malloc")), numeric=False, optional=True),
               Column("", "CUDA context", lambda t: format_bytes((t.run or {}).get("context_bytes")), optional=True)]
    return make_table("conditions", "Tier", columns, trained, key=lambda t: t.name, status=lambda t: t.status,
                      row_css=lambda t: "flagged" if t.name in shortfalls else "",
                      empty="No tier has run yet.", split_markdown=False)
