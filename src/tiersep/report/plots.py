"""The report's figures, drawn with matplotlib's Agg backend into PNG bytes.

Every plot always exists (a short 'no data yet' figure when nothing can be drawn), so the set of
files the report writes is fixed and a workflow can declare them as outputs.
"""
from __future__ import annotations

import io
import math

import numpy as np

from tiersep.report import memory
from tiersep.report.collect import BREAKDOWN_KEYS, Tier
from tiersep.report.units import format_bytes

# (file stem, title) of every plot, in the order the report shows them.
PLOTS = (
    ("memory_estimate_vs_measured", "Estimated vs measured peak memory"),
    ("memory_breakdown", "What each estimate is made of"),
    ("quality_vs_memory", "Quality vs peak memory"),
    ("training_curves", "Training and validation curves"),
    ("memory_over_steps", "Memory over training steps"),
    ("stem_si_sdr", "SI-SDR per stem over the test tracks"),
)
# The Search section's figures (tiersep.report.sections.search), written whether or not a study exists.
SEARCH_PLOTS = (
    ("search_history", "Search: optimisation history"),
    ("search_pareto", "Search: validation SI-SDR against predicted peak, with the GPU budgets"),
    ("search_timeline", "Search: when each trial ran, and how it ended"),
)
STATE_COLORS = {"COMPLETE": "#59a14f", "PRUNED": "#f28e2b", "INFEASIBLE": "#e15759", "FAIL": "#7a1f1f",
                "RUNNING": "#4e79a7", "WAITING": "#bab0ac"}
DPI = 100
# text.parse_math off: tier names are folder names, and one holding '$' (e.g. 'a$\frac$b') is
# mathtext to matplotlib, which fails to parse it and would stop the whole report.
STYLE = {"font.size": 9, "axes.titlesize": 10, "axes.grid": True, "grid.alpha": 0.3, "figure.dpi": DPI,
         "text.parse_math": False}
BREAKDOWN_COLORS = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#bab0ac")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)  # no display, no GUI toolkit, same pixels everywhere
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    buffer = io.BytesIO()
    # No 'Software' metadata: the bytes depend on the data only (and there is no URL in the file).
    fig.savefig(buffer, format="png", dpi=DPI, metadata={"Software": None}, bbox_inches="tight")
    _pyplot().close(fig)
    return buffer.getvalue()


def _empty(title: str, why: str) -> bytes:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 1.6))
    ax.axis("off")
    ax.set_title(title)
    ax.text(0.5, 0.4, why, ha="center", va="center", fontsize=10, color="#555555", transform=ax.transAxes)
    return _png(fig)


def tier_colors(tiers: list[Tier]) -> dict[str, str]:
    """One colour per tier, the same in every plot."""
    import matplotlib

    cmap = matplotlib.colormaps["tab10" if len(tiers) <= 10 else "tab20"]
    return {t.name: matplotlib.colors.to_hex(cmap(i % cmap.N)) for i, t in enumerate(tiers)}


def _bytes_axis(axis, values: list[float]) -> None:
    """Log-scaled byte axis with ticks at powers of two, labelled in KiB/MiB/GiB."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    low, high = max(min(values), 1.0), max(max(values), 2.0)
    lo_exp, hi_exp = math.floor(math.log2(low)), math.ceil(math.log2(high))
    step = max(1, math.ceil((hi_exp - lo_exp) / 8))  # at most about 8 labelled ticks
    ticks = [2.0**e for e in range(lo_exp, hi_exp + 1, step)]
    axis.set_major_locator(FixedLocator(ticks))
    axis.set_minor_locator(NullLocator())
    axis.set_major_formatter(FuncFormatter(lambda v, _pos: format_bytes(v, digits=0)))


def _memory_pair(tier: Tier) -> tuple[float | None, float | None, bool]:
    """(estimate, measurement, comparable) of the tier's headline quantity: CUDA device use, CPU
    process RSS (the gate's booking vs the peak RSS); the estimate record's peak where the tier did
    not train, or trained on another device than any estimate was made for."""
    comparison = memory.headline(tier)
    if comparison is not None:
        return comparison.estimated, comparison.measured, True
    return tier.estimated_peak, memory.measured_peak(tier)[0], tier.run is None


def plot_memory(tiers: list[Tier], budget: float | None) -> bytes:
    title = "Estimated vs measured peak memory"
    pairs = {t.name: _memory_pair(t) for t in tiers}
    shown = [t for t in tiers if pairs[t.name][0] or pairs[t.name][1] or t.failure]
    if not shown:
        return _empty(title, "No estimate and no measurement yet.")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(7.0, 0.8 * len(shown) + 1.5), 4.6))
    x = np.arange(len(shown))
    width = 0.36
    values: list[float] = []
    for i, tier in enumerate(shown):
        estimated, measured, comparable = pairs[tier.name]
        hatch = None if comparable else "//"  # measured on another device than estimated for
        for offset, value, color in ((-width / 2, estimated, "#4e79a7"), (width / 2, measured, "#f28e2b")):
            if value:
                ax.bar(x[i] + offset, value, width, color=color, hatch=hatch, edgecolor="#444444", linewidth=0.5)
                values.append(value)
        failed = tier.failure
        if failed and failed.get("attempted_allocation_bytes"):
            attempted = float(failed["attempted_allocation_bytes"])
            ax.plot(x[i], attempted, marker="x", color="#e15759", markersize=9, mew=2)
            values.append(attempted)
        label = {"refused": "refused", "failed": "failed"}.get(tier.status)
        if label:
            top = max([v for v in (estimated, measured) if v] or [1.0])
            ax.annotate(label, (x[i], top), xytext=(0, 4), textcoords="offset points", ha="center",
                        fontsize=8, color="#e15759", fontweight="bold")
    if budget:
        ax.axhline(budget, color="#e15759", linestyle="--", linewidth=1)
        values.append(budget)
    ax.set_yscale("log")
    _bytes_axis(ax.yaxis, values)
    labels = [f"{t.name}\n{t.measured_device_type or 'not run'}" for t in shown]
    ax.set_xticks(x, labels, rotation=30, ha="right", fontsize=8)
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color="#4e79a7", label="estimate (CUDA: device use; CPU: gate's booking)"),
                       Patch(color="#f28e2b", label="measured (CUDA: device use; CPU: peak RSS)"),
                       Patch(facecolor="white", edgecolor="#444444", hatch="//",
                             label="no estimate for the device it trained on"),
                       Line2D([], [], color="#e15759", marker="x", linestyle="", mew=2,
                              label="allocation that failed (OOM)")]
              + ([Line2D([], [], color="#e15759", linestyle="--", linewidth=1,
                         label=f"budget {format_bytes(budget)}")] if budget else []),
              fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.set_ylabel("bytes (log scale)")
    ax.set_title(title)
    return _png(fig)


def plot_breakdown(tiers: list[Tier]) -> bytes:
    title = "What each estimate is made of (share of the estimated peak)"
    shown = [t for t in tiers if t.estimate and isinstance(t.estimate.get("breakdown"), dict)]
    if not shown:
        return _empty(title, "No estimate with a breakdown yet.")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8.5, 0.42 * len(shown) + 1.4))
    y = np.arange(len(shown))[::-1]
    for i, tier in enumerate(shown):
        parts = [float(tier.estimate["breakdown"].get(k) or 0.0) for k in BREAKDOWN_KEYS]
        total = sum(parts) or 1.0
        left = 0.0
        for part, key, color in zip(parts, BREAKDOWN_KEYS, BREAKDOWN_COLORS):
            ax.barh(y[i], part / total, left=left, color=color, label=key if i == 0 else None)
            left += part / total
        ax.annotate(format_bytes(tier.estimated_peak or total), (1.0, y[i]), xytext=(4, 0),
                    textcoords="offset points", va="center", fontsize=8)
    ax.set_yticks(y, [t.name for t in shown])
    ax.set_xlim(0, 1)
    ax.xaxis.set_major_formatter(lambda v, _pos: f"{v:.0%}")
    ax.legend(ncols=6, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), frameon=False)
    ax.set_title(title)
    return _png(fig)


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both lower memory and higher quality."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1]))
    front, best = [], -math.inf
    for i in order:
        if points[i][1] > best:
            front.append(i)
            best = points[i][1]
    return front


def _quality_x_axis(ax, xs: list[float]) -> None:
    """Peak memory across: log-scaled with power-of-two ticks over a wide range, linear with about
    five labelled ticks over a narrow one (two CPU tiers a few percent apart got a single tick)."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    low, high = min(xs), max(xs)
    if high / low >= 4:
        ax.set_xscale("log")
        _bytes_axis(ax.xaxis, [low / 1.5, high * 1.5])
        ax.set_xlim(low / 1.5, high * 1.5)
        ax.set_xlabel("peak memory (log scale)")
        return
    pad = max((high - low) * 0.25, high * 0.05)
    ax.set_xlim(max(low - pad, 0), high + pad)
    ax.xaxis.set_major_locator(MaxNLocator(5))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: format_bytes(v)))
    ax.set_xlabel("peak memory")


def plot_quality(tiers: list[Tier], colors: dict[str, str]) -> bytes:
    """SI-SDR improvement over the mixture against peak memory. The improvement, not the raw SI-SDR:
    the mixture's level is then 0, a baseline that sits beside the points instead of stretching the
    axis far below them."""
    title = "Quality vs peak memory (Pareto view: up and left is better)"
    peaks = {t.name: memory.measured_peak(t)[0] for t in tiers}
    gains = {t.name: t.overall("si_sdr_improvement") for t in tiers}
    shown = [t for t in tiers if gains[t.name] is not None and (peaks[t.name] or t.estimated_peak)]
    if not shown:
        return _empty(title, "No evaluated tier yet.")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.6))
    points = []
    for tier in shown:
        measured = peaks[tier.name] is not None
        x = peaks[tier.name] if measured else tier.estimated_peak
        y = gains[tier.name]
        points.append((x, y))
        marker = ("s" if tier.measured_device_type == "cpu" else "o") if measured else "D"
        ax.scatter([x], [y], s=60, marker=marker, color=colors[tier.name],
                   facecolors=colors[tier.name] if measured else "none", zorder=3)
        ax.annotate(f"{tier.name}\n{y:+.1f} dB, {format_bytes(x)}", (x, y), xytext=(6, 4),
                    textcoords="offset points", fontsize=8)
    front = pareto_front(points)
    fx, fy = zip(*[points[i] for i in front])
    ax.step(fx, fy, where="post", color="#888888", linestyle="--", linewidth=1, zorder=1,
            label="Pareto front")
    ax.axhline(0.0, color="#bbbbbb", linestyle=":", label="the mixture (no separation)")
    ys = [p[1] for p in points] + [0.0]
    span = max(ys) - min(ys) or 1.0
    ax.set_ylim(min(ys) - 0.15 * span, max(ys) + 0.3 * span)   # room above for the labels
    _quality_x_axis(ax, [p[0] for p in points])
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], marker="o", linestyle="", color="#555555", label="measured on CUDA (device use)"),
               Line2D([], [], marker="s", linestyle="", color="#555555", label="measured on CPU (peak RSS)"),
               Line2D([], [], marker="D", linestyle="", color="#555555", markerfacecolor="none",
                      label="estimate (not measured)")]
    handles += ax.get_legend_handles_labels()[0]
    ax.legend(handles=handles, fontsize=7, loc="lower right")
    ax.set_ylabel("SI-SDR improvement over the mixture,\nmean of stems (dB)")
    ax.set_title(title)
    return _png(fig)


def _series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    pairs = [(r["step"], r[key]) for r in rows
             if r.get("step") is not None and r.get(key) is not None and math.isfinite(r[key])]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def plot_curves(tiers: list[Tier], colors: dict[str, str]) -> bytes:
    title = "Training and validation curves"
    shown = [t for t in tiers if t.metrics]
    if not shown:
        return _empty(title, "No metrics.csv yet.")
    plt = _pyplot()
    fig, (loss_ax, val_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    validation = dict(marker="o", markersize=3)
    ema = dict(linestyle="-.", marker="s", markersize=3)    # train.ema: the EMA weights' validation
    curves = [  # (metrics.csv column, axis, label after the tier's name, line style)
        ("loss", loss_ax, "train", dict(linewidth=0.8, alpha=0.85)),
        ("val_loss", loss_ax, "valid", dict(validation, linestyle="--")),
        ("val_si_sdr", val_ax, "SI-SDR", validation),
        ("val_sdr", val_ax, "SDR", dict(linestyle=":", marker="^", markersize=3)),
        ("val_loss_ema", loss_ax, "valid, EMA", ema),
        ("val_si_sdr_ema", val_ax, "SI-SDR, EMA", ema),
    ]
    for tier in shown:
        for column, ax, label, style in curves:
            steps, values = _series(tier.metrics, column)
            if steps:
                ax.plot(steps, values, color=colors[tier.name], label=f"{tier.name} {label}", **style)
    loss_ax.set_xlabel("step")
    loss_ax.set_ylabel("loss")
    loss_ax.set_title("loss: training (solid), validation (dashed; EMA weights dash-dot)")
    val_ax.set_xlabel("step")
    val_ax.set_ylabel("dB")
    val_ax.set_title("validation SI-SDR (solid; EMA weights dash-dot) and SDR (dotted)")
    for ax in (loss_ax, val_ax):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(title)
    return _png(fig)


def plot_memory_steps(tiers: list[Tier], colors: dict[str, str]) -> bytes:
    title = "Memory over training steps"
    shown = [t for t in tiers if t.memory]
    if not shown:
        return _empty(title, "No memory.csv yet.")
    plt = _pyplot()
    devices = sorted({t.measured_device_type or "unknown" for t in shown})
    fig, axes = plt.subplots(1, len(devices), figsize=(5.5 * len(devices) + 0.5, 4.0), squeeze=False)
    for ax, device in zip(axes[0], devices):
        on_device = [t for t in shown if (t.measured_device_type or "unknown") == device]
        largest = max(max(_series(t.memory, "reserved")[1] + _series(t.memory, "allocated")[1] or [0.0])
                      for t in on_device)
        unit, scale = ("GiB", 2.0**30) if largest >= 2**30 else ("MiB", 2.0**20)  # plain ticks in one unit
        for tier in on_device:
            color = colors[tier.name]
            steps, allocated = _series(tier.memory, "allocated")
            label = f"{tier.name} RSS" if device == "cpu" else f"{tier.name} allocated"
            ax.plot(steps, [v / scale for v in allocated], color=color, label=label)
            steps_r, reserved = _series(tier.memory, "reserved")
            if reserved != allocated:  # CPU rows repeat RSS in both columns: draw it once
                ax.plot(steps_r, [v / scale for v in reserved], color=color, linestyle="--",
                        label=f"{tier.name} reserved")
            # the estimate of what the lines show: the allocator's reserved peak, or the RSS booked
            quantity = "reserved" if device == "cuda" else "process RSS"
            line = next((c.estimated for c in memory.comparisons(tier) if c.quantity == quantity), None)
            if line:
                ax.axhline(line / scale, color=color, linestyle=":", linewidth=1,
                           label=f"{tier.name} estimated {quantity}")
        what = "resident set size (allocated = reserved = RSS)" if device == "cpu" else \
            "allocated (solid), reserved (dashed)"
        ax.set_title(f"measured on {device}: {what}", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel(unit)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    return _png(fig)


def plot_stems(tiers: list[Tier], colors: dict[str, str]) -> bytes:
    title = "SI-SDR per stem over the test tracks (box: quartiles; dots: tracks)"
    shown = [t for t in tiers if t.scores and t.scores.get("per_track")]
    if not shown:
        return _empty(title, "No evaluated tier yet.")
    plt = _pyplot()
    stems = list(shown[0].scores.get("sources") or next(iter(shown[0].scores["per_track"].values())))
    fig, ax = plt.subplots(figsize=(max(8.0, 1.2 * len(stems) * len(shown) / 2 + 3), 4.4))
    rng = np.random.default_rng(0)  # fixed jitter: the same results draw the same picture
    width = 0.8 / len(shown)
    for j, tier in enumerate(shown):
        positions, data = [], []
        for s, stem in enumerate(stems):
            values = [float(track[stem]["si_sdr"]) for track in tier.scores["per_track"].values()
                      if stem in track and track[stem].get("si_sdr") is not None
                      and math.isfinite(float(track[stem]["si_sdr"]))]
            if not values:
                continue
            pos = s - 0.4 + width * (j + 0.5)
            positions.append(pos)
            data.append(values)
            ax.scatter(pos + rng.uniform(-width / 4, width / 4, len(values)), values, s=12,
                       color=colors[tier.name], edgecolors="white", linewidths=0.4, zorder=3)
        if data:
            box = ax.boxplot(data, positions=positions, widths=width * 0.8, patch_artist=True,
                             showfliers=False, manage_ticks=False)
            for patch in box["boxes"]:
                patch.set(facecolor=colors[tier.name], alpha=0.35, edgecolor=colors[tier.name])
            for median in box["medians"]:
                median.set(color=colors[tier.name], linewidth=1.5)
        ax.plot([], [], color=colors[tier.name], marker="s", linestyle="", label=tier.name)
    ax.set_xticks(range(len(stems)), stems)
    ax.set_ylabel("SI-SDR (dB)")
    ax.axhline(0, color="#999999", linewidth=0.8)
    ax.legend(fontsize=7, ncols=min(4, len(shown)))
    ax.set_title(title)
    return _png(fig)


def make_plots(tiers: list[Tier], budget: float | None) -> dict[str, bytes]:
    """{plot file stem: PNG bytes} for every plot in PLOTS."""
    colors = tier_colors(tiers)
    drawn = {
        "memory_estimate_vs_measured": lambda: plot_memory(tiers, budget),
        "memory_breakdown": lambda: plot_breakdown(tiers),
        "quality_vs_memory": lambda: plot_quality(tiers, colors),
        "training_curves": lambda: plot_curves(tiers, colors),
        "memory_over_steps": lambda: plot_memory_steps(tiers, colors),
        "stem_si_sdr": lambda: plot_stems(tiers, colors),
    }
    with _pyplot().rc_context(STYLE):  # the report's style, without changing the process's defaults
        return {name: drawn[name]() for name, _title in PLOTS}


# ---- the Search section ------------------------------------------------------------------------
def _state_handles(states) -> list:
    from matplotlib.patches import Patch

    return [Patch(color=STATE_COLORS[s], label=s) for s in STATE_COLORS if s in states]


def _rug(ax, trials, x) -> None:
    """Trials without a validation SI-SDR (pruned, infeasible, failed) as marks under the axis."""
    for trial in trials:
        if trial.si_sdr is None:
            ax.plot([x(trial)], [0.04], transform=ax.get_xaxis_transform(), marker="x" if trial.state ==
                    "INFEASIBLE" else "v", color=STATE_COLORS.get(trial.state, "#555555"), markersize=7, mew=1.6,
                    linestyle="", clip_on=False)


def plot_search_history(study) -> bytes:
    title = "Optimisation history: validation SI-SDR per trial, and the best so far"
    if study is None or not study.trials:
        return _empty(title, "No search study yet.")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.2))
    scored = [t for t in study.trials if t.si_sdr is not None]
    for t in scored:
        ax.scatter([t.number], [t.si_sdr], s=30, color=STATE_COLORS["COMPLETE"], zorder=3)
    best, xs, ys = -math.inf, [], []
    for t in sorted(scored, key=lambda t: t.number):
        best = max(best, t.si_sdr)
        xs.append(t.number)
        ys.append(best)
    if xs:
        ax.step(xs + [max(t.number for t in study.trials)], ys + [ys[-1]], where="post", color="#333333",
                linewidth=1, label="best so far")
    else:
        ax.text(0.5, 0.5, "no trial has completed with a score yet", transform=ax.transAxes, ha="center",
                color="#555555")
    _rug(ax, study.trials, lambda t: t.number)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(handles=ax.get_legend_handles_labels()[0] + _state_handles({t.state for t in study.trials}),
              fontsize=7, loc="lower right")
    ax.set_xlabel("trial")
    ax.set_ylabel("validation SI-SDR (dB)")
    ax.set_title(title)
    return _png(fig)


def plot_search_pareto(study) -> bytes:
    title = "Validation SI-SDR against predicted peak (the gate's booking): up and left is better"
    shown = [t for t in (study.trials if study else []) if t.booking_gib is not None]
    if not shown:
        return _empty(title, "No search study yet.")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.6))
    index = study.index or {}
    front = {p["trial"] for p in index.get("pareto") or []}
    for t in shown:
        if t.si_sdr is not None:
            on = t.number in front
            ax.scatter([t.booking_gib], [t.si_sdr], s=60 if on else 30, zorder=3, color=STATE_COLORS["COMPLETE"],
                       edgecolors="#222222" if on else "none")
            ax.annotate(str(t.number), (t.booking_gib, t.si_sdr), xytext=(5, 3), textcoords="offset points",
                        fontsize=7)
    line = sorted((t.booking_gib, t.si_sdr) for t in shown if t.number in front)
    if line:
        ax.step(*zip(*line), where="post", color="#888888", linestyle="--", linewidth=1, label="Pareto front")
    _rug(ax, shown, lambda t: t.booking_gib)
    margin = float(index.get("safety_margin") or 0.0)
    xs = [t.booking_gib for t in shown]
    for budget in index.get("budgets") or []:
        limit = budget["budget_gib"] * (1 - margin)   # the largest booking that fits it
        ax.axvline(limit, color="#4e79a7", linestyle=":", linewidth=1)
        ax.annotate(budget["label"], (limit, 1.0), xycoords=ax.get_xaxis_transform(), rotation=90, fontsize=7,
                    ha="right", va="top", color="#4e79a7")
        xs.append(limit)
    if max(xs) / max(min(xs), 1e-9) > 4:   # GPU budgets far beyond the bookings (e.g. a CPU study)
        from matplotlib.ticker import FuncFormatter, NullFormatter

        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))   # no mathtext (STYLE)
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.plot([], [], color="#4e79a7", linestyle=":", label=f"GPU budget (largest booking that fits, {margin:.0%} kept free)")
    ax.plot([], [], marker="x", color=STATE_COLORS["INFEASIBLE"], linestyle="", label="infeasible (no process)")
    ax.plot([], [], marker="v", color=STATE_COLORS["PRUNED"], linestyle="", label="pruned or failed (no final score)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.set_xlabel("predicted peak, booked (GiB)")
    ax.set_ylabel("validation SI-SDR (dB)")
    ax.set_title(title)
    return _png(fig)


def plot_search_timeline(study) -> bytes:
    title = "Timeline: each trial from its start to its end, coloured by how it ended"
    timed = [t for t in (study.trials if study else []) if t.started is not None]
    if not timed:
        return _empty(title, "No search study yet.")
    plt = _pyplot()
    start = min(t.started for t in timed)
    fig, ax = plt.subplots(figsize=(8, 0.28 * len(timed) + 1.8))
    for t in timed:
        left = (t.started - start).total_seconds()
        color = STATE_COLORS.get(t.state, "#555555")
        if t.ran:
            ax.barh(t.number, t.duration, left=left, height=0.6, color=color)
            if t.state == "PRUNED":
                ax.annotate(t.reason, (left + t.duration, t.number), xytext=(3, 0), textcoords="offset points",
                            va="center", fontsize=7, color=color)
        else:   # infeasible (no process: 0 s) or still running
            ax.plot([left], [t.number], marker="x" if t.state == "INFEASIBLE" else ">", color=color, markersize=7,
                    mew=1.6, linestyle="")
    ax.invert_yaxis()
    ax.set_yticks([t.number for t in timed], [str(t.number) for t in timed], fontsize=7)
    ax.set_xlabel("seconds since the first trial started")
    ax.set_ylabel("trial")
    ax.legend(handles=_state_handles({t.state for t in timed}), fontsize=7, loc="upper left",
              bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.set_title(title)
    return _png(fig)


def make_search_plots(study) -> dict[str, bytes]:
    """{plot file stem: PNG bytes} for every plot in SEARCH_PLOTS (study: tiersep.report.search.Study
    or None)."""
    drawn = {"search_history": plot_search_history, "search_pareto": plot_search_pareto,
             "search_timeline": plot_search_timeline}
    with _pyplot().rc_context(STYLE):
        return {name: drawn[name](study) for name, _title in SEARCH_PLOTS}
